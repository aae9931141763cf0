"""`plait plan`: the breakdown, the search table, stable JSON, and one-line errors with exit code 2."""

import json
import re

import pytest

from plait.cli import main


def run(capsys, *argv):
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


BASE = ["--model", "70b", "--gpu", "h100", "--nodes", "8", "--global-batch", "1024"]


def test_breakdown(capsys):
    rc, out, _ = run(capsys, *BASE, "--tp", "8", "--pp", "4", "--zero", "1", "--explain")
    assert rc == 0
    assert "layout: tp8+sp pp4 dp2 zero1 1f1b" in out
    assert "-> fits" in out and "optimizer_states" in out and "MFU" in out
    assert "tp " in out and "InfiniBand NDR" in out
    assert "6N' + 12LHQT" in out  # --explain shows the formulas with their numbers


def test_does_not_fit_says_by_how_much(capsys):
    rc, out, _ = run(capsys, "--model", "70b", "--gpu", "a100-80gb", "--tp", "8", "--global-batch", "8")
    assert rc == 0 and "does not fit by" in out


def test_link_override_changes_the_prediction(capsys):
    _, base, _ = run(capsys, *BASE, "--tp", "8", "--pp", "4", "--json")
    _, slow, _ = run(capsys, *BASE, "--tp", "8", "--pp", "4", "--json", "--link.nvlink-gbps", "150")
    b, s = json.loads(base)["prediction"], json.loads(slow)["prediction"]
    # the catalog's 900 GB/s at its 0.4 share; a given bandwidth is taken as achieved
    assert b["traffic"]["tp"]["link"]["gbps"] == 900 and b["traffic"]["tp"]["link"]["efficiency"] == 0.4
    assert s["traffic"]["tp"]["link"]["gbps"] == 150 and s["traffic"]["tp"]["link"]["efficiency"] == 1.0
    assert s["step_time_s"] > b["step_time_s"]


def test_json_is_stable_and_documented(capsys):
    args = [*BASE, "--tp", "8", "--pp", "4", "--zero", "1", "--json"]
    _, first, _ = run(capsys, *args)
    _, second, _ = run(capsys, *args)
    assert first == second
    doc = json.loads(first)
    assert json.dumps(doc, sort_keys=True, indent=2) == first.strip()
    assert doc["schema"] == "plait.plan/1" and doc["mode"] == "breakdown"
    p = doc["prediction"]
    for key in ("memory_bytes", "memory_total_bytes", "capacity_bytes", "fits", "traffic", "step_time_s",
                "bubble", "mfu", "time_s", "layout"):
        assert key in p
    assert p["memory_total_bytes"] == pytest.approx(sum(p["memory_bytes"].values()))


def test_search_table_and_json(capsys):
    args = ["--model", "8b", "--seq", "4096", "--nodes", "1", "--global-batch", "64", "--tp", "2", "--search",
            "--micro-batch", "1", "--recompute", "none", "--top", "3"]
    rc, out, _ = run(capsys, *args)
    assert rc == 0 and "  1  tp2" in out and "why:" in out
    rc, out, _ = run(capsys, *args, "--json")
    doc = json.loads(out)
    assert doc["mode"] == "search" and 1 <= len(doc["ranked"]) <= 3
    assert all(r["layout"]["tp"] == 2 and r["fits"] for r in doc["ranked"])


