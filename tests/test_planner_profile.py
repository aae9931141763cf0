"""Hardware profiles (`plait bench calibrate` -> `plait plan --hardware`): the calibrate tool writes a
profile the planner reads, measured shapes cost what they measured, other shapes take the nearest
measured efficiency, collectives interpolate between measured sizes, and a bad file is one line."""

from __future__ import annotations

import json
import math
import re

import pytest

from plait.cli import main
from plait.errors import UserError
from plait.planner import roofline
from plait.planner.hardware import cluster
from plait.planner.layout import Layout
from plait.planner.predict import predict
from plait.planner.profile import HardwareProfile, apply_profile, load, save
from plait.planner.traffic import collective_time_s

PEAK = 989e12


def _profile(**kw) -> HardwareProfile:
    base = dict(card="NVIDIA H100 80GB HBM3", gpu="h100", dtype="bf16", peak_tflops=None, hbm_gib=79.2,
                linear=(("fwd", 4096, 4096, 6144, 2 * 4096 * 4096 * 6144 / (0.6 * PEAK)),
                        ("dgrad", 4096, 4096, 6144, 2 * 4096 * 4096 * 6144 / (0.5 * PEAK)),
                        ("wgrad", 4096, 4096, 6144, 2 * 4096 * 4096 * 6144 / (0.4 * PEAK))),
                attention=((2, 2048, 32, 8, 128, 1e-3, 2.5e-3),),
                pointwise_gbps=2500.0, optimizer_gbps=2000.0,
                collectives=(("all_reduce", 2, 1 << 20, 20e-6), ("all_reduce", 2, 1 << 30, 5e-3)))
    base.update(kw)
    return HardwareProfile(**base)


def test_measured_shapes_cost_what_they_measured_and_others_take_the_nearest_efficiency():
    p = _profile()
    assert p.linear_s("fwd", 4096, 4096, 6144, PEAK) == p.linear[0][4]
    # twice the tokens at the same efficiency (60% of peak): twice the time
    assert p.linear_s("fwd", 8192, 4096, 6144, PEAK) == pytest.approx(2 * p.linear[0][4])
    assert p.linear_s("wgrad", 4096, 4096, 6144, PEAK) == pytest.approx(1.5 * p.linear[0][4])
    # attention: exact, and a longer sequence scaled by its causal FLOPs (s^2)
    assert p.attention_s(2, 2048, 32, 8, 128, PEAK) == (1e-3, 2.5e-3)
    f, b = p.attention_s(2, 4096, 32, 8, 128, PEAK)
    assert (f, b) == (pytest.approx(4e-3), pytest.approx(1e-2))
    assert _profile(linear=()).linear_s("fwd", 1, 1, 1, PEAK) is None


def test_collectives_interpolate_between_measured_sizes():
    p = _profile()
    small, big = 1 << 20, 1 << 30
    assert p.collective_s("all_reduce", small, 2) == 20e-6
    assert p.collective_s("all_reduce", 1024, 2) == 20e-6  # below the smallest: the latency floor
    assert p.collective_s("all_reduce", 2 * big, 2) == pytest.approx(10e-3)  # beyond: the last bandwidth
    mid = math.sqrt(small * big)  # halfway in log size: halfway in log time
    assert p.collective_s("all_reduce", mid, 2) == pytest.approx(math.sqrt(20e-6 * 5e-3))
    assert p.collective_s("all_reduce", small, 4) is None and p.collective_s("all_gather", small, 2) is None
    gbps, lat_us = p.fitted_link()
    assert gbps == pytest.approx(big / 5e-3 / 1e9)  # all-reduce over 2 sends the buffer once
    assert lat_us == pytest.approx(20e-6 / 2 * 1e6)  # two ring steps


