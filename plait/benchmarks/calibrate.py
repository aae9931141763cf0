"""`plait bench calibrate`: measure this machine for the planner and write a hardware profile
(`plait/planner/profile.py`) that `plait plan --hardware FILE` prices layouts with.

Measured, each the median of timed repetitions after a warm-up (CUDA events on a GPU):
  linear      the matmuls of nn.Linear - forward, input gradient, weight gradient - at every shape
              a transformer layer of the given presets has at the given tp splits and tokens per
              micro-batch (Q/K/V, the attention output, w1/w3, w2, the output head)
  attention   causal scaled_dot_product_attention (plait's kernel), forward and backward, at the
              presets' head counts per tp split and the given sequence lengths
  pointwise   bandwidth of RMSNorm (compiled on a GPU, as plait runs it): bytes read + written / time
  optimizer   bandwidth of plait's AdamW update on flat fp32 state (compiled on a GPU)
  collectives `plait bench comm`'s torch all-reduce / all-gather / reduce-scatter over 2, 4, ...
              `--nproc` GPUs of this machine, 1 KiB to 1 GiB
  overlap     how much slower matmuls run while each collective runs beside them, and how much slower
              the collective runs, over 2 GPUs and over 4, 8, ... up to --nproc (NCCL gives a larger
              group more channels; plait/benchmarks/overlap.py)
  lockstep    how much longer groups of 2, 4, ... GPUs that meet at every collective take for the
              same work than one GPU alone (plait/benchmarks/lockstep.py)
  gaps        how long plait's own training step leaves the GPU idle, per step: the host's share
              (plait/benchmarks/step_gaps.py)

`--only lockstep|collectives|overlap|gaps|fp8 --out FILE` measures that part alone and writes it into an
existing profile, keeping the rest. `fp8` (plait/benchmarks/fp8_linears.py: plait's FP8 linears, compiled,
per group of a block's linears that share an input) is measured only so, at the shapes of --models,
--tp and --tokens: each shape compiles on its own, so ask for the shapes you plan with.
A few minutes on one GPU node; `--quick` measures a tiny model's shapes (what the tests run on CPU).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

HELP = "measure matmuls, attention, memory-bound kernels, the optimizer and collectives -> a hardware profile"


def add_arguments(p) -> None:
    p.add_argument("--models", default="1b,8b,70b", help="presets whose layer shapes to measure (default 1b,8b,70b)")
    p.add_argument("--tp", default="1,2,4,8", help="tensor-parallel splits of those shapes (default 1,2,4,8)")
    p.add_argument("--tokens", default="2048,4096,8192,16384",
                   help="tokens per micro-batch on one GPU, b x s / cp (default 2048,4096,8192,16384)")
    p.add_argument("--seq", default="2048,4096,8192", help="attention sequence lengths (default 2048,4096,8192)")
    p.add_argument("--nproc", type=int, default=0,
                   help="GPUs for the collectives, measured over groups of 2, 4, ... up to it (default: all; 1 skips)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--max-bytes", default=None, help="largest collective (default 1G on GPU, 4M on CPU)")
    p.add_argument("--collectives", default="",
                   help="add collectives from `plait bench comm --json` files (comma-separated) for group sizes "
                        "not measured here, e.g. a run over more GPUs than this machine has")
    from plait.benchmarks.recalibrate import ONLY

    p.add_argument("--only", choices=ONLY, default=None,
                   help="measure only this part and write it into the existing profile at --out (the rest kept): "
                        "lockstep, collectives (every op over 2, 4, ... GPUs), overlap (its slowdown and stretch), "
                        "gaps (the idle a training step leaves, one GPU) or fp8 (plait's FP8 linears at --models/--tp/--tokens, "
                        "one GPU)")
    p.add_argument("--quick", action="store_true", help="a tiny model's shapes only (for a CPU check of the tool)")
    p.add_argument("--out", default=None, help="profile path (default bench/results/hardware-<card>.json)")


def _ints(text: str, flag: str) -> list[int]:
    from plait.errors import bad_value

    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise bad_value(flag, text, "expected comma-separated positive integers, e.g. 1,2,4") from None
    if not vals or any(v < 1 for v in vals):
        raise bad_value(flag, text, "expected comma-separated positive integers, e.g. 1,2,4")
    return vals


def run(args) -> int:
    import torch

    from plait.config import PRESETS
    from plait.errors import bad_value
    from plait.planner import profile as prof

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise bad_value("--device", "cuda", "no GPU is visible; use --device cpu")
    models = ["tiny"] if args.quick else [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in PRESETS or m == "custom":
            raise bad_value("--models", m, f"choose presets from {', '.join(k for k in PRESETS if k != 'custom')}")
    tps = [1, 2] if args.quick else _ints(args.tp, "--tp")
    tokens = [64, 128] if args.quick else _ints(args.tokens, "--tokens")
    seqs = [64] if args.quick else _ints(args.seq, "--seq")
    cuda = device == "cuda"
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    nproc = args.nproc or (torch.cuda.device_count() if cuda else 2)

    t0 = time.time()
    if args.only:
        from plait.benchmarks.recalibrate import only

        return only(args, device, nproc, t0)
    if cuda:
        warm_up(dev)
    shapes = _linear_shapes(models, tps, tokens)
    linear = [(op, m, k, n, _time_linear(op, m, k, n, dev, dtype)) for (m, k, n) in shapes for op in prof.LINEAR_OPS]
    print(f"# linear: {len(linear)} matmuls in {time.time() - t0:.0f} s", flush=True)
    attention = [(b, s, h, kv, hd, *_time_attention(b, s, h, kv, hd, dev, dtype))
                 for (b, s, h, kv, hd) in _attention_shapes(models, tps, tokens, seqs)]
    print(f"# attention: {len(attention)} shapes", flush=True)
    pointwise = _pointwise_gbps(dev, dtype, max(PRESETS[m]["dim"] for m in models), max(tokens))
    optimizer = _optimizer_gbps(dev, dtype, 1 << (26 if cuda else 20))
    print(f"# pointwise {pointwise:.1f} GB/s, optimizer {optimizer:.1f} GB/s", flush=True)
    collectives = _collectives(device, nproc, args.max_bytes or ("1G" if cuda else "4M")) if nproc > 1 else []
    if args.collectives:  # group sizes this machine cannot form, from runs on a larger one
        here = {n for _, n, _, _ in collectives}
        collectives += [r for r in _recorded_collectives(args.collectives.split(","),
                                                          torch.cuda.get_device_name(dev) if cuda else "cpu")
                        if r[1] not in here]
    print(f"# collectives: {len(collectives)} timings over groups up to {nproc}", flush=True)
    from plait.benchmarks import overlap as ov

    overlapping = ov.measure_groups(device, nproc) if nproc > 1 else {}
    print(ov.describe(overlapping) if overlapping else "# overlap: not measured (one GPU)", flush=True)

    from plait.benchmarks.recalibrate import lockstep as measure_lockstep, step_gap

    lockstep = measure_lockstep(device, nproc)
    gap = step_gap(device)

    card = torch.cuda.get_device_name(dev) if cuda else "cpu"
    gpu = _catalog_key(card) if cuda else None
    best = max(2.0 * m * k * n / t for _, m, k, n, t in linear) / 1e12
    p = prof.HardwareProfile(
        card=card, gpu=gpu, dtype="bf16" if dtype == torch.bfloat16 else "fp32",
        # a GPU's MFU divides by its data-sheet peak; a CPU has none, so its best measured matmul stands in
        peak_tflops=None if gpu else best,
        hbm_gib=torch.cuda.get_device_properties(dev).total_memory / 2**30 if cuda else None,
        linear=tuple(linear), attention=tuple(attention), pointwise_gbps=pointwise, optimizer_gbps=optimizer,
        collectives=tuple(collectives), **overlapping, lockstep=lockstep, step_gap_s=gap,
        source={"torch": torch.__version__, "nccl": _nccl(), "date": time.strftime("%Y-%m-%d"),
                "command": "plait " + " ".join(sys.argv[1:]),
                "seconds": round(time.time() - t0, 1),
                "timing": "bursts behind load" if cuda else "single calls"})  # older profiles: single calls
    out = args.out or f"bench/results/hardware-{_slug(card)}.json"
    prof.save(p, out)
    print(f"# wrote {out} in {time.time() - t0:.0f} s (best matmul {best:.1f} TFLOP/s)")
    return 0


# ---- shapes --------------------------------------------------------------------------------------

def _linear_shapes(models, tps, tokens) -> list[tuple[int, int, int]]:
    """(tokens, in, out) of every Linear of a layer, and of the output head, per model and tp split,
    the way `plait/planner/roofline.py` asks for them."""
    from plait.config import PRESETS

    out = set()
    for name in models:
        c = PRESETS[name]
        h, f, hd = c["dim"], c["ffn_dim"], c["dim"] // c["n_heads"]
        kv = c["n_kv_heads"] * hd
        for t in tps:
            if c["n_heads"] % t or f % t:
                continue
            for m in tokens:
                for k, n in ((h, (h + 2 * kv) / t), (h / t, h), (h, 2 * f / t), (f / t, h), (h, -(-c["vocab_size"] // t))):
                    if k == int(k) and n == int(n):
                        out.add((m, int(k), int(n)))
    return sorted(out)


def _attention_shapes(models, tps, tokens, seqs) -> list[tuple[int, int, int, int, int]]:
    from plait.config import PRESETS

    out = set()
    for name in models:
        c = PRESETS[name]
        hd = c["dim"] // c["n_heads"]
        for t in tps:
            if c["n_heads"] % t:
                continue
            kv = max(1, c["n_kv_heads"] // t)
            for s in seqs:
                for m in tokens:
                    if m % s == 0:
                        out.add((m // s, s, c["n_heads"] // t, kv, hd))
    return sorted(out)


# ---- timing --------------------------------------------------------------------------------------

def _timed(fn, dev, reps: int = 0) -> float:
    """Median seconds of one call of `fn` (after a warm-up), CUDA events on a GPU.

    On a GPU each timed repetition is a burst of calls queued behind real work (`_heat`), the
    events around the burst: what is timed is the kernels back to back on a busy card, as a
    training step runs them. Timing a single call between events adds its launch latency (10-30 us)
    to kernels of a few tens of microseconds; a burst queued behind an idle wait (a GPU sleep) runs
    at a clock the card holds only for short bursts: on an H100 such matmuls came out 11-17% faster
    than the same shapes inside a training step, and the planner then under-predicted every step."""
    import torch

    cuda = dev.type == "cuda"
    for _ in range(2):
        fn()
    if cuda:
        torch.cuda.synchronize(dev)
    t = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(dev)
    once = max(time.perf_counter() - t, 1e-6)
    reps = reps or max(3, min(15, int(0.2 / once)))
    burst = max(1, min(BURST, int(BURST_S / once))) if cuda else 1
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            _heat(dev)  # holds the GPU busy while the burst is queued behind it
            a.record()
            for _ in range(burst):
                fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / burst)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


BURST = 32  # calls a timed burst holds at most
BURST_S = 2e-3  # and about this much work (sized from one synchronised call, launch included)
HEAT_SIDE = 8192  # the heater's square matmul: ~1.4 ms on an H100, longer than queuing a burst takes
_heater: dict = {}


def _heat(dev, calls: int = 2) -> None:
    """Queue `calls` large matmuls: work that keeps the card at the clock and power it sustains under
    a training step's load while the CPU queues the timed burst behind it."""
    import torch

    if dev not in _heater:
        _heater[dev] = torch.randn(HEAT_SIDE, HEAT_SIDE, device=dev, dtype=torch.bfloat16)
    a = _heater[dev]
    for _ in range(calls):
        torch.mm(a, a)


