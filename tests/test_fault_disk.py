"""Disk faults and folder ownership: a disk that fills up mid-run (a real small tmpfs, mounted in a
user + mount namespace) or an injected ENOSPC in an asynchronous write, a read-only --out, too
little space for one checkpoint, and a second run on a folder in use: one line each, a non-zero
exit, every earlier checkpoint still loadable."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest

from fault_runs import assert_no_workers_left, bounded, rows, step_dir, train_args
from plait import checkpoint as ckpt
from plait.cli import main
from plait.config import build_config
from plait.parallel.sharded_state import full_weights
from plait.run_folder import RunFolder


def _namespaces_work() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = "d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs $d && umount $d && rmdir $d"
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", probe],
                          capture_output=True).returncode == 0


needs_namespaces = pytest.mark.skipif(not _namespaces_work(), reason="cannot mount a tmpfs in a user namespace here")


def _in_namespace(tmp_path, setup: str, cmd: list[str], copy_from: str, timeout=120) -> tuple[int, str]:
    """Run `cmd` after the shell `setup` (mounts) in a fresh user + mount namespace; the mounts vanish
    with it, so `copy_from` is copied to tmp_path/"copy" first. Returns (exit code, stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_")}
    script = (f"set -e; {setup}; set +e; {shlex.join(cmd)} 2> {tmp_path}/err; rc=$?; "
              f"cp -a {copy_from} {tmp_path}/copy; exit $rc")
    p = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "bash", "-c", script], env=env,
                       timeout=timeout)
    return p.returncode, (tmp_path / "err").read_text()


