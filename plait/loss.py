"""Output projection fused with cross-entropy, computed in chunks of tokens.

For a 128k vocabulary the logits of one 8x2048 micro-batch are 2.1G numbers (8 GB in fp32): more
than the rest of a 1B model's activations together. Here each chunk's logits are formed, turned
into the loss and into d(loss)/d(logits) at once, multiplied back into the gradients of the hidden
states and of the weight, and dropped. Memory is one chunk; the FLOPs are the same as the unfused
form (one forward and two backward matmuls). The backward pass only scales the stored gradients.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from plait.parallel.rules import LOSS_CHUNK_ELEMENTS

IGNORE_INDEX = -100
_CHUNK_ELEMENTS = LOSS_CHUNK_ELEMENTS  # logits per chunk (shared with the planner)


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with acc in fp32 and a, b in bf16. On CUDA, cuBLAS writes the fp32 sum directly
    (one pass over acc); elsewhere the bf16 product is formed and added."""
    if acc.is_cuda and a.dtype != acc.dtype:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except (TypeError, RuntimeError):
            pass  # torch without mixed-dtype addmm: fall through
    acc += (a @ b.to(a.dtype)).to(acc.dtype)


def ce_chunk(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed loss (fp32) of one chunk, and `scale` x d(sum loss)/d(logits) in the logits' dtype (the
    mean's 1/count applied here, inside the fused kernel, rather than as a pass over the gradients
    of the hidden states and of the output matrix afterwards); fused under compile."""
    lf = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (n, V), at least fp32
    lse = torch.logsumexp(lf, dim=-1)  # (n,)
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0)
    target_logit = lf.gather(1, safe[:, None]).squeeze(1)
    loss = ((lse - target_logit) * valid).sum()
    grad = torch.exp(lf - lse[:, None])
    grad = grad - torch.nn.functional.one_hot(safe, lf.shape[1]).to(grad.dtype)
    grad = grad * (valid[:, None] * scale)
    return loss, grad.to(logits.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk_fn, defer):
        # h: (N, dim) final hidden states; weight: (V, dim); targets: (N,)
        n_tokens = h.shape[0]
        chunk = max(1, _CHUNK_ELEMENTS // weight.shape[0])
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        kept = [] if need_w and defer is not None else None
        grad_w, one_chunk = _NONE_YET if need_w and kept is None else None, n_tokens <= chunk
        scale = _mean_scale(targets, h.dtype)
        total = torch.zeros((), dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
        for s in range(0, n_tokens, chunk):
            hc = h[s:s + chunk]
            logits = hc @ weight.t()  # (n, V) in the compute dtype (autocast applies here)
            loss_c, g = chunk_fn(logits, targets[s:s + chunk], scale)
            # the logits go before the output matrix's gradient is formed beside g: in one chunk that
            # GEMM's output is a third (n, V)-sized buffer (8b's shape: 1 GB less at the peak)
            del logits
            total += loss_c
            grad_w = _chunk_grads(g, h, hc, s, weight, grad_h, grad_w, one_chunk)
            if kept is not None:
                kept.append((g, hc))
            # drop this chunk before the next is formed: held across the assignment, the old
            # gradient would add a chunk to the peak
            del g
        loss = _finish(ctx, total * scale, grad_h, grad_w, weight)
        ctx.deferred = (defer, weight, kept, one_chunk) if kept is not None else None
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        return _scaled(ctx, grad_out) + (None, None, None)


def _mean_scale(targets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """1 / the number of counted targets, in `dtype` (at least fp32), on the device: no host sync."""
    return 1.0 / (targets != IGNORE_INDEX).sum().clamp(min=1).to(torch.promote_types(dtype, torch.float32))


# A weight gradient made in one chunk is the GEMM's own output, in the weights' dtype: no buffer to
# accumulate into and cast (24 bytes a weight of passes, at 16 bits). Over several chunks it
# accumulates in fp32, since bf16 sums of 16+ chunks lose bits; the first chunk's GEMM writes the
# fp32 buffer itself (no zero-filled buffer to add into). `_NONE_YET` stands for it until then.
_NONE_YET = object()


def _mm_to(dtype: torch.dtype, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b, written in `dtype` (fp32 from bf16 operands: on CUDA by cuBLAS directly)."""
    if a.is_cuda and a.dtype != dtype:
        try:
            return torch.mm(a, b, out_dtype=dtype)
        except (TypeError, RuntimeError):
            pass  # torch without mixed-dtype mm: fall through
    return (a @ b).to(dtype)