def test_a_calibrated_cluster_prices_with_the_profile():
    """apply_profile: the link carries the measured collectives (alpha-beta for the rest), matmuls
    and the optimizer cost what was measured, and a step gets slower when the card is slower."""
    c = cluster("h100", 1, 2)
    p = _profile()
    cal = apply_profile(c, p)
    assert collective_time_s("all_reduce", 1 << 30, 2, cal.intra) == 5e-3
    assert collective_time_s("all_gather", 1 << 30, 2, cal.intra) == pytest.approx(
        (1 << 30) / 2 / (cal.intra.gbps * 1e9) + cal.intra.latency_s)
    assert roofline.linear_time_s("fwd", 4096, 4096, 6144, cal) == p.linear[0][4]
    assert cal.gpu.hbm_gib == 79.2 and cal.hbm_efficiency == pytest.approx(2500 / 3350)
    d = _dims()
    fast = predict(d, Layout(dp_shard=2, zero=1), cal, 2)
    slow_linear = tuple((op, m, k, n, 2 * t) for op, m, k, n, t in p.linear)
    slow = predict(d, Layout(dp_shard=2, zero=1), apply_profile(c, _profile(linear=slow_linear)), 2)
    assert slow.time_s["compute"] > 1.5 * fast.time_s["compute"]
    with pytest.raises(Exception, match="measured on .* plan with --gpu h100"):
        apply_profile(cluster("h200", 1, 2), p)


def _dims():
    from plait.planner.inputs import model_dims

    return model_dims("8b", seq=2048, layers=2)


def test_bad_profiles_are_one_line(tmp_path):

    with pytest.raises(UserError, match="no such file; measure one with `plait bench calibrate"):
        load(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(UserError, match="not a readable JSON"):
        load(bad)
    save(_profile(), tmp_path / "ok.json")
    raw = json.loads((tmp_path / "ok.json").read_text())
    assert load(tmp_path / "ok.json") == _profile()
    for field, value, msg in (("schema", "x", "schema is 'x'"), ("pointwise_gbps", -1, "pointwise_gbps = -1"),
                              ("linear", [["fwd", 1, 2]], r"linear\[0\]")):
        (tmp_path / "f.json").write_text(json.dumps(dict(raw, **{field: value})))
        with pytest.raises(UserError, match=msg) as e:
            load(tmp_path / "f.json")
        assert "\n" not in str(e.value)


def test_calibrate_writes_a_profile_that_plan_reads(tmp_path, capsys):
    """`plait bench calibrate --quick` on this CPU (two gloo processes for the collectives) writes
    every section; `plait plan --hardware` prices with it and says so in --explain."""
    out = tmp_path / "cpu.json"
    assert main(["bench", "calibrate", "--quick", "--device", "cpu", "--nproc", "2", "--out", str(out)]) == 0
    p = load(out)
    assert p.gpu is None and p.peak_tflops > 0 and p.dtype == "fp32"
    assert {x[0] for x in p.linear} == {"fwd", "dgrad", "wgrad"} and all(x[4] > 0 for x in p.linear)
    assert p.attention and all(x[5] > 0 and x[6] > 0 for x in p.attention)
    assert {(x[0], x[1]) for x in p.collectives} == {("all_reduce", 2), ("all_gather", 2), ("reduce_scatter", 2),
                                                      ("send_recv", 2)}
    assert p.pointwise_gbps > 0 and p.optimizer_gbps > 0
    assert set(p.overlap) == {"all_gather", "all_reduce", "send_recv"} and all(x >= 0 for x in p.overlap.values())
    assert set(p.stretch) == {"all_gather", "all_reduce", "send_recv"} and all(x >= 1 for x in p.stretch.values())
    assert set(p.lockstep["groups"]) == {"2"} and p.lockstep["groups"]["2"] >= 0 and p.lockstep["sigma"] >= 0
    capsys.readouterr()
    assert main(["plan", "--hardware", str(out), "--model", "tiny", "--seq", "64", "--gpus-per-node", "2",
                 "--dp", "2", "--micro-batch", "1", "--global-batch", "2", "--explain"]) == 0
    text = capsys.readouterr().out
    assert "as measured on cpu" in text and "measured (" in text


def test_lockstep_is_the_expected_maximum_of_the_jobs_gpus():
    """A measured group size costs what it measured; a larger job its spread times the expected
    maximum of that many normal draws; one GPU, or a profile without it, nothing."""
    from plait.planner.profile import expected_max_normal

    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)  # the textbook value
    assert expected_max_normal(4) == pytest.approx(1.02938, rel=1e-4)
    assert expected_max_normal(64) == pytest.approx(2.3464, rel=2e-3)
    p = _profile(lockstep={"groups": {"2": 0.02, "4": 0.035}, "sigma": 0.034})
    assert p.lockstep_slowdown(1) == 0.0 and p.lockstep_slowdown(4) == 0.035
    assert p.lockstep_slowdown(64) == pytest.approx(0.034 * expected_max_normal(64))
    assert _profile().lockstep_slowdown(4) == 0.0