def _cli(corpus, out, steps, extra=()) -> list[str]:
    return [sys.executable, "-m", "plait.cli"] + train_args(corpus, out, steps, nproc=2, zero=3, extra=extra)


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("plait train: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@needs_namespaces
def test_a_disk_that_fills_up_mid_run_ends_in_one_line_and_keeps_earlier_checkpoints(corpus, tmp_path):
    # ~0.85 MB a checkpoint (68K parameters x 12 bytes): a 1.4 MB disk holds the one of step 2, not step 4's
    disk = tmp_path / "disk"
    disk.mkdir()
    run = disk / "run"
    rc, err = _in_namespace(tmp_path, f"mount -t tmpfs -o size=1400k tmpfs {disk}",
                            _cli(corpus, run, 6, ["--checkpoint.every", "2"]), run)
    line = _one_error_line(err)
    assert rc == 2 and "cannot write checkpoint step_00000004 in" in line and "No space left on device" in line, err
    copy = tmp_path / "copy"
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["step_00000002"]  # no partial folder
    assert ckpt.verify(step_dir(copy, 2)) is None and len(full_weights(step_dir(copy, 2))) > 0
    assert [r["step"] for r in rows(copy)][-1] == 3  # a step is logged once its checkpoint is written
    assert_no_workers_left()


@needs_namespaces
def test_a_read_only_out_is_refused_before_training(corpus, tmp_path):
    run = tmp_path / "run"
    with bounded(60):
        assert main(train_args(corpus, run, 2)) == 0
    before = {f: f.read_bytes() for f in step_dir(run, 2).iterdir()}
    rc, err = _in_namespace(tmp_path, f"mount --bind {run} {run} && mount -o remount,ro,bind {run}",
                            [sys.executable, "-m", "plait.cli"] + train_args(corpus, run, 4, extra=["--resume"]), run)
    line = _one_error_line(err)
    assert rc == 2 and f"train.out = '{run}': cannot write there (Read-only file system)" in line, err
    assert {f: f.read_bytes() for f in step_dir(run, 2).iterdir()} == before
    assert ckpt.verify(step_dir(run, 2)) is None


def test_too_little_space_for_one_checkpoint_is_refused_before_training(corpus, tmp_path, monkeypatch, capfd):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr("plait.run_folder.shutil.disk_usage", lambda p: usage._replace(free=256 << 10))
    assert main(train_args(corpus, tmp_path / "run", 2, nproc=2, zero=3)) == 2
    line = _one_error_line(capfd.readouterr().err)
    assert "has 0.25 MiB free but one checkpoint of this model needs about 0.84 MiB" in line, line
    assert not (tmp_path / "run").exists()  # refused before any worker started, and no folder holding a lock left


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a GPU")
def test_a_start_refused_after_preflight_leaves_no_run_folder(corpus, tmp_path, capfd):
    # preflight makes --out; `--train.device cuda` without a GPU is refused after it, and left it behind
    assert main(train_args(corpus, tmp_path / "run", 2, nproc=2, extra=["--train.device", "cuda"])) == 2
    line = _one_error_line(capfd.readouterr().err)
    assert "train.device = 'cuda': no CUDA device is visible" in line and not (tmp_path / "run").exists()
    (tmp_path / "mine").mkdir()  # a folder the user made is theirs: kept
    assert main(train_args(corpus, tmp_path / "mine", 2, extra=["--train.device", "cuda"])) == 2
    capfd.readouterr()
    # the default corpus was prepared first (minutes on a first run), then the device refused
    assert main(["train", "--out", str(tmp_path / "d"), "--data.cache_dir", str(tmp_path / "cache"),
                 "--train.device", "cuda"]) == 2
    assert "train.device = 'cuda'" in _one_error_line(capfd.readouterr().err) and not (tmp_path / "cache").exists()
    assert (tmp_path / "mine").is_dir()


def test_a_start_refused_inside_the_workers_leaves_no_run_folder(corpus, tmp_path, capfd, monkeypatch):
    """Refused once the folder was this run's (nodes that disagree, a rendezvous that timed out): it
    was left holding only its lock."""
    from plait.errors import UserError

    def refuse(*a, **k):
        raise UserError("rank 1 was started with train.lr = 0.1, rank 0 with 0.2: start every node with the same command")

    monkeypatch.setattr("plait.run.train", refuse)
    assert main(train_args(corpus, tmp_path / "run", 2)) == 2
    assert "start every node with the same command" in _one_error_line(capfd.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_a_failed_async_write_ends_in_one_line_and_keeps_earlier_checkpoints(corpus, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("PLAIT_FAULTS", "enospc@rank=1,step=4")  # rank 1's background write of step 4 fails
    run = tmp_path / "run"
    with bounded(90):
        code = main(train_args(corpus, run, 6, nproc=2, zero=3,
                               extra=["--checkpoint.every", "2", "--checkpoint.async", "true"]))
    err = capfd.readouterr().err
    line = _one_error_line(err)
    # not "saved": the write of step 4 was still to fail (it said "saved checkpoint ... (writing in the background)")
    assert f"checkpoint {step_dir(run, 4)}: taken, writing in the background" in err and "saved checkpoint" not in err
    assert code == 2 and line.startswith("plait train: error: rank 1: cannot write checkpoint step_00000004 in "
                                         f"{run / 'checkpoints'}: No space left on device"), line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]
    assert ckpt.verify(step_dir(run, 2)) is None
    assert_no_workers_left()


def test_a_second_run_on_a_folder_in_use_is_refused(corpus, tmp_path, capfd):
    run = tmp_path / "run"
    cfg = build_config({"train": {"out": str(run)}})
    run.mkdir()
    with RunFolder(cfg):  # another run holds the folder
        assert main(train_args(corpus, run, 2)) == 2
        line = _one_error_line(capfd.readouterr().err)
        assert f"train.out = '{run}': is in use by another plait run (pid {os.getpid()} on" in line
    assert not (run / "metrics.jsonl").exists()
    assert main(train_args(corpus, run, 2)) == 0  # free again once the holder is done
    capfd.readouterr()
    with RunFolder(cfg):  # resuming it is refused in that one line too, without the line about its config first
        assert main(train_args(corpus, run, 4, extra=["--resume"])) == 2
        err = capfd.readouterr().err
        assert err.count("\n") == 1 and "is in use by another plait run" in err, err
    # a run still starting (its config written, no checkpoint yet): no "the run starts again from
    # step 0" before the refusal, which the running one would read as a threat to it
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.toml").write_text((run / "config.toml").read_text())
    with RunFolder(build_config({"train": {"out": str(fresh)}})):
        assert main(train_args(corpus, fresh, 2)) == 2
        err = capfd.readouterr().err
        assert err.count("\n") == 1 and "is in use by another plait run" in err, err


def test_an_async_write_that_a_save_waited_for_still_reports_its_time(tmp_path):
    """A save that finds the previous background write still running waits for it; that write's
    report (step, seconds) is handed out by the next poll, not lost (metrics.jsonl logs it)."""
    import time

    from plait.async_checkpoint import AsyncSaver

    saver = AsyncSaver(tmp_path, keep_last=3, rank=0, world=1, timeout_s=60)

    def write(d):
        time.sleep(0.3)
        (d / "state.bin").write_bytes(b"x" * 64)

    saver.save(1, write, {})
    saver.save(2, write, {})  # the first write is still running: this save waits for it
    first = saver.poll()
    assert first["checkpoint_written"] == 1 and first["checkpoint_write_s"] >= 0.3
    assert saver.wait()["checkpoint_written"] == 2
    assert saver.poll() is None
    assert ckpt.latest_valid(tmp_path).name == ckpt.step_dir_name(2)


@pytest.mark.parametrize("message", ["[enforce fail at inline_container.cc:603] . unexpected pos 512 vs 448",
                                     "PytorchStreamWriter failed writing file data/3: file write failed",
                                     "basic_ios::clear: iostream error"])
def test_every_way_torch_save_reports_a_full_disk_is_a_write_failure(message):
    """torch.save's failed writes carry no errno; which message comes depends on where the disk filled
    (a rank that hits it inside the C++ stream says only "iostream error"). Each must end in the
    one-line checkpoint error, not a traceback."""
    assert ckpt.is_write_failure(RuntimeError(message))
    assert not ckpt.is_write_failure(RuntimeError("CUDA error: an illegal memory access was encountered"))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_under_the_metrics_is_one_line_and_not_restarted(corpus, tmp_path, capfd):
    """metrics.jsonl on a full disk (here /dev/full, which refuses every write with ENOSPC): a
    traceback, then `--train.max_restarts` restarts into the same disk; now one line, exit 2."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to("/dev/full")
    with bounded(120):
        rc = main(train_args(corpus, run, 4, nproc=2, extra=["--train.max_restarts", "2"]))
    err = capfd.readouterr().err
    line = _one_error_line(err)
    assert rc == 2 and f"cannot write {run / 'metrics.jsonl'}: No space left on device [errno 28]" in line, err
    assert "restart" not in err.replace("--resume", "")
    assert_no_workers_left()


def test_a_folder_where_the_metrics_file_goes_is_one_line(corpus, tmp_path, capfd):
    """metrics.jsonl made a folder (by hand, by a sync tool): an IsADirectoryError traceback."""
    run = tmp_path / "run"
    (run / "metrics.jsonl").mkdir(parents=True)
    assert main(train_args(corpus, run, 2)) == 2
    line = _one_error_line(capfd.readouterr().err)
    assert f"cannot write {run / 'metrics.jsonl'}: Is a directory [errno 21]" in line, line


def test_an_asynchronous_write_failure_learns_its_cause_before_the_partial_save_goes(tmp_path, monkeypatch):
    """On a full disk an asynchronous save said only torch's "unexpected pos": the partial save was
    removed first, which freed the space the cause's probe then found (a synchronous save said "No
    space left on device")."""
    from plait import checkpoint as ckpt
    from plait.async_checkpoint import AsyncSaver

    saver = AsyncSaver(tmp_path, keep_last=2, rank=0, world=1, timeout_s=10)
    tmp = tmp_path / f".tmp-{ckpt.step_dir_name(4)}"
    (tmp / ".rank00000").mkdir(parents=True)
    seen = []
    monkeypatch.setattr(ckpt, "_cause", lambda folder, e: seen.append(tmp.exists()) or "No space left on device [errno 28]")

    def full():
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4723456 vs 4723344")

    with pytest.raises(ckpt.CheckpointWriteError, match="No space left on device"):
        saver._guarded(4, tmp / ".rank00000", full)
    assert seen == [True] and not tmp.exists()  # probed while the partial save still held the disk, then removed
