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
_ASIDE = ".replaced-"  # step_00000010.replaced-<unix time>: an earlier save of a step saved again


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


def write_atomic(path: Path, text: str) -> None:
    """Replace a small file whole: a crash mid-write leaves the old version, never half of the new.
    A full or read-only disk is one line (`file_write_error`), and the partial file goes."""
    part = Path(path).with_name(Path(path).name + ".part")
    try:
        with open(part, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    except OSError as e:
        part.unlink(missing_ok=True)
        raise file_write_error(Path(path), e) from None


class RunWriteError(UserError):
    """A run's own record (metrics.jsonl, config.toml) could not be written: like a checkpoint that
    cannot be, one line and no restart (a restart would meet the same disk)."""


def file_write_error(path: Path, e: OSError) -> RunWriteError:
    return RunWriteError(f"cannot write {path}: {e.strerror or e} [errno {e.errno}]; checkpoints already saved are "
                         "intact (free space or make the folder writable, then run again: with --resume where one "
                         "was saved)")


def check_writable(folder: Path, field: str) -> None:
    """Fail before training, not at the first save an hour in."""
    if folder.exists() and not folder.is_dir():
        raise bad_value(field, str(folder), "is a file, not a folder; choose a folder for the run")
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


def run_folder_of(path: Path) -> Path | None:
    """The run folder when `path` is one of its checkpoints or its checkpoints folder (what a user
    finds by looking for the checkpoint and gives as the run), else None."""
    p = Path(path)
    if (p / MANIFEST).is_file() or (_STEP_DIR.match(p.name) and p.is_dir()):
        p = p.parent
    elif not list_checkpoints(p):
        return None
    # every run keeps its checkpoints in RUN/checkpoints: another name is no run's
    return p.parent if p.name == "checkpoints" else None


_VERDICTS: dict[Path, str | None] = {}
"""What `verify` found of each folder it hashed in this process: `prune` counts a checkpoint as kept
only if intact, and hashing every kept one again at each save would cost minutes on a large model."""


def verify(folder: Path) -> str | None:
    """None if the checkpoint is intact, else a short reason it is not."""
    reason = _verify(folder, hash_files=True)
    _VERDICTS[Path(folder).resolve()] = reason
    return reason


SHARD_FILE = re.compile(r"^(model|optim)\.shard(\d+)-of-(\d+)\.pt$")
REQUIRED = ("train_state.json", "rng.pt")  # rank 0 writes both into every save; a resume reads both


def missing_part(names) -> str | None:
    """What a checkpoint whose manifest lists the files `names` lacks to be loaded, or None: a
    manifest edited down (or written by something else) passed the checksums and then crashed the
    load, or refused it as "not a plait checkpoint" where an older intact one could go on."""
    for f in REQUIRED:
        if f not in names:
            return f"{f} is not in it (an incomplete save)"
    for kind in ("model", "optim"):
        if f"{kind}.pt" in names:
            continue
        shards = sorted((int(m.group(2)), int(m.group(3))) for n in names
                        if (m := SHARD_FILE.match(n)) and m.group(1) == kind)
        counts = {c for _, c in shards}
        if not shards or len(counts) != 1 or [i for i, _ in shards] != list(range(next(iter(counts)))):
            return f"its {kind} files are incomplete ({kind}.pt, or every {kind}.shardIII-of-NNN.pt)"
    return None


def _verify(folder: Path, hash_files: bool) -> str | None:
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return "manifest.json missing (save did not finish)"
    try:
        doc = json.loads(manifest.read_text())
        entries = doc["files"]
    except (ValueError, KeyError, TypeError):
        return "manifest.json unreadable"
    named = _STEP_DIR.match(Path(folder).name)
    # the newest is found by the folder's name: a renamed folder (step_25 holding step 15) was resumed
    # as the newest, and the steps after its own redone
    if named and isinstance(doc, dict) and isinstance(doc.get("step"), int) and doc["step"] != int(named.group(1)):
        return f"its folder is named for step {int(named.group(1))} but it holds step {doc['step']} (renamed?)"
    # a hand-edited manifest ({"files": {}}, an entry without its size) passed, or raised a KeyError
    if not isinstance(entries, dict) or not entries or not all(
            isinstance(i, dict) and isinstance(i.get("bytes"), int) and isinstance(i.get("sha256"), str)
            for i in entries.values()):
        return "manifest.json lists no files, or files without their size and checksum"
    # (a training checkpoint, format 2: what `plait.train.save_checkpoint` writes)
    if doc.get("format", 0) >= 2 and (lacking := missing_part(entries)) is not None:
        return lacking
    for name, info in entries.items():
        f = folder / name
        if not f.is_file():
            return f"{name} missing"
        if f.stat().st_size != info["bytes"]:
            return f"{name} is {f.stat().st_size} bytes, manifest says {info['bytes']} (truncated?)"
        if hash_files and sha256_file(f) != info["sha256"]:
            return f"{name} checksum mismatch (file altered or corrupted)"
    return None


def _intact(folder: Path) -> bool:
    """Whether `prune` may count `folder` as a kept checkpoint: intact as far as this process knows
    (hashed by `verify`: a resume skipped it as damaged), else its manifest and sizes check out."""
    known = _VERDICTS.get(Path(folder).resolve(), "unknown")
    return known is None if known != "unknown" else _verify(folder, hash_files=False) is None


def latest_valid(root: Path, log=print) -> Path | None:
    """The newest intact checkpoint under root; every damaged one is reported in one line and skipped."""
    for step, folder in list_checkpoints(root):
        reason = verify(folder)
        if reason is None:
            return folder
        log(f"checkpoint {folder} skipped: {reason}")
    return None


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (disk full, folder read-only, ...): one line naming the
    folder and the cause. The partial write is removed; earlier checkpoints are untouched."""


def write_error(step: int, folder: Path, e: BaseException) -> CheckpointWriteError:
    """The error for a failed write into `folder` (a temporary folder of the save, or inside one)."""
    root = Path(folder)
    while root.name.startswith("."):
        root = root.parent
    return CheckpointWriteError(f"cannot write checkpoint {step_dir_name(step)} in {root}: "
                                f"{_cause(Path(folder), e)}; earlier checkpoints are intact (free space or "
                                "make the folder writable, then continue with --resume)")


def is_write_failure(e: BaseException) -> bool:
    """OSError, or torch.save's RuntimeError for a failed write: it carries no errno, and on a full
    disk says only "[enforce fail at inline_container.cc] unexpected pos", "file write failed" or,
    from the C++ stream under it, "basic_ios::clear: iostream error"."""
    return isinstance(e, OSError) or (isinstance(e, RuntimeError) and any(
        k in str(e) for k in ("inline_container", "PytorchStreamWriter", "write failed", "iostream error")))


def _cause(folder: Path, e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror} [errno {e.errno}]"
    try:  # torch.save says only "file write failed": a small write of our own learns why
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".probe"
        with open(probe, "wb") as f:
            f.write(b"\0" * (1 << 20))
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as p:
        try:
            (folder / ".probe").unlink()
        except OSError:
            pass
        return f"{p.strerror} [errno {p.errno}]"
    return str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__


def file_entry(path: Path) -> dict:
    """A manifest entry: the file made durable, then its size and sha256."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def commit(root: Path, tmp: Path, step: int, files: dict, info: dict, keep_last: int) -> Path:
    """Write the manifest of a complete temporary folder, rename it into place, prune old ones."""
    final = root / step_dir_name(step)
    manifest = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files, **info}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync_dir(tmp)
    if final.exists():
        # never destroy an earlier save of the same step (e.g. a damaged one): set it aside, and say so
        aside = final.with_name(f"{final.name}{_ASIDE}{int(time.time())}")
        final.rename(aside)
        print(f"plait: {final} saved again; the earlier save is set aside as {aside.name} (deleted once "
              "checkpoint.keep_last moves past its step)", file=sys.stderr)
    os.replace(tmp, final)
    _fsync_dir(root)
    _VERDICTS[final.resolve()] = None  # just written and hashed; a damaged save of this step went aside
    prune(root, keep_last)
    return final


