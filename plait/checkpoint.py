"""Checkpoints that survive crashes: atomic, checksummed, the newest valid one found on resume.

A checkpoint is a folder `step_00000020/` holding any number of files written by any number of
ranks, plus `manifest.json` with each file's size and sha256. It is written under a temporary name
and renamed into place only when complete, so a crash mid-save leaves no folder that looks valid.
On resume every candidate is re-hashed; a truncated or altered one is reported in one line and the
next older one is tried. Files are named by content (`model.pt`, `optim.pt`, `optim.rank003.pt`),
never by position, and tensors are keyed by parameter name, so layouts can change between runs
wherever the loader knows how to reshard.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from plait.errors import UserError, bad_value

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass  # not every filesystem lets a directory be fsynced; the rename is still atomic


def check_writable(folder: Path, field: str) -> None:
    """Fail before training, not at the first save an hour in."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise bad_value(field, str(folder), f"cannot write there ({e.strerror}); choose a writable folder") from None


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete-looking checkpoint, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def verify(folder: Path) -> str | None:
    """None if the checkpoint is intact, else a short reason it is not."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return "manifest.json missing (save did not finish)"
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return "manifest.json unreadable"
    for name, info in entries.items():
        f = folder / name
        if not f.is_file():
            return f"{name} missing"
        if f.stat().st_size != info["bytes"]:
            return f"{name} is {f.stat().st_size} bytes, manifest says {info['bytes']} (truncated?)"
        if sha256_file(f) != info["sha256"]:
            return f"{name} checksum mismatch (file altered or corrupted)"
    return None


def latest_valid(root: Path, log=print) -> Path | None:
    """The newest intact checkpoint under root; every damaged one is reported in one line and skipped."""
    for step, folder in list_checkpoints(root):
        reason = verify(folder)
        if reason is None:
            return folder
        log(f"checkpoint {folder} skipped: {reason}")
    return None


class Saver:
    """Writes checkpoints under `root`. In a multi-rank run every rank calls `save` with its own
    files; `barrier` synchronises the ranks so rank 0 hashes only complete files."""

    def __init__(self, root: Path, keep_last: int, rank: int = 0, barrier: Callable[[], None] = lambda: None):
        self.root, self.keep_last, self.rank, self.barrier = Path(root), keep_last, rank, barrier

    def save(self, step: int, write: Callable[[Path], None], info: dict) -> Path:
        """`write(tmp_folder)` writes this rank's files; `info` goes into the manifest."""
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{step_dir_name(step)}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.barrier()
        write(tmp)
        self.barrier()
        if self.rank == 0:
            files = {}
            for f in sorted(tmp.iterdir()):
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
                files[f.name] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
            manifest = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files, **info}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            _fsync_dir(tmp)
            if final.exists():
                # never destroy an earlier save of the same step (e.g. a damaged one): set it aside
                final.rename(final.with_name(f"{final.name}.replaced-{int(time.time())}"))
            os.replace(tmp, final)
            _fsync_dir(self.root)
            self._prune()
        self.barrier()
        return final

    def _prune(self) -> None:
        """Delete the oldest checkpoints beyond keep_last, counting only intact ones as kept."""
        kept = 0
        for _, folder in list_checkpoints(self.root):
            if kept >= self.keep_last:
                shutil.rmtree(folder, ignore_errors=True)
            elif (folder / MANIFEST).is_file():
                kept += 1


def load_manifest(folder: Path) -> dict:
    return json.loads((Path(folder) / MANIFEST).read_text())


def resolve_for_reading(path: str, field: str = "--checkpoint") -> Path:
    """A checkpoint folder, or a run/checkpoints folder whose newest valid checkpoint is meant."""
    p = Path(path).expanduser()
    if not p.exists():
        raise bad_value(field, path, "no such checkpoint; give a step_XXXXXXXX folder or a run folder")
    if (p / MANIFEST).is_file() or _STEP_DIR.match(p.name):
        reason = verify(p)
        if reason:
            raise bad_value(field, path, f"is damaged: {reason}; use an older checkpoint")
        return p
    for root in (p / "checkpoints", p):
        found = latest_valid(root, log=lambda m: print(m, file=sys.stderr))
        if found:
            return found
    raise bad_value(field, path, "holds no valid checkpoint; give a step_XXXXXXXX folder or a run folder")


def torch_load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a verified file that still fails to load is a version mismatch
        raise UserError(f"cannot read checkpoint file {path} ({e}); it may come from an incompatible plait version") from None
