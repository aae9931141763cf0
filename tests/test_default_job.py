"""The README's first command, as a user runs it: `plait train` with every default, in its own
process (started with the session and checked last: tests/conftest.py says why)."""

import json
import math


def test_default_job_learns(default_job):
    proc, root = default_job
    rc = proc.wait(timeout=1200)
    out = (root / "stderr.txt").read_text()
    assert rc == 0, out[-3000:]
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) >= 3 and all(b < a for a, b in zip(val, val[1:]))  # falls at every evaluation
    assert rows[0]["loss"] > 0.9 * math.log(256) and val[-1] < 2.5
    assert "--- sample ---" in out and (root / "run" / "checkpoints" / "step_00000200").is_dir()
    assert "Traceback" not in out
