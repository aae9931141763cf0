"""Tensor-parallel training throughput: plait's TP (with and without SP) against torch's own TP.

    python bench/tensor_parallel.py                       # every visible GPU, the 8b preset, seq 2048

Every variant trains the same model on the same global batch (`--global-batch` sequences a step,
split over the data-parallel ranks; tensor-parallel ranks share theirs), each in its own set of G
worker processes, so peak memory compares directly.

  plait-tp1-z3      plait ZeRO-3 over all G GPUs (no tensor parallelism): the baseline
  plait-tpT[-sp]    plait TP of degree T (without / with sequence parallelism) x DP G/T with
                    ZeRO-1 over DP; vocab-parallel fused loss; compiled blocks; fused flat AdamW
  plait-tpT-sp-sel  the same with selective recomputation (its cost in throughput)
  torch-tpT         torch's tensor parallelism the way torchtitan applies it to Llama:
                    parallelize_module with ColwiseParallel / RowwiseParallel / SequenceParallel
                    (norms and residuals sequence-sharded), vocab-parallel embedding and output with
                    loss_parallel cross-entropy; blocks compiled; FSDP2 (fully_shard per block, bf16
                    params, fp32 reduce) over DP for mixed precision and 2D; fused AdamW
A tied model (the 1b preset) is untied by torch's parallelize_module (each module's weight becomes
its own DTensor), so compare on untied shapes (8b, 70b); on those the per-step losses of plait and
torch agree (to 1e-7 in fp32 on CPU).
Rows: tokens/s/GPU, MFU at 989 TFLOP/s bf16 (plait.metrics), peak memory per GPU (max over ranks),
bytes plait sends per GPU per step, the per-step losses (every variant starts from the same weights
and sees the same tokens, so these agree to bf16 rounding).

Writes bench/results/tp-<card>-<G>gpu[-<tag>].json and prints a table.
`--device cpu --preset tiny --no-compile --gpus 4` runs the same code over gloo as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from data_parallel import _adamw, _cleanup, _measure, _model_cfg, _model_section, card_slug, run_variants  # noqa: E402

DEFAULT = ["plait-tp1-z3", "plait-tp2-sp", "plait-tp2", "plait-tp4-sp", "plait-tp4", "plait-tp4-sp-sel",
           "torch-tp2", "torch-tp4"]


def layout(variant: str, gpus: int) -> dict:
    """tp, sp, zero, recompute of a variant name."""
    parts = variant.split("-")
    tp = int(parts[1][2:])
    return {"tp": tp, "sp": "sp" in parts, "zero": 3 if "z3" in parts else (1 if gpus // tp > 1 else 0),
            "recompute": "selective" if "sel" in parts else "none", "torch": parts[0] == "torch"}


def _batch(a, vocab, dp_rank, dp, device):
    import torch

    per = a.global_batch // dp
    g = torch.Generator().manual_seed(1000 + dp_rank)
    rows = torch.randint(0, vocab, (per, a.seq + 1), generator=g)
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


def _plait_step(a, lay, dims, device, comm):
    import torch

    from plait.config import build_config
    from plait.parallel.build import parallelize

    cfg = build_config({"model": _model_section(a), "train": {"lr": 1e-4, "warmup_steps": 0, "recompute": lay["recompute"],
                                                              "fp8": a.fp8},
                        "parallel": {"zero": lay["zero"], "tp": lay["tp"], "sp": "on" if lay["sp"] else "off"}})
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    par = parallelize(cfg, comm, device, dtype, compile=a.compile)
    x, y = _batch(a, cfg.model.vocab_size, par.data_rank, par.data_size, device)

    def step():
        return par.runner.step([(x, y)], 1e-4)[0]

    return step, (par,)


def _torch_step(a, lay, dims, device):
    """torch TP on plait's module tree (names as torchtitan's Llama plan), FSDP2 over dp."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, loss_parallel, parallelize_module)

    from plait.model import build_model

    mcfg = _model_cfg(a)
    model = build_model(mcfg, 0, device)  # fp32: FSDP2 keeps fp32 shards as masters, computes in bf16
    tp_mesh, dp_mesh = dims.submesh("tp"), dims.submesh("dp_shard")
    parallelize_module(model, tp_mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attn_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None, None, None),  # x, cos, sin, kv, docs
                                       desired_input_layouts=(Replicate(), None, None, None, None)),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
            "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    cuda = device.type == "cuda"
    if a.compile:
        for block in model.layers.values():
            block.compile()
    class Logits(torch.nn.Module):
        """tokens -> (B, T, V) logits sharded over tp along the vocabulary, through the modules
        (so that their TP and FSDP hooks run)."""

        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, tokens):
            return self.lm.output(self.lm.norm(self.lm.hidden(tokens)))

    wrapped = Logits(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else torch.float32, reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp)
    fully_shard(wrapped, mesh=dp_mesh, mp_policy=mp)
    opt = _adamw(model, fused=cuda)
    x, y = _batch(a, mcfg.vocab_size, dims.my_coords()["dp_shard"], dims.dp_shard, device)

    def step():
        with loss_parallel():
            logits = wrapped(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach().float()
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        dist.all_reduce(loss)  # the global mean loss, as plait logs it
        return loss / dist.get_world_size()

    return step, (model, opt)


def worker(a, variant) -> list[dict]:
    import torch
    import torch.distributed as dist

    from plait.comm import Comm, Ledger
    from plait.config import ParallelConfig
    from plait.launch import init_distributed

    lay = layout(variant, a.gpus)
    dims = init_distributed(ParallelConfig(nproc=a.gpus, tp=lay["tp"], timeout_s=600), a.device)
    device = dims.device
    ledger = None if lay["torch"] else Ledger()
    try:
        if lay["torch"]:
            step, keep = _torch_step(a, lay, dims, device)
        else:
            step, keep = _plait_step(a, lay, dims, device, Comm(dims, ledger))
        row = _measure(a, variant, step, device, ledger, a.global_batch * a.seq / a.gpus)
        del step, keep
    except Exception as e:  # noqa: BLE001 (a failure every rank meets alike costs one row)
        row = {"variant": variant, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
               "peak_mem_gb": (torch.cuda.max_memory_allocated(device) / 1e9) if device.type == "cuda" else 0.0}
    row.update({k: lay[k] for k in ("tp", "sp", "zero", "recompute")}, dp=a.gpus // lay["tp"])
    peak = torch.tensor([row["peak_mem_gb"]], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    row["peak_mem_gb_max_rank"] = peak.item()
    if dims.rank == 0:
        print(json.dumps(row), flush=True)
    _cleanup(device)
    return [row]


def _table(result) -> str:
    rows = result["rows"]
    base = next((r for r in rows if r["variant"] == "plait-tp1-z3" and "error" not in r), None)
    peers = {r["tp"]: r for r in rows if r["variant"].startswith("torch") and "error" not in r}
    lines = [f"{result['card']}, {result['gpus']} GPUs, torch {result['torch']}, NCCL {result['nccl']}, "
             f"{result['config']['preset']} {result['config']['model']}, seq {result['config']['seq']}, "
             f"global batch {result['config']['global_batch']}",
             f"{'variant':18} {'tok/s/GPU':>10} {'MFU':>6} {'peak GB':>8} {'comm GB':>8} {'vs tp1':>7} {'vs torch':>9}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['variant']:18} ERROR {r['error']}")
            continue
        tok = r["tokens_per_s_per_gpu"]
        mfu = f"{100 * r['mfu']:5.1f}%" if r.get("mfu") else "   n/a"
        comm = f"{r['comm_gb_per_step']:8.2f}" if "comm_gb_per_step" in r else f"{'':8}"
        vs1 = f"{tok / base['tokens_per_s_per_gpu']:6.2f}x" if base else ""
        peer = peers.get(r["tp"])
        vs = f"{tok / peer['tokens_per_s_per_gpu']:8.2f}x" if peer and not r["variant"].startswith("torch") else ""
        lines.append(f"{r['variant']:18} {tok:10.0f} {mfu} {r['peak_mem_gb_max_rank']:8.1f} {comm} {vs1:>7} {vs:>9}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=0, help="processes (default: every visible GPU)")
    ap.add_argument("--preset", default="8b")
    ap.add_argument("--model", action="append", default=[], metavar="KEY=VALUE",
                    help="override a model field of the preset (repeatable), e.g. --model n_layers=8")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--global-batch", type=int, default=8, help="sequences per step, all ranks together")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default=",".join(DEFAULT))
    ap.add_argument("--fp8", default="off", choices=["off", "tensorwise", "rowwise"],
                    help="plait's variants with FP8 linears (train.fp8); the torch peer stays bf16")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tag", default="", help="suffix of the result file")
    ap.add_argument("--out", help="result file (default bench/results/tp-<card>-<G>gpu[-tag].json)")
    a = ap.parse_args(argv)
    a.variants = [v for v in a.variants.split(",") if v]

    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("no GPU visible; use --device cpu --preset tiny --no-compile --gpus 4 for a smoke test")
    a.gpus = a.gpus or (torch.cuda.device_count() if a.device == "cuda" else 4)
    for v in a.variants:
        lay = layout(v, a.gpus)
        if a.gpus % lay["tp"] or a.global_batch % (a.gpus // lay["tp"]):
            ap.error(f"variant {v}: tp must divide the {a.gpus} GPUs and dp the global batch {a.global_batch}")
    card = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if a.device == "cuda" else None
    name = f"tp-{card_slug(card)}-{a.gpus}gpu" + (f"-{a.tag}" if a.tag else "")
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"{name}.json"
    from plait.planner.recorded import RUNTIME_MARKS

    result = {"benchmark": "tensor_parallel", **RUNTIME_MARKS, "card": card, "gpus": a.gpus, "torch": torch.__version__, "nccl": nccl,
              "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", "bench/tensor_parallel.py"] + (argv or sys.argv[1:])),
              "config": {"preset": a.preset, "model": a.model, "seq": a.seq, "global_batch": a.global_batch, "fp8": a.fp8,
                         "steps": a.steps, "warmup": a.warmup, "compile": a.compile}, "rows": []}
    return run_variants(worker, a, a.variants, result, out, lambda v: layout(v, a.gpus), _table)


if __name__ == "__main__":
    sys.exit(main())
