"""Token shards on disk, and the deterministic, resumable sampling of training windows from them.

`prepare` turns documents (text files, JSONL, Parquet, a HuggingFace `datasets` folder) into flat
token arrays (`train_000.bin`, `val_000.bin`, uint16 when the vocabulary fits, else uint32) plus
`meta.json`. The validation split is held out by *document* (a whole text file, or one JSONL /
Parquet / datasets row), chosen by a hash of its name, so no validation text was ever seen in
training. Where that picks no document (one text file is one document; a handful of rows may all
hash into one split), the last val_fraction of the token stream is held out instead, so a positive
val_fraction always gives both splits. val_fraction 0 holds nothing out: an empty validation split,
which training refuses (it evaluates on the split).

Document boundaries. Each document ends with the tokenizer's EOS token; the byte tokenizer has
none (all 256 ids are bytes), so its documents end with a newline as they always did. Either way
`train_000.docs.bin` (int64) lists the offsets in `train_000.bin` at which a document begins, so
the loader finds boundaries without scanning for EOS (which a text may also contain) and without
a 257th byte id. Folders prepared before these side files (format 1) still load: they report no
boundaries, i.e. each window is one document.

Sampling is a pure function of (seed, step): the global batch of step s is the same set of windows
whatever the layout, and each data-parallel rank takes its slice of it. So a data-parallel run sees
exactly the tokens of the single-device run, and resuming needs only the step number. `MixedData`
keeps that contract while drawing rows from several prepared folders by weight.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from plait.errors import UserError, bad_value
from plait.tokenizer import DocumentEncoder, from_spec, save_spec_files

META = "meta.json"
FORMAT_VERSION = 2  # 2: per-shard document offsets (*.docs.bin); 1: tokens only
SHARD_TOKENS = 1 << 30  # tokens per shard file; keeps each file well under 4 GiB
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".c", ".h", ".cc", ".cpp", ".js", ".ts", ".json",
                 ".toml", ".yaml", ".yml", ".html", ".css", ".sh", ".tex", ".csv", ".ini", ".cfg"}
RECORD_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet"}
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_VAL_KEY = 0xFFFF_FFFF  # the rng key that stands for "validation" instead of a step number
_MIX_KEY = 0x4D49_5844  # an rng key component that keeps mixing draws apart from window draws
_CHUNK_DOCS, _CHUNK_CHARS = 512, 1 << 20  # documents handed to a worker at once


# ---------------------------------------------------------------------------------------------
# Reading documents


@dataclass(frozen=True)
class Source:
    """One input to read: kind is "text" (a whole file is a document), "jsonl", "parquet" or "hf"
    (a folder written by `datasets.Dataset.save_to_disk`); size (bytes on disk) drives the bar."""

    kind: str
    path: Path
    size: int


def _is_hf_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file())


def _file_kind(path: Path) -> str | None:
    if path.suffix in RECORD_SUFFIXES:
        return RECORD_SUFFIXES[path.suffix]
    return "text" if path.suffix in TEXT_SUFFIXES else None


def collect_sources(inputs: list[str]) -> list[Source]:
    """Every source the inputs name, in a fixed order (folders are walked in sorted path order)."""
    sources: list[Source] = []
    for item in inputs:
        p = Path(item).expanduser()
        if p.is_file():  # a file named explicitly is read whatever its suffix
            sources.append(Source(RECORD_SUFFIXES.get(p.suffix, "text"), p, p.stat().st_size))
        elif p.is_dir() and _is_hf_dataset(p):
            sources.append(Source("hf", p, sum(f.stat().st_size for f in p.rglob("*.arrow"))))
        elif p.is_dir():
            for f in sorted(f for f in p.rglob("*") if f.is_file() and not _SKIP_DIRS & set(f.parts)):
                kind = _file_kind(f)
                if kind:
                    sources.append(Source(kind, f, f.stat().st_size))
        else:
            raise bad_value("--input", item, "no such file or folder")
    return sources


def _is_val(key: str, fraction: float) -> bool:
    """Hold a document out by a hash of its name: stable across machines, re-runs and workers."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return (h / 2**64) < fraction


