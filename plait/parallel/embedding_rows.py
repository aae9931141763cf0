"""DDP's embedding gradient sent as the rows a step touched, not as a dense matrix.

An embedding's gradient is a (vocab, dim) tensor, but only the rows of the tokens a step saw are
not zero. DDP all-reduces it like any other gradient: 2(N-1)/N x vocab x dim elements sent a rank.
And the embedding is the first layer, so its gradient is the backward's last: that all-reduce runs
after the backward with nothing beside it to hide it (1b on 4 H200s: 0.5 GB of bf16, 3-4 ms of a
255 ms step). Sent as rows instead - each rank's token ids and the gradient at its embedding's
output, all-gathered - a rank receives (N-1) x T x dim elements for T tokens a rank a step, and
every rank adds all N ranks' rows into its gradient with the kernel the embedding's own backward
runs (`embedding_dense_backward`: rows of one token summed in fp32, deterministically). That is
fewer bytes while N x T < 2 x vocab (1b, 4 ranks x 16k tokens a step against 2 x 128k rows).

A tied matrix still needs its dense all-reduce, for the output layer's part of its gradient. That
part no longer waits for the embedding's (the fused loss forms it as the backward starts), so it
goes out first and runs beside the whole backward, leaving only the rows for the end. Measured on
4 x H200 (1b, tied): the tail after the backward fell from 3.1 to 1.8 ms, but the backward's
matmuls slowed by as much beside the extra transfer (93.5-94.4% weak scaling either way), so
`auto` sends rows only for an untied embedding (8b's shape, 8 layers: +1.6%, 6.6 -> 2.7 ms
exposed, 8.4 -> 6.9 GB a step). `on` sends them for a tied one too.

The lookup keeps the weight out of the autograd graph (a detached weight, the graph hanging on a
dummy leaf), so autograd never sums an embedding gradient into the weight: the tied matrix's
gradient is complete, and its DDP hook fires, as soon as the output layer's part lands.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.model import Dense


class RowExchange:
    """Collects each backward's (token ids, output gradient) of the embedding; after the step's
    last backward, all-gathers them over the data-parallel group and adds every rank's rows into
    the embedding's gradient."""

    def __init__(self, comm, group: str, weight: torch.Tensor):
        self.comm, self.group = comm, group
        self.vocab = weight.shape[0]
        self.anchor = torch.zeros((), device=weight.device, requires_grad=True)  # the graph's leaf
        self.items: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.pending = None

    def lookup(self, weight: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation, generation: a plain lookup
            return F.embedding(tokens, weight)
        return _Lookup.apply(self.anchor, weight.detach(), tokens, self)

    def launch(self) -> None:
        """Start the all-gathers of this step's rows (every rank ran the same micro-batches, so
        every rank gathers tensors of one size)."""
        if not self.items:
            return
        ids = torch.cat([i for i, _ in self.items])
        grads = torch.cat([g for _, g in self.items])
        self.items = []
        self.pending = (self.comm.all_gather(ids, self.group, async_op=True),
                        self.comm.all_gather(grads, self.group, async_op=True))

    def add_into(self, grad: torch.Tensor, scale: float) -> None:
        """grad (vocab, dim) += scale x the gathered rows, summed per token."""
        if self.pending is None:
            return
        ids, rows = (h.wait() for h in self.pending)
        self.pending = None
        # a transient (vocab, dim) buffer, as each micro-batch's dense embedding backward allocates;
        # summing per token in it (sorted, fp32 within a row) keeps a frequent token's many rows
        # from being added one rounding at a time into a 16-bit gradient
        grad.add_(torch.ops.aten.embedding_dense_backward(rows.to(grad.dtype), ids, self.vocab, -1, False),
                  alpha=scale)


class _Lookup(torch.autograd.Function):
    """The embedding lookup whose backward hands (ids, output gradient) to the exchange and gives
    no gradient to the weight (which it was given detached)."""

    @staticmethod
    def forward(ctx, anchor, weight, tokens, exchange):
        ctx.save_for_backward(tokens)
        ctx.exchange = exchange
        return F.embedding(tokens, weight)

    @staticmethod
    def backward(ctx, grad):
        (tokens,) = ctx.saved_tensors
        ctx.exchange.items.append((tokens.reshape(-1), grad.reshape(-1, grad.shape[-1])))
        return None, None, None, None


class RowsDense(Dense):
    """The model's dispatch without tensor parallelism (`plait.model.Dense`), its embedding looked
    up through a `RowExchange`."""

    def __init__(self, exchange: RowExchange):
        self.exchange = exchange

    def embed(self, table, tokens):
        return self.exchange.lookup(table.weight, tokens)
