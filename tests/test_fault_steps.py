"""Faults inside a step: a NaN gradient on one rank is skipped on every rank; max_bad_steps in a row
stop the run with the last good state saved; a flipped bit in one replica is caught by the replica
check; a slow rank is named. Plus the arithmetic behind them, without processes."""

from __future__ import annotations

import math

import pytest
import torch

from fault_runs import assert_no_workers_left, assert_same_state, bounded, rows, step_dir, train_args
from plait.bad_steps import StepHealth
from plait.checkpointer import Checkpointer
from plait.cli import main
from plait.config import build_config
from plait.errors import UserError
from plait.faults import parse
from plait.replica import checksum


@pytest.fixture(scope="module")
def nan_once(corpus, tmp_path_factory):
    """2-process ZeRO-3 run with a NaN in rank 1's gradient at step 3, a checkpoint every step."""
    run = tmp_path_factory.mktemp("nan") / "run"
    mp = pytest.MonkeyPatch()
    mp.setenv("PLAIT_FAULTS", "nan@rank=1,step=3")
    try:
        with bounded(90):
            assert main(train_args(corpus, run, 5, nproc=2, zero=3,
                                   extra=["--checkpoint.every", "1", "--checkpoint.keep_last", "10"])) == 0
    finally:
        mp.undo()
    return run


def test_a_nan_gradient_on_one_rank_skips_the_step_on_every_rank(nan_once):
    r = {x["step"]: x for x in rows(nan_once)}
    assert sorted(r) == [1, 2, 3, 4, 5]
    assert r[3].get("skipped") is True and not math.isfinite(r[3]["grad_norm"])
    assert all("skipped" not in r[s] and math.isfinite(r[s]["loss"]) for s in (1, 2, 4, 5))
    assert r[5]["loss"] < r[2]["loss"]  # training goes on
    # no checkpoint at a skipped step: the newest checkpoint always holds a good step's state (that
    # the skipped steps left every rank's state untouched is checked below, with max_bad_steps)
    assert sorted(p.name for p in (nan_once / "checkpoints").iterdir()) == [
        "step_00000001", "step_00000002", "step_00000004", "step_00000005"]
    assert_no_workers_left()


def test_max_bad_steps_in_a_row_stop_with_the_last_good_state(corpus, tmp_path, monkeypatch, capfd, nan_once):
    monkeypatch.setenv("PLAIT_FAULTS", "nan@rank=0,step=3,count=10")
    run = tmp_path / "run"
    with bounded(90):
        code = main(train_args(corpus, run, 8, nproc=2, zero=3, extra=["--train.max_bad_steps", "3"]))
    err = capfd.readouterr().err
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("plait train: error: rank 0: train.max_bad_steps = 3: steps 3-5 each had a non-finite")
    assert f"the state of step 2 is saved in {step_dir(run, 2)}" in last
    assert [x["step"] for x in rows(run)] == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]
    # the live state after three skipped steps, saved at the stop, is bit for bit - on both ranks: weights,
    # Adam moments, step count - that of a run after steps 1 and 2 (warmup: the LR does not depend on steps)
    assert_same_state(step_dir(run, 2), step_dir(nan_once, 2))
    assert_no_workers_left()


def test_a_flipped_bit_in_one_replica_is_caught_at_the_next_check(corpus, tmp_path, monkeypatch, capfd):
    # DDP on 3 ranks: bit 0 of one of rank 1's fp32 weights flips before step 3; checks at steps 2, 4, ...
    monkeypatch.setenv("PLAIT_FAULTS", "flip@rank=1,step=3,bit=0")
    run = tmp_path / "run"
    with bounded(90):
        code = main(train_args(corpus, run, 8, nproc=3, zero=0, extra=[
            "--train.replica_check_every", "2", "--checkpoint.every", "2", "--train.max_restarts", "1"]))
    err = capfd.readouterr().err
    last = err.strip().splitlines()[-1]
    assert code == 1 and last.startswith(
        "plait train: error: rank 0 failed: ReplicaMismatch: replica check at step 4: rank(s) [1] hold "
        "parameters that differ from ranks [0, 2]"), err
    assert f"the newest valid checkpoint is step_00000002: continue with `plait train --out {run} --resume --nproc 3 --dp 3 --parallel.timeout_s 20.0`" in last
    assert "restart" not in err.replace("max_restarts", "")  # a corrupted replica is not restarted over
    # the line says what to do: the ranks' stacks go to the run folder, not 40 lines above it
    assert "Traceback" not in err and f"(each failed rank's traceback: {run / 'failure-tracebacks.txt'})" in last
    assert "--- rank 0 ---\nTraceback" in (run / "failure-tracebacks.txt").read_text()
    assert [x["step"] for x in rows(run)] == [1, 2, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]  # none after the flip
    assert_no_workers_left()