def _text_field_error(field: str, where: str, fields) -> UserError:
    return bad_value("--text-field", field, f"is not a field of {where} (fields: {', '.join(map(str, fields))}); "
                     "pass --text-field NAME")


def read_documents(source: Source, text_field: str = "text") -> Iterator[tuple[str | None, str, float]]:
    """(text, hold-out key, bytes of input it stands for) per document; text None = unreadable.

    Keys name the document (a text file by its name and folder; a record by its file's name
    without suffix, its folder and its row number), so the same document is held out wherever the
    corpus sits on disk, and the same rows as JSONL, Parquet or a datasets folder split alike.
    """
    p = source.path
    if source.kind == "text":
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            text = None
        yield text, f"0:{p.name}:{p.parent.name}", source.size  # the key format of plait's first release
    elif source.kind == "jsonl":
        row_no = 0
        with open(p, "rb") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row_no += 1
                try:
                    row = json.loads(line)
                except ValueError:
                    raise bad_value("--input", f"{p}:{line_no}", "is not a JSON object; fix or remove that line") from None
                if not isinstance(row, dict):  # a list or a number has no fields to name
                    raise bad_value("--input", f"{p}:{line_no}", "is not a JSON object; fix or remove that line")
                if text_field not in row:
                    raise _text_field_error(text_field, f"{p} line {line_no}", row)
                text = row[text_field]
                if text is not None and not isinstance(text, str):
                    raise bad_value("--text-field", text_field, f"holds a {type(text).__name__}, not text, in "
                                    f"{p} line {line_no}; name a text field")
                yield text, f"{p.stem}:{p.parent.name}:{row_no}", len(line)
    elif source.kind == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise bad_value("--input", str(p), "is Parquet, which needs pyarrow: pip install pyarrow") from None
        pf = pq.ParquetFile(p)
        if text_field not in pf.schema_arrow.names:
            raise _text_field_error(text_field, str(p), pf.schema_arrow.names)
        per_row = source.size / max(1, pf.metadata.num_rows)
        row = 0
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                row += 1
                if text is not None and not isinstance(text, str):
                    raise bad_value("--text-field", text_field, f"is not a text column in {p}; name a text column")
                yield text, f"{p.stem}:{p.parent.name}:{row}", per_row
    elif source.kind == "hf":
        yield from _read_hf_dataset(source, text_field)
    else:
        raise AssertionError(source.kind)


def _read_hf_dataset(source: Source, text_field: str):
    p = source.path
    try:
        import datasets
    except ImportError:
        raise bad_value("--input", str(p), "is a HuggingFace datasets folder, which needs the `datasets` "
                        "package: pip install datasets") from None
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise bad_value("--input", str(p), f"holds splits {', '.join(ds)} but no 'train'; give one split's "
                            f"folder, e.g. {p / next(iter(ds))}")
        ds = ds["train"]
    if text_field not in ds.column_names:
        raise _text_field_error(text_field, str(p), ds.column_names)
    per_row = source.size / max(1, len(ds))
    row = 0
    for batch in ds.select_columns([text_field]).iter(batch_size=1024):
        for text in batch[text_field]:
            row += 1
            if text is not None and not isinstance(text, str):
                raise bad_value("--text-field", text_field, f"is not a text column in {p}; name a text column")
            yield text, f"{p.name}:{p.parent.name}:{row}", per_row


def iter_texts(inputs: list[str], text_field: str = "text") -> Iterator[str]:
    """The non-empty document texts of the inputs, in order (for training a tokenizer)."""
    for source in collect_sources(inputs):
        for text, _, _ in read_documents(source, text_field):
            if text and text.strip():
                yield text


# ---------------------------------------------------------------------------------------------
# Writing shards


