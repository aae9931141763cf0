"""Context-parallel training throughput over sequence length: plait's ring and all-to-all (Ulysses)
attention against torch's `context_parallel` (ring SDPA) under FSDP2, and against no context
parallelism.

    python bench/context_parallel.py --model n_layers=8 --seqs 8192,16384,32768,65536

On G GPUs (default: every visible one), with ZeRO-3 and `--recompute` (default selective):
  plait-cp1          no context parallelism: G data-parallel ranks, each its own sequence
  plait-cpG-ring     one sequence split over the G ranks, K/V blocks passed around the ring
  plait-cpG-ulysses  the same split, heads exchanged for sequence by all-to-all
  plait-cpN-...      CP over N of the G ranks (N divides G), G / N data-parallel groups
  torch-cpG          FSDP2 (bf16 compute, fused AdamW, compiled blocks when the peer compiles)
                     with torch.distributed.tensor.experimental.context_parallel's ring attention
                     over the same G ranks (tokens, targets and the RoPE tables sharded by its
                     head-tail load balancer)
Each variant runs the sequence lengths in increasing order in its own G processes; the first that
runs out of memory ends that variant (the longest that fits is the one before). tokens/s/GPU counts
every token a GPU trains on; MFU counts attention FLOPs (the full square, PaLM's convention).
Every variant trains the same model; the cp1 rows see G x N sequences a step, the others N
(`--micro-batch N`, default 1).

Writes bench/results/cp-<card>-<G>gpu[-<tag>].json and prints a table.
`--device cpu --preset tiny --no-compile --gpus 2 --seqs 64,128` runs the same code over gloo.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from data_parallel import (_adamw, _cleanup, _measure, _model_cfg, _model_section, _release, card_slug,  # noqa: E402
                           run_variants)


def _batch(a, vocab, rank, device):
    import torch

    g = torch.Generator().manual_seed(2000 + rank)
    rows = torch.randint(0, vocab, (a.micro_batch, a.seq + 1), generator=g)
    return rows[:, :-1].to(device).contiguous(), rows[:, 1:].to(device).contiguous()


VARIANT = re.compile(r"(plait-cp1|plait-cp(\d+)-(ring|ulysses)|torch-cp(\d+))$")


def _cp_of(variant: str) -> int:
    """The CP degree a variant names: plait-cp1, plait-cp<N>-ring|ulysses, torch-cp<N>."""
    return int(variant.split("-")[1][2:])


def _variant_error(variant: str, gpus: int) -> str | None:
    """What is wrong with a variant's name on `gpus` GPUs, or None."""
    if not VARIANT.match(variant):
        return "write plait-cp1, plait-cpN-ring, plait-cpN-ulysses or torch-cpG"
    cp = _cp_of(variant)
    if gpus % cp:
        return f"CP {cp} must divide the {gpus} GPUs"
    if variant.startswith("torch") and cp != gpus:
        return f"torch's peer spans all {gpus} GPUs: write torch-cpG"
    return None


def _plait(a, variant, comm, device):
    import torch

    from plait.config import build_config
    from plait.parallel.build import parallelize

    cp = _cp_of(variant)
    cfg = build_config({"model": _model_section(a),
                        "train": {"lr": 1e-4, "warmup_steps": 0, "micro_batch": a.micro_batch, "recompute": a.recompute},
                        "parallel": {"zero": 3, "cp": cp, "cp_impl": variant.split("-")[-1] if cp > 1 else "ring"}})
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    par = parallelize(cfg, comm, device, dtype, compile=a.compile)
    x, y = _batch(a, cfg.model.vocab_size, par.data_rank, device)

    def step():
        return par.runner.step([(x, y)], 1e-4)[0]

    return step, par


