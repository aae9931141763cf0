"""In-job restarts: a rank killed with SIGKILL (at a random step, or while it writes an asynchronous
checkpoint) or hanging inside a collective is detected, every worker is stopped, and the run goes on
from the newest valid checkpoint - ending bitwise where an uninterrupted run ends."""

from __future__ import annotations

import os
import random

import pytest

from fault_runs import (assert_no_workers_left, assert_same_state, bounded, fault_log, losses, rows, step_dir,
                        train_args)
from plait.cli import main

STEPS = 8


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """An uninterrupted 4-process ZeRO-3 run: the outcome every interrupted one must reproduce."""
    out = tmp_path_factory.mktemp("ref") / "run"
    with bounded(120):
        assert main(train_args(corpus, out, STEPS, nproc=4, zero=3, extra=["--checkpoint.every", "3"])) == 0
    return out


def _restart(run) -> tuple[int, dict]:
    """(the step whose record carries it, the restart note) of the run's single restart."""
    found = [(r["step"], r["restart"]) for r in rows(run) if "restart" in r]
    assert len(found) == 1, found
    return found[0]


def _assert_equal_after_restart(run, reference) -> None:
    first, note = _restart(run)
    assert first == note["from_step"] + 1  # the first record after the restart carries it
    ref, got = losses(reference), losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    # every loss logged after the restart, bit for bit (floats written by json round-trip exactly)
    assert {s: got[s] for s in got if s >= first} == {s: ref[s] for s in ref if s >= first}
    assert_same_state(step_dir(run, STEPS), step_dir(reference, STEPS))


def test_kill9_of_a_rank_at_a_random_step_restarts_and_ends_bitwise(corpus, tmp_path, monkeypatch, reference,
                                                                   capfd):
    rng = random.Random(os.urandom(8))
    rank, step = rng.randrange(4), rng.randrange(2, STEPS)
    monkeypatch.setenv("PLAIT_FAULTS", f"kill@rank={rank},step={step}")
    monkeypatch.setenv("PLAIT_FAULTS_LOG", str(tmp_path / "faults.jsonl"))
    run = tmp_path / "run"
    with bounded(150):
        assert main(train_args(corpus, run, STEPS, nproc=4, zero=3,
                               extra=["--checkpoint.every", "3", "--train.max_restarts", "2"])) == 0, (rank, step)
    assert [(f["kind"], f["rank"], f["step"]) for f in fault_log(tmp_path / "faults.jsonl")] == [("kill", rank, step)]
    _, note = _restart(run)
    assert note["rank"] == rank and "SIGKILL" in note["cause"], note
    assert note["from_step"] == (step - 1) // 3 * 3 and note["steps_lost"] == step - 1 - note["from_step"], note
    assert f"plait: restart 1 of 2: rank {rank} failed" in capfd.readouterr().err
    _assert_equal_after_restart(run, reference)
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert_no_workers_left()


def test_kill9_during_an_async_checkpoint_write_uses_the_previous_one(corpus, tmp_path, monkeypatch, reference):
    # rank 2 dies after writing its files of step 6, before the checkpoint is committed: step 6 never
    # appears, the restart resumes from step 3 and redoes 4..6
    monkeypatch.setenv("PLAIT_FAULTS", "kill@rank=2,step=6,during=write")
    monkeypatch.setenv("PLAIT_FAULTS_LOG", str(tmp_path / "faults.jsonl"))
    run = tmp_path / "run"
    with bounded(150):
        assert main(train_args(corpus, run, STEPS, nproc=4, zero=3, extra=[
            "--checkpoint.every", "3", "--checkpoint.async", "true", "--train.max_restarts", "1"])) == 0
    assert [(f["kind"], f["step"], f["during"]) for f in fault_log(tmp_path / "faults.jsonl")] == [("kill", 6, "write")]
    _, note = _restart(run)
    assert note["from_step"] == 3 and note["rank"] == 2, note
    _assert_equal_after_restart(run, reference)
    assert all(r.get("checkpoint_async") for r in rows(run) if "checkpoint_stall_s" in r)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000003", "step_00000006",
                                                                       "step_00000008"]
    assert_no_workers_left()


