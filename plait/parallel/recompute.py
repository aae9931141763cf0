"""Activation recomputation: trade FLOPs for the memory of what backward needs.

  none       every block keeps what autograd saves for its backward
  full       a block keeps only its input; backward re-runs its forward first, up to the last
             tensor it needs (the input of w2: the MLP's output matmul and its exit collective are
             never re-run)
  selective  each residual branch (norm + attention, norm + MLP) keeps its input, the outputs of its
             matmuls but the last (Q, K, V; the MLP's gate and up), attention's output and
             log-sum-exp (ring attention's too: its ring is not run again; under Ulysses the
             exchanged q, k, v and output), with SP the gathered inputs of its column-parallel matmuls, and with TP the
             attention's summed output (the MLP branch's input is computed from it); it
             recomputes the cheap elementwise work in between - RMSNorm, RoPE, SwiGLU's product -
             with no matmul and no communication. (Korthikanti et al. 2022 define "selective" for
             GPT, where the costly-to-store part is the attention softmax; plait's fused attention
             stores no softmax, so the elementwise outputs are what is cheap to recompute and costly
             to keep.)

Each wrapper replaces a block's `forward` (full) or its two branches `attend`/`feed` (selective)
with a non-reentrant torch.utils.checkpoint, so hooks on the block module - ZeRO-3's gather before
and release after - stay outside the recomputed region, and `torch.compile` of the block traces it
as one graph. The bytes each mode keeps per layer: `plait.parallel.activations.layer_bytes`.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_aten = torch.ops.aten
# the FP8 linears' forward GEMM (plait/fp8.py; on a CPU without rows' scales its fp32 stand-in)
# counts as the matmul it replaces; its quantization passes around it are recomputed like any
# element-wise op
MATMULS = {_aten.mm.default, _aten.addmm.default, _aten._scaled_mm.default}
# attention kernels (whichever SDPA picks) and the collectives that enter a tensor-parallel region
KEPT = {getattr(_aten, n).default for n in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                                            "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
        if hasattr(_aten, n)}


@functools.cache  # looked up by every branch's policy, every call: once is enough
def _collectives() -> tuple[set, set]:
    """(entering, leaving) collectives of a tensor-parallel region, as registered ops."""
    import plait.comm  # noqa: F401  (registers the plait:: collectives)

    ops = torch.ops.plait
    return frozenset({ops.all_gather.default}), frozenset({ops.all_reduce.default, ops.reduce_scatter.default})


@functools.cache
def _matmuls() -> frozenset:
    """MATMULS and plait's CPU stand-in for a rowwise FP8 GEMM, as registered ops."""
    import plait.fp8  # noqa: F401  (registers plait::rowwise_mm_cpu)

    return frozenset(MATMULS | {torch.ops.plait.rowwise_mm_cpu.default})


@functools.cache
def _context() -> frozenset:
    """Context parallelism's communicating ops, kept so that backward does not communicate again:
    ring attention's registered op (plait/parallel/context.py), like an attention kernel, and
    Ulysses' all-to-alls (plait/parallel/ulysses.py: the exchanged q, k, v and output; recomputing
    them would repeat the four forward all-to-alls in every layer's backward)."""
    import plait.comm  # noqa: F401  (registers plait::all_to_all)
    import plait.parallel.context  # noqa: F401  (registers plait::ring_attention)

    return frozenset({torch.ops.plait.ring_attention.default, torch.ops.plait.all_to_all.default})


class _BranchPolicy:
    """Keep every matmul output of a branch but its last one (the row-parallel output, which feeds
    only the residual add), the attention kernel's outputs, the entering collectives' outputs, and -
    for the attention branch - the leaving collective's: the MLP branch's input is computed from it,
    and torch.compile's partitioner would otherwise replay that collective (and the output matmul
    under it) in backward. Matmuls are counted in program order, separately for the forward and for
    its recomputation, afresh for every call of the branch."""

    def __init__(self, matmuls: int, keep_exit: bool):
        self.matmul_ops = _matmuls()
        entering, leaving = _collectives()
        self.matmuls, self.kept = matmuls, KEPT | _context() | entering | (leaving if keep_exit else set())
        self.count = {False: 0, True: 0}

    def __call__(self, ctx, op, *args, **kwargs):
        if op in self.matmul_ops:
            i = self.count[ctx.is_recompute] % self.matmuls
            self.count[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if i < self.matmuls - 1 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in self.kept else CheckpointPolicy.PREFER_RECOMPUTE


def _recomputed(forward, context_fn, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation / generation: nothing is saved anyway
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _recompute_everything(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def _everything():
    """Full recomputation as a policy rather than a plain checkpoint: torch 2.11's compiler left the
    ops inside an autograd.Function (the FP8 linears', plait/fp8.py) untagged inside a plain
    checkpoint, and its partitioner then saved their matmul outputs - a compiled FP8 block kept
    8x the input it should (tests/test_activations.py); a policy tags every op it dispatches. In
    eager blocks the policy costs a Python call per op; compiled (the GPU default) it costs nothing."""
    return create_selective_checkpoint_contexts(_recompute_everything)


def _selective(matmuls: int, keep_exit: bool):
    def context_fn():  # a fresh count for every call: a recomputation may stop before the last matmul
        return create_selective_checkpoint_contexts(_BranchPolicy(matmuls, keep_exit))

    return context_fn


def apply_recompute(model, mode: str) -> None:
    """Wrap every block of `model` for `mode` (none, selective, full); call before compiling."""
    if mode == "none":
        return
    if mode not in ("selective", "full"):
        raise ValueError(f"unknown recompute mode {mode!r}")
    for block in model.layers.values():
        if mode == "full":
            block.forward = functools.partial(_recomputed, block.forward, _everything)
        else:  # Q, K, V, output projection; gate, up, down
            block.attend = functools.partial(_recomputed, block.attend, _selective(4, keep_exit=True))
            block.feed = functools.partial(_recomputed, block.feed, _selective(3, keep_exit=False))
