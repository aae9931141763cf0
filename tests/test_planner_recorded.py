"""The planner against every plait run recorded in bench/results: each prediction beside its
measurement. Peak memory is held to its goal (within 3% on average); the full table is printed
(pytest -s) and kept in bench/README.md."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from plait.planner import recorded

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def test_every_recorded_plait_run_is_predicted_and_peak_memory_is_within_goal():
    runs = recorded.load(RESULTS)
    names = {r.source for r in runs}
    # every kind of layout the benches ran: one GPU, DDP, ZeRO-1/2/3, TP with and without SP and
    # selective recomputation, and the pipeline schedules
    for want in ("dp-h100-4gpu.json:plait-1gpu", "dp-h100-4gpu.json:plait-ddp", "dp-h100-4gpu.json:plait-zero2",
                 "dp-8b-h100-4gpu.json:plait-zero3", "tp-h100-4gpu.json:plait-tp4-sp-sel", "tp-h100-4gpu.json:plait-tp2",
                 "pp-h100-2gpu.json:plait-1f1b", "pp-h100-2gpu.json:plait-interleaved",
                 "pp-h200-4gpu-8b-zb-compiled.json:plait-zb@m32/8,9,9,6",
                 "pp-h100-4gpu-1b-zb-compiled.json:plait-zb@m8/5,5,5,1",
                 "pp-h200-4gpu.json:plait-1f1b@m32/9,9,9,5", "cp-h200-4gpu-s32k-mb4.json:plait-cp4-ring@32768",
                 "cp-h100-4gpu-s32k-mb4.json:plait-cp4-ulysses@32768", "cp-h200-4gpu.json:plait-cp1@65536",
                 "train-step-h100-2026-11-26.json:plait@1b/16L-mb2-s8192",
                 "train-step-h100-2026-11-26.json:plait@8b/8L-mb2-s2048",
                 "pp-h100-4gpu-1b.json:plait-gpipe@m32/5,5,5,1", "pp-h100-4gpu-1b.json:plait-interleaved@m8/2,2,2,2,2,2,3,1",
                 "pp-h200-4gpu-1b.json:plait-1f1b@m16/5,5,5,1", "pp-h100-4gpu-1b.json:plait-zero3@m4",
                 "layouts-h200-4gpu-8b-s2048.json:tp1 pp1 dp4 zero3 mb8 rc:none",
                 "layouts-h200-4gpu-8b-8L-s32768.json:tp1 pp1 dp4 zero2 mb1 rc:none",
                 "cp-h200-4gpu-s32k-mb1.json:plait-cp4-ulysses@32768", "dp-h200-4gpu-profiled.json:plait-ddp",
                 "pp-h200-4gpu-1b-interleaved-peers.json:plait-interleaved@m4/2,2,2,2,2,2,2,2"):
        assert want in names, want
    assert not any(r.source.split(":")[0] in recorded.SUPERSEDED for r in runs)
    # rows that measured code since replaced (zero-bubble blocks compiled in pieces, the flash-kernel
    # ring, the ring's copying bookkeeping, Ulysses' all-to-alls re-run by recompute) are not priced
    assert "pp-h100-2gpu.json:plait-zb" not in names and "cp-h100-2gpu.json:plait-cp2-ring@16384" not in names
    assert "pp-h200-4gpu.json:plait-zb@m32/balance" not in names
    assert not {"cp-h200-4gpu.json:plait-cp4-ring@131072", "cp-h200-4gpu.json:plait-cp4-ulysses@32768",
                "layouts-h200-4gpu-8b-8L-s32768.json:tp1 pp1 dp1 zero2 cp4 mb4 rc:none"} & names
    checks = recorded.check(runs)
    print("\n" + recorded.table(checks))
    errors = [abs(c.memory_error) for c in checks]
    assert statistics.mean(errors) < 0.03, recorded.table(checks)
    assert max(errors) < 0.10, recorded.table(checks)


def test_an_interleaved_run_is_priced_with_the_virtual_stages_it_ran():
    """`--stage-layers balance` on an interleaved pipeline ran 1b's 16 layers as 2,2,2,2,2,2,3,1 (the
    last virtual stage holds the 128k head); the row records it. Priced with the even split instead,
    the four rows of today's runtime came out 6-8% long (the head's stage a layer too heavy)."""
    runs = [r for r in recorded.load(RESULTS) if r.source.startswith("pp-h100-4gpu-1b-interleaved-compiled-head.json")]
    from plait.planner.profile import load as load_profile

    assert len(runs) == 4 and all(r.layout["stage_split"] == "2,2,2,2,2,2,3,1" for r in runs)
    checks = recorded.check(runs, {"h100": load_profile(RESULTS / "hardware-h100.json")})
    assert max(abs(c.step_error) for c in checks) < 0.04, recorded.table(checks)


def test_a_variant_the_planner_cannot_read_is_an_error(tmp_path):
    """A new bench variant must be taught to `recorded._layout`, not silently left out of the table."""
    import json

    import pytest

    from plait.errors import UserError

    row = {"variant": "plait-zero4", "step_s_median": 0.1, "peak_mem_gb": 1.0}
    (tmp_path / "dp.json").write_text(json.dumps({"benchmark": "data_parallel", "card": "NVIDIA H100 80GB HBM3",
                                                  "gpus": 2, "config": {"preset": "1b", "seq": 2048, "micro_batch": 1},
                                                  "rows": [row]}))
    with pytest.raises(UserError, match="plait-zero4"):
        recorded.load(tmp_path)


@pytest.mark.parametrize("text, says", [("not json", "is not a readable JSON result (Expecting value"),
                                        ('{"benchmark": "tensor_parallel"', "is not a readable JSON result"),
                                        ("[1, 2]", "holds a JSON list, not a benchmark's result object")])
def test_a_file_that_is_no_result_is_one_line(tmp_path, capsys, text, says):
    """A half-written result (a benchmark stopped while writing it) ended `plan --check` in a
    JSONDecodeError traceback."""
    from plait.cli import main

    (tmp_path / "x.json").write_text(text)
    assert main(["plan", "--check", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--check {tmp_path}: x.json {says}" in err[0], err


def test_every_priced_run_against_the_goals():
    """Issue goal: every recorded run's step within 3% on average and 8% at worst, with each card's
    shipped profile. The mean holds (2.7% over 259 runs). The worst does not: 8b ZeRO-3 with FP8
    linears on 4 GPUs at one and two sequences a GPU, priced 7-11% fast on both cards (with the FP8
    all-gather at one sequence: H100 9.7% and 10.9%; H200, whose FP8 linears are measured since
    2026-11-28, 8.1-11.0%; the forward there is host-bound, bench/README.md); then the interleaved
    row at 32 micro-batches of the 8k-vocabulary 8b pipeline, 8.02% (its host at 0.98; 6.8% re-run
    with today's head); every other row is within 7.8% (the 2 x H200 pipelines at 32 micro-batches,
    7.4-7.7% fast). The bounds keep these rows from growing while the gap is open."""
    from plait.planner.profile import load as load_profile

    profiles = {g: load_profile(RESULTS / f"hardware-{g}.json") for g in ("h100", "h200")}
    checks = recorded.priced(recorded.check(recorded.load(RESULTS), profiles))
    errors = sorted((abs(c.step_error), c.run) for c in checks)
    assert len(checks) >= 210
    assert statistics.mean(e for e, _ in errors) < 0.03, errors[-5:]

    def fp8_zero3_small(run) -> bool:
        lay = run.layout
        return lay.get("fp8", "off") != "off" and lay.get("zero") == 3 and lay["micro_batch"] <= 2

    gap = [e for e, run in errors if fp8_zero3_small(run)]
    assert len(gap) >= 10 and max(gap) < 0.115, gap
    rest = [(e, run.source) for e, run in errors if not fp8_zero3_small(run)]
    assert rest[-1][0] < 0.0825 and rest[-2][0] < 0.08, rest[-5:]


@pytest.mark.parametrize("gpu,bound", [("h100", 0.05), ("h200", 0.05)])
def test_each_cards_measured_profile_prices_steps_closer_than_the_data_sheet(gpu, bound):
    """The shipped profiles (`plait bench calibrate` on an H100 and on an H200 machine) against the
    data-sheet defaults over every recorded run on that card: when this was written, H100 5.3% mean
    against 13.0%, H200 6.2% against 16.8% (its worst, zero-bubble 1b stages that ran CPU-bound, is
    in bench/README.md). The H100 profile is timed at the clock a loaded card holds; the runs on
    several GPUs are 3-9% slower than it prices them, the rest of the mean (bench/README.md).
    Pricing with the spec peak again - breaking the calibration - fails this, and so does leaving
    out the fused loss's memory-bound passes."""
    from plait.planner.profile import load as load_profile

    runs = [r for r in recorded.load(RESULTS) if r.gpu == gpu]
    prof = load_profile(RESULTS / f"hardware-{gpu}.json")
    calibrated = statistics.mean(abs(c.step_error) for c in recorded.priced(recorded.check(runs, {gpu: prof})))
    default = statistics.mean(abs(c.step_error) for c in recorded.priced(recorded.check(runs)))
    assert calibrated < bound, calibrated
    assert default > calibrated + 0.05, (default, calibrated)


