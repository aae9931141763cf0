"""kill -9 of `plait train --nproc 2` itself: its workers notice (parent-death signal, and a watcher
thread) and end within seconds; every checkpoint left is valid, and --resume ends bitwise where an
uninterrupted run ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from fault_runs import (assert_no_workers_left, assert_same_state, bounded, losses, rows, step_dir, train_args,
                        with_marker)
from plait import checkpoint as ckpt
from plait.cli import main

STEPS = 30


# the layout `_start` runs, which the line's resume command repeats (a resume takes the run's config, not its layout)
LAYOUT = "--nproc 2 --dp 2 --zero 3 --parallel.timeout_s 20.0"


def _start(corpus, run, marker, **kw) -> subprocess.Popen:
    """`plait train --nproc 2` in a session of its own, rank 0 burning a second of CPU a step (workers
    that ignored a stop would go on training), once it has logged step 3."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_")}
    env.update(PLAIT_TEST_MARKER=marker, PLAIT_FAULTS="slow@rank=0,step=1,ms=1000", OMP_NUM_THREADS="1")
    launcher = subprocess.Popen([sys.executable, "-m", "plait.cli"] + train_args(
        corpus, run, STEPS, nproc=2, zero=3, extra=["--checkpoint.every", "2"]),
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, **kw)
    deadline = time.monotonic() + 90
    while not ((run / "metrics.jsonl").is_file() and len(rows(run)) >= 3):
        assert launcher.poll() is None, launcher.stderr.read().decode()
        assert time.monotonic() < deadline, "the run did not reach step 3"
        time.sleep(0.05)
    return launcher


def _stop(launcher, marker, send) -> tuple[int, float, str]:
    """Send the signal (`send()`), wait for the launcher: (exit code, seconds it took, its stderr)."""
    try:
        send()
        t0 = time.monotonic()
        code = launcher.wait(timeout=30)
        return code, time.monotonic() - t0, launcher.stderr.read().decode()
    finally:
        _end(launcher, marker)


def _end(launcher, marker) -> None:
    """Whatever a test left running of this launch goes."""
    for pid in with_marker(marker):
        os.kill(pid, signal.SIGKILL)
    if launcher.poll() is None:
        launcher.kill()
    launcher.wait()
    launcher.stderr.close()


def test_killing_the_launcher_leaves_no_worker_and_resume_is_bitwise(corpus, tmp_path):
    common = ["--checkpoint.every", "2"]
    ref = tmp_path / "ref"
    with bounded(90):
        assert main(train_args(corpus, ref, STEPS, nproc=2, zero=3, extra=common)) == 0

    run, marker = tmp_path / "run", uuid.uuid4().hex
    # rank 0 burns a second of CPU a step: the workers, left alone, would still be training 30 s later
    launcher = _start(corpus, run, marker)
    try:
        workers = with_marker(marker) - {launcher.pid}
        assert len(workers) >= 2  # the fork server and both ranks carry the launcher's environment
        os.kill(launcher.pid, signal.SIGKILL)
        t0 = time.monotonic()
        launcher.wait(timeout=10)
        while with_marker(marker) and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        gone_after = time.monotonic() - t0
        assert not with_marker(marker), f"workers still running 30 s after the launcher died: {with_marker(marker)}"
        assert gone_after < 5, gone_after  # within seconds, not at the 30 s limit
    finally:
        _end(launcher, marker)

    saved = ckpt.list_checkpoints(run / "checkpoints")
    assert saved and STEPS not in [s for s, _ in saved]  # it was killed mid-run ...
    assert [ckpt.verify(f) for _, f in saved] == [None] * len(saved)  # ... and every checkpoint it left is whole
    with bounded(90):
        assert main(train_args(corpus, run, STEPS, nproc=2, zero=3, extra=common + ["--resume"])) == 0
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-")]  # leftovers removed
    assert losses(run) == losses(ref)
    assert_same_state(step_dir(run, STEPS), step_dir(ref, STEPS))
    assert_no_workers_left()


