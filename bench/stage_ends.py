"""What a pipeline's first and last stages run beyond their blocks, measured on one GPU.

Every recorded pipeline run has its first and last stages slower per micro-batch than the middle
ones, which hold as many layers. This times, per micro-batch (forward + backward, gradients left to
accumulate as a step's micro-batches do), four stage-shaped parts of the model built the way a
pipeline rank builds its own: `k` blocks alone (a middle stage), the embedding + `k` blocks (the
first), `k` blocks + final norm + fused output/loss (the last), and all of it (one device). The
differences are the ends' extra milliseconds; with --hardware (a `plait bench calibrate` profile)
the planner's price for the last stage's extra is set beside it (`plait.planner.roofline.head_times`);
--profile prints the kernels of the last stage's extra.

    python bench/stage_ends.py --preset 8b --model vocab_size=8192 --layers 2 --profile \
        --hardware bench/results/hardware-h100.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch


def _part(cfg, layers: int, first: bool, last: bool):
    from plait.model import Transformer
    from plait.parallel.build import apply_compile

    with torch.device("meta"):
        model = Transformer(cfg, layer_ids=list(range(layers)), first=first, last=last)
    model.to_empty(device="cuda")
    model.tie()
    model.init_weights(0)
    model.to(torch.bfloat16)
    apply_compile(model)
    return model


def _step(model, first: bool, last: bool, tokens, targets, h0):
    h = None if first else h0.detach().requires_grad_()
    out = model.hidden(tokens if first else None, h, seq_len=tokens.shape[1])
    if last:
        loss = model.head(out, targets)
        loss.backward()
    else:
        out.backward(torch.ones_like(out))


def _time(model, first, last, tokens, targets, h0, reps: int) -> float:
    for _ in range(3):
        _step(model, first, last, tokens, targets, h0)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        _step(model, first, last, tokens, targets, h0)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _kernels(model, first, last, tokens, targets, h0, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            _step(model, first, last, tokens, targets, h0)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=90)


def planner_head_s(cfg, seq: int, tokens: int, hardware: str) -> float:
    """The planner's forward + backward seconds of the final norm, output projection and loss."""
    from plait.planner import hardware as hw, profile, roofline
    from plait.planner.costs import ModelDims

    c = profile.apply_profile(hw.cluster(profile.load(hardware).gpu, gpus_per_node=1), profile.load(hardware))
    return sum(roofline.head_times(ModelDims.from_config(cfg, seq), tokens, c))


def main() -> int:
    from plait.config import build_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="8b")
    ap.add_argument("--model", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=2, help="blocks in each stage-shaped part")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="kernel table of the last stage and of the middle one")
    ap.add_argument("--hardware", help="a hardware profile: add the planner's price of the last stage's extra")
    ap.add_argument("--out")
    a = ap.parse_args()
    over = {k: int(v) if v.isdigit() else v for k, v in (kv.split("=", 1) for kv in a.model)}
    cfg = build_config({"model": {"preset": a.preset, "max_seq_len": max(a.seq, 2048), **over}}).model
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (a.micro_batch, a.seq), device="cuda")
    targets = torch.randint(0, cfg.vocab_size, (a.micro_batch, a.seq), device="cuda")
    h0 = torch.randn(a.micro_batch, a.seq, cfg.dim, device="cuda", dtype=torch.bfloat16)
    ms, tables = {}, {}
    for name, first, last in (("middle", False, False), ("first", True, False), ("last", False, True),
                              ("whole", True, True)):
        model = _part(cfg, a.layers, first, last)
        ms[name] = _time(model, first, last, tokens, targets, h0, a.reps)
        if a.profile and name in ("middle", "last"):
            tables[name] = _kernels(model, first, last, tokens, targets, h0, 30)
        del model
        torch.cuda.empty_cache()
    row = {"preset": a.preset, "model": a.model, "seq": a.seq, "micro_batch": a.micro_batch, "layers": a.layers,
           "card": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "ms": {k: round(v, 3) for k, v in ms.items()},
           "first_extra_ms": round(ms["first"] - ms["middle"], 3), "last_extra_ms": round(ms["last"] - ms["middle"], 3)}
    if a.hardware:
        row["planner_last_extra_ms"] = round(1e3 * planner_head_s(cfg, a.seq, a.micro_batch * a.seq, a.hardware), 3)
    print(json.dumps(row), flush=True)
    for name, t in tables.items():
        print(f"--- {name} stage, 4 micro-batches ---\n{t}", file=sys.stderr)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
