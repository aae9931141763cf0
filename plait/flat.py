"""All of a model's parameters as views of one flat buffer, and their gradients as views of another.

Why flat: the optimizer step becomes one fused pass over contiguous memory instead of hundreds of
small kernels; data-parallel gradient buckets are contiguous slices that a collective can reduce in
place; and ZeRO's "each rank owns 1/N of the parameter space" is literally a slice [lo, hi).

Order: matrices first, then the (tiny) norm gains, so weight decay applies to one prefix. Within each
group parameters are laid out in *reverse* registration order, which is roughly the order in which
backward produces their gradients, so the buckets at the front of the buffer fill first.
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


class FlatParams:
    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], pad_to: int = 1):
        """`pad_to`: the total length is rounded up to a multiple of this (e.g. the number of ZeRO
        shards), the padding holding zeros that never train."""
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
        self.data = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        self.grad = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        self.params = [p for _, p in ordered]
        with torch.no_grad():
            for slot, p in zip(self.slots, self.params):
                self.data[slot.offset:slot.offset + slot.numel].copy_(p.reshape(-1))
        self.bind()
        # registered before any engine's hooks, so theirs (DDP's buckets) find the gradient landed
        self._hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i: self._land(p, i))
                       for i, p in enumerate(self.params)]

    def bind(self) -> None:
        """Point every parameter and its .grad at the flat buffers. Autograd then accumulates
        into the flat gradient in place (it only replaces .grad when it is None)."""
        self._grads = [self.view(self.grad, slot) for slot in self.slots]  # made once: the hooks reuse them
        for slot, p, g in zip(self.slots, self.params, self._grads):
            p.data = self.view(self.data, slot)
            p.grad = g

    @staticmethod
    def view(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
        return flat[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def _land(self, p: torch.nn.Parameter, i: int) -> None:
        """After autograd accumulated p's gradient: a gradient it made afresh (p.grad was None)
        is copied into p's slot, which becomes p.grad again, and later backwards add into it."""
        view = self._grads[i]
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            with torch.no_grad():
                view.copy_(p.grad)
            p.grad = view

    def zero_grad(self) -> None:
        """Start a step's gradients. Rather than zero the buffer for the first backward to add
        into, every .grad is dropped: autograd then hands each parameter its gradient as a fresh
        tensor, which `_land` copies into its slot (4 bytes a 16-bit parameter read and written,
        where zeroing and adding moved 8: 2% of the step on 8b's shape, 8 layers, one H200).
        `settle` zeroes the slots no backward reached before anything reads the buffer."""
        for p in self.params:
            p.grad = None

    def settle(self) -> None:
        """Before the buffer is read (the step): each slot holds its parameter's gradient, zeros
        where no backward reached it, and .grad is its view again - also when some code set a
        .grad of its own (torch.nn.Module.zero_grad's None, an assigned tensor)."""
        for p, view in zip(self.params, self._grads):
            if p.grad is None:
                view.zero_()
                p.grad = view
            elif p.grad.data_ptr() != view.data_ptr():
                with torch.no_grad():
                    view.copy_(p.grad)
                p.grad = view
