"""Defects a user found in `plait plan`, `plait schedule` and `plait bench comm`: each test is the
command (or the planner call behind it) that went wrong, and what it must do instead."""

import json

import pytest

from plait.cli import main
from plait.config import PRESETS, ModelConfig
from plait.metrics import flops_per_token
from plait.planner import costs, inputs
from plait.planner.costs import ModelDims
from plait.planner.predict import predict


def _plan(capsys, *argv):
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_mfu_past_100_percent_at_256k_tokens_says_why(capsys):
    """8b at 262144 tokens over CP 8 reports MFU 106.6%: the MFU convention (PaLM's, torchtitan's)
    counts causal attention over the whole T x T square, which the kernel priced does half of. The
    report says so, by how much, and what the MFU is on the FLOPs that run (JSON: the share)."""
    argv = ["--model", "8b", "--seq", "262144", "--gpus-per-node", "8", "--cp", "8", "--global-batch", "8", "--zero", "3"]
    rc, out, _ = _plan(capsys, *argv, "--json")
    assert rc == 0
    p = json.loads(out)["prediction"]
    d = inputs.model_dims("8b", seq=262144)
    half = 6 * d.layers * d.heads * d.head_dim * d.seq  # the masked half, forward and backward
    assert p["causal_masked_share"] == pytest.approx(half / costs.model_flops_per_token(d), rel=1e-12)
    assert p["mfu"] * (1 - p["causal_masked_share"]) <= 1
    rc, out, _ = _plan(capsys, *argv)
    assert rc == 0 and "skips its masked half, 45% of the model FLOPs" in out
    assert f"MFU {p['mfu'] * (1 - p['causal_masked_share']):.1%}" in out
    rc, out, _ = _plan(capsys, "--model", "8b", "--seq", "2048", "--gpus-per-node", "8", "--global-batch", "8")
    assert rc == 0 and "masked half" not in out  # 3% at 2k tokens: no note


@pytest.mark.parametrize("seq", [2048, 131072, 1048576])
@pytest.mark.parametrize("arch,recompute", [("llama", "none"), ("llama", "selective"), ("llama", "full"),
                                            ("gpt", "none"), ("gpt", "selective"), ("gpt", "full")])
def test_mfu_on_the_flops_run_at_most_one(seq, arch, recompute):
    """Whatever the sequence and recomputation, MFU <= HFU, and on the FLOPs a causal kernel runs the
    MFU is at most 1 on the roofline (efficiency 1)."""
    d = inputs.model_dims("1b", arch, None, seq=seq, kv_heads=32 if arch == "gpt" else None)
    c = inputs.make_cluster("h100", 1, 8, {"gpu.efficiency": "1"})
    p = predict(d, inputs.make_layout(c, cp=8, zero=3, recompute=recompute), c, 8, exact=False)
    assert 0 < p.mfu <= p.hfu and p.mfu * (1 - p.masked_share) <= 1


@pytest.mark.parametrize("preset", ["tiny", "small", "125m", "1b", "8b", "70b"])
def test_train_and_plan_count_the_same_model_flops(preset):
    """The MFU `plait train` logs and the one `plait plan` predicts use one numerator."""
    cfg = ModelConfig(preset=preset, **PRESETS[preset])
    for seq in (256, 4096, 131072):
        assert flops_per_token(cfg, seq) == pytest.approx(
            costs.model_flops_per_token(ModelDims.from_config(cfg, seq)), rel=1e-12)


def _one_line_error(capsys, argv, *want):
    rc = main(argv)
    out = capsys.readouterr()
    assert rc == 2, (rc, out)
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.err, out.err
    for w in want:
        assert w in lines[0], lines[0]
    return out


def test_micro_batch_too_large_names_micro_batch(capsys):
    """--micro-batch 1000 on 8 GPUs blamed --global-batch (512, never given) instead."""
    _one_line_error(capsys, ["plan", "--model", "8b", "--dp", "8", "--micro-batch", "1000"],
                    "--micro-batch = 1000", "--micro-batch 64 or less")
    _one_line_error(capsys, ["plan", "--model", "8b", "--dp", "8", "--micro-batch", "2", "--global-batch", "4"],
                    "--micro-batch = 2", "--global-batch 16 or more")


