"""The planner against every plait run recorded in bench/results: each prediction beside its
measurement. Peak memory is held to its goal (within 3% on average); the full table is printed
(pytest -s) and kept in bench/README.md."""

from __future__ import annotations

import statistics
from pathlib import Path

from plait.planner import recorded

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def test_every_recorded_plait_run_is_predicted_and_peak_memory_is_within_goal():
    runs = recorded.load(RESULTS)
    names = {r.source for r in runs}
    # every kind of layout the benches ran: one GPU, DDP, ZeRO-1/2/3, TP with and without SP and
    # selective recomputation, and the pipeline schedules
    for want in ("dp-h100-4gpu.json:plait-1gpu", "dp-h100-4gpu.json:plait-ddp", "dp-h100-4gpu.json:plait-zero2",
                 "dp-8b-h100-4gpu.json:plait-zero3", "tp-h100-4gpu.json:plait-tp4-sp-sel", "tp-h100-4gpu.json:plait-tp2",
                 "pp-h100-2gpu.json:plait-1f1b", "pp-h100-2gpu.json:plait-interleaved", "pp-h100-2gpu.json:plait-zb"):
        assert want in names, want
    assert not any(r.source.split(":")[0] in recorded.SUPERSEDED for r in runs)
    checks = recorded.check(runs)
    print("\n" + recorded.table(checks))
    errors = [abs(c.memory_error) for c in checks]
    assert statistics.mean(errors) < 0.03, recorded.table(checks)
    assert max(errors) < 0.10, recorded.table(checks)


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