class _ShardWriter:
    """Appends tokens to `{split}_NNN.bin` files and document starts to `{split}_NNN.docs.bin`."""

    def __init__(self, folder: Path, split: str, dtype):
        self.folder, self.split, self.dtype = folder, split, dtype
        self.shards: list[dict] = []
        self._starts: list[list[np.ndarray]] = []  # per shard, offsets where a document begins
        self._f = None

    def write(self, ids: np.ndarray, starts: np.ndarray) -> None:
        """Append `ids`; `starts` are the offsets in `ids` where a document begins (ascending).
        A document that crosses into the next shard has no start there: it continues."""
        pos = 0
        while pos < len(ids):
            if self._f is None or self.shards[-1]["tokens"] >= SHARD_TOKENS:
                self._open()
            shard = self.shards[-1]
            n = min(SHARD_TOKENS - shard["tokens"], len(ids) - pos)
            lo, hi = np.searchsorted(starts, [pos, pos + n])
            self._starts[-1].append(starts[lo:hi] - pos + shard["tokens"])
            self._f.write(ids[pos:pos + n].astype(self.dtype, copy=False).tobytes())
            shard["tokens"] += n
            pos += n

    def _open(self) -> None:
        if self._f:
            self._f.close()
        name = f"{self.split}_{len(self.shards):03d}"
        self._f = open(self.folder / f"{name}.bin", "wb")
        self.shards.append({"file": f"{name}.bin", "tokens": 0, "docs_file": f"{name}.docs.bin"})
        self._starts.append([])

    def close(self) -> list[dict]:
        if self._f:
            self._f.close()
        for shard, parts in zip(self.shards, self._starts):
            starts = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
            starts.tofile(self.folder / shard["docs_file"])
            shard["documents"] = len(starts)
        return self.shards


class _Bar:
    """Tokenizing progress on stderr: one redrawn line on a terminal, a line per ~10% elsewhere."""

    def __init__(self, total: float, enabled: bool):
        self.total, self.enabled = max(total, 1.0), enabled
        self.t0 = self._last = time.perf_counter()
        self.tty = enabled and sys.stderr.isatty()
        self._decile = 0

    def update(self, done: float, docs: int, tokens: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        frac = min(1.0, done / self.total)
        rate = tokens / max(now - self.t0, 1e-9)
        line = (f"tokenizing [{'#' * int(24 * frac)}{'.' * (24 - int(24 * frac))}] {100 * frac:3.0f}% "
                f"{docs:,} docs {tokens:,} tokens {rate / 1e3:,.0f}k tok/s")
        if self.tty and now - self._last > 0.1:
            sys.stderr.write("\r" + line.ljust(100))
            sys.stderr.flush()
            self._last = now
        elif not self.tty and int(10 * frac) > self._decile:
            self._decile = int(10 * frac)
            sys.stderr.write(line + "\n")

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\r" + " " * 100 + "\r")


def _chunks(sources: list[Source], text_field: str, val_fraction: float, counts: dict):
    """Documents grouped for the workers: (texts, is_val per text, input bytes covered)."""
    texts, is_val, covered, chars = [], [], 0.0, 0
    hold_out = len(sources) > 1 or sources[0].kind != "text"  # one text file: split its tail instead
    for source in sources:
        used = False
        for text, key, size in read_documents(source, text_field):
            covered += size
            if text is None:
                counts["skipped"] += 1
                continue
            if not text.strip():
                continue
            used = True
            texts.append(text)
            is_val.append(hold_out and _is_val(key, val_fraction))
            chars += len(text)
            if len(texts) >= _CHUNK_DOCS or chars >= _CHUNK_CHARS:
                yield texts, np.array(is_val, dtype=bool), covered
                texts, is_val, covered, chars = [], [], 0.0, 0
        counts["files"] += used
    if texts or covered:
        yield texts, np.array(is_val, dtype=bool), covered


def prepare(inputs: list[str], out: str | Path, tokenizer, val_fraction: float = 0.01,
            quiet: bool = False, *, text_field: str = "text", workers: int = 1) -> Path:
    """Tokenize documents into shards in `out` (written to a temp folder, then renamed into place).

    The shards are byte-identical for any `workers`: chunks are encoded in parallel but written in
    input order.
    """
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():  # else iterdir below raises NotADirectoryError
        raise bad_value("--out", str(out), "is a file; give a new folder for the shards")
    if (out / META).exists():
        raise bad_value("--out", str(out), "already holds prepared data; choose another folder or delete it")
    if out.exists() and any(out.iterdir()):
        raise bad_value("--out", str(out), "exists and is not empty; choose a new folder")
    sources = collect_sources(inputs)
    if not sources:
        raise bad_value("--input", " ".join(inputs), "holds no text files; give files or folders of text, "
                        ".jsonl or .parquet files, or a datasets folder")
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise bad_value("--out", str(out), f"cannot write there ({e.strerror}); choose a writable folder") from None
    try:
        meta = _write_shards(tmp, sources, tokenizer, dtype, val_fraction, text_field, workers, quiet, inputs)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, out)
    if not quiet:
        n = {k: sum(s["tokens"] for s in v) for k, v in meta["splits"].items()}
        print(f"prepared {out}: {meta['documents']['count']:,} documents from {meta['files_used']} file(s) "
              f"({meta['files_skipped']} skipped), {n['train']:,} train / {n['val']:,} val tokens, "
              f"{np.dtype(dtype).name}; {meta['_seconds']:.1f} s, {sum(n.values()) / meta['_seconds']:,.0f} "
              f"tokens/s on {max(1, workers)} worker(s)", file=sys.stderr)
        if not n["val"]:
            print("no validation split (--val-fraction 0): `plait train` and `plait eval` need one; prepare "
                  "with --val-fraction above 0 to train on this folder", file=sys.stderr)
    return out