def test_measured_lockstep_brings_the_h200_runs_on_several_gpus_closer():
    """The H200 profile carries the lockstep slowdown measured on 4 x H200 (1.2% for 2 and 4 GPUs):
    every multi-GPU step takes that much longer than one GPU's work, and the recorded runs on
    several H200s, which the planner prices short, come closer; one-GPU runs do not move. Dropping
    the lockstep from the profile fails this."""
    import dataclasses

    from plait.planner.profile import load as load_profile

    prof = load_profile(RESULTS / "hardware-h200.json")
    assert 0.005 < prof.lockstep_slowdown(4) < 0.03
    runs = [r for r in recorded.load(RESULTS) if r.gpu == "h200"]
    with_it, without = (recorded.priced(recorded.check(runs, {"h200": p}))
                        for p in (prof, dataclasses.replace(prof, lockstep={})))
    multi = [(a, b) for a, b in zip(with_it, without) if a.run.n_gpus > 1]
    assert len(multi) >= 20
    # by 0.5 points (3.2% against 3.7% mean error); a quarter point is the bar
    assert statistics.mean(abs(a.step_error) for a, _ in multi) < statistics.mean(abs(b.step_error) for _, b in multi) - 0.0025
    assert all(a.predicted_step_s == b.predicted_step_s for a, b in zip(with_it, without) if a.run.n_gpus == 1)


