"""examples/run.toml is a real config: it validates, `plait train --config` runs it, and each
commented-out option in it is a field of its section whose example value is accepted."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from plait.cli import main
from plait.config import build_config, load_toml
from plait.validate import validate_config

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "run.toml"


def test_the_example_validates():
    cfg = validate_config(build_config(load_toml(EXAMPLE)))
    assert cfg.model.preset == "tiny" and cfg.train.steps == 300 and cfg.train.out == "runs/example"


def test_every_commented_option_is_a_field_with_a_valid_value():
    section, seen = None, 0
    for line in EXAMPLE.read_text().splitlines():
        if m := re.match(r"^\[(\w+)\]", line):
            section = m.group(1)
        elif section and (m := re.match(r"^#\s*(\w+\s*=\s*(\"[^\"]*\"|[^\s#]+))", line)):
            raw = tomllib.loads(m.group(1))  # the option as it reads once uncommented
            build_config({section: raw})  # an unknown key or a value of the wrong type raises
            seen += 1
    assert seen >= 10


def test_plait_train_runs_the_example(corpus, tmp_path, capsys):
    out = tmp_path / "example"
    assert main(["train", "--config", str(EXAMPLE), "--out", str(out), "--data.path", str(corpus),
                 "--train.steps", "2", "--train.micro_batch", "2", "--train.seq_len", "64", "--train.eval_batches", "1",
                 "--train.progress", "false",
                 "--train.sample_tokens", "0", "--train.tensorboard", "false", "--train.compile", "off"]) == 0
    saved = tomllib.loads((out / "config.toml").read_text())
    assert saved["train"]["eval_every"] == 50 and saved["checkpoint"]["keep_last"] == 2  # from the file
    assert (out / "checkpoints" / "step_00000002").is_dir()
