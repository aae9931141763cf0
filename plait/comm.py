"""Collectives over named mesh dims, each call counted in a `Ledger`.

    ledger = Ledger()
    comm = Comm(dims, ledger)                          # dims: ParallelDims with its mesh built
    comm.all_reduce(grad, "dp", op="avg")              # in place; returns grad
    h = comm.reduce_scatter(flat, "dp_shard", async_op=True); ...; shard = h.wait()
    y = comm.reduce_from(y_partial, "tp")              # autograd-aware forms for TP / SP / CP
    ledger.step(); ledger.summary()                    # {dim: {op: {calls, bytes, sent_bytes}}}

The ledger counts, per device, the bytes a ring algorithm sends for each call (S = message size,
N = group size): all-reduce 2S(N-1)/N; all-gather and reduce-scatter S(N-1)/N of the full (gathered,
resp. unreduced) size; all-to-all S(N-1)/N; broadcast, reduce and send S; recv 0. These are the
seed formulas the planner predicts with, so a run can be checked against its plan byte for byte.

Recording reads only tensor metadata (no device sync, no data access) and costs a few Python
operations; `Ledger(enabled=False)` or `ledger=None` skips it. A group of size 1 skips the
collective itself, so a single-device run goes through the same calls for free.

Errors: a collective that fails or times out raises `CollectiveError` naming the op, the mesh dim,
the group and the rank. gloo raises it from the call (or from `wait()` of an async handle) after
`parallel.timeout_s`. NCCL runs asynchronously, so its watchdog aborts the process instead, with a
log line naming the op type, the group (`mesh_<dim>`) and the rank.
"""

from __future__ import annotations

import re
import weakref

import torch
import torch.distributed as dist

from plait.ledger import Ledger, ring_bytes  # noqa: F401  (re-exported: Comm's callers build the Ledger)

# torch 2.13 renamed the tensor forms (and deprecates the old names); torch 2.11 has only the old ones
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class CollectiveError(RuntimeError):
    """A collective failed or did not complete in time; the message names op, dim, group and rank."""


class Pending:
    """Handle of an async collective: `wait()` completes it and returns its result tensor."""

    __slots__ = ("work", "result", "_after", "_comm", "_op", "_dim")

    def __init__(self, work, result, after, comm, op, dim):
        self.work, self.result, self._after, self._comm, self._op, self._dim = work, result, after, comm, op, dim

    def wait(self):
        if self.work is not None:
            try:
                for w in self.work if isinstance(self.work, list) else (self.work,):
                    w.wait()
            except RuntimeError as e:
                self._comm._raise(self._op, self._dim, e)
            self.work = None
            if self._after is not None:
                self._after()
        return self.result

    def is_completed(self) -> bool:
        return self.work is None or all(w.is_completed() for w in (self.work if isinstance(self.work, list)
                                                                   else (self.work,)))


class _Group:
    __slots__ = ("pg", "n", "rank", "ranks", "native_avg")

    def __init__(self, pg):
        self.pg = pg
        self.n = dist.get_world_size(pg)
        self.rank = dist.get_rank(pg)
        self.ranks = dist.get_process_group_ranks(pg)
        self.native_avg = "nccl" in str(dist.get_backend(pg)).lower()  # gloo has no AVG


