"""ZeRO stages 1 and 2: optimizer state (and, at stage 2, gradients) sharded over `dp_shard`.

Per-rank bytes with bf16 parameters and gradients and K = 12 bytes of optimizer state per element
(fp32 master + two fp32 Adam moments), P parameters, N shards:
  ZeRO-1  (2 + 2) P + K P / N       full parameters and gradient buffer, 1/N of the state
  ZeRO-2  2 P + (2 + K) P / N       full parameters; gradient and state shards only
Traffic per step (ring): reduce-scatter of the gradients P(N-1)/N + all-gather of the updated
parameters P(N-1)/N = 2P(N-1)/N, the same as DDP's all-reduce. Under HSDP the shard is then
all-reduced over `dp_replicate` (2 (P/N)(R-1)/R).
"""

from __future__ import annotations

import torch

from plait.flat import FlatParams, flat_order
from plait.optim import FlatAdamW
from plait.parallel.buckets import InFlight, Ready, group_by_size
from plait.parallel.engine import Groups, Sharded, TensorSplit
from plait.parallel.shard_space import OwnedSpace, ShardLayout


class Zero1(Sharded):
    """FlatAdamW over this rank's contiguous 1/N of the padded flat space.

    Gradients accumulate in the full flat buffer as on one device (no communication on any
    micro-batch); the step reduce-scatters the whole buffer in place - rank r's averaged shard lands
    in its own slice - updates that slice, and all-gathers the parameters in place. One collective
    each way keeps the shard contiguous, so memory is exactly the formula; the price is that the
    reduce-scatter does not overlap backward (ZeRO-2 does).
    """

    def __init__(self, model, named, t, comm, groups: Groups, compile: bool, split: TensorSplit = TensorSplit()):
        n = comm.size(groups.shard)
        flat = FlatParams(named, pad_to=n)
        per = flat.padded // n
        r = comm.rank(groups.shard)
        opt = FlatAdamW(flat, t, lo=r * per, hi=(r + 1) * per, compile=compile)
        super().__init__(model, opt, comm, groups, split=split)
        self._shard_setup(comm, groups)
        self.flat = flat

    def step(self, lr, loss_sum):
        o, flat, g = self.opt, self.flat, self.groups
        flat.settle()
        self._sum_tied()  # on the whole local gradient, before it is cut into shards
        shard = flat.grad[o.lo:o.hi]
        self.comm.reduce_scatter(flat.grad, g.shard, op="avg", out=shard)
        if self.replicas > 1:
            self.comm.all_reduce(shard, g.replicate, op="avg")
        out = self._finish(lr, loss_sum, [(0, shard)])
        self.sync_params()
        flat.zero_grad()
        return out

    def sync_params(self):
        super().sync_params()  # masters -> own slice (bf16); fp32 masters are the slice
        o = self.opt
        self.comm.all_gather(self.flat.data[o.lo:o.hi], self.groups.shard, out=self.flat.data)


