"""Units of parameters gathered from their shards on demand and released after use (ZeRO-3's
parameter side, apart from when it is done).

Each unit of a `ShardLayout` has a full buffer whose storage exists only while the unit is
gathered: the parameters are views of it, valid while the storage comes and goes. A unit is in one
of three states; `gather` starts an asynchronous all-gather of every rank's chunk (cast to the
compute dtype on the way: the shards are fp32 masters), `wait` completes it, `free` releases the
storage. Who decides *when* - a forward prefetching the next block, a backward, a pipeline stage that
keeps its units for all its micro-batches - is the caller's policy, not this bookkeeping's.
"""

from __future__ import annotations

import enum

import torch


class State(enum.Enum):
    FREE = "free"
    GATHERING = "gathering"
    READY = "ready"


class Gathers:
    def __init__(self, layout, shards: torch.Tensor, dtype: torch.dtype, comm, group: str, cast_once: bool = False):
        """layout: the `ShardLayout`; shards: this rank's owned space (its chunk of every unit).
        cast_once: keep each unit's chunk in the compute dtype after its first gather, until
        `drop_casts` (the caller's: when the shards change), rather than casting it at every gather."""
        self.layout, self.shards, self.dtype, self.comm, self.group = layout, shards, dtype, comm, group
        self.cast_once = cast_once
        self.casts: list[torch.Tensor | None] = [None] * len(layout.units)
        self.n_casts = 0  # chunks cast so far (a test counts them)
        self.full: list[torch.Tensor] = []  # per unit, its gathered buffer; storage resized to 0 while free
        for u in layout.units:
            buf = torch.zeros(u.padded, dtype=dtype, device=shards.device)
            buf.untyped_storage().resize_(0)
            self.full.append(buf)
        self.state = [State.FREE] * len(layout.units)
        self.pending: list = [None] * len(layout.units)  # (all-gather handle, the chunk it sends)
        self.gathered_bytes = self.peak_gathered_bytes = 0
        self.trace: list | None = None  # (event, unit) when a test sets it to []

    def __len__(self) -> int:
        return len(self.full)

    def _log(self, event: str, i: int) -> None:
        if self.trace is not None:
            self.trace.append((event, i))

    def _alloc(self, i: int) -> None:
        u, full = self.layout.units[i], self.full[i]
        full.untyped_storage().resize_(u.padded * full.element_size())
        self.gathered_bytes += u.padded * full.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def gather(self, i: int) -> None:
        """Start gathering unit i (no-op if out of range, gathered or on its way)."""
        if i < 0 or i >= len(self.full) or self.state[i] != State.FREE:
            return
        self._alloc(i)
        chunk = self._chunk(i)  # compute dtype on the wire; kept until sent
        self.pending[i] = (self.comm.all_gather(chunk, self.group, out=self.full[i], async_op=True), chunk)
        self.state[i] = State.GATHERING
        self._log("gather", i)

    def _chunk(self, i: int) -> torch.Tensor:
        """This rank's chunk of unit i in the compute dtype: cast now, or the cast kept since the
        shards last changed."""
        if self.casts[i] is not None:
            return self.casts[i]
        src = self.shards[self.layout.owned_slice(self.layout.units[i])]
        chunk = src.to(self.dtype)
        if chunk.data_ptr() != src.data_ptr():
            self.n_casts += 1
            if self.cast_once:
                self.casts[i] = chunk
        return chunk

    def drop_casts(self) -> None:
        """The shards changed (an update, a load): the next gather of each unit casts it again."""
        self.casts = [None] * len(self.casts)

    def kept_casts(self) -> list[torch.Tensor]:
        """The cast chunks kept now (cast_once)."""
        return [c for c in self.casts if c is not None]

    def wait(self, i: int) -> None:
        """Make unit i usable: gather it if free, complete its gather if in flight."""
        self.gather(i)
        if self.state[i] == State.GATHERING:
            self.pending[i][0].wait()
            self.pending[i], self.state[i] = None, State.READY
            self._log("ready", i)

    def free(self, i: int) -> None:
        if self.state[i] == State.FREE:
            return
        if self.state[i] == State.GATHERING:
            self.pending[i][0].wait()
            self.pending[i] = None
        self.full[i].untyped_storage().resize_(0)
        self.gathered_bytes -= self.layout.units[i].padded * self.full[i].element_size()
        self.state[i] = State.FREE
        self._log("free", i)

    @torch.no_grad()
    def fill_from(self, i: int, params) -> None:
        """Give unit i storage, copy `params` (its parameters' current values) in and bind them as
        views of it; then this rank's chunk becomes its part of `shards` and the unit is free again."""
        u, full = self.layout.units[i], self.full[i]
        self._alloc(i)
        full.zero_()
        for s, p in zip(u.slots, params):
            view = u.view(full, s)
            view.copy_(p)
            p.data, p.grad = view, None  # views stay valid while the storage comes and goes
        lo, hi = u.chunk_range(self.layout.rank)
        self.shards[self.layout.owned_slice(u)].copy_(full[lo:hi])
        self.state[i] = State.READY
        self.free(i)

    def resident(self) -> list[torch.Tensor]:
        """The full buffers that hold storage now."""
        return [f for f in self.full if f.untyped_storage().nbytes()]
