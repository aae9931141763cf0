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
Compiled blocks (`torch.compile`, plait's default on GPUs) keep less: the partitioner saves what a
min-cut says is cheapest and recomputes pointwise work in the backward kernels. What it keeps,
read off the partitioned forward graph (`compiled_kept_bytes`), is

  none       e s b h / u + 8 s b / u              the block's input and the two 1/rms (fp32)
             + 2 e s b h                          the inputs of Q/K/V and of w1/w3, whole (a
                                                  collective's output is never recomputed)
             + e s b (2 h / t + 2 d_kv,t) + 4 s b a_t   Q and K after RoPE, V, output, log-sum-exp
             + e s b h / u                        wo's output after its all-reduce / reduce-scatter
                                                  (with the input it rebuilds the residual stream)
             + 3 e s b f / t                      gate, up and their product (SwiGLU's silu and the
                                                  norms' fp32 copies are recomputed)
  selective  eager's bytes less e s b h / u       the second branch's input is rebuilt from the first
  full       e s b h / u                          as eager

For Llama shapes (bf16, no parallelism) that is s b (12 h + 4 d_kv + 6 f) + 8 s b + 4 s b a for
`none`, about 70% of eager's.

FP8 linears (`train.fp8`, plait/fp8.py), compiled, `none`: the partitioner keeps each input's maximum
(a scalar) rather than its FP8 copy wherever the copy can be rebuilt from what it keeps anyway, so

  none       compiled bf16's less 2 e s b h       the norms' outputs are not kept: rebuilt and
                                                  quantized again from the block's input, the
                                                  residual and 1/rms (not with SP: all-gathered)
             less e s b f / t                     SwiGLU's product: rebuilt from gate and up
             plus s b h / t                       wo's input in FP8 (attention's output is kept in
                                                  16 bits too, for attention's backward)
  selective, full: as bf16 (what they keep is not a linear's input)

and a few bytes of scales. Eager, tensorwise keeps every linear's FP8 weight beside bf16's set (1 byte
a weight of the layer); rowwise keeps the bf16 originals: bf16's bytes.
"""

from __future__ import annotations

import gc
import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def layer_bytes(b: int, s: int, h: int, heads: int, kv_heads: int, ffn: int, t: int = 1, sp: bool = False,
                recompute: str = "none", e: float = 2.0, compiled: bool = False, cp: int = 1,
                ulysses: bool = False, fp8: str = "off") -> float:
    """Bytes one block keeps for its backward on one rank, eager or compiled (see the module
    docstring). `s` is the rank's share of the sequence; `cp` the context-parallel degree and
    `ulysses` whether its attention exchanges heads by all-to-all (plait/parallel/ulysses.py)
    rather than passing K/V around the ring; `fp8` the linears' FP8 scaling (`train.fp8`)."""
    kept = _bf16_layer_bytes(b, s, h, heads, kv_heads, ffn, t, sp, recompute, e, compiled, cp, ulysses)
    if fp8 == "off" or recompute != "none":
        return kept
    u, sb = (t if sp else 1), s * b
    if compiled:
        return kept - (2 * e * sb * h if u == 1 else 0.0) - e * sb * ffn / t + sb * h / t
    if fp8 == "tensorwise":  # the FP8 copy of every weight, saved by each linear for its backward
        kv = (kv_heads // t if kv_heads >= t else 1) * (h // heads)
        return kept + h * (h / t + 2 * kv) + h * h / t + 3 * h * ffn / t
    return kept


def _bf16_layer_bytes(b, s, h, heads, kv_heads, ffn, t, sp, recompute, e, compiled, cp, ulysses) -> float:
    """`layer_bytes` with 16-bit linears."""
    u = t if sp else 1
    hd = h // heads
    kv = (kv_heads // t if kv_heads >= t else 1) * hd
    sb = s * b
    attention = e * sb * (2 * h / t + 2 * kv) + 4 * sb * heads / t
    if cp > 1 and ulysses:
        from plait.parallel.ulysses import kv_repeats

        sent = kv * kv_repeats(kv // hd, cp)  # key/value heads repeated up to cp before the exchange
    else:
        sent = kv
    if recompute == "full":
        return e * sb * h / u
    if recompute == "selective":
        kept = (2 * e * sb * h / u + attention + 2 * e * sb * ffn / t + (2 * e * sb * h if sp else 0.0)
                + (e * sb * h / u if t > 1 else 0.0)) - (e * sb * h / u if compiled else 0.0)
        if cp > 1 and ulysses:  # the exchanged q, k, v and output are kept (no all-to-all in backward):
            # eager keeps them beside Q, K and V's matmul outputs, compiled in their place
            kept += e * sb * (2 * h / t + 2 * sent) if not compiled else e * sb * (h / t + 2 * (sent - kv))
        return kept
    if recompute != "none":
        raise ValueError(f"unknown recompute mode {recompute!r}")
    # context parallelism returns attention's output head-major, so the output matmul's input is a
    # copy of it (one SDPA call returns it token-major: a view); Ulysses keeps repeated K/V heads
    cp_extra = (e * sb * h / t + 2 * e * sb * (sent - kv)) if cp > 1 else 0.0
    if compiled:
        return 2 * e * sb * h / u + 8 * sb / u + 2 * e * sb * h + attention + 3 * e * sb * ffn / t + cp_extra
    return 2 * (4 + e) * sb * h / u + 8 * sb / u + 2 * e * sb * h + attention + 4 * e * sb * ffn / t + cp_extra


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
    # Garbage cycles made by the call are among the objects made since it began: with everything
    # older frozen, a collection scans only those (microseconds, where a process that has imported
    # torch's compiler spends 0.3 s a collection walking its ~300k objects).
    gc.freeze()
    try:
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
    finally:
        gc.unfreeze()
    return counts[-1], out


# ops whose output shares its input's storage: a saved view costs nothing beyond its base
_VIEWS = {"view", "_unsafe_view", "transpose", "permute", "detach", "t", "unsqueeze", "squeeze", "expand",
          "alias", "slice", "select", "as_strided", "_reshape_alias"}


def _op_name(node) -> str:
    schema = getattr(node.target, "_schema", None)
    return (schema.name if schema is not None else str(node.target)).split("::")[-1]


def compiled_kept_bytes(fn, *inputs: torch.Tensor) -> tuple[int, object]:
    """`kept_bytes` for `torch.compile(fn)`: run it once through AOT autograd with the partitioner
    inductor uses and add up the tensors the forward graph hands to the backward. A saved view counts
    as its base, once; parameters and buffers do not count, the inputs do (the block keeps its
    input). Storage whose size is symbolic (a random-number state) is a few bytes and is skipped.
    Returns (bytes, output); the graph runs uncompiled, so this works on any device."""
    import functools

    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    seen: dict = {}
    given = {x.untyped_storage().data_ptr() for x in inputs}

    def forward_compiler(gm, example):
        places = [n for n in gm.graph.nodes if n.op == "placeholder"]
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        total, bases = 0, set()
        for node in outputs[seen["outputs"]:]:  # the user's outputs first, then what backward needs
            base = node
            while base.op == "call_function" and _op_name(base) in _VIEWS:
                base = base.args[0]
            val = base.meta.get("val")
            if not isinstance(val, torch.Tensor) or base in bases:
                continue
            if not all(isinstance(n, int) for n in val.shape):
                continue
            bases.add(base)
            if base.op == "placeholder":  # a parameter, a buffer or an input of `fn`
                real = seen["example"][places.index(base)]
                if not isinstance(real, torch.Tensor) or real.untyped_storage().data_ptr() not in given:
                    continue
            total += val.numel() * val.element_size()
        seen["bytes"] = total
        return make_boxed_func(gm.forward)

    def backend(gm, example):
        seen["example"] = example
        seen["outputs"] = sum(1 for x in tree_flatten(gm.graph.output_node().args)[0] if hasattr(x, "op"))
        return aot_module_simplified(gm, example, fw_compiler=forward_compiler,
                                     bw_compiler=lambda g, _: make_boxed_func(g.forward),
                                     partition_fn=functools.partial(min_cut_rematerialization_partition,
                                                                    compiler="inductor"))

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    return seen["bytes"], out
