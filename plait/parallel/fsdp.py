"""ZeRO-3 / FSDP: parameters sharded too, gathered one transformer block at a time.

Units: each transformer block's matrices is a unit; an output matrix of its own (untied from the
embedding) is the head unit, after the last block; the root unit is everything else - embedding
(or a tied output), final norm and every block's norm gains (a few thousand numbers per block).
Putting the gains in the root makes every block unit and the head unit decay-only and the root the
last unit of the owned space, so weight decay stays a prefix of it (`plait.parallel.shard_space`).
The head is apart from the root because their transfers are needed at different moments: the
output matrix is read only by the loss, at the end of the forward, and gets its gradient first in
the backward; the embedding is read first and gets its gradient last. As one unit they were gathered
before the first block and reduced after the last backward block, both with no compute beside
them; apart, the head's gather hides under the last block's forward and its reduce-scatter under
the whole backward, which halves those exposed transfers for an untied model (Llama 3 8B in bf16:
the gather and the reduce-scatter at each micro-batch's ends move 1 GB each instead of 2 GB).

Each rank keeps only its chunk of every unit, in fp32, and the two Adam moments of it: the chunk is
the optimizer's master weight (FSDP2's design). A bf16 run casts a unit's chunk to bf16 as it is
gathered, so no bf16 copy of the shard is kept. Gradient chunks (the reduce dtype) exist only from
the backward that reduces a unit to the update that consumes them. Per-rank bytes: K P / N between
steps, (K + 2) P / N at the update with bf16 reduction (K = 12: master 4 + moments 8) - the
(2 + 2 + K) P / N of the ZeRO paper less the bf16 parameter copy, with the gradients allocated as
backward frees activations rather than held through the forward pass.

The schedule around a step (hooks on the model and on every block; `_OnBackward` markers are
identities whose backward marks where a block's backward starts and ends):
  forward   finish the previous backward's reductions (frees their buffers before activations
            build up); root: gather (it stays until its gradients are reduced: the norms are used by every
            block, and a block runs right after); block i: wait for its gather, start gathering
            block i+1 - after the last block, the head (prefetch, so the transfer hides under block
            i's compute), run, free. The final norm waits for the head; when the model's forward
            returns, the head is freed: the fused loss has formed its gradient, backward never reads it.
  backward  start: start gathering the last block. The head's gradient arrives first (the fused
            loss's backward only scales it): packed and reduce-scattered at once, beside the rest.
            block i: wait for its gather, start gathering block i-1, run; when backward has left
            the block, free its parameters; when all its gradients have arrived, pack them into one
            buffer (one copy) and reduce-scatter it into a new gradient chunk (async), drop them.
            Autograd makes each gradient as a tensor of its own: a buffer bound as their .grad
            beforehand would be zeroed and then added into (autograd adds into an existing .grad),
            three passes over the unit's gradients where the packing is two (8b, 4 x H100: the
            step 1.7% shorter). A pipeline stage (`keep`) still binds one: its backwards add into it.
            The root's gradients are left to autograd (the embedding's comes last: a buffer bound at
            the start would sit empty through the activation peak); they are packed into one buffer
            and reduce-scattered last, then the root is freed.
  step      the optimizer updates the owned chunks and drops the gradient chunks; nothing is
            gathered until the next forward.
Traffic per step: all-gather 2 P_blocks + P_head + P_root, reduce-scatter P, i.e. 3P(N-1)/N less the
head's and root's second gathers, which are never needed: nothing in backward reads the embedding or
output matrix (the fused loss keeps its weight gradient from forward; an embedding's backward needs
only the indices). Exposed at the step's ends: the root's gather and reduce-scatter (and the first
and last blocks'), no longer the output matrix's.

The block is compiled on its own (`forward` only), so these hooks run eagerly around it. The
gathering itself (states, buffers, all-gathers) is `plait.parallel.gather.Gathers`; this module is
the policy: which unit is gathered, used and released when.
"""

from __future__ import annotations

import functools

import torch

from plait.optim import FlatAdamW
from plait.parallel.buckets import InFlight, Ready
from plait.parallel.engine import Groups, Sharded, TensorSplit, tensor_bytes
from plait.parallel.fp8_gather import fp8_units
from plait.parallel.gather import Gathers
from plait.parallel.shard_space import OwnedSpace, ShardLayout


