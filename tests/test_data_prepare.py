"""`plait data prepare` on real-data inputs: JSONL, Parquet, datasets folders, parallel workers,
document boundaries (EOS and side files), old folders, progress and one-line errors."""

import json
import re

import numpy as np
import pytest

from plait import prepare as data_mod
from plait.cli import main
from plait.data import TokenData
from plait.prepare import prepare
from plait.errors import UserError
from plait.tokenizer import ByteTokenizer, train_bpe

# no newlines inside a document: with the byte tokenizer a newline then marks exactly a document end
DOCS = [f"doc {i}: " + "lorem ipsum dolor " * (i % 5 + 1) + "x" * (i % 3) for i in range(60)]


def _jsonl(path, docs, field="text", extra_rows=()):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in extra_rows:
            f.write(row + "\n")
        for d in docs:
            f.write(json.dumps({field: d, "id": 7}) + "\n")
    return path


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _tokens(d: TokenData, split: str) -> np.ndarray:
    return np.concatenate([np.asarray(s) for s in d.splits[split].shards])


def _documents(d: TokenData, split: str) -> list[np.ndarray]:
    """Split a prepared split at its recorded document starts (one shard each here)."""
    ids = _tokens(d, split)
    starts = np.concatenate([np.asarray(s) for s in d.splits[split].doc_starts])
    return np.split(ids, starts[starts > 0])


