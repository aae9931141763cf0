"""All of a model's parameters as views of one flat buffer, and their gradients as views of another.

Why flat: the optimizer step becomes one fused pass over contiguous memory instead of hundreds of
small kernels; data-parallel gradient buckets are contiguous slices that a collective can reduce in
place; and ZeRO's "each rank owns 1/N of the parameter space" is literally a slice [lo, hi).

Order: matrices first, then the (tiny) norm gains, so weight decay applies to one prefix. Within each
group parameters are laid out in *reverse* registration order, which is roughly the order in which
backward produces their gradients, so the buckets at the front of the buffer fill first.

Gradients in pieces (`lazy_grads`: one device, or a tp / pp part without data-parallel peers): the
gradient space is cut at the model's units (a block, the embedding, the output matrix; the norm
gains together) and a unit's piece is allocated when backward lands its first gradient, then
dropped after the update. A whole buffer held through the step sits beside the forward's
activations at their peak (2 bytes a parameter: 5.6 GB on 8b's shape with 8 layers); in pieces,
none is there by then, and each block's piece takes the place of the activations its backward
frees. The update runs over the
pieces as segments of the flat space. Data-parallel engines keep the whole buffer: their buckets
and shards are slices of it.

A slot without a 16-bit copy (`master_only`, in pieces only): an untied embedding is read a few
rows a step, so it needs no (vocabulary x dim) 16-bit copy beside its fp32 master (1.05 GB on 8b,
held through the forward's peak). Its parameter becomes a view of the optimizer's master
(`attach_master`), `data` has a hole where it lay (the other slots keep their offsets in the flat
space; `data_view` maps them), and its gradient is handed in by the lookup
(`plait.parallel.embedding_master`) through `land_outside`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.optim import decays


@dataclass(frozen=True)
class Slot:
    """Where one parameter lies in a flat buffer (a whole model's, or one ZeRO unit's)."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]


def flat_order(named_params: list[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.nn.Parameter]]:
    """The flat layout's order: decayed matrices, then the rest, each in reverse registration order."""
    decayed = [(n, p) for n, p in reversed(named_params) if decays(n, p)]
    return decayed + [(n, p) for n, p in reversed(named_params) if not decays(n, p)]


def unit_of(name: str) -> str:
    """The unit a parameter belongs to: its block ("layers.3"), else its top-level module."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else parts[0]


def grad_pieces(slots: list[Slot], n_decay: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of the flat space: each run of decayed slots of one unit, then every
    undecayed slot (norm gains: small) as one piece."""
    out: list[tuple[int, int]] = []
    key = None
    for s in slots:
        k = unit_of(s.name) if s.offset < n_decay else None
        if out and k == key:
            out[-1] = (out[-1][0], s.offset + s.numel)
        else:
            out.append((s.offset, s.offset + s.numel))
        key = k
    return out


