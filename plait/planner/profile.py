"""A hardware profile: what one machine measured (`plait bench calibrate`), for the planner to use in
place of data-sheet peaks and one efficiency constant (`plait plan --hardware FILE`).

What it holds, each as measured on the machine:
  linear      seconds of the matrix multiplies of nn.Linear: forward (x @ W^T), input gradient
              (dy @ W) and weight gradient (dy^T @ x), per (tokens, in, out) - the shapes of a
              transformer layer at the model's sizes and tp splits, and the output head
  attention   seconds of causal scaled-dot-product attention (the kernel plait's model calls),
              forward and backward, per (batch, seq, heads, kv heads, head dim)
  pointwise   bytes per second of a compiled memory-bound kernel (RMSNorm: read, write)
  optimizer   bytes per second of plait's fused AdamW update on flat fp32 state
  collectives seconds of all-reduce / all-gather / reduce-scatter per (group size, bytes) over the
              machine's GPUs (one node's link)
  overlap     per collective op, how much slower matmuls run while it runs beside them (0.1 = 10%
              longer per second of overlapped collective; plait/benchmarks/overlap.py), over 2 GPUs,
              and over larger groups where measured (`overlap_groups`)
  stretch     per collective op, how many times longer it takes beside matmuls than alone (both
              compete for the SMs and memory bandwidth), likewise per group size
  lockstep    how much slower GPUs that meet at every collective run than one alone (each waits
              for the slowest), per group size measured, and the spread that extends it to larger
              jobs (plait/benchmarks/lockstep.py)
  fp8_linear  seconds of plait's FP8 linears, forward and backward, per group of a block's linears
              that share an input, scaling passes included (plait/benchmarks/fp8_linears.py)

How the planner uses it (`plait/planner/roofline.py`, `plait/planner/traffic.py`):
  a measured shape costs what it measured; another shape costs its FLOPs at the efficiency (share
  of the peak) of the nearest measured shape of the same kind, nearest in log-space of the sizes;
  a collective is interpolated in log-log between the two measured sizes around it (below the
  smallest: the smallest's time, the latency floor; above the largest: the largest's bandwidth);
  a group size or an operation not measured falls back to the alpha-beta model with the link's
  bandwidth and latency fitted to the measurements; a collective hidden behind compute runs
  `stretch` times its time alone and adds its op's overlap slowdown times that duration to the
  compute (none measured: 0 slowdown, no stretch); the work of a job on several GPUs takes
  1 + `lockstep_slowdown(n)` times as long (none measured: no slowdown).
  Nothing is fitted to training step times.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from plait.errors import UserError

SCHEMA = "plait.hardware/1"
LINEAR_OPS = ("fwd", "dgrad", "wgrad")


@dataclass(frozen=True)
class HardwareProfile:
    card: str
    """The device's name as torch reports it."""
    gpu: str | None
    """The planner's catalog entry it refines (h100, h200, ...); None for a CPU or an unknown card."""
    dtype: str
    peak_tflops: float | None
    """The peak the MFU convention divides by; None = the catalog's dense peak for `dtype`."""
    hbm_gib: float | None
    linear: tuple[tuple[str, int, int, int, float], ...]
    """(op, tokens, in, out, seconds)"""
    attention: tuple[tuple[int, int, int, int, int, float, float], ...]
    """(batch, seq, heads, kv_heads, head_dim, forward seconds, backward seconds)"""
    pointwise_gbps: float
    optimizer_gbps: float
    collectives: tuple[tuple[str, int, int, float], ...]
    """(op, group size, bytes, seconds)"""
    overlap: dict = field(default_factory=dict, compare=False, hash=False)
    """{collective op: fractional slowdown of compute beside it}"""
    stretch: dict = field(default_factory=dict, compare=False, hash=False)
    """{collective op: its duration beside compute over its duration alone (>= 1)}"""
    lockstep: dict = field(default_factory=dict, compare=False, hash=False)
    """{"groups": {group size: slowdown}, "sigma": relative spread} (plait/benchmarks/lockstep.py)"""
    fp8_linear: tuple = ()
    """(recipe, gathered 0/1, tokens, in, [outs], forward seconds, backward seconds); () where not
    measured (the planner then estimates FP8 linears from the card's FP8 peak)."""
    step_gap_s: float = 0.0
    """GPU idle per training step that the host leaves (step-boundary syncs, launches): measured on
    plait's one-GPU step (plait/benchmarks/step_gaps.py); 0 for profiles made before it."""
    source: dict = field(default_factory=dict, compare=False, hash=False)
    """How it was measured: torch and NCCL versions, date, command."""
    overlap_groups: dict = field(default_factory=dict, compare=False, hash=False)
    """{group size: {op: slowdown}} measured over more than 2 GPUs (`overlap` is over 2): NCCL runs a
    collective over more ranks with more channels, so it takes more of the SMs beside it."""
    stretch_groups: dict = field(default_factory=dict, compare=False, hash=False)
    """{group size: {op: stretch}}, as `overlap_groups`."""

    # ---- lookups -------------------------------------------------------------------------------

    def linear_s(self, op: str, tokens: float, fin: float, fout: float, peak_flops: float) -> float | None:
        """Seconds of one Linear matmul of this shape, or None when nothing of `op` was measured."""
        pts = [p for p in self.linear if p[0] == op]
        if not pts:
            return None
        flops = 2.0 * tokens * fin * fout
        key = (tokens, fin, fout)
        best = min(pts, key=lambda p: _log_distance(key, p[1:4]))
        if _log_distance(key, best[1:4]) == 0.0:
            return best[4]
        eff = 2.0 * best[1] * best[2] * best[3] / best[4] / peak_flops
        return flops / (peak_flops * eff)

    def fp8_group_s(self, recipe: str, gathered: bool, tokens: float, fin: float,
                    outs: tuple) -> tuple[float, float] | None:
        """(forward, backward) seconds of a group of FP8 linears reading one input, or None when no
        group of this recipe (and weight delivery) was measured. Another shape costs its FLOPs at the
        rate of the nearest measured group with as many outputs."""
        pts = [p for p in self.fp8_linear if p[0] == recipe and bool(p[1]) == gathered and len(p[4]) == len(outs)]
        if not pts:
            return None
        key = (tokens, fin, sum(outs))
        best = min(pts, key=lambda p: _log_distance(key, (p[2], p[3], sum(p[4]))))
        ratio = tokens * fin * sum(outs) / (best[2] * best[3] * sum(best[4]))
        return best[5] * ratio, best[6] * ratio

    def attention_s(self, batch: float, seq: float, heads: float, kv_heads: float, head_dim: float,
                    peak_flops: float) -> tuple[float, float] | None:
        """(forward, backward) seconds of causal attention of this shape, or None if none measured."""
        if not self.attention:
            return None
        for p in self.attention:
            if tuple(p[:5]) == (batch, seq, heads, kv_heads, head_dim):
                return p[5], p[6]
        key = (batch * heads, seq, head_dim)
        best = min(self.attention, key=lambda p: _log_distance(key, (p[0] * p[2], p[1], p[4])))
        # causal: QK^T and AV over half the square, 4 FLOPs per (query, key, head-dim element)
        fl = 2.0 * batch * heads * seq * seq * head_dim
        fl_best = 2.0 * best[0] * best[2] * best[1] * best[1] * best[4]
        return fl * best[5] / fl_best, fl * best[6] / fl_best

    def collective_s(self, op: str, size_bytes: float, n: int) -> float | None:
        """Seconds of one `op` of `size_bytes` over `n` ranks, or None when (op, n) was not measured."""
        pts = sorted((p[2], p[3]) for p in self.collectives if p[0] == op and p[1] == n)
        if not pts or n < 2:
            return None
        if size_bytes <= pts[0][0]:
            return pts[0][1]
        if size_bytes >= pts[-1][0]:
            b, t = pts[-1]
            return t * size_bytes / b
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if b0 <= size_bytes <= b1:
                w = math.log(size_bytes / b0) / math.log(b1 / b0)
                return math.exp(math.log(t0) + w * math.log(t1 / t0))
        return pts[-1][1]

    def fitted_link(self) -> tuple[float, float] | None:
        """(GB/s per device, latency in microseconds) of the alpha-beta model, fitted to the measured
        collectives: bandwidth from the largest sizes (bytes each device sends / time), latency from
        the smallest (time / ring steps). None when no collective was measured."""
        from plait.planner.traffic import bytes_per_device, steps

        if not self.collectives:
            return None
        by_key: dict = {}
        for op, n, size, t in self.collectives:
            if n > 1 and op != "send_recv":  # the collectives' links; point-to-point is looked up as measured
                by_key.setdefault((op, n), []).append((size, t))
        bws, lats = [], []
        for (op, n), pts in by_key.items():
            pts.sort()
            size, t = pts[-1]
            bws.append(bytes_per_device(op, size, n) / t)
            size, t = pts[0]
            lats.append(t / steps(op, n))
        return _median(bws) / 1e9, _median(lats) * 1e6

    def overlap_slowdown(self, op: str, n: int = 2) -> float:
        """Extra compute seconds per second of `op` run beside it over a group of `n` GPUs: the op's own
        measurement, else the mean of those measured, else 0; from the largest group measured that
        is not larger than `n` (`overlap` is the 2-GPU one)."""
        return _measured_at(self.overlap, self.overlap_groups, op, n, 0.0)

    def overlap_stretch(self, op: str, n: int = 2) -> float:
        """How many times its time alone `op` takes beside compute over a group of `n` GPUs: its own
        measurement, else the mean of those measured, else 1 (profiles written before it was
        measured); the group as `overlap_slowdown` picks it."""
        return _measured_at(self.stretch, self.stretch_groups, op, n, 1.0)

    def lockstep_slowdown(self, n: int) -> float:
        """Fraction by which the work of `n` GPUs that synchronise runs longer than one GPU's alone:
        as measured for a group of `n`, else the measured spread times the expected maximum of `n`
        normal draws (a job larger than the machine), else 0 (not measured)."""
        if n <= 1 or not self.lockstep:
            return 0.0
        measured = self.lockstep.get("groups", {})
        if str(n) in measured:
            return measured[str(n)]
        return self.lockstep.get("sigma", 0.0) * expected_max_normal(n)


