"""Asynchronous checkpoints (`--checkpoint.async true`): the state is copied to host memory at the
step boundary and written by a background thread while training goes on.

The protocol, on every rank, with no collective outside the main thread:
  main thread, at the step boundary   wait for this rank's previous checkpoint if it is still being
                                      written (its host buffers are reused), copy the optimizer state
                                      (fp32 masters and Adam moments) into host buffers - pinned on
                                      CUDA - and start the writer. The training stall is this copy.
  writer thread of every rank         write this rank's files into `.tmp-step_N/.rankR/`, fsync and
                                      hash them, move them up into `.tmp-step_N/`, then publish
                                      `.tmp-step_N/.done-rankR.json` (name, bytes, sha256 of each) by
                                      an atomic rename.
  writer thread of rank 0, after that wait until every rank's `.done` file is there (the checkpoint
                                      folder is shared, as for synchronous saves), then write the
                                      manifest from them, rename the folder into place and prune: the
                                      same commit as a synchronous save (`plait.checkpoint.commit`).
So `step_N/` appears only once every rank's files are complete. A rank that dies mid-write leaves a
`.tmp-step_N/` that resume ignores and the next start removes. A failed write (disk full) surfaces on
the main thread at the next step as a one-line `CheckpointWriteError`.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from plait import checkpoint as ckpt

_STATE = ("master", "exp_avg", "exp_avg_sq")


class HostState:
    """What `Engine.save` reads of its optimizer (`master`, `exp_avg`, `exp_avg_sq`, `steps`),
    copied to host memory. The buffers are allocated once and reused by every later checkpoint."""

    def take(self, opt) -> "HostState":
        cuda = None
        for name in _STATE:
            src, buf = getattr(opt, name), getattr(self, name, None)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
                setattr(self, name, buf)
            buf.copy_(src.detach(), non_blocking=src.is_cuda)
            cuda = src.device if src.is_cuda else cuda
        if cuda is not None:  # the copies are queued on the stream: done before training writes src again
            torch.cuda.current_stream(cuda).synchronize()
        self.steps = opt.steps
        return self


class AsyncSaver:
    """Same interface as `plait.checkpoint.Saver`: `snapshot(engine)` then `save(step, write, info)`
    - here `save` returns at once; `poll()` each step, `close()` at the end."""

    def __init__(self, root: Path, keep_last: int, rank: int, world: int, timeout_s: float):
        self.root, self.keep_last, self.rank, self.world, self.timeout_s = Path(root), keep_last, rank, world, timeout_s
        self.host = HostState()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._report: dict | None = None
        self._late: dict | None = None  # a write's report collected by a save that had to wait for it
        self.waited_s = 0.0  # how long the last snapshot waited for the previous write

    def snapshot(self, engine) -> Callable[[Path], None]:
        """The engine's own `save`, reading a host copy of its optimizer state taken now."""
        t0 = time.perf_counter()
        self._keep(self.wait())  # the previous write still reads the host buffers
        self.waited_s = time.perf_counter() - t0
        frozen = copy.copy(engine)  # a shallow copy: same pieces, shard and writer role ...
        frozen.opt = self.host.take(engine.opt)  # ... but the state as it is at this step boundary
        return frozen.save

    def save(self, step: int, write: Callable[[Path], None], info: dict) -> Path:
        self._keep(self.wait())
        self._thread = threading.Thread(target=self._run, args=(step, write, info), name=f"plait-ckpt-{step}",
                                        daemon=True)
        self._thread.start()
        return self.root / ckpt.step_dir_name(step)

    def _keep(self, report: dict | None) -> None:
        if report is not None:
            self._late = report

    def poll(self) -> dict | None:
        """If a write has finished: raise its error, or return its report once (also a report that a
        save collected while waiting for the write)."""
        if self._late is not None:
            report, self._late = self._late, None
            return report
        if self._thread is not None and not self._thread.is_alive():
            return self.wait()
        return None

    def wait(self) -> dict | None:
        """Wait for this rank's running write (on rank 0: and the commit); raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        err, self._error = self._error, None
        if err is not None:
            raise err
        report, self._report = self._report, None
        return report

    close = wait

    def _run(self, step: int, write: Callable[[Path], None], info: dict) -> None:
        t0 = time.perf_counter()
        tmp = self.root / f".tmp-{ckpt.step_dir_name(step)}"
        try:
            self._write_mine(step, tmp, write)
            if self.rank == 0:
                files = self._wait_for_ranks(step, tmp)
                self._guarded(step, tmp, lambda: ckpt.commit(self.root, tmp, step, files, info, self.keep_last))
            self._report = {"checkpoint_written": step, "checkpoint_write_s": time.perf_counter() - t0}
        except BaseException as e:  # handed to the main thread by wait()
            self._error = e

    def _write_mine(self, step: int, tmp: Path, write: Callable[[Path], None]) -> None:
        from plait import faults

        mine = tmp / f".rank{self.rank:05d}"

        def files() -> None:
            mine.mkdir(parents=True, exist_ok=True)
            write(mine)
            faults.at("write", step, mine)
            entries = {}
            for f in sorted(mine.iterdir()):
                entries[f.name] = ckpt.file_entry(f)
                os.replace(f, tmp / f.name)
            mine.rmdir()
            _publish(tmp / f".done-rank{self.rank:05d}.json", entries)

        self._guarded(step, mine, files)

    def _guarded(self, step: int, folder: Path, fn) -> None:
        try:
            fn()
        except Exception as e:
            if not ckpt.is_write_failure(e):
                raise
            # the cause first: its probe of the disk needs the full disk still full (removed first, the
            # partial save freed the space and torch's "unexpected pos" was all the line said)
            error = ckpt.write_error(step, folder, e)
            if self.rank == 0:
                shutil.rmtree(self.root / f".tmp-{ckpt.step_dir_name(step)}", ignore_errors=True)
            raise error from None

    def _wait_for_ranks(self, step: int, tmp: Path) -> dict:
        """Every rank's published file list, once all are there (rank 0, in its writer thread)."""
        deadline = time.monotonic() + self.timeout_s
        done = [tmp / f".done-rank{r:05d}.json" for r in range(self.world)]
        while not all(d.is_file() for d in done):
            if time.monotonic() > deadline:
                missing = [r for r, d in enumerate(done) if not d.is_file()]
                raise RuntimeError(f"checkpoint {ckpt.step_dir_name(step)}: rank(s) {missing} did not finish "
                                   f"their files within parallel.timeout_s = {self.timeout_s:g} s")
            time.sleep(0.01)
        files = {}
        for d in done:
            files.update(json.loads(d.read_text()))
            d.unlink()
        return dict(sorted(files.items()))


def _publish(path: Path, files: dict) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        json.dump(files, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
