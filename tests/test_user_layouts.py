"""Checkpoints moved between layouts and places as a user moves them: a run started with a relative
data folder resumed (and evaluated) from another directory, an HF export of a model shorter than
the trainer's default sequence evaluated without --seq-len, a --preset that does not fit the
checkpoint named as the preset, and Ctrl-C while the fork server still imports torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import MICRO_MODEL
from plait.cli import main


def _args(data, out, steps=2, extra=()):
    args = ["train", "--out", str(out), "--steps", str(steps), "--data.path", str(data), "--train.micro_batch", "4",
            "--train.seq_len", "32", "--train.eval_batches", "1", "--train.eval_every", "0", "--train.progress",
            "false", "--train.sample_tokens", "0", "--train.compile", "off", "--train.tensorboard", "false",
            "--train.device", "cpu", *extra]
    for k, v in MICRO_MODEL.items():
        args += [f"--model.{k}", str(v)]
    return args


def _error_line(capfd):
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_relative_data_folder_resumes_and_evaluates_from_another_directory(corpus, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(corpus.parent)
    run = tmp_path / "r"
    assert main(_args(corpus.name, run)) == 0  # --data.path corpus, relative to where the run started
    assert f'path = "{corpus}"' in (run / "config.toml").read_text()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the saved relative path named nothing here: "meta.json missing"
    capfd.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--steps", "3"]) == 0
    assert main(["eval", "--checkpoint", str(run)]) == 0
    assert f"on {corpus} (validation)" in capfd.readouterr().out


def test_a_relative_data_mix_is_saved_with_absolute_folders_and_its_weights_as_written(tmp_path, monkeypatch):
    from plait.config import build_config
    from plait.preflight import _absolute_data

    monkeypatch.chdir(tmp_path)
    cfg = build_config({"data": {"mix": "web:0.7, ~/code:3"}})
    _absolute_data(cfg)
    assert cfg.data.mix == f"{tmp_path / 'web'}:0.7,{Path('~/code').expanduser()}:3"


def test_an_hf_export_shorter_than_the_default_sequence_evaluates_without_seq_len(corpus, tmp_path, capfd):
    run, hf = tmp_path / "r", tmp_path / "hf"
    assert main(_args(corpus, run)) == 0  # max_seq_len 64, below train.seq_len's default 256
    assert main(["hf", "export", "--checkpoint", str(run), "--out", str(hf), "--dtype", "fp32"]) == 0
    capfd.readouterr()
    assert main(["eval", "--checkpoint", str(hf), "--data", str(corpus), "--batches", "1"]) == 0
    assert capfd.readouterr().out.strip().endswith("(1 batch x 16 x 64)")
    assert main(["eval", "--checkpoint", str(hf), "--data", str(corpus), "--seq-len", "65"]) == 2  # given: checked
    assert "--seq-len = 65: exceeds the model's max_seq_len 64" in _error_line(capfd)


def test_a_preset_that_does_not_fit_the_checkpoint_is_named_as_the_preset(corpus, tmp_path, capfd):
    run = tmp_path / "r"
    assert main(_args(corpus, run)) == 0
    capfd.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--steps", "3", "--preset", "tiny"]) == 2
    line = _error_line(capfd)
    assert line.startswith("plait train: error: model.preset = 'tiny': builds a model with dim = "), line
    assert "holds a 'custom' model with dim = 64; resume without --preset" in line
    # a field set by hand is still named as itself
    assert main(["train", "--out", str(run), "--resume", "--steps", "3", "--model.dim", "32"]) == 2
    assert "error: model.dim = 32: but the checkpoint" in _error_line(capfd)


CTRL_C_EARLY = textwrap.dedent("""
    import os, signal, sys, threading, time
    from multiprocessing import forkserver
    from plait.launch import spawn

    def entry():
        time.sleep(60)

    def interrupt():  # Ctrl-C to the whole group once the fork server's Python runs: it is importing torch
        while getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None) is None:
            time.sleep(0.01)
        time.sleep(0.4)  # past the interpreter's start (a SIGINT before it ends the server silently)
        os.killpg(0, signal.SIGINT)

    if __name__ == "__main__":
        threading.Thread(target=interrupt, daemon=True).start()
        try:
            spawn(entry, (), 2)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
""")


def test_ctrl_c_while_the_fork_server_starts_prints_no_traceback(tmp_path):
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_EARLY)
    # a group of its own: the SIGINT reaches the launcher and its fork server, as a terminal's would
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                       start_new_session=True)
    # before: the fork server's KeyboardInterrupt traceback. A worker the server had forked as the
    # launcher went (a loaded machine) may say why it stops too, in one line of its own.
    lines = r.stderr.strip().splitlines()
    assert lines[0] == "interrupted" and "Traceback" not in r.stderr, r.stderr
    assert all(x.startswith("plait: rank ") and x.endswith(" ended") for x in lines[1:]), r.stderr