class Zero2(Sharded):
    """Gradients reduce-scattered bucket by bucket while backward runs, then freed.

    Buckets are units of a `ShardLayout`: whole parameters in flat order, about `cap` elements, each
    padded to a multiple of N. Parameters are views of one buffer of all buckets back to back; their
    .grad is left to autograd. When a bucket's last gradient has accumulated, its gradients are
    copied into a staging buffer, .grad is dropped, and the staging buffer is reduce-scattered
    asynchronously into this rank's gradient shard - so a full gradient buffer never exists, only
    the buckets in flight (at most three staging buffers). With accumulation every micro-batch is
    reduced and added into the shard, which is the only gradient memory kept between micro-batches.
    """

    def __init__(self, model, named, t, comm, groups: Groups, cap: int, reduce_dtype: torch.dtype, compile: bool,
                 split: TensorSplit = TensorSplit()):
        n, r = comm.size(groups.shard), comm.rank(groups.shard)
        ordered = flat_order(named)
        buckets = group_by_size([p.numel() for _, p in ordered], cap)
        # a pipeline's copy of a tied matrix is a bucket of its own, chunked alike on both stages,
        # so the two ranks' reduced chunks can be added element by element (`Sharded._sum_tied_chunks`)
        alone = {i for i, (name, _) in enumerate(ordered) if name in split.tied}
        buckets = [part for b in buckets for part in _cut_out(b, alone)]
        layout = ShardLayout([[ordered[i] for i in b] for b in buckets], n, r)
        p0 = ordered[0][1]
        self.layout, self.reduce_dtype = layout, reduce_dtype
        self.data = torch.zeros(layout.padded_numel, dtype=p0.dtype, device=p0.device)
        with torch.no_grad():
            for u in layout.units:
                for s, p in zip(u.slots, u.params):
                    view = u.view(self.data[u.base:u.base + u.padded], s)
                    view.copy_(p)
                    p.data, p.grad = view, None
        # fp32 masters of the owned chunks, contiguous; the full buffer is written back after each step
        master = torch.cat([self._chunk(u).float() for u in layout.units]) if layout.units else None
        self.acc = torch.zeros(layout.owned_numel, dtype=reduce_dtype, device=p0.device)
        opt = FlatAdamW(OwnedSpace(master, self.acc, layout.n_decay), t, compile=compile)
        super().__init__(model, opt, comm, groups, pieces=layout.pieces, split=split)
        self._shard_setup(comm, groups)
        owners = {id(p): [i] for i, u in enumerate(layout.units) for p in u.params}
        self.ready = Ready([len(u.params) for u in layout.units], owners, self._launch)
        self.inflight = InFlight()
        self.first = True  # the first micro-batch writes the shard, later ones add to it
        self.hooks = [p.register_post_accumulate_grad_hook(lambda p: self.ready.arrived(id(p)))
                      for u in layout.units for p in u.params]
        self.peak_staged = 0  # most staging elements alive at once (tests check the bound)

    def _chunk(self, u) -> torch.Tensor:
        lo, hi = u.chunk_range(self.layout.rank)
        return self.data[u.base + lo:u.base + hi]

    def before_backward(self, first, last):
        if not first:  # every backward is reduced: finish the previous one's buckets, count afresh
            self.ready.flush()
            self.ready.reset()
        self.first = first

    def _launch(self, i: int) -> None:
        u = self.layout.units[i]
        staging = torch.empty(u.padded, dtype=self.reduce_dtype, device=self.data.device)
        for s, p in zip(u.slots, u.params):
            dst = staging[s.offset:s.offset + s.numel]
            if p.grad is None:
                dst.zero_()
            else:
                dst.copy_(p.grad.reshape(-1))
                p.grad = None  # the gradient's only copy now is in flight
        staging[u.numel:].zero_()
        out = self.acc[self.layout.owned_slice(u)]
        if self.first:
            h = self.comm.reduce_scatter(staging, self.groups.shard, op="avg", out=out, async_op=True)
            self.inflight.add(h, keep=(staging,))
        else:
            part = torch.empty_like(out)
            h = self.comm.reduce_scatter(staging, self.groups.shard, op="avg", out=part, async_op=True)
            self.inflight.add(h, lambda out=out, part=part: out.add_(part), keep=(staging,))
        self.peak_staged = max(self.peak_staged, sum(k[0].numel() for _, _, k in self.inflight.items))
        self.inflight.wait_all(keep_last=2)

    def step(self, lr, loss_sum):
        out = self._update_from_shards(lr, loss_sum)
        self.sync_params()
        return out

    @torch.no_grad()
    def sync_params(self):
        """Masters into this rank's chunks of the full buffer, then one in-place all-gather per bucket."""
        units, master = self.layout.units, self.opt.master
        torch._foreach_copy_([self._chunk(u) for u in units], [master[self.layout.owned_slice(u)] for u in units])
        for u in units:
            full = self.data[u.base:u.base + u.padded]
            self.inflight.add(self.comm.all_gather(self._chunk(u), self.groups.shard, out=full, async_op=True))
        self.inflight.wait_all()

    def memory(self):
        o = self.opt
        return {"params": [self.data], "grads": [self.acc], "optimizer": [o.master, o.exp_avg, o.exp_avg_sq]}


def _cut_out(bucket: list[int], alone: set[int]) -> list[list[int]]:
    """`bucket` with each index in `alone` made a bucket of its own, the order kept."""
    out: list[list[int]] = [[]]
    for i in bucket:
        if i in alone:
            out += [[i], []]
        else:
            out[-1].append(i)
    return [b for b in out if b]
