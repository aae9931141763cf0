"""How much a collective running beside compute slows the compute down, and itself (for `plait bench
calibrate`).

Overlapping communication with compute is not free on a GPU: NCCL's kernels occupy streaming
multiprocessors and memory bandwidth while they run, so the matmuls beside them run slower, and the
matmuls take SMs and bandwidth from the collective, which runs slower too. The planner hides
ZeRO-3's gathers, data-parallel gradient reductions and ring attention's transfers behind compute;
without these costs it predicts steps faster than they run.

Measured on every rank of a group of `nproc` GPUs, per collective op:
  alone    a chain of bf16 matmuls (a transformer MLP's shape), timed by itself; and a chain of the
           op, timed by itself
  beside   the same matmul chain while the op's chain runs on a second stream, sized to outlast it
The slowdown is beside / alone - 1 for the matmuls: the extra compute time per second of overlapped
collective. The stretch is for the op: while the matmuls ran (C seconds) it got through C / stretch
seconds of its work alone, and after them ran at its own speed; so a chain of A seconds alone that
ended B seconds after the matmuls began gives stretch = C / (A - (B - C)).
"""

from __future__ import annotations

import statistics

OPS = ("all_gather", "reduce_scatter", "all_reduce", "send_recv")


def measure(device: str, nproc: int, timeout_s: float = 300.0) -> tuple[dict[str, float], dict[str, float]]:
    """({op: fractional compute slowdown while the op runs beside it}, {op: the op's stretch beside
    compute}), medians over ranks (gloo: all-gather and all-reduce; it has no reduce-scatter)."""
    from plait.launch import run as launch_run

    per_rank = launch_run(_rank, ({"device": device, "nproc": nproc, "timeout": timeout_s},), nproc=nproc,
                          device_type=device)
    ops = [op for op in OPS if op in per_rank[0]]
    return ({op: statistics.median(r[op][0] for r in per_rank) for op in ops},
            {op: statistics.median(r[op][1] for r in per_rank) for op in ops})


def measure_groups(device: str, nproc: int, timeout_s: float = 300.0) -> dict:
    """`measure` over 2 GPUs, and over 4, 8, ... up to `nproc`: the profile's fields `overlap` and
    `stretch` (2 GPUs) and `overlap_groups` / `stretch_groups` ({size: {op: value}}) for the larger
    groups, where NCCL runs its collectives with more channels beside the same compute."""
    overlap, stretch_ = measure(device, 2, timeout_s)
    out = {"overlap": overlap, "stretch": stretch_, "overlap_groups": {}, "stretch_groups": {}}
    n = 4
    while n <= nproc:
        out["overlap_groups"][str(n)], out["stretch_groups"][str(n)] = measure(device, n, timeout_s)
        n *= 2
    return out


def describe(fields: dict) -> str:
    """One line per measured group size: each op's compute slowdown and its own stretch."""
    tables = [("2", fields["overlap"], fields["stretch"])] + [
        (k, v, fields["stretch_groups"][k]) for k, v in fields["overlap_groups"].items()]
    return "\n".join(f"# overlap over {k} GPUs: " + ", ".join(f"{op} +{100 * x:.1f}% (itself x{st[op]:.2f})"
                                                          for op, x in ov.items()) for k, ov, st in tables)


def stretch(alone_s: float, compute_s: float, ended_s: float) -> float:
    """How many times its time alone a collective chain took beside compute: `alone_s` its chain
    alone, `compute_s` the matmuls it ran beside, `ended_s` when it ended, from the matmuls' start.
    Ending first, it ran beside compute throughout; ending after, it ran alone for the rest."""
    if ended_s <= compute_s:
        return max(1.0, ended_s / alone_s)
    done_beside = alone_s - (ended_s - compute_s)  # its seconds alone that it got through beside compute
    if done_beside <= 0:  # timing noise: it ran as fast beside as alone
        return 1.0
    return max(1.0, compute_s / done_beside)


