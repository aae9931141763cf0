"""Data-parallel training throughput: plait DDP and ZeRO-1/2/3 against torch DDP and FSDP2.

    python bench/data_parallel.py                      # every visible GPU, the 1b preset, seq 2048

Same model code (plait's Transformer with its fused loss), same batch (seeded random tokens, a
different slice per rank), same run: each variant runs in its own set of G worker processes, from a
fresh model and with the same compile treatment, so the figures (memory included) compare directly.
plait on one GPU runs first in a process of its own and gives the weak-scaling efficiency: tokens/s/GPU at G
GPUs over tokens/s on one (same micro-batch per GPU). `--accum N` runs N micro-batches per GPU a
step (gradient accumulation) in every variant.

  plait-1gpu    plait's single-device step: bf16 parameters, fp32 masters, compiled blocks, fused AdamW
  plait-ddp     plait.parallel DDP: bucketed all-reduce from backward hooks, bf16 gradients, the
                embedding's gradient sent as the rows a step touched where that is fewer bytes
                (parallel.embedding_rows auto)
  plait-ddp-dense  the same with the embedding's dense gradient all-reduced (embedding_rows off)
  plait-zero1   optimizer state sharded; reduce-scatter + all-gather after backward
  plait-zero2   + gradients: buckets reduce-scattered during backward
  plait-zero3   + parameters, per block, prefetched; bf16 on the wire both ways
  plait-zero3-cast-once   the same, each unit's bf16 chunk kept from its first gather of a step to
                the update (parallel.zero3_cast_once): for --accum > 1
  plait-zero3-fp8-gather  ZeRO-3 with the blocks' weights gathered in FP8 (parallel.zero3_fp8_gather):
                with --fp8 tensorwise, beside plait-zero3 under the same --fp8
  torch-ddp     DistributedDataParallel: fp32 parameters, bf16 autocast, fp32 gradient all-reduce,
                fused AdamW (the standard recipe; its gradients are twice plait's bytes)
  fsdp2         fully_shard per block and root, MixedPrecisionPolicy(bf16 params, bf16 reduce), fp32
                sharded parameters as masters, fused AdamW (as plait and torchtitan)
Every variant clips at 1.0 and logs its loss each step (one host sync), as the trainer does.

Writes bench/results/dp-<card>-<G>gpu.json (card, torch and NCCL versions, date, config, one row per
variant: tokens/s/GPU, MFU at 989 TFLOP/s bf16 (plait.metrics), peak memory per GPU, bytes sent per
GPU per step for plait; on GPUs each rank's host share of the blocks' forwards under ZeRO-3,
`plait.host_share`, which `plait plan --check` reads as the pipeline's), then prints a table.
Budget on 2 GPUs: under 8 minutes (compile included).
`--device cpu --preset tiny --no-compile` runs the same code over gloo on a CPU as a smoke test.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PLAIT = ["plait-ddp", "plait-ddp-dense", "plait-zero1", "plait-zero2", "plait-zero3", "plait-zero3-cast-once", "plait-zero3-fp8-gather"]
ALL = PLAIT + ["fsdp2", "torch-ddp"]  # torch DDP (fp32 params + grads) needs the most memory: last
# cast-once differs from plait-zero3 only with --accum > 1; the FP8 gather needs --fp8 tensorwise
DEFAULT = [v for v in ALL if v not in ("plait-ddp-dense", "plait-zero3-cast-once", "plait-zero3-fp8-gather")]


def card_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; anything unknown -> its words joined by dashes."""
    m = re.search(r"\b([A-Z]+\d{2,4}[A-Z]?)\b", name.replace("NVIDIA", ""))
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")).lower()


def _model_section(a) -> dict:
    """The preset plus any `--model key=value` overrides (e.g. n_layers=4: an 8b-shaped model that fits one GPU)."""
    return {"preset": a.preset, "max_seq_len": max(a.seq, 64), **dict(kv.split("=", 1) for kv in a.model)}


