"""Documents in, token shards out: `prepare` (what `plait data prepare` runs) and the default corpus.

`prepare` turns documents (text files, JSONL, Parquet, a HuggingFace `datasets` folder) into flat
token arrays (`train_000.bin`, `val_000.bin`, uint16 when the vocabulary fits, else uint32) plus
`meta.json`, which `plait.data` reads. The validation split is held out by *document* (a whole
text file, or one JSONL / Parquet / datasets row), chosen by a hash of its name, so no validation
text was ever seen in training. Where that picks no document (one text file is one document; a
handful of rows may all hash into one split), the last val_fraction of the token stream is held
out instead, so a positive val_fraction always gives both splits. val_fraction 0 holds nothing out:
an empty validation split, which training refuses (it evaluates on the split).

Document boundaries. Each document ends with the tokenizer's EOS token; the byte tokenizer has
none (all 256 ids are bytes), so its documents end with a newline as they always did. Either way
`train_000.docs.bin` (int64) lists the offsets in `train_000.bin` at which a document begins, so
the loader finds boundaries without scanning for EOS (which a text may also contain) and without
a 257th byte id.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import json
import os
import re
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from plait.data import FORMAT_VERSION, META
from plait.errors import UserError, bad_value
from plait.tokenizer import DocumentEncoder, document_end, save_spec_files

SHARD_TOKENS = 1 << 30  # tokens per shard file; keeps each file well under 4 GiB
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".c", ".h", ".cc", ".cpp", ".js", ".ts", ".json",
                 ".toml", ".yaml", ".yml", ".html", ".css", ".sh", ".tex", ".csv", ".ini", ".cfg"}
RECORD_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet"}
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_CHUNK_DOCS, _CHUNK_CHARS = 512, 1 << 20  # documents handed to a worker at once
_TAIL_BLOCK = 1 << 23  # tokens read at once when the stream's tail is split off
# JSON's "\\ud83d" escape alone (half of a pair, as scraped text cut mid-emoji holds) is a lone
# surrogate in the str json.loads returns: no UTF-8 encoder or tokenizer takes it
_SURROGATE = re.compile("[\ud800-\udfff]")


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


def _is_prepared(files: list[str]) -> bool:
    """Whether a folder holding `files` (names) is one `plait data prepare` wrote."""
    return META in files and any(f.endswith(".bin") for f in files)


def _file_kind(path: Path) -> str | None:
    suffix = path.suffix.lower()  # A.JSONL and B.TXT (Windows, old archives) were skipped
    if suffix in RECORD_SUFFIXES:
        return RECORD_SUFFIXES[suffix]
    return "text" if suffix in TEXT_SUFFIXES else None


def _hf_source(folder: Path) -> Source:
    return Source("hf", folder, sum(f.stat().st_size for f in folder.rglob("*.arrow")))


def collect_sources(inputs: list[str], repeated: list[str] | None = None) -> list[Source]:
    """Every source the inputs name, in a fixed order (folders are walked in sorted path order), each
    file once: `--input txt txt` doubled the corpus, and the tail held out for validation was then
    also in the train split. The files named again are appended to `repeated`."""
    sources = _named_sources(inputs)
    seen, once = set(), []
    for s in sources:
        key = s.path.resolve()
        if key in seen:
            if repeated is not None:
                repeated.append(str(s.path))
            continue
        seen.add(key)
        once.append(s)
    return once


def _named_sources(inputs: list[str]) -> list[Source]:
    sources: list[Source] = []
    for item in inputs:
        p = Path(item).expanduser()
        if p.is_file():  # a file named explicitly is read whatever its suffix
            sources.append(Source(RECORD_SUFFIXES.get(p.suffix.lower(), "text"), p, p.stat().st_size))
        elif p.is_dir() and _is_hf_dataset(p):
            sources.append(_hf_source(p))
        elif p.is_dir():
            sources.extend(_walk(p, item))
        else:
            raise bad_value("--input", item, "no such file or folder")
    return sources


def mended_note(documents: int) -> str:
    return (f"replaced unpaired UTF-16 surrogates (a \\ud800-\\udfff escape without its other half) with "
            f"U+FFFD in {documents:,} JSONL document(s)")


def _walk(folder: Path, item: str) -> list[Source]:
    """The sources in a folder and below, in sorted path order. A datasets folder met on the way
    is read as one (its state.json and dataset_info.json were read as text, and its rows dropped);
    a folder `plait data prepare` wrote is refused: its meta.json and tokenizer.json are no text
    to train on. Other .json files stay text: code corpora (the default one, the Python standard
    library, among them) hold JSON files as they hold .toml and .yaml ones."""
    found: list[Source] = []
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        if _is_prepared(files):
            what = "is a folder" if here == folder else f"holds {here}, a folder"
            raise bad_value("--input", item, f"{what} made by `plait data prepare` (meta.json and token shards), "
                            "which is no text to train on; " + ("train on it with --data.path" if here == folder else
                            "move it out, or give the folders beside it as --input"))
        if here != folder and _is_hf_dataset(here):
            found.append(_hf_source(here))
            dirs.clear()  # its files are the dataset's: none of them is a document
            continue
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        for name in files:
            f = here / name
            kind = _file_kind(f)
            if kind and not _SKIP_DIRS & set(f.parts) and f.is_file():
                found.append(Source(kind, f, f.stat().st_size))
    return sorted(found, key=lambda s: s.path)  # Path order: by parts, as a sorted rglob gave them


def _is_val(key: str, fraction: float) -> bool:
    """Hold a document out by a hash of its name: stable across machines, re-runs and workers."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return (h / 2**64) < fraction


