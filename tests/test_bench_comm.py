"""`plait bench comm` end to end on CPU: nccl-tests columns, correctness flags, the JSON record."""

import json

import pytest
import torch

from plait.cli import main


def test_bench_comm_writes_nccl_tests_style_results(tmp_path):
    path = tmp_path / "comm.json"
    assert main(["bench", "comm", "--device", "cpu", "--nproc", "2", "--min-bytes", "1K", "--max-bytes", "2K",
                 "--impl", "torch,ring,ring-2", "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    assert "busbw per nccl-tests" in res["title"] and res["nproc"] == 2 and res["device_type"] == "cpu"
    assert res["torch"] == torch.__version__ and res["date"]
    rows = res["results"]
    assert {(r["op"], r["impl"]) for r in rows} == {(o, i) for o in ("all_reduce", "all_gather", "reduce_scatter")
                                                   for i in ("torch", "ring", "ring-2")} | {("send_recv", "torch")}
    assert {r["bytes"] for r in rows} == {1024, 2048} and all(r["correct"] for r in rows)
    # the calls each row timed, as they ran; the config names no count it did not run (it wrote the 0
    # that asks for the defaults)
    assert {(r["iters"], r["warmup"]) for r in rows} == {(20, 1)}
    assert res["config"]["iters"] == res["config"]["warmup"] == "per row"
    for r in rows:  # nccl-tests: busbw = algbw x 2(N-1)/N for all-reduce, x (N-1)/N for the others (N = 2);
        # a ring exchange's link carries what each rank sends
        share = {"all_reduce": 1.0, "send_recv": 1.0}.get(r["op"], 0.5)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * share)
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)


@pytest.mark.parametrize("argv, field", [(["--ops", "send_recv", "--impl", "ring"], "--impl"),
                                         (["--ops", "all_to_all"], "--ops"),
                                         # one process: gloo's "Pair is not connected" traceback
                                         (["--nproc", "1"], "--nproc = 1: a collective needs 2 or more"),
                                         (["--json", "/nonexistent-plait/x.json"], "its folder /nonexistent-plait"),
                                         (["--json", "/"], "--json = '/': is a folder")])
def test_bench_comm_refuses_what_it_cannot_measure_in_one_line(argv, field, capsys):
    assert main(["bench", "comm", "--device", "cpu", "--nproc", "2", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0]


def test_bench_comm_of_rings_alone_measures_what_rings_do():
    """`--impl ring` with the default ops: the rings' three collectives (it was refused, for a
    send_recv the user never asked for); send_recv still where torch is measured or it is named."""
    from plait.benchmarks.comm import chosen_ops

    assert chosen_ops(None, ["ring", "ring-2"]) == ["all_reduce", "all_gather", "reduce_scatter"]
    assert "send_recv" in chosen_ops(None, ["torch", "ring"]) and chosen_ops("send_recv", ["ring"]) == ["send_recv"]
