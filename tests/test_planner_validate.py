"""`plait plan --validate`: the planner's model-state bytes and traffic match a real plait run."""

import json

import pytest

from plait.cli import main

SHAPE = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "96", "--vocab", "256",
         "--seq", "32", "--gpu", "h100", "--nodes", "1", "--gpus-per-node", "2", "--dp", "2",
         "--micro-batch", "2", "--global-batch", "4", "--validate", "--validate-steps", "3", "--json"]


@pytest.mark.parametrize("zero", ["1", "3"])
def test_predicted_state_bytes_and_traffic_equal_the_run(zero, capsys):
    assert main(["plan", *SHAPE, "--zero", zero]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["quantity"]: r for r in out["comparison"]}
    for name in ("parameters (bytes)", "gradients (bytes)", "master + optimizer (bytes)"):
        r = rows[name]
        # plait pads each shard to a multiple of N: at most N-1 elements per unit of difference
        assert abs(r["measured"] - r["predicted"]) <= 0.002 * r["predicted"], (name, r)
    sent = rows["sent per GPU per step (bytes)"]
    expected = sent["predicted"]
    if zero == "3":
        # the planner prices the textbook 3P(N-1)/N; plait keeps its root unit (embedding, output,
        # norm gains: 2*256*64 + 5*64 fp32 elements here) gathered from forward into backward
        expected -= (2 * 256 * 64 + 5 * 64) * 4 * (2 - 1) / 2
    assert sent["measured"] == expected + 12, sent  # + the 12-byte statistics all-reduce: 2 x 12 x (N-1)/N
    assert rows["step time (s)"]["comparable"] is False  # a CPU run is not a GPU prediction


def test_validate_refuses_layouts_without_an_engine(capsys):
    argv = [a for a in SHAPE if a != "--json"]
    argv[argv.index("--dp") + 1] = "1"
    assert main(["plan", *argv, "--tp", "2"]) == 2
    assert "tp 2" in capsys.readouterr().err