def test_a_rank_hanging_in_a_collective_is_detected_within_the_timeout_and_restarted(corpus, tmp_path,
                                                                                      monkeypatch):
    """Rank 1 sleeps inside step 4's backward while rank 0 waits in the reduce-scatter. The run was
    to stop after 5 steps (max_steps_this_run): the restart, from step 2, stops there too (it
    counted 5 more from the checkpoint it resumed from, and ran to step 7)."""
    monkeypatch.setenv("PLAIT_FAULTS", "hang@rank=1,step=4,s=600")
    monkeypatch.setenv("PLAIT_FAULTS_LOG", str(tmp_path / "faults.jsonl"))
    run = tmp_path / "run"
    timeout = 3
    with bounded(120):
        assert main(train_args(corpus, run, 10, nproc=2, zero=3, extra=[
            "--checkpoint.every", "2", "--train.max_restarts", "1", "--parallel.timeout_s", timeout,
            "--train.max_steps_this_run", "5"])) == 0
    (hang,) = fault_log(tmp_path / "faults.jsonl")
    _, note = _restart(run)
    assert "CollectiveError" in note["cause"] and f"parallel.timeout_s = {timeout} s" in note["cause"], note
    # rank 0 timed out waiting; the hung rank is the one that raised nothing (it named rank 0 only)
    assert "rank(s) 1 raised no error and were still running: look there first" in note["cause"], note
    latency = note["detected_at"] - hang["time"]
    assert timeout <= latency < timeout + 5, latency  # the collective's timeout, not a harness bound
    assert note["from_step"] == 2 and sorted(losses(run)) == list(range(1, 6))
    assert max(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*")) == 5
    assert_no_workers_left()


def test_a_restart_by_torchrun_or_slurm_resumes_by_itself_and_is_logged(tmp_path, monkeypatch, capsys, corpus):
    from plait.config import build_config
    from plait.supervise import restart_note, resume_after_outer_restart

    for var in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", "PLAIT_RESTART"):
        monkeypatch.delenv(var, raising=False)
    assert not resume_after_outer_restart(build_config({})).checkpoint.resume  # a first start
    assert restart_note(tmp_path, 0) is None
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 1.0}}\n' for s in range(1, 8)) + '{"st')
    for var, who in (("TORCHELASTIC_RESTART_COUNT", "torchrun"), ("SLURM_RESTART_COUNT", "SLURM")):
        monkeypatch.setenv(var, "2")
        assert resume_after_outer_restart(build_config({})).checkpoint.resume == "auto"
        note = restart_note(tmp_path, 4)
        assert {k: note[k] for k in ("count", "by", "from_step", "steps_lost")} == \
            {"count": 2, "by": who, "from_step": 4, "steps_lost": 3}
        assert f"plait: restart 2 by {who}; resumed from step 4 (3 step(s) to redo)" in capsys.readouterr().err
        monkeypatch.delenv(var)
    # the outer launcher restarts its processes: plait's own restarts are refused there
    for k, v in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999",
                     TORCHELASTIC_RUN_ID="t").items():
        monkeypatch.setenv(k, v)
    assert main(train_args(corpus, tmp_path / "r", 2, extra=["--train.max_restarts", "2"])) == 2
    assert "train.max_restarts = 2: torchrun started these processes, so it must restart them: use torchrun " \
           "--max-restarts 2" in capsys.readouterr().err