def mlp_rank(opts: dict):
    """Join the group of `opts` ("nproc", "timeout", "device") and make a transformer MLP's matmul
    operands on this rank: (dims, x, w, w2), bf16 at an 8b layer's size on a GPU, small fp32 on a CPU."""
    import torch

    from plait.config import ParallelConfig
    from plait.launch import init_distributed

    dims = init_distributed(ParallelConfig(nproc=opts["nproc"], timeout_s=opts["timeout"]), opts["device"])
    dev = dims.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tokens, hidden, ffn = (8192, 4096, 14336) if dev.type == "cuda" else (256, 256, 512)
    x = torch.randn(tokens, hidden, device=dev, dtype=dtype)
    w = torch.randn(hidden, ffn, device=dev, dtype=dtype) / hidden ** 0.5
    w2 = torch.randn(ffn, hidden, device=dev, dtype=dtype) / ffn ** 0.5
    return dims, x, w, w2


def _rank(opts: dict) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from plait.benchmarks.comm import ring_exchange

    dims, x, w, w2 = mlp_rank(opts)
    dev, n = dims.device, dims.world_size
    cuda = dev.type == "cuda"
    dtype = x.dtype
    size = (256 << 20) if cuda else (4 << 20)  # bytes of the collective's full buffer
    numel = size // x.element_size() // n * n
    full = torch.empty(numel, device=dev, dtype=dtype)
    part = torch.empty(numel // n, device=dev, dtype=dtype)
    got = torch.empty_like(part)
    sync_x, async_x = ring_exchange(part, got), ring_exchange(part, got, async_op=True)
    ops = {"all_gather": lambda a: dist.all_gather_into_tensor(full, part, async_op=a),
           "reduce_scatter": lambda a: dist.reduce_scatter_tensor(part, full, async_op=a),
           "all_reduce": lambda a: dist.all_reduce(full, async_op=a),
           # ring attention's step: a chunk to the next rank while the previous rank's arrives
           "send_recv": lambda a: async_x() if a else sync_x()}
    ops = {k: f for k, f in ops.items() if cuda or k != "reduce_scatter"}  # gloo has no reduce-scatter

    def compute(reps):
        for _ in range(reps):
            (x @ w) @ w2

    def timed(fn) -> float:
        if cuda:
            torch.cuda.synchronize(dev)
        dist.barrier()
        t = _clock(cuda, dev)
        fn()
        return t()

    def agreed(k: int) -> int:  # every rank must issue the same number of collectives
        t = torch.tensor([k], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    compute(3)
    reps = agreed(max(1, int(0.05 / max(timed(lambda: compute(4)) / 4, 1e-6))))  # ~50 ms of matmuls
    out = {}
    for op, call in ops.items():
        call(False)
        calls = agreed(int(1.5 * 0.05 / max(timed(lambda: call(False)), 1e-6)) + 1)  # to outlast the matmuls
        alone, beside, chain, ended = [], [], [], []
        for _ in range(5):
            alone.append(timed(lambda: compute(reps)))
            chain.append(timed(lambda: [call(False) for _ in range(calls)]))
            if cuda:
                torch.cuda.synchronize(dev)
            dist.barrier()
            # async collectives run on the backend's own stream (NCCL) or threads (gloo), beside
            # the matmuls on this one; the clock runs on this stream, which then waits for them
            works = [call(True) for _ in range(calls)]
            t = _clock(cuda, dev)
            compute(reps)
            beside.append(t())
            for wk in works:
                wk.wait()
            ended.append(t())
        med = statistics.median
        out[op] = (max(0.0, med(beside) / med(alone) - 1.0), stretch(med(chain), med(beside), med(ended)))
    if cuda:
        torch.cuda.synchronize(dev)
    dist.barrier()
    return out


def _clock(cuda: bool, dev):
    import time

    import torch

    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()

        def stop() -> float:
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return stop
    t0 = time.perf_counter()
    return lambda: time.perf_counter() - t0
