"""`plait bench calibrate --only fp8`: what plait's FP8 linears (`plait/fp8.py`) cost, measured the way
its compiled blocks run them, for the planner to price `train.fp8` layouts.

An FP8 linear is more than its GEMM: each operand is scaled and cast on the fly (a maximum over the
tensor, then a pass that writes the FP8 copy, and for backward the transposed layouts cuBLAS wants),
and those memory-bound passes cost a third of the GEMM's own time at Llama's sizes. Under
torch.compile the linears that read one input (Q, K and V; w1 and w3) quantize it once, and the
passes fuse with the transposes. So the unit measured here is a *group*: the linears of a block that
share an input, compiled together, forward and forward + backward, with the weights
  - as bf16 parameters (quantized at every use, as a block does without ZeRO-3's FP8 gather), or
  - already in FP8 with their scale (`parallel.zero3_fp8_gather`: the gather delivered them so).
Rows: (recipe, gathered 0/1, tokens, in, [outs], forward seconds, backward seconds).
"""

from __future__ import annotations

import time

RECIPE_VARIANTS = (("tensorwise", 0), ("tensorwise", 1), ("rowwise", 0))  # the FP8 gather is tensorwise only


def groups(models, tps, tokens) -> list[tuple[int, int, tuple[int, ...]]]:
    """(tokens, in, outs) of each group of a block's linears that share an input, per model and tp split
    (the shapes `plait.planner.roofline.fp8_groups` asks for)."""
    from plait.config import PRESETS
    from plait.planner.roofline import fp8_groups
    from plait.planner.inputs import model_dims

    out = set()
    for name in models:
        c = PRESETS[name]
        d = model_dims(name, seq=c["max_seq_len"])
        for t in tps:
            if c["n_heads"] % t or c["ffn_dim"] % t:
                continue
            for m in tokens:
                for fin, outs in fp8_groups(d, t):
                    out.add((m, fin, outs))
    return sorted(out)


def time_group(recipe: str, gathered: bool, m: int, fin: int, outs: tuple[int, ...], dev, dtype, timed) -> tuple[float, float]:
    """(forward, backward) seconds of one group: on a GPU compiled as a block is, on a CPU eager."""
    import torch

    from plait.fp8 import E4M3, _FP8Linear, fp8_linear, quantize

    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, fin, generator=g).to(dev, dtype).requires_grad_()
    ws = [(0.02 * torch.randn(n, fin, generator=g)).to(dev, dtype).requires_grad_() for n in outs]
    if gathered:
        q = [quantize(w.detach(), E4M3, None) for w in ws]

        def fn(x, *ws):
            return [_FP8Linear.apply(x, w, False, qw, sw) for w, (qw, sw) in zip(ws, q)]
    else:
        def fn(x, *ws):
            return [fp8_linear(x, w, recipe) for w in ws]
    if dev.type == "cuda":
        torch._dynamo.reset()  # each shape compiles afresh: no recompile limit, no shared guards
        fn = torch.compile(fn, dynamic=False, fullgraph=True)
    grads = [torch.randn(m, n, generator=g).to(dev, dtype) for n in outs]
    fwd = timed(lambda: fn(x, *ws))
    both = timed(lambda: torch.autograd.grad(fn(x, *ws), [x, *ws], grads))
    return fwd, max(both - fwd, 1e-9)


def measure(models, tps, tokens, dev, dtype) -> tuple:
    """Every group shape under every recipe variant; CPU runs (a check of the tool) take the
    smallest shapes only."""
    from plait.benchmarks.calibrate import _timed

    shapes = groups(models, tps, tokens)
    print(f"# fp8 linears: {len(shapes) * len(RECIPE_VARIANTS)} groups to time, each compiled on its own "
          f"(about 5 s each on an H100 host)", flush=True)
    t0 = time.time()
    rows = []
    for recipe, gathered in RECIPE_VARIANTS:
        for m, fin, outs in shapes:
            f, b = time_group(recipe, bool(gathered), m, fin, outs, dev, dtype, lambda fn: _timed(fn, dev))
            rows.append((recipe, gathered, m, fin, list(outs), f, b))
    print(f"# fp8 linears: {len(rows)} groups in {time.time() - t0:.0f} s", flush=True)
    return tuple(rows)
