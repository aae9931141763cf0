"""Token shards on disk, and the deterministic, resumable sampling of training windows from them.

`prepare` turns text files into flat token arrays (`train_000.bin`, `val_000.bin`, uint16 when the
vocabulary fits, else uint32) plus `meta.json`. The validation split is held out by *file*, so no
validation text was ever seen in training.

Sampling is a pure function of (seed, step): the global batch of step s is the same set of windows
whatever the layout, and each data-parallel rank takes its slice of it. So a data-parallel run sees
exactly the tokens of the single-device run, and resuming needs only the step number.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from plait.errors import UserError, bad_value
from plait.tokenizer import from_spec, save_spec_files

META = "meta.json"
FORMAT_VERSION = 1
SHARD_TOKENS = 1 << 30  # tokens per shard file; keeps each file well under 4 GiB
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".c", ".h", ".cc", ".cpp", ".js", ".ts", ".json",
                 ".toml", ".yaml", ".yml", ".html", ".css", ".sh", ".tex", ".csv", ".ini", ".cfg"}
_VAL_KEY = 0xFFFF_FFFF  # the rng key that stands for "validation" instead of a step number


def _collect_files(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        p = Path(item).expanduser()
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES
                            and not {"site-packages", "dist-packages", "__pycache__"} & set(f.parts))
        else:
            raise bad_value("--input", item, "no such file or folder")
    return files


def _is_val(path: Path, root_index: int, fraction: float) -> bool:
    """Hold a file out by a hash of its name: stable across machines and re-runs."""
    h = int.from_bytes(hashlib.sha256(f"{root_index}:{path.name}:{path.parent.name}".encode()).digest()[:8], "little")
    return (h / 2**64) < fraction


class _ShardWriter:
    def __init__(self, folder: Path, split: str, dtype):
        self.folder, self.split, self.dtype = folder, split, dtype
        self.shards: list[dict] = []
        self._f = None

    def write(self, ids: np.ndarray) -> None:
        while len(ids):
            if self._f is None or self.shards[-1]["tokens"] >= SHARD_TOKENS:
                self._open()
            room = SHARD_TOKENS - self.shards[-1]["tokens"]
            part, ids = ids[:room], ids[room:]
            self._f.write(part.astype(self.dtype).tobytes())
            self.shards[-1]["tokens"] += len(part)

    def _open(self) -> None:
        if self._f:
            self._f.close()
        name = f"{self.split}_{len(self.shards):03d}.bin"
        self._f = open(self.folder / name, "wb")
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> list[dict]:
        if self._f:
            self._f.close()
        return self.shards


def prepare(inputs: list[str], out: str | Path, tokenizer, val_fraction: float = 0.01,
            quiet: bool = False) -> Path:
    """Tokenize text files into shards in `out` (written to a temp folder, then renamed into place)."""
    out = Path(out).expanduser()
    if (out / META).exists():
        raise bad_value("--out", str(out), "already holds prepared data; choose another folder or delete it")
    if out.exists() and any(out.iterdir()):
        raise bad_value("--out", str(out), "exists and is not empty; choose a new folder")
    files = _collect_files(inputs)
    if not files:
        raise bad_value("--input", " ".join(inputs), "holds no text files; give files or folders of text")
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise bad_value("--out", str(out), f"cannot write there ({e.strerror}); choose a writable folder") from None
    writers = {s: _ShardWriter(tmp, s, dtype) for s in ("train", "val")}
    skipped = used = 0
    for i, f in enumerate(files):
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            skipped += 1
            continue
        if not text.strip():
            continue
        used += 1
        split = "val" if len(files) > 1 and _is_val(f, 0, val_fraction) else "train"
        writers[split].write(tokenizer.encode(text + "\n"))
    shards = {s: w.close() for s, w in writers.items()}
    n_train = sum(s["tokens"] for s in shards["train"])
    n_val = sum(s["tokens"] for s in shards["val"])
    if n_train + n_val == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise bad_value("--input", " ".join(inputs), "contains no readable UTF-8 text; the corpus is empty")
    if n_val == 0 or n_train == 0:
        # too few files to hold any out by name: split the token stream itself (tail = validation)
        _split_tail(tmp, shards, dtype, max(val_fraction, 0.01))
    save_spec_files(tokenizer, tmp)
    meta = {"format": FORMAT_VERSION, "vocab_size": int(tokenizer.vocab_size),
            "dtype": np.dtype(dtype).name, "tokenizer": tokenizer.spec, "splits": shards,
            "files_used": used, "files_skipped": skipped}
    (tmp / META).write_text(json.dumps(meta, indent=1))
    os.replace(tmp, out)
    if not quiet:
        n = {k: sum(s["tokens"] for s in v) for k, v in shards.items()}
        print(f"prepared {out}: {used} files ({skipped} skipped), {n['train']:,} train / "
              f"{n['val']:,} val tokens, {np.dtype(dtype).name}", file=sys.stderr)
    return out


def _split_tail(folder: Path, shards: dict, dtype, fraction: float) -> None:
    """Rebuild the splits as head/tail of all tokens (single-file corpora)."""
    all_ids = np.concatenate([np.fromfile(folder / s["file"], dtype=dtype)
                              for split in ("train", "val") for s in shards[split]])
    for split in ("train", "val"):
        for s in shards[split]:
            (folder / s["file"]).unlink()
    n_val = max(1, int(len(all_ids) * fraction))
    for split, ids in (("train", all_ids[:-n_val]), ("val", all_ids[-n_val:])):
        w = _ShardWriter(folder, split, dtype)
        w.write(ids)
        shards[split] = w.close()


def default_corpus_dir(cache_dir: str, val_fraction: float) -> Path:
    """The Python standard library of this interpreter, prepared once (bytes) into the cache."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tag = hashlib.sha256(f"{stdlib}:{sys.version}:{val_fraction}".encode()).hexdigest()[:10]
    out = Path(cache_dir).expanduser() / f"stdlib-py{sys.version_info[0]}.{sys.version_info[1]}-{tag}"
    if not (out / META).exists():
        from plait.tokenizer import ByteTokenizer

        print(f"preparing the default corpus (Python standard library at {stdlib}) into {out}", file=sys.stderr)
        try:
            prepare([str(stdlib)], out, ByteTokenizer(), val_fraction, quiet=False)
        except UserError:
            if not (out / META).exists():  # another process may have prepared it meanwhile
                raise
    return out


