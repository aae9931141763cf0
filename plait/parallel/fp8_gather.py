"""ZeRO-3's FP8 all-gather (`parallel.zero3_fp8_gather`): the blocks' weights travel in FP8.

With tensorwise FP8 matmuls (`train.fp8 tensorwise`) each block linear turns its gathered 16-bit
weight into e4m3 with one scale at every forward; eager, it keeps that FP8 copy until its backward
(a byte a parameter of every layer, unsharded; compiled blocks quantize it again in the backward
instead). Here each rank quantizes its own chunk before the all-gather, with the scale of the
*whole* weight, so that:
- one byte a parameter crosses the wire instead of two, and a gathered unit holds one;
- neither the forward nor the backward quantizes a weight: the FP8Linear reads the gathered bits
  (`w8`, `w8_inv`), in the backward from the unit's backward gather (same shards, same scales: the
  same bits), so nothing is kept from forward to backward but the activations.

The scale of a weight needs its |max| over every rank's chunk: found once after each update, for
all FP8 units at once - every weight's slice of this rank's chunks in one multi-tensor pass, then one
all-reduce (max) of the maxima over the shard group (7 numbers a block; and over the tensor-parallel
group when it splits the weights, so a shard is scaled as the whole matrix: `plait.fp8`). The bits are those the FP8
linear would have made from the gathered weight: a maximum is exact, and the scale and the rounding
are `plait.fp8.scale_for` and `scaled` applied to the same 16-bit values - training is bit for bit
that of the 16-bit gather (tests/test_fp8_gather.py).
"""

from __future__ import annotations

import torch

from plait.fp8 import E4M3, FP8Linear, scale_for, scaled


def fp8_units(model, layout) -> tuple[int, ...]:
    """Units whose every parameter is the weight of a tensorwise FP8 linear: the blocks'."""
    lin = {id(m.weight) for m in model.modules() if isinstance(m, FP8Linear) and m.recipe == "tensorwise"}
    return tuple(u.index for u in layout.units if u.params and all(id(p) in lin for p in u.params))


def _alias(view: torch.Tensor) -> torch.Tensor:
    """A tensor on `view`'s memory with a version counter of its own (as a parameter bound by
    `.data` has): the all-gathers and scale updates that refill the buffer in place would otherwise
    count as changes to what autograd saved from the forward, which the backward reads again after
    the same bits are gathered back."""
    t = torch.empty(0, dtype=view.dtype, device=view.device)
    t.data = view
    return t


# cuBLAS's FP8 GEMMs read a scale only from a 16-byte aligned address (CUBLAS_STATUS_NOT_SUPPORTED
# otherwise, on the GPU alone): the scales of a unit's weights lie 16 bytes apart, not 4.
_SCALE_STRIDE = 16 // 4


def _spaced(n: int, device) -> torch.Tensor:
    """n fp32 ones, each at a 16-byte aligned address (a strided view; storages start 256-aligned)."""
    return torch.ones(n, _SCALE_STRIDE, dtype=torch.float32, device=device)[:, 0]