class _OnBackward(torch.autograd.Function):
    """Identity in forward; in backward, calls `callback(i)` when the gradient reaches this point.
    Placed at a block's input it fires as backward leaves the block, at its output as backward enters."""

    @staticmethod
    def forward(ctx, x, callback, i):
        ctx.callback, ctx.i = callback, i
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.callback(ctx.i)
        return g, None, None


def own_head(model) -> torch.nn.Parameter | None:
    """The output matrix when it is not the embedding matrix (untied, or a pipeline's last stage
    holding its own copy): the head unit. None for a tied model and a stage without the head."""
    out = getattr(model, "output", None)
    embed = getattr(model, "embed", None)
    if out is None or (embed is not None and out.weight is embed.weight):
        return None
    return out.weight


def units_of(model, alone: frozenset[str] = frozenset()) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """One unit per transformer block (its matrices), then the head unit when the model has an
    output matrix of its own (`own_head`), then a unit for each parameter named in `alone`, then the
    root unit: everything else, its matrices first (weight decay stays a prefix of the owned space).
    `alone`: a pipeline's first stage's copy of a tied embedding, which is chunked as the last
    stage's copy (its head unit) is, so the two ranks' reduced chunks can be added element by element."""
    units, taken = [], set()
    for key, block in model.layers.items():
        mats = [(f"layers.{key}.{name}", p) for name, p in block.named_parameters() if p.ndim >= 2]
        units.append(mats)
        taken.update(id(p) for _, p in mats)
    head = own_head(model)
    if head is not None:
        units.append([("output.weight", head)])
        taken.add(id(head))
    for name, p in model.named_parameters():
        if name in alone and id(p) not in taken:
            units.append([(name, p)])
            taken.add(id(p))
    rest = [(name, p) for name, p in model.named_parameters() if id(p) not in taken]
    units.append([e for e in rest if e[1].ndim >= 2] + [e for e in rest if e[1].ndim < 2])
    return units