def test_a_restart_stops_where_its_own_invocation_planned_not_where_an_older_one_did(tmp_path):
    """end_step.json names its invocation: a restart whose first attempt died before writing it
    found an earlier invocation's stop there, and ended at once at that older step."""
    from plait.supervise import END_FILE, planned_end

    first = {"PLAIT_ATTEMPT": "0", "PLAIT_INVOCATION": "a"}
    assert planned_end(tmp_path, 10, first) == 10
    assert planned_end(tmp_path, 15, {**first, "PLAIT_ATTEMPT": "1"}) == 10  # a restart of the same one
    # the next invocation's restart, its first attempt gone before it wrote the file: its own plan
    assert planned_end(tmp_path, 20, {"PLAIT_ATTEMPT": "1", "PLAIT_INVOCATION": "b"}) == 20
    assert planned_end(tmp_path, 25, {"PLAIT_ATTEMPT": "2", "PLAIT_INVOCATION": "b"}) == 20
    # a SLURM requeue keeps its job id: it stops where the job's first allocation planned to
    slurm = {"SLURM_JOB_ID": "7", "PLAIT_INVOCATION": "c"}
    assert planned_end(tmp_path, 30, slurm) == 30
    assert planned_end(tmp_path, 38, {**slurm, "SLURM_RESTART_COUNT": "1", "PLAIT_INVOCATION": "d"}) == 30
    assert planned_end(tmp_path, 40, {"SLURM_JOB_ID": "8", "SLURM_RESTART_COUNT": "1"}) == 40
    # torchrun's named rendezvous; its static one ("none") is every job's and names nothing
    assert planned_end(tmp_path, 50, {"TORCHELASTIC_RUN_ID": "job1"}) == 50
    assert planned_end(tmp_path, 55, {"TORCHELASTIC_RUN_ID": "job1", "TORCHELASTIC_RESTART_COUNT": "1"}) == 50
    (tmp_path / END_FILE).write_text('{"end": 3}\n')  # written before the file named its invocation
    assert planned_end(tmp_path, 60, {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "1"}) == 60


def test_an_error_of_the_programs_own_kind_is_not_restarted(tmp_path, capsys):
    """A ValueError in a worker (a shape that does not split, a bug) happens again on every restart:
    --train.max_restarts 2 ran it three times and then advised running it again. A fault a restart
    cures (a process killed, a collective timed out, the device) is still restarted."""
    from plait.config import build_config
    from plait.launch import SpawnError
    from plait.supervise import run_workers

    cfg = build_config({"train": {"out": str(tmp_path / "run"), "max_restarts": 2}})
    (tmp_path / "run").mkdir()
    for message, tries in (("ValueError: reduce-scatter along axis 0: size 255 is not divisible", 1),
                           ("TypeError: unsupported operand", 1),
                           ("TimeoutError: rank 1 still running after 60 s", 3),
                           ("process ended with signal SIGKILL and recorded no Python error", 3)):
        calls = []

        def attempt(cfg, env, message=message):
            calls.append(env["PLAIT_ATTEMPT"])
            raise SpawnError(1, message, {1: ""}, {1: 1})

        with pytest.raises(SpawnError):
            run_workers(cfg, attempt)
        assert len(calls) == tries, (message, calls)
    capsys.readouterr()


def test_a_killed_rank_without_restarts_ends_in_one_line_that_says_how_to_continue(corpus, tmp_path, monkeypatch,
                                                                                 capfd):
    monkeypatch.setenv("PLAIT_FAULTS", "kill@rank=1,step=4")
    run = tmp_path / "run"
    with bounded(90):
        code = main(train_args(corpus, run, 5, nproc=2, zero=2, extra=["--checkpoint.every", "2"]))
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("plait train: error:")]
    assert code == 1 and "Traceback" not in err and len(lines) == 1, err
    # the peer may or may not have failed too before the launcher stopped it ("1 other rank(s) failed after it")
    assert lines[0].startswith("plait train: error: rank 1 failed: process ended with signal SIGKILL") and \
        lines[0].endswith("; the newest valid checkpoint is step_00000002: continue with "
                          f"`plait train --out {run} --resume --nproc 2 --dp 2 --zero 2 --parallel.timeout_s 20.0`; "
                          "--train.max_restarts K restarts it by itself"), lines[0]
    assert_no_workers_left()
    monkeypatch.delenv("PLAIT_FAULTS")
    with bounded(90):  # what the line says to do works
        assert main(train_args(corpus, run, 5, nproc=2, zero=2, extra=["--checkpoint.every", "2", "--resume"])) == 0
    assert sorted(losses(run)) == [1, 2, 3, 4, 5]