def _model_cfg(a):
    from plait.config import build_config

    return build_config({"model": _model_section(a)}).model


def _batch(a, vocab, rank, device):
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    rows = torch.randint(0, vocab, (a.micro_batch, a.seq + 1), generator=g)
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


def _adamw(model, fused: bool):
    import torch

    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    kw = {"fused": True} if fused else {}
    return torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, **kw)


def _plait_step(a, variant, device, comm):
    """A step function for plait on one device (comm None) or under a data-parallel engine."""
    import torch

    from plait.config import build_config
    from plait.parallel.build import parallelize

    zero = {"plait-1gpu": 0, "plait-ddp": 0, "plait-ddp-dense": 0, "plait-zero1": 1, "plait-zero2": 2, "plait-zero3": 3,
            "plait-zero3-cast-once": 3, "plait-zero3-fp8-gather": 3}[variant]
    cfg = build_config({"model": _model_section(a),
                        "train": {"lr": 1e-4, "warmup_steps": 0, "recompute": a.recompute, "fp8": a.fp8},
                        "parallel": {"zero": zero, "bucket_mb": a.bucket_mb,
                                     "overlap_ctas": a.overlap_ctas if zero == 0 else 0,
                                     "embedding_rows": "off" if variant == "plait-ddp-dense" else "auto",
                                     "zero3_cast_once": variant == "plait-zero3-cast-once",
                                     "zero3_fp8_gather": variant == "plait-zero3-fp8-gather"}})
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    par = parallelize(cfg, comm, device, dtype, compile=a.compile)
    x, y = _batch(a, cfg.model.vocab_size, par.data_rank, device)

    def step():  # `accum` micro-batches a step: the engine reduces as its stage does (ZeRO-2/3 each one)
        return par.runner.step([(x, y)] * a.accum, 1e-4)[0]

    return step, (par.model, par.engine)


def _torch_step(a, variant, device, dims):
    import torch
    import torch.distributed as dist

    from plait.model import build_model
    from plait.parallel.build import apply_compile

    mcfg = _model_cfg(a)
    model = build_model(mcfg, 0, device)  # fp32: torch's recipes keep fp32 parameters
    if a.compile:  # blocks compiled on their own, module hooks (FSDP2's) left outside, as for plait
        apply_compile(model, hooks_outside=True)
    cuda = device.type == "cuda"
    if variant == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[device] if cuda else None, bucket_cap_mb=a.bucket_mb,
                                          gradient_as_bucket_view=True)
        opt = _adamw(model, fused=cuda)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = dims.submesh("dp_shard")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else torch.float32,
                                  reduce_dtype=torch.bfloat16 if cuda else torch.float32)
        for block in model.layers.values():
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        wrapped, opt = model, _adamw(model, fused=cuda)  # fused on GPU, as plait and torchtitan
    x, y = _batch(a, mcfg.vocab_size, dist.get_rank(), device)

    import contextlib

    def step():  # `accum` micro-batches: DDP reduces only the last (no_sync before it, its own recipe);
        # FSDP2 reduce-scatters every one, as torchtitan leaves it (skipping would keep whole gradients)
        for i in range(a.accum):
            quiet = wrapped.no_sync() if variant == "torch-ddp" and i < a.accum - 1 else contextlib.nullcontext()
            with quiet:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                    loss = wrapped(x, y) / a.accum
                loss.backward()
        loss = loss * a.accum
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach().float()
        dist.all_reduce(loss)  # the global mean loss, as plait's engines log it (same small all-reduce)
        return loss / dist.get_world_size()

    return step, (wrapped, opt)