def test_one_gpu_steps_on_the_h100_are_priced_within_6pct_each():
    """What the profile alone decides: a step on one GPU has no communication, so its time is the
    calibrated kernels' plus the idle its host leaves. The H100 profile times the kernels behind
    load, at the clock (about 1.4 GHz at the 700 W cap) that the card holds under a training step,
    and measured the host's gaps on plait's own step (6.9 ms on 1b at 2 x 2048 tokens): every
    one-GPU H100 run is then within 6%, within 2% on average. The gaps differ from host to host
    (4.5-6.9 ms profiled on that step across H100 hosts, 24 ms on a one-GPU machine with a fourth of
    the cores), up to 2.5% of an 80-110 ms step. Timed behind an idle wait instead, the card boosts
    to 1.98 GHz and every such run came out 8-11% fast; the data sheet's defaults are up to 12% off."""
    from plait.planner.profile import load as load_profile

    runs = [r for r in recorded.load(RESULTS) if r.gpu == "h100" and r.n_gpus == 1]
    assert len(runs) >= 5, [r.source for r in runs]
    errors = [abs(c.step_error) for c in recorded.check(runs, {"h100": load_profile(RESULTS / "hardware-h100.json")})]
    assert max(errors) < 0.06 and statistics.mean(errors) < 0.02, errors