def warm_up(dev, seconds: float = 2.0) -> None:
    """Bring the card to its sustained state (clocks, power, temperature) before the first timing."""
    import torch

    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        _heat(dev, 8)
        torch.cuda.synchronize(dev)


def _time_linear(op, m, k, n, dev, dtype) -> float:
    import torch

    x = torch.randn(m, k, device=dev, dtype=dtype)
    w = torch.randn(n, k, device=dev, dtype=dtype)
    dy = torch.randn(m, n, device=dev, dtype=dtype)
    fn = {"fwd": lambda: x @ w.t(), "dgrad": lambda: dy @ w, "wgrad": lambda: dy.t() @ x}[op]
    return _timed(fn, dev)


def _time_attention(b, s, heads, kv, hd, dev, dtype) -> tuple[float, float]:
    import torch
    import torch.nn.functional as F

    q = torch.randn(b, heads, s, hd, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(b, kv, s, hd, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(b, kv, s, hd, device=dev, dtype=dtype, requires_grad=True)
    gqa = heads != kv
    fwd = _timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa), dev)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    grad = torch.randn_like(out)

    def both():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        torch.autograd.grad(o, (q, k, v), grad)

    return fwd, max(_timed(both, dev) - fwd, 1e-9)


def _pointwise_gbps(dev, dtype, h: int, tokens: int) -> float:
    """RMSNorm over (tokens, h): reads x, writes y (the weight is negligible)."""
    import torch

    x = torch.randn(tokens, h, device=dev, dtype=dtype)
    w = torch.ones(h, device=dev, dtype=dtype)

    def norm(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w

    fn = torch.compile(norm) if dev.type == "cuda" else norm
    t = _timed(lambda: fn(x, w), dev)
    return 2 * x.numel() * x.element_size() / t / 1e9


def _optimizer_gbps(dev, dtype, n: int) -> float:
    """plait's flat AdamW update (plait/optim.py) on n elements: reads the gradient, reads and writes
    the fp32 master and both moments, writes the low-precision parameters."""
    import torch

    from plait.optim import adamw_update

    master = torch.randn(n, device=dev)
    m1, m2 = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    grad = torch.randn(n, device=dev, dtype=dtype)
    param = torch.empty(n, device=dev, dtype=dtype) if dtype != torch.float32 else None
    hp = torch.tensor([1e-4, 0.1, 0.9, 0.95, 1e-8, 1e-4, 1.0, 1.0], device=dev)
    fn = torch.compile(adamw_update, dynamic=False) if dev.type == "cuda" else adamw_update
    t = _timed(lambda: fn(master, m1, m2, grad, param, hp), dev)
    moved = n * (grad.element_size() + 2 * 4 * 3 + (param.element_size() if param is not None else 0))
    return moved / t / 1e9


def _collectives(device: str, nproc: int, max_bytes: str) -> list[tuple[str, int, int, float]]:
    """`plait bench comm` with torch's collectives over groups of 2, 4, ... up to nproc processes."""
    from plait.benchmarks.comm import OPS, bench_rank, parse_bytes
    from plait.launch import run as launch_run

    rows = []
    n = 2
    while n <= nproc:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "comm.json")
            opts = dict(device=device, ops=list(OPS), impls=["torch"], min_bytes=1024, max_bytes=parse_bytes(max_bytes),
                        factor=4, dtype="bf16" if device == "cuda" else "fp32", iters=0, warmup=0,
                        piece_bytes=parse_bytes("16M"), json=path, timeout=300.0, nproc=n)
            launch_run(bench_rank, (opts,), nproc=n, device_type=device)
            with open(path) as f:
                for r in json.load(f)["results"]:
                    rows.append((r["op"], n, int(r["bytes"]), r["time_us"] / 1e6))
        n *= 2
    return rows


def _recorded_collectives(paths, card: str) -> list[tuple[str, int, int, float]]:
    """torch's collectives from `plait bench comm` result files, which must be of this card."""
    from plait.errors import bad_value

    rows = []
    for path in (p.strip() for p in paths if p.strip()):
        try:
            with open(path) as f:
                res = json.load(f)
            n, found = int(res["nproc"]), res["device"]
            timed = [(r["op"], n, int(r["bytes"]), r["time_us"] / 1e6) for r in res["results"] if r["impl"] == "torch"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise bad_value("--collectives", path, f"is not a `plait bench comm --json` result ({e})") from None
        if found != card:
            raise bad_value("--collectives", path, f"was measured on {found}, this machine is {card}")
        rows += timed
    return rows


def _catalog_key(card: str) -> str | None:
    from plait.planner.hardware import card_key

    return card_key(card)


def _nccl() -> str | None:
    import torch

    try:
        return ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a build without NCCL
        return None


def _slug(card: str) -> str:
    import re

    words = [w for w in re.split(r"[^a-z0-9]+", card.lower()) if w and w not in ("nvidia", "gb", "hbm3", "80gb")]
    return "-".join(words[:2]) or "device"
