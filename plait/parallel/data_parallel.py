"""Data parallelism for `plait train`: one engine per layout, all with the same small interface.

    engine = apply_data_parallel(model, cfg, comm)      # comm=None: one device
    for i, (x, y) in enumerate(micro_batches):
        engine.begin_micro(i, len(micro_batches))
        (model(x, y) / len(micro_batches)).backward()
    loss, grad_norm = engine.step(lr, loss_sum)          # global mean loss; grads reduced, clipped, applied

  engine  gradients                                        optimizer state   parameters after the step
  Local   flat buffer                                      all               updated in place
  DDP     flat buffer, all-reduced in buckets while the    all               updated in place, equal on
          last micro-batch's backward runs                                   every rank
  ZeRO-1  flat buffer, reduce-scattered after backward     1/N, contiguous   all-gathered
  ZeRO-2  1/N shard; buckets reduce-scattered during       1/N per bucket    all-gathered per bucket
          backward, then freed
  ZeRO-3  1/N shard per block (plait.parallel.fsdp)        1/N per block     stay sharded; gathered per
                                                                             block before use

Groups are named, not global: an engine talks on `dp` (every rank with its own data: loss mean),
`dp_shard` (the ranks a ZeRO stage shards over) and `dp_replicate` (HSDP replicas, which all-reduce
their shards), through a `plait.comm.Comm` that maps the names to process groups - the mesh in a
run, sub-groups in tests - and counts every byte in its ledger.

Gradients are averaged over all dp ranks: each rank's loss is the mean over its tokens, so the mean
of the ranks' gradients is the gradient of the global mean loss - the single-device gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from plait.errors import bad_value
from plait.flat import FlatParams
from plait.optim import FlatAdamW
from plait.parallel import sharded_state
from plait.parallel.buckets import InFlight, Ready, bucket_cap, group_by_size


def tensor_bytes(groups: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    return {k: sum(x.numel() * x.element_size() for x in v) for k, v in groups.items()}


@dataclass(frozen=True)
class DPNames:
    """Names of the mesh dims the engines talk on (keys of the Comm's groups)."""

    dp: str = "dp"
    shard: str = "dp_shard"
    replicate: str = "dp_replicate"


def reduce_dtype_of(name: str, param_dtype: torch.dtype) -> torch.dtype:
    """`parallel.reduce_dtype` resolved: auto reduces in the parameters' dtype."""
    return {"auto": param_dtype, "fp32": torch.float32, "bf16": torch.bfloat16}[name]


class Engine:
    """What every layout shares: data-parallel coordinates, the loss/norm statistics, checkpoints."""

    def __init__(self, model, opt: FlatAdamW, comm=None, names: DPNames = DPNames(), pieces=None):
        """pieces: which parts of which parameters the optimizer's buffers hold (default: its range
        of a FlatParams), for checkpoints."""
        self.model, self.opt, self.comm, self.names = model, opt, comm, names
        self.rank = comm.rank(names.dp) if comm else 0
        self.size = comm.size(names.dp) if comm else 1
        self.pieces = pieces if pieces is not None else sharded_state.flat_pieces(opt.flat, opt.lo, opt.hi)
        # which rank adds its gradient shard's squared norm into the global one (replicas hold copies)
        self.norm_owner = True
        self._loss = self._loss_mean = None

    # ---- the step ------------------------------------------------------------------------------------

    def begin_micro(self, index: int, count: int) -> None:
        """Called before each micro-batch's forward; `index == count - 1` marks the last one."""

    def step(self, lr: float, loss_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Finish reducing gradients, clip by the global norm, update; returns (mean loss, grad norm)."""
        raise NotImplementedError

    def _reduce_stats(self, sum_sq: torch.Tensor) -> torch.Tensor:
        """FlatAdamW's `sum_sq_reduce`: one all-reduce carries this rank's share of the squared
        gradient norm and its loss, so clipping and logging cost a single 8-byte message."""
        own = sum_sq if self.norm_owner else torch.zeros_like(sum_sq)
        stats = torch.stack([own, self._loss.detach().float().reshape(())])
        self.comm.all_reduce(stats, self.names.dp)
        self._loss_mean = stats[1] / self.size
        return stats[0]

    def all_mean(self, value: float) -> float:
        """Mean of a host number over the dp ranks (validation loss)."""
        if self.comm is None or self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.opt.master.device)
        return (self.comm.all_reduce(t, self.names.dp).item()) / self.size

    # ---- state ---------------------------------------------------------------------------------------

    @property
    def shard(self) -> tuple[int, int] | None:
        """(index, count) of the shard files this rank writes; None = the full form (rank 0)."""
        return None

    @property
    def writes_state(self) -> bool:
        return self.rank == 0

    def save(self, folder: Path) -> None:
        if self.writes_state:
            sharded_state.write(folder, self.pieces, self.opt, self.shard)

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
            self.opt.flat.data[self.opt.lo:self.opt.hi].copy_(self.opt.master)

    def memory(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds for parameters, gradients and optimizer state."""
        o = self.opt
        return {"params": [o.flat.data], "grads": [o.flat.grad],
                "optimizer": ([o.master] if o.separate else []) + [o.exp_avg, o.exp_avg_sq]}

    def gather_for_inference(self) -> None:
        """Make the whole model usable by this rank alone (ZeRO-3 gathers; the rest already are)."""


class Local(Engine):
    """One device: FlatAdamW over the whole flat space, no communication."""

    def step(self, lr, loss_sum):
        grad_norm = self.opt.step(lr)
        self.opt.zero_grad()
        return loss_sum, grad_norm


class DDP(Engine):
    """Gradients all-reduced (averaged) over `dp` in size-bounded buckets of the flat gradient buffer.

    A bucket is a contiguous slice of the buffer, so its all-reduce runs in place with no copy. Each
    parameter's post-accumulate-grad hook counts it into its bucket; a full bucket is launched
    asynchronously at once, so its communication overlaps the rest of backward. On micro-batches
    before the last, gradients only accumulate locally: the hooks do nothing.
    """

    def __init__(self, model, opt: FlatAdamW, comm, names: DPNames, cap: int):
        super().__init__(model, opt, comm, names)
        flat = opt.flat
        self.flat = flat
        self.norm_owner = self.rank == 0  # every rank holds the same full gradient
        groups = group_by_size([s.numel for s in flat.slots], cap)
        self.ranges = [(flat.slots[g[0]].offset, flat.slots[g[-1]].offset + flat.slots[g[-1]].numel) for g in groups]
        owners = {id(flat.params[i]): [b] for b, g in enumerate(groups) for i in g}
        self.ready = Ready([len(g) for g in groups], owners, self._launch)
        self.inflight = InFlight()
        self.sync = True
        self.hooks = [p.register_post_accumulate_grad_hook(self._arrived) for p in flat.params]

    def begin_micro(self, index, count):
        self.sync = index == count - 1

    def _arrived(self, p) -> None:
        if self.sync:
            self.ready.arrived(id(p))

    def _launch(self, b: int) -> None:
        a, e = self.ranges[b]
        self.inflight.add(self.comm.all_reduce(self.flat.grad[a:e], self.names.dp, op="avg", async_op=True))

    def step(self, lr, loss_sum):
        self.ready.flush()  # buckets whose parameters got no gradient still take part
        self.inflight.wait_all()
        self.ready.reset()
        self._loss = loss_sum
        grad_norm = self.opt.step(lr, sum_sq_reduce=self._reduce_stats)
        self.flat.zero_grad()
        self.sync = True
        return self._loss_mean, grad_norm


def check_layout(cfg) -> None:
    """What `plait train` refuses before any process starts (beyond the mesh checks of validate)."""
    p = cfg.parallel
    for name in ("tp", "pp", "cp"):
        if getattr(p, name) != 1:
            raise bad_value(f"parallel.{name}", getattr(p, name), "is not wired into `plait train` yet; "
                            "train with data parallelism only (--nproc N --dp N --zero 0|1|2|3)")
    if p.reduce_dtype not in ("auto", "fp32", "bf16"):
        raise bad_value("parallel.reduce_dtype", p.reduce_dtype, "choose auto, fp32 or bf16")
    if p.reduce_dtype != "auto" and p.zero < 2:
        raise bad_value("parallel.reduce_dtype", p.reduce_dtype, "needs --zero 2 or 3 (DDP and ZeRO-1 reduce "
                        "the gradient buffer in place, in the parameters' dtype); use --zero 2 or drop it")


def apply_data_parallel(model, cfg, comm=None, names: DPNames = DPNames(), compile: bool = False) -> Engine:
    """Wrap `model` (parameters already in the compute dtype) in the engine its layout needs.

    comm=None is one device. Otherwise `cfg.parallel.zero` picks DDP or a ZeRO stage over
    `names.shard`, replicated over `names.replicate` (HSDP) when that group has more than one rank.
    """
    t, p = cfg.train, cfg.parallel
    named = list(model.named_parameters())
    if comm is None:
        return Local(model, FlatAdamW(FlatParams(named), t, compile=compile))
    dtype = named[0][1].dtype
    if p.zero == 0:
        flat = FlatParams(named)
        return DDP(model, FlatAdamW(flat, t, compile=compile), comm, names, bucket_cap(p.bucket_mb, flat.grad.element_size()))
    from plait.parallel import zero

    if p.zero == 1:
        return zero.Zero1(model, named, t, comm, names, compile)
    reduce_dtype = reduce_dtype_of(p.reduce_dtype, dtype)
    if p.zero == 2:
        cap = bucket_cap(p.bucket_mb, torch.empty((), dtype=reduce_dtype).element_size())
        return zero.Zero2(model, named, t, comm, names, cap, reduce_dtype, compile)
    from plait.parallel.fsdp import Zero3

    return Zero3(model, t, comm, names, reduce_dtype, compile)
