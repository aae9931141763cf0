"""How fast a compiled tensorwise FP8 quantization finds its scale: the whole tensor's largest
magnitude in one reduction, per row then over the rows, or per 64k-element block then over the
blocks. The shapes are SwiGLU's at `1b` (16,384 tokens x 8,192), where plait's FP8 linears quantize
the MLP's output in the forward and its two input gradients in the backward (results/fp8-amax-rows-h200.json).

    python bench/fp8_amax.py [--tokens 16384 --ffn 8192 --iters 20]
"""

import argparse

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
TOP = torch.finfo(E4M3).max


def amax(x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "whole":
        return x.abs().amax()
    if how == "rows":
        return x.abs().amax(dim=-1).amax()
    return x.abs().view(-1, 1 << 16).amax(dim=-1).amax()


def quantize(x: torch.Tensor, how: str):
    scale = TOP / amax(x, how).float().clamp(min=1e-12)
    return (x.float() * scale).clamp(-TOP, TOP).to(E4M3), scale.reciprocal()


def forward(g, u, how):
    return quantize(F.silu(g) * u, how)


def backward(g, u, dh, how):
    """SwiGLU's input gradients, each quantized and also written transposed (the weight-gradient
    GEMM's layout), as plait's FP8 linears do."""
    sg = torch.sigmoid(g.float())
    dg = (dh.float() * u.float() * sg * (1 + g.float() * (1 - sg))).to(g.dtype)
    du = (dh.float() * g.float() * sg).to(g.dtype)
    (a, sa), (b, sb) = quantize(dg, how), quantize(du, how)
    return a, sa, b, sb, a.t().contiguous(), b.t().contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    g, u, dh = (torch.randn(a.tokens, a.ffn, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for how in ("whole", "rows", "blocks"):
        for name, fn, args in (("forward", forward, (g, u)), ("backward", backward, (g, u, dh))):
            step = torch.compile(lambda *t, fn=fn, how=how: fn(*t, how))
            for _ in range(3):
                step(*args)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(a.iters):
                step(*args)
            end.record()
            torch.cuda.synchronize()
            print(f"{how:6s} {name:8s} {start.elapsed_time(end) / a.iters * 1e3:8.1f} us")


if __name__ == "__main__":
    main()
