"""How `plait plan` shows a prediction or a search: text for people, JSON for programs.

The JSON is stable: keys sorted, schema named and versioned (`"schema": "plait.plan/1"`), every
quantity in base units (bytes, seconds, FLOPs, FLOP/s) under a name that says so. docs/planner.md
documents each field.
"""

from __future__ import annotations

import dataclasses
import json

from plait.planner import costs
from plait.planner.costs import ModelDims
from plait.planner.hardware import GIB, Cluster, Link
from plait.planner.predict import Prediction
from plait.planner.search import SearchResult, explain_ranking, seconds

SCHEMA = "plait.plan/1"


def _link(link: Link) -> dict:
    return {"name": link.name, "gbps": link.gbps, "efficiency": link.efficiency, "latency_us": link.latency_us}


def header_dict(d: ModelDims, c: Cluster, global_batch: int, precision: str) -> dict:
    return {
        "schema": SCHEMA,
        "model": {**dataclasses.asdict(d), "params": costs.param_count(d),
                  "matmul_params": costs.matmul_params(d),
                  "model_flops_per_token": costs.model_flops_per_token(d)},
        "cluster": {"gpu": c.gpu.name, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node,
                    "n_gpus": c.n_gpus, "dtype": c.dtype, "peak_flops": c.peak_flops,
                    "hbm_bytes": c.gpu.hbm_gib * GIB, "hbm_gbps": c.gpu.hbm_gbps,
                    "matmul_efficiency": c.matmul_efficiency, "hbm_efficiency": c.hbm_efficiency,
                    "reserved_bytes": c.reserved_gib * GIB, "intra_link": _link(c.intra),
                    "inter_link": _link(c.inter),
                    # the text names the measured card in --explain only: a program must see what priced it
                    "profile": c.profile.card if c.profile is not None else None},
        "global_batch": global_batch,
        "precision": precision,
    }


def prediction_dict(p: Prediction) -> dict:
    return {
        "layout": dataclasses.asdict(p.layout),
        "layout_name": p.layout.describe(),
        "microbatches": p.microbatches,
        "tokens_per_step": p.tokens_per_step,
        "memory_bytes": dict(p.memory_bytes),
        "memory_total_bytes": p.memory_total_bytes,
        "memory_rank": p.memory_rank,
        "capacity_bytes": p.capacity_bytes,
        "headroom_bytes": p.headroom_bytes,
        "fits": p.fits,
        "traffic": {name: {"group_size": t.n, "link": _link(t.link), "crosses_nodes": t.crosses_nodes,
                           "bytes_per_device": t.bytes_per_device, "collectives_per_step": t.count,
                           "time_s": t.time_s,
                           "collectives": [{"op": x.op, "size_bytes": x.size_bytes, "group_size": x.n,
                                            "count": x.count, "bytes_per_device": x.bytes_per_device,
                                            "what": x.what} for x in t.collectives]}
                    for name, t in p.traffic.items()},
        "time_s": dict(p.time_s),
        "makespan_s": p.makespan_s,
        "step_time_s": p.step_time_s,
        "bubble": p.bubble,
        "tokens_per_s": p.tokens_per_s,
        "model_flops_per_step": p.model_flops_per_step,
        "hardware_flops_per_step": p.hardware_flops_per_step,
        "mfu": p.mfu,
        "hfu": p.hfu,
        "causal_masked_share": p.masked_share,
        "simulated": p.exact,
    }


def to_json(obj: dict) -> str:
    return json.dumps(obj, sort_keys=True, indent=2)


def _gib(x: float) -> str:
    return f"{x / GIB:8.2f}"


def _bytes(x: float) -> str:
    for unit, k in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if x >= k:
            return f"{x / k:.2f} {unit}"
    return f"{x:.0f} B"


def title(d: ModelDims, c: Cluster, global_batch: int, precision: str) -> str:
    n = costs.param_count(d)
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"  # a CPU-sized model is not "0.00B"
    return (f"{d.arch} model: {size} parameters (L={d.layers} h={d.hidden} "
            f"a={d.heads} kv={d.kv_heads} f={d.ffn} V={d.vocab} s={d.seq}) on {c.nodes} x {c.gpus_per_node} "
            f"{c.gpu.name}; global batch {global_batch} x {d.seq} tokens; precision {precision}")


# how the step-time parts read in text (the JSON keeps the short keys)
PART_NAMES = {"bubble": "idle in the pipeline", "dp_sync": "exposed dp sync", "zero3": "zero3 gathers",
              "host": "host gaps"}


