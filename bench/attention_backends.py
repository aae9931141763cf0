"""Which SDPA backend runs plait's causal grouped-query attention fastest, forward + backward.

    python bench/attention_backends.py --out attn.json

For each shape (1b's and 8b's heads at the sequences plait trains) it times
`F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)` - what plait's model
calls, with the backend torch picks - against each backend forced (cuDNN, flash, memory-efficient)
and against K/V expanded to every query head first (what a backend without grouped-query support
runs). CUDA events around a burst of fwd+bwd calls, the median of five bursts."""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {  # name: (batch, heads, kv heads, head dim, seq)
    "1b-s2048": (8, 32, 8, 64, 2048),
    "1b-s8192": (2, 32, 8, 64, 8192),
    "8b-s2048": (2, 32, 8, 128, 2048),
    "8b-s8192": (1, 32, 8, 128, 8192),
}
BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def time_ms(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    out = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / reps)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name, (B, H, KV, D, T) in SHAPES.items():
        q = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, KV, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(B, KV, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16)
        flops = 4 * B * H * T * T / 2 * D * 3.5  # causal: forward 2 products, backward 5
        for bname, backend in BACKENDS.items():
            for expand in (False, True):
                def step():
                    kk, vv = (k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)) if expand else (k, v)
                    o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=not expand)
                    o.backward(g)
                try:
                    if backend is None:
                        ms = time_ms(step)
                    else:
                        with sdpa_kernel([backend]):
                            ms = time_ms(step)
                except RuntimeError as e:
                    rows.append({"shape": name, "backend": bname, "expanded_kv": expand, "error": str(e).split("\n")[0][:200]})
                    continue
                rows.append({"shape": name, "backend": bname, "expanded_kv": expand, "fwd_bwd_ms": round(ms, 4),
                             "tflops": round(flops / ms / 1e9, 1)})
                print(f"{name:10} {bname:10} expand={expand!s:5} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
    out = {"benchmark": "attention backends", "card": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