def _chunk_grads(g, h, hc, s, weight, grad_h, grad_w, one_chunk: bool):
    """A chunk's (scaled) d(loss)/d(logits) g into the hidden states' gradient rows and the weight's
    gradient; returns the weight's gradient so far (None: not wanted)."""
    if grad_h is not None:
        grad_h[s:s + hc.shape[0]] = (g @ weight.to(g.dtype)).to(h.dtype)
    if grad_w is None:
        return None
    a, b = g.t(), hc.to(g.dtype)
    if one_chunk:  # hc is all of h; fp32 weights under 16-bit autocast get the GEMM's fp32 output
        return _mm_to(weight.dtype, a, b)
    if grad_w is _NONE_YET:
        return _mm_to(torch.promote_types(weight.dtype, torch.float32), a, b)
    _accumulate_mm(grad_w, a, b)
    return grad_w


def _finish(ctx, loss, grad_h, grad_w, weight):
    """Keep the mean's gradients formed in forward (already scaled by 1/count), the weight's in
    its own dtype; return the mean loss."""
    if grad_w is _NONE_YET:  # no tokens
        grad_w = torch.zeros_like(weight)
    elif grad_w is not None and grad_w.dtype != weight.dtype:
        grad_w = grad_w.to(weight.dtype)
    # backward takes them out of ctx and scales them in place: the weight's gradient reaches autograd
    # as the only reference to it, which autograd hands on as .grad without a copy (its product with
    # grad_out was a second such matrix, formed while the first was still held)
    ctx.grads = (grad_h, grad_w)
    return loss


def _scaled(ctx, grad_out) -> tuple:
    """Backward of a fused loss: the gradients formed in forward, times the incoming one. A deferred
    weight gradient goes to its store instead (`linear_cross_entropy`'s `defer`)."""
    if ctx.grads is None:
        raise RuntimeError("the fused loss's backward ran twice: it hands its gradients on the first time")
    (grad_h, grad_w), ctx.grads = ctx.grads, None
    gh = grad_h.mul_(grad_out.to(grad_h.dtype)) if grad_h is not None else None
    gw = grad_w.mul_(grad_out.to(grad_w.dtype)) if grad_w is not None else None
    if ctx.deferred is not None:
        store, weight, kept, one_chunk = ctx.deferred
        ctx.deferred = None  # the store holds the chunks now; a second backward would find none
        store.keep_fn(weight, functools.partial(_deferred_weight_grad, weight, kept, one_chunk, grad_out))
    return gh, gw


def _deferred_weight_grad(weight, kept, one_chunk: bool, grad_out) -> torch.Tensor:
    """The output matrix's gradient from the chunks' kept (scaled d(loss)/d(logits), hidden states),
    by the same GEMMs, sums and casts as in the loss's forward: bit for bit what it would have been."""
    grad_w = _NONE_YET
    for g, hc in kept:
        grad_w = _chunk_grads(g, None, hc, 0, weight, None, grad_w, one_chunk)
    if grad_w is _NONE_YET:  # no tokens
        grad_w = torch.zeros_like(weight)
    elif grad_w.dtype != weight.dtype:
        grad_w = grad_w.to(weight.dtype)
    return grad_w * grad_out.to(grad_w.dtype)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_fn: Callable = ce_chunk, defer=None) -> torch.Tensor:
    """Mean next-token loss of `h @ weight.T` against `targets`, never materialising all logits.

    `defer`: a `plait.parallel.wgrad.WeightGradStore` that takes the output matrix's gradient, to
    be formed when its W runs (a zero-bubble pipeline's last stage): the loss keeps each chunk's
    d(loss)/d(logits) (tokens x vocabulary, 16-bit) until then instead of multiplying it into the
    weight's gradient at once. The input gradient, which the stage before waits for, is formed as
    always."""
    return _LinearCrossEntropy.apply(h, weight, targets, chunk_fn, defer)


