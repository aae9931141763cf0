"""Activation recomputation: trade FLOPs for the memory of what backward needs.

  none       every block keeps what autograd saves for its backward
  full       a block keeps only its input; backward re-runs its forward first (about a third more
             FLOPs for the blocks, the least memory)
  selective  a block keeps the outputs of its matmuls, of attention and of the collectives, and
             recomputes the cheap elementwise work in between - RMSNorm, RoPE, SwiGLU's gate
             (Korthikanti et al. 2022 define "selective" for GPT, where the expensive-to-store part is
             the attention softmax; plait's flash attention stores no softmax, so what remains cheap
             to recompute and costly to keep is the elementwise work). Recomputing it costs no
             matmul and no communication.

The wrapper replaces each block's inner `forward` (torch.utils.checkpoint, non-reentrant), so
hooks on the block module - ZeRO-3's gather before and release after - stay outside the recomputed
region, and `torch.compile` of the block traces the checkpoint as one graph. The bytes each mode
keeps per layer are `plait.parallel.activations.layer_bytes` (checked against a measurement).
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_aten = torch.ops.aten


def _saved_ops() -> set:
    """Ops whose outputs selective recomputation keeps (those present in this torch)."""
    names = ["mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"]
    ops = {getattr(_aten, n).default for n in names if hasattr(_aten, n)}
    import plait.comm  # noqa: F401  (registers the plait:: collectives)

    ops |= {torch.ops.plait.all_reduce.default, torch.ops.plait.all_gather.default,
            torch.ops.plait.reduce_scatter.default, torch.ops.plait.all_to_all.default}
    return ops


def _policy(saved, ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _recomputed(forward, context_fn, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation / generation: nothing is saved anyway
        return forward(*args, **kwargs)
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def apply_recompute(model, mode: str) -> None:
    """Wrap every block of `model` for `mode` (none, selective, full); call before compiling."""
    if mode == "none":
        return
    if mode not in ("selective", "full"):
        raise ValueError(f"unknown recompute mode {mode!r}")
    context_fn = None
    if mode == "selective":
        policy = functools.partial(_policy, _saved_ops())
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    for block in model.layers.values():
        block.forward = functools.partial(_recomputed, block.forward, context_fn)
