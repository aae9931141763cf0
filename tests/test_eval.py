"""`plait eval`: held-out loss and perplexity of a plait checkpoint or an HF folder on prepared
data, reproducing the run's own validation loss; one-line errors (exit 2)."""

import json
import math
import re

import pytest

from plait.cli import main
from plait.data import TokenData
from plait.prepare import prepare
from plait.tokenizer import ByteTokenizer, from_path
from plait.preflight import preflight
from plait.train import train
from conftest import micro_config


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "run"
    # two micro-batches a step: the validation set is eval_batches global batches of 2 x 4 sequences
    train(preflight(micro_config(corpus, out, train={"steps": 4, "eval_batches": 3, "grad_accum": 2})))
    return out


def _reported(err_or_out: str) -> tuple[float, float]:
    m = re.search(r"loss (\d+\.\d+), perplexity (\d+\.\d+)", err_or_out)
    return float(m.group(1)), float(m.group(2))


def test_eval_reproduces_the_runs_validation_loss(run, corpus, capsys):
    from plait.commands.eval import evaluate

    state = json.loads(next((run / "checkpoints").glob("step_*/train_state.json")).read_text())
    r = evaluate(str(run), TokenData(corpus))
    # same weights, same windows (the run's seed, micro-batch, sequence and eval batches), fp32
    assert r["loss"] == pytest.approx(state["val_loss"], rel=1e-6)
    assert r["perplexity"] == pytest.approx(math.exp(state["val_loss"]), rel=1e-6)
    assert r["tokens"] == 3 * 2 * 4 * 32
    assert main(["eval", "--checkpoint", str(run), "--data", str(corpus)]) == 0
    loss, ppl = _reported(capsys.readouterr().out)
    assert loss == pytest.approx(state["val_loss"], abs=1e-4) and ppl == pytest.approx(math.exp(loss), rel=1e-3)
    # without --data: the data the run trained on (its config's data.path), the same windows
    assert main(["eval", "--checkpoint", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"on {corpus} (validation)" in out and _reported(out) == (loss, ppl)
    assert out.rstrip().endswith("over 768 tokens (6 batches x 4 x 32)")
    other = evaluate(str(run), TokenData(corpus), batches=2, batch_size=2, seq_len=16)
    assert other["tokens"] == 2 * 2 * 16 and other["loss"] != r["loss"]
    # a batch larger than the validation set (3 x 8 sequences) still reads one batch
    assert evaluate(str(run), TokenData(corpus), batch_size=64)["batches"] == 1
    assert main(["eval", "--checkpoint", str(run), "--batches", "1", "--batch-size", "2", "--seq-len", "16"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("over 32 tokens (1 batch x 2 x 16)")  # not "1 batches"


def test_an_hf_export_evaluates_like_its_checkpoint(run, corpus, tmp_path, capsys):
    from plait.commands.eval import evaluate

    assert main(["hf", "export", "--checkpoint", str(run), "--out", str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    assert main(["eval", "--checkpoint", str(tmp_path / "hf"), "--data", str(corpus), "--batches", "3",
                 "--batch-size", "4", "--seq-len", "32"]) == 0
    assert "loss" in capsys.readouterr().out
    # the HF folder carries no run config: its defaults give seed 0, the micro run's seed too, so
    # with the run's batch shape both read the same windows with the same fp32 weights
    hf = evaluate(str(tmp_path / "hf"), TokenData(corpus), batches=3, batch_size=4, seq_len=32)
    # an HF folder records no training data: --data is needed, and the error says so
    assert main(["eval", "--checkpoint", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "records no training data; give --data DIR" in err
    assert hf["loss"] == pytest.approx(evaluate(str(run), TokenData(corpus), batches=3, batch_size=4)["loss"], rel=1e-5)


@pytest.mark.parametrize("case, needle", [
    ("missing_data", "--data = '{p}/nope': holds no prepared data"),
    ("missing_ckpt", "--checkpoint = '{p}/nope': no such checkpoint"),
    ("wide_vocab", "has vocabulary 300, larger than the model's 256"),
    ("other_tokenizer", "was prepared with another tokenizer than the checkpoint's"),
    ("long", "--seq-len = 70: exceeds the model's max_seq_len 64"),
    ("negative", "--batches = -1: must be a positive integer"),
    ("zero", "--batch-size = 0: must be a positive integer (leave it out for the run's value)"),  # was the default
    ("no_val", "has no validation split (prepared with --val-fraction 0)"),
    # a device torch does not know, or one plait does not run on, was a traceback from deep in torch
    ("unknown_device", "--device = 'foo': is not a device; use cpu, cuda or cuda:N"),
    ("mps", "--device = 'mps': is not supported; use cpu, cuda or cuda:N"),
])
def test_eval_errors_are_one_line(run, corpus, tmp_path, capsys, case, needle):
    data, ckpt, extra = str(corpus), str(run), []
    if case == "missing_data":
        data = str(tmp_path / "nope")
    elif case == "missing_ckpt":
        ckpt = str(tmp_path / "nope")
    elif case in ("wide_vocab", "other_tokenizer"):
        pytest.importorskip("tokenizers")
        from tokenizers import Tokenizer, models, pre_tokenizers

        # a word-level tokenizer: 300 words is wider than the byte model, 200 fits it but is not bytes;
        # its whitespace pre-tokenizer drops newlines, so </s> ends its documents (prepare refuses it without)
        words = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(298 if case == "wide_vocab" else 198)}}
        tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(tmp_path / "tok.json"))
        (tmp_path / "t.txt").write_text(" ".join(f"w{i % 150}" for i in range(2000)))
        data = str(prepare([str(tmp_path / "t.txt")], tmp_path / "d", from_path(str(tmp_path / "tok.json")), quiet=True))
    elif case == "long":
        extra = ["--seq-len", "70"]
    elif case == "negative":
        extra = ["--batches", "-1"]
    elif case == "zero":
        extra = ["--batch-size", "0"]
    elif case in ("unknown_device", "mps"):
        extra = ["--device", {"unknown_device": "foo"}.get(case, case)]
    elif case == "no_val":
        (tmp_path / "x.txt").write_text("def f(x):\n    return x\n" * 40)
        data = str(prepare([str(tmp_path / "x.txt")], tmp_path / "d", ByteTokenizer(), val_fraction=0.0, quiet=True))
    assert main(["eval", "--checkpoint", ckpt, "--data", data, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and needle.format(p=tmp_path) in err


def test_byte_data_for_a_byte_model_needs_no_tokenizer_file(run, tmp_path):
    from plait.commands.eval import evaluate

    (tmp_path / "x.txt").write_text("def f(x):\n    return x\n" * 40)
    d = TokenData(prepare([str(tmp_path / "x.txt")], tmp_path / "d", ByteTokenizer(), val_fraction=0.3, quiet=True))
    r = evaluate(str(run), d, batches=2, batch_size=2, seq_len=16)
    assert 0 < r["loss"] < math.log(256) + 1


def test_eval_reproduces_a_document_masked_runs_validation_loss(tmp_path):
    """A run trained with data.document_mask validates with each token attending within its
    document; eval read the windows without their boundaries and reported another loss."""
    from plait.commands.eval import evaluate

    docs = [f"def f{i}(x):\n    return x * {i} + {i % 7}" for i in range(300)]  # short: windows cross documents
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    data = prepare([str(tmp_path / "d.jsonl")], tmp_path / "data", ByteTokenizer(), val_fraction=0.2, quiet=True)
    out = tmp_path / "run"
    cfg = micro_config(data, out, train={"steps": 2})
    cfg.data.document_mask = True
    train(preflight(cfg))
    state = json.loads(next((out / "checkpoints").glob("step_*/train_state.json")).read_text())
    assert evaluate(str(out), TokenData(data))["loss"] == pytest.approx(state["val_loss"], rel=1e-6)


def test_a_damaged_newer_checkpoint_is_skipped_and_said_once(run, corpus, tmp_path, capsys):
    """eval resolved the checkpoint twice: each skipped one was said twice and hashed twice."""
    import shutil

    r = tmp_path / "run"
    shutil.copytree(run, r)
    newest = sorted((r / "checkpoints").glob("step_*"))[-1]
    bad = newest.with_name("step_00000099")
    shutil.copytree(newest, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**manifest, "step": 99}))  # a newer save, not a renamed one
    f = bad / "model.pt"
    f.write_bytes(bytes(len(f.read_bytes())))  # altered, same size
    assert main(["eval", "--checkpoint", str(r), "--data", str(corpus)]) == 0
    err = capsys.readouterr().err
    assert err.count("skipped") == 1 and "step_00000099 skipped: model.pt checksum mismatch" in err, err
