"""The planner prices FP8 linears (`plait plan --fp8`, `--zero3-fp8-gather`): from the groups of FP8
linears a profile measured (`plait bench calibrate --only fp8`), else from the card's FP8 peak and the
scaling passes' bytes; a block of FP8 linears keeps less for its backward; bad combinations are one
line. The bytes the FP8 gather saves are checked against a run's ledger in test_fp8_gather.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from plait.cli import main
from plait.errors import UserError
from plait.planner import costs, inputs, roofline
from plait.planner.layout import Layout
from plait.planner.predict import predict
from plait.planner.profile import load, save
from test_planner_profile import _profile

D8 = inputs.model_dims("8b", seq=2048)


def _measured(scale: float = 1.0):
    """A profile whose FP8 groups (8b, 4096 tokens) run at `scale` times a made-up but fixed time."""
    rows = []
    for recipe, gathered in (("tensorwise", 0), ("tensorwise", 1), ("rowwise", 0)):
        for fin, outs in roofline.fp8_groups(D8, 1):
            flops = 2.0 * 4096 * fin * sum(outs)
            rows.append((recipe, gathered, 4096, fin, tuple(outs), scale * flops / 1.2e15, scale * 2 * flops / 1.1e15))
    return _profile(fp8_linear=tuple(rows))


def test_measured_groups_price_the_block_and_other_shapes_scale_by_flops():
    c = dataclasses.replace(inputs.make_cluster("h100", 1, 1, {}), profile=_measured())
    fwd, dgrad, wgrad = roofline.fp8_linear_times(D8, 4096, c, 1, "tensorwise")
    want_f = sum(r[5] for r in c.profile.fp8_linear if r[0] == "tensorwise" and not r[1])
    want_b = sum(r[6] for r in c.profile.fp8_linear if r[0] == "tensorwise" and not r[1])
    assert fwd == pytest.approx(want_f) and dgrad + wgrad == pytest.approx(want_b) and dgrad == wgrad
    # twice the tokens: twice the FLOPs at the nearest group's rate
    assert roofline.fp8_linear_times(D8, 8192, c, 1, "tensorwise")[0] == pytest.approx(2 * want_f)
    # the block's time moves with the measurement: the profile, not a constant, prices it
    slow = dataclasses.replace(c, profile=_measured(2.0))
    base = roofline.layer_times(D8, 4096, c, 1, "tensorwise")
    assert roofline.layer_times(D8, 4096, slow, 1, "tensorwise").forward_s - base.forward_s == pytest.approx(want_f)


def test_fp8_is_faster_and_keeps_less_than_bf16_uncalibrated_too():
    """Without a measured profile the FP8 GEMMs run at the data sheet's FP8 peak (twice bf16's) and
    the scaling passes add their bytes: faster than bf16, slower than twice as fast."""
    c = inputs.make_cluster("h100", 1, 1, {})
    bf = predict(D8, Layout(micro_batch=2), c, 2)
    f8 = predict(D8, Layout(micro_batch=2, fp8="tensorwise"), c, 2)
    assert 1.0 < bf.step_time_s / f8.step_time_s < 2.0
    assert f8.memory_bytes["activations"] < 0.8 * bf.memory_bytes["activations"]
    lt, lt8 = roofline.layer_times(D8, 4096, c), roofline.layer_times(D8, 4096, c, 1, "tensorwise")
    assert lt8.attention_forward_s == lt.attention_forward_s and lt8.forward_s < lt.forward_s
    # weights gathered in FP8 skip their quantization
    assert roofline.layer_times(D8, 4096, c, 1, "tensorwise", True).forward_s < lt8.forward_s


def test_the_fp8_gather_moves_a_byte_a_block_weight_and_holds_a_block_in_one():
    c = inputs.make_cluster("h100", 1, 4, {})
    lays = {g: Layout(dp_shard=4, zero=3, micro_batch=1, fp8="tensorwise", zero3_fp8_gather=g) for g in (False, True)}
    p = {g: predict(D8, lay, c, 4) for g, lay in lays.items()}
    assert p[True].traffic["dp_shard"].bytes_per_device < 0.8 * p[False].traffic["dp_shard"].bytes_per_device
    assert p[True].memory_bytes["zero3_gather"] <= p[False].memory_bytes["zero3_gather"]
    # kept from the first gather of a step (cast-once): the blocks' chunks in one byte, and quantized once
    once = {g: predict(D8, dataclasses.replace(lay, zero3_cast_once=True, micro_batch=1), c, 16)
            for g, lay in lays.items()}
    per_gather = {g: predict(D8, dataclasses.replace(lay, micro_batch=1), c, 16) for g, lay in lays.items()}
    blocks = D8.layers * (costs.block_linear_share(D8, 1)) / 4
    kept = {g: once[g].memory_bytes["parameters"] - per_gather[g].memory_bytes["parameters"] for g in (False, True)}
    assert kept[False] - kept[True] == pytest.approx(blocks)
    assert once[True].step_time_s < per_gather[True].step_time_s


def test_a_profiles_fp8_groups_survive_a_round_trip_and_a_bad_row_is_one_line(tmp_path):
    path = tmp_path / "h100.json"
    save(_measured(), path)
    assert load(path).fp8_linear == _measured().fp8_linear
    raw = json.loads(path.read_text())
    raw["fp8_linear"][0][0] = "blockwise"
    path.write_text(json.dumps(raw))
    with pytest.raises(UserError, match=r"fp8_linear\[0\] = .* is malformed") as e:
        load(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("layout, needle", [
    (dict(fp8="e5m2"), "--fp8 = 'e5m2': choose one of off, tensorwise, rowwise"),
    (dict(zero=2, fp8="tensorwise", zero3_fp8_gather=True), "zero3_fp8_gather = True: it gathers tensorwise FP8"),
    (dict(zero=3, fp8="rowwise", zero3_fp8_gather=True), "not zero 3 and fp8 rowwise"),
])
def test_bad_fp8_layouts_are_one_line(layout, needle):
    with pytest.raises(UserError, match=needle) as e:
        Layout(**layout)
    assert "\n" not in str(e.value)


def test_plan_prices_fp8_from_the_command_line(capsys):
    args = ["plan", "--model", "8b", "--seq", "2048", "--gpu", "h100", "--gpus-per-node", "4", "--global-batch", "8",
            "--dp", "4", "--zero", "3", "--micro-batch", "2", "--json"]
    assert main(args) == 0
    bf = json.loads(capsys.readouterr().out)["prediction"]
    assert main(args + ["--fp8", "tensorwise", "--zero3-fp8-gather"]) == 0
    f8 = json.loads(capsys.readouterr().out)["prediction"]
    assert f8["step_time_s"] < bf["step_time_s"] and f8["memory_total_bytes"] < bf["memory_total_bytes"]
    assert main(args[:-1] + ["--zero", "2", "--fp8", "tensorwise", "--zero3-fp8-gather"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("plait plan: error: --zero3-fp8-gather = True") and "\n" not in err


def test_the_search_ranks_fp8_layouts_when_asked(capsys):
    """`plan --search --fp8 tensorwise`: every ranked layout runs FP8 linears, and the best is
    faster than the best bf16 layout of the same search."""
    args = ["plan", "--model", "8b", "--seq", "2048", "--gpu", "h100", "--gpus-per-node", "4", "--global-batch", "8",
            "--top", "3", "--json"]
    best = {}
    for fp8 in ("off", "tensorwise"):
        assert main(args + ["--fp8", fp8]) == 0
        ranked = json.loads(capsys.readouterr().out)["ranked"]
        assert ranked and all(r["layout"]["fp8"] == fp8 for r in ranked)
        best[fp8] = ranked[0]["step_time_s"]
    assert best["tensorwise"] < best["off"]
