"""Pipeline-parallel training throughput: plait's executor against torch.distributed.pipelining.

    python bench/pipeline.py --microbatches 4,8,16,32      # every visible GPU as pipeline stages, 8b

Every variant trains the same model on the same batch (`--microbatches` x `--micro-batch` sequences
a step), each in its own set of G worker processes, which measures every micro-batch count in turn
(smallest first: a count that runs out of memory ends the set, and the counts before it are kept).

  plait-gpipe / plait-1f1b       plait's executor running plait's schedule lists (compiled blocks)
  plait-interleaved              interleaved 1F1B, v = 2 chunks per rank
  plait-zb                       ZB-H1: B computes input gradients, W the deferred weight gradients
                                 (blocks compiled whole: the deferring linears are ops in the graph)
  plait-zbv                      ZB-V: ZB-H1's split backward over v = 2 chunks a rank placed in a V
                                 (rank 0 holds the first and the last stage)
  plait-zero3                    no pipeline: ZeRO-3 over all G GPUs, the same global batch
  torch-gpipe / torch-1f1b       torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B on the
                                 same stages (blocks compiled, fused AdamW, bf16 autocast, logits +
                                 cross-entropy on the last stage as its examples do)
  torch-interleaved              ScheduleInterleaved1F1B, v = 2
  torch-zb                       ScheduleInterleavedZeroBubble, v = 2 (torch's zero-bubble schedule
                                 needs several stages per rank; plait's ZB-H1 runs one), blocks eager:
                                 it cannot split a compiled block's backward
  torch-zbv                      ScheduleZBVZeroBubble on the same V-placed stages, blocks eager
plait rows add the measured bubble of the last timed step (per-action times on every rank, synced)
next to the schedule's simulated one (equal costs) and its replay (the measured action times through
the schedule's dependencies, messages instant: the bubble the stages' costs force). Measured minus
replayed is what transfers and the executor added.
`host_share` per rank: host seconds issuing the actions over device seconds running them (>= ~1:
launch-bound).

Writes bench/results/pp-<card>-<G>gpu[-<tag>].json and prints a table.
`--device cpu --preset tiny --no-compile --gpus 4` runs the same code over gloo as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from data_parallel import _adamw, _cleanup, _measure, _model_cfg, _model_section, run_variants, card_slug  # noqa: E402

ALL = ["plait-zero3", "plait-gpipe", "plait-1f1b", "plait-interleaved", "plait-zb", "plait-zbv", "torch-gpipe",
       "torch-1f1b", "torch-interleaved", "torch-zb", "torch-zbv"]
CHUNKS = {"interleaved": 2, "zb": 2, "zbv": 2}  # model chunks a rank, torch's side (plait's zb runs one)


def _batch(a, vocab, device):
    import torch

    g = torch.Generator().manual_seed(1000 + a.microbatches)
    rows = torch.randint(0, vocab, (a.microbatches * a.micro_batch, a.seq + 1), generator=g)
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


def _split(a, v: int) -> str:
    """--stage-layers for a schedule of v chunks a rank: "balance" applies to every schedule (it splits
    pp x v stages); explicit counts are per rank, so only one-chunk schedules take them. torch's
    stages get the same split as plait's."""
    return a.stage_layers if a.stage_layers == "balance" or v == 1 else ""


def _plait(a, variant, dims, device, comm):
    """plait's parallelized model for `variant`; `step_for(m)` gives the step function of a batch of m
    micro-batches (one model for every m: its compiled blocks do not depend on m)."""
    import torch

    from plait.config import build_config
    from plait.parallel.build import parallelize

    sched = variant.split("-")[1]
    pp = a.gpus if sched != "zero3" else 1
    v = 2 if sched in ("interleaved", "zbv") else 1
    cfg = build_config({"model": _model_section(a), "train": {"lr": 1e-4, "warmup_steps": 0, "micro_batch": a.micro_batch},
                        "parallel": {"pp": pp, "schedule": sched if pp > 1 else "1f1b", "v": v,
                                     "zero": 3 if pp == 1 else 1, "stage_layers": _split(a, v) if pp > 1 else ""}})
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    par = parallelize(cfg, comm, device, dtype, compile=a.compile)

    def step_for(m):
        x, y = _batch(argparse.Namespace(**{**vars(a), "microbatches": m}), cfg.model.vocab_size, device)
        if pp == 1:  # the same global batch over G data-parallel ranks, m / G micro-batches each
            per = x.shape[0] // a.gpus
            x, y = x[par.data_rank * per:(par.data_rank + 1) * per], y[par.data_rank * per:(par.data_rank + 1) * per]
        micro = list(zip(x.split(a.micro_batch), y.split(a.micro_batch)))
        return lambda: par.runner.step(micro, 1e-4)[0]

    return step_for, par


