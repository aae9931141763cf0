"""Does one matmul for q, k and v (and one for the MLP's gate and up) beat three (two)?

Times forward + backward (input and weight gradients) of a transformer layer's input projections
on the GPU, bf16, at a preset's shapes: separate weights as the model holds them, against the same
weights concatenated into one matrix (the concatenation and the split of its gradient included).

  python bench/gemm_fusion.py --presets 1b,8b --tokens 16384 [--out bench/results/x.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F


def _time(fn, reps: int = 30) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def case(tokens: int, dim: int, outs: list[int]) -> dict:
    x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ws = [torch.randn(n, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for n in outs]
    gy = [torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16) for n in outs]

    def separate():
        ys = [F.linear(x, w) for w in ws]
        torch.autograd.backward(ys, gy)

    g_cat = torch.cat(gy, dim=-1)

    def fused():
        y = F.linear(x, torch.cat(ws))
        torch.autograd.backward([y], [g_cat])

    sep, fus = _time(separate), _time(fused)
    flop = 6 * tokens * dim * sum(outs)
    return {"tokens": tokens, "dim": dim, "outs": outs, "separate_ms": sep, "fused_ms": fus,
            "separate_tflops": flop / sep / 1e9, "fused_tflops": flop / fus / 1e9, "gain": sep / fus}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="1b,8b")
    ap.add_argument("--tokens", default="16384")
    ap.add_argument("--out")
    a = ap.parse_args()
    from plait.config import build_config

    rows = []
    for preset in a.presets.split(","):
        cfg = build_config({"model": {"preset": preset}}).model
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        for tokens in map(int, a.tokens.split(",")):
            for what, outs in (("qkv", [q, kv, kv]), ("gate_up", [cfg.ffn_dim, cfg.ffn_dim])):
                r = {"preset": preset, "what": what, **case(tokens, cfg.dim, outs)}
                rows.append(r)
                print(json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"benchmark": "gemm_fusion", "card": torch.cuda.get_device_name(0),
                       "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
