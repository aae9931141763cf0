"""Malformed inputs of every kind - command-line values, config fields, TOML files, data folders,
checkpoints with truncated, altered or missing files, tokenizer files - each end in one clear error
line (exit code 2): never a traceback, never a hang, and never a checkpoint deleted or rewritten."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from fault_runs import bounded, step_dir, train_args
from plait.cli import main


@pytest.fixture(scope="module")
def good(corpus, tmp_path_factory):
    """A finished single-process run with checkpoints at steps 1 and 2."""
    run = tmp_path_factory.mktemp("good") / "run"
    with bounded(60):
        assert main(train_args(corpus, run, 2, extra=["--checkpoint.every", "1"])) == 0
    return run


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_byte(path: Path) -> None:
    b = bytearray(path.read_bytes())
    b[len(b) // 2] ^= 0xFF
    path.write_bytes(bytes(b))


def _damage_all(run: Path, how) -> None:
    for folder in (run / "checkpoints").iterdir():
        how(folder)


def _garbage_with_manifest(folder: Path) -> None:
    """model.pt replaced by garbage and the manifest updated to match: passes the checksum, fails to load."""
    (folder / "model.pt").write_bytes(b"not a torch file" * 64)
    m = json.loads((folder / "manifest.json").read_text())
    m["files"]["model.pt"] = {"bytes": 1024, "sha256": hashlib.sha256((folder / "model.pt").read_bytes()).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(m))


def _data_copy(corpus: Path, case: Path, damage) -> Path:
    data = case / "data"
    shutil.copytree(corpus, data)
    damage(data)
    return data


# (name, setup(case folder, corpus, good run) -> argv, text the error line must contain)
CASES = [
    # command-line values and config fields
    ("batch not a number", lambda c, d, g: _t(d, c, "--train.micro_batch", "abc"),
     "train.micro_batch = 'abc': expected an integer"),
    ("negative batch", lambda c, d, g: _t(d, c, "--train.micro_batch", "-5"), "train.micro_batch = -5"),
    ("unknown preset", lambda c, d, g: _t(d, c, "--model.preset", "huge"), "model.preset = 'huge'"),
    ("unknown dtype", lambda c, d, g: _t(d, c, "--train.dtype", "fp8"), "train.dtype = 'fp8'"),
    ("zero stage 7", lambda c, d, g: _t(d, c, "--parallel.zero", "7"), "parallel.zero = 7"),
    ("sequence too long", lambda c, d, g: _t(d, c, "--train.seq_len", "100000"), "train.seq_len = 100000"),
    ("heads do not divide dim", lambda c, d, g: _t(d, c, "--model.n_heads", "5"), "model.n_heads = 5"),
    ("negative restarts", lambda c, d, g: _t(d, c, "--train.max_restarts", "-1"), "train.max_restarts = -1"),
    ("spike factor below 1", lambda c, d, g: _t(d, c, "--train.spike_factor", "0.5"), "train.spike_factor = 0.5"),
    ("async not a boolean", lambda c, d, g: _t(d, c, "--checkpoint.async", "maybe"),
     "checkpoint.async_save = 'maybe': expected true or false"),
    ("negative minutes", lambda c, d, g: _t(d, c, "--checkpoint.every_minutes", "-1"), "checkpoint.every_minutes = -1"),
    ("replica check, no replica", lambda c, d, g: _t(d, c, "--train.replica_check_every", "2"),
     "train.replica_check_every = 2: this layout keeps no two copies"),
    ("zero straggler threshold", lambda c, d, g: _t(d, c, "--train.straggler_threshold", "0"),
     "train.straggler_threshold = 0.0"),
    ("max_bad_steps 0", lambda c, d, g: _t(d, c, "--train.max_bad_steps", "0"), "train.max_bad_steps = 0"),
    ("unknown section", lambda c, d, g: _t(d, c, "--nosuch.key", "1"), "unknown config section 'nosuch'"),
    ("unknown key", lambda c, d, g: _t(d, c, "--train.stepz", "10"), "did you mean 'steps'?"),
    ("flag without value", lambda c, d, g: _t(d, c, "--train.lr"), "--train.lr needs a value"),
    ("stray argument", lambda c, d, g: _t(d, c, "banana"), "unexpected argument 'banana'"),
    ("zero processes", lambda c, d, g: _t(d, c, "--nproc", "0"), "parallel.nproc = 0"),
    ("dp larger than world", lambda c, d, g: _t(d, c, "--nproc", "2", "--dp", "3"), "dp_shard"),
    # TOML files
    ("missing config file", lambda c, d, g: _t(d, c, "--config", str(c / "nope.toml")), "no such file"),
    ("TOML syntax error", lambda c, d, g: _toml(c, d, "[train\nsteps = 3"), "not valid TOML"),
    ("TOML binary garbage", lambda c, d, g: _toml(c, d, b"\xff\xfe\x00garbage\x80"), "--config"),
    ("TOML wrong type", lambda c, d, g: _toml(c, d, '[train]\nwarmup_steps = "ten"'), "train.warmup_steps = 'ten'"),
    ("TOML float for int", lambda c, d, g: _toml(c, d, "[checkpoint]\nevery = 1.5"), "checkpoint.every = 1.5"),
    ("TOML section not a table", lambda c, d, g: _toml(c, d, "checkpoint = 5"), "[checkpoint] must be a table"),
    ("TOML unknown section", lambda c, d, g: _toml(c, d, "[trian]\nsteps = 3"), "did you mean 'train'?"),
    # data folders
    ("data folder missing", lambda c, d, g: _t(c / "nodata", c), "data.path"),
    ("data folder empty", lambda c, d, g: _t(_data_copy(d, c, _empty), c), "data.path"),
    ("data meta.json corrupt", lambda c, d, g: _t(_data_copy(d, c, lambda x: (x / "meta.json").write_text("{oops")), c),
     "data.path"),
    ("data shard missing", lambda c, d, g: _t(_data_copy(d, c, lambda x: (x / "train_000.bin").unlink()), c),
     "train_000.bin"),
    ("data vocabulary too large", lambda c, d, g: _t(_data_copy(d, c, _big_vocab), c, "--model.vocab_size", "259"),
     "model.vocab_size = 259"),
    ("data mix malformed", lambda c, d, g: _t(d, c, "--data.path", "", "--data.mix", "a:b:c"), "data.mix"),
    # checkpoints
    ("resume: every checkpoint truncated", lambda c, d, g: _resume(g, c, d, lambda f: _truncate(f / "model.pt")),
     "every checkpoint"),
    ("resume: manifests missing", lambda c, d, g: _resume(g, c, d, lambda f: (f / "manifest.json").unlink()),
     "every checkpoint"),
    ("resume: a byte altered", lambda c, d, g: _resume(g, c, d, lambda f: _flip_byte(f / "optim.pt")),
     "every checkpoint"),
    ("resume: train_state.json missing", lambda c, d, g: _resume(g, c, d, lambda f: (f / "train_state.json").unlink()),
     "every checkpoint"),
    ("resume: garbage that matches its manifest", lambda c, d, g: _resume(g, c, d, _garbage_with_manifest),
     "cannot read checkpoint file"),
    ("generate: truncated checkpoint", lambda c, d, g: _gen(g, c, lambda f: _truncate(f / "model.pt")), "is damaged"),
    ("generate: no checkpoint there", lambda c, d, g: ["generate", "--checkpoint", str(c / "none"), "--prompt", "x"],
     "no such checkpoint"),
    ("eval: altered checkpoint", lambda c, d, g: _eval(g, c, d, lambda f: _flip_byte(f / "model.pt")), "is damaged"),
    ("init_from: damaged checkpoint", lambda c, d, g: _init_from(g, c, d), "train.init_from"),
    # tokenizer files
    ("tokenizer file missing", lambda c, d, g: _prep(c, d, c / "nope.json"), "--tokenizer"),
    ("tokenizer not JSON", lambda c, d, g: _prep(c, d, _write(c / "tok.json", "{not json")), "--tokenizer"),
    ("tokenizer JSON of something else", lambda c, d, g: _prep(c, d, _write(c / "tok.json", '{"a": 1}')),
     "--tokenizer"),
]


def _t(data, case, *extra):
    return train_args(data, case / "run", 2, extra=list(extra))


def _toml(case, data, content):
    path = case / "run.toml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return _t(data, case, "--config", str(path))


def _empty(folder: Path) -> None:
    for f in folder.iterdir():
        f.unlink()


def _big_vocab(folder: Path) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    meta["vocab_size"] = 50000
    (folder / "meta.json").write_text(json.dumps(meta))


def _copy_run(good: Path, case: Path, damage) -> Path:
    run = case / "run"
    shutil.copytree(good, run)
    _damage_all(run, damage)
    return run


def _resume(good, case, data, damage):
    run = _copy_run(good, case, damage)
    return train_args(data, run, 4, extra=["--resume"])


def _gen(good, case, damage):
    run = _copy_run(good, case, damage)
    return ["generate", "--checkpoint", str(step_dir(run, 2)), "--prompt", "def ", "--max-new-tokens", "2"]


def _eval(good, case, data, damage):
    run = _copy_run(good, case, damage)
    return ["eval", "--checkpoint", str(step_dir(run, 2)), "--data", str(data)]


def _init_from(good, case, data):
    src = _copy_run(good, case, lambda f: _truncate(f / "model.pt"))
    return train_args(data, case / "new", 2, extra=["--train.init_from", str(step_dir(src, 2))])


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _prep(case, data, tokenizer):
    src = case / "src"
    src.mkdir(exist_ok=True)
    (src / "a.txt").write_text("hello world\n" * 50)
    return ["data", "prepare", "--input", str(src), "--out", str(case / "prepared"), "--tokenizer", str(tokenizer),
            "--workers", "1"]


def _files(root: Path) -> dict[str, str]:
    """sha256 of every file under the checkpoint folders below root."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "checkpoints" in p.parts}


def test_there_are_at_least_30_cases():
    assert len(CASES) >= 30
    print(f"{len(CASES)} malformed inputs")


@pytest.mark.parametrize("name, setup, needle", CASES, ids=[c[0] for c in CASES])
def test_a_malformed_input_gives_one_clear_line(name, setup, needle, corpus, good, tmp_path, capfd):
    argv = setup(tmp_path, corpus, good)
    before = _files(tmp_path)
    capfd.readouterr()
    with bounded(30):
        code = main(argv)
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if ": error:" in line]
    assert code == 2, f"{name}: exit code {code}\n{err}"
    assert "Traceback" not in err and len(errors) == 1, f"{name}:\n{err}"
    assert needle in errors[0], f"{name}: {errors[0]!r} lacks {needle!r}"
    # everything else on stderr is a plait note (e.g. which checkpoint was skipped and why)
    assert all(line.startswith("plait") for line in err.splitlines() if line.strip()), err
    assert _files(tmp_path) == before, f"{name}: a checkpoint file was deleted or rewritten"