def test_lockstep_slows_the_work_of_a_job_on_several_gpus():
    """The stage durations (hence a compute-bound step) of a multi-GPU layout grow by the measured
    slowdown; one GPU's do not."""
    d = _dims()
    base, locked = _profile(), _profile(lockstep={"groups": {"4": 0.04}, "sigma": 0.039})
    four = [predict(d, Layout(dp_shard=4, zero=1), apply_profile(cluster("h100", 1, 4), p), 4) for p in (base, locked)]
    assert four[1].time_s["compute"] == pytest.approx(1.04 * four[0].time_s["compute"], rel=1e-9)
    assert four[1].step_time_s > four[0].step_time_s + 0.03 * four[0].time_s["compute"]
    one = [predict(d, Layout(), apply_profile(cluster("h100", 1, 1), p), 1) for p in (base, locked)]
    assert one[0].step_time_s == one[1].step_time_s
    # --explain says which: measured for this many GPUs, or extended from the spread
    assert "x 1.040: 4 GPUs in lockstep" in dict(four[1].explain)["layer time"]
    assert "(measured)" in dict(four[1].explain)["layer time"]
    eight = predict(d, Layout(dp_shard=8, zero=1), apply_profile(cluster("h100", 1, 8), locked), 8)
    assert "8 GPUs in lockstep" in dict(eight.explain)["layer time"] and "spread" in dict(eight.explain)["layer time"]


def test_calibrate_only_lockstep_updates_a_profile(tmp_path, capsys):
    """--only lockstep rewrites that part of an existing profile and keeps the rest; without an
    existing --out it is one line naming the flag; a malformed lockstep field is one line."""
    out = tmp_path / "cpu.json"
    save(_profile(card="cpu", gpu=None, peak_tflops=0.2), out)
    assert main(["bench", "calibrate", "--only", "lockstep", "--device", "cpu", "--nproc", "2", "--out", str(out)]) == 0
    p = load(out)
    assert p == _profile(card="cpu", gpu=None, peak_tflops=0.2) and set(p.lockstep["groups"]) == {"2"}
    assert "lockstep" in p.source
    capsys.readouterr()
    assert main(["bench", "calibrate", "--only", "lockstep", "--device", "cpu", "--out", str(tmp_path / "no.json")]) == 2
    assert re.fullmatch(r"plait bench: error: --out = '.*no.json': --only updates an existing profile.*",
                        capsys.readouterr().err.strip())
    assert main(["bench", "calibrate", "--only", "lockstep", "--device", "cpu", "--nproc", "1", "--out", str(out)]) == 2
    assert "--nproc = 1: lockstep needs two or more GPUs" in capsys.readouterr().err
    save(_profile(), tmp_path / "h100.json")  # measured on another device than this one
    assert main(["bench", "calibrate", "--only", "lockstep", "--device", "cpu", "--out", str(tmp_path / "h100.json")]) == 2
    assert "it was measured on NVIDIA H100 80GB HBM3, this machine has cpu" in capsys.readouterr().err
    raw = json.loads(out.read_text())
    (tmp_path / "bad.json").write_text(json.dumps(dict(raw, lockstep={"groups": {"2": -1}})))
    with pytest.raises(UserError, match="lockstep = .*re-run `plait bench calibrate`") as e:
        load(tmp_path / "bad.json")
    assert "\n" not in str(e.value)


