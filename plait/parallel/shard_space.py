"""Units of parameters split into N equal chunks: the layout ZeRO-2 and ZeRO-3 shard.

A unit is a list of whole parameters laid out contiguously (a gradient bucket under ZeRO-2, a
transformer block under ZeRO-3), padded with zeros to a multiple of N, so that one reduce-scatter
hands rank r the r-th chunk of the unit's gradient and one all-gather rebuilds the unit from the
chunks. Rank r's *owned space* is its chunks of every unit, concatenated: the fp32 masters, both Adam
moments and the reduced gradients live there, contiguous, so the optimizer update stays one fused
pass (`plait.optim.FlatAdamW`, given an `OwnedSpace`).

Why per-unit chunks rather than one contiguous 1/N of the whole flat space (ZeRO-1): a reduce-scatter
splits its input into N equal pieces, so gradients can be reduced while backward runs only if each
ready unit is split N ways on its own. Padding is at most N-1 elements per unit.

Units list decayed parameters (matrices) before the others, and units holding no-decay parameters
come last, so weight decay applies to a prefix of the owned space, as FlatAdamW expects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.flat import Slot
from plait.optim import decays
from plait.ranges import Box, overlap


@dataclass(frozen=True)
class Piece:
    """The part of one parameter this rank holds: elements [start, start + numel) of the flattened
    local tensor, stored at `offset` of the rank's buffers. `box` places the local tensor in the full
    one (the whole tensor, or a tensor-parallel shard of it), so any layout can read the piece."""

    name: str
    start: int
    numel: int
    offset: int
    box: Box

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the local tensor the piece is a flat range of."""
        return self.box.shape


class Unit:
    """Whole parameters laid out back to back, padded to `padded` = chunk * N elements."""

    def __init__(self, index: int, named_params: list[tuple[str, torch.nn.Parameter]], n: int):
        self.index = index
        self.params = [p for _, p in named_params]
        self.slots: list[Slot] = []
        offset = 0
        for name, p in named_params:
            self.slots.append(Slot(name, offset, p.numel(), tuple(p.shape)))
            offset += p.numel()
        self.numel = offset
        self.chunk = -(-offset // n)
        self.padded = self.chunk * n
        self.owned = 0  # offset of this rank's chunk in the owned space (set by ShardLayout)
        self.base = 0  # offset of the unit in the padded space of all units back to back (ditto)

    def chunk_range(self, rank: int) -> tuple[int, int]:
        return rank * self.chunk, (rank + 1) * self.chunk

    def view(self, full: torch.Tensor, slot: Slot) -> torch.Tensor:
        return full[slot.offset:slot.offset + slot.numel].view(slot.shape)


class ShardLayout:
    """`units` (lists of (name, parameter)) over `n` ranks, seen from `rank`."""

    def __init__(self, units: list[list[tuple[str, torch.nn.Parameter]]], n: int, rank: int):
        self.n, self.rank = n, rank
        self.units = [Unit(i, u, n) for i, u in enumerate(units) if u]
        self.pieces: list[Piece] = []
        owned = base = 0
        decay_end, first_plain = 0, None  # owned offsets: end of the last decayed element, first plain one
        for u in self.units:
            u.owned, u.base = owned, base
            base += u.padded
            lo, hi = u.chunk_range(rank)
            for s, p in zip(u.slots, u.params):
                ov = overlap(s.offset, s.offset + s.numel, lo, hi)
                if ov is None:
                    continue
                a, b = ov
                piece = Piece(s.name, a - s.offset, b - a, owned + a - lo, Box.whole(s.shape))
                self.pieces.append(piece)
                if decays(s.name, p):
                    decay_end = piece.offset + piece.numel
                elif first_plain is None:
                    first_plain = piece.offset
            owned += u.chunk
        self.owned_numel = owned
        if first_plain is not None and first_plain < decay_end:
            raise ValueError("units must list decayed parameters before the others (weight decay is a prefix)")
        self.n_decay = decay_end
        self.padded_numel = sum(u.padded for u in self.units)
        self.numel = sum(u.numel for u in self.units)

    def owned_slice(self, u: Unit) -> slice:
        return slice(u.owned, u.owned + u.chunk)


@dataclass
class OwnedSpace:
    """The part of `plait.flat.FlatParams`' interface that FlatAdamW uses, over a rank's owned space:
    `data` is what the update reads as parameters (fp32: the masters themselves; bf16: the compute
    copy it writes after each step), `grad` the reduced gradient shard (None where the engine hands
    the optimizer its gradient pieces at each step, as ZeRO-3 does)."""

    data: torch.Tensor
    grad: torch.Tensor | None
    n_decay: int

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def padded(self) -> int:
        return self.data.numel()

    @property
    def device(self) -> torch.device:
        return self.data.device

    def data_view(self, lo: int, hi: int) -> torch.Tensor:
        return self.data[lo:hi]

    def initial(self, lo: int, hi: int) -> list[tuple[int, torch.Tensor]]:
        return [(lo, self.data[lo:hi])]

    def attach_master(self, master: torch.Tensor, lo: int) -> None:
        """Every owned element has its 16-bit copy (no slot reads its master directly)."""

    def write_params(self, master: torch.Tensor, lo: int) -> None:
        self.data[lo:lo + master.numel()].copy_(master)

    def settle(self) -> None:
        """Nothing to settle: the gradient is the reduced shard, which the engine writes whole."""

    def zero_grad(self) -> None:
        pass  # the engine overwrites the shard on the first micro-batch of every step
