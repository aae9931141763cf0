"""`plait data tokenizer` trains a byte-level BPE that `prepare --tokenizer` uses; any HF
tokenizer.json works with prepare (its EOS found by name, a large vocabulary stored as uint32)."""

import json

import numpy as np
import pytest

from plait.cli import main
from plait.data import TokenData
from plait.prepare import prepare
from plait.tokenizer import HFTokenizer

pytest.importorskip("tokenizers")

WORDS = ["plait", "shard", "token", "mesh", "rank", "batch", "loss", "layer", "über", "naïve", "日本"]


def _corpus(tmp_path):
    rng = np.random.default_rng(0)
    src = tmp_path / "c"
    src.mkdir()
    with open(src / "a.jsonl", "w") as f:
        for _ in range(200):
            f.write(json.dumps({"body": " ".join(rng.choice(WORDS, 12))}) + "\n")
    (src / "notes.txt").write_text("a plain text file: shard the mesh by rank\n" * 20)
    return src


def test_train_a_bpe_then_prepare_with_it(tmp_path, capsys):
    src = _corpus(tmp_path)
    tok_file = tmp_path / "tok.json"
    assert main(["data", "tokenizer", "--input", str(src), "--vocab", "320", "--out", str(tok_file),
                 "--text-field", "body"]) == 0
    err = capsys.readouterr().err
    assert "wrote" in err
    tok = HFTokenizer(tok_file)
    assert 256 < tok.vocab_size <= 320 and tok.eos_id is not None
    # a size the text cannot reach is said, not only printed as a number
    assert ("fewer than the 320 asked" in err) == (tok.vocab_size < 320)
    assert main(["data", "tokenizer", "--input", str(src), "--vocab", "70000", "--out", str(tmp_path / "big.json"),
                 "--text-field", "body"]) == 0
    assert "fewer than the 70000 asked: the text held no more pairs to merge" in capsys.readouterr().err
    # merges were learned from the corpus: its words take fewer tokens than bytes
    text = "shard the mesh by rank, über naïve 日本"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("shard token batch")) < len("shard token batch") // 2
    assert main(["data", "prepare", "--input", str(src), "--out", str(tmp_path / "d"), "--tokenizer", str(tok_file),
                 "--text-field", "body", "--workers", "2"]) == 0
    d = TokenData(tmp_path / "d")
    assert d.vocab_size == tok.vocab_size and d.meta["documents"]["eos_id"] == tok.eos_id
    ids = np.concatenate([np.asarray(s) for split in d.splits.values() for s in split.shards])
    assert (ids == tok.eos_id).sum() == d.meta["documents"]["count"] == 201
    assert d.tokenizer().decode(d.tokenizer().encode(text)) == text


def test_any_hf_tokenizer_json_works_llama3_shape(tmp_path):
    """A word-level tokenizer with Llama 3's vocabulary size and its end-of-text token: uint32 shards,
    `<|end_of_text|>` ends each document."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    vocab.update({f"w{i}": len(vocab) + i for i in range(128000 - len(vocab))})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path / "tokenizer.json")
    assert hf.vocab_size == 128003 and hf.eos_id == tok.token_to_id("<|end_of_text|>")
    src = tmp_path / "c"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.txt").write_text(" ".join(WORDS[i:i + 5]))
    out = prepare([str(src)], tmp_path / "d", hf, val_fraction=0.0, quiet=True)
    d = TokenData(out)
    assert d.meta["dtype"] == "uint32"
    ids = np.concatenate([np.asarray(s) for split in d.splits.values() for s in split.shards])
    assert list(ids[:6]) == [vocab[w] for w in WORDS[0:5]] + [hf.eos_id]


def test_a_tokenizer_without_an_eos_ends_documents_with_a_newline(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "\n": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("\n", "isolated")
    tok.save(str(tmp_path / "t.json"))
    hf = HFTokenizer(tmp_path / "t.json")
    assert hf.eos_id is None
    (tmp_path / "x.txt").write_text("a")
    d = TokenData(prepare([str(tmp_path / "x.txt")], tmp_path / "d", hf, quiet=True))
    assert d.meta["documents"]["end"] == "newline"


@pytest.mark.parametrize("args, needle", [
    (["--vocab", "100"], "--vocab = 100: must be at least 257"),
    (["--out", "EXISTS"], "exists; choose another file name"),
])
def test_tokenizer_errors_are_one_line(tmp_path, capsys, args, needle):
    src = _corpus(tmp_path)
    (tmp_path / "EXISTS").write_text("{}")
    argv = ["data", "tokenizer", "--input", str(src), "--out", str(tmp_path / "new.json"), *args]
    argv = [str(tmp_path / a) if a == "EXISTS" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err


def test_a_lone_surrogate_in_jsonl_trains_and_is_said(tmp_path, capsys):
    """The tokenizers library refused the str json.loads gave for "\\ud83d" (a TypeError traceback)."""
    src = tmp_path / "j4.jsonl"
    src.write_text('{"text": "abc abc"}\n{"text": "\\ud83d abc"}\n')
    assert main(["data", "tokenizer", "--input", str(src), "--vocab", "300", "--out", str(tmp_path / "t.json")]) == 0
    err = capsys.readouterr().err
    assert "with U+FFFD in 1 JSONL document(s)" in err and "wrote" in err, err


def _wordpiece(path):
    """A BERT-style tokenizer.json: no end-of-text token, and its normalizer makes "\\n" a space that
    the pre-tokenizer drops (encode("\\n") == [])."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator([" ".join(WORDS[:8])] * 4 + ["shard the mesh by rank"],
                            trainers.WordPieceTrainer(vocab_size=120, special_tokens=["[UNK]", "[CLS]", "[SEP]"]))
    tok.save(str(path))
    hf = HFTokenizer(path)
    assert hf.eos_id is None and len(hf.encode("\n")) == 0
    return hf