def test_jsonl_parquet_and_datasets_folder_give_the_same_documents_and_shards(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    # hold-out keys name a record by (file stem, folder, row): same names, same split
    # blank lines, an empty text and a null text are not documents
    jl = _jsonl(tmp_path / "j" / "c" / "a.jsonl", DOCS, extra_rows=["", '{"text": ""}', '{"text": null}'])
    (tmp_path / "p" / "c").mkdir(parents=True)
    pq.write_table(pa.table({"text": ["", None] + DOCS}), tmp_path / "p" / "c" / "a.parquet")
    datasets.Dataset.from_dict({"text": ["", None] + DOCS}).save_to_disk(str(tmp_path / "h" / "c" / "a"))
    outs = {}
    for name, src in (("jsonl", jl), ("parquet", tmp_path / "p" / "c" / "a.parquet"), ("hf", tmp_path / "h" / "c" / "a")):
        outs[name] = prepare([str(src)], tmp_path / f"out_{name}", ByteTokenizer(), val_fraction=0.2, quiet=True)
    d = TokenData(outs["jsonl"])
    assert d.meta["documents"]["count"] == len(DOCS)
    assert 0 < d.meta["splits"]["val"][0]["documents"] < len(DOCS) // 2  # held out by row
    # every recorded document is one input document plus its newline end, in input order
    got = [bytes(doc.astype(np.uint8)).decode() for split in ("train", "val") for doc in _documents(d, split)]
    assert sorted(got) == sorted(t + "\n" for t in DOCS)
    train_docs = [bytes(doc.astype(np.uint8)).decode() for doc in _documents(d, "train")]
    assert train_docs == [t + "\n" for t in DOCS if t + "\n" in train_docs]
    bins = {k: {n: b for n, b in _files(v).items() if n.endswith(".bin")} for k, v in outs.items()}
    assert bins["jsonl"] == bins["parquet"] == bins["hf"]


def test_shards_are_byte_identical_whatever_the_number_of_workers(tmp_path, monkeypatch):
    src = tmp_path / "src"
    for i in range(12):
        (src / "txt").mkdir(parents=True, exist_ok=True)
        (src / "txt" / f"f{i:02d}.txt").write_text(f"file {i} " * (10 + i))
    _jsonl(src / "rows.jsonl", DOCS * 3)
    # small chunks: many in flight at once, so a worker finishing early would reorder the shards
    monkeypatch.setattr(data_mod, "_CHUNK_DOCS", 3)
    one = prepare([str(src)], tmp_path / "w1", ByteTokenizer(), val_fraction=0.1, quiet=True, workers=1)
    three = prepare([str(src)], tmp_path / "w3", ByteTokenizer(), val_fraction=0.1, quiet=True, workers=3)
    assert _files(one) == _files(three)
    assert len(_files(one)) == 5  # meta.json, train/val tokens, train/val document starts


def test_documents_end_with_the_tokenizers_eos(tmp_path):
    pytest.importorskip("tokenizers")
    tok = train_bpe(DOCS, 300, tmp_path / "tok.json")
    assert tok.eos_id is not None
    out = prepare([str(_jsonl(tmp_path / "c" / "a.jsonl", DOCS))], tmp_path / "d", tok, val_fraction=0.2, quiet=True)
    d = TokenData(out)
    assert d.meta["documents"] == {"count": len(DOCS), "end": "eos", "eos_id": tok.eos_id}
    for split in ("train", "val"):
        docs = _documents(d, split)
        assert all(doc[-1] == tok.eos_id and (doc[:-1] != tok.eos_id).all() for doc in docs)
        assert all(tok.decode(doc[:-1]) in DOCS for doc in docs)


def test_batch_documents_follow_the_boundaries(tmp_path):
    out = prepare([str(_jsonl(tmp_path / "c" / "a.jsonl", DOCS))], tmp_path / "d", ByteTokenizer(),
                  val_fraction=0.1, quiet=True)
    d = TokenData(out)
    assert d.has_documents
    kw = dict(micro_batch=6, grad_accum=2, dp_rank=1, dp_size=2, seq_len=96, seed=3)
    x, _ = d.batch(4, 1, **kw)
    ids = d.batch_documents(4, 1, **kw)
    assert ids.shape == x.shape and (ids[:, 0] == 0).all()
    # a new document begins right after each newline (the byte tokenizer's document end), nowhere else
    new_doc = ids[:, 1:] != ids[:, :-1]
    assert (new_doc == (x[:, :-1] == ord("\n"))).all()
    assert (ids[:, 1:] - ids[:, :-1]).max() == 1 and new_doc.any()


def test_documents_that_cross_a_shard_end_continue_in_the_next_shard(tmp_path, monkeypatch):
    monkeypatch.setattr(data_mod, "SHARD_TOKENS", 250)  # documents of 30-100 tokens: many cross
    out = prepare([str(_jsonl(tmp_path / "c" / "a.jsonl", DOCS))], tmp_path / "d", ByteTokenizer(),
                  val_fraction=0.0, quiet=True)
    d = TokenData(out)
    split = d.splits["train"]
    assert len(split.shards) > 5
    bases = np.cumsum([0] + [len(s) for s in split.shards[:-1]])
    starts = np.concatenate([np.asarray(st) + b for st, b in zip(split.doc_starts, bases)])
    docs = [bytes(doc.astype(np.uint8)).decode() for doc in np.split(_tokens(d, "train"), starts[1:])]
    assert docs[:-1] == [t + "\n" for t in DOCS[:len(docs) - 1]]


def test_single_stream_tail_split_keeps_document_boundaries(tmp_path, monkeypatch):
    # when no row hashes into validation (forced here; a few rows may all miss), the tail of the
    # stream becomes the validation split
    monkeypatch.setattr(data_mod, "_is_val", lambda key, fraction: False)
    out = prepare([str(_jsonl(tmp_path / "c" / "a.jsonl", DOCS))], tmp_path / "d", ByteTokenizer(),
                  val_fraction=0.01, quiet=True)
    d = TokenData(out)
    train, val = _documents(d, "train"), _documents(d, "val")
    text = lambda doc: bytes(doc.astype(np.uint8)).decode()  # noqa: E731
    whole = [t + "\n" for t in DOCS]
    assert "".join(map(text, train + val)) == "".join(whole)
    # the document cut by the split has its head in train and its tail (no start) in val
    assert len(d.splits["val"].doc_starts[0]) == 0  # 1% of the tokens: within the last document
    assert [text(doc) for doc in train[:-1] + val[1:]] == whole[:len(train) - 1] + whole[len(train):]
    assert text(train[-1]) + text(val[0]) == whole[len(train) - 1]



@pytest.mark.parametrize("block", [7, 250, 1 << 20])
def test_the_tail_split_streamed_in_blocks_writes_what_one_pass_writes(tmp_path, monkeypatch, block):
    """The tail split reads the shards a block at a time: blocks that cut documents and shard ends
    (shards of 250 tokens, blocks of 7) give the bytes of reading every token at once."""
    monkeypatch.setattr(data_mod, "_is_val", lambda key, fraction: False)
    monkeypatch.setattr(data_mod, "SHARD_TOKENS", 250)
    src = str(_jsonl(tmp_path / "c" / "a.jsonl", DOCS))
    one = _files(prepare([src], tmp_path / "one", ByteTokenizer(), val_fraction=0.3, quiet=True))
    monkeypatch.setattr(data_mod, "_TAIL_BLOCK", block)
    streamed = prepare([src], tmp_path / "blocks", ByteTokenizer(), val_fraction=0.3, quiet=True)
    assert _files(streamed) == one and sum(n.startswith("val_") for n in one) > 2
    d = TokenData(streamed)
    assert d.splits["val"].tokens == int(sum(len(t) + 1 for t in DOCS) * 0.3)


def test_val_fraction_zero_holds_nothing_out(tmp_path, capsys):
    # it used to hold out the last 1% of the tokens anyway, cutting through a document
    src = _jsonl(tmp_path / "c" / "a.jsonl", DOCS)
    assert main(["data", "prepare", "--input", str(src), "--out", str(tmp_path / "d"), "--val-fraction", "0"]) == 0
    err = capsys.readouterr().err
    assert f"{sum(len(t) + 1 for t in DOCS):,} train / 0 val tokens" in err
    assert "no validation split (--val-fraction 0)" in err
    d = TokenData(tmp_path / "d")
    assert d.meta["splits"]["val"] == [] and not d.has_val
    assert [bytes(doc.astype(np.uint8)).decode() for doc in _documents(d, "train")] == [t + "\n" for t in DOCS]
    # training would evaluate on the empty split: refused up front, naming the folder and the fix
    with pytest.raises(UserError, match=r"data.path = .*: has no validation split \(prepared with --val-fraction 0\)"
                       r".*prepare it again with --val-fraction above 0"):
        d.check(256, 16)


def test_a_single_text_file_holds_out_its_tail_only_when_asked(tmp_path):
    # one text file is one document, which a hash cannot split: val_fraction > 0 takes the stream's tail
    (tmp_path / "one.txt").write_text("".join(f"line {i} of the only file\n" for i in range(200)))
    total = (tmp_path / "one.txt").stat().st_size + 1  # the document's end
    d = TokenData(prepare([str(tmp_path / "one.txt")], tmp_path / "a", ByteTokenizer(), val_fraction=0.05, quiet=True))
    assert len(_tokens(d, "val")) == int(total * 0.05) and len(_tokens(d, "train")) == total - int(total * 0.05)
    d.check(256, 16)
    d = TokenData(prepare([str(tmp_path / "one.txt")], tmp_path / "b", ByteTokenizer(), val_fraction=0.0, quiet=True))
    assert len(_tokens(d, "train")) == total and not d.has_val


def test_the_default_corpus_refuses_val_fraction_zero(tmp_path):
    with pytest.raises(UserError, match=r"data.val_fraction = 0.0: leaves the default corpus no validation split"):
        data_mod.default_corpus_dir(str(tmp_path / "cache"), 0.0)
    assert not (tmp_path / "cache").exists()  # refused before any preparing


def test_an_unusable_cache_dir_is_named_as_data_cache_dir(tmp_path):
    """The default corpus's folder was reported as `--out = '<cache>/stdlib-...'`: the user's --out was
    fine, the folder they named was data.cache_dir."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match=r"data.cache_dir = '.*afile': is a file; give a folder"):
        data_mod.default_corpus_dir(str(tmp_path / "afile"), 0.01)
    blocked = tmp_path / "blocked"
    blocked.write_text("x")  # a file where the cache's parent folder should be
    with pytest.raises(UserError, match=r"data.cache_dir = '.*blocked/cache': cannot write there"):
        data_mod.default_corpus_dir(str(blocked / "cache"), 0.01)

def test_a_folder_prepared_before_document_files_still_loads(tmp_path):
    folder = tmp_path / "old"
    folder.mkdir()
    ids = np.frombuffer(("hello world\n" * 50).encode(), dtype=np.uint8).astype(np.uint16)
    ids[:500].tofile(folder / "train_000.bin")
    ids[500:].tofile(folder / "val_000.bin")
    (folder / "meta.json").write_text(json.dumps({
        "format": 1, "vocab_size": 256, "dtype": "uint16", "tokenizer": {"kind": "byte"},
        "splits": {"train": [{"file": "train_000.bin", "tokens": 500}],
                   "val": [{"file": "val_000.bin", "tokens": 100}]}, "files_used": 1, "files_skipped": 0}))
    d = TokenData(folder)
    kw = dict(micro_batch=2, grad_accum=1, dp_rank=0, dp_size=1, seq_len=16, seed=0)
    x, y = d.batch(0, 0, **kw)
    assert x.shape == (2, 16) and not d.has_documents
    assert (d.batch_documents(0, 0, **kw) == 0).all()  # no boundaries known: one document per window
    assert len(list(d.val_batches(2, micro_batch=2, dp_rank=0, dp_size=1, seq_len=16, seed=0))) == 2


def test_progress_bar_and_summary(tmp_path, capsys):
    src = _jsonl(tmp_path / "c" / "a.jsonl", DOCS)
    assert main(["data", "prepare", "--input", str(src), "--out", str(tmp_path / "d"), "--workers", "2"]) == 0
    err = capsys.readouterr().err
    assert "tokenizing [" in err and "100%" in err
    total = sum(len(t) + 1 for t in DOCS)
    assert f"prepared {tmp_path / 'd'}: {len(DOCS)} documents" in err
    assert f"{total:,} tokens" in err.split("tokenizing")[-1] and "tokens/s on 2 worker(s)" in err


@pytest.mark.parametrize("setup, args, needle", [
    ("jsonl", ["--text-field", "body"], "--text-field = 'body': is not a field of .*fields: text, id"),
    ("badline", [], r"a.jsonl:2': is not a JSON object"),
    ("number", [], "--text-field = 'text': holds a number, not text"),  # once "holds a int"
    ("object", [], "--text-field = 'text': holds an object, not text"),
    # a JSON line that is not an object once blamed --text-field for a row with no fields at all
    ("array", [], r"a.jsonl:2': is not a JSON object; fix or remove that line"),
    # a Latin-1 line was "not a JSON object" too
    ("latin1", [], r"a.jsonl:2': is not UTF-8 \(byte 0xe9 at column 14\); re-encode the file as UTF-8"),
    ("jsonl", ["--workers", "0"], "--workers = 0: must be 1 or more"),
    ("nothing", [], "holds no text files"),
])
def test_prepare_errors_are_one_line(tmp_path, capsys, setup, args, needle):
    src = tmp_path / "c"
    src.mkdir()
    if setup == "jsonl":
        _jsonl(src / "a.jsonl", DOCS[:3])
    elif setup == "badline":
        (src / "a.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    elif setup == "number":
        (src / "a.jsonl").write_text('{"text": 3}\n')
    elif setup == "object":
        (src / "a.jsonl").write_text('{"text": {"body": "x"}}\n')
    elif setup == "array":
        (src / "a.jsonl").write_text('{"text": "fine"}\n["not", "a", "row"]\n')
    elif setup == "latin1":
        (src / "a.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    elif setup == "nothing":
        (src / "image.png").write_bytes(b"\x89PNG")
    assert main(["data", "prepare", "--input", str(src), "--out", str(tmp_path / "d"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert re.search(needle, err), err
    assert not (tmp_path / "d").exists() and not list(tmp_path.glob(".tmp-*"))  # nothing half-written


def test_an_out_that_is_a_file_is_one_line(tmp_path, capsys):
    """--out naming an existing file was a NotADirectoryError traceback."""
    src = tmp_path / "c"
    src.mkdir()
    _jsonl(src / "a.jsonl", DOCS[:3])
    (tmp_path / "taken").write_text("keep me")
    assert main(["data", "prepare", "--input", str(src), "--out", str(tmp_path / "taken")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out = '{tmp_path / 'taken'}': is a file; give a new folder" in err, err
    assert (tmp_path / "taken").read_text() == "keep me"


def test_a_datasets_folder_without_the_library_is_one_line(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "state.json").write_text("{}")
    (folder / "dataset_info.json").write_text("{}")
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # import datasets -> ImportError
    assert main(["data", "prepare", "--input", str(folder), "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a HuggingFace datasets folder" in err and "pip install datasets" in err


@pytest.mark.parametrize("cut", ["tokens", "documents"])
def test_a_shard_cut_short_is_refused_in_one_line(tmp_path, cut):
    """A shard shorter than meta.json records (a full disk, a partial copy) trained on part of the
    data without a word, its document starts pointing past its end; now the folder is refused."""
    src = _jsonl(tmp_path / "c" / "a.jsonl", DOCS)
    out = tmp_path / "d"
    prepare([str(src)], out, ByteTokenizer(), val_fraction=0.2, quiet=True)
    shard = json.loads((out / "meta.json").read_text())["splits"]["train"][0]
    name = shard["file"] if cut == "tokens" else shard["docs_file"]
    data = (out / name).read_bytes()
    (out / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=rf"data.path = .*: has a damaged meta.json or shard \({re.escape(name)} holds "
                       rf"[\d,]+ {cut} where meta.json records [\d,]+\); prepare it again"):
        TokenData(out)


def test_prepare_says_when_validation_is_the_streams_tail(tmp_path, capsys):
    """Whole documents are held out where a hash picks some; where it picks none the split cuts the
    stream's tail, through a document, and the command says so (it said nothing)."""
    (tmp_path / "one.txt").write_text("".join(f"line {i} of the only file\n" for i in range(200)))
    assert main(["data", "prepare", "--input", str(tmp_path / "one.txt"), "--out", str(tmp_path / "a")]) == 0
    assert "validation: the last 50 tokens of the stream, cutting through a document" in capsys.readouterr().err  # 1%
    src = _jsonl(tmp_path / "c" / "a.jsonl", DOCS)
    assert main(["data", "prepare", "--input", str(src), "--out", str(tmp_path / "b"), "--val-fraction", "0.2"]) == 0
    assert "validation: the last" not in capsys.readouterr().err


def test_prepare_names_the_files_it_skips(tmp_path, capsys):
    """A text file with one byte that is not UTF-8 is left out whole; the summary named no file."""
    (tmp_path / "good.txt").write_text("fine text\n" * 20)
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 au lait\n")
    assert main(["data", "prepare", "--input", str(tmp_path / "good.txt"), str(tmp_path / "latin1.txt"),
                 "--out", str(tmp_path / "d")]) == 0
    assert f"skipped 1 file(s) that are not UTF-8 text: {tmp_path / 'latin1.txt'}" in capsys.readouterr().err


def test_a_file_named_twice_is_read_once(tmp_path, capsys):
    """`--input txt txt` (or a folder and a file in it) doubled the corpus: the tail held out for
    validation was then in the train split too."""
    src = tmp_path / "txt"
    src.mkdir()
    (src / "a.txt").write_text("alpha " * 50)
    (src / "b.txt").write_text("beta " * 50)
    assert main(["data", "prepare", "--input", str(src), str(src / "a.txt"), str(src), "--out",
                 str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert f"read once: 3 file(s) the inputs name more than once: {src / 'a.txt'}" in err, err
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert meta["files_used"] == 2 and meta["documents"]["count"] == 2


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    import errno

    def full(self, ids, starts):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(data_mod._ShardWriter, "write", full)
    src = tmp_path / "txt"
    src.mkdir()
    (src / "a.txt").write_text("alpha " * 50)
    assert main(["data", "prepare", "--input", str(src), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out = '{tmp_path / 'o'}': could not be written (No space left on device)" \
        in err, err
    assert not [p for p in tmp_path.iterdir() if p.name not in ("txt",)]  # no partial folder left


def test_null_texts_are_empty_rows_not_unreadable_files(tmp_path, capsys):
    """A JSONL row whose text is null was counted as a skipped non-UTF-8 file, once per row."""
    path = _jsonl(tmp_path / "in" / "rows.jsonl", DOCS[:20], extra_rows=['{"text": null}'] * 3)
    assert main(["data", "prepare", "--input", str(path), "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert "not UTF-8" not in err and "from 1 file(s) (0 skipped; 3 empty document(s) left out)" in err, err
    assert json.loads((tmp_path / "o" / "meta.json").read_text())["documents"]["count"] == 20


def test_a_byte_order_mark_is_not_text(tmp_path):
    """Files saved as UTF-8 with a byte-order mark (Windows Notepad's default): a JSONL file's first
    record was refused as "not a JSON object", and a text file's mark became three tokens."""
    plain, marked = tmp_path / "plain", tmp_path / "marked"
    for folder, bom in ((plain, b""), (marked, b"\xef\xbb\xbf")):
        folder.mkdir()
        (folder / "a.txt").write_bytes(bom + "\n".join(DOCS[:30]).encode())
        (folder / "b.jsonl").write_bytes(bom + _jsonl(tmp_path / f"{folder.name}.jsonl", DOCS[30:]).read_bytes())
    for folder in (plain, marked):
        prepare([str(folder / "a.txt"), str(folder / "b.jsonl")], folder / "out", ByteTokenizer(), quiet=True)
    assert _files(marked / "out") == _files(plain / "out")


def test_a_text_field_for_text_files_is_one_line(tmp_path, capsys):
    """--text-field with nothing but text files was ignored without a word."""
    (tmp_path / "a.txt").write_text("\n".join(DOCS))
    assert main(["data", "prepare", "--input", str(tmp_path / "a.txt"), "--text-field", "body",
                 "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == (
        "plait data: error: --text-field = 'body': names a field of JSONL, Parquet or datasets rows, and every "
        "input is a text file (one document each): drop --text-field")
    assert not (tmp_path / "o").exists()


def test_ranks_preparing_the_default_corpus_at_once_prepare_it_once(tmp_path, monkeypatch):
    """Every rank of a torchrun or srun job prepares the default corpus on its first start: they raced
    to rename it into place, and the losers died ("Directory not empty"), leaving their temp folder."""
    import threading
    import time

    calls = []

    def slow_prepare(inputs, out, tokenizer, val_fraction=0.01, quiet=False, **kw):
        calls.append(out)
        time.sleep(0.3)  # both ranks are inside at once without the lock
        out.mkdir(parents=True)
        (out / data_mod.META).write_text("{}")
        return out

    monkeypatch.setattr(data_mod, "prepare", slow_prepare)
    got, errors = [], []

    def rank():
        try:
            got.append(data_mod.default_corpus_dir(str(tmp_path / "cache"), 0.01))
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    threads = [threading.Thread(target=rank) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(calls) == 1 and len(set(got)) == 1 and len(got) == 3


@pytest.mark.parametrize("workers", [1, 2])
def test_a_lone_surrogate_in_jsonl_becomes_u_fffd_and_is_said(tmp_path, capsys, workers):
    """json.loads accepts "\\ud83d" alone; encoding it to UTF-8 was a UnicodeEncodeError from a worker."""
    src = tmp_path / "j4.jsonl"
    # a lone high half, a lone low half, and a whole pair (an emoji: text, not a mistake)
    src.write_text('{"text": "abc"}\n{"text": "x\\ud83d"}\n{"text": "\\ude00y"}\n{"text": "ok \\ud83d\\ude00"}\n')
    assert main(["data", "prepare", "--input", str(src), "--out", str(tmp_path / "d"), "--workers", str(workers)]) == 0
    err = capsys.readouterr().err
    assert "with U+FFFD in 2 JSONL document(s)" in err, err
    d = TokenData(tmp_path / "d")
    text = bytes(np.concatenate([_tokens(d, "train"), _tokens(d, "val")]).astype(np.uint8)).decode()
    assert text == "abc\nx\ufffd\n\ufffdy\nok \U0001f600\n"


@pytest.mark.parametrize("damage", ["not parquet", "page"])
@pytest.mark.parametrize("command", ["prepare", "tokenizer"])
def test_a_damaged_parquet_file_is_one_line(tmp_path, capsys, damage, command):
    """pyarrow's ArrowInvalid (or OSError "Corrupt snappy compressed data") was a traceback."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    if command == "tokenizer":
        pytest.importorskip("tokenizers")
    f = tmp_path / "p.parquet"
    if damage == "not parquet":
        f.write_text("notparquet\n")
    else:  # footer intact, the data pages behind it overwritten
        pq.write_table(pa.table({"text": [f"hello world {i}" for i in range(5000)]}), f, compression="snappy")
        raw = bytearray(f.read_bytes())
        raw[200:2000] = b"\x55" * 1800
        f.write_bytes(bytes(raw))
    out = tmp_path / ("d" if command == "prepare" else "t.json")
    assert main(["data", command, "--input", str(f), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--input = '{f}': is not a readable Parquet file (" in err, err
    assert not out.exists()


def test_a_datasets_folder_inside_an_input_folder_is_read_as_a_dataset(tmp_path):
    """Its state.json and dataset_info.json were read as two text documents and its rows dropped."""
    datasets = pytest.importorskip("datasets")
    src = tmp_path / "c"
    (src / "notes").mkdir(parents=True)
    (src / "notes" / "a.txt").write_text("a text file beside the dataset")
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(src / "rows"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS[:5]})}).save_to_disk(str(src / "z" / "dd"))
    d = TokenData(prepare([str(src)], tmp_path / "d", ByteTokenizer(), val_fraction=0.2, quiet=True))
    assert d.meta["documents"]["count"] == 1 + len(DOCS) + 5 and d.meta["files_used"] == 3
    text = bytes(np.concatenate([_tokens(d, "train"), _tokens(d, "val")]).astype(np.uint8)).decode()
    assert "a text file beside" in text and DOCS[7] in text and "fingerprint" not in text and '"splits"' not in text


def test_a_prepared_folder_inside_an_input_folder_is_refused_in_one_line(tmp_path, capsys):
    """Its meta.json (and an HF tokenizer.json) were read as text documents to train on."""
    src = tmp_path / "c"
    src.mkdir()
    (src / "a.txt").write_text("some text " * 20)
    prepare([str(src / "a.txt")], src / "sub" / "prepared", ByteTokenizer(), val_fraction=0.2, quiet=True)
    assert main(["data", "prepare", "--input", str(src), "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--input = '{src}': holds {src / 'sub' / 'prepared'}, a folder made by" in err, err
    assert "move it out, or give the folders beside it as --input" in err
    assert main(["data", "prepare", "--input", str(src / "sub" / "prepared"), "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a folder made by `plait data prepare`" in err and "--data.path" in err, err
    assert not (tmp_path / "d").exists()


def test_upper_case_suffixes_are_read_as_their_kind(tmp_path):
    """In a folder A.JSONL and B.TXT were skipped; A.JSONL named directly was one text document of JSON."""
    src = tmp_path / "c"
    _jsonl(src / "A.JSONL", DOCS[:10])
    (src / "B.TXT").write_text("an upper-case text file")
    (src / "C.PNG").write_bytes(b"\x89PNG")  # still no text
    d = TokenData(prepare([str(src)], tmp_path / "d", ByteTokenizer(), val_fraction=0.2, quiet=True))
    assert d.meta["documents"]["count"] == 11 and d.meta["files_used"] == 2
    d = TokenData(prepare([str(src / "A.JSONL")], tmp_path / "d2", ByteTokenizer(), val_fraction=0.2, quiet=True))
    assert d.meta["documents"]["count"] == 10
    assert b'"text"' not in bytes(np.concatenate([_tokens(d, "train"), _tokens(d, "val")]).astype(np.uint8))


def test_one_large_text_file_takes_memory_in_proportion_to_its_shard(tmp_path):
    """One text file is one document: its int64 ids per document, their concatenation, the masked
    copy per split and the tail split's reload of every token took 26 times the file in memory."""
    import tracemalloc

    f = tmp_path / "big.txt"
    f.write_text("lorem ipsum dolor sit amet\n" * 160_000)  # 4.3 MB: 8.6 MB of uint16 shard
    size = f.stat().st_size
    tracemalloc.start()
    try:
        out = prepare([str(f)], tmp_path / "d", ByteTokenizer(), val_fraction=0.01, quiet=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the text (as str and as UTF-8) and its uint16 ids are what must be held: about 4x (it was 19x)
    assert peak < 6 * size, f"peak {peak / size:.1f} x the file"
    d = TokenData(out)
    assert d.splits["train"].tokens + d.splits["val"].tokens == size + 1


@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_an_empty_corpus_names_text_field_only_where_records_have_one(tmp_path, kind):
    """Empty text files were told to "check --text-field", which text files have none of."""
    src = tmp_path / "c"
    src.mkdir()
    if kind == "txt":
        (src / "empty.txt").write_text("  \n")
    else:
        (src / "a.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(UserError, match="all of them empty; the corpus has no text") as e:
        prepare([str(src)], tmp_path / "d", ByteTokenizer(), quiet=True)
    assert ("--text-field" in str(e.value)) == (kind == "jsonl")
