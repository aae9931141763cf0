"""Tokenizers: the built-in byte-level one, and any HuggingFace `tokenizers` JSON file.

A tokenizer is described by a small JSON-able spec ({"kind": "byte"} or {"kind": "hf", "file": ...})
stored beside prepared data and inside checkpoints, so `plait generate` decodes with exactly the
tokenizer the model was trained with.

Also here: encoding many documents in worker processes (`DocumentEncoder`), and training a
byte-level BPE (`train_bpe`, for `plait data tokenizer`).
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from plait.errors import UserError, bad_value

TOKENIZER_FILE = "tokenizer.json"
# Names of the end-of-document token in common tokenizer.json files, most specific first:
# GPT-2/Qwen/Phi and plait's own BPE, Llama 3 (base), Llama 2/Mistral/T5, Gemma. Chat-turn ends
# such as Llama 3's <|eot_id|> are left out on purpose: they end a turn, not a document.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
BPE_EOS = "<|endoftext|>"
# ... and of the start-of-document token (plait's data has none; an export names it for HF's generate)
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, nothing to download, every text representable.

    It has no end-of-document token (eos_id = None): all 256 ids are bytes, and a 257th id would
    change the vocabulary of every byte-level model and checkpoint. Prepared data records document
    boundaries in side files instead (see plait.prepare).
    """

    vocab_size = 256
    spec = {"kind": "byte"}
    eos_id = None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A HuggingFace `tokenizers` JSON file (BPE, unigram, ...)."""

    def __init__(self, path: str | Path, field: tuple[str, str] | None = None):
        """`field`: (name, value) an unreadable file is blamed on (default --tokenizer and `path`):
        a prepared folder's tokenizer.json is one the user named by the folder."""
        name, shown = field or ("--tokenizer", str(path))
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError(f"{name} needs the `tokenizers` package: pip install tokenizers") from None
        self.path = Path(path)
        try:
            self._tok = Tokenizer.from_file(str(self.path))
        except Exception as e:  # the library raises a plain Exception on bad JSON
            what = "" if field is None else f"its {self.path.name} is "
            raise bad_value(name, shown, f"{what}not a readable tokenizers JSON file ({e})") from None
        # ids, not a count: a file may leave gaps (an added token placed at id 1500 of 1000 tokens),
        # and the model needs a row for the largest id
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
        self.spec = {"kind": "hf", "file": TOKENIZER_FILE}
        self.eos_id = next((i for i in map(self._tok.token_to_id, EOS_NAMES) if i is not None), None)
        self.bos_id = next((i for i in map(self._tok.token_to_id, BOS_NAMES) if i is not None), None)

    def token(self, i: int | None) -> str | None:
        return None if i is None else self._tok.id_to_token(i)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def save_to(self, folder: Path) -> None:
        shutil.copyfile(self.path, Path(folder) / TOKENIZER_FILE)

    def __getstate__(self):  # worker processes rebuild it from the file rather than pickling Rust state
        return {"path": str(self.path)}

    def __setstate__(self, state):
        self.__init__(state["path"])


def from_path(path: str | None):
    """The tokenizer a user names on the command line (None = bytes)."""
    if not path:
        return ByteTokenizer()
    if not Path(path).is_file():
        raise bad_value("--tokenizer", path, "no such file; give a HuggingFace tokenizer.json")
    return HFTokenizer(path)


def from_spec(spec: dict, folder: str | Path, field: tuple[str, str] | None = None):
    """Rebuild the tokenizer a spec describes; HF files are looked up in `folder`; `field` as
    `HFTokenizer`'s."""
    if spec.get("kind") == "byte":
        return ByteTokenizer()
    if spec.get("kind") == "hf":
        return HFTokenizer(Path(folder) / spec.get("file", TOKENIZER_FILE), field)
    raise UserError(f"unknown tokenizer spec {spec!r} in {folder}: re-run `plait data prepare`")


def save_spec_files(tokenizer, folder: Path) -> None:
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.save_to(folder)


def document_end(tokenizer) -> str:
    """How a document's end is marked in the tokens: "eos" (the tokenizer's end-of-text id) or
    "newline" (a tokenizer without one: a newline is appended to the text, as plait always did for bytes).

    A tokenizer with neither (WordPiece / BERT: no end-of-text token, and its normalizer turns a
    newline into a space it then drops) would lay documents end to end with nothing between them,
    while meta.json said "newline": refused, before anything is read or written.
    """
    if getattr(tokenizer, "eos_id", None) is not None:
        return "eos"
    if np.array_equal(tokenizer.encode("x\n"), tokenizer.encode("x")):
        raise bad_value("--tokenizer", str(getattr(tokenizer, "path", tokenizer)), "has no end-of-text token "
                        f"({', '.join(EOS_NAMES)}) and drops newlines, so nothing would mark where a document ends; "
                        "use a tokenizer with an end-of-text token or one that keeps newlines (e.g. `plait data "
                        "tokenizer`'s byte-level BPE)")
    return "newline"