def test_calibrate_only_collectives_or_overlap_updates_those_parts(tmp_path):
    """--only collectives re-measures every collective (send/recv included) over 2 processes and
    --only overlap the slowdowns and stretches; the rest of the profile stays as it was."""
    out = tmp_path / "cpu.json"
    before = _profile(card="cpu", gpu=None, peak_tflops=0.2, collectives=(("all_reduce", 2, 1 << 20, 1.0),))
    save(before, out)
    assert main(["bench", "calibrate", "--only", "collectives", "--device", "cpu", "--nproc", "2",
                 "--max-bytes", "64K", "--out", str(out)]) == 0
    p = load(out)
    assert {(x[0], x[1]) for x in p.collectives} == {("all_reduce", 2), ("all_gather", 2), ("reduce_scatter", 2),
                                                      ("send_recv", 2)}
    assert ("all_reduce", 2, 1 << 20, 1.0) not in p.collectives and max(x[2] for x in p.collectives) <= 64 << 10
    assert p.linear == before.linear and p.overlap == {} and "collectives" in p.source
    assert main(["bench", "calibrate", "--only", "overlap", "--device", "cpu", "--nproc", "2", "--out", str(out)]) == 0
    q = load(out)
    assert set(q.overlap) == {"all_gather", "all_reduce", "send_recv"} and all(x >= 1 for x in q.stretch.values())
    assert q.collectives == p.collectives and {"collectives", "overlap"} <= set(q.source)


