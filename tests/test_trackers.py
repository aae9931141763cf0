"""MetricsLog's trackers: metrics.jsonl always, W&B when a project is given (a fake `wandb` module
stands in for the library so the test runs without it; a real offline run where it is installed),
and the one-line description of what is active."""

import json
import sys
import types

import pytest

from plait.errors import UserError
from plait.metrics import MetricsLog, check_wandb

RECORDS = [{"step": 1, "loss": 5.0, "lr": 1e-4, "mfu": "n/a", "tokens_per_s": 100.0},
           {"step": 2, "loss": 4.5, "lr": 2e-4, "mfu": "n/a", "tokens_per_s": 110.0, "val_loss": 4.7}]


class FakeRun:
    offline = True

    def __init__(self, calls):
        self.calls = calls

    def log(self, data, step):
        self.calls.append(("log", dict(data), step))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = []
    mod = types.ModuleType("wandb")

    def init(**kw):
        calls.append(("init", kw))
        return FakeRun(calls)

    mod.init = init
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return calls


def test_wandb_gets_every_numeric_metric_at_its_step(tmp_path, fake_wandb):
    log = MetricsLog(tmp_path, tensorboard=False, wandb_project="plait-test", run_name="tiny", config={"train": {"steps": 2}})
    assert log.describe() == (f"trackers: metrics.jsonl ({tmp_path / 'metrics.jsonl'}), "
                              "wandb (project plait-test, offline)")
    for r in RECORDS:
        log.log(r)
    log.close()
    init = fake_wandb[0][1]
    assert (init["project"], init["name"], init["config"], init["dir"]) == ("plait-test", "tiny",
                                                                            {"train": {"steps": 2}}, str(tmp_path))
    assert fake_wandb[1:] == [("log", {"loss": 5.0, "lr": 1e-4, "tokens_per_s": 100.0}, 1),
                              ("log", {"loss": 4.5, "lr": 2e-4, "tokens_per_s": 110.0, "val_loss": 4.7}, 2),
                              ("finish",)]
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == RECORDS


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, fake_wandb):
    MetricsLog(tmp_path, tensorboard=False, wandb_project="p").close()
    MetricsLog(tmp_path, tensorboard=False, wandb_project="p").close()
    inits = [c[1] for c in fake_wandb if c[0] == "init"]
    assert inits[0]["id"] == inits[1]["id"] and inits[0]["resume"] == inits[1]["resume"] == "allow"
    assert inits[0]["name"] == tmp_path.name  # the run folder names the W&B run by default


def test_without_a_project_or_off_the_main_rank_no_wandb(tmp_path, fake_wandb):
    log = MetricsLog(tmp_path, tensorboard=False)
    log.log(RECORDS[0])
    log.close()
    assert fake_wandb == [] and "wandb" not in log.describe()
    other_rank = MetricsLog(None, wandb_project="p")
    other_rank.log(RECORDS[0])
    assert fake_wandb == [] and other_rank.describe() == "trackers: none on this rank"


def test_tensorboard_is_listed_only_when_its_writer_exists(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=True)
    assert (f"tensorboard ({tmp_path / 'tb'})" in log.describe()) == (log.tb is not None)
    log.close()


def test_a_project_without_wandb_installed_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(UserError, match=r"^train.wandb = 'p': needs the wandb package: pip install wandb"):
        check_wandb("p")
    with pytest.raises(UserError, match="needs the wandb package"):
        MetricsLog(tmp_path, tensorboard=False, wandb_project="p")
    check_wandb("")  # no project asked for: nothing to check


def test_real_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricsLog(tmp_path, tensorboard=False, wandb_project="plait-test", config={"a": 1})
    assert log.describe().endswith("wandb (project plait-test, offline)")
    for r in RECORDS:
        log.log(r)
    log.close()
    run_id = (tmp_path / "wandb_id").read_text().strip()
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
