"""A damaged HuggingFace folder (a download or copy cut short, a file edited wrongly) given to
`train --train.init_from`, `eval`/`generate --checkpoint` or `hf export --checkpoint`: each case was a
traceback (JSONDecodeError, AttributeError, KeyError, TypeError, SafetensorError) or named a flag the
user never gave (--tokenizer); now one line naming the user's flag, exit 2, and nothing started."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from plait.cli import main
from plait.config import ModelConfig
from plait.hf import mark_byte_level, save_hf
from plait.model import build_model

AGAIN = "download the model again"


def _write(name: str, text: str):
    return lambda d: (d / name).write_text(text)


def _config(**changes):
    def damage(d):
        c = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(dict(c, **changes)))
    return damage


def _tokenizer(d):
    pytest.importorskip("tokenizers")
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": {')  # cut short


DAMAGES = {  # case: (damage the folder, words the line must hold)
    "config.json not JSON": (_write("config.json", "{"), ["config.json is not valid JSON (", AGAIN]),
    "config.json an array": (_write("config.json", "[1, 2]"), ["config.json holds an array, not the JSON object",
                                                               AGAIN]),
    "config.json lacks keys": (_write("config.json", '{"model_type": "llama"}'),
                               ["config.json lacks 'vocab_size'", "'num_attention_heads'", AGAIN]),
    "config.json key of another type": (_config(num_attention_heads="x"),
                                        ["config.json has num_attention_heads = 'x' where a positive whole number "
                                         "belongs", "correct it, or " + AGAIN]),
    "weights cut short": (lambda d: os.truncate(d / "model.safetensors", 10000),
                          ["has a model.safetensors that safetensors cannot read (", "incomplete metadata",
                           "cut short", AGAIN]),
    "weights a Git LFS pointer": (_write("model.safetensors", "version https://git-lfs.github.com/spec/v1\n"
                                         "oid sha256:0123\nsize 70000\n"),
                                  ["has a model.safetensors that is a Git LFS pointer", "git lfs pull"]),
    "index not JSON": (_write("model.safetensors.index.json", "{"),
                       ["model.safetensors.index.json is not valid JSON (", AGAIN]),
    "index without weight_map": (_write("model.safetensors.index.json", '{"metadata": {}}'),
                                 ['model.safetensors.index.json has no "weight_map"', AGAIN]),
    "tokenizer.json cut short": (_tokenizer, ["has a tokenizer.json the tokenizers library cannot read (", AGAIN]),
}


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    """A byte-level HF folder as `plait hf export` writes it, of a model small enough to copy per test."""
    cfg = ModelConfig(preset="custom", vocab_size=256, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48,
                      max_seq_len=64)
    out = save_hf(dict(build_model(cfg, seed=1).named_parameters()), cfg, tmp_path_factory.mktemp("hf") / "m")
    mark_byte_level(out)
    return out


def _commands(hf, corpus, tmp_path):
    """Each command that reads an HF folder: (argv, the flag it names, what it must not have made)."""
    new, export = tmp_path / "new", tmp_path / "export"
    return {
        "train": (["train", "--train.init_from", str(hf), "--data.path", str(corpus), "--out", str(new),
                   "--train.steps", "1", "--train.progress", "false", "--train.eval_every", "0", "--train.device",
                   "cpu", "--train.compile", "off", "--train.tensorboard", "false"], "train.init_from", new),
        "eval": (["eval", "--checkpoint", str(hf), "--data", str(corpus), "--batches", "1", "--seq-len", "16"],
                 "--checkpoint", None),
        "generate": (["generate", "--checkpoint", str(hf), "--max-new-tokens", "2"], "--checkpoint", None),
        "hf export": (["hf", "export", "--checkpoint", str(hf), "--out", str(export)], "--checkpoint", export),
    }


def test_the_healthy_folder_evaluates_and_generates(healthy, corpus, capfd):
    """The folder the cases damage is sound: their lines come from the damage alone."""
    for command in ("eval", "generate"):
        argv, _, _ = _commands(healthy, corpus, healthy.parent)[command]
        assert main(argv) == 0, capfd.readouterr().err


@pytest.mark.parametrize("command", ["train", "eval", "generate", "hf export"])
@pytest.mark.parametrize("case", DAMAGES)
def test_a_damaged_hf_folder_is_one_line_naming_the_flag(healthy, corpus, tmp_path, capfd, case, command):
    damage, words = DAMAGES[case]
    hf = tmp_path / "hf"
    shutil.copytree(healthy, hf)
    damage(hf)
    argv, flag, made = _commands(hf, corpus, tmp_path)[command]
    capfd.readouterr()
    assert main(argv) == 2
    out = capfd.readouterr()
    lines = out.err.splitlines()
    assert len(lines) == 1, out.err
    assert f"{flag} = '{hf}': " in lines[0], lines[0]
    assert all(w in lines[0] for w in words), lines[0]
    assert "Traceback" not in out.err + out.out
    assert made is None or not made.exists()  # refused before the run or export folder was made
