"""--train.profile_steps A:B writes a Chrome trace of exactly those steps; a CUDA out-of-memory error
becomes one line naming the snapshot written (the CUDA paths themselves run on GPU machines only)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import MICRO_MODEL, micro_config
from dp_runs import cli_train
from plait.cli import main
from plait.errors import UserError
from plait.profile import snapshot_on_oom
from plait.preflight import preflight
from plait.train import train
from plait.validate import validate_config


def _trace(path):
    events = json.loads(path.read_text())["traceEvents"]
    steps = {e["name"]: e for e in events if str(e.get("name", "")).startswith("plait.step ")}
    return events, steps


def test_a_profiled_window_is_a_chrome_trace_of_those_steps(corpus, tmp_path, capsys):
    run = tmp_path / "r"
    train(preflight(micro_config(corpus, run, train={"steps": 4, "profile_steps": "2:3"})))
    trace = run / "profile" / "trace_steps2-3_rank0.json"
    assert f"plait: profiler trace of steps 2-3 in {trace}" in capsys.readouterr().err
    events, steps = _trace(trace)
    assert sorted(steps) == ["plait.step 2", "plait.step 3"]  # steps 1 and 4 ran outside the window
    # the optimizer step's matmuls are inside the step ranges
    s2 = steps["plait.step 2"]
    inside = [e for e in events if str(e.get("name", "")).startswith("aten::mm")
              and s2["ts"] <= e.get("ts", -1) <= s2["ts"] + s2["dur"]]
    assert inside
    assert [p.name for p in (run / "profile").iterdir()] == [trace.name]  # no memory snapshot on CPU


def test_a_window_the_run_ends_inside_is_written_at_the_end(corpus, tmp_path):
    run = tmp_path / "r"
    train(preflight(micro_config(corpus, run, train={"steps": 3, "profile_steps": "3:3"})))
    _, steps = _trace(run / "profile" / "trace_steps3-3_rank0.json")
    assert sorted(steps) == ["plait.step 3"]


def test_every_ranks_trace_is_named(corpus, tmp_path, capfd):
    # each rank writes its own trace: a line naming rank 0's alone sent users looking for rank 1's in it
    run = tmp_path / "r"
    assert main(cli_train(corpus, run, MICRO_MODEL, steps=3, extra=["--nproc", "2", "--train.micro_batch", "2",
                                                                     "--train.profile_steps", "2:3"])) == 0
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["trace_steps2-3_rank0.json", "trace_steps2-3_rank1.json"]
    lines = [x for x in capfd.readouterr().err.splitlines() if "profiler trace" in x]
    assert lines == [f"plait: profiler traces of steps 2-3 in {run / 'profile' / 'trace_steps2-3_rank*.json'} "
                     "(2 files, one per rank)"], lines


@pytest.mark.parametrize("spec, needle", [
    ("3:2", "write A:B with 1 <= A <= B"), ("0:2", "write A:B with 1 <= A <= B"), ("2", "write A:B, the first and last"),
    ("a:b", "write A:B, the first and last"), ("2:9", "ends after the run's last step (6)"),
])
def test_bad_profile_steps_are_one_line(corpus, tmp_path, spec, needle):
    with pytest.raises(UserError, match=f"^train.profile_steps = '{spec}': .*{re.escape(needle)}"):
        validate_config(micro_config(corpus, tmp_path / "r", train={"profile_steps": spec}))


def test_out_of_memory_writes_the_allocator_snapshot_and_says_where(tmp_path, monkeypatch):
    written = []
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: written.append(path) or open(path, "wb").close())
    with pytest.raises(UserError) as e, snapshot_on_oom(tmp_path, 3):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of "
                                          "79.18 GiB of which 3.00 GiB is free. Including non-PyTorch memory, ...")
    path = tmp_path / "profile" / "oom_memory_rank3.pickle"
    assert written == [str(path)] and path.is_file()
    msg = str(e.value)
    assert msg.startswith("CUDA out of memory (tried to allocate 4.00 GiB with 3.00 GiB free); memory snapshot in "
                          f"{path}") and "\n" not in msg and "--train.micro_batch" in msg


def test_a_window_before_the_resume_step_is_named(corpus, tmp_path, capfd):
    """--resume with a profile window the run already passed recorded nothing without a word."""
    run = tmp_path / "r"
    train(preflight(micro_config(corpus, run, train={"steps": 3})))
    capfd.readouterr()
    train(preflight(micro_config(corpus, run, train={"steps": 5, "profile_steps": "2:3"}, checkpoint={"resume": "auto"})))
    err = capfd.readouterr().err
    assert "train.profile_steps = '2:3' lies before step 4, where this run resumes: nothing is recorded; profile " \
           "steps within 4:5" in err, err
    assert not (run / "profile").exists()