def _measure(a, variant, step, device, ledger=None, tokens_per_gpu_step: float | None = None) -> dict:
    """Warm up, then time `a.steps` steps (median), each with the loss's host sync a logging loop
    pays; tokens/s/GPU from `tokens_per_gpu_step` (default a micro-batch of sequences per GPU)."""
    import torch

    from plait.metrics import flops_per_token, peak_flops, peak_memory_bytes

    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    for _ in range(a.warmup):
        step().item()
    warm = time.perf_counter() - t0
    if cuda:  # steady-state peak: compile-time scratch (autotuning, graph capture) is not training memory
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    if ledger is not None:
        ledger.reset()
    before = _allocator_counts(device)
    times, losses = [], []
    for _ in range(a.steps):
        t = time.perf_counter()
        loss = step().item()  # the host sync a training loop that logs every step pays too
        times.append(time.perf_counter() - t)
        losses.append(loss)
        if ledger is not None:
            ledger.step()
    med = statistics.median(times)
    after = _allocator_counts(device)
    tok_s = (tokens_per_gpu_step or a.micro_batch * a.seq * getattr(a, "accum", 1)) / med
    peak = peak_flops(device, torch.bfloat16) if cuda else None
    row = {"variant": variant, "step_s_median": med, "step_s_min": min(times), "tokens_per_s_per_gpu": tok_s,
           "mfu": tok_s * flops_per_token(_model_cfg(a), a.seq) / peak if peak else None,
           "peak_mem_gb": (torch.cuda.max_memory_allocated(device) if cuda else peak_memory_bytes(device)) / 1e9,
           "warmup_and_compile_s": warm, "loss": loss,
           "losses": losses}  # every variant trains the same model on the same tokens: these must agree
    if before is not None:  # a steady step reuses cached blocks: device calls here stall the host
        row["allocator_per_step"] = {k: (after[k] - before[k]) / a.steps for k in before}
    if ledger is not None and ledger.steps:
        row["comm_gb_per_step"] = sum(d["sent_bytes"] for d in ledger.summary().values()) / 1e9
    if getattr(a, "profile", 0) and cuda:
        try:  # a profiler failure must not cost the row its timing
            row["gpu_time"] = _profile(a, step, variant)
        except Exception as e:  # noqa: BLE001 (reported in the row)
            row["gpu_time_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return row


def _allocator_counts(device) -> dict | None:
    """The CUDA caching allocator's calls into the driver so far (cudaMalloc, cudaFree) and its
    retries after a failed allocation (each frees cached blocks: a device sync); None on CPU."""
    import torch

    if device.type != "cuda":
        return None
    st = torch.cuda.memory_stats(device)
    return {"device_allocs": st.get("num_device_alloc", 0), "device_frees": st.get("num_device_free", 0),
            "alloc_retries": st.get("num_alloc_retries", 0)}


def _profile(a, step, variant: str = "step") -> dict:
    """`a.profile` more steps under torch.profiler -> this rank's GPU time per step split into
    compute, exposed and overlapped communication, and idle (plait.gpu_time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from plait.gpu_time import kernels_of, split

    host = bool(getattr(a, "trace_host", False))  # the host's side too: its ops and Python calls
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host else [])
    with profile(activities=acts, with_stack=host) as prof:
        for _ in range(a.profile):
            step().item()
        torch.cuda.synchronize()
    if getattr(a, "trace_dir", None):  # every rank's: a collective waits for the last rank to reach it
        _write_trace(prof, Path(a.trace_dir) / f"{variant}-rank{torch.distributed.get_rank()}.json.gz")
    return split(kernels_of(prof), a.profile)


def _write_trace(prof, path: Path) -> None:
    """The profiled steps' Chrome trace (streams as rows: when each gather ran against the compute
    beside it), gzipped; open it in https://ui.perfetto.dev."""
    import gzip
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        prof.export_chrome_trace(tmp.name)
        path.write_bytes(gzip.compress(Path(tmp.name).read_bytes()))