def prune(root: Path, keep_last: int) -> None:
    """Delete the oldest checkpoints beyond keep_last, counting only intact ones as kept, and the
    saves set aside (`commit`) of steps older than any it keeps. A damaged checkpoint newer than
    them stays (it was reported) but is not counted: it counted, and a resume past a damaged step 20
    with keep_last 1 deleted the step it resumed from and the one it had just saved."""
    kept, oldest = 0, None
    for step, folder in list_checkpoints(root):
        if kept >= keep_last:
            shutil.rmtree(folder, ignore_errors=True)
        elif _intact(folder):
            kept, oldest = kept + 1, step
    if kept >= keep_last and oldest is not None:
        for folder in root.glob(f"step_*{_ASIDE}*"):
            if int(folder.name[5:13]) < oldest:
                shutil.rmtree(folder, ignore_errors=True)


def remove_partial(root: Path) -> list[str]:
    """Delete what interrupted saves left (`.tmp-step_*` folders); returns their names. Call only
    while no rank of this run writes (before workers start, or after they all ended)."""
    if not Path(root).is_dir():
        return []
    gone = [p for p in Path(root).iterdir() if p.name.startswith(".tmp-") and p.is_dir()]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in gone]


class Saver:
    """Writes checkpoints under `root`, the caller waiting until it is done. In a multi-rank run
    every rank calls `save` with its own files; `barrier` synchronises the ranks so rank 0 hashes
    only complete files. A failed write raises `CheckpointWriteError` (rank 0 removes the partial
    folder; earlier checkpoints are untouched)."""

    def __init__(self, root: Path, keep_last: int, rank: int = 0, barrier: Callable[[], None] = lambda: None):
        self.root, self.keep_last, self.rank, self.barrier = Path(root), keep_last, rank, barrier

    def snapshot(self, engine) -> Callable[[Path], None]:
        """What writes the engine's state: the live state itself, as the caller waits for the save."""
        return engine.save

    def poll(self) -> None:
        """Nothing runs in the background (the interface of `plait.async_checkpoint.AsyncSaver`)."""

    close = poll

    def save(self, step: int, write: Callable[[Path], None], info: dict) -> Path:
        """`write(tmp_folder)` writes this rank's files; `info` goes into the manifest."""
        from plait import faults

        tmp = self.root / f".tmp-{step_dir_name(step)}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            self._guarded(step, tmp, lambda: tmp.mkdir(parents=True))
        self.barrier()
        self._guarded(step, tmp, lambda: (write(tmp), faults.at("write", step, tmp)))
        self.barrier()
        final = self.root / step_dir_name(step)
        if self.rank == 0:
            files = lambda: {f.name: file_entry(f) for f in sorted(tmp.iterdir())}  # noqa: E731
            self._guarded(step, tmp, lambda: commit(self.root, tmp, step, files(), info, self.keep_last))
        self.barrier()
        return final

    def _guarded(self, step: int, tmp: Path, fn) -> None:
        try:
            fn()
        except Exception as e:
            if not is_write_failure(e):
                raise
            err = write_error(step, tmp, e)
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise err from None


def load_manifest(folder: Path) -> dict:
    return json.loads((Path(folder) / MANIFEST).read_text())


def resolve_for_reading(path: str, field: str = "--checkpoint") -> Path:
    """A checkpoint folder, or a run/checkpoints folder whose newest valid checkpoint is meant."""
    p = Path(path).expanduser()
    if not p.exists():
        raise bad_value(field, path, "no such checkpoint; give a step_XXXXXXXX folder, a run folder or a HuggingFace "
                        "model folder")
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
