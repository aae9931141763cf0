"""`plait plan --explain` names each bubble it prints: the share of all pipeline ranks' time (the
schedule's figure), the busiest rank's idle share of the step, and the textbook formula."""

import json
import re

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
