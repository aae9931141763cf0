"""When a run saves, and what each save costs the training loop.

A checkpoint is due every `checkpoint.every` steps, every `checkpoint.every_minutes` minutes and at
the end. Every rank must decide alike (a save has barriers, and every rank writes its part), but
their clocks differ: the minutes are measured on each rank and the largest elapsed time is taken
with one all-reduce of one number per step (only when minutes are set).

`saver` is a `plait.checkpoint.Saver` (the loop waits for the write) or, with
`--checkpoint.async true`, a `plait.async_checkpoint.AsyncSaver` (the loop waits only for a copy
to host memory). `timed` measures the stall either way, so the two can be compared
(`bench/checkpoint_stall.py`); an asynchronous save due while the previous one is still being
written waits for it, and says how long (`checkpoint_wait_s`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import torch

from plait import checkpoint as ckpt
from plait.async_checkpoint import AsyncSaver


class Checkpointer:
    def __init__(self, cfg, root: Path, rank: int, world: int, comm=None, barrier=lambda: None, device="cpu"):
        c = cfg.checkpoint
        self.every, self.minutes, self.at_end, self.comm, self.device = c.every, c.every_minutes, c.at_end, comm, device
        self.root = Path(root)
        self.is_async = bool(c.async_save)
        if self.is_async:
            self.saver = AsyncSaver(root, c.keep_last, rank, world, cfg.parallel.timeout_s)
        else:
            self.saver = ckpt.Saver(root, c.keep_last, rank=rank, barrier=barrier)
        self.last = time.monotonic()
        self.stalls: list[float] = []
        self.saved: set[int] = set()  # steps this run saved (or resumed from): the same set on every rank

    def due(self, done: int, end: int) -> bool:
        """Whether step `done` (1-based) ends with a checkpoint; the same answer on every rank."""
        if (self.every and done % self.every == 0) or (done == end and self.at_end):
            return True
        if not self.minutes:
            return False
        elapsed = torch.tensor([time.monotonic() - self.last], dtype=torch.float64, device=self.device)
        if self.comm is not None:
            self.comm.all_reduce(elapsed, "world", op="max")
        return elapsed.item() >= self.minutes * 60

    @contextmanager
    def timed(self, step: int, record: dict):
        """Around the save of `step`: adds `checkpoint_stall_s` (the time the loop waited for it)
        to the step's record."""
        t0 = time.perf_counter()
        yield
        stall = time.perf_counter() - t0
        self.stalls.append(stall)
        self.saved.add(step)
        self.last = time.monotonic()
        record.update(checkpoint_stall_s=stall, checkpoint_async=self.is_async)
        if self.is_async:  # the part of the stall spent waiting for the previous write: saves too close together
            record["checkpoint_wait_s"] = self.saver.waited_s

    def keep(self, step: int, save) -> Path | None:
        """Make sure a complete checkpoint of `step` exists before the run stops: `save()` writes it
        unless this run already has (or resumed from) it; waits for it. None for step 0."""
        if step and step not in self.saved:
            with self.timed(step, {}):
                save()
        self.close()
        return self.root / ckpt.step_dir_name(step) if step else None

    def poll(self, record: dict) -> None:
        """Each step: a background write that failed raises here; one that finished is reported."""
        done = self.saver.poll()
        if done:
            record.update(done)

    def close(self) -> dict | None:
        """Wait for a write still running (the run's last checkpoint must exist when it ends)."""
        return self.saver.close()
