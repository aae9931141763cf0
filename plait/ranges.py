"""Half-open ranges [lo, hi) of a flat space, and the boxes of a tensor that tensor parallelism cuts.

Everything in plait that shards a tensor describes the part a rank holds in these two terms: a
*box* (per-axis ranges of the full tensor: a tensor-parallel shard) and a *flat range* of that box
(elements [start, start + numel) of the box laid out row-major: a ZeRO shard of it). One definition
of the overlap arithmetic serves the flat parameter space, the ZeRO layouts and the checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def overlap(a0: int, a1: int, b0: int, b1: int) -> tuple[int, int] | None:
    """The intersection of [a0, a1) and [b0, b1), or None when it is empty."""
    lo, hi = max(a0, b0), min(a1, b1)
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True)
class Box:
    """Where a rank's tensor sits in the full one: `origin` per axis and the local `shape`.

    The box may run past `full` (a vocabulary padded to a multiple of tp): elements outside the
    full tensor are padding, never read into or out of a checkpoint."""

    full: tuple[int, ...]
    origin: tuple[int, ...]
    shape: tuple[int, ...]

    @staticmethod
    def whole(shape) -> "Box":
        shape = tuple(int(d) for d in shape)
        return Box(shape, (0,) * len(shape), shape)

    @property
    def is_whole(self) -> bool:
        return self.shape == self.full and not any(self.origin)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def real_numel(self, start: int = 0, numel: int | None = None) -> int:
        """Elements of the flat range [start, start + numel) of the box that lie inside the full tensor."""
        numel = self.numel - start if numel is None else numel
        return sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1, _ in _clipped(self, start, numel))


def _as_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    if len(shape) == 2:
        return shape
    raise ValueError(f"boxes of {len(shape)}-D tensors are not supported (plait's parameters are 1-D or 2-D)")


def _origin_2d(origin: tuple[int, ...]) -> tuple[int, int]:
    return tuple(origin) if len(origin) == 2 else (0, origin[0] if origin else 0)


def rects(box: Box, start: int, numel: int) -> list[tuple[int, int, int, int, int]]:
    """The flat range [start, start + numel) of `box` as at most three rectangles of the full tensor
    (seen as 2-D: a 1-D tensor is one row): (row0, row1, col0, col1, offset of the rectangle's first
    element in the range). A partial first row, whole rows, a partial last row."""
    _, w = _as_2d(box.shape)
    r0, c0 = _origin_2d(box.origin)
    out, pos, end = [], start, start + numel
    while pos < end:
        row, col = divmod(pos, w)
        if col or end - pos < w:  # a partial row
            n = min(w - col, end - pos)
            out.append((r0 + row, r0 + row + 1, c0 + col, c0 + col + n, pos - start))
        else:  # as many whole rows as the range holds
            n = (end - pos) // w * w
            out.append((r0 + row, r0 + row + n // w, c0, c0 + w, pos - start))
        pos += n
    return out


def _clipped(box: Box, start: int, numel: int):
    """`rects` cut to the full tensor's bounds (padding rows/columns dropped)."""
    R, C = _as_2d(box.full)
    w = _as_2d(box.shape)[1]
    for r0, r1, c0, c1, off in rects(box, start, numel):
        rr, cc = overlap(r0, r1, 0, R), overlap(c0, c1, 0, C)
        if rr and cc:
            yield rr[0], rr[1], cc[0], cc[1], off + (rr[0] - r0) * w + (cc[0] - c0)


def copy_overlap(dst_box: Box, dst_start: int, dst_numel: int, dsts: list,
                 src_box: Box, src_start: int, srcs: list) -> int:
    """Copy every element the two pieces share (in full-tensor coordinates) from each 1-D `srcs[k]`
    into `dsts[k]`; returns how many elements were copied. Each piece is a flat range of a box."""
    if dst_box == src_box:  # the common case (same layout or no tensor parallelism): one 1-D overlap
        ov = overlap(dst_start, dst_start + dst_numel, src_start, src_start + srcs[0].numel())
        if ov is None:
            return 0
        for d, s in zip(dsts, srcs):
            d[ov[0] - dst_start:ov[1] - dst_start].copy_(s[ov[0] - src_start:ov[1] - src_start])
        return dst_box.real_numel(ov[0], ov[1] - ov[0])
    copied = 0
    dw, sw = _as_2d(dst_box.shape)[1], _as_2d(src_box.shape)[1]  # row strides inside each piece's buffer
    src_rects = list(_clipped(src_box, src_start, srcs[0].numel()))
    for dr0, dr1, dc0, dc1, doff in _clipped(dst_box, dst_start, dst_numel):
        for sr0, sr1, sc0, sc1, soff in src_rects:
            rr, cc = overlap(dr0, dr1, sr0, sr1), overlap(dc0, dc1, sc0, sc1)
            if not (rr and cc):
                continue
            nr, nc = rr[1] - rr[0], cc[1] - cc[0]
            for d, s in zip(dsts, srcs):
                dv = _window(d, doff + (rr[0] - dr0) * dw + (cc[0] - dc0), nr, nc, dw)
                dv.copy_(_window(s, soff + (rr[0] - sr0) * sw + (cc[0] - sc0), nr, nc, sw))
            copied += nr * nc
    return copied


def _window(buf, offset: int, rows: int, cols: int, stride: int):
    """A (rows, cols) view of 1-D `buf` starting at element `offset`, rows `stride` elements apart."""
    e = buf.stride(0)
    return buf.as_strided((rows, cols), (stride * e, e), buf.storage_offset() + offset * e)