def run_variants(worker, a, variants, result: dict, out: Path, failed, table, timeout_s: float = 900,
                 recover=None) -> int:
    """Each variant in its own set of `a.gpus` processes (clean memory peaks), `worker(a, variant)`
    returning rank 0's rows; a variant that fails gets the rows `recover(variant)` finds it left (if
    given), then one row, `failed(variant)` plus the error. The JSON is rewritten after every variant,
    so a run cut short keeps what it measured."""
    from plait.launch import spawn

    t0 = time.perf_counter()
    for variant in variants:
        try:
            rows = spawn(worker, (a, variant), a.gpus, device_type=a.device, timeout_s=timeout_s)[0]
        except Exception as e:  # noqa: BLE001 - keep what was measured; say what failed
            rows = (recover(variant) if recover else []) + [
                {"variant": variant, **failed(variant), "error": str(e).splitlines()[0][:300]}]
        result["rows"] += rows
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**result, "wall_s": time.perf_counter() - t0}, indent=1))
    result["wall_s"] = time.perf_counter() - t0
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out} in {result['wall_s']:.0f} s\n" + table(result))
    return 0


def _release(keep) -> None:
    """Remove plait's engine hooks (`Engine.close`) from what a variant kept alive: the hooks live in
    autograd's C++ graph, so without this the model and its optimizer state outlive the variant."""
    for k in keep if isinstance(keep, (tuple, list)) else (keep,):
        if hasattr(k, "close"):
            k.close()


def _cleanup(device) -> None:
    """Drop the last variant: compiled code (so no variant inherits another's graphs or holds its
    tensors), garbage (engines and their hooks form cycles), cached GPU memory, the peak counter."""
    import torch

    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def single(a) -> dict:
    """plait on one device, no process group (what `plait train` does with one GPU)."""
    import torch

    device = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # memory statistics need an initialised device
        torch.cuda.reset_peak_memory_stats(device)
    step, _ = _plait_step(a, "plait-1gpu", device, None)
    return _measure(a, "plait-1gpu", step, device)


def _brackets_hooks(a, variant: str) -> bool:
    """Whether a block's module hooks run outside its compiled graph, where `plait.host_share` can
    bracket them: ZeRO-3 compiles each block's `forward` only (its gathers are hooks); the other
    engines compile the whole module call, whose hooks a bracket added now would recompile."""
    return variant.startswith("plait-zero3") or not a.compile


def _forward_host_share(a, step, model, device) -> float | None:
    """After the timed steps, `a.host_share_steps` more with each block's forward bracketed
    (`plait.host_share`): this rank's host seconds issuing the blocks' forwards over the GPU's
    seconds running them. GPUs only: on a CPU both clocks are the host's."""
    from plait.host_share import ForwardHostShare

    if device.type != "cuda" or not getattr(a, "host_share_steps", 0):
        return None
    with ForwardHostShare(model.layers.values(), device) as hs:
        for _ in range(a.host_share_steps):
            step().item()
    return hs.share()


