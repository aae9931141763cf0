"""What every gradient engine shares: the groups it talks on, the backward-order hook, the step's
statistics over the whole mesh, and name-keyed checkpoints.

An engine owns one model part's parameters, gradients and optimizer state. Whoever runs the
micro-batches (the plain loop, later a pipeline executor) drives it:

    engine.before_backward(first, last)    # before each micro-batch's backward of this part
    loss, grad_norm = engine.step(lr, loss_sum)

`first`/`last` say whether this is the first/last backward of the step *for this part*, in the order
the backwards run - not the forwards, which a pipeline schedule runs in a different order. DDP
reduces during the last backward; ZeRO-2/3 reduce every backward and add from the second on.

Groups are names the `plait.comm.Comm` resolves (mesh dims in a run, sub-groups in tests):
  grad       gradients are averaged over it: dp (dp x cp with context parallelism)
  shard      ZeRO shards over it: dp_shard (dp_shard x cp)
  replicate  HSDP replicas all-reduce their shards over it
  tp         tensor parallelism: partial gradients of replicated parameters are summed over it
  stats      every rank of the job: the loss and the squared gradient norm are summed over it
Data coordinates (which slice of the batch a rank reads) are not the engine's business.

Statistics span the mesh. Every element of the global gradient is counted by exactly one rank: a
ZeRO shard by its owner (first replica), a DDP replica's full gradient by dp rank 0, a parameter
that tensor parallelism replicates (norm gains, KV heads when tp > kv heads) by tp rank 0 only,
one that it splits by every tp rank. The loss is counted once per data-parallel rank (tp rank 0, a
rank that holds a loss: the last pipeline stage). One all-reduce of three numbers carries both.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from plait.optim import FlatAdamW, sum_of_squares
from plait.parallel import sharded_state
from plait.ranges import Box, overlap


def tensor_bytes(groups: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    return {k: sum(x.numel() * x.element_size() for x in v) for k, v in groups.items()}


def reduce_dtype_of(name: str, param_dtype: torch.dtype) -> torch.dtype:
    """`parallel.reduce_dtype` resolved: auto reduces in the parameters' dtype."""
    return {"auto": param_dtype, "fp32": torch.float32, "bf16": torch.bfloat16}[name]


@dataclass(frozen=True)
class Groups:
    """Names of the Comm groups an engine talks on (see the module docstring)."""

    grad: str = "dp"
    shard: str = "dp_shard"
    replicate: str = "dp_replicate"
    tp: str = "tp"
    stats: str = "world"
    pp: str = "pp"
    tied: str = "pp_ends"
    cp: str = "cp"


@dataclass(frozen=True)
class TensorSplit:
    """How tensor parallelism cut the parameters, as far as the engines care: for each split
    parameter the box of the full tensor this rank holds; the names of replicated parameters whose
    gradients are partial sums over tp (sequence-parallel norm gains, KV heads shared by tp ranks).
    Every parameter not in `boxes` is replicated over tp."""

    boxes: dict[str, Box] = field(default_factory=dict)
    partial: frozenset[str] = frozenset()
    # pipeline parallelism: parameters that are one of two copies of a tied matrix (the first
    # stage's embedding, the last stage's output), whose gradients are summed over `Groups.tied`;
    # and local names that checkpoints know by another name (the last stage's copy: embed.weight),
    # which this rank neither writes nor counts in the gradient norm (the first stage does)
    tied: frozenset[str] = frozenset()
    aliases: dict[str, str] = field(default_factory=dict)


