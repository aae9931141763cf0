"""Roofline compute time: a kernel runs at min(peak, bandwidth x arithmetic intensity).

Equivalently its time is max(FLOPs / peak, bytes / bandwidth): whichever of the two roofs it hits.
Peaks are scaled by the cluster's matmul and HBM efficiencies (what well-tuned kernels reach).

A transformer block is costed kernel by kernel on one GPU of a layout: each weight matmul with its
tensor-parallel shard (m = tokens on this GPU, k x n = the shard of the weight), the attention core
(causal: half the square), and the memory-bound rest (norms, residual adds, RoPE, the gated
activation) by the bytes it reads and writes. Backward costs twice the forward matmuls (input and
weight gradients, one matmul each) and 2.5 times the attention core (fused attention recomputes
the scores and does five products to the forward's two).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.planner.costs import ModelDims
from plait.planner.hardware import Cluster


def attainable_flops(peak_flops: float, bandwidth_bytes_s: float, intensity: float) -> float:
    """The roofline: min(peak, bandwidth x FLOPs-per-byte)."""
    return min(peak_flops, bandwidth_bytes_s * intensity)


def ridge_intensity(c: Cluster) -> float:
    """FLOPs per byte where the two roofs meet: below it a kernel is memory-bound."""
    return c.peak_flops * c.matmul_efficiency / (c.gpu.hbm_gbps * 1e9 * c.hbm_efficiency)


def kernel_time_s(flops: float, bytes_moved: float, c: Cluster) -> float:
    return max(flops / (c.peak_flops * c.matmul_efficiency),
               bytes_moved / (c.gpu.hbm_gbps * 1e9 * c.hbm_efficiency))


def gemm_time_s(m: float, k: float, n: float, c: Cluster, elem_bytes: float = 2.0) -> float:
    """(m x k) @ (k x n): 2 m k n FLOPs over reading A and B and writing C once."""
    return kernel_time_s(2 * m * k * n, elem_bytes * (m * k + k * n + m * n), c)


@dataclass(frozen=True)
class LayerTimes:
    """Seconds for one block on one GPU for one micro-batch."""

    forward_s: float
    backward_input_s: float
    backward_weight_s: float
    attention_forward_s: float
    """The attention core's share of forward_s (context parallelism overlaps its ring with it)."""
    pointwise_forward_s: float = 0.0
    """The memory-bound share of forward_s: norms, RoPE, the gated activation, residual adds (what
    plait's selective recomputation runs again)."""

    @property
    def backward_s(self) -> float:
        return self.backward_input_s + self.backward_weight_s


# Elements a block's memory-bound forward kernels read and write per token, as (on the (tokens, h)
# hidden states, which TP alone replicates on every rank and sequence parallelism splits; on
# tensors TP splits by heads or by the FFN's columns). Llama as plait runs it: two RMSNorms and two
# residual adds (8 h); RoPE on q and k and SwiGLU (4 (h + kv) + 3 f). GPT as Megatron-LM runs it
# (its fused kernels): two LayerNorms (read + write, 4 h), two fused bias-dropout-adds (read the
# output and the residual, write the sum and a one-byte mask: 7 h in 16-bit elements); attention's
# output made contiguous (2 h) and the fused bias-GeLU (2 f).
POINTWISE_ELEMENTS = {"llama": lambda d: (8 * d.hidden, 4 * (d.hidden + d.kv_dim) + 3 * d.ffn),
                      "gpt": lambda d: (11 * d.hidden, 2 * d.hidden + 2 * d.ffn)}


def layer_times(d: ModelDims, tokens: float, c: Cluster, tp: int = 1, fp8: str = "off",
                fp8_gathered: bool = False, sp: bool = True) -> LayerTimes:
    """Cost one block for `tokens` tokens of a micro-batch on one GPU (tokens already / cp).

    With tensor parallelism every matmul runs on all the micro-batch's tokens with 1/tp of the
    weight; attention on 1/tp of the heads; pointwise work on the heads' and FFN's 1/tp, and on the
    hidden states' 1/tp only with sequence parallelism (`sp`: without it every TP rank runs the
    norms and residual adds on the whole micro-batch, `POINTWISE_ELEMENTS`). `fp8`: the block's linears run as plait's
    FP8 linears with that scaling (`train.fp8`), their weights delivered in FP8 by ZeRO-3's gather
    when `fp8_gathered` (`fp8_linear_times`)."""
    h, f, kv, e = d.hidden, d.ffn, d.kv_dim, 2.0
    m = tokens
    if d.arch == "llama":
        shapes = [(h, (h + 2 * kv) / tp), (h / tp, h), (h, 2 * f / tp), (f / tp, h)]
    else:
        shapes = [(h, 3 * h / tp), (h / tp, h), (h, f / tp), (f / tp, h)]
    if fp8 != "off":
        fwd, dgrad, wgrad = fp8_linear_times(d, m, c, tp, fp8, fp8_gathered)
    else:
        fwd, dgrad, wgrad = (sum(linear_time_s(op, m, k, n, c) for k, n in shapes) for op in ("fwd", "dgrad", "wgrad"))
    if d.arch == "gpt":
        attn, attn_b = megatron_attention_s(d, m, c, tp)
    else:
        # causal: a query meets s/2 keys on average (with CP too: the ring brings the rest); 4 FLOPs
        # per (query, key, head-dim element) for QK^T and AV
        attn_flops = m * 4 * (d.seq / 2) * d.heads * d.head_dim / tp
        attn_bytes = e * m * (h + 2 * kv + h) / tp
        attn, attn_b = kernel_time_s(attn_flops, attn_bytes, c), None
        heads, kv_heads = d.heads / tp, max(1.0, d.kv_heads / tp)
        measured = c.profile.attention_s(m / d.seq, d.seq, heads, kv_heads, d.head_dim, c.peak_flops) if c.profile else None
        if measured is not None:
            attn, attn_b = measured
    whole, split = POINTWISE_ELEMENTS[d.arch](d)
    # sequence parallelism splits the hidden states' passes over tp; TP alone replicates them
    pw_bytes = e * m * (whole / (tp if sp else 1) + split / tp)
    pw = kernel_time_s(0.0, pw_bytes, c)
    return LayerTimes(forward_s=fwd + attn + pw, backward_input_s=dgrad + (attn_b if attn_b is not None else 2.5 * attn)
                      + 2 * pw, backward_weight_s=wgrad, attention_forward_s=attn, pointwise_forward_s=pw)