class FlatParams:
    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], pad_to: int = 1, lazy_grads: bool = False,
                 master_only: str | None = None):
        """`pad_to`: the total length is rounded up to a multiple of this (e.g. the number of ZeRO
        shards), the padding holding zeros that never train. `lazy_grads`: gradients in pieces
        allocated as backward reaches them (module docstring); `grad` is then None. `master_only`:
        the name of a parameter that gets no 16-bit copy (module docstring)."""
        ordered = flat_order(named_params)
        decayed = [(n, p) for n, p in ordered if decays(n, p)]
        if not ordered:
            raise ValueError("FlatParams needs at least one parameter")
        dtypes = {p.dtype for _, p in ordered}
        if len(dtypes) != 1:
            raise ValueError(f"parameters must share one dtype to be flattened, got {dtypes}")
        self.dtype, self.device = ordered[0][1].dtype, ordered[0][1].device
        self.slots: list[Slot] = []
        offset = 0
        for n, p in ordered:
            self.slots.append(Slot(n, offset, p.numel(), tuple(p.shape)))
            offset += p.numel()
        self.numel = offset  # real elements, without padding
        self.n_decay = sum(p.numel() for _, p in decayed)
        self.padded = -(-offset // pad_to) * pad_to
        if lazy_grads and self.padded != self.numel:
            raise ValueError("gradients in pieces need an unpadded flat space")
        self.pieces = grad_pieces(self.slots, self.n_decay) if lazy_grads else None
        self.hole, self.hole_index, self._hole_init = None, None, None
        if master_only is not None:
            i = next((k for k, s in enumerate(self.slots) if s.name == master_only), None)
            if i is None or self.pieces is None or self.dtype == torch.float32:
                raise ValueError(f"master_only {master_only!r}: needs a 16-bit parameter of that name, in pieces")
            hole = (self.slots[i].offset, self.slots[i].offset + self.slots[i].numel)
            if hole not in self.pieces:  # its gradient is handed in whole, never beside another's
                raise ValueError(f"master_only {master_only!r}: must be a gradient piece of its own")
            self.hole, self.hole_index = hole, i
        gap = self.hole[1] - self.hole[0] if self.hole else 0
        self.data = torch.zeros(self.padded - gap, dtype=self.dtype, device=self.device)
        self.grad = None if lazy_grads else torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        if lazy_grads:
            piece_of, i = [], 0
            for slot in self.slots:
                while slot.offset >= self.pieces[i][1]:
                    i += 1
                piece_of.append(i)
            self._piece_of = piece_of
            self._bufs: list[torch.Tensor | None] = [None] * len(self.pieces)
        self.params = [p for _, p in ordered]
        with torch.no_grad():
            for i, (slot, p) in enumerate(zip(self.slots, self.params)):
                if i == self.hole_index:
                    self._hole_init = p.detach()  # the master's first value (`initial`), then let go
                else:
                    self.data_view(slot.offset, slot.offset + slot.numel).copy_(p.reshape(-1))
        self.bind()
        # registered before any engine's hooks, so theirs (DDP's buckets) find the gradient landed
        self._hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i: self._land(p, i))
                       for i, p in enumerate(self.params)]

    def bind(self) -> None:
        """Point every parameter and its .grad at the flat buffers. Autograd then accumulates
        into the flat gradient in place (it only replaces .grad when it is None). In pieces, .grad
        starts as None: the first backward lands it."""
        if self.pieces is None:
            self._grads = [self.view(self.grad, slot) for slot in self.slots]  # made once: the hooks reuse them
        else:
            self._grads = [None] * len(self.slots)
        for i, (slot, p, g) in enumerate(zip(self.slots, self.params, self._grads)):
            if i != self.hole_index:  # (the hole's parameter is the master's view: `attach_master`)
                p.data = self.data_view(slot.offset, slot.offset + slot.numel).view(slot.shape)
            p.grad = g

    def data_view(self, lo: int, hi: int) -> torch.Tensor | None:
        """The 16-bit parameters of flat range [lo, hi): a view of `data`, or None inside the hole."""
        if self.hole is None or hi <= self.hole[0]:
            return self.data[lo:hi]
        a, b = self.hole
        if lo >= b:
            return self.data[lo - (b - a):hi - (b - a)]
        if a <= lo and hi <= b:
            return None
        raise ValueError(f"flat range [{lo}, {hi}) straddles the slot without a 16-bit copy [{a}, {b})")

    def initial(self, lo: int, hi: int) -> list[tuple[int, torch.Tensor]]:
        """The parameters' values over [lo, hi) as (offset, tensor) pieces, the hole's included
        (an optimizer's fp32 master starts from them)."""
        if self.hole is None:
            return [(lo, self.data[lo:hi])]
        a, b = self.hole
        out = [(x, self.data_view(x, y)) for x, y in ((lo, min(hi, a)), (max(lo, b), hi)) if x < y]
        if self._hole_init is not None and lo < b and a < hi:
            assert lo <= a and b <= hi, "the slot without a 16-bit copy lies in one optimizer's range"
            out.append((a, self._hole_init.reshape(-1)))
        return sorted(out, key=lambda t: t[0])

    def attach_master(self, master: torch.Tensor, lo: int) -> None:
        """Make the hole's parameter a view of the fp32 `master` (which covers the flat space from
        `lo`): the lookup reads its rows, and a checkpoint's load reaches it there."""
        if self.hole is None:
            return
        slot = self.slots[self.hole_index]
        self.params[self.hole_index].data = master[slot.offset - lo:slot.offset - lo + slot.numel].view(slot.shape)
        self._hole_init = None

    def write_params(self, master: torch.Tensor, lo: int) -> None:
        """The 16-bit parameters over [lo, lo + len(master)) set from fp32 master values (after a load)."""
        for off, view in self.initial(lo, lo + master.numel()):
            if view.dtype == self.dtype and (self.hole is None or off != self.hole[0]):
                view.copy_(master[off - lo:off - lo + view.numel()])

    def land_outside(self, g: torch.Tensor) -> None:
        """The hole's gradient, handed in by its lookup's backward (autograd cannot give a 16-bit
        gradient to the fp32 parameter): the first of a step becomes its piece, later ones add."""
        i = self.hole_index
        fresh = self._grads[i] is None
        if fresh and self._adopt(g, i):
            return
        with torch.no_grad():
            view = self._grad_view(i)
            view.copy_(g) if fresh else view.add_(g)

    def _grad_view(self, i: int) -> torch.Tensor:
        """Parameter i's slot of the gradient; in pieces, its piece allocated on first use (every
        element of a piece is then written: by `_land`'s copy, or zeroed by `settle`)."""
        view = self._grads[i]
        if view is None:
            k = self._piece_of[i]
            lo, hi = self.pieces[k]
            if self._bufs[k] is None:
                self._bufs[k] = torch.empty(hi - lo, dtype=self.dtype, device=self.device)
            slot = self.slots[i]
            view = self._grads[i] = self._bufs[k][slot.offset - lo:slot.offset - lo + slot.numel].view(slot.shape)
        return view

    def _adopt(self, g: torch.Tensor, i: int) -> bool:
        """In pieces, a piece of parameter i alone (the output matrix, an untied embedding) that is
        not allocated yet becomes autograd's fresh gradient itself: no copy, and no second matrix
        beside it while it lands. Only a tensor that is exactly its storage is taken (autograd hands
        a gradient it made or stole for this parameter; a view of something larger would keep
        that alive)."""
        if self.pieces is None or self._grads[i] is not None:
            return False
        k, slot = self._piece_of[i], self.slots[i]
        lo, hi = self.pieces[k]
        if (hi - lo != slot.numel or g.dtype != self.dtype or g.device != self.device or not g.is_contiguous()
                or g.storage_offset() != 0 or g.untyped_storage().nbytes() != g.numel() * g.element_size()):
            return False
        self._bufs[k], self._grads[i] = g.view(-1), g
        return True

    def grad_segments(self, lo: int = 0, hi: int | None = None) -> list[tuple[int, torch.Tensor]]:
        """(offset from lo, gradient) pieces covering [lo, hi) of the flat space, settled."""
        hi = self.padded if hi is None else hi
        self.settle()
        if self.pieces is None:
            return [(0, self.grad[lo:hi])]
        assert (lo, hi) == (0, self.padded), "gradients in pieces are read whole (no data-parallel shards)"
        return [(a, buf) for (a, _), buf in zip(self.pieces, self._bufs)]

    def grad_buffers(self) -> list[torch.Tensor]:
        """The gradient memory allocated now."""
        return [self.grad] if self.pieces is None else [b for b in self._bufs if b is not None]

    @staticmethod
    def view(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
        return flat[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def _land(self, p: torch.nn.Parameter, i: int) -> None:
        """After autograd accumulated p's gradient: a gradient it made afresh (p.grad was None)
        is copied into p's slot, which becomes p.grad again, and later backwards add into it."""
        if p.grad is None:
            return
        if self._adopt(p.grad, i):
            return
        view = self._grad_view(i)
        if p.grad.data_ptr() != view.data_ptr():
            with torch.no_grad():
                view.copy_(p.grad)
            p.grad = view

    def zero_grad(self) -> None:
        """Start a step's gradients. Rather than zero the buffer for the first backward to add
        into, every .grad is dropped: autograd then hands each parameter its gradient as a fresh
        tensor, which `_land` copies into its slot (4 bytes a 16-bit parameter read and written,
        where zeroing and adding moved 8: 2% of the step on 8b's shape, 8 layers, one H200).
        `settle` zeroes the slots no backward reached before anything reads the buffer. In pieces,
        the pieces go too."""
        for p in self.params:
            p.grad = None
        if self.pieces is not None:
            self._grads = [None] * len(self.slots)
            self._bufs = [None] * len(self.pieces)

    def settle(self) -> None:
        """Before the buffer is read (the step): each slot holds its parameter's gradient, zeros
        where no backward reached it, and .grad is its view again - also when some code set a
        .grad of its own (torch.nn.Module.zero_grad's None, an assigned tensor)."""
        for i, p in enumerate(self.params):
            if i == self.hole_index:  # its gradient never is .grad: landed, or zeros
                if self._grads[i] is None:
                    self._grad_view(i).zero_()
                continue
            view = self._grad_view(i)
            if p.grad is None:
                view.zero_()
                p.grad = view
            elif p.grad.data_ptr() != view.data_ptr():
                with torch.no_grad():
                    view.copy_(p.grad)
                p.grad = view