@dataclass
class Split:
    shards: list[np.memmap]

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.shards)


class TokenData:
    """Prepared shards, memory-mapped; windows of `seq_len + 1` tokens give inputs and targets."""

    def __init__(self, path: str | Path, field: str = "data.path"):
        self.path = Path(path).expanduser()
        meta_file = self.path / META
        if not meta_file.is_file():
            raise bad_value(field, str(path), "holds no prepared data (meta.json missing); "
                            "run `plait data prepare --input FILES --out DIR` first")
        try:
            self.meta = json.loads(meta_file.read_text())
            self.vocab_size = int(self.meta["vocab_size"])
            dtype = np.dtype(self.meta["dtype"])
            self.splits = {k: Split([np.memmap(self.path / s["file"], dtype=dtype, mode="r")
                                     for s in v if s["tokens"] > 0])
                           for k, v in self.meta["splits"].items()}
        except (KeyError, ValueError, OSError) as e:
            raise bad_value(field, str(path), f"has a damaged meta.json or shard ({e}); prepare it again") from None
        self.tokenizer_spec = self.meta.get("tokenizer", {"kind": "byte"})

    def tokenizer(self):
        return from_spec(self.tokenizer_spec, self.path)

    def check(self, vocab_size: int, seq_len: int) -> None:
        if self.vocab_size > vocab_size:
            raise bad_value("model.vocab_size", vocab_size,
                            f"is smaller than the data's vocabulary ({self.vocab_size}); set --model.vocab_size {self.vocab_size}")
        for name, split in self.splits.items():
            longest = max((len(s) for s in split.shards), default=0)
            if longest < seq_len + 1:
                raise bad_value("train.seq_len", seq_len,
                                f"is longer than the {name} split ({longest} tokens in its largest shard); "
                                f"use a shorter sequence or more data")

    def _windows(self, split: str, starts: np.ndarray, seq_len: int) -> np.ndarray:
        """Rows of seq_len+1 tokens at global start indices over the split's valid start positions."""
        shards = self.splits[split].shards
        sizes = np.array([len(s) - seq_len for s in shards])  # valid starts per shard
        bounds = np.cumsum(sizes)
        out = np.empty((len(starts), seq_len + 1), dtype=np.int64)
        which = np.searchsorted(bounds, starts, side="right")
        for row, (g, k) in enumerate(zip(starts, which)):
            local = g - (bounds[k] - sizes[k])
            out[row] = shards[k][local:local + seq_len + 1]
        return out

    def _starts(self, split: str, key: int, count: int, seq_len: int, seed: int) -> np.ndarray:
        valid = sum(len(s) - seq_len for s in self.splits[split].shards)
        return np.random.default_rng([seed, key]).integers(0, valid, size=count)

    def batch(self, step: int, micro: int, *, micro_batch: int, grad_accum: int, dp_rank: int,
              dp_size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (micro_batch, seq_len) of one micro-batch of one data-parallel rank.

        The step's global batch is micro_batch * dp_size * grad_accum windows in a fixed order;
        rank r of micro-step m takes rows [(m * dp_size + r) * micro_batch, ... + micro_batch).
        """
        total = micro_batch * dp_size * grad_accum
        starts = self._starts("train", step, total, seq_len, seed)
        first = (micro * dp_size + dp_rank) * micro_batch
        rows = torch.from_numpy(self._windows("train", starts[first:first + micro_batch], seq_len))
        return rows[:, :-1], rows[:, 1:]

    def val_batches(self, n_batches: int, *, micro_batch: int, dp_rank: int, dp_size: int,
                    seq_len: int, seed: int):
        """The same held-out windows at every evaluation (so val losses are comparable over time)."""
        total = n_batches * micro_batch * dp_size
        starts = self._starts("val", _VAL_KEY, total, seq_len, seed)
        for i in range(n_batches):
            first = (i * dp_size + dp_rank) * micro_batch
            rows = torch.from_numpy(self._windows("val", starts[first:first + micro_batch], seq_len))
            yield rows[:, :-1], rows[:, 1:]
