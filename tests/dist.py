"""Run a test body in N gloo processes on 127.0.0.1 and get back what each rank returned.

    from dist import run_dist

    def _body(dims, n):                 # module level: workers import it by name
        x = torch.ones(n) * dims.rank
        Comm(dims).all_reduce(x, "world")
        return x.tolist()

    def test_sum():
        results = run_dist(_body, 4, 3, tp=2)      # 4 ranks, mesh dp_shard=2 x tp=2
        assert results[0] == [6.0, 6.0, 6.0]

Each rank joins a process group and builds the mesh through `plait.launch.init_distributed` (the
production path), calls `body(dims, *args)`, and tears the group down (the gloo exit-crash fix). A
rank that raises fails the test with one line naming it, followed by its traceback. Nothing outlives
the call: a rank still running after `timeout` seconds dumps its stacks and exits, the launcher stops
the rest, and every collective has the same timeout, so a missing peer fails instead of hanging.

Spawning costs ~0.5 s with torch preloaded in the fork server, against 2-4 s per rank when each
imports torch itself; still, put several checks into one body rather than one spawn per check.
"""

from __future__ import annotations

import pytest

from plait.config import ParallelConfig
from plait.launch import SpawnError, init_distributed, spawn


def _rank_main(body, args, parallel):
    dims = init_distributed(parallel, "cpu")
    return body(dims, *args)  # spawn's worker wrapper destroys the process group afterwards


def run_dist(body, nproc: int, *args, timeout: float = 60.0, **parallel) -> list:
    """body(dims, *args) on `nproc` ranks; returns the per-rank results in rank order.

    Keyword arguments set ParallelConfig fields (tp=2, dp_replicate=2, timeout_s=..., ...);
    dp_shard defaults to whatever they leave.
    """
    parallel.setdefault("timeout_s", timeout)
    cfg = ParallelConfig(nproc=nproc, **parallel)
    try:
        return spawn(_rank_main, (body, args, cfg), nproc, timeout_s=timeout, preload=(body.__module__,))
    except SpawnError as e:
        pytest.fail(f"{e}\n--- traceback of rank {e.rank} ---\n{e.traceback}", pytrace=False)
