"""`plait plan --validate`: the planner's model-state bytes and traffic match a real plait run."""

import json

import pytest
import torch

from plait.cli import main

SHAPE = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "96", "--vocab", "256",
         "--seq", "32", "--gpu", "h100", "--nodes", "1", "--gpus-per-node", "2", "--dp", "2",
         "--micro-batch", "2", "--global-batch", "4", "--validate", "--validate-steps", "3", "--validate-device", "cpu",
         "--json"]


def control(n: int) -> float:
    """Bytes a rank sends a step beyond the model's traffic, which the planner leaves out: the 12-byte
    statistics all-reduce (loss, squared gradient norm, count) and the 4-byte stop request
    (plait/preempt.py), each 2 x S x (N-1)/N over the N ranks."""
    return 2 * (12 + 4) * (n - 1) / n


@pytest.mark.parametrize("zero", ["0", "1", "3"])  # DDP: its embedding's gradient goes as rows here (auto)
def test_predicted_state_bytes_and_traffic_equal_the_run(zero, capsys):
    assert main(["plan", *SHAPE, "--zero", zero]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["quantity"]: r for r in out["comparison"]}
    for name in ("parameters (bytes)", "gradients (bytes)", "master + optimizer (bytes)"):
        r = rows[name]
        # plait pads each shard to a multiple of N: at most N-1 elements per unit of difference
        assert abs(r["measured"] - r["predicted"]) <= 0.002 * r["predicted"], (name, r)
    sent = rows["sent per GPU per step (bytes)"]
    # ZeRO-3: the planner counts what plait sends, not the textbook's 3P(N-1)/N: the root unit
    # (embedding, output, norm gains) is gathered once a micro-batch, kept from forward into backward
    assert sent["measured"] == sent["predicted"] + control(2), sent
    assert rows["step time (s)"]["comparable"] is False  # a CPU run is not a GPU prediction


def test_the_fp8_gather_layout_runs_as_predicted(capsys):
    """`--fp8 tensorwise --zero3-fp8-gather --validate`: the trainer runs the planned FP8 layout, and
    every byte it sends is the planner's (the blocks' weights at one byte, the root unit's once) but
    for the FP8 weights' maxima, one all-reduce of 7 numbers a block a step."""
    assert main(["plan", *SHAPE, "--zero", "3", "--fp8", "tensorwise", "--zero3-fp8-gather"]) == 0
    rows = {r["quantity"]: r for r in json.loads(capsys.readouterr().out)["comparison"]}
    sent = rows["sent per GPU per step (bytes)"]
    maxima = 2 * (4 * 7 * 2) * (2 - 1) / 2  # 7 fp32 maxima a block, 2 blocks, all-reduced over 2
    assert sent["measured"] == sent["predicted"] + maxima + control(2), sent


@pytest.mark.parametrize("zero", ["0", "3"])
def test_tensor_parallel_prediction_equals_the_run(zero, capsys):
    """tp 2 x dp 2 with SP: model-state bytes per rank and every byte sent (the planner counts the
    layers', the vocabulary's and the partial gradients' tp traffic) against a 4-process run."""
    argv = list(SHAPE)
    argv[argv.index("--gpus-per-node") + 1] = "4"
    argv[argv.index("--global-batch") + 1] = "8"
    assert main(["plan", *argv, "--tp", "2", "--zero", zero]) == 0
    rows = {r["quantity"]: r for r in json.loads(capsys.readouterr().out)["comparison"]}
    for name in ("parameters (bytes)", "gradients (bytes)", "master + optimizer (bytes)"):
        r = rows[name]
        # padding: ZeRO units to a multiple of N, the vocabulary to a multiple of tp
        assert abs(r["measured"] - r["predicted"]) <= 0.01 * r["predicted"], (name, r)
    sent = rows["sent per GPU per step (bytes)"]
    stats = control(4)
    if zero == "0":
        assert sent["measured"] == sent["predicted"] + stats, sent
    else:
        # ZeRO-3's root unit (untied embedding and output: 2 x 128 x 64 rows of the split vocabulary,
        # and 5 norm gains of 64) is gathered once a micro-batch, as the planner counts it; the
        # shards split the partial gradients' all-reduce unevenly (at most its 5 x 64 fp32 differ)
        assert abs(sent["measured"] - (sent["predicted"] + stats)) <= 5 * 64 * 4, sent


def test_validate_refuses_layouts_without_an_engine(capsys):
    argv = [a for a in SHAPE if a != "--json"]
    argv[argv.index("--dp") + 1] = "1"
    assert main(["plan", *argv, "--pp", "2"]) == 2
    assert "set --pp 1" in capsys.readouterr().err


def test_context_parallel_prediction_equals_the_run(capsys):
    """cp 2 x dp 2 with ZeRO-1: the ring's K/V blocks and accumulators and the dp x cp reduction,
    byte for byte against a 4-process run; state bytes within padding."""
    argv = list(SHAPE)
    argv[argv.index("--gpus-per-node") + 1] = "4"
    argv[argv.index("--global-batch") + 1] = "4"
    assert main(["plan", *argv, "--cp", "2", "--zero", "1"]) == 0
    rows = {r["quantity"]: r for r in json.loads(capsys.readouterr().out)["comparison"]}
    for name in ("parameters (bytes)", "gradients (bytes)", "master + optimizer (bytes)"):
        assert abs(rows[name]["measured"] - rows[name]["predicted"]) <= 0.002 * rows[name]["predicted"], rows[name]
    sent = rows["sent per GPU per step (bytes)"]
    assert sent["measured"] == sent["predicted"] + control(4), sent


def test_peak_memory_is_compared_without_the_reserved_allowance():
    """The run's peak is what the allocator handed out (torch.cuda.max_memory_allocated): the
    prediction's `reserved` (CUDA context, NCCL buffers) is not in it, so it is not compared (on 4 x
    H200, 1b ZeRO-3 read 0.937x with it: 2 GiB of 29.5 GB)."""
    from plait.planner import inputs
    from plait.planner.predict import predict
    from plait.planner.validate import compare

    d = inputs.model_dims("1b", seq=2048)
    c = inputs.make_cluster("h200", 1, 4, {})
    p = predict(d, inputs.make_layout(c, dp=4, zero=3, micro_batch=8), c, 32)
    measured = {"state_bytes": {}, "cuda": True, "sent_bytes": 0, "peak_mem_bytes": 1.0, "step_time_s": 1.0}
    rows = {r[0]: r for r in compare(p, measured)}
    assert p.memory_bytes["reserved"] > 0
    assert rows["peak memory (bytes)"][1] == p.memory_total_bytes - p.memory_bytes["reserved"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU where there is none")
def test_validate_on_a_gpu_where_there_is_none_is_one_line(capsys):
    argv = [a if a != "cpu" else "cuda" for a in SHAPE]
    assert main(["plan", *argv]) == 2
    assert capsys.readouterr().err.strip() == ("plait plan: error: --validate-device = 'cuda': no GPU is visible; "
                                               "use --validate-device cpu")