def test_a_slow_rank_is_named(corpus, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("PLAIT_FAULTS", "slow@rank=2,step=1,ms=80")  # 80 ms of CPU a step on rank 2
    run = tmp_path / "run"
    with bounded(90):
        assert main(train_args(corpus, run, 4, nproc=3, zero=1, extra=["--train.straggler_every", "2"])) == 0
    reports = [x for x in rows(run) if "rank_cpu_s" in x]
    assert [x["step"] for x in reports] == [2, 4]
    for x in reports:
        assert x["stragglers"] == [2], x
        assert x["rank_cpu_s"][2] > 0.08 > max(x["rank_cpu_s"][:2]), x
    assert "plait: rank 2 is slow:" in capfd.readouterr().err
    assert_no_workers_left()


def test_checksum_sees_every_single_bit_flip():
    torch.manual_seed(0)
    x = torch.randn(1000)
    base = checksum([x])
    assert torch.equal(base, checksum([x.clone()]))
    words = x.view(torch.int32)
    for i, bit in [(0, 0), (17, 5), (999, 22), (500, 30), (3, 31)]:
        y = words.clone()
        y[i] ^= 1 << bit
        assert not torch.equal(checksum([y.view(torch.float32)]), base), (i, bit)
    assert not torch.equal(checksum([x.bfloat16()]), checksum([x.bfloat16() * -1]))  # 16-bit words too


def test_step_health_counts_bad_steps_in_a_row_and_spikes():
    said = []
    h = StepHealth(max_bad=2, spike_factor=2.0, start=0, say=said.append)
    for s in range(1, 12):
        assert h.check(s, 1.0, 0.5) == {}
    assert h.check(12, 5.0, 0.5) == {"loss_spike": True, "loss_median": 1.0}
    assert h.check(13, float("nan"), 0.5) == {"skipped": True} and not h.stop
    assert h.check(14, 1.0, float("inf")) == {"skipped": True} and h.stop and h.last_good == 12
    assert h.check(15, 1.0, 0.5) == {} and not h.stop and h.last_good == 15  # "in a row": a good step resets
    assert len(said) == 3 and "loss spike" in said[0] and "step 13 skipped" in said[1]


def test_checkpoint_every_minutes(monkeypatch, tmp_path):
    cfg = build_config({"checkpoint": {"every_minutes": 0.5, "at_end": False}})
    now = [100.0]
    monkeypatch.setattr("plait.checkpointer.time.monotonic", lambda: now[0])
    c = Checkpointer(cfg, tmp_path, rank=0, world=1)
    assert not c.due(1, 10)
    now[0] += 31
    assert c.due(2, 10)
    with c.timed(2, {}):
        pass
    assert not c.due(3, 10)  # the clock starts again at each save


def test_fault_specs_are_checked():
    f = parse("kill@rank=1,step=5; nan@step=2,count=3")
    assert [(x.kind, x.rank, x.step, x.count) for x in f] == [("kill", 1, 5, 1), ("nan", 0, 2, 3)]
    for bad, needle in [("boom@rank=1", "unknown fault 'boom'"), ("kill@rnk=1", "unknown key 'rnk'"),
                        ("kill@step=x", "step='x'")]:
        with pytest.raises(UserError, match=needle):
            parse(bad)