def test_zero3_steps_are_priced_with_their_passes_over_the_weights():
    """ZeRO-3 casts a rank's fp32 chunk to 16 bits before every gather, packs each unit's gradients
    into the reduce-scatter's buffer and, with several micro-batches a GPU, adds each reduced chunk
    into the step's: memory-bound passes on the compute stream, per micro-batch
    (`stage_costs.zero3_passes`). Priced, every recorded ZeRO-3 run without a pipeline on either
    card is within 7.5% and 3% on average; without them the planner priced them all short, by 4.9%
    on average and 12.8% at worst (8b on 2 GPUs with 4 micro-batches a GPU), which fails this.
    (The FP8 gather's runs, whose passes differ, and those with FP8 linears at one or two sequences a
    GPU, priced up to 9.3% short on H200, are held by test_every_priced_run_against_the_goals.)"""
    from plait.planner.profile import load as load_profile

    hw = {g: load_profile(RESULTS / f"hardware-{g}.json") for g in ("h100", "h200")}
    runs = [r for r in recorded.load(RESULTS) if r.layout.get("zero") == 3 and r.layout.get("pp", 1) == 1
            and r.layout.get("cp", 1) == 1 and r.n_gpus > 1 and not r.layout.get("zero3_fp8_gather")
            and not (r.layout.get("fp8", "off") != "off" and r.layout["micro_batch"] <= 2)]
    assert len(runs) >= 20, [r.source for r in runs]
    assert any(r.global_batch > r.n_gpus * r.layout["micro_batch"] for r in runs)  # several micro-batches a GPU
    errors = [abs(c.step_error) for c in recorded.priced(recorded.check(runs, hw))]
    assert max(errors) < 0.075 and statistics.mean(errors) < 0.03, sorted(errors)


@pytest.mark.parametrize("name", ["layouts-h200-4gpu-8b-s2048.json", "layouts-h200-4gpu-8b-8L-s32768.json"])
def test_the_layout_the_search_ranks_first_runs_within_5pct_of_the_fastest_tried(name):
    """bench/layouts.py ran the search's best layouts (and others) with plait's trainer on 4 x H200:
    8b at sequence 2048 and the 8b shape (8 layers) at 32k. What the search ranks first must be,
    measured, within 5% of the fastest layout tried; each file holds the search's own ranking, the
    profile it used, and at least one layout it ranked lower."""
    import json

    data = json.loads((RESULTS / name).read_text())
    rows = [r for r in data["rows"] if "step_s_median" in r]
    assert len(rows) >= 3 and data["search"][0]["layout"] == next(r for r in rows if r["search_rank"] == 1)["variant"]
    first = next(r for r in rows if r["search_rank"] == 1)
    fastest = min(r["step_s_median"] for r in rows)
    assert first["step_s_median"] <= 1.05 * fastest, (first, fastest)
    assert any(r["search_rank"] != 1 for r in rows)


def test_the_planner_predicts_each_pipelines_measured_bubble_for_the_split_that_ran():
    """Every pipeline run recorded its measured bubble. For every schedule (GPipe, 1F1B, interleaved,
    ZB-H1, ZB-V), the planner's simulation of the same split with its profile's stage costs comes within
    2 points of it on average where the textbook formula, which assumes equal stages, is 9+ points
    off. Runs whose host could not keep its GPU fed (host share >= 1: the 1b zero-bubble stages at
    16-32 micro-batches) measured the CPU, which the planner does not price; their rows are in the
    table, not the bound. Simulating equal stages instead of the split's costs fails this."""
    from plait.planner.profile import load as load_profile

    runs = [r for r in recorded.load(RESULTS) if r.bubble is not None]
    profiles = {g: load_profile(RESULTS / f"hardware-{g}.json") for g in ("h100", "h200")}
    checks = recorded.check(runs, profiles)
    print("\n" + recorded.bubble_table(checks))
    fed = [c for c in checks if not c.run.host_bound]
    assert len(fed) >= 20 and {c.run.layout["schedule"] for c in fed} == {"gpipe", "1f1b", "interleaved", "zb", "zbv"}
    gap = statistics.mean(abs(c.predicted_bubble - c.run.bubble) for c in fed)
    assert gap < 0.02, recorded.bubble_table(checks)