class Zero3(Sharded):
    """keep: a pipeline stage's policy. A stage runs many forwards and backwards per step, in the
    schedule's order; gathering every block for each of them would multiply ZeRO-3's traffic by the
    number of micro-batches. So the stage's units are gathered once when the step begins
    (`begin_step`) and released after the update; gradients accumulate in full per-unit buffers and
    are reduce-scattered once, from the step's last backward on. Between steps a rank still holds
    only its shards (fp32 masters, moments): 12 of the 16 bytes per parameter stay divided by N."""

    def __init__(self, model, t, comm, groups: Groups, reduce_dtype: torch.dtype, compile: bool,
                 split: TensorSplit = TensorSplit(), keep: bool = False, cast_once: bool = False,
                 fp8_gather: bool = False):
        n, r = comm.size(groups.shard), comm.rank(groups.shard)
        self.keep, self.sync = keep, True
        self.blocks = list(model.layers.values())
        units = units_of(model, split.tied)
        layout = ShardLayout(units, n, r)
        self.layout, self.reduce_dtype = layout, reduce_dtype
        self.root = len(layout.units) - 1
        # the head unit sits between the last block and the root (None: tied, or no output here)
        self.head = len(self.blocks) if own_head(model) is not None else None
        p0 = units[-1][0][1]
        self.dtype, self.device = p0.dtype, p0.device
        # this rank's chunk of every unit, fp32 (the masters): the only parameter memory kept between uses
        master = torch.promote_types(self.dtype, torch.float32)
        self.shards = torch.zeros(layout.owned_numel, dtype=master, device=self.device)
        fp8 = fp8_units(model, layout) if fp8_gather else ()
        self.gather = Gathers(layout, self.shards, self.dtype, comm, groups.shard, cast_once, fp8, compile)
        for i, u in enumerate(layout.units):
            self.gather.fill_from(i, u.params)
        if fp8:  # the blocks' FP8 linears read the weights gathered in FP8
            self.gather.fp8.bind(model)
            if comm.size(groups.tp) > 1:  # a weight tensor parallelism splits is scaled as the whole matrix
                self.gather.fp8.tp_group = groups.tp
        self.gshards: list = [None] * len(layout.units)  # per unit, this step's reduced gradient chunk
        self.at_update: dict | None = None  # state bytes at the last update (they peak there)
        opt = FlatAdamW(OwnedSpace(self.shards, None, layout.n_decay), t, compile=compile)  # shards = masters
        super().__init__(model, opt, comm, groups, pieces=layout.pieces, split=split)
        self._shard_setup(comm, groups)
        self.grads: list = [None] * len(layout.units)
        # reduce-scatter order = the order backward completes units: the head first (the fused
        # loss's gradient, there as backward begins), then the last block ... the first, root last
        order = self._reduce_order()
        owners = {id(p): [order.index(u.index)] for u in layout.units for p in u.params}
        self.ready = Ready([len(layout.units[k].params) for k in order], owners, lambda j: self._reduce(order[j]))
        self.inflight = InFlight()
        self.hooks = [model.register_forward_pre_hook(self._model_pre), model.register_forward_hook(self._model_post)]
        for i, block in enumerate(self.blocks):
            self.hooks += [block.register_forward_pre_hook(functools.partial(self._block_pre, i)),
                           block.register_forward_hook(functools.partial(self._block_post, i))]
        if self.head is not None:  # the final norm runs just before the loss reads the output matrix
            self.hooks.append(model.norm.register_forward_pre_hook(self._head_pre))
        self.hooks += [p.register_post_accumulate_grad_hook(self._arrived) for u in layout.units for p in u.params]

    def _reduce_order(self) -> list[int]:
        blocks = list(range(len(self.blocks) - 1, -1, -1))
        head = [self.head] if self.head is not None else []
        # a tied embedding's own unit (a pipeline's first stage): its gradient comes last, as the root's
        alone = [i for i in range(len(self.blocks), self.root) if i not in head]
        return head + blocks + alone + [self.root]

    def _arrived(self, p) -> None:
        if self.sync:
            self.ready.arrived(id(p))

    # ---- forward -----------------------------------------------------------------------------------

    def _model_pre(self, module, args):
        # the previous backward's last reductions (the root's packed gradient among them, a full
        # copy of its embedding) would otherwise stay queued, and their buffers held, through this
        # forward's activation peak. Waiting costs nothing: on NCCL it only orders the stream, and
        # the root's all-gather issued next on the same group queues behind them anyway
        self.inflight.wait_all()
        self.gather.wait(self.root)
        self.gather.gather(0)

    def _model_post(self, module, args, out):
        backward = torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad
        if backward:
            out.register_hook(self._backward_begins)
        else:
            self.gather.free(self.root)
        # the fused loss (a scalar) formed the output matrix's gradient in forward: backward never
        # reads the head, so it goes now, before the backward's activation peak. Logits that will be
        # differentiated need it in backward: it goes once its gradient is reduced then.
        if self.head is not None and not self.keep and not (backward and out.ndim > 0):
            self.gather.free(self.head)

    def _block_pre(self, i, module, args):
        self.gather.wait(i)
        # prefetch, hidden under block i's compute: the next block; after the last, the head unit
        self.gather.gather(i + 1 if i + 1 < self.root else -1)
        if torch.is_grad_enabled() and args[0].requires_grad:
            return (_OnBackward.apply(args[0], self._left_block, i),) + tuple(args[1:])

    def _head_pre(self, module, args):
        self.gather.wait(self.head)

    def _block_post(self, i, module, args, out):
        if not self.keep:
            self.gather.free(i)
        if torch.is_grad_enabled() and out.requires_grad:
            return _OnBackward.apply(out, self._entering_block, i)

    # ---- backward ----------------------------------------------------------------------------------

    def before_backward(self, first, last):
        if self.keep:  # gradients accumulate; reduce from the step's last backward on
            self.sync = last
            return
        if not first:  # every backward is reduced: finish the previous one's buckets, count afresh
            self.ready.flush()
            self.ready.reset()
        # The root (norm gains) is released once its gradients are reduced; a backward that follows
        # another without a forward in between needs it back. The head is not read in backward.
        self.gather.wait(self.root)

    def begin_step(self):
        if self.keep:
            for i in range(len(self.gather)):
                self.gather.gather(i)
            for i in range(len(self.gather)):
                self.gather.wait(i)

    def end_forward_only(self):
        if self.keep:
            self.sync_params()  # frees the gathered units; the next step gathers them again

    def _backward_begins(self, grad):
        self.gather.gather(len(self.blocks) - 1)

    def _entering_block(self, i: int) -> None:
        self.gather.wait(i)
        if self.keep:  # several backwards add into one buffer (a pipeline stage's step)
            self._bind_grads(i)
        self.gather.gather(i - 1)

    def _left_block(self, i: int) -> None:
        if not self.keep:
            self.gather.free(i)  # every backward op reading block i's weights has run

    def _bind_grads(self, i: int) -> None:
        """A zeroed gradient buffer for unit i, its parameters' .grad as views: autograd accumulates
        in place, and the buffer is reduce-scattered as it is (padding included)."""
        if self.grads[i] is not None:
            return
        u = self.layout.units[i]
        buf = torch.zeros(u.padded, dtype=self.dtype, device=self.device)
        for s, p in zip(u.slots, u.params):
            p.grad = u.view(buf, s)
        self.grads[i] = buf

    def _packed_grads(self, i: int) -> torch.Tensor:
        """Unit i's gradients as one padded buffer in the reduce dtype: a pipeline stage's bound
        buffer, else one packed from the .grad tensors autograd made (zeros for a parameter no
        gradient reached). A unit of one parameter needing no padding (the head, usually) is its
        .grad as it is: no copy of the output matrix's gradient at the start of backward, when
        activations peak."""
        u, buf = self.layout.units[i], self.grads[i]
        if buf is None and len(u.params) == 1 and u.padded == u.numel and u.params[0].grad is not None:
            buf = u.params[0].grad.reshape(-1)
        if buf is None:
            buf = torch.empty(u.padded, dtype=self.reduce_dtype, device=self.device)
            buf[u.numel:].zero_()  # the padding
            grads = [p.grad for p in u.params]
            if all(g is not None and g.dtype == buf.dtype for g in grads):
                torch.cat([g.reshape(-1) for g in grads], out=buf[:u.numel])  # one copy kernel
            else:
                for s, g in zip(u.slots, grads):  # casting, or filling a slot no gradient reached
                    if g is None:
                        u.view(buf, s).zero_()
                    else:
                        u.view(buf, s).copy_(g)
        return buf if buf.dtype == self.reduce_dtype else buf.to(self.reduce_dtype)

    def _reduce(self, i: int) -> None:
        u, src = self.layout.units[i], self._packed_grads(i)
        for p in u.params:
            p.grad = None
        self.grads[i] = None
        out = self.gshards[i]
        shard = self.groups.shard
        if out is None:  # the step's first reduction of this unit writes a new chunk ...
            self.gshards[i] = out = torch.empty(u.chunk, dtype=self.reduce_dtype, device=self.device)
            self.inflight.add(self.comm.reduce_scatter(src, shard, op="avg", out=out, async_op=True), keep=(src,))
        else:  # ... later backwards add into it
            part = torch.empty_like(out)
            h = self.comm.reduce_scatter(src, shard, op="avg", out=part, async_op=True)
            self.inflight.add(h, lambda out=out, part=part: out.add_(part), keep=(src,))
        self.gather._log("reduce", i)
        if i in (self.root, self.head) and not self.keep:  # the head: already freed unless logits needed it
            self.gather.free(i)
        self.inflight.wait_all(keep_last=2)

    # ---- the step ----------------------------------------------------------------------------------

    def _grad_segments(self):
        return [(u.owned, g) for u, g in zip(self.layout.units, self.gshards)]

    def step(self, lr, loss_sum):
        # no all-gather after the update: each block gathers its new shards when it next runs
        out = self._update_from_shards(lr, loss_sum)
        self.at_update = tensor_bytes(self.memory())  # the gradient chunks' (and kept casts') last moment
        self.gather.drop_casts()  # the shards changed: the next gather casts them again
        self.gshards = [None] * len(self.gshards)
        if self.keep:
            self.sync_params()  # the stage is gathered anew from the updated shards at the next step
            self.sync = True
        return out

    def state_bytes(self):
        return self.at_update if self.at_update is not None else super().state_bytes()

    def sync_params(self):
        self.gather.drop_casts()  # after a load the shards are new
        for i in range(len(self.gather)):  # the masters are the shards: regather from them when next used
            self.gather.free(i)

    def memory(self):
        o = self.opt
        grads = [g for g in self.gshards + self.grads if g is not None]
        return {"params": [self.shards] + self.gather.resident() + self.gather.kept_casts(), "grads": grads,
                "optimizer": [o.exp_avg, o.exp_avg_sq]}

    def gather_for_inference(self) -> None:
        """Gather every unit and remove the hooks: the model is whole on every rank from now on
        (in the compute dtype: FP8-gathered units too, for matmuls that read the weights themselves)."""
        if self.gather.fp8 is not None:
            self.gather.fp8.unbind(self.model)
            self.gather.set_fp8(False)
        for i in range(len(self.gather)):
            self.gather.wait(i)
        self.close()
