"""What lockstep costs: GPUs that synchronise run at the pace of the slowest (for `plait bench calibrate`).

A GPU does not take exactly the same time for the same work twice: its clock and power management
move on millisecond time scales. Alone, those wobbles average out over a step. Several GPUs that meet
at every collective (a data-parallel all-reduce, a ZeRO-3 gather, a tensor-parallel all-reduce, a
pipeline's send) each wait for the slowest one at each meeting, and the expected maximum of N
wobbling durations is longer than their mean. One GPU never pays this; a job of thousands pays it at
every collective.

Measured here, on every GPU of the machine (groups of 2, 4, ... up to `nproc`):
  alone    rank 0 runs a chain of bf16 matmuls (a transformer MLP's shape, a few milliseconds) and
           synchronises with itself; the others wait
  meet     every rank of the group runs the same chain, then a one-element all-reduce: each
           iteration ends when the slowest rank's chain has
  latency  the one-element all-reduce by itself
The lockstep slowdown of a group of n is (meet - latency) / alone - 1 over mean iteration times,
the median of five rounds that alternate alone and together (after every GPU has run long enough to
settle at its sustained clocks). It grows like the expected maximum of n draws: for independent wobbles of relative
spread s, 1 + s * E[max of n standard normals]; `sigma` is that s, which the planner uses to price
a job on more GPUs than were measured (`HardwareProfile.lockstep_slowdown`).
"""

from __future__ import annotations

import statistics

from plait.planner.profile import expected_max_normal


def measure(device: str, nproc: int, seconds: float | None = None, timeout_s: float = 300.0) -> dict:
    """{"groups": {n: slowdown}, "sigma": s} over groups of 2, 4, ... up to `nproc` GPUs, each mode
    timed for `seconds` in all (default 6 on a GPU; 0.2 on a CPU, where it is only a check of the tool)."""
    from plait.launch import run as launch_run

    seconds = seconds if seconds is not None else (6.0 if device == "cuda" else 0.3)
    per_rank = launch_run(_rank, ({"device": device, "nproc": nproc, "seconds": seconds, "timeout": timeout_s},),
                          nproc=nproc, device_type=device)
    groups = per_rank[0]
    sigmas = [s / expected_max_normal(n) for n, s in groups.items()]
    return {"groups": {str(n): s for n, s in groups.items()}, "sigma": statistics.median(sigmas) if sigmas else 0.0}


def sizes(nproc: int) -> list[int]:
    out, n = [], 2
    while n <= nproc:
        out.append(n)
        n *= 2
    return out


def _rank(opts: dict) -> dict[int, float]:
    import torch
    import torch.distributed as dist

    from plait.benchmarks.overlap import mlp_rank

    dims, x, w, _ = mlp_rank(opts)
    dev, rank = dims.device, dims.rank
    cuda = dev.type == "cuda"
    one = torch.ones(1, device=dev)

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def chain():
        for _ in range(4):
            x @ w

    def mean_iteration(body, iters: int) -> float:
        import time

        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            body()
            sync()
        return (time.perf_counter() - t0) / iters

    def agreed(k: int) -> int:  # every rank must issue the same number of collectives
        t = torch.tensor([k], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    for _ in range(3):
        chain()
    probe = mean_iteration(chain, 5)
    rounds = 5  # alone and together alternate, so a drift of the clocks shows in neither more than the other
    iters = agreed(min(1000, max(10, int(opts["seconds"] / rounds / max(probe, 1e-6)))))
    mean_iteration(chain, iters * rounds // 2)  # every GPU at its sustained clocks first
    out = {}
    for n in sizes(dims.world_size):
        group = dist.new_group(list(range(n)))  # every rank creates every group, in the same order

        def meet():
            chain()
            dist.all_reduce(one, group=group)

        if rank < n:
            mean_iteration(meet, 3)  # the group's first calls set up its communicator
            latency = mean_iteration(lambda: dist.all_reduce(one, group=group), iters)
        ratios = []
        for _ in range(rounds):
            dist.barrier()
            alone = mean_iteration(chain, iters) if rank == 0 else None
            dist.barrier()
            if rank < n:
                met = mean_iteration(meet, iters)
                if rank == 0:
                    ratios.append((met - latency) / alone)
        if rank == 0:
            out[n] = max(0.0, statistics.median(ratios) - 1.0)
        dist.barrier()
    sync()
    return out