def test_an_untimed_row_is_priced_for_memory_and_left_out_of_the_step_statistics():
    """A run made to find the longest sequence that fits times its first length right after one
    warm-up step (compile, autotuning): the row says so (`untimed`), the table marks it, its memory
    counts and its step time does not."""
    runs = {r.source: r for r in recorded.load(RESULTS)}
    cold, warm = (runs[f"cp-h100-2gpu-longest.json:plait-cp1@{s}"] for s in (49152, 65536))
    assert cold.untimed and not warm.untimed
    checks = recorded.check([cold, warm])
    assert [c.run for c in recorded.priced(checks)] == [warm]
    text = recorded.table(checks)
    assert "untimed" in text and "1 untimed run" in text


def test_a_host_bound_run_is_shown_but_left_out_of_the_step_statistics():
    """A rank whose host took longer to issue its actions than its GPU to run them measured the CPU
    (the 1b zero-bubble stages on 4 x H200, host share up to 1.44): its row is marked, its step error
    stays out of the mean and the worst, its memory error stays in."""
    from dataclasses import replace

    runs = {r.source: r for r in recorded.load(RESULTS)}
    zb = runs["pp-h200-4gpu-1b-zb-compiled.json:plait-zb@m4/5,5,5,1"]
    assert zb.host_bound and zb.host_share > 1.4
    gpu = runs["dp-h100-4gpu.json:plait-ddp"]
    assert not gpu.host_bound
    checks = recorded.check([zb, gpu])
    assert [c.run for c in recorded.priced(checks)] == [gpu]
    text = recorded.table(checks)
    assert "host-bound (1.44)" in text and "leave out 1 host-bound" in text
    worst = [ln for ln in text.splitlines() if ln.startswith("worst |error|")][0]
    assert f"{abs(checks[1].step_error):.1%}" in worst
    assert not replace(zb, host_share=0.9).host_bound
    # the same as data (`plait plan --check DIR --json`): both rows, the host-bound one not counted
    data = recorded.rows(checks)
    assert [(r["run"], r["counted"], r["left_out"]) for r in data["runs"]] == [
        (zb.source, False, "host-bound"), (gpu.source, True, "")]
    assert data["step_error"] == {"mean": abs(checks[1].step_error), "worst": abs(checks[1].step_error), "runs": 1}


def test_a_data_parallel_run_with_accumulation_is_priced_at_its_global_batch(tmp_path):
    """`bench/data_parallel.py --accum N` runs N micro-batches a GPU a step: the planner must price
    G x micro-batch x N sequences, N micro-batches a GPU, not one."""
    import json

    def runs(accum: int, folder: Path) -> dict:
        folder.mkdir()
        rows = [{"variant": v, "step_s_median": 0.5, "peak_mem_gb": 20.0} for v in ("plait-1gpu", "plait-zero3")]
        config = {"preset": "1b", "seq": 2048, "micro_batch": 2, **({"accum": accum} if accum > 1 else {})}
        (folder / "dp.json").write_text(json.dumps({"benchmark": "data_parallel", "card": "NVIDIA H100 80GB HBM3",
                                                    "gpus": 4, "config": config, "rows": rows}))
        return {r.source.split(":")[1]: r for r in recorded.load(folder)}

    one, three = runs(1, tmp_path / "a"), runs(3, tmp_path / "b")
    assert one["plait-1gpu"].global_batch == 2 and three["plait-1gpu"].global_batch == 6
    assert one["plait-zero3"].global_batch == 8 and three["plait-zero3"].global_batch == 24
    assert three["plait-zero3"].layout["micro_batch"] == 2 and three["plait-zero3"].layout["dp"] == 4
    t1, t3 = (recorded.check([r["plait-zero3"]])[0].predicted_step_s for r in (one, three))
    assert 2.5 < t3 / t1 < 3.0  # three micro-batches' work; the update and the step's ends once


