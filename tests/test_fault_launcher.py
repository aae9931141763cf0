"""kill -9 of `plait train --nproc 2` itself: its workers notice (parent-death signal, and a watcher
thread) and end within seconds; every checkpoint left is valid, and --resume ends bitwise where an
uninterrupted run ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

from fault_runs import (assert_no_workers_left, assert_same_state, bounded, losses, rows, step_dir, train_args,
                        with_marker)
from plait import checkpoint as ckpt
from plait.cli import main

STEPS = 30


def test_killing_the_launcher_leaves_no_worker_and_resume_is_bitwise(corpus, tmp_path):
    common = ["--checkpoint.every", "2"]
    ref = tmp_path / "ref"
    with bounded(90):
        assert main(train_args(corpus, ref, STEPS, nproc=2, zero=3, extra=common)) == 0

    run, marker = tmp_path / "run", uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_")}
    # rank 0 burns a second of CPU a step: the workers, left alone, would still be training 30 s later
    env.update(PLAIT_TEST_MARKER=marker, PLAIT_FAULTS="slow@rank=0,step=1,ms=1000", OMP_NUM_THREADS="1")
    launcher = subprocess.Popen([sys.executable, "-m", "plait.cli"] + train_args(corpus, run, STEPS, nproc=2, zero=3,
                                                                                 extra=common),
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not ((run / "metrics.jsonl").is_file() and len(rows(run)) >= 3):
            assert launcher.poll() is None, launcher.stderr.read().decode()
            assert time.monotonic() < deadline, "the run did not reach step 3"
            time.sleep(0.05)
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
        for pid in with_marker(marker):
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()
        launcher.stderr.close()

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
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_")}
    # rank 0 burns a second of CPU a step: workers that ignored the signal would go on training
    env.update(PLAIT_TEST_MARKER=marker, PLAIT_FAULTS="slow@rank=0,step=1,ms=1000", OMP_NUM_THREADS="1")
    launcher = subprocess.Popen([sys.executable, "-m", "plait.cli"] + train_args(
        corpus, run, STEPS, nproc=2, zero=3, extra=["--checkpoint.every", "2"]),
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # `plait train ... &` in a script
    try:
        deadline = time.monotonic() + 90
        while not ((run / "metrics.jsonl").is_file() and len(rows(run)) >= 3):
            assert launcher.poll() is None, launcher.stderr.read().decode()
            assert time.monotonic() < deadline, "the run did not reach step 3"
            time.sleep(0.05)
        os.killpg(launcher.pid, signal.SIGINT)
        t0 = time.monotonic()
        code = launcher.wait(timeout=30)
        stopped = time.monotonic() - t0
        err = launcher.stderr.read().decode()
    finally:
        for pid in with_marker(marker):
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()
        launcher.stderr.close()
    assert code == 130 and stopped < 10, (code, stopped, err)
    last = err.strip().splitlines()[-1]
    assert last.startswith("plait train: interrupted; the newest valid checkpoint is step_0000000") and \
        last.endswith(f"continue with `plait train --out {run} --resume`") and "Traceback" not in err, err
    assert len(rows(run)) < STEPS and not with_marker(marker)
