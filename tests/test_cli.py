"""The command line: the default job's pieces, generate, export, and one-line errors (exit 2)."""

import os
import subprocess
import sys

import pytest

from plait.cli import main
from conftest import MICRO_MODEL


def _micro_args(corpus, out, steps=4):
    args = ["--out", str(out), "--steps", str(steps), "--data.path", str(corpus), "--train.micro_batch", "4",
            "--train.seq_len", "32", "--train.eval_batches", "1", "--train.progress", "false",
            "--train.sample_tokens", "20", "--train.compile", "off", "--train.tensorboard", "false"]
    for k, v in MICRO_MODEL.items():
        args += [f"--model.{k}", str(v)]
    return args


def test_train_generate_export(corpus, tmp_path, capsys):
    assert main(["train", *_micro_args(corpus, tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert "--- sample ---" in err and "final val loss" in err
    assert main(["generate", "--checkpoint", str(tmp_path / "r"), "--prompt", "def ", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def ") and len(out) > 4
    assert main(["generate", "--checkpoint", str(tmp_path / "r"), "--temperature", "1.0", "--top-k", "5",
                 "--max-new-tokens", "8"]) == 0
    capsys.readouterr()
    assert main(["hf", "export", "--checkpoint", str(tmp_path / "r"), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert main(["generate", "--checkpoint", str(tmp_path / "hf"), "--max-new-tokens", "4"]) == 0


def _unwritable(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    return ro / "run"


@pytest.mark.parametrize("case, needle", [
    ("unknown-key", "unknown key in [train] 'stepz'"),
    ("wrong-type", "train.micro_batch = 'ten': expected an integer"),
    ("heads", "model.n_heads = 3: must divide model.dim = 64"),
    ("missing-data", "data.path = "),
    ("empty-corpus", "--input = "),
    ("unwritable", "train.out = "),
    ("no-checkpoint", "--checkpoint = "),
    ("existing-run", "already holds 1 checkpoint(s); pass --resume"),
    ("bad-config-file", "--config = "),
])
def test_bad_input_exits_2_with_one_line(case, needle, corpus, tmp_path, capsys):
    base = _micro_args(corpus, tmp_path / "r")
    argv = {
        "unknown-key": ["train", *base, "--train.stepz", "3"],
        "wrong-type": ["train", *base, "--train.micro_batch", "ten"],
        "heads": ["train", *base, "--model.n_heads", "3"],
        "missing-data": ["train", *base, "--data.path", str(tmp_path / "nodata")],
        "empty-corpus": ["data", "prepare", "--input", str(tmp_path), "--out", str(tmp_path / "d")],
        "unwritable": ["train", *base, "--out", str(_unwritable(tmp_path) if os.geteuid() else "/proc/plait")],
        "no-checkpoint": ["generate", "--checkpoint", str(tmp_path / "nothing")],
        "existing-run": ["train", *base],
        "bad-config-file": ["train", "--config", str(tmp_path / "missing.toml")],
    }[case]
    if case == "existing-run":
        assert main(argv) == 0
        capsys.readouterr()
        before = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    if case == "existing-run":  # nothing already saved was touched
        assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == before


def test_real_process_exit_code_and_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "plait.cli", "train", "--model.n_kv_heads", "3"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert "model.n_kv_heads = 3" in r.stderr