def _write_shards(tmp: Path, sources, tokenizer, dtype, val_fraction, text_field, workers, quiet, inputs) -> dict:
    t0 = time.perf_counter()
    writers = {s: _ShardWriter(tmp, s, dtype) for s in ("train", "val")}
    counts = {"skipped": 0, "files": 0}
    bar = _Bar(sum(s.size for s in sources), enabled=not quiet)
    pending: collections.deque = collections.deque()  # (is_val, bytes) of chunks handed to the encoder

    def texts():
        for chunk_texts, is_val, covered in _chunks(sources, text_field, val_fraction, counts):
            pending.append((is_val, covered))
            yield chunk_texts

    done = n_docs = n_tokens = 0
    for ids, lengths in DocumentEncoder(tokenizer, workers, dtype).map(texts()):
        is_val, covered = pending.popleft()
        token_is_val = np.repeat(is_val, lengths)
        for split, docs in (("train", ~is_val), ("val", is_val)):
            doc_lengths = lengths[docs]
            starts = np.concatenate([[0], np.cumsum(doc_lengths)[:-1]]).astype(np.int64) if len(doc_lengths) else \
                np.zeros(0, np.int64)
            writers[split].write(ids[token_is_val == (split == "val")], starts)
        done, n_docs, n_tokens = done + covered, n_docs + len(lengths), n_tokens + len(ids)
        bar.update(done, n_docs, n_tokens)
    bar.close()
    shards = {s: w.close() for s, w in writers.items()}
    n_train = sum(s["tokens"] for s in shards["train"])
    n_val = sum(s["tokens"] for s in shards["val"])
    if n_train + n_val == 0:
        raise bad_value("--input", " ".join(inputs), "contains no readable UTF-8 text; the corpus is empty")
    if val_fraction > 0 and (n_val == 0 or n_train == 0):
        # too few documents to hold any out by name (or one text file: one document): split the token
        # stream itself (tail = validation). With val_fraction 0 the user asked for no validation data.
        _split_tail(tmp, shards, dtype, val_fraction)
    save_spec_files(tokenizer, tmp)
    eos = getattr(tokenizer, "eos_id", None)
    meta = {"format": FORMAT_VERSION, "vocab_size": int(tokenizer.vocab_size),
            "dtype": np.dtype(dtype).name, "tokenizer": tokenizer.spec, "splits": shards,
            "documents": {"count": n_docs, "end": "newline" if eos is None else "eos", "eos_id": eos},
            "files_used": counts["files"], "files_skipped": counts["skipped"]}
    (tmp / META).write_text(json.dumps(meta, indent=1))  # no timings in it: same inputs, same bytes
    return {**meta, "_seconds": max(time.perf_counter() - t0, 1e-9)}