class Comm:
    """Collective wrappers addressed by mesh dim name ("dp", "tp", ...); see the module docstring.

    dims: a ParallelDims with its mesh built (groups are looked up by name and cached), or None.
    groups: extra or overriding {name: ProcessGroup}; "world" is always the default group.
    Reduction ops: "sum", "avg", "max", "min". Peers and roots are ranks *within* the dim's group.
    """

    def __init__(self, dims=None, ledger: Ledger | None = None, groups: dict | None = None,
                 timeout_s: float | None = None):
        self.dims = dims
        self.ledger = ledger if ledger is not None and ledger.enabled else None
        self._given = dict(groups or {})
        self._groups: dict[str, _Group] = {}
        self._lean: dict[str, _Group] = {}  # per dim: the same ranks on a communicator of few SMs (`lean`)
        self.timeout_s = timeout_s if timeout_s is not None else getattr(dims, "timeout_s", None)
        _LIVE[id(self)] = self  # the registered ops find this Comm by its id (see `key`)

    def group(self, dim: str) -> _Group:
        g = self._groups.get(dim)
        if g is None:
            if dim in self._given:
                pg = self._given[dim]
            elif dim == "world":
                pg = dist.group.WORLD
            elif self.dims is None:  # never guess: a collective on the wrong group is a silent bug
                raise ValueError(f"Comm has no group {dim!r}: give it in groups= or build the Comm from dims")
            else:
                pg = self.dims.group(dim)
            g = self._groups[dim] = _Group(pg)
        return g

    def lean(self, dim: str, max_ctas: int) -> None:
        """Give dim `dim` a second communicator whose collectives take at most `max_ctas` SMs, for
        those issued with `lean=True` (communication that overlaps compute). Collective: every rank
        calls it, in the same order. On NCCL it needs `dims` (bare groups carry no partition to copy);
        other backends have no such budget and use the dim's own group."""
        g = self.group(dim)
        if g.n == 1 or not g.native_avg:  # only NCCL takes a thread-block budget: elsewhere the group itself
            self._lean[dim] = g
            return
        if self.dims is None:
            raise ValueError(f"Comm.lean({dim!r}) needs the mesh: build the Comm from dims")
        self._lean[dim] = _Group(self.dims.lean_group(dim, max_ctas))

    def size(self, dim: str) -> int:
        return self.group(dim).n

    def rank(self, dim: str) -> int:
        return self.group(dim).rank

    # ---- plain collectives ---------------------------------------------------------------------------

    def all_reduce(self, t, dim: str, op: str = "sum", async_op: bool = False, lean: bool = False):
        """`lean`: on the dim's few-SM communicator where `lean(dim, ...)` made one (same ranks, same
        result, counted under `dim`)."""
        g = self._lean.get(dim) if lean else None
        g = g if g is not None else self.group(dim)
        if self.ledger is not None:
            self.ledger.record("all_reduce", dim, t.numel() * t.element_size(), g.n)
        if g.n == 1:
            return self._done(t, async_op)
        rop, after = self._op(op, g, t)
        return self._issue(dist.all_reduce, (t,), dict(op=rop, group=g.pg), t, after, async_op, "all_reduce", dim)

    def all_gather(self, t, dim: str, out=None, async_op: bool = False):
        """Concatenate every rank's `t` along dim 0 into `out` (allocated when None)."""
        g = self.group(dim)
        if out is None:
            out = t.new_empty((g.n * t.shape[0],) + tuple(t.shape[1:])) if t.dim() else t.new_empty(g.n)
        if self.ledger is not None:
            self.ledger.record("all_gather", dim, out.numel() * out.element_size(), g.n)
        if g.n == 1:
            out.copy_(t.reshape(out.shape))
            return self._done(out, async_op)
        return self._issue(_all_gather_single, (out, t), dict(group=g.pg), out, None, async_op, "all_gather", dim)

    def reduce_scatter(self, t, dim: str, op: str = "sum", out=None, async_op: bool = False):
        """Reduce `t` over the group and keep this rank's 1/N slice along dim 0 (into `out`)."""
        g = self.group(dim)
        if out is None:
            out = t.new_empty((t.shape[0] // g.n,) + tuple(t.shape[1:]))
        if self.ledger is not None:
            self.ledger.record("reduce_scatter", dim, t.numel() * t.element_size(), g.n)
        if g.n == 1:
            out.copy_(t.reshape(out.shape))
            return self._done(out, async_op)
        rop, after = self._op(op, g, out)
        return self._issue(_reduce_scatter_single, (out, t), dict(op=rop, group=g.pg), out, after, async_op,
                           "reduce_scatter", dim)

    def broadcast(self, t, dim: str, src: int = 0, async_op: bool = False):
        g = self.group(dim)
        if self.ledger is not None:
            self.ledger.record("broadcast", dim, t.numel() * t.element_size(), g.n)
        if g.n == 1:
            return self._done(t, async_op)
        return self._issue(dist.broadcast, (t,), dict(src=g.ranks[src], group=g.pg), t, None, async_op,
                           "broadcast", dim)

    def reduce(self, t, dim: str, dst: int = 0, op: str = "sum", async_op: bool = False):
        """Reduce into `t` on group rank `dst`; on the other ranks `t` is scratch afterwards (gloo uses it)."""
        g = self.group(dim)
        if self.ledger is not None:
            self.ledger.record("reduce", dim, t.numel() * t.element_size(), g.n)
        if g.n == 1:
            return self._done(t, async_op)
        rop, after = self._op(op, g, t)
        if after is not None and g.rank != dst:
            after = None  # only the destination holds the sum to divide
        return self._issue(dist.reduce, (t,), dict(dst=g.ranks[dst], op=rop, group=g.pg), t, after, async_op,
                           "reduce", dim)

    def all_to_all(self, t, dim: str, out=None, async_op: bool = False):
        """Equal-split all-to-all along dim 0: slice j of `t` goes to rank j, slice i of `out` came from i."""
        g = self.group(dim)
        out = torch.empty_like(t) if out is None else out
        if self.ledger is not None:
            self.ledger.record("all_to_all", dim, t.numel() * t.element_size(), g.n)
        if g.n == 1:
            out.copy_(t)
            return self._done(out, async_op)
        return self._issue(dist.all_to_all_single, (out, t), dict(group=g.pg), out, None, async_op,
                           "all_to_all", dim)

    def send_recv(self, dim: str, sends=(), recvs=(), async_op: bool = False, record: bool = True):
        """Batched point-to-point: sends/recvs are (tensor, peer) with peer a rank in the dim's group;
        `record=False` keeps a set-up exchange out of the ledger."""
        g = self.group(dim)
        ops = []
        for t, peer in sends:
            if self.ledger is not None and record:
                self.ledger.record("send", dim, t.numel() * t.element_size(), g.n)
            ops.append(dist.P2POp(dist.isend, t, g.ranks[peer], g.pg))
        for t, peer in recvs:
            if self.ledger is not None and record:
                self.ledger.record("recv", dim, t.numel() * t.element_size(), g.n)
            ops.append(dist.P2POp(dist.irecv, t, g.ranks[peer], g.pg))
        if not ops:
            return self._done(None, async_op)
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            self._raise("send_recv", dim, e)
        p = Pending(works, None, None, self, "send_recv", dim)
        return p if async_op else p.wait()

    def barrier(self, dim: str = "world") -> None:
        g = self.group(dim)
        if g.n > 1:
            self._issue(dist.barrier, (), dict(group=g.pg), None, None, False, "barrier", dim)

    # ---- plumbing ------------------------------------------------------------------------------------

    def _op(self, op: str, g: _Group, result):
        if op == "avg" and not (g.native_avg and result.is_cuda):
            return dist.ReduceOp.SUM, lambda: result.div_(g.n)  # gloo has no AVG: sum, then divide
        try:
            return _OPS[op], None
        except KeyError:
            raise ValueError(f"unknown reduction {op!r}; choose sum, avg, max or min") from None

    def _issue(self, fn, args, kwargs, result, after, async_op, op, dim):
        try:
            work = fn(*args, async_op=True, **kwargs)
        except RuntimeError as e:
            self._raise(op, dim, e)
        p = Pending(work, result, after, self, op, dim)
        return p if async_op else p.wait()

    def _done(self, result, async_op):
        return Pending(None, result, None, self, "", "") if async_op else result

    def _raise(self, op: str, dim: str, e: Exception):
        g = self.group(dim)
        ranks = g.ranks if len(g.ranks) <= 8 else f"{g.ranks[:4]}...{g.ranks[-2:]}"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if re.search(r"timed? ?out", str(e), re.I):
            limit = f"parallel.timeout_s = {self.timeout_s:g} s" if self.timeout_s else "the timeout"
            what = f"did not complete within {limit}: a peer is missing, stuck or slower than the timeout"
        else:
            what = f"failed ({first})"
        raise CollectiveError(f"{op} on mesh dim {dim!r} (group of {g.n}: ranks {ranks}) {what}, on rank "
                              f"{dist.get_rank()}") from e

    # ---- autograd-aware forms (tensor / sequence / context parallel) ---------------------------------
    # Each is an autograd.Function over collectives registered as torch ops (`plait::all_reduce`,
    # ...), so torch.compile traces a block that uses them as one graph instead of breaking around
    # them; the op runs `Comm` at run time, so the ledger counts every call, compiled or not.

    def key(self, dim: str) -> str:
        """The name the registered ops know this Comm's `dim` by. Pure (no side effect), so a traced
        graph that bakes it in finds the Comm on its very first run."""
        return f"{id(self)}/{dim}"

    def copy_to(self, x, dim: str):
        """Identity forward, all-reduce backward: enter a TP region (column-parallel input)."""
        return _CopyTo.apply(x, self.key(dim))

    def reduce_from(self, x, dim: str):
        """All-reduce forward, identity backward: leave a TP region (row-parallel output)."""
        return _ReduceFrom.apply(x, self.key(dim))

    def all_gather_along(self, x, dim: str, axis: int = 0, grad: str = "reduce_scatter"):
        """All-gather along tensor axis `axis`. Backward: reduce-scatter (SP: the gathered activation
        feeds a TP region whose ranks each add a partial gradient) or "split" (keep own slice)."""
        return _GatherAlong.apply(x, self.key(dim), axis, grad)

    def reduce_scatter_along(self, x, dim: str, axis: int = 0):
        """Reduce-scatter along `axis` forward, all-gather backward (SP: leave a TP region)."""
        return _ReduceScatterAlong.apply(x, self.key(dim), axis)

    def split_along(self, x, dim: str, axis: int = 0):
        """Keep this rank's slice along `axis` forward (no traffic), all-gather backward."""
        return _SplitAlong.apply(x, self.key(dim), axis)

    def all_to_all_along(self, x, dim: str, scatter_axis: int, gather_axis: int):
        """Split along `scatter_axis`, exchange, concatenate along `gather_axis`; backward reverses it
        (Ulysses-style context parallel: sequence-sharded <-> head-sharded)."""
        return _AllToAllAlong.apply(x, self.key(dim), self.size(dim), scatter_axis, gather_axis)

    def all_to_all_chunks(self, x, dim: str):
        """x (n, *chunk): slot j goes to rank j, slot i of the result came from rank i; backward
        sends the gradient's slots home the same way. For callers that build the send layout
        themselves (several tensors in one buffer)."""
        return _AllToAllChunks.apply(x, self.key(dim))

    def _gather(self, x, dim, axis):
        n = self.size(dim)
        if n == 1:
            return x
        x, axis = x.contiguous(), axis % x.dim()
        buf = x.new_empty((n,) + tuple(x.shape))  # (n, *x.shape): slot j holds rank j's x
        self.all_gather(x.view(-1), dim, out=buf.view(-1))
        return buf.movedim(0, axis).flatten(axis, axis + 1)

    def _reduce_scatter(self, x, dim, axis):
        n = self.size(dim)
        if n == 1:
            return x
        axis = axis % x.dim()
        if x.shape[axis] % n:
            raise ValueError(f"reduce-scatter along axis {axis}: size {x.shape[axis]} is not divisible by the "
                             f"{n} ranks of {dim!r}")
        src = x.unflatten(axis, (n, -1)).movedim(axis, 0).contiguous()  # (n, ..., size/n, ...)
        out = src.new_empty(src.shape[1:])
        self.reduce_scatter(src.view(-1), dim, out=out.view(-1))
        return out

    def _split(self, x, dim, axis):
        n = self.size(dim)
        if n == 1:
            return x
        return x.chunk(n, axis)[self.rank(dim)].contiguous()


def _to_chunks(x, n: int, s_axis: int):
    """(n, *chunk), contiguous: chunk j of `x` along `s_axis` (the one rank j gets) in slot j."""
    return x.unflatten(s_axis, (n, -1)).movedim(s_axis, 0).contiguous()


def _from_chunks(y, g_axis: int):
    """Slot i of (n, *chunk) (what rank i sent) placed i-th along `g_axis`: a view."""
    return y.movedim(0, g_axis).flatten(g_axis, g_axis + 1)


# ---- collectives as registered ops ---------------------------------------------------------------
# Out of place (a compiled graph may not have its inputs mutated behind its back); the fake
# implementations give compile the output shapes without communicating.

_LIVE: "weakref.WeakValueDictionary[int, Comm]" = weakref.WeakValueDictionary()


def resolve_key(key: str) -> tuple[Comm, str]:
    """The Comm and mesh dim a registered op's `key` (`Comm.key`) names."""
    ident, _, dim = key.partition("/")
    return _LIVE[int(ident)], dim


def _fresh(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A registered op may not return its input (a group of one does nothing): copy it then. And it
    returns contiguous tensors, as its fake implementation promises the compiler (a gather or an
    all-to-all along an inner axis leaves a strided view)."""
    return x.clone(memory_format=torch.contiguous_format) if out is x else out.contiguous()


@torch.library.custom_op("plait::all_reduce", mutates_args=())
def _op_all_reduce(x: torch.Tensor, key: str) -> torch.Tensor:
    comm, dim = resolve_key(key)
    out = x.clone(memory_format=torch.contiguous_format)
    return comm.all_reduce(out, dim)


@_op_all_reduce.register_fake
def _(x, key):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("plait::all_reduce_max", mutates_args=())
def _op_all_reduce_max(x: torch.Tensor, key: str) -> torch.Tensor:
    """The element-wise max over the dim's ranks (FP8's scales: a split tensor's largest magnitude)."""
    comm, dim = resolve_key(key)
    out = x.clone(memory_format=torch.contiguous_format)
    return comm.all_reduce(out, dim, op="max")


@_op_all_reduce_max.register_fake
def _(x, key):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("plait::all_gather", mutates_args=())
def _op_all_gather(x: torch.Tensor, key: str, axis: int) -> torch.Tensor:
    comm, dim = resolve_key(key)
    return _fresh(comm._gather(x, dim, axis), x)


@_op_all_gather.register_fake
def _(x, key, axis):
    n, axis = resolve_key(key)[0].size(resolve_key(key)[1]), axis % x.dim()
    return x.new_empty(x.shape[:axis] + (n * x.shape[axis],) + x.shape[axis + 1:])


@torch.library.custom_op("plait::reduce_scatter", mutates_args=())
def _op_reduce_scatter(x: torch.Tensor, key: str, axis: int) -> torch.Tensor:
    comm, dim = resolve_key(key)
    return _fresh(comm._reduce_scatter(x, dim, axis), x)


@_op_reduce_scatter.register_fake
def _(x, key, axis):
    n, axis = resolve_key(key)[0].size(resolve_key(key)[1]), axis % x.dim()
    return x.new_empty(x.shape[:axis] + (x.shape[axis] // n,) + x.shape[axis + 1:])


@torch.library.custom_op("plait::all_to_all", mutates_args=())
def _op_all_to_all(x: torch.Tensor, key: str) -> torch.Tensor:
    """x (n, *chunk): slot j goes to rank j; slot i of the result came from rank i. The layout
    changes either side (`_to_chunks`, `_from_chunks`) stay outside the op, in the caller's graph,
    where the compiler fuses them into the neighbouring kernels instead of copying twice here."""
    comm, dim = resolve_key(key)
    return comm.all_to_all(x.contiguous(), dim)  # a fresh tensor, even over a group of one


@_op_all_to_all.register_fake
def _(x, key):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _split(x, key, axis):
    comm, dim = resolve_key(key)
    return comm._split(x, dim, axis)


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key):
        ctx.key = key
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return torch.ops.plait.all_reduce(g, ctx.key), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key):
        return torch.ops.plait.all_reduce(x, key)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key, axis, grad):
        ctx.key, ctx.axis, ctx.grad = key, axis, grad
        return torch.ops.plait.all_gather(x, key, axis)

    @staticmethod
    def backward(ctx, g):
        if ctx.grad == "split":
            return _split(g, ctx.key, ctx.axis), None, None, None
        return torch.ops.plait.reduce_scatter(g, ctx.key, ctx.axis), None, None, None


class _ReduceScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key, axis):
        ctx.key, ctx.axis = key, axis
        return torch.ops.plait.reduce_scatter(x, key, axis)

    @staticmethod
    def backward(ctx, g):
        return torch.ops.plait.all_gather(g, ctx.key, ctx.axis), None, None


class _SplitAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key, axis):
        ctx.key, ctx.axis = key, axis
        return _split(x, key, axis)

    @staticmethod
    def backward(ctx, g):
        return torch.ops.plait.all_gather(g, ctx.key, ctx.axis), None, None


class _AllToAllChunks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key):
        ctx.key = key
        return torch.ops.plait.all_to_all(x, key)

    @staticmethod
    def backward(ctx, g):
        return torch.ops.plait.all_to_all(g, ctx.key), None


class _AllToAllAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key, n, s_axis, g_axis):
        ctx.key, ctx.n, ctx.s_axis, ctx.g_axis = key, n, s_axis % x.dim(), g_axis % x.dim()
        return _from_chunks(torch.ops.plait.all_to_all(_to_chunks(x, n, ctx.s_axis), key), ctx.g_axis)

    @staticmethod
    def backward(ctx, g):
        y = torch.ops.plait.all_to_all(_to_chunks(g, ctx.n, ctx.g_axis), ctx.key)
        return _from_chunks(y, ctx.s_axis), None, None, None, None