def breakdown_text(p: Prediction, explain: bool = False) -> str:
    lay = p.layout
    lines = [f"layout: {lay.describe()}  ({p.microbatches} micro-batch{'es' if p.microbatches != 1 else ''} of {lay.micro_batch} per step)", "",
             f"memory per GPU (pipeline rank {p.memory_rank}, the fullest)      GiB"]
    for k, v in p.memory_bytes.items():
        if v:
            lines.append(f"  {k:<42}{_gib(v)}")
    total, cap = p.memory_total_bytes, p.capacity_bytes
    verdict = (f"fits, {p.headroom_bytes / GIB:.2f} GiB free" if p.fits
               else f"does not fit by {-p.headroom_bytes / GIB:.2f} GiB")
    # per-layer and per-parameter traffic (tp, cp, the ZeRO dims) is rank 0's stage's: with uneven
    # stages another rank sends in proportion to its own layers
    where = (" (pipeline rank 0's, with more layers a rank sends more; pp: the rank that sends the most messages)"
             if lay.pp > 1 else "")
    lines += [f"  {'total':<42}{_gib(total)} of {cap / GIB:.2f}  -> {verdict}", "",
              f"traffic per step, per device{where}"]
    if not p.traffic:
        lines.append("  (none: a single GPU)")
    for t in p.traffic.values():
        lines.append(f"  {t.dim:<13} group {t.n:<4} {t.link.name} ({t.link.bytes_per_s / 1e9:g} GB/s"
                     f"{', crosses nodes' if t.crosses_nodes else ''}): {_bytes(t.bytes_per_device)} in "
                     f"{t.count:g} collectives, {t.time_s:.3f} s if nothing overlapped")
    t = p.step_time_s
    parts = ", ".join(f"{PART_NAMES.get(k, k)} {v / t:.1%}" for k, v in p.time_s.items() if v / t >= 0.001)
    # Two different bubbles, each named: the mean over every pipeline rank (the schedule's figure,
    # as in the papers) and the idle time of the busiest rank, which is what lengthens the step.
    idle = p.time_s.get("bubble", 0.0) / t
    how = "simulated schedule" if p.exact else "closed-form estimate"
    lines += ["", f"step time   {seconds(t)}  (on the busiest rank: {parts})",
              f"bubble      {p.bubble:.2%} of all pipeline ranks' time ({how}); the busiest rank idles "
              f"{idle:.2%} of the step" if lay.pp > 1 else "bubble      none (one pipeline stage)",
              f"throughput  {p.tokens_per_s:,.0f} tokens/s; MFU {p.mfu:.1%} (HFU {p.hfu:.1%})"]
    if lay.fp8 != "off" and p.mfu > 0.7:  # the convention's bf16 peak: FP8 GEMMs run up to twice it
        lines += ["            MFU is over the card's dense bf16 peak (the convention, to compare with bf16 "
                  "runs): FP8 matmuls can take it past 100%"]
    if p.masked_share >= 0.1:  # long sequences: the convention's count is well above the kernels' work
        lines += ["            MFU and HFU count causal attention over the whole T x T square (PaLM's and "
                  "torchtitan's convention, to compare with theirs);",
                  f"            the causal kernel skips its masked half, {p.masked_share:.0%} of the model FLOPs: "
                  f"on the FLOPs it runs, MFU {p.mfu * (1 - p.masked_share):.1%}"]
    if explain:
        lines += ["", "how these numbers come out:"]
        lines += [f"  {k}: {v}" for k, v in p.explain]
    return "\n".join(lines)


def ranking_text(res: SearchResult, explain: bool = True) -> str:
    # milliseconds where the steps are short: a small model's ranked steps all printed as 0.000 s
    ms = bool(res.ranked) and max(p.step_time_s for p in res.ranked) < 0.1
    unit, scale = ("step ms", 1e3) if ms else ("step s", 1.0)
    if not res.ranked:  # no table header over nothing
        return "\n".join(explain_ranking(res))
    # as wide as the longest name (a CP, pipeline and split layout's passed 52 and shifted its row)
    w = max(52, *(len(p.layout.describe()) + 1 for p in res.ranked))
    lines = [f"{'#':>3}  {'layout':<{w}}{unit:>9}{'MFU':>8}{'bubble':>8}{'mem GiB':>9}{'free':>7}"]
    for i, p in enumerate(res.ranked, start=1):
        lines.append(f"{i:>3}  {p.layout.describe():<{w}}{p.step_time_s * scale:>9.3f}{p.mfu:>8.1%}{p.bubble:>8.1%}"
                     f"{p.memory_total_bytes / GIB:>9.1f}{p.headroom_bytes / GIB:>7.1f}")
    if explain or not res.ranked:
        lines += ["", "why:"] + [f"  {x}" for x in explain_ranking(res)]
    return "\n".join(lines)
