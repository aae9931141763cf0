"""`plait plan --explain` names each bubble it prints: the share of all pipeline ranks' time (the
schedule's figure), the busiest rank's idle share of the step, and the textbook formula."""

import json
import re

import pytest

from plait.cli import main

ARGS = ["plan", "--model", "70b", "--gpu", "h100", "--nodes", "8", "--global-batch", "1024", "--tp", "8", "--pp", "4",
        "--zero", "1"]


def _percent(pattern, text):
    m = re.search(pattern, text)
    assert m, (pattern, text)
    return float(m.group(1)) / 100


def test_every_bubble_figure_says_what_it_is_a_share_of(capsys):
    assert main([*ARGS, "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["prediction"]
    assert main([*ARGS, "--explain"]) == 0
    out = capsys.readouterr().out
    step = next(x for x in out.splitlines() if x.startswith("step time"))
    bubble = next(x for x in out.splitlines() if x.startswith("bubble"))
    pipeline = next(x for x in out.splitlines() if x.strip().startswith("pipeline:"))
    # no bare "bubble N%" beside another bubble: each number is named by what it measures
    assert "bubble" not in step and "on the busiest rank:" in step
    idle = p["time_s"]["bubble"] / p["step_time_s"]
    assert abs(_percent(r"idle in the pipeline ([\d.]+)%", step) - idle) < 0.0006
    assert abs(_percent(r"([\d.]+)% of all pipeline ranks' time", bubble) - p["bubble"]) < 0.00006
    assert abs(_percent(r"the busiest rank idles ([\d.]+)% of the step", bubble) - idle) < 0.00006
    assert p["bubble"] > 2 * idle  # genuinely different numbers, so the labels matter
    assert abs(_percent(r"([\d.]+)% of all ranks' time as simulated", pipeline) - p["bubble"]) < 0.00006
    assert abs(_percent(r"even stages and free P2P would be ([\d.]+)%", pipeline) - 3 / (512 + 3)) < 0.00006


def test_one_stage_has_no_bubble(capsys):
    assert main(["plan", "--model", "8b", "--gpu", "h100", "--nodes", "1", "--global-batch", "64", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "bubble      none (one pipeline stage)" in out and "idle in the pipeline" not in out


def test_the_state_bytes_line_gives_the_tables_figure_at_the_peak(capsys):
    """The line said 1.75 B/param for 8b ZeRO-3 on 8 GPUs (the update's state) beside a table of
    1.5 (no gradient shard at one micro-batch's forward peak), and 16 against 14 on one GPU."""
    for argv, at_update, at_peak in ((["--model", "8b", "--dp", "8", "--zero", "3", "--global-batch", "8"], 1.75, 1.5),
                                     (["--model", "1b", "--nodes", "1", "--gpus-per-node", "1", "--global-batch", "1",
                                       "--dp", "1"], 16, 14)):
        assert main(["plan", *argv, "--json"]) == 0
        p = json.loads(capsys.readouterr().out)["prediction"]
        state = sum(p["memory_bytes"].get(k, 0) for k in ("parameters", "gradients", "master_weights",
                                                          "optimizer_states"))
        assert main(["plan", *argv, "--explain"]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if "state bytes/param" in x)
        assert f"-> {at_update:g} B/param" in line and f"at the activation peak {at_peak:g} B/param" in line, line
        params = float(re.search(r"x ([\d.e+]+) params", line).group(1))
        assert state / params == pytest.approx(at_peak, rel=1e-3)
