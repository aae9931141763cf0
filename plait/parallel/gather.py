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

from plait.parallel.fp8_gather import FP8Gather


class State(enum.Enum):
    FREE = "free"
    GATHERING = "gathering"
    READY = "ready"


class Gathers:
    def __init__(self, layout, shards: torch.Tensor, dtype: torch.dtype, comm, group: str, cast_once: bool = False,
                 fp8_units: tuple[int, ...] = (), compile: bool = False):
        """layout: the `ShardLayout`; shards: this rank's owned space (its chunk of every unit).
        cast_once: keep each unit's chunk in the compute dtype after its first gather, until
        `drop_casts` (the caller's: when the shards change), rather than casting it at every gather.
        fp8_units: units gathered in FP8 (`plait.parallel.fp8_gather`) unless `set_fp8(False)`;
        compile: their quantization fused by torch.compile."""
        self.layout, self.shards, self.dtype, self.comm, self.group = layout, shards, dtype, comm, group
        self.cast_once = cast_once
        self.casts: list[torch.Tensor | None] = [None] * len(layout.units)
        self.n_casts = 0  # chunks cast so far (a test counts them)
        self.full: list[torch.Tensor] = []  # per unit, its gathered buffer; storage resized to 0 while free
        for u in layout.units:
            buf = torch.zeros(u.padded, dtype=dtype, device=shards.device)
            buf.untyped_storage().resize_(0)
            self.full.append(buf)
        self.fp8 = FP8Gather(self, fp8_units, compile) if fp8_units else None
        self.held: list[torch.Tensor | None] = [None] * len(layout.units)  # the buffer a gathered unit fills
        self.state = [State.FREE] * len(layout.units)
        self.pending: list = [None] * len(layout.units)  # (all-gather handle, the chunk it sends)
        self.gathered_bytes = self.peak_gathered_bytes = 0
        self.trace: list | None = None  # (event, unit) when a test sets it to []

    def __len__(self) -> int:
        return len(self.full)

    def _log(self, event: str, i: int) -> None:
        if self.trace is not None:
            self.trace.append((event, i))

    def _alloc(self, i: int, buf: torch.Tensor | None = None) -> None:
        u, buf = self.layout.units[i], self.full[i] if buf is None else buf
        buf.untyped_storage().resize_(u.padded * buf.element_size())
        self.held[i] = buf
        self.gathered_bytes += u.padded * buf.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def gather(self, i: int) -> None:
        """Start gathering unit i (no-op if out of range, gathered or on its way)."""
        if i < 0 or i >= len(self.full) or self.state[i] != State.FREE:
            return
        fp8 = self.fp8 is not None and self.fp8.applies(i)
        buf = self.fp8.full[i] if fp8 else self.full[i]
        self._alloc(i, buf)
        chunk = self._chunk(i, fp8)  # on the wire in the compute dtype, or FP8; kept until sent
        self.pending[i] = (self.comm.all_gather(chunk, self.group, out=buf, async_op=True), chunk)
        self.state[i] = State.GATHERING
        self._log("gather", i)

    def _chunk(self, i: int, fp8: bool = False) -> torch.Tensor:
        """This rank's chunk of unit i in the compute dtype (or in FP8, as bytes): cast now, or the
        cast kept since the shards last changed."""
        if self.casts[i] is not None:
            return self.casts[i]
        src = self.shards[self.layout.owned_slice(self.layout.units[i])]
        chunk = self.fp8.quantized_chunk(i, src) if fp8 else src.to(self.dtype)
        if chunk.data_ptr() != src.data_ptr():
            self.n_casts += 1
            if self.cast_once:
                self.casts[i] = chunk
        return chunk

    def drop_casts(self) -> None:
        """The shards changed (an update, a load): the next gather of each unit casts it again (and
        FP8 units find their scales again)."""
        self.casts = [None] * len(self.casts)
        if self.fp8 is not None:
            self.fp8.stale = True

    def set_fp8(self, on: bool) -> None:
        """Gather the FP8 units in FP8 (training) or in the compute dtype (inference: the plain
        matmuls read the weights themselves). Units gathered the other way are released."""
        if self.fp8 is None or self.fp8.on == on:
            return
        for i in self.fp8.units:
            self.free(i)
            self.casts[i] = None
        self.fp8.on = on

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
        buf, self.held[i] = self.held[i], None
        buf.untyped_storage().resize_(0)
        self.gathered_bytes -= self.layout.units[i].padded * buf.element_size()
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
        return [f for f in self.held if f is not None]
