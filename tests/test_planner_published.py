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
    # Megatron-LM's GPT runs on 32-3,072 A100s (TP, PP, DP; Narayanan et al. 2021): 9.1% mean when written
    megatron = [abs(c.error) for c in checks if c.run.source == published.MEGATRON_2021]
    assert len(megatron) == 10 and statistics.mean(megatron) < 0.10 and max(megatron) < 0.18, published.table(checks)
    assert statistics.mean(errors) < 0.12 and max(errors) < 0.25, published.table(checks)


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
        assert abs(a.error) < abs(b.error)


def test_plan_published_prints_the_table(capsys):
    from plait.cli import main

    assert main(["plan", "--published"]) == 0
    out = capsys.readouterr().out
    assert "torchtitan Llama 3 70B, FSDP2, full AC" in out and "mean |error|" in out
