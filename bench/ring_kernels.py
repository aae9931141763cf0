"""One context-parallel rank's ring attention, the kernels alone: CUDA's flash kernel against cuDNN's
fused attention per ring step (forward and backward, plait.parallel.block_attention), beside the one
causal SDPA call an all-to-all (Ulysses) rank makes over the same work - no communication, one GPU.

    python bench/ring_kernels.py                  # CP 4 rank of a 131072-token 8b sequence

Writes bench/results/ring-kernels-<card>.json and prints ms per layer and achieved TFLOP/s (causal
work: the forward's two matmuls over half the square, the backward counted as 2.5 forwards).
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

from data_parallel import card_slug  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--seq", type=int, default=131072, help="the whole sequence; a rank holds seq / cp")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out")
    a = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from plait.parallel import block_attention as blk
    from plait.parallel.context import _part, ring_calls

    if not torch.cuda.is_available():
        ap.error("needs a GPU")
    torch.manual_seed(0)
    C, T, H, KV, d = a.cp, a.seq // a.cp, a.heads, a.kv_heads, a.head_dim
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q, dout, out = (torch.randn(1, H, T, d, **bf) for _ in range(3))
    k, v = (torch.randn(1, KV, T, d, **bf) for _ in range(2))
    lse = torch.randn(1, H, T, device="cuda")

    def ring(how):  # rank 1's ring steps (every rank does the same work)
        for calls in ring_calls(C, 1, True):
            for qp, kp, kind in calls:
                qq, kk, vv = _part(q, qp).contiguous(), _part(k, kp).contiguous(), _part(v, kp).contiguous()
                blk.forward(qq, kk, vv, kind == "causal", d ** -0.5, how)
                blk.backward(_part(dout, qp).contiguous(), qq, kk, vv, _part(out, qp).contiguous(),
                             _part(lse, qp).contiguous(), kind == "causal", d ** -0.5, how)

    qu = torch.randn(1, H // C, T * C, d, **bf, requires_grad=True)
    ku, vu = (torch.randn(1, max(1, KV // C), T * C, d, **bf, requires_grad=True) for _ in range(2))

    def ulysses():
        o = F.scaled_dot_product_attention(qu, ku, vu, is_causal=True, enable_gqa=KV // C < H // C)
        o.backward(torch.ones_like(o))

    def timeit(fn, n=3):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    flops = 2 * (T * C) ** 2 * H * d / C * 3.5  # one rank's share of causal attention, forward + backward
    rows = []
    for name, fn in (("ring-flash", lambda: ring("flash")), ("ring-cudnn", lambda: ring("cudnn")),
                     ("ulysses-sdpa", ulysses)):
        try:
            ms = timeit(fn)
            rows.append({"variant": name, "ms": ms, "tflops": flops / ms / 1e9})
        except RuntimeError as e:
            rows.append({"variant": name, "error": str(e).splitlines()[0][:300]})
        print(json.dumps(rows[-1]), flush=True)
    card = torch.cuda.get_device_name(0)
    result = {"benchmark": "ring_kernels", "card": card, "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(["python", "bench/ring_kernels.py"] + (argv or sys.argv[1:])),
              "config": vars(a), "kernel_picked": blk.kernel(q, None, k), "rows": rows}
    path = Path(a.out) if a.out else ROOT / "bench" / "results" / f"ring-kernels-{card_slug(card)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
