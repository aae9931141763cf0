"""One block of ring attention: a query chunk against a key/value chunk, "full" (every key earlier)
or "causal" (the same chunk), returning the block's output and log-sum-exp; and its backward, which
takes the *final* output and log-sum-exp of the query chunk (so the block's probabilities come out
normalised over the whole sequence, and D = rowsum(dO * O) is the final one).

Two kernels do the same algebra:
  fused  the CPU's flash attention (`_scaled_dot_product_flash_attention_for_cpu` and its backward,
         which accepts the final output and log-sum-exp): the kernel SDPA itself runs
  math   scores in fp32 (any device and dtype), and the only one that masks by document
`kernel(...)` picks fused on a CPU without document masking. GPUs take the math path until CUDA's
flash backward, whose forward bookkeeping this ring would have to hand back, is checked on a GPU
against it. Key/value heads are expanded to the query heads for a block (the ring still sends only
the key/value heads) and their gradients folded back by the caller.
"""

from __future__ import annotations

import torch


def kernel(q: torch.Tensor, docs) -> str:
    """fused on a CPU without a document mask, else math."""
    return "fused" if docs is None and q.device.type == "cpu" else "math"


def forward(q, k, v, causal: bool, scale: float, how: str, qdoc=None, kdoc=None):
    """(out, lse) of q (B, H, c, d) over k, v (B, H, c, d): out in the accumulation dtype (fp32 for
    16-bit inputs), lse fp32-or-wider (B, H, c)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    if how == "fused":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out.to(acc), lse.to(acc)
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
