"""FP8 matmuls for the blocks' linear layers (`--train.fp8 tensorwise|rowwise`).

Each linear y = x W^T runs as three FP8 GEMMs through `torch._scaled_mm` (cuBLAS's FP8 kernels on
H100/H200, a reference kernel on CPUs): the forward x W^T and the backward's dx = dy W and
dW = dy^T x. Every operand is cast to FP8 on the fly from its bf16 tensor with a dynamic scale that
puts its largest magnitude (amax) at the format's largest finite value; the GEMM multiplies the
inverse scales back in. No state is kept between steps (no amax history), so checkpoints, resume
and every parallel layout are untouched: a rank quantizes exactly the tensors its bf16 matmul would
have read.

Two scalings:
- tensorwise: one scale per operand. x and W in e4m3 (3 mantissa bits), dy in e5m2 (5 exponent
  bits: gradients span a wider range). The fastest: the scales apply once, outside the GEMM.
- rowwise: one scale per row of the contraction, (M, 1) for the left operand and (1, N) for the
  right, all operands e4m3 and scales rounded down to powers of two (exact to apply). An outlier
  token or channel then costs precision only in its own row.

Split operands (`shards`). Where a layout splits an operand over ranks - the tokens over context
parallelism (m), a column-parallel weight's output features (n), a row-parallel one's input
features (k) - each rank holds part of the tensor one device scales whole. Its largest magnitude
(per tensor, or per row of the contraction) is then maxed over the ranks holding the rest (one
all-reduce of a number, or of a row of them), so every rank scales its part as one device scales
the whole, and every layout trains FP8 as one device does, to rounding. One case cannot: tensor
parallelism over more ranks than key/value heads has each rank project its head with the
gradient of its own query heads only, a part of the sum one device quantizes, so there the match
is to quantization.

Tensorwise saves the FP8 x and W its forward made and backward's GEMMs reuse them (a tensor's
scale is the same whatever axis a GEMM contracts); rowwise saves the bf16 originals, each quantized
again along the axis its backward GEMM contracts. The embedding, norms, attention, output head and loss
stay bf16, the optimizer's master weights fp32. Under torch.compile the casts fuse with the
transposes each GEMM needs (the right operand column-major) into one pass per operand.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.errors import bad_value

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise")
_EPS = 1e-12  # an all-zero operand gets a finite scale (and quantizes to zeros)
_ALIGN = 16  # cuBLAS FP8 GEMMs need every dimension a multiple of 16


def scale_for(amax: torch.Tensor, fmt: torch.dtype, pow2: bool = False) -> torch.Tensor:
    """The scale (fp32) that puts `amax` on fmt's largest finite value."""
    scale = torch.finfo(fmt).max / amax.float().clamp(min=_EPS)
    if pow2:  # a power of two multiplies exactly: the scale itself adds no rounding
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def scaled(x: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """x times `scale`, saturated and rounded to `fmt`."""
    top = torch.finfo(fmt).max
    # one fp32 copy of x scaled in place, not three (eager); copy=True: an fp32 x must stay untouched
    return x.to(torch.float32, copy=True).mul_(scale).clamp_(-top, top).to(fmt)


def over(shards: tuple[str, ...], axes: str) -> tuple[str, ...]:
    """The `Comm.key`s of the ranks holding the rest of an operand split along `axes` (module
    docstring): `shards` holds "m/KEY", "n/KEY", "k/KEY" entries."""
    return tuple(sh[2:] for sh in shards if sh[0] in axes)


# the axes along which each operand's amax runs: tensorwise the whole tensor, rowwise the contraction
TENSORWISE_AXES = {"x": "mk", "w": "nk", "dy": "mn"}
ROWWISE_AXES = {"forward": ("k", "k"), "input_grad": ("n", "n"), "weight_grad": ("m", "m")}


def quantize(x: torch.Tensor, fmt: torch.dtype, dim: int | None, pow2: bool = False, reduce: tuple[str, ...] = ()):
    """(x in `fmt`, inverse scale): x scaled so that its amax, over `dim` (kept as a size-1 axis) or
    the whole tensor (dim None), lands on fmt's largest finite value; `reduce`: the `Comm.key`s over
    which that amax is maxed first (the ranks that hold the rest of a split x)."""
    if dim is None:
        # each row's largest magnitude, then theirs: the same number, but compiled, a whole-tensor
        # max is one split reduction that read under half of HBM's bandwidth on H200, where one per
        # row runs a program a row (bench/fp8_amax.py: SwiGLU's output at 1b 455 -> 356 us; the
        # 1b FP8 step 1.4% faster, results/fp8-amax-rows-h200.json)
        a = x.abs().amax(dim=-1).amax() if x.dim() > 1 else x.abs().amax()
    else:
        a = x.abs().amax(dim=dim, keepdim=True)
    for key in reduce:
        a = torch.ops.plait.all_reduce_max(a, key)
    scale = scale_for(a, fmt, pow2)
    return scaled(x, scale, fmt), scale.reciprocal()


def _cpu_takes_row_scales() -> bool:
    """Whether this torch's CPU _scaled_mm takes rows' scales: torch 2.11's takes one scale an
    operand and fails an internal assert on more (2.13's takes them)."""
    q = torch.zeros(16, 16).to(E4M3)
    try:
        torch._scaled_mm(q, q.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


_CPU_ROW_SCALES = _cpu_takes_row_scales()


@torch.library.custom_op("plait::rowwise_mm_cpu", mutates_args=())
def rowwise_mm_cpu(qa: torch.Tensor, qb: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """A rowwise-scaled FP8 product where the CPU's _scaled_mm takes no rows' scales: dequantized in
    fp32, out of place. One op, as _scaled_mm is, so that selective recomputation keeps its 16-bit
    output (plait/parallel/recompute.py counts it as a matmul), not the fp32 product inside."""
    return (torch.mm(qa.float(), qb.float()) * sa * sb).to(out_dtype)


@rowwise_mm_cpu.register_fake
def _(qa, qb, sa, sb, out_dtype):
    return qa.new_empty((qa.shape[0], qb.shape[1]), dtype=out_dtype)


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, fa: torch.dtype, fb: torch.dtype, rowwise: bool,
             out_dtype: torch.dtype, fast_accum: bool, reduce: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
             ) -> torch.Tensor:
    """a (M, K) @ b (K, N) with both operands quantized along K (rowwise) or whole (tensorwise);
    `reduce`: each operand's keys to max its amax over (`quantize`)."""
    qa, sa = quantize(a, fa, -1 if rowwise else None, rowwise, reduce[0])  # sa (M, 1) or ()
    qb, sb = quantize(b, fb, 0 if rowwise else None, rowwise, reduce[1])  # sb (1, N) or ()
    if rowwise and a.device.type == "cpu" and not _CPU_ROW_SCALES:
        return rowwise_mm_cpu(qa, qb, sa, sb, out_dtype)
    qa = qa.contiguous()  # _scaled_mm: left operand row-major,
    qb = qb.t().contiguous().t()  # right operand column-major (no copy when b is a transposed weight)
    return torch._scaled_mm(qa, qb, scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast_accum)


# The three GEMMs of a linear y = x W^T, x (..., K), W (N, K), dy (..., N). Fast accumulation in the
# forward only, as is usual: the gradients' long sums keep full accumulation precision.
def _reduce(shards: tuple[str, ...], rowwise: bool, gemm: str, left: str, right: str):
    """Each operand's keys for `fp8_gemm` (`left`/`right`: the operands' tensorwise names)."""
    if not shards:
        return (), ()
    if rowwise:
        return tuple(over(shards, axes) for axes in ROWWISE_AXES[gemm])
    return over(shards, TENSORWISE_AXES[left]), over(shards, TENSORWISE_AXES[right])


def forward_gemm(x: torch.Tensor, weight: torch.Tensor, rowwise: bool, shards: tuple[str, ...] = ()) -> torch.Tensor:
    y = fp8_gemm(x.reshape(-1, x.shape[-1]), weight.t(), E4M3, E4M3, rowwise, x.dtype, fast_accum=True,
                 reduce=_reduce(shards, rowwise, "forward", "x", "w"))
    return y.view(*x.shape[:-1], weight.shape[0])


def input_grad_gemm(dy: torch.Tensor, weight: torch.Tensor, rowwise: bool, out_dtype: torch.dtype,
                    shards: tuple[str, ...] = ()) -> torch.Tensor:
    g = E4M3 if rowwise else E5M2  # tensorwise: gradients in e5m2, for their range
    dx = fp8_gemm(dy.reshape(-1, dy.shape[-1]).to(weight.dtype), weight, g, E4M3, rowwise, out_dtype, fast_accum=False,
                  reduce=_reduce(shards, rowwise, "input_grad", "dy", "w"))
    return dx.view(*dy.shape[:-1], weight.shape[1])


def weight_grad_gemm(dy: torch.Tensor, x: torch.Tensor, rowwise: bool, out_dtype: torch.dtype,
                     shards: tuple[str, ...] = ()) -> torch.Tensor:
    g = E4M3 if rowwise else E5M2
    dy2 = dy.reshape(-1, dy.shape[-1]).to(x.dtype)
    return fp8_gemm(dy2.t(), x.reshape(-1, x.shape[-1]), g, E4M3, rowwise, out_dtype, fast_accum=False,
                    reduce=_reduce(shards, rowwise, "weight_grad", "dy", "x"))


def aligned(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether cuBLAS's FP8 GEMMs take x @ weight^T and its gradients (every dimension a multiple of 16)."""
    return not (x.numel() // x.shape[-1] % _ALIGN or x.shape[-1] % _ALIGN or weight.shape[0] % _ALIGN)


class _FP8Linear(torch.autograd.Function):
    """Tensorwise: x and W are quantized once, in the forward, and backward's GEMMs reuse them. A
    tensor's scale does not depend on the axis a GEMM contracts, so these are exactly the FP8
    tensors backward would make again (the same bits); saved in FP8 they also take half the bytes of
    the bf16 x. Rowwise scales run along the contraction, which differs between the forward and
    the backward GEMMs: it saves the bf16 originals and quantizes each again."""

    @staticmethod
    def forward(ctx, x, weight, rowwise, qw=None, sw=None, shards=()):
        # qw, sw: the weight already in FP8 with its inverse scale (ZeRO-3's FP8 all-gather, tensorwise):
        # `weight` is then read for nothing but its dtype and shape, and gets its gradient
        x = x.to(weight.dtype)
        ctx.rowwise, ctx.shards = rowwise, shards
        if rowwise:
            ctx.save_for_backward(x, weight)
            return forward_gemm(x, weight, rowwise, shards)
        qx, sx = quantize(x.reshape(-1, x.shape[-1]), E4M3, None, reduce=over(shards, TENSORWISE_AXES["x"]))
        if qw is None:
            qw, sw = quantize(weight, E4M3, None, reduce=over(shards, TENSORWISE_AXES["w"]))
        y = torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype, use_fast_accum=True)
        ctx.save_for_backward(qx, sx, qw, sw)
        ctx.dtypes = x.dtype, weight.dtype
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        if ctx.rowwise:
            x, weight = ctx.saved_tensors
            dx = input_grad_gemm(dy, weight, True, x.dtype, ctx.shards) if ctx.needs_input_grad[0] else None
            dw = weight_grad_gemm(dy, x, True, weight.dtype, ctx.shards) if ctx.needs_input_grad[1] else None
            return dx, dw, None, None, None, None
        qx, sx, qw, sw = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        qdy, sdy = quantize(dy.reshape(-1, dy.shape[-1]).to(w_dtype), E5M2, None,  # once for both GEMMs
                            reduce=over(ctx.shards, TENSORWISE_AXES["dy"]))
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dy @ W: W column-major on the right
            dx = torch._scaled_mm(qdy, qw.t().contiguous().t(), scale_a=sdy, scale_b=sw, out_dtype=x_dtype,
                                  use_fast_accum=False).view(*dy.shape[:-1], qw.shape[1])
        if ctx.needs_input_grad[1]:  # dy^T @ x: dy^T row-major on the left, x column-major on the right
            dw = torch._scaled_mm(qdy.t().contiguous(), qx.t().contiguous().t(), scale_a=sdy, scale_b=sx,
                                  out_dtype=w_dtype, use_fast_accum=False)
        return dx, dw, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: str, shards: tuple[str, ...] = ()) -> torch.Tensor:
    """x @ weight^T in FP8; shapes cuBLAS cannot take (a dimension not a multiple of 16, such as one
    token at a time when generating) run the bf16 matmul instead."""
    if not aligned(x, weight):
        return F.linear(x, weight)
    return _FP8Linear.apply(x, weight, recipe == "rowwise", None, None, shards)


class FP8Linear(nn.Linear):
    """An nn.Linear whose matmul runs in FP8 with `recipe`'s scaling; its weight is the parameter it
    had (the bf16 copy TP and the engine manage). A class rather than a per-module forward: the
    compiled blocks then guard on the same code and share one graph, where distinct bound callables
    made every block compile again (and fall back to eager past dynamo's recompile limit).

    `prequantized`: ZeRO-3 all-gathers this weight in FP8 (`parallel.zero3_fp8_gather`) into the
    buffers `w8` (its e4m3 bits) and `w8_inv` (the inverse tensorwise scale); the bf16 parameter
    then holds no storage while gathered, and the forward takes the FP8 weight as it is."""

    recipe = "tensorwise"
    prequantized = False
    shards: tuple[str, ...] = ()  # where the layout splits its operands (`shard_linears`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prequantized:
            if not aligned(x, self.w8):  # validation keeps training's shapes aligned; no bf16 weight to fall back on
                raise RuntimeError(f"an FP8-gathered weight {tuple(self.w8.shape)} met input {tuple(x.shape)}, "
                                   "which cuBLAS's FP8 GEMMs cannot take (dimensions multiples of 16)")
            return _FP8Linear.apply(x, self.weight, False, self.w8, self.w8_inv, self.shards)
        return fp8_linear(x, self.weight, self.recipe, self.shards)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight^T in FP8 for part of this layer's weight (the KV head a tensor-parallel rank
        uses where heads are replicated)."""
        return fp8_linear(x, weight, self.recipe, self.shards)


def apply_fp8(model, recipe: str, device: torch.device) -> None:
    """Route every block linear of `model` through FP8 GEMMs scaled by `recipe`."""
    if recipe not in RECIPES:
        raise bad_value("train.fp8", recipe, f"choose off, {', '.join(RECIPES)}")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise bad_value("train.fp8", recipe, f"needs FP8 tensor cores (H100, H200, L40S, B200); {name} has none: "
                        "set train.fp8 off")
    for lin in model.block_linears():
        assert lin.bias is None, "FP8Linear computes no bias; plait's linears have none"
        lin.__class__ = FP8Linear  # in place: parameters, names and hooks stay
        lin.recipe = recipe


def shard_linears(model, tp_key: str | None, cp_key: str | None) -> None:
    """Tell each block linear where the layout splits its operands (module docstring): tokens over
    context parallelism; a column-parallel weight's output features, a row-parallel one's input
    features over tensor parallelism (`plait.parallel.tensor.PLAN`). Replicated key/value heads are
    split nowhere: every rank holds the whole matrix."""
    from plait.parallel.tensor import PLAN

    for bname, block in model.layers.items():
        for name, lin in block.named_modules():
            if not isinstance(lin, nn.Linear):
                continue
            kind = PLAN.get(f"{name}.weight")
            if kind == "kv":
                kind = None if block.attn.kv_rows is not None else "column"
            shards = [f"m/{cp_key}"] if cp_key else []
            if tp_key and kind in ("column", "row"):
                shards.append(f"{'n' if kind == 'column' else 'k'}/{tp_key}")
            lin.shards = tuple(shards)
