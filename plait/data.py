"""Token shards on disk, and the deterministic, resumable sampling of training windows from them.

`plait.prepare` writes a prepared folder: flat token arrays (`train_000.bin`, `val_000.bin`, uint16
when the vocabulary fits, else uint32), the offsets at which documents begin (`*.docs.bin`) and
`meta.json`. This module reads it. Folders prepared before the document side files (format 1)
still load: they report no boundaries, i.e. each window is one document.

Sampling is a pure function of (seed, step): the global batch of step s is the same set of windows
whatever the layout, and each data-parallel rank takes its slice of it. So a data-parallel run sees
exactly the tokens of the single-device run, and resuming needs only the step number. `MixedData`
keeps that contract while drawing rows from several prepared folders by weight.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from plait.errors import bad_value
from plait.tokenizer import TOKENIZER_FILE, from_spec

META = "meta.json"
FORMAT_VERSION = 2  # 2: per-shard document offsets (*.docs.bin); 1: tokens only
_VAL_KEY = 0xFFFF_FFFF  # the rng key that stands for "validation" instead of a step number
_MIX_KEY = 0x4D49_5844  # an rng key component that keeps mixing draws apart from window draws


# ---------------------------------------------------------------------------------------------
# Reading shards: windows, batches, document boundaries


def _json_kind(value) -> str:
    """What a JSON value is, in JSON's words: the user reads the file, not Python's types."""
    for typ, kind in ((bool, "a boolean"), ((int, float), "a number"), (str, "a string"), (list, "an array"),
                      (dict, "an object"), (type(None), "null")):
        if isinstance(value, typ):  # bool first: True is an int to Python
            return kind
    return f"a {type(value).__name__}"


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
            # JSON that is not what prepare writes ([1, 2], a dtype numpy has no name for) raised
            # AttributeError or TypeError past the handler below: each is said here as the damage it is
            if not isinstance(self.meta, dict):
                raise ValueError(f"it holds {_json_kind(self.meta)}, not an object")
            if int(self.meta.get("format", 1)) > FORMAT_VERSION:
                raise bad_value(field, str(path), f"was prepared by a newer plait (format {self.meta['format']}); "
                                "upgrade plait or prepare it again")
            self.vocab_size = int(self.meta["vocab_size"])
            try:
                dtype = np.dtype(self.meta["dtype"])
            except TypeError:
                raise ValueError(f"dtype {self.meta['dtype']!r} is not a numpy type") from None
            if dtype.kind not in "ui":  # token ids: prepare writes uint16 or uint32
                raise ValueError(f"dtype {dtype.name} is not an integer type")
            splits = self.meta["splits"]
            if not isinstance(splits, dict) or not all(isinstance(v, list) and all(isinstance(s, dict) for s in v)
                                                       for v in splits.values()):
                raise ValueError("its splits are not lists of shards")
            self.splits = {k: self._open_split(v, dtype) for k, v in splits.items()}
            self.tokenizer_spec = self.meta.get("tokenizer", {"kind": "byte"})
            if not isinstance(self.tokenizer_spec, dict) or not isinstance(self.tokenizer_spec.get("file", ""), str):
                raise ValueError(f"its tokenizer is {_json_kind(self.tokenizer_spec)}, not a tokenizer spec")
        except (KeyError, ValueError, TypeError, OSError) as e:
            raise bad_value(field, str(path), f"has a damaged meta.json or shard ({e}); prepare it again") from None
        name = self.tokenizer_spec.get("file", TOKENIZER_FILE)
        if self.tokenizer_spec.get("kind") == "hf" and not (self.path / name).is_file():
            # the tokenizer the shards were encoded with: without it no text can be read or checked
            # (eval's same_tokenizer met a FileNotFoundError; train blamed a --tokenizer never given)
            raise bad_value(field, str(path), f"is missing its {name} (the tokenizer its shards were encoded "
                            "with); put that file back or prepare the folder again")

    def _open_split(self, shards: list[dict], dtype) -> Split:
        shards = [s for s in shards if s["tokens"] > 0]
        for s in shards:  # a shard cut short (a full disk, a partial copy) would train on part of the data
            for key, count, size in (("file", "tokens", dtype.itemsize), ("docs_file", "documents", 8)):
                if key in s and (key == "file" or s[count]):
                    have = (self.path / s[key]).stat().st_size
                    if have != s[count] * size:
                        raise ValueError(f"{s[key]} holds {have // size:,} {count} where meta.json records "
                                         f"{s[count]:,}")
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
        return from_spec(self.tokenizer_spec, self.path, field=(self.field, str(self.path)))

    def check(self, vocab_size: int, seq_len: int, weights=None) -> None:
        """`weights`: the checkpoint or HF folder whose weights fix the model's vocabulary, if any."""
        if self.vocab_size > vocab_size:
            if weights:  # the vocabulary is the weights': raising it is refused, the data is what is wrong
                raise bad_value(self.field, str(self.path), f"has a vocabulary of {self.vocab_size}, larger than the "
                                f"{vocab_size} of the weights in {weights}; prepare the data with their tokenizer")
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
                                f"is longer than the {name} split of {self.path} ({longest} tokens in its largest "
                                f"shard); use a shorter sequence or more data")

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
    if not math.isfinite(sum(w for _, w in out)):  # 1e308 twice: an inf sum, and every weight 0 after it
        raise bad_value(field, spec, f"weights sum past the largest number; only their ratios count: {example}")
    return out


def _tokenizer_identity(data: TokenData) -> tuple:
    from plait.tokenizer import encoding_identity

    spec = data.tokenizer_spec
    digest = ""
    if spec.get("kind") == "hf":  # what encodes, not the file's bytes (`same_tokenizer`)
        digest = encoding_identity(data.path / spec.get("file", "tokenizer.json"))
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

    def check(self, vocab_size: int, seq_len: int, weights=None) -> None:
        for part in self.parts:
            part.check(vocab_size, seq_len, weights)

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
    if data_cfg.path:
        return TokenData(data_cfg.path)
    from plait.prepare import default_corpus_dir

    return TokenData(default_corpus_dir(data_cfg.cache_dir, data_cfg.val_fraction))
