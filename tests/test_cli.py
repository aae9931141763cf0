"""The command line: the default job's pieces, generate, export, and one-line errors (exit 2)."""

import json
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
    # --train.progress false hides the bar, not the run's other lines (it hid them all)
    assert "plait: custom model" in err and "step 4: val loss" in err and "saved checkpoint" in err
    assert "[####" not in err
    assert main(["generate", "--checkpoint", str(tmp_path / "r"), "--prompt", "def ", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def ") and len(out) > 4
    assert main(["generate", "--checkpoint", str(tmp_path / "r"), "--temperature", "1.0", "--top-k", "5",
                 "--max-new-tokens", "8"]) == 0
    capsys.readouterr()
    assert main(["hf", "export", "--checkpoint", str(tmp_path / "r"), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["plait_tokenizer"] == "bytes"
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
    ("out-is-a-file", "is a file, not a folder; choose a folder for the run"),
    ("no-checkpoint", "--checkpoint = "),
    ("existing-run", "already holds 1 checkpoint(s); pass --resume"),
    ("bad-config-file", "--config = "),
    ("config-is-a-folder", "is a folder, not a file; give the path of a TOML config"),
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
        "config-is-a-folder": ["train", "--config", str(tmp_path)],
        "out-is-a-file": ["train", *base, "--out", str(tmp_path / "a-file")],
    }[case]
    (tmp_path / "a-file").write_text("not a run folder\n")
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


def test_output_cut_short_by_its_reader_is_no_traceback(tmp_path):
    """`plait mesh ... | head`: the reader closed the pipe, and Python's BrokenPipeError printed a
    traceback after the lines it wanted."""
    r = subprocess.run(f"{sys.executable} -m plait.cli mesh --tp 2 --dp 64 --all | head -1", shell=True,
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.stdout.startswith("world 128 =") and r.stderr == "", r.stderr


def test_an_empty_png_path_is_refused(capsys):
    assert main(["schedule", "--pp", "2", "--microbatches", "4", "--png", ""]) == 2
    assert "--png = '': is empty" in capsys.readouterr().err


def test_train_refuses_data_without_a_validation_split(tmp_path, capsys):
    # --val-fraction 0 now holds nothing out; training evaluates on the split, so it says so up front
    (tmp_path / "c").mkdir()
    for i in range(8):
        (tmp_path / "c" / f"{i}.txt").write_text(f"document {i}: " + "some words " * 40)
    assert main(["data", "prepare", "--input", str(tmp_path / "c"), "--out", str(tmp_path / "d"),
                 "--val-fraction", "0"]) == 0
    capsys.readouterr()
    assert main(["train", *_micro_args(tmp_path / "d", tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.path = " in err[0] and "has no validation split" in err[0], err
    assert "--val-fraction above 0" in err[0] and not (tmp_path / "r").exists()
    # the default corpus (no --data.path) is named by the setting the user gave
    base = _micro_args(tmp_path / "d", tmp_path / "r")
    i = base.index("--data.path")
    assert main(["train", *base[:i], *base[i + 2:], "--data.val_fraction", "0",
                 "--data.cache_dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.val_fraction = 0.0: leaves the default corpus no validation split" in err[0], err


@pytest.mark.parametrize("argv, needle", [
    (["--tp", "3", "--pp", "2", "--gpus-per-node", "4"],
     "--tp = 3: 1 tensor-parallel group(s) span nodes of 4 GPUs (e.g. ranks [3, 4, 5])"),
    (["--tp", "0"], "--tp = 0: must be a positive integer"),
    (["--pp", "0"], "--pp = 0: must be a positive integer"),
    (["--cp", "-2"], "--cp = -2: must be a positive integer"),
    (["--dp-replicate", "0"], "--dp-replicate = 0: must be a positive integer"),
    (["--nproc", "0"], "--nproc = 0: must be a positive integer"),
    (["--gpus-per-node", "0"], "--gpus-per-node = 0: must be a positive integer"),
    (["--tp", "2", "--dp", "-1"], "--dp = -1: must be a positive integer (or leave it out and give --nproc"),
    (["--dp-shard", "0"], "--dp-shard = 0: must be a positive integer"),
    (["--nproc", "8", "--tp", "3"],
     "--nproc = 8: is not divisible by --dp-replicate 1 x --tp 3 x --pp 1 x --cp 1 = 3"),
    (["--nproc", "8", "--dp", "2"],
     "--nproc = 8: differs from --dp 2 x --dp-replicate 1 x --tp 1 x --pp 1 x --cp 1 = 2; "
     "give --nproc 2, or leave --dp out"),
])
def test_plait_mesh_blames_the_flag_it_takes(argv, needle, capsys):
    # not "world size = 0" (the product) nor parallel.* (the config's names, which mesh does not take)
    assert main(["mesh", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err
    assert "world size" not in err and "parallel." not in err
    if "span nodes" in needle:
        assert err.rstrip().endswith("or pass --allow-cross-node-tp to show the layout anyway")


def test_plait_mesh_allow_cross_node_tp_warns_in_its_flags(capsys):
    assert main(["mesh", "--tp", "3", "--pp", "2", "--gpus-per-node", "4", "--allow-cross-node-tp"]) == 0
    out = capsys.readouterr().out
    assert "warning: --tp = 3: 1 tensor-parallel group(s) span nodes" in out and "parallel." not in out
    assert main(["mesh", "--nproc", "8", "--dp", "-1", "--tp", "2"]) == 0  # -1 with --nproc: inferred
    assert "dp_shard 4" in capsys.readouterr().out


def test_sp_flag_takes_a_value_like_its_field():
    # --parallel.sp auto|on|off has the alias --sp: a bare --sp is on, and `--sp off` was "unexpected argument 'off'"
    from plait.cli import build_parser
    from plait.commands.train import config_from_args

    parser, _ = build_parser()
    for argv, want in ((["--sp"], "on"), (["--sp", "off"], "off"), (["--sp", "auto", "--train.steps", "3"], "auto"),
                       (["--sp", "--train.steps", "3"], "on"), ([], "auto")):
        args, extra = parser.parse_known_args(["train", "--nproc", "2", "--tp", "2", *argv])
        cfg = config_from_args(args, extra)[0]
        assert cfg.parallel.sp == want, argv


@pytest.mark.parametrize("argv,meant", [(["plan", "--model", "8b", "--gpus", "8"], "--nodes N --gpus-per-node G"),
                                        (["train", "--step", "3"], "--steps"),
                                        (["plan", "--model", "8b", "--gpus-per-nod", "8"], "--gpus-per-node")])
def test_an_abbreviated_or_misspelt_flag_is_refused_naming_the_flag(capsys, argv, meant):
    # argparse took `plan --gpus 8` as --gpus-per-node 8: 8 GPUs a node, not 8 GPUs, and nothing said so
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # --gpus is no near miss of --gpus-per-node (a node's count, not the cluster's): plan says what is
    assert len(err) == 1 and (f"did you mean {meant}?" in err[0] or f"a cluster is {meant}" in err[0]), err


def test_a_dotted_override_is_not_taken_for_an_abbreviation():
    # the refusal above leaves `--section.key` overrides alone (one plan: it is the same for every flag)
    assert main(["plan", "--model", "8b", "--gpus-per-node", "8", "--link.nvlink-gbps", "370"]) == 0


def test_train_help_lists_every_schedule(capsys):
    from plait.parallel.schedules import SCHEDULES

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text.rsplit("--schedule SCHEDULE", 1)[1][:100] for name in SCHEDULES), text


def test_a_lost_peer_under_an_outer_launcher_is_one_line_saying_where_to_go_on(tmp_path, capsys, monkeypatch):
    """Under torchrun or srun each process is a rank: a peer's death reached it as a collective's
    traceback, with no word of the checkpoint to continue from."""
    from plait.comm import CollectiveError

    def dies(*a, **k):
        raise CollectiveError("all_gather on mesh dim 'dp_shard' (ranks [0, 1]) failed on rank 1: Connection reset "
                              "by peer\nmore detail")

    monkeypatch.setattr("plait.run.launch_training", dies)
    assert main(["train", "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("plait train: error: all_gather on mesh dim 'dp_shard'") and \
        "another rank stopped first" in err and "no checkpoint was saved: run the command again" in err, err