def _torch(a, dims, device):
    """FSDP2 over every rank plus torch's context_parallel over the same ranks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.experimental import context_parallel

    from plait.model import build_model
    from plait.parallel.build import apply_compile

    mcfg = _model_cfg(a)
    cuda = device.type == "cuda"
    model = build_model(mcfg, 0, device)  # fp32 parameters, bf16 compute: FSDP2's recipe
    if a.compile:
        apply_compile(model, hooks_outside=True)
    mesh = dims.submesh("cp")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else torch.float32,
                              reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = _adamw(model, fused=cuda)
    x, y = _batch(a, mcfg.vocab_size, 0, device)  # the same sequences on every rank, each split over them
    rope = [model.rope_cos, model.rope_sin]
    assert rope[0].shape[0] == a.seq, "the RoPE tables must be as long as the sequence to be sharded with it"

    def step():
        xs, ys = x.clone(), y.clone()
        with context_parallel(mesh, buffers=[xs, ys, *rope], buffer_seq_dims=[1, 1, 0, 0], no_restore_buffers={xs, ys}):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = model(xs, ys)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach().float()
        dist.all_reduce(loss)
        return loss / dist.get_world_size()

    return step, (model, opt)


def worker(a, variant) -> list[dict]:
    import torch

    from plait.config import ParallelConfig
    from plait.launch import init_distributed

    cp = _cp_of(variant)
    dims = init_distributed(ParallelConfig(nproc=a.gpus, cp=cp, zero=3, timeout_s=900), a.device)
    device = dims.device
    rows = []
    for seq in a.seqs:
        b = copy.copy(a)
        b.seq = seq
        row = _one(b, variant, dims, device, cp)
        if "error" in row and row["error"] != "out of memory" and b.compile and variant.startswith("torch"):
            first = row["error"]  # the peer's compiled blocks failed under its CP dispatcher: run it eagerly
            _cleanup(device)
            b.compile = a.compile = False
            row = _one(b, variant, dims, device, cp)
            row["compiled_error"] = first
        row["compile"] = b.compile
        row.update(seq=seq, cp=cp)
        peak = torch.tensor([row.get("peak_mem_gb", 0.0)], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        row["peak_mem_gb_max_rank"] = peak.item()
        if dims.rank == 0:
            print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
        rows.append(row)
        _cleanup(device)
        if "error" in row:
            break  # longer sequences need more memory still
    return rows


def _one(b, variant, dims, device, cp) -> dict:
    import torch

    from plait.comm import Comm, Ledger

    try:
        if variant.startswith("plait"):
            step, keep = _plait(b, variant, Comm(dims, Ledger(enabled=False)), device)
        else:
            step, keep = _torch(b, dims, device)
        row = _measure(b, variant, step, device, tokens_per_gpu_step=b.micro_batch * b.seq / cp)
        _release(keep)  # else the next sequence length's model finds this one's memory still taken
        del step, keep
        return row
    except Exception as e:  # noqa: BLE001 - every rank meets an out-of-memory alike
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e)
        return {"variant": variant, "error": "out of memory" if oom else
                f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}


def _table(result) -> str:
    rows = result["rows"]
    lines = [f"{result['card']}, {result['gpus']} GPUs, torch {result['torch']}, {result['config']['preset']} "
             f"{result['config']['model']}, ZeRO-3, recompute {result['config']['recompute']}",
             f"{'variant':20} {'seq':>7} {'tok/s/GPU':>10} {'MFU':>6} {'peak GB':>8} {'vs cp1':>7} {'vs torch':>9}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['variant']:20} {r['seq']:7} {r['error']}")
            continue
        tok = r["tokens_per_s_per_gpu"]
        base = next((p for p in rows if p["variant"] == "plait-cp1" and p["seq"] == r["seq"] and "error" not in p), None)
        peer = next((p for p in rows if p["variant"].startswith("torch") and p["seq"] == r["seq"] and "error" not in p
                     and r["variant"].startswith("plait-cp") and r["variant"] != "plait-cp1"), None)
        mfu = f"{100 * r['mfu']:5.1f}%" if r.get("mfu") else "   n/a"
        vb = f"{tok / base['tokens_per_s_per_gpu']:6.2f}x" if base and r is not base else f"{'':7}"
        vt = f"{tok / peer['tokens_per_s_per_gpu']:8.2f}x" if peer else ""
        lines.append(f"{r['variant']:20} {r['seq']:7} {tok:10.0f} {mfu} {r['peak_mem_gb_max_rank']:8.1f} {vb} {vt}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=0, help="processes (default: every visible GPU)")
    ap.add_argument("--preset", default="8b")
    ap.add_argument("--model", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--seqs", default="8192,16384,32768,65536,131072")
    ap.add_argument("--micro-batch", type=int, default=1,
                    help="sequences a data-parallel rank trains per step, as one micro-batch (default 1); "
                         "with G x N on the cp1 rows and N on the cpG rows, N = G gives both one global batch")
    ap.add_argument("--recompute", default="selective", choices=["none", "selective", "full"])
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="after timing, profile K more steps: GPU time split into compute, exposed and "
                         "overlapped communication and idle, with the kernels that took most (plait.gpu_time)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default="plait-cp1,plait-cpG-ring,plait-cpG-ulysses,torch-cpG")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tag", default="")
    ap.add_argument("--out")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a variant's processes may take before they are stopped")
    a = ap.parse_args(argv)

    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("no GPU visible; use --device cpu --preset tiny --no-compile --gpus 2 --seqs 64,128 for a smoke test")
    a.gpus = a.gpus or (torch.cuda.device_count() if a.device == "cuda" else 2)
    a.seqs = sorted(int(s) for s in a.seqs.split(",") if s)
    a.seq = max(a.seqs)
    variants = [v.replace("cpG", f"cp{a.gpus}") for v in a.variants.split(",") if v]
    for v in variants:
        if _variant_error(v, a.gpus):
            ap.error(f"--variants {v!r}: {_variant_error(v, a.gpus)}")
    card = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    name = f"cp-{card_slug(card)}-{a.gpus}gpu" + (f"-{a.tag}" if a.tag else "")
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"{name}.json"
    from plait.planner.recorded import RUNTIME_MARKS

    result = {"benchmark": "context_parallel", **RUNTIME_MARKS, "card": card, "gpus": a.gpus, "torch": torch.__version__,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())) if a.device == "cuda" else None,
              "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(["python", "bench/context_parallel.py"] + (argv or sys.argv[1:])),
              "config": {"preset": a.preset, "model": a.model, "seqs": a.seqs, "micro_batch": a.micro_batch,
                         "recompute": a.recompute,
                         "steps": a.steps, "warmup": a.warmup, "compile": a.compile}, "rows": []}
    return run_variants(worker, a, variants, result, out, lambda v: {"seq": 0}, _table, timeout_s=a.timeout)


if __name__ == "__main__":
    sys.exit(main())
