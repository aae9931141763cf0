"""Output projection fused with cross-entropy, computed in chunks of tokens.

For a 128k vocabulary the logits of one 8x2048 micro-batch are 2.1G numbers (8 GB in fp32): more
than the rest of a 1B model's activations together. Here each chunk's logits are formed, turned
into the loss and into d(loss)/d(logits) at once, multiplied back into the gradients of the hidden
states and of the weight, and dropped. Memory is one chunk; the FLOPs are the same as the unfused
form (one forward and two backward matmuls). The backward pass only scales the stored gradients.
"""

from __future__ import annotations

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


def ce_chunk(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed loss (fp32) and d(sum loss)/d(logits) (logits' dtype) of one chunk; fused under compile."""
    lf = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (n, V), at least fp32
    lse = torch.logsumexp(lf, dim=-1)  # (n,)
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0)
    target_logit = lf.gather(1, safe[:, None]).squeeze(1)
    loss = ((lse - target_logit) * valid).sum()
    grad = torch.exp(lf - lse[:, None])
    grad = grad - torch.nn.functional.one_hot(safe, lf.shape[1]).to(grad.dtype)
    grad = grad * valid[:, None]
    return loss, grad.to(logits.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk_fn):
        # h: (N, dim) final hidden states; weight: (V, dim); targets: (N,)
        n_tokens = h.shape[0]
        chunk = max(1, _CHUNK_ELEMENTS // weight.shape[0])
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        # accumulate the weight gradient over chunks in fp32: bf16 sums of 16+ chunks lose bits
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
        for s in range(0, n_tokens, chunk):
            hc = h[s:s + chunk]
            logits = hc @ weight.t()  # (n, V) in the compute dtype (autocast applies here)
            loss_c, g = chunk_fn(logits, targets[s:s + chunk])
            total += loss_c
            _chunk_grads(g, h, hc, s, weight, grad_h, grad_w)
            # drop this chunk before the next is formed: held across the assignment, the old logits
            # and gradient would add a third chunk to the peak
            del logits, g
        return _finish(ctx, total, targets, grad_h, grad_w, weight)

    @staticmethod
    def backward(ctx, grad_out):
        return _scaled(ctx, grad_out) + (None, None)


def _chunk_grads(g, h, hc, s, weight, grad_h, grad_w) -> None:
    """A chunk's d(loss)/d(logits) g into the hidden states' gradient rows and the weight's gradient."""
    if grad_h is not None:
        grad_h[s:s + hc.shape[0]] = (g @ weight.to(g.dtype)).to(h.dtype)
    if grad_w is not None:
        _accumulate_mm(grad_w, g.t(), hc.to(g.dtype))


def _finish(ctx, total, targets, grad_h, grad_w, weight):
    """Mean over the counted tokens: scale the loss and the gradients formed in forward, keep them."""
    count = (targets != IGNORE_INDEX).sum().clamp(min=1)
    scale = 1.0 / count.to(total.dtype)
    if grad_h is not None:
        grad_h.mul_(scale.to(grad_h.dtype))
    if grad_w is not None:
        grad_w = grad_w.mul_(scale.to(grad_w.dtype)).to(weight.dtype)
    ctx.save_for_backward(grad_h, grad_w)
    return total * scale


def _scaled(ctx, grad_out) -> tuple:
    """Backward of a fused loss: the gradients formed in forward, times the incoming one."""
    grad_h, grad_w = ctx.saved_tensors
    gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
    gw = grad_w * grad_out.to(grad_w.dtype) if grad_w is not None else None
    return gh, gw


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_fn: Callable = ce_chunk) -> torch.Tensor:
    """Mean next-token loss of `h @ weight.T` against `targets`, never materialising all logits."""
    return _LinearCrossEntropy.apply(h, weight, targets, chunk_fn)


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


def vp_chunk_grad(lf: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, vocab_start: int, dtype):
    """d(sum loss)/d(local logits) of a chunk once the global logsumexp is known: softmax over the
    whole vocabulary restricted to this shard, minus the one-hot where the shard holds the target."""
    valid = targets != IGNORE_INDEX
    local = targets - vocab_start
    mine = (local >= 0) & (local < lf.shape[1]) & valid
    grad = torch.exp(lf - lse[:, None])
    onehot = torch.nn.functional.one_hot(torch.where(mine, local, 0), lf.shape[1]).to(grad.dtype) * mine[:, None]
    return ((grad - onehot) * valid[:, None]).to(dtype)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The fused loss with the output matrix split by vocabulary rows over tp (Megatron's
    vocab-parallel cross-entropy, kept in plait's chunks): each rank forms only its (n, V/tp) logits
    per chunk; the ranks' logsumexps and target logits travel in one all-gather of 2n numbers and
    combine exactly (logsumexp of logsumexps). The full logits never exist on any rank. grad_h is
    this shard's part: the caller's region entry (copy_to or the SP all-gather) sums it over tp."""

    @staticmethod
    def forward(ctx, h, weight, targets, comm, dim, vocab_start, vocab_size, fns):
        # h: (N, dim) on every tp rank; weight: (V/tp, dim) this rank's rows; targets: (N,)
        stats_fn, grad_fn = fns
        n_tokens = h.shape[0]
        chunk = max(1, _CHUNK_ELEMENTS // weight.shape[0])
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, n_tokens, chunk):
            hc, tc = h[s:s + chunk], targets[s:s + chunk]
            logits = hc @ weight.t()  # (n, V/tp)
            lse_local, tgt_local, lf = stats_fn(logits, tc, vocab_start, vocab_size)
            parts = comm.all_gather(torch.stack([lse_local, tgt_local]), dim)  # (tp * 2, n)
            parts = parts.view(-1, 2, lse_local.shape[0])
            lse = torch.logsumexp(parts[:, 0], dim=0)
            target_logit = parts[:, 1].sum(0)
            valid = tc != IGNORE_INDEX
            total += ((lse - target_logit) * valid).sum()
            if need_h or need_w:
                _chunk_grads(grad_fn(lf, lse, tc, vocab_start, logits.dtype), h, hc, s, weight, grad_h, grad_w)
            del logits, lf, lse_local, tgt_local  # as in _LinearCrossEntropy: one chunk alive at a time
        return _finish(ctx, total, targets, grad_h, grad_w, weight)

    @staticmethod
    def backward(ctx, grad_out):
        return _scaled(ctx, grad_out) + (None,) * 6


def vocab_parallel_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, comm, dim: str,
                                 vocab_start: int, vocab_size: int, fns=None) -> torch.Tensor:
    """Mean next-token loss with `weight` holding vocabulary rows [vocab_start, vocab_start +
    weight.shape[0]) of a `vocab_size` vocabulary (rows past it are padding); see the class."""
    return _VocabParallelCrossEntropy.apply(h, weight, targets, comm, dim, vocab_start, vocab_size,
                                            fns or (vp_chunk_stats, vp_chunk_grad))