def test_ctrl_c_stops_every_worker_at_once_and_says_where_to_continue(corpus, tmp_path):
    """SIGINT to the whole process group (Ctrl-C in a terminal, `kill -INT -PGID`), here of a launcher
    started as a script's background job, which POSIX shells start with SIGINT ignored: the launcher
    takes it anyway, and its workers, which would inherit the ignoring, must stop too, within
    seconds, not run on until the launcher's grace period ends (30 s). The launcher says which
    checkpoint --resume continues from."""
    run, marker = tmp_path / "run", uuid.uuid4().hex
    launcher = _start(corpus, run, marker, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    code, took, err = _stop(launcher, marker, lambda: os.killpg(launcher.pid, signal.SIGINT))
    assert code == 130 and took < 10, (code, took, err)
    last = err.strip().splitlines()[-1]
    assert last.startswith("plait train: interrupted; the newest valid checkpoint is step_0000000") and \
        last.endswith(f"continue with `plait train --out {run} --resume {LAYOUT}`") and "Traceback" not in err, err
    assert len(rows(run)) < STEPS and not with_marker(marker)


@pytest.mark.parametrize("to", ["launcher", "one worker"])
def test_sigusr1_saves_the_step_every_rank_is_at_and_stops(corpus, tmp_path, to):
    """A scheduler's advance notice (SIGUSR1), to the launcher (which relays it) or to one worker only
    (srun's tasks get it each; here one is enough): the ranks agree on a step, save it, and leave;
    the run says where to continue, and continues from there."""
    run, marker = tmp_path / "run", uuid.uuid4().hex
    launcher = _start(corpus, run, marker)

    def send():
        if to == "launcher":
            os.kill(launcher.pid, signal.SIGUSR1)
        else:
            os.kill(max(with_marker(marker) - {launcher.pid}), signal.SIGUSR1)  # the newest: a rank, not the fork server
    code, took, err = _stop(launcher, marker, send)
    stopped = rows(run)[-1]["step"]
    assert code == 143 and took < 10 and stopped < STEPS, (code, took, err)
    assert f"plait: SIGUSR1: stopped after step {stopped}, its checkpoint saved" in err, err
    assert err.strip().splitlines()[-1] == (f"plait train: stopped by SIGUSR1; the newest valid checkpoint is "
                                            f"step_{stopped:08d}: continue with `plait train --out {run} --resume {LAYOUT}`")
    assert ckpt.verify(step_dir(run, stopped)) is None and not with_marker(marker)
    # what a torchrun restart of these workers reads, so as not to train on (tests/test_user_launch.py)
    # (with the torchrun job that made it: none here, plait's own launcher)
    assert json.loads((run / "stopped.json").read_text()) == {"signal": "SIGUSR1", "step": stopped, "job": None}
    if to == "launcher":  # the stop is the same either way: one resume proves it continues
        with bounded(90):
            assert main(train_args(corpus, run, stopped + 2, nproc=2, zero=3, extra=["--resume"])) == 0
        assert sorted(losses(run)) == list(range(1, stopped + 3))
        assert not (run / "stopped.json").exists()  # a new invocation continues the run


def test_ctrl_c_ends_workers_blocked_inside_a_collective_within_seconds(tmp_path):
    """Ctrl-C while every rank waits inside a collective that will not complete (NCCL's barrier
    behind a rank that already left, on 4 x H200): their KeyboardInterrupt cannot run, and they sat
    there until the launcher's agent killed them 30 s later. Each ends itself a few seconds after the
    signal now (plait.lifeline.after_ctrl_c)."""
    marker, ready = uuid.uuid4().hex, str(tmp_path / "ready")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_")}
    env.update(PLAIT_TEST_MARKER=marker, OMP_NUM_THREADS="1")
    tests = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {tests!r}); import fault_runs; from plait.launch import spawn; "
            f"spawn(fault_runs.blocked_in_a_collective, ({ready!r},), nproc=2)")
    launcher = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 90
    while not all(os.path.exists(f"{ready}{r}") for r in (0, 1)):
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.stderr.read().decode()
        time.sleep(0.05)
    time.sleep(0.5)  # inside the barriers
    code, took, err = _stop(launcher, marker, lambda: os.killpg(launcher.pid, signal.SIGINT))
    assert took < 15, (code, took, err)
    assert not with_marker(marker)


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_stop_notice_before_training_stops_at_the_first_step_saved(corpus, tmp_path, capfd, monkeypatch, nproc):
    """SIGUSR1 during start-up (import, rendezvous, loading): its default action killed the rank with
    nothing said, and its peers waited out parallel.timeout_s. Now it is held, and the run stops,
    saved, at the end of its first step. To `plait train --nproc N` before it had started its
    workers, the notice was held and never passed on: the run trained to its end."""
    from plait import preempt

    monkeypatch.setitem(preempt._EARLY, "got", 0)
    old = signal.getsignal(signal.SIGUSR1)
    try:
        preempt.catch_early()
        os.kill(os.getpid(), signal.SIGUSR1)  # as a scheduler's notice would, before train() runs
        run = tmp_path / "run"
        with bounded(60):
            assert main(train_args(corpus, run, 6, nproc=nproc)) == 143
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert "stopped by SIGUSR1" in capfd.readouterr().err
    assert [s for s, _ in ckpt.list_checkpoints(run / "checkpoints")] == [1] and len(rows(run)) == 1


def test_ctrl_c_as_a_worker_starts_ends_it_without_a_traceback(tmp_path):
    """Ctrl-C as the workers start (before the training loop handles it): each worker's
    KeyboardInterrupt reached multiprocessing's bootstrap, which printed "Process ForkServerProcess-N:
    Traceback ..." under the run's one line. A launched rank now ends quietly with 130."""
    code = ("from plait import launch\n"
            "def boom():\n    raise KeyboardInterrupt\n"
            f"launch._worker(boom, (), {{}}, 0, {str(tmp_path)!r})\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 130 and "Traceback" not in p.stderr, (p.returncode, p.stderr)
