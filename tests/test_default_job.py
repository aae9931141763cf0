"""The README's first command, as a user runs it: `plait train` with every default."""

import json
import math

from plait.cli import main


def test_default_job_learns(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "run"), "--train.progress", "false"]) == 0
    err = capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) >= 3 and all(b < a for a, b in zip(val, val[1:]))  # falls at every evaluation
    assert rows[0]["loss"] > 0.9 * math.log(256) and val[-1] < 2.5
    assert "--- sample ---" in err and (tmp_path / "run" / "checkpoints" / "step_00000200").is_dir()
