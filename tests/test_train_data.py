"""`plait train` on a `--data.mix` of prepared folders, end to end, with its trackers: every folder
feeds training and validation at its weight, and W&B gets the run (a fake `wandb` module stands in
for the library, as in test_trackers)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from conftest import micro_config
from plait.data import MixedData
from plait.prepare import prepare
from plait.errors import UserError
from plait.tokenizer import ByteTokenizer
from plait.preflight import preflight
from plait.train import train

STEPS = 8


def _folder(root, letter: str):
    """A prepared folder whose documents hold one letter only (and the newlines that end lines)."""
    src = root / f"{letter}_src"
    src.mkdir()
    for i in range(12):
        (src / f"doc_{i:02d}.txt").write_text((letter * 63 + "\n") * 8)
    return prepare([str(src)], root / letter, ByteTokenizer(), val_fraction=0.25, quiet=True)


def _source(row) -> str:
    """Which folder a window came from: the one letter among its bytes."""
    letters = set(bytes(row.tolist()).decode()) - {"\n"}
    assert len(letters) == 1, letters  # a window never mixes folders
    return letters.pop()


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = []

    class Run:
        offline = True

        def log(self, data, step):
            calls.append(("log", step))

        def finish(self):
            calls.append(("finish",))

    mod = types.ModuleType("wandb")
    mod.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return calls


def test_a_mix_trains_and_validates_on_every_folder_at_its_weight(tmp_path, monkeypatch, capsys, fake_wandb):
    a, b = _folder(tmp_path, "a"), _folder(tmp_path, "b")
    seen = {"train": [], "val": []}
    rows = MixedData._rows

    def spy(self, split, plan, seq_len):
        out = rows(self, split, plan, seq_len)
        seen[split].append([_source(r) for r in out])
        return out

    monkeypatch.setattr(MixedData, "_rows", spy)
    run = tmp_path / "run"
    cfg = micro_config("", run, train={"steps": STEPS, "eval_every": 4, "progress": True, "wandb": "plait-test"})
    cfg.data.path, cfg.data.mix = "", f"{a}:1,{b}:3"
    summary = train(preflight(cfg))
    # training: each step's 4 rows are 1 from a and 3 from b (weights 1:3), never the default corpus
    assert len(seen["train"]) == STEPS and all(sorted(s) == ["a", "b", "b", "b"] for s in seen["train"])
    # validation reads the held-out documents of both folders
    assert {x for batch in seen["val"] for x in batch} == {"a", "b"}
    vals = [json.loads(x).get("val_loss") for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert vals[3] is not None and summary["val_loss"] == vals[7] < vals[3]  # the mix's held-out loss falls
    err = capsys.readouterr().err
    assert f"plait: trackers: metrics.jsonl ({run / 'metrics.jsonl'}), wandb (project plait-test, offline)" in err
    init = fake_wandb[0][1]
    assert (init["project"], init["name"]) == ("plait-test", "run")
    assert init["config"]["data"]["mix"] == f"{a}:1,{b}:3" and init["config"]["train"]["steps"] == STEPS
    assert [c[1] for c in fake_wandb if c[0] == "log"] == list(range(1, STEPS + 1))
    assert fake_wandb[-1] == ("finish",)


def test_a_wandb_project_without_wandb_is_refused_before_training(corpus, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(UserError, match=r"^train.wandb = 'p': needs the wandb package"):
        preflight(micro_config(corpus, tmp_path / "r", train={"wandb": "p"}))
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