def vp_chunk_stats(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int):
    """One vocabulary shard's part of a chunk's cross-entropy: (logsumexp over this shard, the
    target's logit where this shard holds the target else 0), both (n,) fp32, and the fp32 logits
    with padding columns (ids >= vocab_size) at -inf. Fused under compile."""
    lf = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (n, V/tp)
    ids = vocab_start + torch.arange(lf.shape[1], device=lf.device)
    lf = lf.masked_fill(ids[None, :] >= vocab_size, float("-inf"))
    local = targets - vocab_start
    mine = (local >= 0) & (local < lf.shape[1]) & (targets != IGNORE_INDEX)
    safe = torch.where(mine, local, 0)
    target_logit = torch.where(mine, lf.gather(1, safe[:, None]).squeeze(1), 0.0)
    return torch.logsumexp(lf, dim=-1), target_logit, lf


def vp_chunk_grad(lf: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, vocab_start: int, dtype,
                  scale: torch.Tensor):
    """`scale` x d(sum loss)/d(local logits) of a chunk once the global logsumexp is known: softmax
    over the whole vocabulary restricted to this shard, minus the one-hot where the shard holds the
    target (scaled by the mean's 1/count here, as in `ce_chunk`)."""
    valid = targets != IGNORE_INDEX
    local = targets - vocab_start
    mine = (local >= 0) & (local < lf.shape[1]) & valid
    grad = torch.exp(lf - lse[:, None])
    onehot = torch.nn.functional.one_hot(torch.where(mine, local, 0), lf.shape[1]).to(grad.dtype) * mine[:, None]
    return ((grad - onehot) * (valid[:, None] * scale)).to(dtype)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The fused loss with the output matrix split by vocabulary rows over tp (Megatron's
    vocab-parallel cross-entropy, kept in plait's chunks): each rank forms only its (n, V/tp) logits
    per chunk; the ranks' logsumexps and target logits travel in one all-gather of 2n numbers and
    combine exactly (logsumexp of logsumexps). The full logits never exist on any rank. grad_h is
    this shard's part: the caller's region entry (copy_to or the SP all-gather) sums it over tp."""

    @staticmethod
    def forward(ctx, h, weight, targets, comm, dim, vocab_start, vocab_size, fns, defer):
        # h: (N, dim) on every tp rank; weight: (V/tp, dim) this rank's rows; targets: (N,)
        stats_fn, grad_fn = fns
        n_tokens = h.shape[0]
        chunk = max(1, _CHUNK_ELEMENTS // weight.shape[0])
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        kept = [] if need_w and defer is not None else None
        grad_w, one_chunk = _NONE_YET if need_w and kept is None else None, n_tokens <= chunk
        scale = _mean_scale(targets, h.dtype)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, n_tokens, chunk):
            hc, tc = h[s:s + chunk], targets[s:s + chunk]
            logits = hc @ weight.t()  # (n, V/tp)
            lse_local, tgt_local, lf = stats_fn(logits, tc, vocab_start, vocab_size)
            dtype = logits.dtype
            del logits  # as in _LinearCrossEntropy: lf holds what the gradient needs
            parts = comm.all_gather(torch.stack([lse_local, tgt_local]), dim)  # (tp * 2, n)
            parts = parts.view(-1, 2, lse_local.shape[0])
            lse = torch.logsumexp(parts[:, 0], dim=0)
            target_logit = parts[:, 1].sum(0)
            valid = tc != IGNORE_INDEX
            total += ((lse - target_logit) * valid).sum()
            g = grad_fn(lf, lse, tc, vocab_start, dtype, scale) if need_h or need_w else None
            del lf, lse_local, tgt_local  # before the weight-gradient GEMM, as the logits above
            if g is not None:
                grad_w = _chunk_grads(g, h, hc, s, weight, grad_h, grad_w, one_chunk)
                if kept is not None:
                    kept.append((g, hc))
                del g  # one chunk alive at a time
        loss = _finish(ctx, total * scale, grad_h, grad_w, weight)
        ctx.deferred = (defer, weight, kept, one_chunk) if kept is not None else None
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        return _scaled(ctx, grad_out) + (None,) * 7


def vocab_parallel_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, comm, dim: str,
                                 vocab_start: int, vocab_size: int, fns=None, defer=None) -> torch.Tensor:
    """Mean next-token loss with `weight` holding vocabulary rows [vocab_start, vocab_start +
    weight.shape[0]) of a `vocab_size` vocabulary (rows past it are padding); see the class.
    `defer`: as in `linear_cross_entropy`."""
    return _VocabParallelCrossEntropy.apply(h, weight, targets, comm, dim, vocab_start, vocab_size,
                                            fns or (vp_chunk_stats, vp_chunk_grad), defer)