def worker(a) -> list[dict]:
    """Every variant in turn on this rank; rows as measured here (rank 0's are reported)."""
    import torch
    import torch.distributed as dist

    from plait.comm import Comm, Ledger
    from plait.config import ParallelConfig
    from plait.launch import init_distributed

    dims = init_distributed(ParallelConfig(nproc=a.gpus, timeout_s=300, bind_cpus=a.bind_cpus), a.device)
    device = dims.device
    rows = []
    for variant in a.variants:
        ledger = Ledger() if variant in PLAIT else None
        # what an earlier variant left allocated would inflate this one's peak: record it
        leftover = torch.cuda.memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0
        try:  # a failure every rank meets alike (compile, OOM at build) costs one row, not the run
            if variant in PLAIT:
                step, keep = _plait_step(a, variant, device, Comm(dims, ledger))
            else:
                step, keep = _torch_step(a, variant, device, dims)
            row = _measure(a, variant, step, device, ledger)
            if variant in ("plait-ddp", "plait-ddp-dense"):  # what parallel.embedding_rows decided
                row["embedding_rows"] = getattr(keep[1], "rows", None) is not None
            if variant in PLAIT and device.type == "cuda" and a.host_share_steps and _brackets_hooks(a, variant):
                # every rank's, as the pipeline's: the slowest host paces the collectives
                share = _forward_host_share(a, step, keep[0], device)
                got = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
                mine = float("nan") if share is None else share
                dist.all_gather_into_tensor(got, torch.tensor([mine], dtype=torch.float64, device=device))
                row["host_share"] = [round(x, 3) for x in got.tolist()]
            _release(keep)
            del step, keep
        except Exception as e:  # noqa: BLE001 (reported in the row)
            row = {"variant": variant, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
            row["peak_mem_gb"] = 0.0
        row["leftover_gb_at_start"] = leftover
        row["cpus_rank0"] = len(os.sched_getaffinity(0)) if dims.rank == 0 else None  # the binding it ran under
        peak = torch.tensor([row["peak_mem_gb"]], dtype=torch.float64, device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        row["peak_mem_gb_max_rank"] = peak.item()
        rows.append(row)
        if dims.rank == 0:
            print(json.dumps(row), flush=True)
        _cleanup(device)
        dist.barrier()
    return rows


def _table(result) -> str:
    base = next((r for r in result["rows"] if r["variant"] == "plait-1gpu" and "error" not in r), None)
    fsdp2 = next((r for r in result["rows"] if r["variant"] == "fsdp2" and "error" not in r), None)
    lines = [f"{result['card']}, {result['gpus']} GPU(s), torch {result['torch']}, NCCL {result['nccl']}, "
             f"preset {result['config']['preset']}, seq {result['config']['seq']}, micro-batch "
             f"{result['config']['micro_batch']} per GPU",
             f"{'variant':22} {'tok/s/GPU':>10} {'MFU':>6} {'peak GB':>8} {'comm GB':>8} {'scaling':>8} {'vs FSDP2':>9}"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"{r['variant']:22} ERROR {r['error']}")
            continue
        tok = r["tokens_per_s_per_gpu"]
        mfu = f"{100 * r['mfu']:5.1f}%" if r.get("mfu") else "   n/a"
        comm = f"{r['comm_gb_per_step']:8.2f}" if "comm_gb_per_step" in r else f"{'':8}"
        scale = f"{100 * tok / base['tokens_per_s_per_gpu']:7.1f}%" if base and r is not base else f"{'':8}"
        vs = f"{tok / fsdp2['tokens_per_s_per_gpu']:8.2f}x" if fsdp2 else ""
        lines.append(f"{r['variant']:22} {tok:10.0f} {mfu} {r.get('peak_mem_gb_max_rank', r['peak_mem_gb']):8.1f} "
                     f"{comm} {scale} {vs}")
        if "gpu_time" in r:
            g = r["gpu_time"]
            lines.append(f"{'':12} per step: compute {g['compute_ms']:.1f} ms, communication exposed "
                         f"{g['exposed_comm_ms']:.1f} / overlapped {g['overlapped_ms']:.1f} ms, idle {g['idle_ms']:.1f} ms")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=0, help="processes (default: every visible GPU)")
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--model", action="append", default=[], metavar="KEY=VALUE",
                    help="override a model field of the preset (repeatable), e.g. --model n_layers=4")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per GPU per step")
    ap.add_argument("--accum", type=int, default=1,
                    help="micro-batches per GPU per step (gradient accumulation; each GPU sees micro-batch x accum)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile happens here)")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--overlap-ctas", type=int, default=0,
                    help="plait DDP: SMs its overlapped gradient all-reduce may take (parallel.overlap_ctas; 0 = NCCL's "
                         "choice; the ZeRO variants keep 0)")
    ap.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                    help="plait's activation recomputation (train.recompute); the torch peers keep everything")
    ap.add_argument("--fp8", default="off", choices=["off", "tensorwise", "rowwise"],
                    help="plait's FP8 matmuls in the blocks (train.fp8) for every plait variant; the torch peers stay bf16")
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="after timing, profile K more steps: GPU time split into compute, exposed and "
                         "overlapped communication, idle (a 'gpu_time' entry in each row)")
    ap.add_argument("--bind-cpus", default="auto", choices=["auto", "off"],
                    help="parallel.bind_cpus: each rank's host threads on cores of their own (auto) or the OS's choice")
    ap.add_argument("--host-share-steps", type=int, default=2, metavar="K",
                    help="after timing, K more steps measuring each rank's host share of the blocks' forwards (ZeRO-3) "
                    "(host seconds issuing over GPU seconds running; >= ~1: host-bound, as plan --check marks it); 0: skip")
    ap.add_argument("--trace-dir", help="with --profile: each rank's Chrome trace of the profiled steps, one "
                    "gzipped file a variant and rank, here")
    ap.add_argument("--trace-host", action="store_true",
                    help="with --trace-dir: record the host's ops and Python calls too (where issuing a step goes)")
    ap.add_argument("--variants", default=",".join(DEFAULT))
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--no-single", dest="single", action="store_false", help="skip the 1-GPU baseline")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", help="result file (default bench/results/dp-<card>-<G>gpu.json)")
    ap.add_argument("--child-single", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.variants = [v for v in a.variants.split(",") if v]
    if "plait-zero3-fp8-gather" in a.variants and a.fp8 != "tensorwise":
        ap.error("plait-zero3-fp8-gather gathers the FP8 its tensorwise matmuls read: add --fp8 tensorwise")
    if a.accum < 1:
        ap.error(f"--accum {a.accum}: give the micro-batches per GPU per step, 1 or more")
    bad = [kv for kv in a.model if "=" not in kv]
    if bad:
        ap.error(f"--model {bad[0]!r}: write KEY=VALUE, e.g. --model n_layers=4")
    unknown = set(a.variants) - set(ALL)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {','.join(ALL)}")
    if a.child_single:
        print("RESULT " + json.dumps(single(a)), flush=True)
        return 0

    import torch

    from plait.launch import spawn

    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("no GPU visible; use --device cpu --preset tiny --no-compile for a smoke test")
    a.gpus = a.gpus or (torch.cuda.device_count() if a.device == "cuda" else 2)
    card = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if a.device == "cuda" else None
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"dp-{card_slug(card)}-{a.gpus}gpu.json"
    from plait.planner.recorded import RUNTIME_MARKS

    result = {"benchmark": "data_parallel", **RUNTIME_MARKS, "card": card, "gpus": a.gpus, "torch": torch.__version__, "nccl": nccl,
              "date": time.strftime("%Y-%m-%d"), "config": {"preset": a.preset, "model": a.model, "seq": a.seq, "micro_batch": a.micro_batch,
              "accum": a.accum, "steps": a.steps, "warmup": a.warmup, "bucket_mb": a.bucket_mb, "overlap_ctas": a.overlap_ctas,
              "embedding_rows": "auto (plait-ddp-dense: off; each DDP row says what auto chose)",
              "compile": a.compile, "recompute": a.recompute, "fp8": a.fp8, "bind_cpus": a.bind_cpus,
              "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}, "rows": []}
    t0 = time.perf_counter()
    if a.single:  # its own process: nothing of it stays on GPU 0 while the workers run
        cmd = [sys.executable, __file__, "--child-single"] + [x for x in (argv or sys.argv[1:]) if x != "--child-single"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        row = json.loads(line[-1][7:]) if line else {"variant": "plait-1gpu",
                                                     "error": (r.stderr.strip().splitlines() or ["?"])[-1][:300]}
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
    # one set of worker processes per variant: an engine, its hooks and compiled graphs hold GPU
    # memory until the process ends, which would inflate the next variant's peak
    for variant in a.variants:
        one = argparse.Namespace(**{**vars(a), "variants": [variant]})
        try:
            rows = spawn(worker, (one,), a.gpus, device_type=a.device)[0]
        except Exception as e:  # keep what was measured; say what failed
            rows = [{"variant": variant, "error": str(e).splitlines()[0][:300]}]
        result["rows"] += rows
    result["wall_s"] = time.perf_counter() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out} in {result['wall_s']:.0f} s\n" + _table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
