"""Tokenizers: the built-in byte-level one, and any HuggingFace `tokenizers` JSON file.

A tokenizer is described by a small JSON-able spec ({"kind": "byte"} or {"kind": "hf", "file": ...})
stored beside prepared data and inside checkpoints, so `plait generate` decodes with exactly the
tokenizer the model was trained with.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from plait.errors import UserError, bad_value

TOKENIZER_FILE = "tokenizer.json"


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, nothing to download, every text representable."""

    vocab_size = 256
    spec = {"kind": "byte"}

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A HuggingFace `tokenizers` JSON file (BPE, unigram, ...)."""

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError("--tokenizer needs the `tokenizers` package: pip install tokenizers") from None
        self.path = Path(path)
        try:
            self._tok = Tokenizer.from_file(str(self.path))
        except Exception as e:  # the library raises a plain Exception on bad JSON
            raise bad_value("--tokenizer", str(path), f"not a readable tokenizers JSON file ({e})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.spec = {"kind": "hf", "file": TOKENIZER_FILE}

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def save_to(self, folder: Path) -> None:
        shutil.copyfile(self.path, Path(folder) / TOKENIZER_FILE)


def from_path(path: str | None):
    """The tokenizer a user names on the command line (None = bytes)."""
    if not path:
        return ByteTokenizer()
    if not Path(path).is_file():
        raise bad_value("--tokenizer", path, "no such file; give a HuggingFace tokenizer.json")
    return HFTokenizer(path)


def from_spec(spec: dict, folder: str | Path):
    """Rebuild the tokenizer a spec describes; HF files are looked up in `folder`."""
    if spec.get("kind") == "byte":
        return ByteTokenizer()
    if spec.get("kind") == "hf":
        return HFTokenizer(Path(folder) / spec.get("file", TOKENIZER_FILE))
    raise UserError(f"unknown tokenizer spec {spec!r} in {folder}: re-run `plait data prepare`")


def save_spec_files(tokenizer, folder: Path) -> None:
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.save_to(folder)
