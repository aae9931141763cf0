"""Data: prepare -> shards + meta, held-out split, dtype by vocab, deterministic rank-sliced batches."""

import json

import numpy as np
import pytest
import torch

from plait.data import TokenData
from plait.prepare import prepare
from plait.errors import UserError
from plait.tokenizer import ByteTokenizer


def _corpus(tmp_path, n_files=40):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(n_files):
        (src / f"f{i:02d}.txt").write_text(f"file {i}: " + "hello world " * (20 + i))
    return src


def test_prepare_writes_shards_meta_and_holds_out_files(tmp_path):
    src = _corpus(tmp_path)
    out = prepare([str(src)], tmp_path / "d", ByteTokenizer(), val_fraction=0.2, quiet=True)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 256 and meta["files_used"] == 40
    train = np.fromfile(out / "train_000.bin", dtype=np.uint16).tobytes().replace(b"\x00", b"")
    val = np.fromfile(out / "val_000.bin", dtype=np.uint16)
    assert len(val) > 0
    total = sum(len(f.read_text()) + 1 for f in src.iterdir())
    assert meta["splits"]["train"][0]["tokens"] + meta["splits"]["val"][0]["tokens"] == total
    val_text = val.astype(np.uint8).tobytes().decode()
    # every held-out file is absent from training
    for line in val_text.strip().split("\n"):
        assert line.encode() not in train


def test_wide_vocab_uses_uint32(tmp_path):
    class Wide(ByteTokenizer):
        vocab_size = 70000
        spec = {"kind": "byte"}

        def encode(self, text):
            return super().encode(text) + 65500

    out = prepare([str(_corpus(tmp_path, 5))], tmp_path / "d", Wide(), quiet=True)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint32"
    assert np.fromfile(out / "train_000.bin", dtype=np.uint32).max() > 65535


def test_single_file_is_split_by_tail(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("abc " * 1000)
    out = prepare([str(f)], tmp_path / "d", ByteTokenizer(), val_fraction=0.1, quiet=True)
    d = TokenData(out)
    assert d.splits["val"].tokens == 400 and d.splits["train"].tokens == 3601


def test_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.decoder = decoders.ByteLevel()
    src = _corpus(tmp_path)
    tok.train([str(p) for p in src.iterdir()], trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tok.json"))
    from plait.tokenizer import from_path

    out = prepare([str(src)], tmp_path / "d", from_path(str(tmp_path / "tok.json")), quiet=True)
    d = TokenData(out)
    assert d.vocab_size == tok.get_vocab_size() and (out / "tokenizer.json").is_file()
    assert "hello world" in d.tokenizer().decode(d.tokenizer().encode("hello world"))


@pytest.mark.parametrize("setup, needle", [
    ("empty", "no readable UTF-8 text"),
    ("nofiles", "holds no text files"),
    ("missing", "no such file or folder"),
    ("exists", "already holds prepared data"),
])
def test_prepare_errors(tmp_path, setup, needle):
    src = tmp_path / "src"
    src.mkdir()
    out = tmp_path / "d"
    if setup == "empty":
        (src / "a.txt").write_bytes(b"\xff\xfe\x00bad")
    elif setup == "missing":
        src = tmp_path / "nope"
    elif setup == "exists":
        (src / "a.txt").write_text("x" * 100)
        prepare([str(src)], out, ByteTokenizer(), quiet=True)
    with pytest.raises(UserError, match=needle):
        prepare([str(src)], out, ByteTokenizer(), quiet=True)


def test_batches_are_deterministic_and_rank_slices_tile_the_global_batch(corpus):
    d = TokenData(corpus)
    kw = dict(seq_len=16, seed=5)
    single = [d.batch(3, m, micro_batch=4, grad_accum=2, dp_rank=0, dp_size=1, **kw) for m in range(2)]
    again = d.batch(3, 1, micro_batch=4, grad_accum=2, dp_rank=0, dp_size=1, **kw)
    assert torch.equal(single[1][0], again[0])
    x_single = torch.cat([x for x, _ in single])
    # 2 ranks x micro-batch 2 x 2 micro-steps: the same 8 windows, in the same order
    x_dp = torch.cat([d.batch(3, m, micro_batch=2, grad_accum=2, dp_rank=r, dp_size=2, **kw)[0]
                      for m in range(2) for r in range(2)])
    assert torch.equal(x_single, x_dp)
    x, y = single[0]
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    other_step = d.batch(4, 0, micro_batch=4, grad_accum=2, dp_rank=0, dp_size=1, **kw)[0]
    assert not torch.equal(other_step, single[0][0])


def test_missing_data_dir_error(tmp_path):
    with pytest.raises(UserError, match="data.path = .*meta.json missing.*plait data prepare"):
        TokenData(tmp_path)


@pytest.mark.parametrize("change, needle", [
    (lambda m: [1, 2], "it holds an array, not an object"),  # was AttributeError: 'list' has no 'get'
    (lambda m: dict(m, dtype="float99"), "dtype 'float99' is not a numpy type"),  # was TypeError
    (lambda m: dict(m, dtype="float32"), "dtype float32 is not an integer type"),
    (lambda m: dict(m, splits=[1]), "its splits are not lists of shards"),
    (lambda m: dict(m, splits={"train": [3]}), "its splits are not lists of shards"),
    (lambda m: dict(m, splits={"train": [{"file": "train_000.bin", "tokens": "many"}]}), "not supported"),
    (lambda m: dict(m, tokenizer="bytes"), "its tokenizer is a string, not a tokenizer spec"),
])
def test_a_damaged_meta_json_is_one_line(tmp_path, change, needle):
    out = prepare([str(_corpus(tmp_path, 5))], tmp_path / "d", ByteTokenizer(), val_fraction=0.2, quiet=True)
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps(change(meta)))
    with pytest.raises(UserError) as e:
        TokenData(out, field="--data")
    assert str(e.value).startswith(f"--data = '{out}': has a damaged meta.json or shard (")
    assert needle in str(e.value) and str(e.value).endswith("prepare it again")


def test_a_prepared_folder_missing_its_tokenizer_json_is_one_line_naming_the_folder(tmp_path, capsys):
    """eval met a FileNotFoundError; train blamed `--tokenizer = '.../tokenizer.json'`, never given."""
    pytest.importorskip("tokenizers")
    from plait.cli import main
    from plait.tokenizer import train_bpe

    src = _corpus(tmp_path, 5)
    tok = train_bpe((f.read_text() for f in sorted(src.iterdir())), 300, tmp_path / "tok.json")
    out = prepare([str(src)], tmp_path / "nt", tok, val_fraction=0.2, quiet=True)
    (out / "tokenizer.json").unlink()
    for argv, field in ((["eval", "--checkpoint", str(tmp_path / "run"), "--data", str(out)], "--data"),
                        (["train", "--data.path", str(out), "--out", str(tmp_path / "run")], "data.path")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert f"{field} = '{out}': is missing its tokenizer.json" in err and "prepare the folder again" in err, err
    # a tokenizer.json that is there but unreadable names the folder too, not a --tokenizer flag
    (out / "tokenizer.json").write_text("{broken")
    with pytest.raises(UserError, match=rf"^data.path = '{out}': its tokenizer.json is not a readable"):
        TokenData(out).tokenizer()