def _split_tail(folder: Path, shards: dict, dtype, fraction: float) -> None:
    """Rebuild the splits as head/tail of all tokens (single-file corpora), documents kept."""
    parts = [s for split in ("train", "val") for s in shards[split]]
    all_ids = np.concatenate([np.fromfile(folder / s["file"], dtype=dtype) for s in parts])
    bases = np.cumsum([0] + [s["tokens"] for s in parts])
    starts = np.concatenate([np.fromfile(folder / s["docs_file"], dtype=np.int64) + base
                             for s, base in zip(parts, bases)])
    for s in parts:
        (folder / s["file"]).unlink()
        (folder / s["docs_file"]).unlink()
    cut = len(all_ids) - max(1, int(len(all_ids) * fraction))
    for split, lo, hi in (("train", 0, cut), ("val", cut, len(all_ids))):
        w = _ShardWriter(folder, split, dtype)
        w.write(all_ids[lo:hi], starts[(starts >= lo) & (starts < hi)] - lo)
        shards[split] = w.close()


def default_corpus_dir(cache_dir: str, val_fraction: float) -> Path:
    """The Python standard library of this interpreter, prepared once (bytes) into the cache."""
    if not val_fraction > 0:  # refused here, by the setting they gave: TokenData.check would name the cache
        raise bad_value("data.val_fraction", val_fraction, "leaves the default corpus no validation split, "
                        "which training evaluates on; use a value above 0 (default 0.01)")
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


# ---------------------------------------------------------------------------------------------
# Reading shards: windows, batches, document boundaries


@dataclass
class Split:
    shards: list[np.memmap]
    doc_starts: list[np.ndarray] | None = None  # per shard, ascending offsets where a document begins

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.shards)


