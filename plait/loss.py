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

IGNORE_INDEX = -100
_CHUNK_ELEMENTS = 1 << 29  # logits per chunk: 1 GiB in bf16; fewer chunks = fewer passes over grad_w


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
            if need_h:
                grad_h[s:s + chunk] = (g @ weight.to(g.dtype)).to(h.dtype)
            if need_w:
                _accumulate_mm(grad_w, g.t(), hc.to(g.dtype))
        count = (targets != IGNORE_INDEX).sum().clamp(min=1)
        scale = 1.0 / count.to(total.dtype)
        if need_h:
            grad_h.mul_(scale.to(grad_h.dtype))
        if need_w:
            grad_w = grad_w.mul_(scale.to(acc)).to(weight.dtype)
        ctx.save_for_backward(grad_h if need_h else None, grad_w if need_w else None)
        return total * scale

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        gw = grad_w * grad_out.to(grad_w.dtype) if grad_w is not None else None
        return gh, gw, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_fn: Callable = ce_chunk) -> torch.Tensor:
    """Mean next-token loss of `h @ weight.T` against `targets`, never materialising all logits."""
    return _LinearCrossEntropy.apply(h, weight, targets, chunk_fn)
