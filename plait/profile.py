"""Looking inside a run: a profiler trace of a few steps, and a memory snapshot when CUDA runs out.

`--train.profile_steps A:B` records optimizer steps A..B (numbered as in metrics.jsonl, from 1)
with `torch.profiler` and writes a Chrome trace (open it in https://ui.perfetto.dev or
chrome://tracing), one file per rank, under `<out>/profile/`. Each step is a range named
`plait.step N` in the trace. On CUDA the same steps also record the caching allocator's history
(every allocation with its Python stack) and dump it as a snapshot for https://pytorch.org/memory_viz.

A CUDA out-of-memory error ends the run with one line saying where the allocator's snapshot at that
moment was written. It always holds the segments and blocks in use; the stacks that allocated them
are in it only when the error came inside a profiled window (recording them costs time on every
allocation, so plait does not do it unasked).
"""

from __future__ import annotations

import re
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from plait.errors import UserError, bad_value

HISTORY_ENTRIES = 200_000  # allocator events kept while profiling (a ring buffer: the newest win)


def parse_steps(spec: str, steps: int, field: str = "train.profile_steps") -> tuple[int, int]:
    """"A:B" -> (A, B) with 1 <= A <= B <= steps."""
    first, sep, last = str(spec).partition(":")
    try:
        a, b = int(first), int(last)
    except ValueError:
        raise bad_value(field, spec, "write A:B, the first and last optimizer step to profile (e.g. 5:7)") from None
    if not sep or not 1 <= a <= b:
        raise bad_value(field, spec, "write A:B with 1 <= A <= B, the first and last optimizer step to profile (e.g. 5:7)")
    if b > steps:
        raise bad_value(field, spec, f"ends after the run's last step ({steps}); profile steps within 1:{steps}")
    return a, b


class StepProfiler:
    """Call `step(n)` at the top of each optimizer step n and `close()` after the loop; records the
    steps of `spec` that this run reaches (a resumed run may start inside or past the window).

    `say` gets one line per file written (None: write silently, as ranks other than the main one do);
    each of `world` ranks writes its own files, and the line names them all.
    """

    def __init__(self, spec: str, folder: Path, rank: int, device: torch.device, say=None, world: int = 1):
        self.window = parse_steps(spec, sys.maxsize) if spec else None
        self.folder, self.rank, self.device, self.say, self.world = Path(folder), rank, device, say, world
        self.prof = None
        self.marker = None
        self.recorded: list[int] = []

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def step(self, n: int) -> None:
        if self.marker is not None:
            self.marker.__exit__(None, None, None)
            self.marker = None
        if self.window is None:
            return
        first, last = self.window
        if self.prof is not None and n > last:
            self._stop()
        if self.prof is None and first <= n <= last and not self.recorded:
            self._start()
        if self.prof is not None:
            self.recorded.append(n)
            # a named range per step: the trace shows where each optimizer step begins and ends
            self.marker = torch.profiler.record_function(f"plait.step {n}")
            self.marker.__enter__()

    def close(self) -> None:
        """End the last step's range; write what was recorded if the run ended inside the window."""
        self.step(sys.maxsize)

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
        # one window per run: acc_events keeps torch from warning that a later cycle would clear it
        self.prof = profile(activities=activities, record_shapes=True, profile_memory=True, acc_events=True)
        self.prof.start()

    def _stop(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)  # the kernels of the last step belong in the trace
        self.prof.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        span = f"steps{self.recorded[0]}-{self.recorded[-1]}_rank{self.rank}"
        trace = self.folder / f"trace_{span}.json"
        self.prof.export_chrome_trace(str(trace))
        self.prof = None
        # every rank writes its own files: naming only this one's sent users looking for the others in it
        s, each = ("s", f"{self.world} files, one per rank") if self.world > 1 else ("", "")
        written = [f"profiler trace{s} of steps {self.recorded[0]}-{self.recorded[-1]} in {self._every(trace)}"
                   + (f" ({each})" if each else "")]
        if self.cuda:
            snapshot = self.folder / f"memory_{span}.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(f"memory snapshot{s} in {self._every(snapshot)} "
                           f"({each + '; ' if each else ''}https://pytorch.org/memory_viz)")
        if self.say is not None:
            self.say("; ".join(written))

    def _every(self, mine: Path) -> Path:
        """This rank's file, or the pattern of every rank's when there are several."""
        return mine if self.world == 1 else mine.with_name(mine.name.replace(f"_rank{self.rank}.", "_rank*."))


def _what_failed(message: str) -> str:
    """The allocation that failed, from torch's out-of-memory message (a paragraph of advice)."""
    asked = re.search(r"Tried to allocate ([\d.]+ \w+)", message)
    free = re.search(r"of which ([\d.]+ \w+) is free", message)
    if asked:
        return f"tried to allocate {asked.group(1)}" + (f" with {free.group(1)} free" if free else "")
    return message.strip().splitlines()[0][:200] if message.strip() else "no detail"


def oom_snapshot_path(out: Path, rank: int) -> Path:
    return Path(out) / "profile" / f"oom_memory_rank{rank}.pickle"


@contextmanager
def snapshot_on_oom(out: Path, rank: int):
    """Turn a CUDA out-of-memory error into a one-line `UserError` naming the allocator snapshot
    written at that moment, so the run says what to look at instead of a page of traceback."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        path = oom_snapshot_path(out, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            torch.cuda.memory._dump_snapshot(str(path))
            where = f"memory snapshot in {path} (open it at https://pytorch.org/memory_viz)"
        except Exception as dump_error:  # no CUDA context left to ask: still say what happened
            where = f"no memory snapshot ({dump_error})"
        raise UserError(f"CUDA out of memory ({_what_failed(str(e))}); {where}; lower --train.micro_batch, "
                        "raise --zero, use --train.recompute selective|full, or profile a step with "
                        "--train.profile_steps N:N to record which code allocated what") from None
