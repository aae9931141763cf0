"""The layout search: only layouts that fit, ranked by predicted step time, pinned dims respected,
and a reason for every rejection."""

import pytest

from plait.config import PRESETS, ModelConfig
from plait.planner.costs import ModelDims
from plait.planner.hardware import cluster
from plait.planner.layout import check_layout
from plait.planner.predict import predict
from plait.planner.search import Space, candidates, explain_ranking, pin, search

L8B = ModelDims.from_config(ModelConfig(**PRESETS["8b"]), seq=4096)
SMALL = Space(micro_batch=(1, 2), recompute=("none", "full"), zero=(0, 1, 3), v=(2,))


@pytest.fixture(scope="module")
def result():
    return search(L8B, cluster("h100", 2, 8), 64, space=SMALL, top=8, refine=12)


def test_ranked_by_simulated_step_time_and_all_fit(result):
    assert result.ranked
    times = [p.step_time_s for p in result.ranked]
    # ascending; equal times (to rounding) are ordered toward simpler layouts, so a pair may differ in
    # the last bits the wrong way
    assert all(b >= a * (1 - 1e-9) for a, b in zip(times, times[1:])), times
    for p in result.ranked:
        assert p.fits and p.exact
        again = predict(L8B, p.layout, cluster("h100", 2, 8), 64)
        assert again.step_time_s == pytest.approx(p.step_time_s)


def test_every_candidate_is_counted(result):
    n = sum(1 for _ in candidates(L8B, cluster("h100", 2, 8), 64, SMALL))
    fitting = n - sum(result.rejected.values())
    assert result.considered == n and fitting >= len(result.ranked)


def test_the_winner_beats_what_it_is_compared_with(result):
    best = result.best
    for lay in (p.layout for p in result.ranked[1:]):
        assert predict(L8B, lay, cluster("h100", 2, 8), 64).step_time_s >= best.step_time_s * 0.999
    lines = explain_ranking(result)
    assert lines[0].startswith("#1 ") and "MFU" in lines[0]
    assert any(line.startswith("considered") for line in lines)


def test_pins_are_respected():
    res = search(L8B, cluster("h100", 2, 8), 64, space=pin(SMALL, tp=4, pp=2), top=5, refine=5)
    assert res.ranked and all(p.layout.tp == 4 and p.layout.pp == 2 for p in res.ranked)


def test_context_parallel_layouts_are_tried_both_ways():
    """Where cp > 1 the search prices the ring and Ulysses (the planner prices both within a few
    percent of measured runs, bench/README.md); a pinned implementation is the only one tried."""
    long = ModelDims.from_config(ModelConfig(**PRESETS["8b"]), seq=32768)
    c = cluster("h200", 1, 4)
    space = Space(micro_batch=(1,), recompute=("selective",), zero=(2,), pp=(1,))
    impls = {(lay.cp, lay.cp_impl) for lay in candidates(long, c, 4, space)}
    assert {(2, "ring"), (2, "ulysses"), (4, "ring"), (4, "ulysses")} <= impls
    assert all(impl == "ring" for cp, impl in impls if cp == 1)
    pinned = {(lay.cp, lay.cp_impl) for lay in candidates(long, c, 4, pin(space, cp_impl="ring"))}
    assert {impl for cp, impl in pinned if cp > 1} == {"ring"}


def test_candidates_are_valid_layouts():
    c = cluster("h100", 2, 8)
    for lay in candidates(L8B, c, 64, SMALL):
        assert lay.n_gpus == 16
        check_layout(L8B, lay, c, 64)