def _json_kind(value) -> str:
    """What a JSON value is, in JSON's words and with its article: the user reads the file, not Python's types."""
    for typ, kind in ((bool, "a boolean"), ((int, float), "a number"), (list, "an array"), (dict, "an object")):
        if isinstance(value, typ):  # bool first: True is an int to Python
            return kind
    return f"a {type(value).__name__}"


def _text_field_error(field: str, where: str, fields) -> UserError:
    return bad_value("--text-field", field, f"is not a field of {where} (fields: {', '.join(map(str, fields))}); "
                     "pass --text-field NAME")


def read_documents(source: Source, text_field: str = "text",
                   counts: dict | None = None) -> Iterator[tuple[str | None, str, float]]:
    """(text, hold-out key, bytes of input it stands for) per document; text None = an unreadable
    text file (a record whose text is null is an empty document). A JSONL text's lone surrogates
    become U+FFFD, and `counts["mended"]` (if given) counts the documents that held any.

    Keys name the document (a text file by its name and folder; a record by its file's name
    without suffix, its folder and its row number), so the same document is held out wherever the
    corpus sits on disk, and the same rows as JSONL, Parquet or a datasets folder split alike.
    """
    p = source.path
    if source.kind == "text":
        try:
            text = p.read_text(encoding="utf-8-sig")  # a leading byte-order mark is no text
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
                    # a byte-order mark before the first record (Notepad's UTF-8) is no text
                    row = json.loads(line.decode("utf-8-sig" if line_no == 1 else "utf-8"))
                except UnicodeDecodeError as e:
                    raise bad_value("--input", f"{p}:{line_no}", f"is not UTF-8 (byte {line[e.start]:#04x} at "
                                    f"column {e.start + 1}); re-encode the file as UTF-8") from None
                except ValueError:
                    raise bad_value("--input", f"{p}:{line_no}", "is not a JSON object; fix or remove that line") from None
                if not isinstance(row, dict):  # a list or a number has no fields to name
                    raise bad_value("--input", f"{p}:{line_no}", "is not a JSON object; fix or remove that line")
                if text_field not in row:
                    raise _text_field_error(text_field, f"{p} line {line_no}", row)
                text = row[text_field]
                if text is not None and not isinstance(text, str):
                    raise bad_value("--text-field", text_field, f"holds {_json_kind(text)}, not text, in "
                                    f"{p} line {line_no}; name a text field")
                if text and _SURROGATE.search(text):
                    # one broken character in a scraped row loses it, not the run; the summary says how many
                    text = _SURROGATE.sub("\ufffd", text)
                    if counts is not None:
                        counts["mended"] = counts.get("mended", 0) + 1
                # a null text is an empty row (it was counted as a skipped non-UTF-8 file, once per row)
                yield text or "", f"{p.stem}:{p.parent.name}:{row_no}", len(line)
    elif source.kind == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise bad_value("--input", str(p), "is Parquet, which needs pyarrow: pip install pyarrow") from None
        import pyarrow as pa

        try:
            pf = pq.ParquetFile(p)
        except (pa.ArrowException, OSError) as e:  # not Parquet at all, or its footer cut off
            raise _damaged_parquet(p, e) from None
        if text_field not in pf.schema_arrow.names:
            raise _text_field_error(text_field, str(p), pf.schema_arrow.names)
        per_row = source.size / max(1, pf.metadata.num_rows)
        row = 0
        batches = pf.iter_batches(columns=[text_field], batch_size=1024)
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowException, OSError) as e:  # a page damaged behind a readable footer
                raise _damaged_parquet(p, e) from None
            if batch is None:
                break
            for text in batch.column(0).to_pylist():
                row += 1
                if text is not None and not isinstance(text, str):
                    raise bad_value("--text-field", text_field, f"is not a text column in {p}; name a text column")
                yield text or "", f"{p.stem}:{p.parent.name}:{row}", per_row
    elif source.kind == "hf":
        yield from _read_hf_dataset(source, text_field)
    else:
        raise AssertionError(source.kind)


