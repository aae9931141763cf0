"""The planner against measurements other systems published (plait/planner/published.py): every
run is predicted with the catalog's defaults for its GPU and the errors are printed (pytest -s)
and kept in docs/planner.md. The bounds are what the planner does today, so a change that makes
it worse on clusters it has never seen shows up here."""

from __future__ import annotations

import statistics

import pytest

from plait.planner import published


def test_every_published_run_is_predicted():
    checks = published.check()
    print("\n" + published.table(checks))
    assert len(checks) == len(published.RUNS) >= 16
    assert all(c.fits for c in checks)  # they ran, so a layout the planner says does not fit is wrong
    errors = [abs(c.error) for c in checks]
    # full recomputation prices the same work torchtitan ran: within 10%
    full = [abs(c.error) for c in checks if c.run.layout["recompute"] == "full" and c.run.source == published.TORCHTITAN]
    assert full and max(full) < 0.10, published.table(checks)
    # Megatron-LM's GPT runs on 32-3,072 A100s (TP, PP, DP; Narayanan et al. 2021): 2.4% mean, 7.5%
    # worst now (Calculon, an analytical model of its own, reports 3.65% and 8.87% on them)
    megatron = [abs(c.error) for c in checks if c.run.source == published.MEGATRON_2021]
    assert len(megatron) == 10 and statistics.mean(megatron) < 0.03 and max(megatron) < 0.08, published.table(checks)
    # all 16: 4.5% mean, 13.1% worst (torchtitan's selective and no-AC rows, 11-13% fast)
    assert statistics.mean(errors) < 0.05 and max(errors) < 0.14, published.table(checks)


def test_megatron_rows_are_priced_with_megatrons_attention_and_nvlinks_measured_share():
    """The GPT architecture is Megatron's: its attention materialises the scores (the activation
    memory the planner keeps for GPT counts them), so its time does too (`roofline.megatron_attention_s`),
    and NVLink collectives run at the share of the catalog figure 4 x H200 measured (0.4). With
    plait's fused attention and the seeds' 600 GB/s instead, the ten Megatron-LM rows came out 33%
    fast on average; with Megatron's attention alone, 15%; with both, 9%. Breaking either fails this."""
    import dataclasses

    from plait.planner import hardware, roofline

    tokens = published.megatron_tokens_per_s(163, 128, 25600)  # the 1T row: 502 PFLOP/s over 3,072 GPUs
    assert 163e12 * 3072 / 1e15 == pytest.approx(500.7, abs=0.1) and 19 < tokens < 21
    assert hardware.LINKS["nvlink3"].efficiency == hardware.LINK_EFFICIENCY == 0.4
    d = published.inputs_dims(published.MEGATRON_RUNS[0])
    c = hardware.cluster("a100-80gb", 4, 8)
    fwd, bwd = roofline.megatron_attention_s(d, 4 * 2048, c)
    scores = 4 * 2048 * 2048 * 24
    assert fwd > roofline.kernel_time_s(0.0, 13 * scores, c) and bwd > roofline.kernel_time_s(0.0, 19 * scores, c)
    mean = statistics.mean(abs(c.error) for c in published.check(published.MEGATRON_RUNS))
    seed_links = dataclasses.replace(hardware.LINKS["nvlink3"], efficiency=1.0)
    try:
        hardware.LINKS["nvlink3"] = seed_links
        worse = statistics.mean(abs(c.error) for c in published.check(published.MEGATRON_RUNS))
    finally:
        hardware.LINKS["nvlink3"] = dataclasses.replace(seed_links, efficiency=hardware.LINK_EFFICIENCY)
    assert mean < 0.10 and worse > mean + 0.04, (mean, worse)