def test_a_result_file_says_which_head_it_ran(tmp_path):
    """The benches write `"head": HEAD_RUNTIME` into their results: such a run is priced with today's
    head (compiled final norm, no scaling or fp32 pass in one chunk); a file without it with the head
    of its day (`Layout.eager_head`), which costs more on a big vocabulary."""
    import json

    def run(head: dict, name: str):
        folder = tmp_path / name
        folder.mkdir()
        rows = [{"variant": "plait-1gpu", "step_s_median": 0.5, "peak_mem_gb": 20.0}]
        (folder / "dp.json").write_text(json.dumps({"benchmark": "data_parallel", "card": "NVIDIA H100 80GB HBM3",
                                                    "gpus": 4, **head, "config": {"preset": "1b", "seq": 2048,
                                                                                  "micro_batch": 1}, "rows": rows}))
        (r,) = recorded.load(folder)
        return r

    new, old = run({"head": recorded.HEAD_RUNTIME}, "new"), run({}, "old")
    assert not new.layout.get("eager_head") and old.layout["eager_head"]
    t_new, t_old = (recorded.check([r])[0].predicted_step_s for r in (new, old))
    assert t_new < t_old


def test_a_result_file_says_how_one_device_held_its_gradients(tmp_path):
    """The benches write `"grads": GRADS_RUNTIME`: one device's gradients came in pieces that the
    backward allocates, so at one micro-batch a step none is there at the forward's peak; a file
    without it held the whole buffer through the step (`Layout.grads_whole`), 2 bytes a parameter
    more at the peak."""
    import json

    from plait.planner.costs import param_count
    from plait.planner.inputs import model_dims

    def run(marks: dict, name: str, micro_batch: int):
        folder = tmp_path / f"{name}{micro_batch}"
        folder.mkdir()
        rows = [{"preset": "1b", "seq_len": 2048, "variant": "plait", "micro_batch": micro_batch,
                 "step_s_median": 0.5, "peak_mem_gb": 40.0}]
        (folder / "ts.json").write_text(json.dumps({"benchmark": "train_step", "card": "NVIDIA H200",
                                                    "head": recorded.HEAD_RUNTIME, **marks, "rows": rows}))
        (r,) = recorded.load(folder)
        return r

    new, old = run({"grads": recorded.GRADS_RUNTIME}, "new", 8), run({}, "old", 8)
    assert not new.layout.get("grads_whole") and old.layout["grads_whole"]
    m_new, m_old = (recorded.check([r])[0].predicted_peak_gb for r in (new, old))
    assert m_old - m_new == pytest.approx(2 * param_count(model_dims("1b")) / 1e9, rel=1e-6)


def test_a_result_file_says_whether_one_device_held_the_embeddings_16bit_copy(tmp_path):
    """The benches write `"embed": EMBED_RUNTIME`: an untied embedding is looked up from its fp32
    master with no 16-bit copy; a file without it held the copy (`Layout.embed_copy`), 2 bytes a
    table element more. A tied table (1b) keeps its copy either way."""
    import json

    def run(marks: dict, name: str, preset: str, extra: dict):
        folder = tmp_path / f"{name}{preset}"
        folder.mkdir()
        rows = [{"preset": preset, "seq_len": 2048, "variant": "plait", "micro_batch": 2, "step_s_median": 0.5,
                 "peak_mem_gb": 40.0, **extra}]
        (folder / "ts.json").write_text(json.dumps({"benchmark": "train_step", "card": "NVIDIA H200",
                                                    **recorded.RUNTIME_MARKS, **marks, "rows": rows}))
        (r,) = recorded.load(folder)
        return recorded.check([r])[0].predicted_peak_gb, r

    (m_new, new), (m_old, old) = (run(marks, name, "8b", {"n_layers": 8})
                                  for marks, name in (({}, "new"), ({"embed": "copy"}, "old")))
    assert not new.layout.get("embed_copy") and old.layout["embed_copy"]
    assert m_old - m_new == pytest.approx(128256 * 4096 * 2 / 1e9, rel=1e-6)
    tied = [run(marks, name, "1b", {})[0] for marks, name in (({}, "new"), ({"embed": "copy"}, "old"))]
    assert tied[0] == tied[1]