def _damaged_parquet(p: Path, e: Exception) -> Exception:
    """pyarrow says a damaged file with an OSError without errno ("Corrupt snappy compressed data")
    or an ArrowInvalid; an OSError with one (EIO, EACCES) is the disk's, said by `prepare`."""
    if isinstance(e, OSError) and e.errno:
        return e
    why = str(e).splitlines()[0] if str(e) else type(e).__name__
    return bad_value("--input", str(p), f"is not a readable Parquet file ({why}); replace it or leave it out")


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
            yield text or "", f"{p.name}:{p.parent.name}:{row}", per_row


def iter_texts(inputs: list[str], text_field: str = "text", counts: dict | None = None) -> Iterator[str]:
    """The non-empty document texts of the inputs, in order (for training a tokenizer); `counts`
    as `read_documents`'s."""
    for source in collect_sources(inputs):
        for text, _, _ in read_documents(source, text_field, counts):
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
            # the array's own memory, not a bytes copy of it (a document can be a whole file)
            self._f.write(np.ascontiguousarray(ids[pos:pos + n], dtype=self.dtype).data)
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
        for text, key, size in read_documents(source, text_field, counts):
            covered += size
            if text is None:
                counts["skipped"] += 1
                counts["skipped_paths"].append(str(source.path))
                continue
            if not text.strip():  # nothing to learn from; said in the summary line, not silently
                counts["empty"] += 1
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
            quiet: bool = False, *, text_field: str = "text", workers: int = 1,
            field: tuple[str, str] | None = None) -> Path:
    """Tokenize documents into shards in `out` (written to a temp folder, then renamed into place).

    The shards are byte-identical for any `workers`: chunks are encoded in parallel but written in
    input order. `field`: (name, value) the errors about `out` name (default --out and `out`): the
    default corpus's folder is one the user named by data.cache_dir.
    """
    out = Path(out).expanduser()
    name, shown = field or ("--out", str(out))
    if out.exists() and not out.is_dir():  # else iterdir below raises NotADirectoryError
        raise bad_value(name, shown, "is a file; give a new folder for the shards")
    if (out / META).exists():
        raise bad_value(name, shown, "already holds prepared data; choose another folder or delete it")
    if out.exists() and any(out.iterdir()):
        raise bad_value(name, shown, "exists and is not empty; choose a new folder")
    document_end(tokenizer)  # a tokenizer that cannot end a document: refused before anything is read
    repeated: list[str] = []
    sources = collect_sources(inputs, repeated)
    if repeated and not quiet:
        names = ", ".join(repeated[:5]) + (f" and {len(repeated) - 5} more" if len(repeated) > 5 else "")
        print(f"read once: {len(repeated)} file(s) the inputs name more than once: {names}", file=sys.stderr)
    if not sources:
        raise bad_value("--input", " ".join(inputs), "holds no text files; give files or folders of text, "
                        ".jsonl or .parquet files, or a datasets folder")
    if text_field != "text" and all(s.kind == "text" for s in sources):  # it was read nowhere
        raise bad_value("--text-field", text_field, "names a field of JSONL, Parquet or datasets rows, and every "
                        "input is a text file (one document each): drop --text-field")
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise bad_value(name, shown, f"cannot write there ({e.strerror}); choose a writable folder") from None
    try:
        meta = _write_shards(tmp, sources, tokenizer, dtype, val_fraction, text_field, workers, quiet, inputs)
    except OSError as e:  # a full disk was a traceback from the shard writer
        shutil.rmtree(tmp, ignore_errors=True)
        writing = e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG) or (
            e.filename and str(Path(e.filename).resolve()).startswith(str(tmp.resolve())))
        if writing:
            raise bad_value(name, shown, f"could not be written ({e.strerror}); nothing was kept: free "
                            "space there or choose another folder") from None
        raise bad_value("--input", str(e.filename or " ".join(inputs)), f"could not be read ({e.strerror})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, out)
    if not quiet:
        n = {k: sum(s["tokens"] for s in v) for k, v in meta["splits"].items()}
        empty = f"; {meta['_empty']:,} empty document(s) left out" if meta["_empty"] else ""
        print(f"prepared {out}: {meta['documents']['count']:,} documents from {meta['files_used']} file(s) "
              f"({meta['files_skipped']} skipped{empty}), {n['train']:,} train / {n['val']:,} val tokens, "
              f"{np.dtype(dtype).name}; {meta['_seconds']:.1f} s, {sum(n.values()) / meta['_seconds']:,.0f} "
              f"tokens/s on {max(1, workers)} worker(s)", file=sys.stderr)
        if meta["_skipped"]:
            names = ", ".join(meta["_skipped"][:5]) + (f" and {len(meta['_skipped']) - 5} more"
                                                       if len(meta["_skipped"]) > 5 else "")
            print(f"skipped {len(meta['_skipped'])} file(s) that are not UTF-8 text: {names}", file=sys.stderr)
        if meta["_mended"]:
            print(mended_note(meta["_mended"]), file=sys.stderr)
        if meta["_tail"]:
            print(f"validation: the last {n['val']:,} tokens of the stream, cutting through a document: too few "
                  "documents to hold whole ones out by name", file=sys.stderr)
        if not n["val"]:
            print("no validation split (--val-fraction 0): `plait train` and `plait eval` need one; prepare "
                  "with --val-fraction above 0 to train on this folder", file=sys.stderr)
    return out


def _write_shards(tmp: Path, sources, tokenizer, dtype, val_fraction, text_field, workers, quiet, inputs) -> dict:
    t0 = time.perf_counter()
    writers = {s: _ShardWriter(tmp, s, dtype) for s in ("train", "val")}
    counts = {"skipped": 0, "files": 0, "skipped_paths": [], "empty": 0, "mended": 0}
    bar = _Bar(sum(s.size for s in sources), enabled=not quiet)
    pending: collections.deque = collections.deque()  # (is_val, bytes) of chunks handed to the encoder

    def texts():
        for chunk_texts, is_val, covered in _chunks(sources, text_field, val_fraction, counts):
            pending.append((is_val, covered))
            yield chunk_texts

    done = n_docs = n_tokens = 0
    for ids, lengths in DocumentEncoder(tokenizer, workers, dtype).map(texts()):
        is_val, covered = pending.popleft()
        # each run of consecutive documents of one split is written as a slice of the chunk's ids:
        # no mask over the tokens and no copy of them (a chunk can be one document of a whole file)
        bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        edges = np.unique([0, *(np.flatnonzero(is_val[1:] != is_val[:-1]) + 1), len(is_val)])  # [0]: no documents
        for a, b in zip(edges[:-1], edges[1:]):
            lo = bounds[a]
            writers["val" if is_val[a] else "train"].write(ids[lo:bounds[b]], bounds[a:b] - lo)
        done, n_docs, n_tokens = done + covered, n_docs + len(lengths), n_tokens + len(ids)
        bar.update(done, n_docs, n_tokens)
    bar.close()
    shards = {s: w.close() for s, w in writers.items()}
    n_train = sum(s["tokens"] for s in shards["train"])
    n_val = sum(s["tokens"] for s in shards["val"])
    if n_train + n_val == 0:
        if counts["empty"] and not counts["skipped"]:
            # --text-field names the field of records: for text files it is no fix
            field = " (check --text-field)" if any(s.kind != "text" for s in sources) else ""
            raise bad_value("--input", " ".join(inputs), f"holds {counts['empty']} document(s), all of them empty; "
                            f"the corpus has no text{field}")
        raise bad_value("--input", " ".join(inputs), "contains no readable UTF-8 text; the corpus is empty")
    tail = val_fraction > 0 and (n_val == 0 or n_train == 0)
    if tail:
        # too few documents to hold any out by name (or one text file: one document): split the token
        # stream itself (tail = validation). With val_fraction 0 the user asked for no validation data.
        _split_tail(tmp, shards, dtype, val_fraction)
    save_spec_files(tokenizer, tmp)
    eos = getattr(tokenizer, "eos_id", None)
    meta = {"format": FORMAT_VERSION, "vocab_size": int(tokenizer.vocab_size),
            "dtype": np.dtype(dtype).name, "tokenizer": tokenizer.spec, "splits": shards,
            "documents": {"count": n_docs, "end": document_end(tokenizer), "eos_id": eos},
            "files_used": counts["files"], "files_skipped": counts["skipped"]}
    (tmp / META).write_text(json.dumps(meta, indent=1))  # no timings in it: same inputs, same bytes
    return {**meta, "_seconds": max(time.perf_counter() - t0, 1e-9), "_tail": tail, "_skipped": counts["skipped_paths"],
            "_empty": counts["empty"], "_mended": counts["mended"]}


def _split_tail(folder: Path, shards: dict, dtype, fraction: float) -> None:
    """Rebuild the splits as head/tail of all tokens (single-file corpora), documents kept.

    The tokens stream through in blocks, from the old shards (renamed aside) into the new ones:
    loading them all at once held the corpus in memory a second time."""
    parts = [s for split in ("train", "val") for s in shards[split]]
    bases = np.cumsum([0] + [s["tokens"] for s in parts])
    starts = np.concatenate([np.fromfile(folder / s["docs_file"], dtype=np.int64) + base
                             for s, base in zip(parts, bases)]) if parts else np.zeros(0, np.int64)
    for s in parts:
        (folder / s["docs_file"]).unlink()
        (folder / s["file"]).rename(folder / f".old-{s['file']}")
    total = int(bases[-1])
    cut = total - max(1, int(total * fraction))
    writers = {"train": _ShardWriter(folder, "train", dtype), "val": _ShardWriter(folder, "val", dtype)}
    for s, base in zip(parts, bases):
        old = folder / f".old-{s['file']}"
        with open(old, "rb") as f:
            for lo in range(int(base), int(base) + s["tokens"], _TAIL_BLOCK):
                block = np.fromfile(f, dtype=dtype, count=min(_TAIL_BLOCK, int(base) + s["tokens"] - lo))
                for split, a, b in (("train", lo, min(lo + len(block), cut)), ("val", max(lo, cut), lo + len(block))):
                    if a < b:  # this block's tokens of the split, and the documents that begin among them
                        i, j = np.searchsorted(starts, [a, b])
                        writers[split].write(block[a - lo:b - lo], starts[i:j] - a)
        old.unlink()
    for split, w in writers.items():
        shards[split] = w.close()


def default_corpus_dir(cache_dir: str, val_fraction: float) -> Path:
    """The Python standard library of this interpreter, prepared once (bytes) into the cache."""
    if not val_fraction > 0:  # refused here, by the setting they gave: TokenData.check would name the cache
        raise bad_value("data.val_fraction", val_fraction, "leaves the default corpus no validation split, "
                        "which training evaluates on; use a value above 0 (default 0.01)")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tag = hashlib.sha256(f"{stdlib}:{sys.version}:{val_fraction}".encode()).hexdigest()[:10]
    out = Path(cache_dir).expanduser() / f"stdlib-py{sys.version_info[0]}.{sys.version_info[1]}-{tag}"
    if (out / META).exists():
        return out
    cache = Path(cache_dir).expanduser()
    if cache.exists() and not cache.is_dir():
        raise bad_value("data.cache_dir", cache_dir, "is a file; give a folder for plait's prepared corpus")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = os.open(cache / f".{out.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise bad_value("data.cache_dir", cache_dir, f"cannot write there ({e.strerror}); choose a writable folder") \
            from None
    import fcntl

    # every rank of a torchrun or srun job prepares the corpus on its first start: one does it, the
    # others wait here and read it (they raced to rename it into place, and the losers failed)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / META).exists():
            from plait.tokenizer import ByteTokenizer

            print(f"preparing the default corpus (Python standard library at {stdlib}) into {out}", file=sys.stderr)
            prepare([str(stdlib)], out, ByteTokenizer(), val_fraction, quiet=False, field=("data.cache_dir", cache_dir))
    finally:
        os.close(lock)  # drops the lock
    return out