class _Batches:
    """The batch contract shared by one prepared folder and a mix of them.

    A subclass gives `_plan(split, key, count, seq_len, seed)`: the rows of a global batch as an
    array whose row i says where window i comes from (a pure function of its arguments), and
    `_rows(split, plan, seq_len)` / `_doc_rows(split, plan, seq_len)` that read those windows.
    """

    def _slice(self, split, key, micro, micro_batch, n_micro, dp_rank, dp_size, seq_len, seed):
        plan = self._plan(split, key, micro_batch * dp_size * n_micro, seq_len, seed)
        first = (micro * dp_size + dp_rank) * micro_batch
        return plan[first:first + micro_batch]

    def batch(self, step: int, micro: int, *, micro_batch: int, grad_accum: int, dp_rank: int,
              dp_size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (micro_batch, seq_len) of one micro-batch of one data-parallel rank.

        The step's global batch is micro_batch * dp_size * grad_accum windows in a fixed order;
        rank r of micro-step m takes rows [(m * dp_size + r) * micro_batch, ... + micro_batch).
        """
        plan = self._slice("train", step, micro, micro_batch, grad_accum, dp_rank, dp_size, seq_len, seed)
        rows = torch.from_numpy(self._rows("train", plan, seq_len))
        return rows[:, :-1], rows[:, 1:]

    def batch_documents(self, step: int, micro: int, *, micro_batch: int, grad_accum: int, dp_rank: int,
                        dp_size: int, seq_len: int, seed: int) -> torch.Tensor:
        """Document index (micro_batch, seq_len) of each input position of the same micro-batch.

        Position 0 of each row is document 0; the index rises by one where a document begins. A
        document-masking attention lets position i see position j <= i iff their indices are
        equal. Data prepared without boundaries (format 1) gives zeros: one document per window.
        """
        plan = self._slice("train", step, micro, micro_batch, grad_accum, dp_rank, dp_size, seq_len, seed)
        return torch.from_numpy(self._doc_rows("train", plan, seq_len)[:, :-1])

    def val_batches(self, n_batches: int, *, micro_batch: int, dp_rank: int, dp_size: int,
                    seq_len: int, seed: int, documents: bool = False):
        """The same held-out windows at every evaluation (so val losses are comparable over time);
        with `documents`, each batch also gives its positions' document indices (`batch_documents`)."""
        for i in range(n_batches):
            plan = self._slice("val", _VAL_KEY, i, micro_batch, n_batches, dp_rank, dp_size, seq_len, seed)
            rows = torch.from_numpy(self._rows("val", plan, seq_len))
            if documents:
                yield rows[:, :-1], rows[:, 1:], torch.from_numpy(self._doc_rows("val", plan, seq_len)[:, :-1])
            else:
                yield rows[:, :-1], rows[:, 1:]


class TokenData(_Batches):
    """Prepared shards, memory-mapped; windows of `seq_len + 1` tokens give inputs and targets."""

    def __init__(self, path: str | Path, field: str = "data.path"):
        self.path, self.field = Path(path).expanduser(), field
        meta_file = self.path / META
        if not meta_file.is_file():
            raise bad_value(field, str(path), "holds no prepared data (meta.json missing); "
                            "run `plait data prepare --input FILES --out DIR` first")
        try:
            self.meta = json.loads(meta_file.read_text())
            if int(self.meta.get("format", 1)) > FORMAT_VERSION:
                raise bad_value(field, str(path), f"was prepared by a newer plait (format {self.meta['format']}); "
                                "upgrade plait or prepare it again")
            self.vocab_size = int(self.meta["vocab_size"])
            dtype = np.dtype(self.meta["dtype"])
            self.splits = {k: self._open_split(v, dtype) for k, v in self.meta["splits"].items()}
        except (KeyError, ValueError, OSError) as e:
            raise bad_value(field, str(path), f"has a damaged meta.json or shard ({e}); prepare it again") from None
        self.tokenizer_spec = self.meta.get("tokenizer", {"kind": "byte"})

    def _open_split(self, shards: list[dict], dtype) -> Split:
        shards = [s for s in shards if s["tokens"] > 0]
        tokens = [np.memmap(self.path / s["file"], dtype=dtype, mode="r") for s in shards]
        if not all("docs_file" in s for s in shards):  # format 1: boundaries were not recorded
            return Split(tokens)
        starts = [np.memmap(self.path / s["docs_file"], dtype=np.int64, mode="r") if s["documents"]
                  else np.zeros(0, np.int64) for s in shards]
        return Split(tokens, starts)

    @property
    def has_documents(self) -> bool:
        """Whether document boundaries were recorded (folders prepared by plait's format 2)."""
        return all(s.doc_starts is not None for s in self.splits.values())

    @property
    def has_val(self) -> bool:
        """Whether any tokens were held out for validation (none when prepared with val_fraction 0)."""
        return "val" in self.splits and self.splits["val"].tokens > 0

    def tokenizer(self):
        return from_spec(self.tokenizer_spec, self.path)

    def check(self, vocab_size: int, seq_len: int) -> None:
        if self.vocab_size > vocab_size:
            raise bad_value("model.vocab_size", vocab_size,
                            f"is smaller than the data's vocabulary ({self.vocab_size}); set --model.vocab_size {self.vocab_size}")
        if not self.has_val:  # else the seq_len check below would blame train.seq_len for a 0-token split
            raise bad_value(self.field, str(self.path), "has no validation split (prepared with --val-fraction 0), "
                            "and training evaluates on it (every train.eval_every steps and at the end); "
                            "prepare it again with --val-fraction above 0, e.g. 0.01")
        for name, split in self.splits.items():
            longest = max((len(s) for s in split.shards), default=0)
            if longest < seq_len + 1:
                raise bad_value("train.seq_len", seq_len,
                                f"is longer than the {name} split ({longest} tokens in its largest shard); "
                                f"use a shorter sequence or more data")

    def _valid(self, split: str, seq_len: int) -> np.ndarray:
        """Window starts per shard: a window of seq_len+1 tokens never crosses a shard's end."""
        return np.array([max(0, len(s) - seq_len) for s in self.splits[split].shards], dtype=np.int64)

    def _plan(self, split: str, key: int, count: int, seq_len: int, seed: int, stream: tuple = ()) -> np.ndarray:
        """Global window start indices over the split's valid starts, drawn from rng(seed, key, *stream)."""
        valid = int(self._valid(split, seq_len).sum())
        return np.random.default_rng([seed, key, *stream]).integers(0, valid, size=count)

    def _locate(self, split: str, starts: np.ndarray, seq_len: int):
        """(shard, offset in shard) of each global window start."""
        sizes = self._valid(split, seq_len)
        bounds = np.cumsum(sizes)
        which = np.searchsorted(bounds, starts, side="right")
        return which, starts - (bounds[which] - sizes[which])

    def _rows(self, split: str, starts: np.ndarray, seq_len: int) -> np.ndarray:
        """Rows of seq_len+1 tokens at global start indices."""
        shards = self.splits[split].shards
        out = np.empty((len(starts), seq_len + 1), dtype=np.int64)
        for row, (k, local) in enumerate(zip(*self._locate(split, starts, seq_len))):
            out[row] = shards[k][local:local + seq_len + 1]
        return out

    def _doc_rows(self, split: str, starts: np.ndarray, seq_len: int) -> np.ndarray:
        """Document index of each of the seq_len+1 tokens of the windows at global start indices."""
        out = np.zeros((len(starts), seq_len + 1), dtype=np.int64)
        doc_starts = self.splits[split].doc_starts
        if doc_starts is None:
            return out
        for row, (k, local) in enumerate(zip(*self._locate(split, starts, seq_len))):
            out[row, self.document_starts(doc_starts[k], local, seq_len + 1)] = 1
        return np.cumsum(out, axis=1)

    @staticmethod
    def document_starts(shard_starts: np.ndarray, offset: int, length: int) -> np.ndarray:
        """Positions in (0, length) where a document begins, in the window [offset, offset+length)
        of a shard whose document starts are `shard_starts`. Position 0 always opens the window."""
        lo, hi = np.searchsorted(shard_starts, [offset + 1, offset + length])
        return np.asarray(shard_starts[lo:hi]) - offset


# ---------------------------------------------------------------------------------------------
# Mixing several prepared folders


def parse_mix(spec: str, field: str = "data.mix") -> list[tuple[str, float]]:
    """"dirA:0.7,dirB:0.3" -> [(dirA, 0.7), (dirB, 0.3)]; weights are relative, each > 0."""
    example = "write DIR:WEIGHT,DIR:WEIGHT, e.g. data/web:0.7,data/code:0.3"
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise bad_value(field, spec, f"names no folder; {example}")
    out: list[tuple[str, float]] = []
    for item in items:
        path, sep, weight = item.rpartition(":")  # the last colon: a path may hold one
        if not sep or not path.strip():
            raise bad_value(field, spec, f"entry {item!r} has no weight; {example}")
        try:
            w = float(weight)
        except ValueError:
            raise bad_value(field, spec, f"weight {weight!r} of {path} is not a number; {example}") from None
        if not (w > 0 and math.isfinite(w)):
            raise bad_value(field, spec, f"weight {weight} of {path} must be a positive number")
        if any(p == path.strip() for p, _ in out):
            raise bad_value(field, spec, f"names {path} twice; give each folder once")
        out.append((path.strip(), w))
    return out


def _tokenizer_identity(data: TokenData) -> tuple:
    spec = data.tokenizer_spec
    digest = ""
    if spec.get("kind") == "hf":
        digest = hashlib.sha256((data.path / spec.get("file", "tokenizer.json")).read_bytes()).hexdigest()
    return spec.get("kind"), data.vocab_size, digest


class MixedData(_Batches):
    """Several prepared folders drawn by weight, with `TokenData`'s batch contract.

    Each step's global batch of n rows takes its sources by systematic sampling: with cumulative
    weights c_k (normalized to sum 1) and one u ~ U[0, 1) drawn from (seed, step), row i comes
    from the folder k whose interval [c_{k-1}, c_k) holds (i + u) / n. So folder k gives floor or
    ceil of w_k * n rows of every step (w_k * n on average, even where w_k * n < 1), and each window
    is drawn uniformly inside its folder. The rows stay grouped by folder: a step's gradient sums
    over its whole global batch, so their order within the step changes nothing. Everything is a
    function of (seed, step) alone: resume and any parallel layout see the same rows.
    """

    def __init__(self, spec: str, field: str = "data.mix"):
        entries = parse_mix(spec, field)
        self.parts = [TokenData(path, field) for path, _ in entries]
        w = np.array([weight for _, weight in entries], dtype=np.float64)
        self.weights = w / w.sum()
        first = _tokenizer_identity(self.parts[0])
        for part in self.parts[1:]:
            if _tokenizer_identity(part) != first:
                raise bad_value(field, spec, f"{part.path} was prepared with another tokenizer or vocabulary than "
                                f"{self.parts[0].path}; prepare every folder with the same --tokenizer")
        self.vocab_size = self.parts[0].vocab_size
        self.has_documents = all(p.has_documents for p in self.parts)
        self.has_val = all(p.has_val for p in self.parts)

    def tokenizer(self):
        return self.parts[0].tokenizer()

    def check(self, vocab_size: int, seq_len: int) -> None:
        for part in self.parts:
            part.check(vocab_size, seq_len)

    def _plan(self, split: str, key: int, count: int, seq_len: int, seed: int) -> np.ndarray:
        """(count, 2) rows of (folder index, global start index within that folder)."""
        rng = np.random.default_rng([seed, key, _MIX_KEY])
        points = (np.arange(count) + rng.random()) / count
        which = np.minimum(np.searchsorted(np.cumsum(self.weights), points, side="right"), len(self.parts) - 1)
        starts = np.zeros(count, dtype=np.int64)
        for k, part in enumerate(self.parts):
            rows = np.flatnonzero(which == k)
            # a stream per folder: folders of equal size must not draw the same offsets
            starts[rows] = part._plan(split, key, len(rows), seq_len, seed, stream=(_MIX_KEY, k))
        return np.stack([which, starts], axis=1)

    def _gather(self, read, split: str, plan: np.ndarray, seq_len: int) -> np.ndarray:
        out = np.zeros((len(plan), seq_len + 1), dtype=np.int64)
        for k, part in enumerate(self.parts):
            rows = plan[:, 0] == k
            if rows.any():
                out[rows] = read(part, split, plan[rows, 1], seq_len)
        return out

    def _rows(self, split, plan, seq_len):
        return self._gather(TokenData._rows, split, plan, seq_len)

    def _doc_rows(self, split, plan, seq_len):
        return self._gather(TokenData._doc_rows, split, plan, seq_len)


def open_data(data_cfg):
    """The training data a `DataConfig` names: a mix, a prepared folder, or the default corpus."""
    if data_cfg.mix:
        return MixedData(data_cfg.mix)
    return TokenData(data_cfg.path or default_corpus_dir(data_cfg.cache_dir, data_cfg.val_fraction))
