"""An untied embedding looked up from its fp32 master, with no 16-bit copy of the table.

The blocks' weights are read whole at every step, so a 16-bit copy of each is what their matmuls
take. An embedding is read a few rows at a time: keeping a (vocabulary x dim) 16-bit copy of it
beside its fp32 master costs 2 bytes a row element through the whole step, the forward's peak
included (8b: 128,256 x 4,096 x 2 = 1.05 GB; torchtitan's autocast never makes one either: it casts
the linears' weights, not the embedding's). Here the lookup reads the rows from the master and casts
them, which gives the very values the copy held (a cast of each element either way).

Its backward is the embedding's own (`embedding_dense_backward` on the 16-bit output gradient: the
same kernel, the same sums), handed to the flat space's piece for the table (`FlatParams.land_outside`)
rather than to autograd, which would cast a gradient for an fp32 parameter up to a 4-byte
(vocabulary x dim) matrix. The table's parameter is kept out of the graph (given detached), which
hangs on a dummy leaf instead, as `plait.parallel.embedding_rows` does.

Used where an engine holds the table whole and updates it itself: one device, or a pipeline's first
stage with no data-parallel peer (`plait.parallel.engine.Local`), the table untied and not split by
tensor parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class MasterLookup:
    """Installed as the embedding module's forward: tokens -> rows of the fp32 table, in `dtype`."""

    def __init__(self, table: torch.nn.Embedding, flat, dtype: torch.dtype):
        self.table, self.flat, self.dtype = table, flat, dtype
        self.anchor = torch.zeros((), device=table.weight.device, requires_grad=True)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        weight = self.table.weight  # the master's view (FlatParams.attach_master)
        if not torch.is_grad_enabled():  # evaluation, generation
            return F.embedding(tokens, weight).to(self.dtype)
        return _Lookup.apply(self.anchor, weight.detach(), tokens, self)


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, weight, tokens, lookup):
        ctx.save_for_backward(tokens)
        ctx.lookup, ctx.vocab = lookup, weight.shape[0]
        return F.embedding(tokens, weight).to(lookup.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        (tokens,) = ctx.saved_tensors
        grad = torch.ops.aten.embedding_dense_backward(grad_out, tokens, ctx.vocab, -1, False)
        ctx.lookup.flat.land_outside(grad)
        return None, None, None, None


def master_only_name(model, split, tp: int) -> str | None:
    """The embedding's name when this rank's engine may keep it without a 16-bit copy (module
    docstring), else None."""
    table = getattr(model, "embed", None)
    if table is None or tp > 1 or model.cfg.tie_embeddings or table.weight.dtype == torch.float32:
        return None
    if "embed.weight" in split.boxes or "embed.weight" in split.tied:
        return None
    return "embed.weight"


def install(model, flat) -> None:
    """Point the embedding's forward at its master (after the optimizer attached it)."""
    model.embed.forward = MasterLookup(model.embed, flat, flat.dtype)  # the 16-bit dtype the copy had
