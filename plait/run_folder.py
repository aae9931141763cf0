"""A run folder (`--out`) belongs to one run at a time and has room for the next checkpoint.

Checked before any worker starts, by the process that launches them (rank 0 under torchrun/srun):
  - the lock: `--out/.lock`, held with flock(2) for the whole run. The kernel drops it when the
    holder ends, however it ends (kill -9 included), so a dead run never leaves a stale lock; the
    file names the holder (pid, host) for the error a second run gets.
  - free space: a checkpoint needs about 12 bytes per parameter (fp32 masters and two Adam moments,
    all ranks together); less free space than one checkpoint is refused, less than keep_last of
    them is warned about.
  - leftovers: `.tmp-` folders of saves that a crash interrupted are removed (only the lock holder
    may: no one else writes there).
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

from plait import checkpoint as ckpt
from plait.errors import bad_value

LOCK = ".lock"
BYTES_PER_PARAM = 12  # fp32 master + exp_avg + exp_avg_sq


def checkpoint_bytes(model_cfg) -> int:
    from plait.planner.costs import ModelDims, param_count

    return BYTES_PER_PARAM * param_count(ModelDims.from_config(model_cfg)) + (64 << 10)  # + rng, json, manifest


class RunFolder:
    """`with RunFolder(cfg, holder=True):` - lock, space check and cleanup for the run's duration.
    holder=False (every other rank of an outer launcher) does nothing."""

    def __init__(self, cfg, holder: bool = True, created: bool = False):
        self.out = Path(cfg.train.out).expanduser()
        self.cfg, self.holder, self.created = cfg, holder, created  # created: made for this run by preflight
        self.fd: int | None = None

    def __enter__(self) -> "RunFolder":
        if self.holder:
            self.acquire()
            try:
                check_space(self.out, self.cfg)
                gone = ckpt.remove_partial(self.out / "checkpoints")
                if gone:
                    print(f"plait: removed {len(gone)} partial checkpoint(s) an interrupted save left: "
                          f"{', '.join(gone)}", file=sys.stderr)
            except BaseException:
                self._refused()
                raise
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # a start refused inside the workers (nodes that disagree, a rendezvous that timed out) left
        # the folder it made holding only its lock
        if exc_type is not None and self.holder and {p.name for p in self.out.iterdir()} <= {LOCK}:
            self._refused()
        self.release()

    def _refused(self) -> None:
        """A refused start leaves no run folder it made (only its lock) behind."""
        if self.created:
            (self.out / LOCK).unlink(missing_ok=True)  # while still locked: no other run holds it
        self.release()
        if self.created:
            discard(self.out)

    def acquire(self) -> None:
        import fcntl

        path = self.out / LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise bad_value("train.out", str(self.out), f"cannot create {LOCK} there ({e.strerror}); "
                            "choose a writable folder") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise bad_value("train.out", str(self.out), f"is in use by another plait run ({holder}); wait for it "
                            "to end or choose another --out") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self.fd = fd

    @staticmethod
    def holder(out: Path) -> str | None:
        """Who holds `out`'s lock now (its pid and host), or None when no run does; takes nothing.
        A start asks before it says anything about the folder: the refusal comes first."""
        import fcntl

        try:
            fd = os.open(Path(out) / LOCK, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None  # (closing the fd drops the shared lock at once)
        except OSError:
            return os.read(fd, 200).decode(errors="replace").strip() or "another process"
        finally:
            os.close(fd)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock; the file stays (removing it would race a new holder)
            self.fd = None


def discard(out: Path) -> None:
    """Remove the run folder a refused start made, if nothing is in it."""
    try:
        out.rmdir()
    except OSError:
        pass


def check_space(out: Path, cfg) -> None:
    need = checkpoint_bytes(cfg.model)
    free = shutil.disk_usage(out).free
    if free < need:
        raise bad_value("train.out", str(out), f"has {_gib(free)} free but one checkpoint of this model needs about "
                        f"{_gib(need)}; free space there or choose another --out")
    keep = cfg.checkpoint.keep_last
    if free < need * keep:
        print(f"plait: {out} has {_gib(free)} free, room for fewer than checkpoint.keep_last = {keep} checkpoints "
              f"of about {_gib(need)} each", file=sys.stderr)


def _gib(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size / 8:
            return f"{n / size:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"