def test_explicit_gpt_shape(capsys):
    rc, out, _ = run(capsys, "--arch", "gpt", "--layers", "96", "--hidden", "12288", "--heads", "96",
                     "--vocab", "51200", "--seq", "2048", "--gpu", "a100-80gb", "--nodes", "128",
                     "--global-batch", "1536", "--tp", "8", "--pp", "16", "--no-sp", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["model"]["params"] == 174_615_846_912
    assert doc["prediction"]["traffic"]["tp"]["collectives"][0]["op"] == "all_reduce"


def test_fleet_comparison(capsys):
    rc, out, _ = run(capsys, "--nodes", "8", "--fleet-jobs", "60")
    assert rc == 0 and "first-fit" in out and "pack" in out


@pytest.mark.parametrize("argv,needle", [
    (["--model", "70b", "--gpu", "tpu9"], "--gpu"),
    (["--layers", "4", "--hidden", "100", "--heads", "3", "--vocab", "10", "--seq", "8", "--tp", "1"], "--heads"),
    (["--layers", "-4", "--hidden", "128", "--heads", "4", "--vocab", "10", "--seq", "8"], "--layers"),
    (["--model", "70b", "--nodes", "2", "--tp", "8", "--pp", "4", "--dp", "4"], "GPUs"),
    (["--model", "70b", "--tp", "3"], "tp"),
    (["--model", "70b", "--tp", "8", "--link.warp-gbps", "9"], "link"),
    (["--model", "70b", "--tp", "8", "--link.nvlink-gbps"], "needs a value"),
    (["--model", "huge"], "--model"),
    (["--hidden", "128"], "--model is not set"),
    (["--model", "70b", "--nodes", "0"], "--nodes"),
    # no FP8 tensor cores: the search must not price FP8 at twice the bf16 rate, nor reject every layout
    (["--model", "8b", "--gpu", "a100", "--fp8", "tensorwise"], "the A100 SXM 80GB has no FP8 tensor cores"),
    (["--model", "8b", "--gpu", "v100", "--fp8", "rowwise", "--tp", "8"], "V100 SXM2 32GB has no FP8"),
    # an unset shell variable planned with data-sheet figures, or drew nothing, unsaid
    (["--model", "8b", "--dp", "8", "--hardware", ""], "--hardware = '': is empty"),
    # 1f1b is the default, but given it asks for a pipeline as zb does
    (["--model", "8b", "--dp", "8", "--schedule", "1f1b"], "--schedule = '1f1b': orders a pipeline's stages"),
    (["--model", "8b", "--dp", "8", "--precision", "fp32", "--fp8", "tensorwise"], "--fp8 = 'tensorwise': FP8 "
     "linears train under mixed precision"),
    (["--model", "8b", "--dp", "8", "--precision", "fp32", "--hardware", "bench/results/hardware-h100.json"],
     "--precision = 'fp32': bench/results/hardware-h100.json measured 16-bit matmuls"),
    # what `plait train` refuses: a pipeline rank of empty stages holds nothing
    (["--model", "8b", "--gpus-per-node", "3", "--pp", "3", "--dp", "1", "--stage-layers", "16,0,16"],
     "--stage-layers = '16,0,16': leaves pipeline rank 1 no layer"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("plait plan: error:") and needle in err


def test_v100_plans_at_its_fp16_rate(capsys):
    # no bf16 tensor cores, and plan has no dtype flag: mixed precision there is fp16 (same bytes)
    rc, out, err = run(capsys, "--model", "8b", "--gpu", "v100", "--tp", "8", "--json")
    doc = json.loads(out)
    assert rc == 0 and err == ""
    assert doc["cluster"]["dtype"] == "fp16" and doc["cluster"]["peak_flops"] == 125e12
    assert 0 < doc["prediction"]["mfu"] < 1


@pytest.mark.parametrize("argv,flag", [
    (["--tp", "0"], "--tp = 0"),
    (["--pp", "0"], "--pp = 0"),
    (["--cp", "0"], "--cp = 0"),
    (["--dp", "0"], "--dp = 0"),
    (["--dp", "8", "--dp-replicate", "0"], "--dp-replicate = 0"),
    (["--tp", "8", "--micro-batch", "0"], "--micro-batch = 0"),
    (["--pp", "2", "--v", "0"], "--v = 0"),
    # the search takes the same flags as pins: a 0 there divided by zero
    (["--tp", "0", "--search"], "--tp = 0"),
    (["--micro-batch", "0"], "--micro-batch = 0"),
    (["--dp-replicate", "0"], "--dp-replicate = 0"),
    (["--tp", "-2", "--search"], "--tp = -2"),
    (["--global-batch", "0"], "--global-batch = 0"),
    (["--global-batch", "-3", "--tp", "8"], "--global-batch = -3"),
    (["--top", "0"], "--top = 0"),
    (["--top", "-1"], "--top = -1"),
    (["--fleet-jobs", "-1"], "--fleet-jobs = -1"),
    (["--gpus-per-node", "0"], "--gpus-per-node = 0"),
    (["--nodes", "0", "--tp", "8"], "--nodes = 0"),
    # every time divides by these: 0 was a ZeroDivisionError traceback
    (["--tp", "8", "--gpu.tflops", "0"], "--gpu.tflops = '0': must be a positive number"),
    (["--tp", "8", "--gpu.hbm-gbps", "0"], "--gpu.hbm-gbps = '0': must be a positive number"),
    # a GPU of 0 GiB was accepted ("total 25.82 of 0.00 -> does not fit"); a link said "zero or
    # more" of -5 and "positive" of 0
    (["--tp", "8", "--gpu.hbm-gib", "0"], "--gpu.hbm-gib = '0': must be a positive number"),
    (["--tp", "8", "--link.nvlink-gbps", "-5"], "--link.nvlink-gbps = '-5': must be a positive number"),
    (["--tp", "8", "--link.nvlink-gbps", "0"], "--link.nvlink-gbps = '0': must be a positive number"),
    # named by the flag given (it was blamed on --gpu.matmul-efficiency)
    (["--tp", "8", "--gpu.efficiency", "2"], "--gpu.efficiency = '2': must be in (0, 1]"),
    (["--tp", "8", "--gpu.efficiency", "nan"], "--gpu.efficiency = 'nan': expected a finite number"),
    # knobs of something the layout does not run were priced as if never given
    (["--tp", "8", "--cp-impl", "ulysses"], "--cp-impl = 'ulysses': chooses how context parallelism splits attention: "
                                            "it needs --cp > 1 (without it, drop --cp-impl)"),
    (["--tp", "8", "--validate-steps", "3"], "--validate-steps = 3: counts the steps of a --validate run: add "
                                             "--validate, or drop --validate-steps"),
    (["--tp", "8", "--gpu.reserved-gib", "100"], "--gpu.reserved-gib = 100.0: must be less than the H100 SXM 80GB's "
                                                 "80 GiB of memory (or give a larger --gpu.hbm-gib)"),
    (["--tp", "8", "--gpu.hbm-efficiency", "0"], "--gpu.hbm-efficiency = '0': must be in (0, 1]"),
])
def test_zero_or_negative_counts_are_refused(capsys, argv, flag):
    rc, out, err = run(capsys, "--model", "8b", *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and flag in err
    assert "--dp-replicate" not in err or "--dp-replicate" in argv  # --dp 0 blames --dp


def test_check_of_a_folder_without_runs_is_an_error(capsys, tmp_path):
    (tmp_path / "notes.json").write_text('{"benchmark": "other"}')
    rc, out, err = run(capsys, "--check", str(tmp_path))
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and f"--check {tmp_path}" in err and "no recorded plait runs" in err


def test_json_carries_explain_and_placement(capsys):
    args = [*BASE, "--tp", "8", "--pp", "4", "--json"]
    _, plain, _ = run(capsys, *args)
    rc, out, _ = run(capsys, *args, "--explain", "--placement")
    doc, base = json.loads(out), json.loads(plain)
    assert rc == 0 and "explain" not in base and "placement" not in base
    assert {k: v for k, v in doc.items() if k not in ("explain", "placement")} == base
    assert any(e["quantity"] == "parameters" for e in doc["explain"])
    assert len(doc["placement"]) == 64 and doc["placement"][8] == {
        "rank": 8, "node": 1, "gpu": 0, "coords": {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 0}}


def test_search_shows_the_best_layouts_placement(capsys):
    args = ["--model", "8b", "--seq", "4096", "--global-batch", "64", "--tp", "2", "--search",
            "--micro-batch", "1", "--recompute", "none", "--top", "2", "--placement"]
    rc, out, _ = run(capsys, *args)
    assert rc == 0 and "best layout's placement:" in out and "rank  node  gpu" in out
    rc, out, _ = run(capsys, *args, "--json", "--explain")
    doc = json.loads(out)
    assert rc == 0 and len(doc["placement"]) == 8 and doc["explain"]
    assert all(r["coords"]["tp"] == r["gpu"] % 2 for r in doc["placement"])


def test_fleet_json(capsys):
    rc, out, _ = run(capsys, "--nodes", "8", "--fleet-jobs", "60", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["mode"] == "fleet" and doc["jobs"] == 60
    assert [r["policy"] for r in doc["fleet"]] == ["first-fit", "spread", "pack"]
    assert all(r["placed"] + r["refused"] == 60 for r in doc["fleet"])


@pytest.mark.parametrize("argv,says,never", [
    # --schedule was not given: the error is about --v (it read "--schedule = '1f1b --v 2'")
    (["--dp", "8", "--v", "2"], ["--v = 2:", "--pp > 1", "--schedule interleaved"], ["--schedule ="]),
    (["--dp", "8", "--schedule", "zb"], ["--schedule = 'zb':", "--pp > 1"], ["--v"]),
    # the micro-batch count is no flag of plan's: name what makes it
    (["--pp", "4", "--schedule", "interleaved", "--v", "2", "--global-batch", "6"],
     ["--global-batch / (dp x --micro-batch)) = 3:", "multiple of 4"], ["--microbatches"]),
    # only what is missing (it asked for --zero 3 when it was given)
    (["--dp", "8", "--zero", "3", "--zero3-fp8-gather"], ["--zero3-fp8-gather", "set --fp8 tensorwise"], ["--zero 3"]),
    (["--dp", "8", "--fp8", "tensorwise", "--zero3-fp8-gather"], ["set --zero 3"], ["--fp8 tensorwise"]),
    (["--dp", "8", "--zero3-fp8-gather"], ["set --zero 3 --fp8 tensorwise"], []),
])
def test_errors_name_what_was_given_and_ask_for_what_is_missing(capsys, argv, says, never):
    rc, out, err = run(capsys, "--model", "8b", "--nodes", "1", *argv)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert all(s in err for s in says) and not any(s in err for s in never), err


@pytest.mark.parametrize("argv,says", [
    (["--model", "8b", "--hidden", "4000"], "--hidden = 4000: gives 32 heads of an odd size 125; RoPE needs an even"),
    (["--model", "8b", "--hidden", "4001"], "--hidden = 4001: must be a multiple of --heads = 32"),
    (["--model", "8b", "--hidden", "4000", "--heads", "32"], "--heads = 32: gives an odd head size 125"),
    (["--layers", "4", "--hidden", "250", "--heads", "2", "--vocab", "10", "--seq", "8"], "--heads = 2"),
])
def test_an_odd_head_size_is_refused_as_train_refuses_it(capsys, argv, says):
    rc, out, err = run(capsys, *argv, "--nodes", "1", "--dp", "8")
    assert rc == 2 and out == "" and err.count("\n") == 1 and says in err, err


@pytest.mark.parametrize("hidden,heads", [(4000, 32), (4096, 32), (250, 2), (4001, 32), (96, 3), (96, 4)])
def test_planner_and_train_take_the_same_head_sizes(capsys, hidden, heads):
    from plait.config import ModelConfig
    from plait.errors import UserError
    from plait.validate import validate_model

    try:
        validate_model(ModelConfig(dim=hidden, n_heads=heads, n_kv_heads=1))
        train_ok = True
    except UserError:
        train_ok = False
    rc, _, _ = run(capsys, "--layers", "2", "--hidden", str(hidden), "--heads", str(heads), "--kv-heads", "1",
                   "--vocab", "64", "--seq", "64", "--nodes", "1", "--gpus-per-node", "1", "--dp", "1", "--json")
    assert (rc == 0) == train_ok
    # GPT's learned positions take any head size (a GPT shape with RoPE's rule would be refused)
    rc, _, _ = run(capsys, "--arch", "gpt", "--layers", "2", "--hidden", str(hidden), "--heads", str(heads),
                   "--vocab", "64", "--seq", "64", "--nodes", "1", "--gpus-per-node", "1", "--dp", "1", "--json")
    assert (rc == 0) == (hidden % heads == 0)


def test_every_time_s_key_is_documented(capsys):
    """docs/planner.md lists the parts of a prediction's `time_s`; `host` was missing."""
    import re
    from pathlib import Path

    _, out, _ = run(capsys, *BASE, "--tp", "8", "--pp", "4", "--json")
    keys = set(json.loads(out)["prediction"]["time_s"])
    docs = Path(__file__).resolve().parents[1] / "docs" / "planner.md"
    listed = re.search(r"`time_s` \(([a-z0-9_, ]+):", " ".join(docs.read_text().split())).group(1)
    assert keys == {k.strip() for k in listed.split(",")}
    assert "`host` is" in docs.read_text()


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_explain_bytes_per_param_is_the_tables(zero, capsys):
    """--explain's state bytes per parameter is what the memory table holds: under ZeRO-3 the fp32
    shard is the master (14 B / N_d, not the paper's 16 B / N_d)."""
    import json
    import re

    args = ["plan", "--model", "8b", "--gpu", "h100", "--nodes", "1", "--gpus-per-node", "8", "--global-batch", "64",
            "--micro-batch", "1", "--seq", "4096", "--dp", "8", "--zero", str(zero)]
    assert main([*args, "--explain"]) == 0
    per_param = float(re.search(r"-> ([\d.]+) B/param x ([\d.e+]+) params", capsys.readouterr().out)[1])
    assert main([*args, "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)["prediction"]["memory_bytes"]
    state = mem["parameters"] + mem["master_weights"] + mem["optimizer_states"]
    # gradients: ZeRO-3 holds a unit's full gradient besides the shard at its peak; the state's own is N g / N_d
    grads = 2 * 8.03e9 / (8 if zero >= 2 else 1)
    assert (state + grads) / 8.03e9 == pytest.approx(per_param, rel=2e-3)


@pytest.mark.parametrize("kind, needle", [
    ("nvlink", "--link.intra = 'nvlink': names a family of links; choose its kind: nvlink2, nvlink3, nvlink4, nvlink5"),
    ("nvlink9", "--link.intra = 'nvlink9': unknown link; choose one of nvlink2"),
])
def test_a_link_swapped_in_is_named_by_its_kind(kind, needle, capsys):
    """`--link.nvlink-gbps` takes a family; `--link.intra` needs a kind, and says which (it said unknown link)."""
    assert main(["plan", "--model", "8b", "--gpu", "h100", "--nodes", "2", "--dp", "16", "--zero", "3",
                 "--link.intra", kind]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert main(["plan", "--model", "8b", "--gpu", "h100", "--nodes", "2", "--dp", "16", "--zero", "3",
                 "--link.intra", "nvlink3"]) == 0


def test_plans_dp_counting_the_replicas_is_said_where_it_differs_from_trains(capsys):
    """train --dp 4 --parallel.dp_replicate 2 is 8 GPUs; plan --dp 4 --dp-replicate 2 is 4. The
    refusal says so rather than only "use --dp 8"."""
    assert main(["plan", "--model", "8b", "--gpu", "h100", "--nodes", "1", "--dp", "4", "--dp-replicate", "2",
                 "--zero", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "use --dp 8 or leave --dp out (plan's --dp counts every data-parallel rank" in err[0], err


def test_tied_embeddings_of_a_shape_given_in_full(capsys):
    """`plait train --model.preset custom` ties its embeddings by default; a plan of the same shape
    priced an untied model (a second vocab x hidden matrix, no tied-gradient sum across the pipeline's
    ends) and could not be told otherwise."""
    shape = ["--layers", "4", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq", "32",
             "--gpus-per-node", "2", "--pp", "2", "--dp", "1", "--global-batch", "4", "--json"]
    docs = {}
    for tie in ("on", "off"):
        rc, out, _ = run(capsys, *shape, "--tie-embeddings", tie)
        assert rc == 0
        docs[tie] = json.loads(out)
    assert docs["off"]["model"]["params"] - docs["on"]["model"]["params"] == 256 * 64
    assert "pp_ends" in docs["on"]["prediction"]["traffic"] and "pp_ends" not in docs["off"]["prediction"]["traffic"]


def test_fp32_is_priced_at_the_cards_fp32_rate(capsys):
    """--precision fp32 doubled the bytes but priced the matmuls at the bf16 tensor cores' peak."""
    docs = {}
    for prec in ("mixed", "fp32"):
        rc, out, _ = run(capsys, "--model", "8b", "--dp", "8", "--precision", prec, "--json")
        docs[prec] = json.loads(out)
    assert docs["fp32"]["cluster"]["dtype"] == "fp32" and docs["fp32"]["cluster"]["peak_flops"] == pytest.approx(66.9e12)
    ratio = docs["fp32"]["prediction"]["step_time_s"] / docs["mixed"]["prediction"]["step_time_s"]
    assert 10 < ratio < 989 / 66.9 * 1.1, ratio


def test_interleaved_and_zbv_take_two_chunks_unless_told_and_zero3_counts_its_calls(capsys):
    """`plait schedule` drew interleaved and ZB-V with v = 2 by itself; plan and train refused them
    for "--v = 1", a value no one gave. ZeRO-3's traffic line counts a gather per block and pass."""
    for sched in ("interleaved", "zbv"):
        rc, out, _ = run(capsys, "--model", "8b", "--pp", "2", "--schedule", sched, "--dp", "4", "--json")
        assert rc == 0 and json.loads(out)["prediction"]["layout"]["v"] == 2
    rc, out, _ = run(capsys, "--model", "8b", "--gpus-per-node", "4", "--global-batch", "32", "--dp", "4", "--zero", "3",
                     "--micro-batch", "8")
    # m = 1 micro-batch: 32 blocks gathered in forward and backward, their gradients reduced, and the
    # root unit (embedding, norm gains) and 8b's untied output matrix, each a unit of its own, gathered
    # and reduced once: 64 + 32 + 2 x 2 (it counted the two as one)
    assert re.search(r"dp_shard .* in 100 collectives", out) and "(1 micro-batch of 8 per step)" in out, out
