"""DDP: gradients all-reduced (averaged) over the grad group in buckets while backward runs.

Per-rank bytes: (2 + 2 + K) P with bf16 parameters and gradients (K = 12: fp32 master and moments);
traffic per step: one all-reduce of the gradients, 2P(N-1)/N sent per rank (ring). With the
embedding sent as rows (`parallel.embedding_rows`), an untied embedding's V x dim elements leave
that all-reduce and each rank sends its T token ids and T x dim output gradients to the N-1 others.
"""

from __future__ import annotations

from plait.optim import FlatAdamW
from plait.parallel.buckets import InFlight, Ready, group_by_size
from plait.parallel.engine import Engine, Groups, TensorSplit


class DDP(Engine):
    """A bucket is a contiguous slice of the flat gradient buffer, so its all-reduce runs in place
    with no copy. Each parameter's post-accumulate-grad hook counts it into its bucket; a full bucket
    is launched asynchronously at once, so its communication overlaps the rest of backward. Only the
    step's last backward reduces: before it, gradients accumulate locally and the hooks do nothing.
    """

    def __init__(self, model, opt: FlatAdamW, comm, groups: Groups, cap: int, split: TensorSplit = TensorSplit(),
                 overlap_ctas: int = 0, rows: bool = False):
        """rows: send the embedding's gradient as the rows the step touched
        (`plait.parallel.embedding_rows`); the model must have no tensor or pipeline split."""
        super().__init__(model, opt, comm, groups, split=split)
        flat = opt.flat
        self.flat = flat
        self.norm_owner = comm.rank(groups.grad) == 0  # every rank holds the same full gradient
        buckets = group_by_size([s.numel for s in flat.slots], cap)
        self.rows, order = None, None
        if rows:
            buckets, order = self._rows_buckets(model, buckets)
        self.ranges = [(flat.slots[g[0]].offset, flat.slots[g[-1]].offset + flat.slots[g[-1]].numel) for g in buckets]
        owners = {id(flat.params[i]): [b] for b, g in enumerate(buckets) for i in g}
        self.ready = Ready([len(g) for g in buckets], owners, self._launch, order)
        self.last = self.ready.order[-1]  # the bucket launched last, which nothing overlaps
        self.inflight = InFlight()
        self.sync = True
        self.hooks = [p.register_post_accumulate_grad_hook(self._arrived) for p in flat.params]
        # Every bucket but the last reduces while the backward's matmuls run beside it: on a
        # communicator of `overlap_ctas` SMs they leave the matmuls more of the GPU (4 x H200, 1b,
        # every collective capped by NCCL_MAX_CTAS: the step's compute 8.2 ms over one GPU's at NCCL's
        # choice, 2.1 ms at 8). The last bucket launched (the embedding's, unless it goes as rows)
        # runs after the backward with nothing beside it, where the cap only slowed it (3.1 -> 6.5
        # ms): it keeps NCCL's choice.
        self.lean = overlap_ctas > 0
        if self.lean:
            comm.lean(groups.grad, overlap_ctas)

    def _rows_buckets(self, model, buckets):
        """The embedding's slot out of its bucket: tied, a bucket of its own launched first (the
        output layer's gradient is all it waits for); untied, in no bucket (its gradient is all
        rows). Returns the buckets and their launch order."""
        from plait.model import DENSE
        from plait.parallel.embedding_rows import RowExchange, RowsDense

        assert model.tp is DENSE and model.embed is not None, "embedding rows need the whole, unsplit model"
        flat, weight = self.flat, model.embed.weight
        e = next(i for i, p in enumerate(flat.params) if p is weight)
        self.rows = RowExchange(self.comm, self.groups.grad, weight)
        self.rows_slot = flat.slots[e]
        model.tp = RowsDense(self.rows)
        cut = [part for g in buckets for part in ([i for i in g if i < e], [e] if e in g else [], [i for i in g if i > e])
               if part]
        tied = model.output is not None and model.output.weight is weight
        if not tied:
            return [g for g in cut if g != [e]], None
        first = cut.index([e])
        return cut, [first] + [b for b in range(len(cut)) if b != first]

    def before_backward(self, first, last):
        self.sync = last

    def _arrived(self, p) -> None:
        if self.sync and id(p) in self.ready.owners:  # an untied embedding's rows are in no bucket
            self.ready.arrived(id(p))

    def _launch(self, b: int) -> None:
        a, e = self.ranges[b]
        lean = self.lean and b != self.last
        self.inflight.add(self.comm.all_reduce(self.flat.grad[a:e], self.groups.grad, op="avg", async_op=True,
                                               lean=lean))

    def step(self, lr, loss_sum):
        self.flat.settle()  # slots no backward reached hold zeros before their buckets go out
        self.ready.flush()  # buckets whose parameters got no gradient still take part
        if self.rows is not None:
            self.rows.launch()
        self.inflight.wait_all()
        if self.rows is not None:  # after the all-reduce that averaged the tied matrix's dense part
            self.rows.add_into(self.flat.view(self.flat.grad, self.rows_slot), 1.0 / self.comm.size(self.groups.grad))
        self.ready.reset()
        self._sum_tied()
        out = self._finish(lr, loss_sum)
        self.flat.zero_grad()
        self.sync = True
        return out