def encode_documents(tokenizer, texts: list[str], dtype) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of documents laid end to end, and each document's length.

    Each document ends with the tokenizer's EOS id; a tokenizer without one (bytes) ends it with a
    newline, as plait always has, so old and new byte-level shards hold the same tokens. The ids
    are written once, in `dtype`: one text file is one document, and int64 copies of it (per
    document, then concatenated) took 16 bytes per token, where the shard takes 2 or 4.
    """
    eos = getattr(tokenizer, "eos_id", None)
    encode = _compact_encode(tokenizer)
    if eos is not None:
        parts, end = [encode(t) for t in texts], [eos]
    elif type(tokenizer).encode is ByteTokenizer.encode:  # t + "\n" is t's bytes then byte 10: no copy of t
        parts, end = [encode(t) for t in texts], [ord("\n")]
    else:
        parts, end = [encode(t + "\n") for t in texts], []
    lengths = np.array([len(p) + len(end) for p in parts], dtype=np.int64)
    ids = np.empty(int(lengths.sum()), dtype=dtype)
    pos = 0
    for i in range(len(parts)):
        part, parts[i] = parts[i], None  # each document's own ids go as soon as they are copied
        ids[pos:pos + len(part)] = part
        ids[pos + len(part):pos + lengths[i]] = end
        pos += lengths[i]
    return ids, lengths


def _compact_encode(tokenizer):
    """`tokenizer.encode` without its int64 array, where it is plait's own: bytes are their ids
    (uint8), and `tokenizers` gives a list. Another class's encode (a subclass's) is used as it is."""
    if type(tokenizer).encode is ByteTokenizer.encode:
        return lambda text: np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    if type(tokenizer).encode is HFTokenizer.encode:
        return lambda text: tokenizer._tok.encode(text, add_special_tokens=False).ids
    return tokenizer.encode


_worker_tokenizer = None


def _worker_init(tokenizer) -> None:
    global _worker_tokenizer
    # each worker is one core's worth of encoding; the library's own thread pool would oversubscribe
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = tokenizer


def _worker_encode(texts: list[str], dtype) -> tuple[np.ndarray, np.ndarray]:
    return encode_documents(_worker_tokenizer, texts, dtype)


class DocumentEncoder:
    """`encode_documents` over chunks of documents in `workers` processes, results in input order.

    Results come back in submission order whatever the number of workers, so the shards written
    from them are byte-identical for any `workers`. At most 2 chunks per worker are in flight, so a
    corpus larger than memory streams through.
    """

    def __init__(self, tokenizer, workers: int, dtype):
        self.tokenizer, self.workers, self.dtype = tokenizer, workers, dtype

    def map(self, chunks: Iterable[list[str]]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        if self.workers <= 1:
            for texts in chunks:
                yield encode_documents(self.tokenizer, texts, self.dtype)
            return
        # fork where there is one: workers inherit the tokenizer and need not re-import the caller's
        # main module (spawn would, and fails from a script without a __main__ guard). The parent
        # has run no encoding yet, so no tokenizer thread pool is copied half-way.
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        # an executor, not a Pool: a worker that dies raises BrokenProcessPool instead of hanging
        with ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context(method),
                                 initializer=_worker_init, initargs=(self.tokenizer,)) as pool:
            pending: collections.deque = collections.deque()
            for texts in chunks:
                pending.append(pool.submit(_worker_encode, texts, self.dtype))
                if len(pending) >= 2 * self.workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()


def train_bpe(texts: Iterable[str], vocab_size: int, out: str | Path, show_progress: bool = False) -> "HFTokenizer":
    """Train a byte-level BPE (GPT-2 style) with `tokenizers` and write its tokenizer.json.

    The 256 byte symbols are always in the vocabulary, so any text encodes without unknown tokens;
    `<|endoftext|>` is added as the end-of-document token that `plait data prepare` appends.
    """
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise UserError("plait data tokenizer needs the `tokenizers` package: pip install tokenizers") from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_EOS], show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    try:
        tok.save(str(out))
    except Exception as e:  # the library raises a plain Exception (a full disk)
        raise bad_value("--out", str(out), f"could not be written ({e}); free space there or choose another file") \
            from None
    return HFTokenizer(out)


# the parts of a tokenizers JSON file that decide which ids a text becomes (plait encodes without
# special tokens, so the post-processor, and the decoder, padding and truncation, do not count)
_ENCODING_PARTS = ("model", "added_tokens", "normalizer", "pre_tokenizer")


def same_tokenizer(tokenizer, data) -> bool:
    """Whether `data` (a prepared folder: its tokenizer spec and files) was tokenized by `tokenizer`:
    the same kind, and for a HuggingFace file the same encoding parts. Not the same bytes:
    transformers' `save_pretrained` rewrites a file it loaded (adds a post-processor, reorders keys)."""
    spec = data.tokenizer_spec
    if getattr(tokenizer, "spec", {}).get("kind") != spec.get("kind"):
        return False
    if spec.get("kind") != "hf":
        return True
    return encoding_identity(tokenizer.path) == encoding_identity(data.path / spec.get("file", TOKENIZER_FILE))


def encoding_identity(path) -> str:
    """A digest of what decides a tokenizers JSON file's ids (`_ENCODING_PARTS`), the same for a file
    transformers re-saved: merges written as "a b" (older files) or as ["a", "b"] (newer) are one."""
    import hashlib

    raw = Path(path).read_bytes()
    try:
        d = json.loads(raw)
        parts = {k: d.get(k) for k in _ENCODING_PARTS}
        model = parts["model"]
        if isinstance(model, dict) and isinstance(model.get("merges"), list):
            parts["model"] = dict(model, merges=[m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"]])
        raw = json.dumps(parts, sort_keys=True).encode()
    except (ValueError, AttributeError):  # not JSON we can read: only the same bytes are the same
        pass
    return hashlib.sha256(raw).hexdigest()


