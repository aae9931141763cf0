"""One block of ring attention: a query chunk against a key/value chunk, "full" (every key earlier)
or "causal" (the same chunk), returning the block's output and log-sum-exp; and its backward, which
takes the *final* output and log-sum-exp of the query chunk (so the block's probabilities come out
normalised over the whole sequence, and D = rowsum(dO * O) is the final one).

Four kernels do the same algebra:
  fused  the CPU's flash attention (`_scaled_dot_product_flash_attention_for_cpu` and its backward,
         which accepts the final output and log-sum-exp): the kernel SDPA itself runs on a CPU
  cudnn  cuDNN's fused attention (`_scaled_dot_product_cudnn_attention` and its backward): what
         SDPA itself picks on Hopper for plait's unsplit attention, and much faster there than
         flash (measured on 4 x H200 at 32k-128k tokens: the ring on flash ran at 0.66-0.81x the
         all-to-all variant, whose one SDPA call ran on cuDNN)
  flash  CUDA's flash attention (`_scaled_dot_product_flash_attention` and its backward), where
         cuDNN's is missing or fails its check
  math   scores in fp32 (any device and dtype), and the only one that masks by document
Without dropout the GPU kernels' backward needs from the forward only the output and log-sum-exp,
so the ring hands them the final ones. `kernel(...)` picks fused on a CPU and cudnn (else flash) on
a GPU when it can, without document masking. These kernels take grouped-query key/value heads as
they are; for the math path the caller expands them to the query heads (the ring still sends only
the key/value heads) and folds their gradients back.
"""

from __future__ import annotations

import torch


NATIVE_GQA = ("fused", "cudnn", "flash")  # kernels that take fewer key/value heads than query heads as they are

_CUDNN_WORKS: dict = {}  # (device, dtype, head size, heads, kv heads) -> whether cuDNN's kernel checked out


def kernel(q: torch.Tensor, docs, k: torch.Tensor) -> str:
    """Without a document mask: fused on a CPU; on a GPU for fp16/bf16 and head sizes flash takes
    (a multiple of 8, at most 256) cudnn when it passes `cudnn_works` for these shapes (k gives the
    key/value head count), else flash; else math."""
    if docs is not None:
        return "math"
    if q.device.type == "cpu":
        return "fused"
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256:
        return "cudnn" if cudnn_works(q, k) else "flash"
    return "math"


def cudnn_works(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether cuDNN's attention runs here for these dtypes, head size and (grouped) head counts and
    agrees with the math path, forward and backward, on a small causal block - once per shape class.
    cuDNN's support varies with its version and the card; a kernel that errors or disagrees is never
    used (flash takes over)."""
    key = (q.device, q.dtype, q.shape[-1], q.shape[1], k.shape[1])
    if key not in _CUDNN_WORKS:
        with torch.autocast(q.device.type, enabled=False):  # the math reference in fp32, whatever the caller runs
            _CUDNN_WORKS[key] = torch.backends.cuda.cudnn_sdp_enabled() and _agrees(q, k)
    return _CUDNN_WORKS[key]


def _agrees(q, k) -> bool:
    g = torch.Generator(device=q.device).manual_seed(0)
    h, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
    a, b, c, do = (torch.randn(1, n, 128, d, device=q.device, dtype=q.dtype, generator=g) for n in (h, hkv, hkv, h))
    scale = d ** -0.5
    try:
        with torch.no_grad():
            out, lse = forward(a, b, c, True, scale, "cudnn")
            grads = backward(do, a, b, c, out, lse, True, scale, "cudnn")
    except RuntimeError:
        return False
    rep = h // hkv
    bx, cx = b.repeat_interleave(rep, 1), c.repeat_interleave(rep, 1)
    ref_out, ref_lse = forward(a, bx, cx, True, scale, "math")
    ref = backward(do, a, bx, cx, ref_out, ref_lse, True, scale, "math")
    ref = (ref[0], *(x.view(1, hkv, rep, 128, d).sum(2) for x in ref[1:]))

    def close(x, y):
        return bool(torch.isfinite(x).all()) and float((x.float() - y).abs().max()) <= 0.05 * max(1.0, float(y.abs().max()))

    return close(out, ref_out) and close(lse, ref_lse) and all(close(x, y) for x, y in zip(grads, ref))


def forward(q, k, v, causal: bool, scale: float, how: str, qdoc=None, kdoc=None, cast: bool = True):
    """(out, lse) of q (B, H, c, d) over k, v (B, H, c, d): out in the accumulation dtype (fp32 for
    16-bit inputs; with `cast` False a fused kernel's out stays in its own dtype, for a caller that
    accumulates it into an fp32 buffer without a copy), lse fp32-or-wider (B, H, c)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    keep = acc if cast else None
    if how == "fused":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out.to(keep or out.dtype), lse.to(acc)
    if how == "cudnn":
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                      scale=scale)[:2]
        return out.to(keep or out.dtype), lse.view(q.shape[:-1])  # cuDNN's log-sum-exp is (B, H, c, 1)
    if how == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out.to(keep or out.dtype), lse
    s = _scores(q.to(acc), k.to(acc), causal, scale, qdoc, kdoc)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - _no_inf(lse)[..., None]) @ v.to(acc), lse


def backward(dout, q, k, v, out, lse, causal: bool, scale: float, how: str, qdoc=None, kdoc=None, cast: bool = True):
    """(dq, dk, dv) of one block given the query chunk's final output `out` and `lse`; in the
    accumulation dtype, or with `cast` False in a fused kernel's own."""
    acc = torch.promote_types(q.dtype, torch.float32) if cast else None
    if how == "fused":
        dt = q.dtype
        lse = lse.to(torch.float32 if dt in (torch.bfloat16, torch.float16) else dt)  # as the forward gave it
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(dt), q, k, v, out.to(dt), lse, 0.0, causal, scale=scale)
        return tuple(g.to(acc or g.dtype) for g in grads)
    if how == "cudnn":
        dt, none = q.dtype, torch.empty(0, device=q.device)  # no dropout: no seed or offset to replay
        # no bias and no cumulative sequence lengths (given ones would mean packed, 3-d tensors)
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout.to(dt).contiguous(), q, k, v, out.to(dt).contiguous(), lse.float().reshape(*q.shape[:-1], 1),
            none, none, None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale)
        return tuple(g.to(acc or g.dtype) for g in grads)
    if how == "flash":
        dt, n = q.dtype, q.shape[2]
        rng = torch.empty(0, device=q.device, dtype=torch.int64)  # no dropout: no random state to replay
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.to(dt).contiguous(), q, k, v, out.to(dt).contiguous(), lse.float().contiguous(), None, None, n,
            k.shape[2], 0.0, causal, rng, rng, scale=scale)
        return tuple(g.to(acc or g.dtype) for g in grads)
    acc = torch.promote_types(q.dtype, torch.float32)
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