def test_a_zero_bubble_run_before_w_added_each_gradient_as_formed_is_priced_as_it_ran():
    """On 2 x H200 (8b, 16 layers, m = 8) both schedules held 45.09 GB on the 9-layer rank between
    actions, but ZB-H1 peaked 3.9 GB higher: its W formed the chunk's 63 weight gradients before
    adding any. A pipeline file without `"wgrad": WGRAD_RUNTIME` is priced with that (and lands
    within 1%); today's W adds each as formed, and the same run is priced at 1F1B's peak."""
    import dataclasses

    runs = [r for r in recorded.load(RESULTS) if r.source.startswith("pp-h200-2gpu-16l-held.json:")]
    (zb,), (f1b,) = ([r for r in runs if f"plait-{s}@" in r.source] for s in ("zb", "1f1b"))
    assert zb.layout["wgrad_batched"]
    old, ones = recorded.check([zb, f1b])
    assert abs(old.memory_error) < 0.01 and abs(ones.memory_error) < 0.01
    today = recorded.check([dataclasses.replace(zb, layout={**zb.layout, "wgrad_batched": False})])[0]
    assert today.predicted_peak_gb == pytest.approx(ones.predicted_peak_gb)
    assert old.predicted_peak_gb - today.predicted_peak_gb == pytest.approx(9 * 218.1e6 * 2 / 1e9, rel=0.01)


def test_fp8_runs_are_priced_from_the_measured_fp8_linears():
    """The recorded FP8 runs (`train.fp8` tensorwise and rowwise, one GPU; ZeRO-3 on 4 GPUs with the
    16-bit and the FP8 gather) are priced with the H100 profile's FP8 linear groups: one-GPU steps
    within 4.5%, every FP8 run's memory within 1.5% (a block of FP8 linears keeps less). Priced
    without the groups (the data sheet's FP8 peak and the passes' bytes) they are further off, and
    the check leaves them out of its step statistics."""
    import dataclasses

    from plait.planner.profile import load as load_profile

    runs = [r for r in recorded.load(RESULTS) if r.layout.get("fp8", "off") != "off" and r.gpu == "h100"]
    assert {r.layout["fp8"] for r in runs} == {"tensorwise", "rowwise"} and len(runs) >= 15
    prof = load_profile(RESULTS / "hardware-h100.json")
    checks = recorded.check(runs, {"h100": prof})
    one = [c for c in checks if c.run.n_gpus == 1]
    assert len(one) >= 6 and max(abs(c.step_error) for c in one) < 0.045, [(c.run.source, c.step_error) for c in one]
    assert max(abs(c.memory_error) for c in checks) < 0.015
    blind = recorded.check(runs, {"h100": dataclasses.replace(prof, fp8_linear=())})
    timed = [i for i, c in enumerate(checks) if not c.run.host_bound and not c.run.untimed]
    assert statistics.mean(abs(blind[i].step_error) for i in timed) > \
        statistics.mean(abs(checks[i].step_error) for i in timed)
    # without the groups the planner does not answer for these steps: shown, left out of the statistics
    assert all(c.unmeasured for c in blind) and not recorded.priced(blind)
    assert not any(c.unmeasured for c in checks) and len(recorded.priced(checks)) == len(timed)


def test_check_as_json_names_its_mode(tmp_path, capsys):
    """Every `plan --json` document names its `mode` (the docs say so); --check's had none."""
    import json

    from plait.cli import main

    rows = [{"variant": "plait-1gpu", "step_s_median": 0.5, "peak_mem_gb": 20.0}]
    (tmp_path / "dp.json").write_text(json.dumps({"benchmark": "data_parallel", "card": "NVIDIA H100 80GB HBM3",
                                                  "gpus": 4, "config": {"preset": "1b", "seq": 2048, "micro_batch": 1},
                                                  "rows": rows}))
    assert main(["plan", "--check", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mode"] == "check" and len(data["check"]["runs"]) == 1