def _measured_at(pairs: dict, groups: dict, op: str, n: int, default: float) -> float:
    """`op`'s figure from the largest group of at most `n` GPUs that measured it (`groups`: {size:
    {op: value}}; `pairs`: over 2 GPUs); where none did, the mean of that nearest group's measured
    ops; else `default`."""
    tables = [groups[str(k)] for k in sorted((int(k) for k in groups if int(k) <= n), reverse=True)] + [pairs]
    for table in tables:
        if op in table:
            return table[op]
    table = next((t for t in tables if t), {})
    return sum(table.values()) / len(table) if table else default


@functools.lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1), by integrating x n phi(x) Phi(x)^(n-1)."""
    if n <= 1:
        return 0.0
    lo, hi, steps = -10.0, 10.0, 4000
    h = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * h
        phi = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        w = 0.5 if i in (0, steps) else 1.0
        total += w * x * n * phi * cdf ** (n - 1)
    return total * h


def _log_distance(a, b) -> float:
    return sum(math.log(x / y) ** 2 for x, y in zip(a, b))


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else 0.5 * (xs[mid - 1] + xs[mid])


# ---- files -------------------------------------------------------------------------------------

def to_dict(p: HardwareProfile) -> dict:
    return {"schema": SCHEMA, "card": p.card, "gpu": p.gpu, "dtype": p.dtype, "peak_tflops": p.peak_tflops,
            "hbm_gib": p.hbm_gib, "pointwise_gbps": p.pointwise_gbps, "optimizer_gbps": p.optimizer_gbps,
            "source": p.source,
            "linear": [list(x) for x in p.linear], "attention": [list(x) for x in p.attention],
            "collectives": [list(x) for x in p.collectives], "overlap": dict(p.overlap),
            "overlap_stretch": dict(p.stretch), "overlap_groups": {k: dict(v) for k, v in p.overlap_groups.items()},
            "overlap_stretch_groups": {k: dict(v) for k, v in p.stretch_groups.items()},
            "lockstep": dict(p.lockstep), "step_gap_s": p.step_gap_s,
            "fp8_linear": [[r[0], r[1], r[2], r[3], list(r[4]), r[5], r[6]] for r in p.fp8_linear]}


def save(p: HardwareProfile, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(to_dict(p), indent=1) + "\n")


def load(path: str | Path) -> HardwareProfile:
    """Read a profile; any defect is one line naming the file, the field and the fix."""
    where = f"--hardware {path}"
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{where}: no such file; measure one with `plait bench calibrate --out {path}`") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{where}: not a readable JSON file ({e})") from None
    if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
        raise UserError(f"{where}: schema is {raw.get('schema') if isinstance(raw, dict) else None!r}, expected "
                        f"{SCHEMA!r}; write it with `plait bench calibrate`")

    def number(name, positive=True, optional=False):
        v = raw.get(name)
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (positive and not v > 0):
            raise UserError(f"{where}: {name} = {v!r}, expected a positive number")
        return float(v)

    def rows(name, width, check):
        out = []
        for i, r in enumerate(raw.get(name) or []):
            if not isinstance(r, list) or len(r) != width or not check(r):
                raise UserError(f"{where}: {name}[{i}] = {r!r} is malformed; re-run `plait bench calibrate`")
            out.append(tuple(r))
        return tuple(out)

    def pos(*xs):
        return all(not isinstance(x, bool) and isinstance(x, (int, float)) and x > 0 for x in xs)

    linear = rows("linear", 5, lambda r: r[0] in LINEAR_OPS and pos(*r[1:]))
    attention = rows("attention", 7, lambda r: pos(*r))
    collectives = rows("collectives", 4, lambda r: isinstance(r[0], str) and pos(*r[1:]))
    fp8_linear = rows("fp8_linear", 7, lambda r: r[0] in ("tensorwise", "rowwise") and r[1] in (0, 1)
                      and isinstance(r[4], list) and r[4] and pos(r[2], r[3], *r[4], r[5], r[6]))
    fp8_linear = tuple((r[0], int(r[1]), r[2], r[3], tuple(r[4]), r[5], r[6]) for r in fp8_linear)
    def table(name, value, lo, hi, what):
        if not isinstance(value, dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v < hi for v in value.values()):
            raise UserError(f"{where}: {name} = {value!r}, expected {{op: {what}}}; re-run `plait bench calibrate`")
        return {str(k): float(v) for k, v in value.items()}

    def per_group(name, lo, hi, what):
        value = raw.get(name) or {}
        if not isinstance(value, dict) or not all(str(k).isdigit() and int(k) > 2 for k in value):
            raise UserError(f"{where}: {name} = {value!r}, expected {{group size > 2: {{op: {what}}}}}; "
                            f"re-run `plait bench calibrate --only overlap`")
        return {str(k): table(f"{name}[{k}]", v, lo, hi, what) for k, v in value.items()}

    overlap = table("overlap", raw.get("overlap") or {}, 0, 10, "slowdown >= 0")
    stretch = table("overlap_stretch", raw.get("overlap_stretch") or {}, 1, 100, "factor >= 1")
    overlap_groups = per_group("overlap_groups", 0, 10, "slowdown >= 0")
    stretch_groups = per_group("overlap_stretch_groups", 1, 100, "factor >= 1")
    gap = raw.get("step_gap_s", 0.0)
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not 0 <= gap < 1:
        raise UserError(f"{where}: step_gap_s = {gap!r}, expected seconds in [0, 1); re-run "
                        f"`plait bench calibrate --only gaps`")
    gap = float(gap)
    lockstep = raw.get("lockstep") or {}
    groups = lockstep.get("groups", {}) if isinstance(lockstep, dict) else None
    if not isinstance(groups, dict) or not all(
            str(k).isdigit() and isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 10
            for k, v in groups.items()) or not (
            isinstance(lockstep.get("sigma", 0.0), (int, float)) and 0 <= lockstep.get("sigma", 0.0) < 10):
        raise UserError(f"{where}: lockstep = {lockstep!r}, expected {{\"groups\": {{size: slowdown >= 0}}, "
                        f"\"sigma\": spread >= 0}}; re-run `plait bench calibrate`")
    return HardwareProfile(card=str(raw.get("card", "?")), gpu=raw.get("gpu"), dtype=str(raw.get("dtype", "bf16")),
                           peak_tflops=number("peak_tflops", optional=True), hbm_gib=number("hbm_gib", optional=True),
                           linear=linear, attention=attention, pointwise_gbps=number("pointwise_gbps"),
                           optimizer_gbps=number("optimizer_gbps"), collectives=collectives,
                           overlap=overlap, stretch=stretch, overlap_groups=overlap_groups, stretch_groups=stretch_groups,
                           lockstep={"groups": {str(k): float(v) for k, v in groups.items()},
                                     "sigma": float(lockstep.get("sigma", 0.0))} if lockstep else {},
                           step_gap_s=gap, fp8_linear=fp8_linear, source=raw.get("source") or {})


def apply_profile(c, prof: HardwareProfile, path: str = "the profile"):
    """The cluster `c` costed with `prof`: its peak and memory where measured, the intra-node link
    fitted to the measured collectives (and carrying them), HBM efficiency from the pointwise
    bandwidth; the profile itself rides along for matmuls and attention."""
    import dataclasses

    from plait.planner.hardware import GPUS

    if prof.gpu is not None and GPUS.get(prof.gpu) is not None and GPUS[prof.gpu].name != c.gpu.name:
        raise UserError(f"--hardware {path} was measured on {prof.card} ({prof.gpu}); plan with --gpu {prof.gpu} "
                        f"or measure this GPU with `plait bench calibrate`")
    gpu, dtype = c.gpu, c.dtype
    if prof.peak_tflops is not None:  # a device the catalog does not know (a CPU): its measured peak
        dtype = prof.dtype
        gpu = dataclasses.replace(gpu, name=prof.card, tflops={**gpu.tflops, dtype: prof.peak_tflops})
    elif c.dtype != prof.dtype:
        raise UserError(f"--hardware {path} measured {prof.dtype} kernels; the plan prices {c.dtype}")
    if prof.hbm_gib is not None:
        gpu = dataclasses.replace(gpu, hbm_gib=prof.hbm_gib)
    intra = c.intra
    fit = prof.fitted_link()
    if fit is not None:
        intra = dataclasses.replace(intra, name=f"{intra.name}, measured", gbps=fit[0], latency_us=fit[1], efficiency=1.0,
                                    measured=prof)
    hbm_eff = min(1.0, prof.pointwise_gbps / gpu.hbm_gbps)
    return dataclasses.replace(c, gpu=gpu, dtype=dtype, intra=intra, hbm_efficiency=hbm_eff, profile=prof)
