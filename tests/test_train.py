"""The training loop: learning, accumulation, bitwise resume, metrics, schedules, precision."""

import json
import math

import pytest

import torch

from plait.config import TrainConfig
from plait.optim import lr_at
from plait.preflight import preflight
from plait.train import train
from conftest import micro_config


def _weights(run_dir, step):
    return torch.load(run_dir / "checkpoints" / f"step_{step:08d}" / "model.pt", weights_only=True)


def test_loss_falls_and_metrics_are_logged(corpus, tmp_path):
    cfg = preflight(micro_config(corpus, tmp_path / "r", train={"steps": 40, "eval_every": 20}))
    summary = train(cfg)
    assert sum(summary["losses"][-5:]) / 5 < summary["losses"][0] - 1.0
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_bytes"):
        assert key in rows[0]
    assert rows[0]["mfu"] == "n/a"  # no peak FLOP/s for a CPU
    assert [r["step"] for r in rows if "val_loss" in r] == [20, 40]
    assert rows[-1]["val_loss"] < math.log(256)
    assert (tmp_path / "r" / "config.toml").is_file()


def test_grad_accumulation_equals_one_big_batch(corpus, tmp_path):
    a = train(preflight(micro_config(corpus, tmp_path / "a", train={"micro_batch": 2, "grad_accum": 4})))
    b = train(preflight(micro_config(corpus, tmp_path / "b", train={"micro_batch": 8, "grad_accum": 1})))
    for la, lb in zip(a["losses"], b["losses"]):
        assert abs(la - lb) <= 1e-5 * abs(lb)
    wa, wb = _weights(tmp_path / "a", 6), _weights(tmp_path / "b", 6)
    # Adam divides by sqrt(v): where a gradient is ~0, summation-order rounding moves the update
    # by a visible fraction of lr. 1% of one step's update (lr = 3e-3) is far below any real bug
    # (a missing 1/grad_accum scale, say, changes losses at the first step).
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 3e-5


def test_resume_is_bitwise_identical(corpus, tmp_path):
    straight = micro_config(corpus, tmp_path / "s", train={"steps": 20})
    train(preflight(straight))
    first = micro_config(corpus, tmp_path / "p", train={"steps": 20, "max_steps_this_run": 10})
    train(preflight(first))
    assert sorted(p.name for p in (tmp_path / "p" / "checkpoints").iterdir()) == ["step_00000010"]
    second = micro_config(corpus, tmp_path / "p", train={"steps": 20}, checkpoint={"resume": True})
    train(preflight(second))
    ws, wp = _weights(tmp_path / "s", 20), _weights(tmp_path / "p", 20)
    assert ws.keys() == wp.keys()
    assert all(torch.equal(ws[k], wp[k]) for k in ws)
    os_ = torch.load(tmp_path / "s" / "checkpoints" / "step_00000020" / "optim.pt", weights_only=True)
    op = torch.load(tmp_path / "p" / "checkpoints" / "step_00000020" / "optim.pt", weights_only=True)
    assert all(torch.equal(os_["moments"][n]["exp_avg_sq"], op["moments"][n]["exp_avg_sq"]) for n in os_["moments"])


def test_resume_skips_a_damaged_newest_checkpoint(corpus, tmp_path, capsys):
    cfg = micro_config(corpus, tmp_path / "r", train={"steps": 6}, checkpoint={"every": 2, "keep_last": 5})
    train(preflight(cfg))
    newest = tmp_path / "r" / "checkpoints" / "step_00000006" / "model.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    again = micro_config(corpus, tmp_path / "r", train={"steps": 8}, checkpoint={"resume": True, "keep_last": 5})
    summary = train(preflight(again))
    err = capsys.readouterr().err
    assert "step_00000006 skipped" in err and "resumed from" in err and "step 4" in err
    assert len(summary["losses"]) == 4  # steps 5..8
    # eval, export and generate on the run folder skip it too: said once, naming the step they used
    from plait.cli import main

    last = tmp_path / "r" / "checkpoints" / "step_00000008"  # the resumed run's last
    newest.parent.rename(tmp_path / "r" / "checkpoints" / "step_00000010")  # the damaged one newest again
    for argv, used in ((["eval", "--checkpoint", str(tmp_path / "r"), "--batches", "1"], f"{last} on "),
                       (["hf", "export", "--checkpoint", str(tmp_path / "r"), "--out", str(tmp_path / "hf")],
                        f"exported {last} -> "),
                       (["generate", "--checkpoint", str(tmp_path / "r"), "--max-new-tokens", "2"], "")):
        assert main(argv) == 0
        out = capsys.readouterr()
        err = out.err + out.out
        assert err.count("step_00000010 skipped") == 1 and used in err, (argv[0], err)


def test_lr_schedule():
    cfg = TrainConfig(steps=100, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, cfg) == 0.1 and lr_at(9, cfg) == 1.0
    assert lr_at(10, cfg) == 1.0 and abs(lr_at(55, cfg) - 0.55) < 1e-12
    assert abs(lr_at(100, cfg) - 0.1) < 1e-12


def test_bf16_training_runs_on_cpu(corpus, tmp_path):
    s = train(preflight(micro_config(corpus, tmp_path / "r", train={"dtype": "bf16", "steps": 3})))
    assert all(math.isfinite(x) for x in s["losses"])
    w = _weights(tmp_path / "r", 3)
    assert all(t.dtype == torch.float32 for t in w.values())  # checkpoints hold the fp32 masters


def test_continue_training_from_huggingface(corpus, tmp_path):
    transformers = __import__("pytest").importorskip("transformers")
    hc = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(hc).save_pretrained(tmp_path / "hf")
    cfg = preflight(micro_config(corpus, tmp_path / "r", train={"steps": 2, "lr": 0.0, "min_lr": 0.0,
                                                                  "init_from": str(tmp_path / "hf")}))
    assert cfg.model.ffn_dim == 96  # the shape comes from the HF config
    train(cfg)
    w = _weights(tmp_path / "r", 2)
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert torch.equal(w["layers.1.mlp.w1.weight"], ref["model.layers.1.mlp.gate_proj.weight"])


def test_mfu_is_per_gpu():
    """MFU divides tokens/s *per GPU* by one GPU's peak: the global rate over one card's peak would
    read N times too high on N GPUs."""
    from plait.metrics import throughput

    one = throughput(8192, 0.5, 1, 6e9, 1e15)
    four = throughput(4 * 8192, 0.5, 4, 6e9, 1e15)  # four GPUs, each as fast as the one
    assert four["tokens_per_s"] == 4 * one["tokens_per_s"]
    assert four["tokens_per_s_per_gpu"] == one["tokens_per_s_per_gpu"] == 8192 / 0.5
    assert four["mfu"] == one["mfu"] == pytest.approx(8192 / 0.5 * 6e9 / 1e15)
    assert throughput(8192, 0.5, 2, 6e9, None)["mfu"] == "n/a"  # CPU: no peak
