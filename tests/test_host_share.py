"""The forward's host share (plait.host_share): what it brackets, and how plan --check reads it."""

from __future__ import annotations

import json
import time

import torch

from plait.host_share import ForwardHostShare
from plait.planner import recorded


def test_the_bracket_holds_the_blocks_own_hooks_and_goes_away():
    blocks = [torch.nn.Linear(4, 4) for _ in range(3)]
    # an engine's hooks (ZeRO-3 gathers the next block in its pre-hook) are registered before
    for b in blocks:
        b.register_forward_pre_hook(lambda m, a: time.sleep(0.01))
        b.register_forward_hook(lambda m, a, o: time.sleep(0.005))
    x = torch.randn(2, 4)
    with ForwardHostShare(blocks, torch.device("cpu")) as hs:
        for _ in range(2):
            y = x
            for b in blocks:
                y = b(y)
    assert len(hs.spans) == 6
    assert all(h1 - h0 >= 0.015 for _, h0, _, h1 in hs.spans)  # both engine hooks inside the bracket
    assert abs(hs.share() - 1.0) < 1e-9  # a CPU's device clock is its host's
    assert all(len(b._forward_pre_hooks) == 1 for b in blocks)
    assert all(len(b._forward_hooks) == 1 for b in blocks)
    assert ForwardHostShare(blocks, torch.device("cpu")).share() is None


def test_a_data_parallel_row_at_or_above_one_is_marked_host_bound(tmp_path):
    row = {"variant": "plait-zero3", "step_s_median": 0.2, "peak_mem_gb": 30.0, "peak_mem_gb_max_rank": 30.0}
    data = {"benchmark": "data_parallel", "card": "NVIDIA H200", "gpus": 4,
            "config": {"preset": "8b", "model": [], "seq": 2048, "micro_batch": 1},
            "rows": [dict(row, host_share=[0.71, 1.04, 0.69, 0.7]), dict(row, variant="plait-zero1", host_share=[0.5] * 4),
                     dict(row, variant="plait-ddp")]}
    (tmp_path / "dp-8b-h200-4gpu-x.json").write_text(json.dumps(data))
    runs = {r.source.split(":")[1]: r for r in recorded.load(tmp_path)}
    assert runs["plait-zero3"].host_bound and runs["plait-zero3"].host_share == 1.04
    assert not runs["plait-zero1"].host_bound and not runs["plait-ddp"].host_bound


def test_held_names_each_ranks_fullest_level_between_actions():
    """`plait.timeline.held` read ZB-H1's extra 3.9 GB off the timeline: per rank, the most bytes held
    once an action was issued, and which action; nothing where no bytes were counted (a CPU run)."""
    from plait.timeline import held

    gpu = [("F", 0, 0, 0.0, 1.0, 0.1, 10), ("F", 1, 0, 1.0, 2.0, 0.1, 30), ("B", 0, 0, 2.0, 4.0, 0.1, 20)]
    cpu = [("F", 0, 0, 0.0, 1.0, 1.0, 0)]
    assert held([gpu, cpu, []]) == [{"bytes": 30, "action": ["F", 1, 0]}, None, None]