# Bytes a GPT layer's attention moves per element of its (heads/tp) x s x s scores, in Megatron's
# kernels (Korthikanti et al. 2022, whose activation memory `memory.gpt_layer_activation_bytes`
# follows): the forward writes the QK^T scores (2), the fused scale-mask-softmax reads and writes
# them (4), the attention dropout reads, writes and keeps a 1-byte mask (5) and AV reads the result
# (2); the backward writes dP (2), takes the dropout (5) and the softmax (6) back, and reads the
# score gradient for dQ and dK (4) and the probabilities for dV (2).
SCORE_BYTES = {"forward": 13.0, "backward": 19.0}


def megatron_attention_s(d: ModelDims, tokens: float, c: Cluster, tp: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds of a GPT layer's attention as Megatron-LM runs it: the scores
    materialised, QK^T and AV as batched GEMMs over the whole square (the causal mask is applied
    to the scores, not skipped), the softmax and dropout as memory-bound passes over them
    (`SCORE_BYTES`). The planner's GPT architecture is this model's (its activation memory keeps
    these scores); its Llama is plait's, whose fused attention skips the masked half and keeps none."""
    scores = tokens * d.seq * d.heads / tp  # elements: each token's query meets every key, per head
    gemm = 2 * 2 * scores * d.head_dim  # QK^T and AV
    fwd = kernel_time_s(gemm, 0.0, c) + kernel_time_s(0.0, SCORE_BYTES["forward"] * scores, c)
    bwd = kernel_time_s(2 * gemm, 0.0, c) + kernel_time_s(0.0, SCORE_BYTES["backward"] * scores, c)
    return fwd, bwd


def linear_time_s(op: str, tokens: float, fin: float, fout: float, c: Cluster) -> float:
    """One Linear's matmul (fwd x @ W^T, dgrad dy @ W, wgrad dy^T @ x): measured on a calibrated
    cluster, else the roofline (all three are 2 x tokens x in x out FLOPs)."""
    if c.profile is not None:
        t = c.profile.linear_s(op, tokens, fin, fout, c.peak_flops)
        if t is not None:
            return t
    return gemm_time_s(tokens, fin, fout, c)


def fp8_groups(d: ModelDims, tp: int = 1) -> list[tuple[int, tuple[int, ...]]]:
    """(in, outs) of each group of a block's linears that read one input, on one tensor-parallel rank:
    under torch.compile such a group quantizes its input once (`plait.benchmarks.fp8_linears`)."""
    h, f = d.hidden, d.ffn
    kv = max(d.head_dim, d.kv_dim // tp)  # heads replicated past kv_heads ranks
    if d.arch == "llama":
        return [(h, (h // tp, kv, kv)), (h // tp, (h,)), (h, (f // tp, f // tp)), (f // tp, (h,))]
    return [(h, (3 * h // tp,)), (h // tp, (h,)), (h, (f // tp,)), (f // tp, (h,))]


# HBM bytes an FP8 linear's scaling passes move per element, where no profile measured them (compiled,
# tensorwise; plait/fp8.py): forward, its input's maximum (read 2) and FP8 copy (read 2, write 1), the
# weight's likewise unless gathered in FP8; backward, dy's maximum and its FP8 copy in both layouts
# its two GEMMs read (2 + 2 + 2), the saved FP8 input transposed for the weight gradient (1 + 1), the
# weight cast again (read 2, write 1: compiled blocks recompute it rather than keep it). Rowwise
# scales along each GEMM's contraction, so backward quantizes dy, x and W afresh (2 + 2 + 1 each).
FP8_PASS_BYTES = {"tensorwise": {"x": 5.0, "w": 5.0, "dy": 6.0, "x_bwd": 2.0, "w_bwd": 3.0},
                  "rowwise": {"x": 5.0, "w": 5.0, "dy": 10.0, "x_bwd": 5.0, "w_bwd": 5.0}}


def fp8_linear_times(d: ModelDims, tokens: float, c: Cluster, tp: int, recipe: str,
                     gathered: bool = False) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of a block's linears as FP8 linears.

    On a cluster whose profile measured them (`plait bench calibrate --only fp8`) each group costs
    what it measured, scaled by FLOPs from the nearest measured shape; otherwise its GEMMs run at the
    card's FP8 peak times the matmul efficiency and its scaling passes move FP8_PASS_BYTES. Backward
    splits evenly between its two GEMMs of equal FLOPs. Both are compiled blocks' costs: eager FP8
    linears, whose scaling runs as separate kernels, cost more than this prices them."""
    fwd = bwd = 0.0
    peak8 = c.gpu.tflops["fp8"] * 1e12  # check_layout refused FP8 on a card without it
    pb = FP8_PASS_BYTES[recipe]
    for fin, outs in fp8_groups(d, tp):
        got = c.profile.fp8_group_s(recipe, gathered, tokens, fin, outs) if c.profile is not None else None
        if got is None:
            n = sum(outs)
            flops = 2.0 * tokens * fin * n
            w = 0.0 if gathered else 1.0
            f_bytes = pb["x"] * tokens * fin + w * pb["w"] * fin * n + 2 * tokens * n
            b_bytes = pb["dy"] * tokens * n + pb["x_bwd"] * tokens * fin + w * pb["w_bwd"] * fin * n \
                + 2 * tokens * fin + 2 * fin * n
            eff = peak8 * c.matmul_efficiency
            got = (flops / eff + kernel_time_s(0.0, f_bytes, c), 2 * flops / eff + kernel_time_s(0.0, b_bytes, c))
        fwd += got[0]
        bwd += got[1]
    return fwd, bwd / 2, bwd / 2


# Bytes the fused loss (plait/loss.py) moves per weight of the output matrix and micro-batch, beside
# its matmuls. In one chunk the weight gradient is the GEMM's own 16-bit output, already scaled by
# 1/count inside the softmax: backward only scales it by the incoming gradient (2 + 2) and adds it
# into the flat gradient (6). Over several chunks it goes through an fp32 sum first, which the
# first chunk's GEMM writes and the others add into (read and write, 8), cast to 16 bits (4 + 2).
LOSS_BYTES_PER_WEIGHT = {"one_chunk": 10.0, "chunks": 24.0,
                         # before the scaling moved into the softmax: a zero-filled fp32 buffer (4)
                         # even in one chunk, and a scaling pass (8)
                         "eager": 36.0}
LOSS_BYTES_PER_LOGIT = 4.0  # the fused softmax reads each 16-bit logit and writes its gradient
# Bytes per element of the (tokens, dim) hidden states the final RMSNorm moves, forward + backward:
# compiled, it reads x and writes y (2 + 2), then reads x and dy and writes dx (6); eager, each of
# its fp32 steps is a pass of its own (the cast up, square, mean, scale, cast down, gain; and their
# backward: 36 + 74). The runs recorded before the norm was compiled (`eager`) are priced as they
# were then, without it: added, it moves the one-GPU H100 runs from 1.9% to 2.2% mean error (every
# one of them further off) while it brings the 8b pipeline rows at a 8k vocabulary 1.2 points closer.
NORM_BYTES = {"compiled": 10.0, "eager": 110.0}


def head_times(d: ModelDims, tokens: float, c: Cluster, tp: int = 1, sp: bool = False,
               eager: bool = False, eager_norm: bool = False) -> tuple[float, float]:
    """Forward and backward seconds of the final norm, the output projection and the loss on the last
    stage: the three matmuls split as forward and backward ones, and the memory-bound passes (the
    norm's, the softmax's, the weight gradient's) added to the forward. plait's fused loss runs all
    of it inside its forward; the pipeline's stage costs put both parts there. `eager`: the head as
    plait ran it before its final norm was compiled (`Layout.eager_head`); `eager_norm`: the norm
    uncompiled (that, or `train.compile off`)."""
    from plait.parallel.rules import LOSS_CHUNK_ELEMENTS

    rows = -(-d.vocab // tp)
    fwd = linear_time_s("fwd", tokens, d.hidden, rows, c)
    per_weight = LOSS_BYTES_PER_WEIGHT["eager" if eager else
                                       "one_chunk" if tokens <= max(1, LOSS_CHUNK_ELEMENTS // rows) else "chunks"]
    norm = 0.0 if eager else NORM_BYTES["eager" if eager_norm else "compiled"] * tokens * d.hidden / (tp if sp else 1)
    passes = kernel_time_s(0.0, LOSS_BYTES_PER_LOGIT * tokens * rows + per_weight * rows * d.hidden + norm, c)
    return fwd + passes, linear_time_s("dgrad", tokens, d.hidden, rows, c) + linear_time_s("wgrad", tokens, d.hidden, rows, c)