class FP8Gather:
    """The FP8 side of `plait.parallel.gather.Gathers`: per FP8 unit a byte buffer the all-gather
    fills, and per weight its scale and inverse scale (updated in place: the linears hold views)."""

    def __init__(self, gathers, units: tuple[int, ...], compile: bool = False):
        self.g, self.units = gathers, tuple(units)
        # per weight, eager, the quantization is half a dozen passes over the chunk (6 kernels a weight,
        # 7 weights a block, twice a micro-batch): compiled, one kernel reads the fp32 chunk once
        self._quantize = compiled(slot_quantize) if compile else slot_quantize
        self.on = True  # off for inference, whose plain matmuls read the 16-bit weights
        self.tp_group: str | None = None  # the weights are tensor-parallel shards: maxima over it too
        self.stale = True  # the shards changed since the scales were found
        dev = gathers.shards.device
        self.full: dict[int, torch.Tensor] = {}
        self.scale: dict[int, torch.Tensor] = {}
        self.inv: dict[int, torch.Tensor] = {}
        for i in self.units:
            u = gathers.layout.units[i]
            self.full[i] = torch.zeros(u.padded, dtype=torch.uint8, device=dev)
            self.full[i].untyped_storage().resize_(0)
            self.scale[i] = _spaced(len(u.params), dev)
            self.inv[i] = _spaced(len(u.params), dev)
        self.ranges = {i: self._slot_ranges(i) for i in self.units}  # fixed by the layout: found once
        # find_scales' inputs, fixed too: every weight's slice of this rank's chunks (views of the
        # shards, which are updated in place) and where its |max| goes among all FP8 weights
        self.slices, index, at = [], [], 0
        for i in self.units:
            src = gathers.shards[gathers.layout.owned_slice(gathers.layout.units[i])]
            for j, a, b in self.ranges[i]:
                self.slices.append(src[a:b])
                index.append(at + j)
            at += len(self.scale[i])
        self.n_weights, self.index = at, torch.tensor(index, dtype=torch.long, device=dev)

    def applies(self, i: int) -> bool:
        return self.on and i in self.full

    def bind(self, model) -> None:
        """Point each FP8 unit's linears at their gathered bits and inverse scale. Views are made
        while the buffer holds storage (a view past a storage's end is refused), then it is released."""
        lin = {id(m.weight): m for m in model.modules() if isinstance(m, FP8Linear)}
        for i in self.units:
            u, buf = self.g.layout.units[i], self.full[i]
            buf.untyped_storage().resize_(u.padded)
            bits = buf.view(E4M3)
            for j, (s, p) in enumerate(zip(u.slots, u.params)):
                m = lin[id(p)]
                m.register_buffer("w8", _alias(u.view(bits, s)), persistent=False)
                m.register_buffer("w8_inv", _alias(self.inv[i][j]), persistent=False)
                m.prequantized = True
            buf.untyped_storage().resize_(0)

    def unbind(self, model) -> None:
        for m in model.modules():
            if isinstance(m, FP8Linear):
                m.prequantized = False

    def _slot_ranges(self, i: int) -> tuple:
        """((weight index, a, b), ...): [a, b) of the unit's chunk on this rank that each weight it
        holds part of covers; back to back from 0 (the weights lie so), the unit's padding after."""
        u = self.g.layout.units[i]
        lo, hi = u.chunk_range(self.g.layout.rank)
        out = []
        for j, s in enumerate(u.slots):
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                out.append((j, a - lo, b - lo))
        return tuple(out)

    @torch.no_grad()  # gathers run in the forward and in backward hooks: one grad mode, one compiled graph
    def find_scales(self) -> None:
        """Every FP8 weight's |max| over the shard group (one all-reduce), its scale and inverse."""
        g = self.g
        amax = weights_amax(self.slices, self.index, self.n_weights, g.dtype)
        g.comm.all_reduce(amax, g.group, op="max")
        if self.tp_group is not None:  # (replicated weights, the same on every tp rank, keep their maxima)
            g.comm.all_reduce(amax, self.tp_group, op="max")
        scale = scale_for(amax, E4M3)
        inv = scale.reciprocal()
        at = 0
        for i in self.units:
            n = len(self.scale[i])
            self.scale[i].copy_(scale[at:at + n])
            self.inv[i].copy_(inv[at:at + n])
            at += n
        self.stale = False

    @torch.no_grad()
    def quantized_chunk(self, i: int, src: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of unit i in e4m3, as bytes (padding: zero bits), from its fp32 `src`."""
        if self.stale:
            self.find_scales()
        return self._quantize(src, self.scale[i], self.ranges[i], self.g.dtype).view(torch.uint8)


def compiled(fn):
    """fn under torch.compile, keeping its casts to 16 bits: inductor otherwise computes through them
    in fp32, and the bits would no longer be those of the 16-bit weight."""
    return torch.compile(fn, dynamic=False, options={"emulate_precision_casts": True})


def weights_amax(slices: list, index: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """(n,) fp32: each weight's |max| over its slices (`slices[k]` is part of weight `index[k]`), as
    the `dtype` value it is gathered as; 0 for a weight this rank holds none of. Rounding is monotonic
    and odd, so the |max| of the rounded values is the rounded |max|: one pass over the fp32 values.
    All slices go through one multi-tensor launch rather than a compiled call a unit (32 on 8b, about
    0.25 ms of host time each). On 4 x H200 at one sequence a GPU those calls overlapped the root
    unit's all-gather, so the step did not get shorter (`dp-8b-h200-4gpu-fp8-gather-amax-ab.json`);
    the host is freed for the forward that follows, and one graph fewer is compiled."""
    out = torch.zeros(n, dtype=torch.float32, device=index.device)
    if slices:
        # several slices of one weight (in other units' chunks) keep the largest
        out.scatter_reduce_(0, index, torch.stack(torch._foreach_norm(slices, float("inf"))).float(), "amax")
    return out.to(dtype).float()


def slot_quantize(src: torch.Tensor, scale: torch.Tensor, ranges: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The chunk in e4m3, each weight's part of it as `dtype` values times the weight's scale (what
    the FP8 linear would do to the gathered weight), the padding after them zero."""
    parts = [scaled(src[a:b].to(dtype), scale[j], E4M3) for j, a, b in ranges]
    end = ranges[-1][2] if ranges else 0
    if end < src.numel():
        parts.append(torch.zeros(src.numel() - end, dtype=E4M3, device=src.device))
    return torch.cat(parts)