def test_torchtitans_selective_op_policy_is_priced_as_the_work_it_recomputes():
    """torchtitan's "selective op" checkpointing recomputes a block's 2nd, 4th and 6th matmuls (wk,
    wo, w3): 36.5% of an 8b block's forward matmul FLOPs (hand count: (4096*1024 + 4096^2 +
    4096*14336) / (2*4096^2 + 2*4096*1024 + 3*4096*14336)). Priced as plait's selective, which
    recomputes no matmul, the published rows were over-predicted by 24-35%; with those matmuls
    recomputed, by 14-22%, near the 14% of the run without checkpointing (the catalog's efficiency
    on an A100 nobody calibrated)."""
    import dataclasses

    assert published.torchtitan_op_sac(4096, 1024, 14336) == 79691776 / 218103808
    sel = [r for r in published.RUNS if r.layout.get("recompute_matmuls")]
    assert len(sel) == 3
    priced = published.check(tuple(sel))
    plain = published.check(tuple(dataclasses.replace(r, layout={**r.layout, "recompute_matmuls": 0.0})
                                  for r in sel))
    for a, b in zip(priced, plain):
        assert 0.08 < b.predicted / a.predicted - 1 < 0.16, (a.run.name, a.predicted, b.predicted)
    # on 70B at one sequence the fp32 reduce-scatters bound the step either way (-4.9% priced, +3.0%
    # without the matmuls); over the three rows the priced policy is the closer
    assert statistics.mean(abs(a.error) for a in priced) < statistics.mean(abs(b.error) for b in plain) - 0.05


def test_megatron_2021_runs_are_priced_as_its_table_script_ran_them():
    """What the Megatron-LM rows take from Megatron-LM 2021 (its paper and the script that made its
    Table 1, `published.MEGATRON_SC21`): the script's micro-batches and interleaving; tensor
    parallelism without sequence parallelism (every TP rank runs the norms and dropouts on the
    whole micro-batch: 7.5% mean error without it); a reentrant checkpoint that replays both
    all-reduces of a layer (3.7% without it); its "local" DDP's all-reduce after the backward on
    the pipelined rows (2.8%). Breaking any one makes the ten rows worse."""
    import dataclasses

    def mean(runs) -> float:
        return statistics.mean(abs(c.error) for c in published.check(tuple(runs)))

    rows = published.MEGATRON_RUNS
    assert [r.layout["micro_batch"] for r in rows] == [16, 16, 16, 8, 4, 2, 2, 1, 1, 1]
    assert [r.layout["v"] for r in rows] == [1, 1, 1, 1, 1, 3, 2, 2, 3, 1]
    base = mean(rows)
    for knob, broken in (("sp", True), ("recompute_whole", False), ("grad_overlap", True)):
        assert mean(dataclasses.replace(r, layout={**r.layout, knob: broken}) for r in rows) > base + 0.003, knob


def test_torchtitan_rows_reduce_gradients_in_fp32():
    """torchtitan's FSDP2 reduces gradients in fp32 (its default mixed_precision_reduce): twice the
    reduce-scatter bytes of a 16-bit reduction. Priced with 16-bit reductions its six rows came out
    11.8% fast on average, 8.0% with them in fp32."""
    import dataclasses

    from plait.planner.memory import PRECISIONS

    assert PRECISIONS["mixed-fp32-reduce"].wire_grad_bytes == 4 and PRECISIONS["mixed"].wire_grad_bytes == 2
    rows = tuple(r for r in published.RUNS if r.source == published.TORCHTITAN)
    fp32 = statistics.mean(abs(c.error) for c in published.check(rows))
    bf16 = statistics.mean(abs(c.error) for c in published.check(tuple(dataclasses.replace(r, precision="mixed")
                                                                     for r in rows)))
    assert fp32 < 0.09 and bf16 > fp32 + 0.03, (fp32, bf16)


def test_plan_published_prints_the_table(capsys):
    from plait.cli import main

    assert main(["plan", "--published"]) == 0
    out = capsys.readouterr().out
    assert "torchtitan Llama 3 70B, FSDP2, full AC" in out and "mean |error|" in out
    import json

    assert main(["plan", "--published", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "plait.plan/1" and data["mode"] == "published"
    assert len(data["published"]["runs"]) == len(published.RUNS)
    row = data["published"]["runs"][0]
    assert row["tokens_per_s_per_gpu"]["measured"] == published.RUNS[0].tokens_per_s_per_gpu
    assert data["published"]["error"]["worst"] == max(abs(r["tokens_per_s_per_gpu"]["error"])
                                                      for r in data["published"]["runs"])