def _torch(a, variant, dims, device):
    """torch.distributed.pipelining over plait's blocks, split into the same stages."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

    from plait.model import Transformer
    from plait.parallel.schedules import stage_of
    from plait.parallel.stages import rank_chunks, resolve_counts, stage_layer_ids

    sched = variant.split("-")[1]
    v = CHUNKS.get(sched, 1)
    mcfg, pp, rank = _model_cfg(a), a.gpus, dist.get_rank()
    split = _split(a, v)
    counts = resolve_counts(split, mcfg, a.seq, pp * v, sched) if split else None
    chunks = rank_chunks(pp, v, rank, stage_layer_ids(mcfg.n_layers, pp * v, counts), sched)
    cuda = device.type == "cuda"

    class Stage(torch.nn.Module):
        def __init__(self, lm, keys, first, last):
            super().__init__()
            self.lm, self.keys, self.first, self.last = lm, keys, first, last

        def forward(self, x):
            h = self.lm.embed(x) if self.first else x
            T = h.shape[1]
            cos, sin = self.lm.rope_cos[:T].to(h.dtype), self.lm.rope_sin[:T].to(h.dtype)
            for k in self.keys:
                h = self.lm.layers[k](h, cos, sin)
            return self.lm.output(self.lm.norm(h)) if self.last else h

    stages, params = [], []
    for c, ids in enumerate(chunks):
        s = stage_of(sched, pp, rank, c)
        with torch.device("meta"):
            lm = Transformer(mcfg, layer_ids=ids, first=s == 0, last=s == pp * v - 1)
        lm.to_empty(device=device)
        lm.init_weights(0)
        # torch's zero-bubble schedule splits each backward by walking autograd's graph, which a
        # compiled block's node does not allow ("Attribute '_input_metadata' is invalid", torch 2.11,
        # 4 x H100): its blocks run eagerly, the way that schedule works
        if a.compile and sched not in ("zb", "zbv"):
            for block in lm.layers.values():
                block.compile()
        stages.append(PipelineStage(Stage(lm, [str(i) for i in ids], s == 0, s == pp * v - 1), s, pp * v, device))
        params += list(lm.parameters())

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
            "zb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}[sched]
    schedule = kind(stages if v > 1 else stages[0], a.microbatches, loss_fn=loss_fn)
    opt = _adamw(torch.nn.ModuleList([s.submod for s in stages]), fused=cuda)
    x, y = _batch(a, mcfg.vocab_size, device)
    holds_last = any(s.is_last for s in stages)

    def step():
        losses = []
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            if rank == 0:
                schedule.step(x, target=y, losses=losses)
            else:
                schedule.step(target=y, losses=losses)
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # each stage its own part (no global norm: the peer's default)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = torch.stack(losses).mean().detach().float() if holds_last else torch.zeros((), device=device)
        dist.all_reduce(loss)
        return loss

    return step, (stages, opt)


def _measure_pp(a, variant, step, device, runner=None) -> dict:
    """The shared timing, then (plait) one more step timed action by action for the bubble."""
    row = _measure(a, variant, step, device, tokens_per_gpu_step=a.microbatches * a.micro_batch * a.seq / a.gpus)
    row["microbatches"] = a.microbatches
    if runner is not None and hasattr(runner, "timeline"):
        runner.timeline.enabled = True
        step().item()
        runner.timeline.enabled = False
        row["bubble_spans_rank"] = runner.timeline.steps[-1]["actions"]
    return row


def _bubble(a, variant, row, spans, sched) -> None:
    """The measured, replayed and equal-stage bubbles from every rank's (rank, action times, layers a
    chunk), each rank's host share, and the measured timeline's PNG."""
    from plait import timeline as tl

    flat = [(r, act[3], act[4], act[0], act[1], act[2]) for r, acts, _ in spans for act in acts]
    pp, v = len(spans), sched.v
    row.update(tl.report(flat, sched, [spans[r][2][c] for r, c in map(sched.place, range(pp * v))]))
    row["host_share"] = tl.host_share([acts for _, acts, _ in spans])  # >= ~1: that rank was launch-bound
    row["held_after_action"] = tl.held([acts for _, acts, _ in spans])  # each rank's fullest point between actions
    if a.png_dir:  # the measured timeline beside the JSON
        try:
            png = Path(a.png_dir) / f"{variant}-m{a.microbatches}.png"
            png.parent.mkdir(parents=True, exist_ok=True)  # this script's own output folder: draw creates none
            tl.draw(flat, pp, v, png, f"{variant}, m {a.microbatches}: measured bubble {row['measured_bubble']:.1%}, "
                    f"replayed {row['replayed_bubble']:.1%}, equal stages {row['simulated_bubble']:.1%}")
            row["timeline_png"] = png.name
        except Exception as e:  # noqa: BLE001 (no matplotlib: the numbers stand without it)
            row["timeline_png"] = f"not drawn: {e}"


def _one_count(a, variant, dims, device, built) -> dict:
    """Rank 0's row for one micro-batch count `a.microbatches`; `built` holds plait's model across counts."""
    import torch.distributed as dist

    from plait.comm import Comm, Ledger

    runner = None
    if variant.startswith("plait"):
        if "par" not in built:
            built["step_for"], built["par"] = _plait(a, variant, dims, device, Comm(dims, Ledger(enabled=False)))
        runner = built["par"].runner if hasattr(built["par"].runner, "timeline") else None
        row = _measure_pp(a, variant, built["step_for"](a.microbatches), device, runner)
    else:
        step, keep = _torch(a, variant, dims, device)
        try:
            row = _measure_pp(a, variant, step, device)
        finally:
            del step, keep
    # every rank's action times: the measured bubble needs all of them
    spans = [None] * dims.world_size
    mine = [len(c) for c in runner.chunks] if runner is not None else None
    dist.all_gather_object(spans, (dims.rank, row.pop("bubble_spans_rank", None), mine,
                                   row.get("allocator_per_step")))
    if spans[0][3] is not None:  # every rank's: one rank's driver calls stall that rank's host alone
        row["allocator_per_step"] = [s[3] for s in spans]
    spans = [s[:3] for s in spans]
    if runner is not None and dims.rank == 0 and all(s[1] for s in spans):
        _bubble(a, variant, row, spans, runner.schedule(a.microbatches))
    # every rank's peak: a schedule's ranks hold different things (the head, pending W's), and the
    # planner prices each rank
    peaks = [None] * dims.world_size
    dist.all_gather_object(peaks, row["peak_mem_gb"])
    row["peak_mem_gb_per_rank"] = peaks
    row["peak_mem_gb_max_rank"] = max(peaks)
    return row


def _bind_cpus(mode: str, device) -> str:
    """Bind this rank's threads to CPUs by its GPU (torch's NUMA binding, as `torchrun --numa-binding
    MODE` does; it needs the numactl tool and falls back to no binding); returns the cores it holds."""
    try:
        from torch.numa.binding import AffinityMode, NumaOptions, _maybe_apply_numa_binding_to_current_process
    except ImportError:
        return "not bound: this torch has no torch.numa.binding"
    if device.type == "cuda":
        _maybe_apply_numa_binding_to_current_process(
            gpu_index=device.index, numa_options=NumaOptions(AffinityMode(mode), should_fall_back_if_binding_fails=True))
    cpus = sorted(os.sched_getaffinity(0))
    return f"{len(cpus)} cores: {cpus[0]}-{cpus[-1]}" if cpus else "none"


def worker(a, variant) -> list[dict]:
    """Every micro-batch count of `a.counts` in turn on one set of processes; rank 0 also appends each
    row to `a.partial` as it is measured, so a set stopped by its time limit keeps the counts it ran."""
    import faulthandler
    import gc

    import torch
    import torch.distributed as dist

    from plait.config import ParallelConfig
    from plait.launch import init_distributed

    # a set that hangs prints every rank's Python stack before its time limit stops it
    faulthandler.dump_traceback_later(max(a.timeout - 15, 5), exit=False)

    plait_pp = variant.startswith("plait") and variant != "plait-zero3"
    dims = init_distributed(ParallelConfig(nproc=a.gpus, pp=a.gpus if plait_pp else 1, timeout_s=900), a.device)
    device = dims.device
    bound = None
    if a.cpu_bind != "none":  # every rank's cores: whether the binding took, and where
        every = [None] * dims.world_size
        dist.all_gather_object(every, _bind_cpus(a.cpu_bind, device))
        bound = {"mode": a.cpu_bind, "cpus_per_rank": every}
    rows, built = [], {}
    for m in a.counts:
        am = argparse.Namespace(**{**vars(a), "microbatches": m})
        try:
            row = _one_count(am, variant, dims, device, built)
        except Exception as e:  # noqa: BLE001 (a failure every rank meets alike costs one row)
            row = {"variant": variant, "microbatches": m,
                   "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                   "peak_mem_gb": (torch.cuda.max_memory_allocated(device) / 1e9) if device.type == "cuda" else 0.0}
        if bound is not None:
            row["cpu_bind"] = bound
        rows.append(row)
        if dims.rank == 0:
            print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
            if a.partial:
                with open(a.partial, "a") as f:
                    f.write(json.dumps(row) + "\n")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if "error" in row:
            break  # a larger count needs more memory still
    built.clear()
    _cleanup(device)
    faulthandler.cancel_dump_traceback_later()
    return rows


def _table(result) -> str:
    rows = result["rows"]
    lines = [f"{result['card']}, {result['gpus']} GPUs, torch {result['torch']}, {result['config']['preset']} "
             f"{result['config']['model']}, seq {result['config']['seq']}, micro-batch {result['config']['micro_batch']}",
             f"{'variant':18} {'m':>3} {'tok/s/GPU':>10} {'MFU':>6} {'peak GB':>8} {'bubble':>7} {'replay':>7} {'sim.':>6} {'vs torch':>9} {'vs z3':>6}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['variant']:18} {r['microbatches']:3} ERROR {r['error']}")
            continue
        tok = r["tokens_per_s_per_gpu"]
        peer = next((p for p in rows if p["variant"] == r["variant"].replace("plait", "torch") and "error" not in p
                     and p["microbatches"] == r["microbatches"] and p is not r), None)
        mfu = f"{100 * r['mfu']:5.1f}%" if r.get("mfu") else "   n/a"
        bub = f"{100 * r['measured_bubble']:6.1f}%" if "measured_bubble" in r else f"{'':7}"
        sim = f"{100 * r['simulated_bubble']:5.1f}%" if "simulated_bubble" in r else f"{'':6}"
        rep = f"{100 * r['replayed_bubble']:6.1f}%" if "replayed_bubble" in r else f"{'':7}"
        z3 = next((p for p in rows if p["variant"] == "plait-zero3" and "error" not in p
                   and p["microbatches"] == r["microbatches"]), None)
        vs = f"{tok / peer['tokens_per_s_per_gpu']:8.2f}x" if peer else f"{'':9}"
        vz = f"{tok / z3['tokens_per_s_per_gpu']:5.2f}x" if z3 else ""
        lines.append(f"{r['variant']:18} {r['microbatches']:3} {tok:10.0f} {mfu} {r['peak_mem_gb_max_rank']:8.1f} "
                     f"{bub} {rep} {sim} {vs} {vz}")
        sp = r.get("split") or {}
        if sp:
            lines.append(f"{'':22}stages {sp['stage_layers']}: {sp['stage_ms']} ms a micro-batch"
                         + (f"; {sp['suggested_stage_layers']} would give {sp['suggested_stage_ms']}"
                            if "suggested_stage_layers" in sp else ""))
        if r.get("host_share"):
            lines.append(f"{'':22}host share per rank: {' / '.join(f'{h:.2f}' for h in r['host_share'])}")
        alloc = r.get("allocator_per_step")
        if isinstance(alloc, list) and any(x["device_allocs"] or x["device_frees"] or x["alloc_retries"] for x in alloc):
            lines.append(f"{'':22}cudaMalloc / cudaFree / retries a step, per rank: " + ", ".join(
                f"{x['device_allocs']:g}/{x['device_frees']:g}/{x['alloc_retries']:g}" for x in alloc))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=0, help="processes = pipeline stages (default: every visible GPU)")
    ap.add_argument("--preset", default="8b")
    ap.add_argument("--model", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--microbatches", default="8", help="micro-batches a step; several, comma-separated, run in "
                    "turn on each variant's processes (e.g. 4,8,16,32)")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default=",".join(ALL))
    ap.add_argument("--stage-layers", default="", help="layers per stage for plait and torch alike: balance (every "
                    "schedule; the output head's cost counted) or counts per rank for v = 1 schedules, e.g. 9,7")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tag", default="")
    ap.add_argument("--out")
    ap.add_argument("--png-dir", default="", help="draw each plait variant's measured timeline here")
    ap.add_argument("--timeout", type=float, default=900, help="seconds a variant may take before it is stopped")
    ap.add_argument("--cpu-bind", default="none", choices=["none", "node", "socket", "exclusive", "core-complex"],
                    help="bind each rank's threads to the CPUs by its GPU (torch's NUMA binding; needs numactl)")
    a = ap.parse_args(argv)
    a.variants = [v for v in a.variants.split(",") if v]
    a.counts = sorted(int(m) for m in a.microbatches.split(",") if m)
    a.microbatches = a.counts[0]

    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("no GPU visible; use --device cpu --preset tiny --no-compile --gpus 4 for a smoke test")
    a.gpus = a.gpus or (torch.cuda.device_count() if a.device == "cuda" else 4)
    card = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    name = f"pp-{card_slug(card)}-{a.gpus}gpu" + (f"-{a.tag}" if a.tag else "")
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"{name}.json"
    from plait.planner.recorded import HEAD_WGRAD, RUNTIME_MARKS, WGRAD_RUNTIME

    result = {"benchmark": "pipeline", **RUNTIME_MARKS,
              "wgrad": WGRAD_RUNTIME, "card": card, "gpus": a.gpus, "torch": torch.__version__,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())) if a.device == "cuda" else None,
              "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", "bench/pipeline.py"] + (argv or sys.argv[1:])),
              "config": {"preset": a.preset, "model": a.model, "seq": a.seq, "micro_batch": a.micro_batch,
                         "stage_layers": a.stage_layers, "microbatches": a.counts,
                         "steps": a.steps, "warmup": a.warmup, "compile": a.compile, "cpu_bind": a.cpu_bind,
                         "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                         # where plait's last stage runs its output head and loss (plait/parallel/pipeline.py)
                         "head_slot": "backward",
                         # a zero-bubble last stage forms the output matrix's gradient in its W (plait/loss.py)
                         "head_wgrad": HEAD_WGRAD}, "rows": []}
    a.partial = str(out.with_suffix(".partial.jsonl"))
    Path(a.partial).unlink(missing_ok=True)

    def recover(variant):  # the counts a stopped set measured before its time ran out
        part = Path(a.partial)
        return [r for r in map(json.loads, part.read_text().splitlines()) if r["variant"] == variant] if part.exists() else []

    def failed(variant):  # the row of the count that was running
        done = {r["microbatches"] for r in recover(variant)}
        return {"microbatches": next((m for m in a.counts if m not in done), a.counts[-1])}

    code = run_variants(worker, a, a.variants, result, out, failed, _table, timeout_s=a.timeout, recover=recover)
    Path(a.partial).unlink(missing_ok=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
