"""ParallelDims: validation, rank order, groups, placement on nodes, `plait mesh`, the real DeviceMesh."""

import pytest

from dist import run_dist
from plait.cli import main
from plait.config import build_config
from plait.validate import validate_config
from plait.errors import UserError
from plait.parallel.dims import FLATTENED, NAMES, ParallelDims


def test_product_must_equal_world_size():
    # the fix for each way of starting the processes: plait's --nproc, torchrun's and srun's counts
    with pytest.raises(UserError, match=r"= 3 but 8 processes run.*--nproc 3;.*--nproc_per_node and --nnodes, or --ntasks"):
        ParallelDims(dp_shard=3, world_size=8)


def test_one_dim_is_inferred():
    assert ParallelDims(dp_shard=-1, tp=2, pp=2, world_size=8).dp_shard == 2
    assert ParallelDims(dp_shard=2, tp=-1, world_size=8).tp == 4
    with pytest.raises(UserError, match="both -1"):
        ParallelDims(dp_shard=-1, tp=-1, world_size=8)
    with pytest.raises(UserError, match="cannot infer parallel.dp_shard: 8 processes are not divisible by .* = 3"):
        ParallelDims(tp=3, world_size=8)
    with pytest.raises(UserError, match=r"parallel.pp = 0"):
        ParallelDims(pp=0, world_size=8)


def test_errors_are_one_line():
    for kw in (dict(dp_shard=3), dict(tp=3), dict(tp=-1, pp=-1), dict(cp=0)):
        with pytest.raises(UserError) as e:
            ParallelDims(world_size=8, **kw)
        assert "\n" not in str(e.value)


def test_rank_order_tp_innermost_pp_outermost():
    d = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, tp=2, pp=2, world_size=32)
    assert d.coords(1) == dict(pp=0, dp_replicate=0, dp_shard=0, cp=0, tp=1)
    assert d.coords(2)["cp"] == 1 and d.coords(4)["dp_shard"] == 1 and d.coords(8)["dp_replicate"] == 1
    assert d.coords(16)["pp"] == 1
    assert all(d.rank_at(d.coords(r)) == r for r in range(32))
    assert d.group_ranks("tp", 5) == [4, 5]
    assert d.group_ranks("pp", 5) == [5, 21]
    assert d.group_ranks("dp", 1) == [1, 5, 9, 13]            # dp_replicate x dp_shard, tp and cp fixed
    assert d.group_ranks("dp_shard_cp", 0) == [0, 2, 4, 6]
    assert d.group_ranks("dp_cp", 0) == [0, 2, 4, 6, 8, 10, 12, 14]
    assert d.local_rank("dp", 13) == 3 and d.size("dp_cp") == 8 and d.size("world") == 32
    for name in NAMES + tuple(FLATTENED):  # groups partition the world
        groups = d.groups(name)
        assert sorted(r for g in groups for r in g) == list(range(32))
        assert all(len(g) == d.size(name) for g in groups)


def test_tp_group_must_stay_inside_a_node():
    assert ParallelDims(tp=4, world_size=16).check_placement(8) is None
    with pytest.raises(UserError, match=r"parallel.tp = 8: 2 tensor-parallel group.*span nodes of 4 GPUs"):
        ParallelDims(tp=8, world_size=16).check_placement(4)
    with pytest.raises(UserError, match="span nodes of 6"):  # 4 does not divide 6: ranks 4-7 straddle nodes
        ParallelDims(tp=4, world_size=12).check_placement(6)
    warning = ParallelDims(tp=8, world_size=16).check_placement(4, allow_cross_node_tp=True)
    assert warning.startswith("warning:") and "span nodes" in warning


def test_config_validation_uses_dims():
    with pytest.raises(UserError, match="cannot infer parallel.dp_shard: 3 processes"):
        validate_config(build_config({"parallel": {"nproc": 3, "tp": 2}}))
    validate_config(build_config({"parallel": {"nproc": 4, "tp": 2}}))
    validate_config(build_config({}))  # the single-process default


def test_plait_mesh_prints_the_map(capsys):
    assert main(["mesh", "--tp", "2", "--pp", "2", "--dp", "2", "--gpus-per-node", "4"]) == 0
    out = capsys.readouterr().out
    assert "world 8 = pp 2 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 2" in out
    assert "2 node(s) x 4 GPUs per node" in out
    lines = [ln.split() for ln in out.splitlines() if ln.split() and all(w.isdigit() for w in ln.split())]
    assert lines[5] == ["5", "1", "1", "1", "0", "0", "0", "1"]  # rank node gpu pp dp_rep dp_shard cp tp
    assert "tp: size 2, inside a node: [0,1] [2,3] [4,5] [6,7]" in out
    assert "pp: size 2, every group spans nodes: [0,4]" in out
    assert main(["mesh", "--tp", "8", "--dp", "2", "--gpus-per-node", "4"]) == 2
    assert "span nodes" in capsys.readouterr().err
    # a group of 512 ranks was one line of ~2,000 characters, four times over
    assert main(["mesh", "--tp", "2", "--dp", "512"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) < 400 and "[0,2,4,6,8,10,12,14,...,1020,1022] (512 ranks)" in out


def _mesh_body(dims):
    """On each rank: the torch groups of every dim hold exactly the ranks the arithmetic predicts."""
    import torch
    import torch.distributed as dist

    rank = dims.rank
    got = {}
    for name in NAMES + tuple(FLATTENED) + ("world",):
        got[name] = dist.get_process_group_ranks(dims.group(name)) == dims.group_ranks(name, rank)
    got["hsdp"] = dims.submesh("dp_replicate", "dp_shard_cp").shape == (2, 4)
    got["coords"] = dims.mesh.get_coordinate() == tuple(dims.coords(rank).values())
    # every group carries the configured timeout, not torch's 30-minute default
    got["timeouts"] = all(g._get_backend(torch.device("cpu")).options._timeout.total_seconds() == 45
                          for g in dims.all_groups())
    return got


def test_device_mesh_matches_the_arithmetic():
    for got in run_dist(_mesh_body, 8, dp_replicate=2, dp_shard=2, cp=2, timeout_s=45):
        assert all(got.values()), got