def test_calibrate_takes_collectives_from_a_comm_result(tmp_path, capsys):
    """--collectives adds torch's rows of a `plait bench comm --json` file (its group size from the
    file) for group sizes not measured here; a file from another card is one line."""
    comm = {"device": "cpu", "nproc": 4, "results": [
        {"op": "all_reduce", "impl": "torch", "bytes": 1024, "time_us": 50.0},
        {"op": "all_reduce", "impl": "ring", "bytes": 1024, "time_us": 99.0},
        {"op": "all_gather", "impl": "torch", "bytes": 4096, "time_us": 70.0}]}
    (tmp_path / "comm.json").write_text(json.dumps(comm))
    out = tmp_path / "cpu.json"
    assert main(["bench", "calibrate", "--quick", "--device", "cpu", "--nproc", "1", "--collectives",
                 str(tmp_path / "comm.json"), "--out", str(out)]) == 0
    assert sorted(load(out).collectives) == [("all_gather", 4, 4096, 70e-6), ("all_reduce", 4, 1024, 50e-6)]
    (tmp_path / "gpu.json").write_text(json.dumps(dict(comm, device="NVIDIA H100 80GB HBM3")))
    capsys.readouterr()
    assert main(["bench", "calibrate", "--quick", "--device", "cpu", "--nproc", "1", "--collectives",
                 str(tmp_path / "gpu.json"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(r"plait bench: error: --collectives = '.*gpu.json': was measured on NVIDIA H100 80GB HBM3, "
                        r"this machine is cpu", err), err


def test_plan_takes_one_profile_a_card(capsys):
    """--hardware a,b: --check prices each recorded run with its card's profile, a plan takes --gpu's,
    and a list with no profile of --gpu is one line naming the flag."""
    from pathlib import Path

    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    both = f"{results / 'hardware-h100.json'},{results / 'hardware-h200.json'}"
    assert main(["plan", "--hardware", both, "--gpu", "h200", "--model", "8b", "--gpus-per-node", "4", "--dp", "4",
                 "--zero", "3", "--micro-batch", "8", "--global-batch", "32", "--seq", "2048"]) == 0
    assert "H200" in capsys.readouterr().out
    assert main(["plan", "--hardware", both, "--gpu", "a100-80gb", "--model", "8b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--hardware" in err[0] and "--gpu h100 or h200" in err[0]


def test_a_collective_beside_compute_runs_its_stretch_slower_and_slows_the_compute_that_long():
    """`stretch` from what overlap.py times: a 30 ms chain alone that ended 40 ms after 20 ms of
    matmuls began got through 10 ms of its work beside them: 2x. The planner's `hide` then gives a
    window of compute only window / stretch of a collective, and charges the overlap slowdown for
    the collective's longer time beside it. Without a stretch it prices as before."""
    import dataclasses

    from plait.benchmarks.overlap import stretch
    from plait.planner.hardware import cluster
    from plait.planner.profile import apply_profile
    from plait.planner.stage_costs import hide

    assert stretch(0.030, 0.020, 0.040) == pytest.approx(2.0)
    assert stretch(0.010, 0.020, 0.015) == pytest.approx(1.5)  # ended first: beside compute throughout
    assert stretch(0.030, 0.020, 0.029) == 1.0  # faster beside than alone: noise, no stretch
    c = apply_profile(cluster("h100", 1, 2), dataclasses.replace(_profile(), overlap={"all_gather": 0.25}))
    assert hide((("all_gather", 0.004),), 0.010, c) == pytest.approx((0.0, 0.001))
    c2 = apply_profile(cluster("h100", 1, 2), dataclasses.replace(_profile(), overlap={"all_gather": 0.25},
                                                                   stretch={"all_gather": 2.0}))
    assert hide((("all_gather", 0.004),), 0.010, c2) == pytest.approx((0.0, 0.002))
    # 8 ms alone, 16 ms beside: the 10 ms window hides 5 ms of it, 3 ms run after the compute
    assert hide((("all_gather", 0.008),), 0.010, c2) == pytest.approx((0.003, 0.25 * 0.010))


def test_a_profile_with_a_stretch_below_one_is_refused(tmp_path):
    from plait.planner.profile import to_dict

    raw = to_dict(_profile())
    raw["overlap_stretch"] = {"all_gather": 0.5}
    (tmp_path / "s.json").write_text(json.dumps(raw))
    with pytest.raises(UserError, match="overlap_stretch"):
        load(tmp_path / "s.json")


def test_a_step_pays_the_measured_host_gap_once(tmp_path, capsys):
    """The idle a plait step leaves its GPU (`step_gap_s`, plait/benchmarks/step_gaps.py) is added
    once a step, whatever the layout and micro-batch count, as its own part ("host"); it survives a
    save and load; a bad value is one line; `--only gaps` on a CPU writes none (nothing there waits
    for the host) and keeps the rest of the profile."""
    d = _dims()
    for lay, gb, n in ((Layout(), 1, 1), (Layout(dp_shard=4, zero=3), 16, 4), (Layout(pp=2, dp_shard=2), 8, 4)):
        c = cluster("h100", 1, n)
        base = predict(d, lay, apply_profile(c, _profile()), gb)
        gap = predict(d, lay, apply_profile(c, _profile(step_gap_s=0.004)), gb)
        assert gap.step_time_s == pytest.approx(base.step_time_s + 0.004, rel=1e-12)
        assert gap.time_s["host"] == 0.004 and base.time_s["host"] == 0.0
        assert sum(gap.time_s.values()) == pytest.approx(gap.step_time_s)
    assert "host gaps 4.00 ms" in dict(gap.explain)["step time"]
    save(_profile(step_gap_s=0.004), tmp_path / "g.json")
    assert load(tmp_path / "g.json").step_gap_s == 0.004
    raw = json.loads((tmp_path / "g.json").read_text())
    (tmp_path / "bad.json").write_text(json.dumps(dict(raw, step_gap_s=-1)))
    with pytest.raises(UserError, match=r"step_gap_s = -1, expected seconds in \[0, 1\)") as e:
        load(tmp_path / "bad.json")
    assert "\n" not in str(e.value)
    out = tmp_path / "cpu.json"
    save(_profile(card="cpu", gpu=None, peak_tflops=0.2, step_gap_s=0.004), out)
    assert main(["bench", "calibrate", "--only", "gaps", "--device", "cpu", "--nproc", "1", "--out", str(out)]) == 0
    p = load(out)
    assert p.step_gap_s == 0.0 and "gaps" in p.source and p.linear == _profile().linear


def test_step_gaps_runs_plaits_own_step():
    """`plait bench calibrate`'s gap measurement builds and runs plait's one-GPU step end to end; on
    a CPU it profiles nothing (the host runs the kernels: no GPU waits) and reports 0 seconds."""
    import torch

    from plait.benchmarks import step_gaps

    got = step_gaps.measure(torch.device("cpu"), preset="tiny", micro_batch=1, seq=64, warmup=1, steps=1)
    assert got["seconds"] == 0.0 and got["gaps"] == [] and (got["model"], got["micro_batch"], got["seq"]) == ("tiny", 1, 64)


def test_overlap_is_measured_and_priced_per_group_size(tmp_path):
    """`--only overlap --nproc 4` measures the overlap over 2 GPUs (`overlap`) and over 4
    (`overlap_groups`), both saved and read back. The planner prices a collective with the largest
    group measured that is not larger than its own: ZeRO-3 over 4 GPUs with the 4-GPU figures,
    over 2 with the 2-GPU ones; a profile without groups prices every group size as before."""
    import dataclasses

    from plait.config import PRESETS, ModelConfig
    from plait.planner.costs import ModelDims
    from plait.planner.predict import predict
    from plait.planner.profile import apply_profile

    out = tmp_path / "cpu.json"
    save(_profile(card="cpu", gpu=None, peak_tflops=0.2), out)
    assert main(["bench", "calibrate", "--only", "overlap", "--device", "cpu", "--nproc", "4", "--out", str(out)]) == 0
    q = load(out)
    assert set(q.overlap_groups) == set(q.stretch_groups) == {"4"}
    assert set(q.overlap_groups["4"]) == {"all_gather", "all_reduce", "send_recv"}
    assert all(x >= 1 for x in q.stretch_groups["4"].values())

    flat = dataclasses.replace(_profile(), overlap={"all_gather": 0.1, "reduce_scatter": 0.1, "all_reduce": 0.2},
                               stretch={"all_gather": 1.5, "reduce_scatter": 1.5, "all_reduce": 1.4})
    grouped = dataclasses.replace(flat, overlap_groups={"4": {"all_gather": 0.3, "reduce_scatter": 0.3}},
                                  stretch_groups={"4": {"all_gather": 1.2, "reduce_scatter": 1.2}})
    assert grouped.overlap_slowdown("all_gather", 2) == 0.1 and grouped.overlap_slowdown("all_gather", 4) == 0.3
    assert grouped.overlap_stretch("reduce_scatter", 8) == 1.2 and grouped.overlap_stretch("reduce_scatter", 3) == 1.5
    assert load_roundtrip(grouped, tmp_path).overlap_groups == grouped.overlap_groups
    d = ModelDims.from_config(ModelConfig(**PRESETS["8b"]), seq=2048)
    block, ddp = {}, {}
    for name, prof in (("flat", flat), ("grouped", grouped)):
        for n in (2, 4):
            c = apply_profile(cluster("h100", 1, n), prof)
            block[name, n] = predict(d, Layout(dp_shard=n, zero=3, micro_batch=1), c, n).time_s["zero3"]
            ddp[name, n] = predict(d, Layout(dp_shard=n, zero=0, micro_batch=1), c, 4 * n).time_s["dp_sync"]
    assert block["grouped", 2] == block["flat", 2] and block["grouped", 4] > block["flat", 4]
    assert ddp["grouped", 4] == ddp["flat", 4]  # no all-reduce measured over 4: its 2-GPU figure


def load_roundtrip(p, tmp_path):
    path = tmp_path / "roundtrip.json"
    save(p, path)
    return load(path)
