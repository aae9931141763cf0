"""What one of plait's transformer blocks keeps for its backward, as a formula and as a measurement.

Derived the way Korthikanti et al. 2022 (seed 003) derive s b h (34 + 5 a s / h) for GPT, for
plait's own block (RMSNorm, RoPE, grouped-query flash attention, SwiGLU, no dropout) as it runs in
eager mode. Notation: b micro-batch, s sequence (this rank's), h hidden, a heads, f MLP width,
d_kv = kv_heads x head_dim; t the tensor-parallel degree, u = t with sequence parallelism (the
residual stream is split along the tokens) else 1; e bytes of an activation (2 bf16, 4 fp32);
a_t = a / t heads and d_kv,t = d_kv / t (one head's width when tp > kv_heads: heads are replicated)
per rank. In bytes:

  none       2 (4 + e) s b h / u + 8 s b / u     each RMSNorm: its input in fp32 and the normalised
                                                  value, and 1/rms (fp32)
             + 2 e s b h                          the inputs of Q/K/V and of w1/w3 (the norms'
                                                  outputs; with SP the all-gathered ones, whole)
             + e s b (2 h / t + 2 d_kv,t)         Q and K after RoPE, V, attention's output
             + 4 s b a_t                          attention's log-sum-exp (fp32); no s x s scores
             + 4 e s b f / t                      SwiGLU: gate, silu(gate), up, their product
  selective  2 e s b h / u                        the two branches' inputs
             + e s b (2 h / t + 2 d_kv,t) + 4 s b a_t   Q, K (before RoPE), V, output, log-sum-exp
             + 2 e s b f / t                      gate, up
             + [SP] 2 e s b h                     the all-gathered inputs of the column matmuls
             + [tp > 1] e s b h / u               attention's output after its all-reduce /
                                                  reduce-scatter (so that nothing replays it)
  full       e s b h / u                          the block's input

So with bf16 and no parallelism `none` is s b (20 h + 4 d_kv + 8 f) + 8 s b + 4 s b a; selective
drops the norms' copies, SwiGLU's silu and product and the matmul inputs (about half of it for
Llama shapes) for a few elementwise kernels of recomputation; full keeps 2 s b h.
`torch.compile` picks what to save itself (its partitioner recomputes cheap pointwise work), so a
compiled block keeps at most `none`'s bytes.
"""

from __future__ import annotations

import gc
import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def layer_bytes(b: int, s: int, h: int, heads: int, kv_heads: int, ffn: int, t: int = 1, sp: bool = False,
                recompute: str = "none", e: float = 2.0) -> float:
    """Bytes one block keeps for its backward on one rank (see the module docstring)."""
    u = t if sp else 1
    hd = h // heads
    kv = (kv_heads // t if kv_heads >= t else 1) * hd
    sb = s * b
    attention = e * sb * (2 * h / t + 2 * kv) + 4 * sb * heads / t
    if recompute == "full":
        return e * sb * h / u
    if recompute == "selective":
        return (2 * e * sb * h / u + attention + 2 * e * sb * ffn / t + (2 * e * sb * h if sp else 0.0)
                + (e * sb * h / u if t > 1 else 0.0))
    if recompute != "none":
        raise ValueError(f"unknown recompute mode {recompute!r}")
    return 2 * (4 + e) * sb * h / u + 8 * sb / u + 2 * e * sb * h + attention + 4 * e * sb * ffn / t


class _Created(TorchDispatchMode):
    """Every storage an op creates while active, held weakly."""

    def __init__(self):
        super().__init__()
        self.made: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view (of a weight, of an earlier result) shares its input's storage: not a new one
        given = {x.untyped_storage().data_ptr() for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)}
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in given:
                st = x.untyped_storage()
                self.made.append((st.data_ptr(), StorageWeakRef(st), st.nbytes()))
        return out


def kept_bytes(fn, *inputs: torch.Tensor) -> tuple[int, object]:
    """Run `fn(*inputs)` and measure the bytes its autograd graph keeps alive for backward: every
    storage created during the call that is still referenced afterwards, less the outputs. The
    inputs are copied inside the window, so a copy kept by the graph counts as the block's (as a
    block keeps its input); parameters and buffers existed before and do not count. Returns
    (bytes, output): keep the output alive until backward."""
    spy = _Created()
    with spy:
        out = fn(*[x * 1.0 for x in inputs])
    outs = {x.untyped_storage().data_ptr() for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)}
    counts = []
    for _ in range(5):
        # what only a reference cycle holds is garbage, not kept for backward; and a collective's
        # backend thread (gloo) may hold a finished operation's buffers a moment longer
        gc.collect()
        alive = {ptr: n for ptr, ref, n in spy.made if not ref.expired() and ptr not in outs}
        counts.append(sum(alive.values()))
        if len(counts) > 1 and counts[-1] == counts[-2]:
            break
        time.sleep(0.02)
    return counts[-1], out
