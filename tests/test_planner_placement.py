"""Ranks -> nodes/GPUs with TP innermost, and the multi-job fleet simulator (seed 002's
"fragmentation problem"; seed files in ../shared/seeds/)."""

import pytest

from plait.errors import UserError
from plait.planner.fleet import Fleet, Job, place as fleet_place, random_jobs, run
from plait.planner.placement import ORDER, coords, groups, nodes_spanned, place, rank_of


def test_order_matches_the_runtime_mesh():
    """The planner numbers ranks exactly as plait.parallel.dims builds the device mesh."""
    dims = pytest.importorskip("plait.parallel.dims")
    assert ORDER == tuple(dims.NAMES)


def test_tp_innermost_and_round_trip():
    sizes = {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 4}
    for r in range(16):
        assert rank_of(coords(r, sizes), sizes) == r
    assert groups("tp", sizes)[0] == [0, 1, 2, 3]
    assert groups("pp", sizes)[0] == [0, 8]


def test_gpt3_megatron_layout_on_1024_gpus():
    """Seeds 000/001: GPT-3 on 1024 GPUs = TP 8 x PP 16 x DP 8; TP within each node (NVLink), the
    other dims across nodes."""
    sizes = {"pp": 16, "dp_shard": 8, "tp": 8}
    pl = place(sizes, 128, 8)
    assert len(pl.rows) == 1024
    assert nodes_spanned("tp", sizes, 8) == 1
    assert nodes_spanned("pp", sizes, 8) == 16 and nodes_spanned("dp_shard", sizes, 8) == 8
    assert all(len({r // 8 for r in g}) == 1 for g in groups("tp", sizes))


def test_seed_002_3d_example():
    """Seed 002: 64 GPUs = TP 8 x PP 4 x DP 2; replica 0 on nodes 0-3 with stage i on node i,
    replica 1 on nodes 4-7. That is the mesh order (dp, pp, tp); plait's (pp, dp, tp) puts the two
    replicas of a stage on adjacent nodes instead -- TP stays in a node either way."""
    sizes = {"dp_shard": 2, "pp": 4, "tp": 8}
    seed_order = ("dp_shard", "pp", "tp")
    for r in range(64):
        c = coords(r, sizes, seed_order)
        assert r // 8 == c["dp_shard"] * 4 + c["pp"]
    plait_nodes = {(c["pp"], c["dp_shard"]): r // 8 for r, _, _, c in place(sizes, 8, 8).rows}
    assert plait_nodes[(0, 0)] == 0 and plait_nodes[(0, 1)] == 1 and plait_nodes[(1, 0)] == 2


def test_grouped_dims_and_irregular_spans():
    sizes = {"dp_shard": 4, "cp": 2, "tp": 2}
    assert nodes_spanned(("dp_shard", "cp"), sizes, 8) == 2  # 8 ranks 2 apart: 16 ranks, 2 nodes
    assert nodes_spanned(("dp_shard", "cp"), sizes, 16) == 1
    # tp = 3 on 8-GPU nodes: some groups straddle a node boundary
    odd = {"dp_shard": 8, "tp": 3}
    assert nodes_spanned("tp", odd, 8) == 2
    with pytest.raises(ValueError):
        nodes_spanned(("pp", "tp"), sizes, 8)  # not adjacent


def test_place_refuses_bad_layouts():
    with pytest.raises(UserError):
        place({"tp": 8, "dp_shard": 3}, 2, 8)  # 24 ranks on 16 GPUs
    with pytest.raises(UserError):
        place({"tp": 16}, 2, 8)  # a TP group bigger than a node


def test_seed_bad_and_good_placement():
    """Seed 002: jobs A and B (4 GPUs, TP 2) spread 2 + 2 over two 8-GPU nodes ("bad placement"),
    or packed 4 + 4 into one node ("good placement") -- spreading and plait's packing produce them."""
    a, b = Job("A", 4, 2), Job("B", 4, 2)
    spread, pack = Fleet(2, 8), Fleet(2, 8)
    for j in (a, b):
        fleet_place(spread, j, "spread")
        fleet_place(pack, j, "pack")
    assert [row.count("A") for row in spread.owner] == [2, 2] and [row.count("B") for row in spread.owner] == [2, 2]
    assert pack.owner[0].count("A") == 4 and pack.owner[0].count("B") == 4 and pack.free(1) == list(range(8))


def test_seed_job_c_claim():
    """Seed 002 says job C (4 GPUs, TP within a node) "cannot schedule" after the bad placement
    because the free GPUs are "split across nodes". Each node still has 4 free GPUs and NVSwitch
    joins any four of them, so C fits (pinned). The seed's point holds for a job that needs a
    whole node: C' = 8 GPUs with TP 8 is refused after spreading and placed after packing."""
    c4 = Job("C", 4, 4)
    assert run([Job("A", 4, 2), Job("B", 4, 2), c4], 2, 8, "spread").unplaceable == []
    c8 = Job("C", 8, 8)
    assert run([Job("A", 4, 2), Job("B", 4, 2), c8], 2, 8, "spread").unplaceable == ["C"]
    assert run([Job("A", 4, 2), Job("B", 4, 2), c8], 2, 8, "pack").unplaceable == []


def test_pack_beats_first_fit_on_a_trace():
    """On a reproducible trace of arrivals and departures, plait's packing never cuts a TP group
    across nodes; first-fit does, and only by doing so does it refuse fewer jobs: counting its cut
    jobs as failures, packing fails fewer. It also leaves the free GPUs less fragmented."""
    jobs = random_jobs(150, 16, 8, seed=1)
    ff, pk = run(jobs, 16, 8, "first-fit"), run(jobs, 16, 8, "pack")
    assert len(pk.unplaceable) < len(ff.unplaceable) + len(ff.split_jobs)
    assert pk.split_groups == 0 < ff.split_groups
    assert pk.mean_fragmentation < ff.mean_fragmentation
    assert len(pk.placed) + len(pk.unplaceable) == 150


def test_fragmentation_formula():
    f = Fleet(2, 8)
    f.owner[0][:6] = ["x"] * 6  # node 0: 2 free, node 1: 8 free
    assert f.fragmentation(8) == pytest.approx(2 / 10)
    assert f.fragmentation(2) == 0.0
    with pytest.raises(UserError):
        Job("bad", 6, 4)
