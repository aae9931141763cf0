"""Slow ranks: each rank's CPU time per step, compared across ranks every `train.straggler_every`
steps; a rank whose mean exceeds the median by more than `train.straggler_threshold` is named.

Why CPU time, not wall time: data parallelism synchronises every step, so every rank's wall time
is the slowest one's - a fast rank spends the difference waiting inside a collective. Waiting on a
gloo socket takes no CPU, so the CPU a rank spends on a step is its own work: a rank on a slower or
throttled core, or given more work, stands out. (On GPUs this is the host's side only - data
loading, Python, kernel launches; a slow GPU shows in NCCL's own tools.) Measuring costs two clock
reads per step; comparing costs one all-gather of one number per rank every `straggler_every` steps.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


class StragglerReport:
    def __init__(self, comm, every: int, threshold: float, device, is_main: bool):
        self.comm, self.every, self.threshold, self.device, self.is_main = comm, every, threshold, device, is_main
        self.window: list[float] = []
        self.t0 = 0.0

    def begin(self) -> None:
        self.t0 = time.process_time()

    def end(self, done: int, record: dict) -> None:
        """After step `done`: on reporting steps, adds `rank_cpu_s` (each rank's mean CPU seconds
        per step over the window) to rank 0's record and warns about a straggler."""
        if not self.every or self.comm is None:
            return
        self.window.append(time.process_time() - self.t0)
        if done % self.every:
            return
        mine = torch.tensor([sum(self.window) / len(self.window)], dtype=torch.float64, device=self.device)
        per_rank = self.comm.all_gather(mine, "world").tolist()
        first = done - len(self.window) + 1
        self.window = []
        if not self.is_main:
            return
        record["rank_cpu_s"] = per_rank
        median = statistics.median(per_rank)
        for rank, s in enumerate(per_rank):
            if median > 0 and s > median * (1 + self.threshold):
                record.setdefault("stragglers", []).append(rank)
                print(f"plait: rank {rank} is slow: {s * 1e3:.1f} ms of CPU per step over steps {first}-{done}, "
                      f"{s / median - 1:+.0%} against the median {median * 1e3:.1f} ms "
                      f"(train.straggler_threshold = {self.threshold:g})", file=sys.stderr, flush=True)