def test_nothing_fits():
    big = ModelDims.from_config(ModelConfig(**PRESETS["405b"]))
    res = search(big, cluster("h100", 1, 1), 8, space=Space(micro_batch=(1,), recompute=("full",)))
    assert res.ranked == [] and res.rejected["does not fit in memory"] >= 1
    why = explain_ranking(res)
    assert why[0].startswith(f"no layout fits: of {res.considered} considered, {res.considered} rejected: does not fit")
    # what the nearest needs (it printed an empty table and "does not fit in memory: 1")
    # the leanest of them: how far off the cluster is (the fastest named 4593 GiB for 405b on 8 GPUs)
    lean = min(res.leanest_oom.memory_total_bytes, res.example_oom.memory_total_bytes)
    assert res.leanest_oom.memory_total_bytes == lean
    assert why[1].startswith("the leanest of them, tp1 pp1 dp1") and "GiB per GPU of 80 (" in why[1]
    assert "x): more GPUs" in why[1]
    from plait.planner.report import ranking_text

    assert ranking_text(res).splitlines() == why


def test_bench_layouts_reads_back_every_name_the_search_prints():
    """bench/layouts.py runs the search's layouts by their printed names: each name of a 4-GPU search
    (ZeRO stages, HSDP, CP with either implementation, TP + SP, recompute) reads back to a layout
    whose name is the same."""
    import sys
    from pathlib import Path

    from plait.planner import inputs
    from plait.planner.search import search

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from layouts import parse_layout

    c = inputs.make_cluster("h200", 1, 4, {})
    d = inputs.model_dims("8b", "llama", None, seq=8192)
    names = {p.layout.describe() for p in search(d, c, 8, top=2000, refine=2000).ranked if p.layout.pp == 1}
    assert any("cp" in n for n in names) and any("tp2" in n for n in names) and any("x" in n.split()[2] for n in names)
    for name in names:
        assert inputs.make_layout(c, **parse_layout(name)).describe() == name


def test_a_small_models_reasons_have_digits_and_no_dangling_separator():
    """A search that rejected nothing ended "considered 12 layouts; ", and a small model's runners-up
    read "+0.000 s compute": differences under a millisecond at three decimals of a second."""
    tiny = ModelDims.from_config(ModelConfig(**PRESETS["tiny"]))
    res = search(tiny, cluster("h100", 1, 1), 512, top=10)
    assert not res.rejected and len(res.ranked) >= 3
    lines = explain_ranking(res)
    assert lines[-1] == f"considered {res.considered} layouts, none rejected"
    assert not any("0.000 s" in line for line in lines), lines
    assert "ms compute" in lines[1]


def test_a_long_search_reports_its_progress_and_a_pipe_gets_none(monkeypatch):
    """`search` counts the layouts it has screened, every 1,000, out of all it will screen; `plait
    plan` shows that on a terminal only (a pipe or file gets the result alone)."""
    import io

    from plait.commands.plan import _search_progress
    from plait.planner import inputs

    calls = []
    res = search(inputs.model_dims("1b", seq=2048), cluster("h100", 1, 8), 64, progress=lambda *a: calls.append(a))
    assert calls == [(k, res.considered) for k in range(1000, res.considered + 1, 1000)] and len(calls) >= 5
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert _search_progress() is None

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    monkeypatch.setattr("sys.stderr", tty)
    show = _search_progress()
    show(1000, 2500)
    show(2000, 2500)
    assert "searching: 1,000 of 2,500 layouts screened\r" in tty.getvalue() and tty.getvalue().endswith("\r\033[K")


def test_a_balance_split_that_comes_out_even_is_not_tried_twice():
    """`balance` moves layers off the last stage to pay for the output head; where the layers divide so
    that it changes nothing (here 8b's 32 layers over 32 stages: a layer each either way), the even
    split already is that layout, and a ranking would list the same prediction twice."""
    from plait.planner.stage_costs import split_layers

    seen = {}
    for lay in candidates(L8B, cluster("h100", 4, 8), 64, SMALL):
        if lay.pp == 1:
            continue
        S = lay.pp * lay.v
        key = (lay.tp, lay.pp, lay.v, lay.dp_shard, lay.dp_replicate, lay.cp, lay.cp_impl, lay.zero,
               lay.micro_batch, lay.recompute, lay.schedule, tuple(split_layers(L8B, S, lay.stage_split, lay.schedule)))
        assert key not in seen, (lay, seen[key])
        seen[key] = lay
    assert any(k[1] * k[2] == 32 for k in seen)  # the case where the two splits agree was searched
