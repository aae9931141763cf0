"""Whether a rank's forward is host-bound: the host's seconds issuing each block's forward over the
device's seconds running it.

A block's forward is bracketed by two hooks: one that runs before every other pre-hook of the block
(so an engine's own hooks, ZeRO-3's gather of the next block among them, count as issuing) and one
after every other post-hook. Each records the host clock and a CUDA event on the current stream.
Host seconds are the bracket's length on the host clock; device seconds the time between the two
events on the stream: when the GPU reached the block, to when it finished what the block issued,
waits for a gather included. Near or above 1 the GPU waits on the CPU, as with the pipeline's
`plait.timeline.host_share`: at one sequence a GPU, 8b's ZeRO-3 forward with FP8 linears issues a
block in 1.45-2.4 ms of host time that its GPU runs in 1.4-2.1 ms (4 x H200), and every all-gather
then waits for the slowest rank's host. On a CPU both clocks are the host's: it reads 1.
"""

from __future__ import annotations

import time

import torch


def mark(cuda: bool):
    """(device mark, host time): a CUDA event recorded on the current stream, or the host clock twice
    (a CPU's device is its host). The pipeline's timeline marks its actions with it too."""
    host = time.perf_counter()
    if not cuda:
        return host, host
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev, host


class ForwardHostShare:
    """`with ForwardHostShare(blocks, device) as hs: <steps>`, then `hs.share()`."""

    def __init__(self, blocks, device: torch.device):
        self.blocks, self.cuda = list(blocks), device.type == "cuda"
        self.spans: list = []  # (device start, host start, device end, host end) per block forward
        self._open: dict[int, tuple] = {}
        self._handles: list = []

    def _pre(self, i, module, args):
        self._open[i] = mark(self.cuda)

    def _post(self, i, module, args, out):
        start = self._open.pop(i, None)
        if start is not None:
            self.spans.append(start + mark(self.cuda))

    def __enter__(self):
        for i, b in enumerate(self.blocks):
            self._handles.append(b.register_forward_pre_hook(lambda m, a, i=i: self._pre(i, m, a), prepend=True))
            self._handles.append(b.register_forward_hook(lambda m, a, o, i=i: self._post(i, m, a, o)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False

    def share(self) -> float | None:
        """Host seconds over device seconds, summed over every recorded block forward (None if none)."""
        if not self.spans:
            return None
        if self.cuda:
            torch.cuda.synchronize()
            device = sum(a.elapsed_time(b) / 1e3 for a, _, b, _ in self.spans)
        else:
            device = sum(b - a for a, _, b, _ in self.spans)
        host = sum(b - a for _, a, _, b in self.spans)
        return host / device if device > 0 else None
