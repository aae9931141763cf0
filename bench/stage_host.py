"""Host time of one pipeline stage's actions, on a CPU with a model so small that its kernels cost
next to nothing: what a stage's host spends issuing F and B (1F1B) or F, B and W (ZB-H1) - Python,
dynamo's guards, autograd - for compiled blocks. On a GPU this is the floor under a stage's time
when its kernels are short (the 1b stages at micro-batch 2 ran with host shares near 1: README).

    python bench/stage_host.py --schedule zb            # one schedule per process: compiled
    python bench/stage_host.py --schedule 1f1b          # code caches do not mix

Prints the median milliseconds of each action kind, the best of --repeats rounds (a shared machine
is noisy; the minimum is the cost without interference).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from plait.config import ModelConfig
from plait.model import build_model
from plait.parallel.build import apply_compile
from plait.parallel.wgrad import WeightGradStore


def _stage(zb: bool, layers: int):
    cfg = ModelConfig(vocab_size=256, dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)
    model = build_model(cfg, 0, "cpu")
    store = None
    if zb:
        store = WeightGradStore()
        for lin in model.block_linears():
            store.serve(lin)
    apply_compile(model)
    return model, store


def _round(model, store, actions: int) -> tuple[float, float, float]:
    x0 = torch.randn(1, 32, 64, requires_grad=True)
    f, b, w = [], [], []
    for i in range(actions):
        x = x0.detach().requires_grad_()
        t = time.perf_counter()
        h = model.hidden(None, x, seq_len=32)
        f.append(time.perf_counter() - t)
        t = time.perf_counter()
        if store is not None:
            with store.input_grads_only(i):
                torch.autograd.backward(h, torch.ones_like(h))
        else:
            torch.autograd.backward(h, torch.ones_like(h))
        b.append(time.perf_counter() - t)
        if store is not None:
            t = time.perf_counter()
            store.run(i)
            w.append(time.perf_counter() - t)
    med = lambda v: 1e3 * statistics.median(v) if v else 0.0  # noqa: E731
    return med(f), med(b), med(w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", choices=("1f1b", "zb"), default="zb")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=8)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, store = _stage(a.schedule == "zb", a.layers)
    _round(model, store, 5)  # compile
    rounds = [_round(model, store, 40) for _ in range(a.repeats)]
    f, b, w = (min(r[i] for r in rounds) for i in range(3))
    print(f"{a.schedule}: F {f:.2f} ms  B {b:.2f} ms  W {w:.2f} ms  total {f + b + w:.2f} ms")


if __name__ == "__main__":
    main()