def test_a_tokenizer_that_cannot_end_a_document_is_refused_in_one_line(tmp_path, capsys):
    """Prepare wrote meta "end": "newline" and laid the documents end to end with nothing between them."""
    _wordpiece(tmp_path / "wp.json")
    src = _corpus(tmp_path)
    argv = ["data", "prepare", "--input", str(src), "--out", str(tmp_path / "d"), "--tokenizer", str(tmp_path / "wp.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--tokenizer = '{tmp_path / 'wp.json'}': has no end-of-text token" in err, err
    assert "use a tokenizer with an end-of-text token or one that keeps newlines" in err
    assert not (tmp_path / "d").exists() and not list(tmp_path.glob(".tmp-*"))


def test_generate_with_an_empty_prompt_and_a_tokenizer_without_eos_or_newline(tmp_path, capsys, monkeypatch):
    """document_start took tokenizer.encode("\\n")[-1]: an IndexError for WordPiece. A BOS starts the
    document where the tokenizer has one; else the empty prompt is refused in one line."""
    import json as json_

    from plait import train as train_mod
    from plait.commands.generate import document_start
    from plait.config import build_config
    from plait.model import build_model

    hf = _wordpiece(tmp_path / "wp.json")
    cfg = build_config({"model": {"preset": "custom", "vocab_size": 128, "dim": 16, "n_layers": 1, "n_heads": 2,
                                  "n_kv_heads": 2, "ffn_dim": 32, "max_seq_len": 16}})
    model = build_model(cfg.model, 0, "cpu").eval()
    monkeypatch.setattr(train_mod, "model_from_checkpoint", lambda path, device: (model, hf, cfg, tmp_path))
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prompt = '': gives no tokens" in err and "give a prompt" in err, err
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "rank", "--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    # the same tokenizer with a BOS token: the empty prompt starts from it
    spec = json_.loads((tmp_path / "wp.json").read_text())
    spec["added_tokens"].append({"id": hf.vocab_size, "content": "<s>", "single_word": False, "lstrip": False, "rstrip": False,
                                 "normalized": False, "special": True})
    (tmp_path / "bos.json").write_text(json_.dumps(spec))
    bos = HFTokenizer(tmp_path / "bos.json")
    assert bos.bos_id is not None and document_start(bos) == bos.bos_id
    monkeypatch.setattr(train_mod, "model_from_checkpoint", lambda path, device: (model, bos, cfg, tmp_path))
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "", "--max-new-tokens", "2"]) == 0


@pytest.mark.parametrize("setup", ["empty file", "binary files", "empty rows"])
def test_input_without_text_is_refused_as_prepare_refuses_it(tmp_path, capsys, setup):
    """A tokenizer of the 256 bytes alone was written with rc 0, where `data prepare` refuses the input."""
    src = tmp_path / "c"
    src.mkdir()
    if setup == "empty file":
        src = src / "empty.txt"
        src.write_text("")
    elif setup == "binary files":
        (src / "a.txt").write_bytes(bytes(range(128, 256)) * 4)
        (src / "b.md").write_bytes(b"\xff\xfe" * 100)
    else:
        (src / "a.jsonl").write_text('{"text": ""}\n{"text": null}\n')
    out = tmp_path / "t.json"
    assert main(["data", "tokenizer", "--input", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--input = '{src}': holds no readable UTF-8 text to train on" in err, err
    assert ("--text-field" in err) == (setup == "empty rows")
    assert not out.exists()


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_an_out_that_cannot_be_written_is_one_line_before_training(tmp_path, capsys):
    """/proc/x.json was a traceback from the library's save, after training."""
    assert main(["data", "tokenizer", "--input", str(_corpus(tmp_path)), "--out", "/proc/x.json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out = '/proc/x.json': cannot be written (" in err, err
    assert "choose a writable folder" in err
