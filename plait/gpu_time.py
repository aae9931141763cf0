"""Where a step's GPU time goes: compute kernels, communication kernels, their overlap, and idle.

A data-parallel step runs NCCL kernels beside backward's matmuls. What it costs over one GPU is the
communication nobody overlapped (the GPU runs only NCCL kernels), plus the slowdown of the compute
that ran beside communication, plus gaps the host left. This splits a profiled window of kernel
intervals into those parts, on the union of intervals (kernels of one kind on several streams
count once), so `exposed_comm_ms + overlapped_ms` is the time communication was running and
`compute_ms + exposed_comm_ms + idle_ms` is the window.
"""

from __future__ import annotations

from collections import Counter


def is_comm(kernel_name: str) -> bool:
    """NCCL's kernels (ncclDevKernel_*, ncclKernel_*): the communication."""
    return kernel_name.startswith("nccl")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(xs, ys) -> float:
    """Total length where two sorted, disjoint interval lists overlap."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def split(kernels: list[tuple[str, float, float]], steps: int = 1) -> dict:
    """`kernels`: (name, start, end) in microseconds over `steps` steps -> milliseconds per step:
    window, compute (any non-communication kernel running), exposed_comm (only communication
    running), overlapped (both), idle (nothing), and the ten kernels with the most time."""
    if not kernels:
        return {"window_ms": 0.0, "compute_ms": 0.0, "exposed_comm_ms": 0.0, "overlapped_ms": 0.0,
                "idle_ms": 0.0, "top": []}
    comm = _union([(a, b) for n, a, b in kernels if is_comm(n)])
    compute = _union([(a, b) for n, a, b in kernels if not is_comm(n)])
    window = max(b for _, _, b in kernels) - min(a for _, a, _ in kernels)
    both = _intersection(comm, compute)
    busy = _length(comm) + _length(compute) - both
    per = Counter()
    for n, a, b in kernels:
        per[n] += b - a
    ms = 1e-3 / steps
    return {"window_ms": window * ms, "compute_ms": _length(compute) * ms,
            "exposed_comm_ms": (_length(comm) - both) * ms, "overlapped_ms": both * ms,
            "idle_ms": (window - busy) * ms,
            "top": [(n[:80], t * ms) for n, t in per.most_common(10)], "gaps": gaps(kernels)}


def gaps(kernels: list[tuple[str, float, float]], top: int = 8) -> list[tuple[float, str, str]]:
    """The `top` longest stretches with no kernel running, longest first: (milliseconds, the kernel
    that ended before it, the one that started after it) - where the host left the GPU waiting."""
    by_start = sorted(kernels, key=lambda k: k[1])
    out, end, last = [], None, None
    for n, a, b in by_start:
        if end is not None and a > end:
            out.append(((a - end) * 1e-3, last[:60], n[:60]))
        if end is None or b > end:
            end, last = b, n
    return sorted(out, reverse=True)[:top]


def kernels_of(prof) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of every GPU kernel a finished `torch.profiler.profile` recorded."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start:
            out.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return out
