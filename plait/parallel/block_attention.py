"""One block of ring attention: a query chunk against a key/value chunk, "full" (every key earlier)
or "causal" (the same chunk), returning the block's output and log-sum-exp; and its backward, which
takes the *final* output and log-sum-exp of the query chunk (so the block's probabilities come out
normalised over the whole sequence, and D = rowsum(dO * O) is the final one).

Three kernels do the same algebra:
  fused  the CPU's flash attention (`_scaled_dot_product_flash_attention_for_cpu` and its backward,
         which accepts the final output and log-sum-exp): the kernel SDPA itself runs on a CPU
  flash  CUDA's flash attention (`_scaled_dot_product_flash_attention` and its backward) for 16-bit
         blocks whose head size it takes; without dropout its backward needs from the forward only
         the output and log-sum-exp, so the ring hands it the final ones
  math   scores in fp32 (any device and dtype), and the only one that masks by document
`kernel(...)` picks fused on a CPU and flash on a GPU when it can, without document masking.
The flash kernels take grouped-query key/value heads as they are; for the math path the caller
expands them to the query heads (the ring still sends only the key/value heads) and folds their
gradients back.
"""

from __future__ import annotations

import torch


NATIVE_GQA = ("fused", "flash")  # kernels that take fewer key/value heads than query heads as they are


def kernel(q: torch.Tensor, docs) -> str:
    """Without a document mask: fused on a CPU, flash on a GPU for fp16/bf16 and head sizes it takes
    (a multiple of 8, at most 256); else math."""
    if docs is not None:
        return "math"
    if q.device.type == "cpu":
        return "fused"
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256:
        return "flash"
    return "math"


def forward(q, k, v, causal: bool, scale: float, how: str, qdoc=None, kdoc=None):
    """(out, lse) of q (B, H, c, d) over k, v (B, H, c, d): out in the accumulation dtype (fp32 for
    16-bit inputs), lse fp32-or-wider (B, H, c)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    if how == "fused":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out.to(acc), lse.to(acc)
    if how == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out.to(acc), lse
    s = _scores(q.to(acc), k.to(acc), causal, scale, qdoc, kdoc)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - _no_inf(lse)[..., None]) @ v.to(acc), lse


def backward(dout, q, k, v, out, lse, causal: bool, scale: float, how: str, qdoc=None, kdoc=None):
    """(dq, dk, dv) of one block given the query chunk's final output `out` and `lse`."""
    acc = torch.promote_types(q.dtype, torch.float32)
    if how == "fused":
        dt = q.dtype
        lse = lse.to(torch.float32 if dt in (torch.bfloat16, torch.float16) else dt)  # as the forward gave it
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(dt), q, k, v, out.to(dt), lse, 0.0, causal, scale=scale)
        return tuple(g.to(acc) for g in grads)
    if how == "flash":
        dt, n = q.dtype, q.shape[2]
        rng = torch.empty(0, device=q.device, dtype=torch.int64)  # no dropout: no random state to replay
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.to(dt).contiguous(), q, k, v, out.to(dt).contiguous(), lse.float().contiguous(), None, None, n,
            k.shape[2], 0.0, causal, rng, rng, scale=scale)
        return tuple(g.to(acc) for g in grads)
    qa, ka, va, da = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    p = torch.exp(_scores(qa, ka, causal, scale, qdoc, kdoc) - lse[..., None])
    delta = (da * out.to(acc)).sum(-1, keepdim=True)  # D = rowsum(dO * O)
    ds = p * (da @ va.transpose(-1, -2) - delta)
    return (ds @ ka) * scale, (ds.transpose(-1, -2) @ qa) * scale, p.transpose(-1, -2) @ da


def _scores(q, k, causal: bool, scale: float, qdoc=None, kdoc=None) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) * scale  # (B, H, c, c)
    if causal:
        c = s.shape[-1]
        s = s.masked_fill(torch.ones(c, c, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if qdoc is not None:  # another document's keys are masked too
        s = s.masked_fill((qdoc[:, :, None] != kdoc[:, None, :])[:, None], float("-inf"))
    return s


def _no_inf(x: torch.Tensor) -> torch.Tensor:
    """-inf (a query that sees no key of a block: another document's) as 0, so exp(s - lse) stays 0, not NaN."""
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)