class Engine:
    """The base of every layout. Subclasses set up gradients and the optimizer and implement
    `step` with `_finish`."""

    def __init__(self, model, opt: FlatAdamW, comm=None, groups: Groups = Groups(), pieces=None,
                 split: TensorSplit = TensorSplit()):
        """pieces: which parts of which parameters the optimizer's buffers hold (default: its range
        of a FlatParams), for checkpoints and the statistics."""
        self.model, self.opt, self.comm, self.groups, self.split = model, opt, comm, groups, split
        self.tp_rank = comm.rank(groups.tp) if comm else 0
        self.tp_size = comm.size(groups.tp) if comm else 1
        self.pp_rank = comm.rank(groups.pp) if comm else 0
        self.pp_size = comm.size(groups.pp) if comm else 1
        pieces = pieces if pieces is not None else sharded_state.flat_pieces(opt.flat, opt.lo, opt.hi)
        pieces = [replace(p, box=split.boxes[p.name]) if p.name in split.boxes else p for p in pieces]
        self._partial = _ranges(p for p in pieces if p.name in split.partial)
        # owned ranges this rank adds to the squared norm: on tp rank 0 all but a copy another stage
        # counts, elsewhere only the tensor-parallel shards
        self._counted = _ranges(p for p in pieces if p.name not in split.aliases
                                and (self.tp_rank == 0 or p.name in split.boxes))
        if self._counted == _ranges(pieces):
            self._counted = None  # everything: the plain (chunked) sum over the segments
        self._copies = {p.offset for p in pieces if p.name in split.aliases}  # read under another name, never written
        self.pieces = [replace(p, name=split.aliases[p.name]) if p.name in split.aliases else p for p in pieces]
        self.tied_params = [p for n, p in model.named_parameters() if n in split.tied]
        # the rank that counts (and writes) this rank's gradient / state: replicas hold copies
        self.norm_owner = True

    # ---- the step ------------------------------------------------------------------------------------

    def before_backward(self, first: bool, last: bool) -> None:
        """Called before each micro-batch's backward of this model part (see the module docstring)."""

    def begin_step(self) -> None:
        """Called by a pipeline executor before a step's first forward (ZeRO-3 gathers its stage),
        and by evaluation before its forward-only batches between steps."""

    def end_forward_only(self) -> None:
        """Called after forward-only work between steps (evaluation): give back what `begin_step`
        gathered (a pipeline stage's ZeRO-3 units)."""

    def _sum_tied(self) -> None:
        """The two copies of a tied matrix (first and last pipeline stage) add their full local
        gradients - after the data-parallel average, which commutes with the sum - so both take
        the same update and stay equal. (Engines whose gradients are whole at step time call it.)"""
        if self.tied_params and self.pp_size > 1:
            grads = [p.grad for p in self.tied_params]
            packed = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1)
            self.comm.all_reduce(packed, self.groups.tied)
            if len(grads) > 1:
                torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(packed.split([g.numel() for g in grads]), grads)])

    def step(self, lr: float, loss_sum: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Finish reducing gradients, clip by the global norm, update. `loss_sum`: this rank's loss
        summed over its micro-batches (None where the rank computes no loss). Returns (global mean
        loss, global pre-clip grad norm) as device tensors."""
        raise NotImplementedError

    def _finish(self, lr: float, loss_sum, segments: list[tuple[int, torch.Tensor]] | None = None):
        """The shared end of a step once the data-parallel reduction is done: sum partial gradients
        over tp, take the global statistics, update. `segments`: (offset in the owned space,
        gradient) pieces covering it (default: the optimizer's own gradient range).

        A non-finite loss or gradient norm skips the update: weights, moments and the optimizer's
        step count stay as they were (the caller sees the non-finite numbers it returns). Every
        rank holds the same all-reduced statistics, and a NaN or inf in any rank's gradient makes
        the global norm non-finite, so all ranks skip alike without another collective. The check
        costs one host sync per step, before the update's kernels are launched."""
        segments = self.opt.grad_segments() if segments is None else segments
        if self._partial and self.tp_size > 1:
            self._sum_partials_over_tp(segments)
        norm, loss = self._statistics(segments, loss_sum)
        if bool(torch.isfinite(norm) & torch.isfinite(loss)):
            self.opt.step(lr, grad=segments, norm=norm)
        return loss, norm

    def _sum_partials_over_tp(self, segments) -> None:
        """One all-reduce over tp carries every partial gradient this rank owns (packed, then unpacked)."""
        views = _views(segments, self._partial)
        packed = torch.cat([v.reshape(-1) for v in views])
        self.comm.all_reduce(packed, self.groups.tp)
        torch._foreach_copy_(views, list(packed.split([v.numel() for v in views])))

    def _statistics(self, segments, loss_sum) -> tuple[torch.Tensor, torch.Tensor]:
        device = segments[0][1].device if segments else self.opt.master.device
        grads = [g for _, g in segments] if self._counted is None else _views(segments, self._counted)
        sq = sum_of_squares(grads, device) if self.norm_owner else torch.zeros((), device=device)
        has_loss = loss_sum is not None and self.tp_rank == 0
        loss = loss_sum.detach().float().reshape(()) if has_loss else torch.zeros((), device=device)
        stats = torch.stack([sq.float(), loss.to(device), torch.tensor(float(has_loss), device=device)])
        if self.comm is not None:
            self.comm.all_reduce(stats, self.groups.stats)
        return stats[0].sqrt(), stats[1] / stats[2].clamp(min=1)

    def global_mean(self, value: float | None) -> float:
        """Mean of a host number over the ranks that hold one, counted once per data-parallel rank
        (the validation loss)."""
        has = value is not None and self.tp_rank == 0
        t = torch.tensor([value if has else 0.0, float(has)], dtype=torch.float64, device=self.opt.master.device)
        if self.comm is not None:
            self.comm.all_reduce(t, self.groups.stats)
        return (t[0] / t[1].clamp(min=1)).item()

    def replicated(self) -> tuple[list[torch.Tensor], str]:
        """The state every data-parallel replica of this rank must hold bit for bit - its fp32
        masters (the weights themselves in fp32) - and the group of those replicas. The replica
        check (`plait.replica`) compares a checksum of it over that group."""
        return [self.opt.master], self.groups.grad

    # ---- state ---------------------------------------------------------------------------------------

    @property
    def shard(self) -> tuple[int, int] | None:
        """(index, count) of the shard files this rank writes; None = the full form (one writer)."""
        if self.tp_size == 1 and self.pp_size == 1:
            return None
        return (self.pp_rank * self.tp_size + self.tp_rank, self.pp_size * self.tp_size)

    @property
    def writes_state(self) -> bool:
        return self.norm_owner

    def written_pieces(self) -> list:
        """What this rank writes: a replicated parameter only from tp rank 0, a tied matrix only from
        the first pipeline stage, so no element is stored twice."""
        split = {self.split.aliases.get(n, n) for n in self.split.boxes}
        return [p for p in self.pieces if p.offset not in self._copies and (self.tp_rank == 0 or p.name in split)]

    def save(self, folder: Path) -> None:
        if self.writes_state:
            sharded_state.write(folder, self.written_pieces(), self.opt, self.shard)

    def load(self, folder: Path, with_optimizer: bool = True) -> None:
        sharded_state.load(folder, self.pieces, self.opt, with_optimizer)
        self.sync_params()

    def load_weights(self, weights: dict[str, torch.Tensor], field: str, source: str) -> None:
        """Start from full fp32 weights keyed by name (`field` = `source` names them in errors)."""
        sharded_state.load_weights(weights, self.pieces, self.opt, field, source)
        self.sync_params()

    def state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds where they peak: at
        the update (`plait plan --validate` compares them with the planner's prediction)."""
        return tensor_bytes(self.memory())

    def sync_params(self) -> None:
        """Make the compute parameters equal the masters again (after a load)."""
        if self.opt.separate:
            self.opt.flat.write_params(self.opt.master, self.opt.lo)

    def memory(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds for parameters, gradients and optimizer state."""
        o = self.opt
        return {"params": [o.flat.data], "grads": o.flat.grad_buffers(),
                "optimizer": ([o.master] if o.separate else []) + [o.exp_avg, o.exp_avg_sq]}

    def gather_for_inference(self) -> None:
        """Make the model part usable for inference by this rank (ZeRO-3 gathers; the rest already are)."""

    def close(self) -> None:
        """Remove the hooks this engine put on the model. A gradient hook is held by autograd's C++
        graph, which Python's garbage collector cannot see through: until it is removed, the model,
        the engine and its optimizer state stay alive after the last reference to them is gone (a
        second model built in the same process would find that memory taken)."""
        for h in getattr(self, "hooks", []):
            h.remove()
        self.hooks = []


def _ranges(pieces) -> list[tuple[int, int]]:
    """Owned-space ranges of the pieces, sorted, adjacent ones merged."""
    out: list[tuple[int, int]] = []
    for a, b in sorted((p.offset, p.offset + p.numel) for p in pieces):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _views(segments, ranges) -> list[torch.Tensor]:
    """Views of the gradient segments (offset, tensor) covering the owned-space `ranges`."""
    out = []
    for off, g in segments:
        for a, b in ranges:
            ov = overlap(a, b, off, off + g.numel())
            if ov is not None:
                out.append(g[ov[0] - off:ov[1] - off])
    return out


class Local(Engine):
    """FlatAdamW over the whole flat space with no data-parallel peer: one device, or a tensor /
    pipeline part whose comm carries only the tp sums, the tied matrix's sum and the statistics. Its
    gradients may lie in pieces that exist only from backward to the update (`plait.flat`)."""

    def step(self, lr, loss_sum):
        if self.tied_params and self.pp_size > 1:
            self.opt.flat.settle()  # every tied copy's gradient in place (zeros where none came)
            self._sum_tied()
        out = self._finish(lr, loss_sum)
        self.opt.zero_grad()
        return out

    def state_bytes(self) -> dict[str, int]:
        flat = self.opt.flat  # at the update every piece is there, whatever is allocated now
        return {**super().state_bytes(), "grads": flat.padded * flat.data.element_size()}


class Sharded(Engine):
    """Shard and replica coordinates shared by the ZeRO engines."""

    def _shard_setup(self, comm, groups: Groups) -> None:
        self.n, self.r = comm.size(groups.shard), comm.rank(groups.shard)
        self.replicas = comm.size(groups.replicate)
        # replicas hold the same shard after their all-reduce: only the first counts and writes it
        self.norm_owner = comm.rank(groups.replicate) == 0

    def replicated(self):
        return [self.opt.master], self.groups.replicate  # a shard has copies only on the other HSDP replicas

    def _update_from_shards(self, lr, loss_sum):
        """For engines that reduce-scatter during backward (ZeRO-2, ZeRO-3): finish the in-flight
        reductions, average across replicas (HSDP), update this rank's shard."""
        self.ready.flush()
        self.inflight.wait_all()
        self.ready.reset()
        segments = self._grad_segments()
        if self.replicas > 1:
            for _, g in segments:
                self.comm.all_reduce(g, self.groups.replicate, op="avg")
        self._sum_tied_chunks(segments)
        return self._finish(lr, loss_sum, segments)

    def _sum_tied_chunks(self, segments) -> None:
        """`_sum_tied` for sharded gradients: the first and last pipeline stage each hold their copy
        of a tied matrix as a unit of its own, chunked alike (same shape, same shard group size), so
        data-parallel rank r of each holds the same elements' averaged gradient; adding the two
        chunks over `Groups.tied` gives both the gradient of the one matrix, as the whole-gradient
        sum followed by the reduce-scatter would (the sum and the average commute)."""
        if not self.tied_params or self.pp_size == 1:
            return
        tied = {id(p) for p in self.tied_params}
        ranges = []
        for u in self.layout.units:
            if any(id(p) in tied for p in u.params):
                assert len(u.params) == 1, "a tied copy must be a unit of its own"
                ranges.append((u.owned, u.owned + u.chunk))
        views = _views(segments, ranges)
        packed = torch.cat(views) if len(views) > 1 else views[0]
        self.comm.all_reduce(packed, self.groups.tied)
        if len(views) > 1:
            torch._foreach_copy_(views, list(packed.split([v.numel() for v in views])))

    def _grad_segments(self) -> list[tuple[int, torch.Tensor]]:
        """(offset in the owned space, reduced gradient) pieces covering it."""
        return [(0, self.acc)]

    @property
    def shard(self):
        per = self.pp_size * self.tp_size
        return (self.r * per + self.pp_rank * self.tp_size + self.tp_rank, self.n * per)