def test_dp_not_matching_the_gpus_names_dp(capsys):
    """--dp 3 on 8 GPUs said the product was wrong without naming the flag or the dp that fits."""
    _one_line_error(capsys, ["plan", "--model", "8b", "--dp", "3"], "--dp = 3", "use --dp 8")
    _one_line_error(capsys, ["plan", "--model", "8b", "--tp", "4", "--dp", "4"], "--dp = 4", "use --dp 2")


def test_search_json_names_the_fastest_layout_that_does_not_fit(capsys):
    """The text shows the fastest layout that does not fit; the JSON had nothing when none fits."""
    rc = main(["plan", "--model", "405b", "--gpus-per-node", "8", "--json", "--top", "1", "--tp", "8",
               "--search"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 1 and doc["ranked"] == []
    assert doc["fastest_not_fitting"]["fits"] is False and doc["fastest_not_fitting"]["layout"]["tp"] == 8
    assert doc["cluster"]["profile"] is None  # no --hardware: the data sheet priced it


def test_a_huge_global_batch_without_a_pipeline_is_priced_at_once():
    """One stage has no fill or drain: a million micro-batches were simulated one by one (28 s)."""
    import time

    d = inputs.model_dims("8b")
    c = inputs.make_cluster("h100", 1, 8, {})
    t0 = time.perf_counter()
    p = predict(d, inputs.make_layout(c, dp=8), c, 8_000_000)
    assert time.perf_counter() - t0 < 2
    assert p.bubble == pytest.approx(0, abs=1e-12) and p.microbatches == 1_000_000
    # the closed form is the simulation's answer for one stage
    from plait.planner.predict import estimate_makespan, simulate_makespan

    durs = ((0.3, 0.5, 0.0),)  # a schedule without W: its B carries the weight gradients
    assert estimate_makespan("1f1b", 1, 1000, 1, durs, 0.0)[0] == pytest.approx(
        simulate_makespan("1f1b", 1, 1000, 1, durs, 0.0)[0], rel=1e-12)


def test_a_small_models_step_time_is_not_printed_as_zero(capsys):
    rc, out, _ = _plan(capsys, "--model", "tiny", "--dp", "8", "--global-batch", "8")
    assert rc == 0 and "step time   0.000 s" not in out and " ms  (on the busiest rank" in out


def test_schedule_refuses_an_infinite_time_and_a_bad_suffix_before_drawing(capsys):
    _one_line_error(capsys, ["schedule", "--f", "inf"], "--f = inf", "finite")
    out = _one_line_error(capsys, ["schedule", "--png", "/tmp/plait-user-plan-x.txt"], "--png", ".txt")
    assert out.out == ""  # refused before the timeline was printed


def test_schedule_check_is_linear_and_still_catches_a_late_receive():
    """The checker scanned each rank's list before every compute (pp 8 x 2000 micro-batches: 100 s)."""
    import dataclasses
    import time

    from plait.parallel.schedules import ScheduleError, build_schedule, check

    t0 = time.perf_counter()
    check(build_schedule("1f1b", 8, 2000))
    assert time.perf_counter() - t0 < 4
    s = build_schedule("1f1b", 4, 8)
    acts = list(s.ranks[1])
    i_recv = next(i for i, a in enumerate(acts) if a.kind == "RECV_F" and a.microbatch == 2)
    i_f = next(i for i, a in enumerate(acts) if a.kind == "F" and a.microbatch == 2)
    recv = acts.pop(i_recv)
    acts.insert(i_f, recv)  # now right after the F that needs it
    ranks = list(s.ranks)
    ranks[1] = tuple(acts)
    with pytest.raises(ScheduleError, match="has no RECV_F before it"):
        check(dataclasses.replace(s, ranks=tuple(ranks)))


@pytest.mark.parametrize("args,want", [
    (["--factor", "1"], "--factor = 1"),  # ran as 2, unsaid
    (["--min-bytes", "0"], "--min-bytes = '0'"),  # never ended: 0 x factor
    (["--min-bytes", "8K", "--max-bytes", "1K"], "--min-bytes = '8K'"),  # an empty table, exit 0
    (["--max-bytes", "1X"], "--max-bytes = '1X'"),  # named "size"
    (["--iters", "-3"], "--iters = -3"),  # negative times
    (["--impl", "ring-0"], "--impl = 'ring-0'"),
    (["--timeout", "0"], "--timeout = 0.0"),  # a worker's traceback
    (["--nproc", "-1"], "--nproc = -1"),  # named parallel.nproc
])
def test_bench_comm_refuses_bad_values_by_their_flag(capsys, args, want):
    _one_line_error(capsys, ["bench", "comm", "--device", "cpu", *args], want)


def test_validate_refuses_a_model_this_host_cannot_hold():
    """An 8b --validate on a CPU failed on the disk check naming train.out and --out, flags plan has not."""
    from plait.errors import UserError
    from plait.planner.validate import _check_host_room

    with pytest.raises(UserError, match="--validate"):
        _check_host_room(inputs.model_dims("405b"))  # 6.5 TB of fp32 state


def test_config_refuses_an_infinite_learning_rate(tmp_path):
    """TOML's `inf` passed every check (NaN did not): the run would train NaNs."""
    from plait.config import build_config, load_toml
    from plait.errors import UserError
    from plait.validate import validate_config

    f = tmp_path / "c.toml"
    f.write_text("[train]\nlr = inf\n")
    with pytest.raises(UserError, match="train.lr = inf: must be a finite number"):
        validate_config(build_config(load_toml(f)))


def test_the_breakdown_says_whose_traffic_and_why_fp8_mfu_passes_100(capsys):
    """The traffic rows are pipeline rank 0's (its layers' tp / cp bytes): with uneven stages the
    lines beside them (the fullest rank's memory, the busiest rank's time) read as the same rank's.
    An FP8 plan printed MFU 106% without a word: the convention's bf16 peak."""
    assert main(["plan", "--model", "8b", "--gpu", "h100", "--nodes", "4", "--global-batch", "64", "--pp", "4",
                 "--cp", "8", "--cp-impl", "ulysses", "--zero", "1", "--stage-layers", "2,10,10,10"]) == 0
    assert ("traffic per step, per device (pipeline rank 0's, with more layers a rank sends more; pp: the rank that "
            "sends the most messages)" in capsys.readouterr().out)
    assert main(["plan", "--model", "70b", "--gpu", "h100", "--nodes", "8", "--global-batch", "1024", "--fp8",
                 "tensorwise", "--zero", "3", "--zero3-fp8-gather", "--dp", "64"]) == 0
    out = capsys.readouterr().out
    mfu = float(out.split("MFU ")[1].split("%")[0])
    assert mfu > 100 and "FP8 matmuls can take it past 100%" in out


def test_search_keeps_a_given_dp_and_refuses_degrees_that_cannot_fill_the_cluster(capsys):
    """`--search --tp 2 --pp 2 --dp 2` on 8 GPUs was refused ("--dp is implied"), though it names a
    layout that fills them; --dp now pins the search like --tp does. Pins that fill no layout were
    searched to "no layout fits: of 0 considered, ": one line now, naming the degrees."""
    base = ["--model", "8b", "--gpu", "h100", "--nodes", "1", "--gpus-per-node", "8", "--search", "--json"]

    def degrees(out):
        return {(r["layout"]["tp"], r["layout"]["pp"], r["layout"]["cp"],
                 r["layout"]["dp_replicate"] * r["layout"]["dp_shard"]) for r in json.loads(out)["ranked"]}

    rc, out, _ = _plan(capsys, *base, "--tp", "2", "--pp", "2", "--dp", "2")
    assert rc == 0 and degrees(out) == {(2, 2, 1, 2)}
    rc, out, _ = _plan(capsys, *base, "--dp", "4")
    found = degrees(out)
    assert rc == 0 and found and {dp for *_, dp in found} == {4} and {t * p * c for t, p, c, _ in found} == {2}
    for pins, want in ((["--tp", "4", "--pp", "4"], "--tp 4 --pp 4: their product, 16, does not divide the "
                        "cluster's 8 GPUs"),
                       (["--tp", "2", "--pp", "2", "--cp", "1", "--dp", "1"], "their product is 4, but the cluster "
                        "has 8 GPUs: give --dp 2 or leave --dp out"),
                       (["--dp", "0"], "--dp = 0: must be a positive integer")):
        rc, _, err = _plan(capsys, *base[:-1], *pins)
        assert rc == 2 and want in err and len(err.strip().splitlines()) == 1, err
    # a micro-batch that divides no global batch's share: one line (it was a generic "no layout to consider")
    rc, _, err = _plan(capsys, *base[:-1], "--dp", "8", "--micro-batch", "3", "--global-batch", "8")
    assert rc == 2 and err.strip() == ("plait plan: error: --micro-batch = 3: must divide --global-batch 8: every "
                                       "data-parallel rank runs whole micro-batches of it")


def test_search_pins_a_schedule_to_pipelines_and_refuses_a_pipeline_deeper_than_the_model(capsys):
    """`--search --schedule zbv` ranked layouts without a pipeline first (no schedule at all), and
    `--search --pp 8` on a 4-layer model ended in a KeyError from the stage split."""
    base = ["--model", "tiny", "--gpu", "h100", "--nodes", "1", "--gpus-per-node", "8", "--global-batch", "8",
            "--search"]
    for pins, schedules in ((["--schedule", "zbv"], {"zbv"}), (["--v", "2"], {"zbv", "interleaved"}),
                            (["--schedule", "1f1b"], {"1f1b"})):
        rc, out, _ = _plan(capsys, *base, "--json", *pins)
        ranked = json.loads(out)["ranked"]
        assert rc == 0 and ranked, pins
        assert all(r["layout"]["pp"] > 1 for r in ranked), pins
        assert {r["layout"]["schedule"] for r in ranked} <= schedules, pins
    for pins, want in ((["--pp", "8"], "--pp = 8: pp x v = 8 stages exceed the model's 4 layer(s)"),
                       (["--v", "4", "--schedule", "zb"], "--v = 4: only the interleaved and zbv schedules have "
                        "virtual stages"),
                       # every candidate was rejected, exit 1: "of 126 considered, 126 rejected: --tp constraint"
                       (["--tp", "8", "--nodes", "2", "--gpus-per-node", "4"], "--tp = 8: a tensor-parallel group "
                        "must fit inside a node of 4 GPUs")):
        rc, _, err = _plan(capsys, *base, *pins)
        assert rc == 2 and want in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, says", [
    # modes that each do one thing: all but one were silently ignored
    (["--check", "bench/results", "--published"], "--check and --published are modes of their own"),
    (["--published", "--dp", "8"], "--published = True: prices the published runs' own layouts and reads no "
                                   "layout: drop --dp"),
    (["--fleet-jobs", "10", "--nodes", "2", "--tp", "8"], "--fleet-jobs = 10: prices random jobs"),
    (["--model", "tiny", "--dp", "2", "--validate", "--search"], "--validate = True: runs the one layout given"),
    # a knob of a pipeline without one (counts were refused, "balance" was not)
    (["--model", "8b", "--dp", "8", "--stage-layers", "balance"], "--stage-layers = 'balance': splits a pipeline's"),
    # ZB-V runs v 2: a search pinned at v 3 searched v 2, unsaid
    (["--model", "8b", "--global-batch", "16", "--search", "--schedule", "zbv", "--v", "3"],
     "--v = 3: ZB-V runs two model chunks per rank"),
    (["--model", "8b", "--global-batch", "16", "--search", "--schedule", "interleaved", "--v", "1"],
     "--v = 1: the interleaved schedule needs v >= 2"),
    # HSDP where it means nothing: DDP labelled dp2x4, or ZeRO over a group of one
    (["--model", "8b", "--dp", "8", "--dp-replicate", "2", "--zero", "0", "--global-batch", "64"],
     "--dp-replicate = 2: replicates ZeRO's shard groups (HSDP): it needs --zero 1, 2 or 3"),
    (["--model", "8b", "--dp", "8", "--dp-replicate", "8", "--zero", "3", "--global-batch", "64"],
     "--dp-replicate = 8: equal to --dp leaves ZeRO a shard group of one GPU"),
])
def test_plan_flags_that_would_be_ignored_or_mislabelled_are_one_line(capsys, argv, says):
    rc, _, err = _plan(capsys, *argv)
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_a_search_at_v_1_means_no_virtual_stages(capsys):
    """--v 1 rejected every layout (906 of 906: "--v constraint"): it now searches the schedules
    without virtual stages, and no pipeline."""
    rc, out, _ = _plan(capsys, "--model", "8b", "--global-batch", "16", "--v", "1", "--json")
    ranked = json.loads(out)["ranked"]
    assert rc == 0 and ranked and all(r["layout"]["v"] == 1 for r in ranked)
