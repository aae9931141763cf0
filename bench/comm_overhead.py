"""What plait.comm's wrapper costs on top of a raw torch.distributed call.

    python bench/comm_overhead.py --nproc 2 --json            # starts the processes itself
    torchrun --nproc_per_node 2 bench/comm_overhead.py --json

For small messages (where a fixed cost would show) it times, per call:
  issue  host time to enqueue an async all-reduce (what the CPU spends; NCCL runs it later)
  call   a synchronous all-reduce end to end (GPU: including the kernel, synchronized at the end)
for raw `dist.all_reduce`, `Comm.all_reduce` recording to a Ledger, and `Comm` with no ledger.
Rounds alternate between the three so that drift hits all alike; medians are reported. It also
times `Ledger.record` alone. Rank 0 prints a table and, with --json, writes
bench/results/comm-overhead-<card>-<n>gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def rank_main(opts):
    import torch
    import torch.distributed as dist

    from plait.comm import Comm, Ledger
    from plait.config import ParallelConfig
    from plait.launch import init_distributed

    dims = init_distributed(ParallelConfig(nproc=opts["nproc"], timeout_s=300), opts["device"])
    dev, pg = dims.device, dims.group("dp")
    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    with_ledger, no_ledger = Comm(dims, Ledger()), Comm(dims, None)
    variants = {
        "raw": lambda x, a: dist.all_reduce(x, group=pg, async_op=a),
        "comm+ledger": lambda x, a: with_ledger.all_reduce(x, "dp", async_op=a),
        "comm": lambda x, a: no_ledger.all_reduce(x, "dp", async_op=a),
    }
    rows = []
    for nbytes in opts["sizes"]:
        x = torch.ones(max(1, nbytes // 4), device=dev)
        samples = {(v, k): [] for v in variants for k in ("issue", "call")}
        for _ in range(opts["rounds"]):
            for name, fn in variants.items():
                for _ in range(opts["warmup"]):
                    fn(x, False)
                sync()
                dist.barrier(group=pg)
                t0 = time.perf_counter()
                works = [fn(x, True) for _ in range(opts["iters"])]
                t1 = time.perf_counter()
                for w in works:
                    w.wait()
                sync()
                dist.barrier(group=pg)
                t2 = time.perf_counter()
                for _ in range(opts["iters"]):
                    fn(x, False)
                sync()
                t3 = time.perf_counter()
                samples[(name, "issue")].append((t1 - t0) / opts["iters"] * 1e6)
                samples[(name, "call")].append((t3 - t2) / opts["iters"] * 1e6)
        for (name, kind), vals in samples.items():
            rows.append(dict(bytes=nbytes, variant=name, measure=kind, us=statistics.median(vals)))
    led = Ledger()
    t0 = time.perf_counter()
    for _ in range(100000):
        led.record("all_reduce", "dp", 4096, 8)
    record_ns = (time.perf_counter() - t0) / 100000 * 1e9
    if dims.rank != 0:
        return None
    title = (f"# comm overhead: {dims.world_size} x "
             f"{torch.cuda.get_device_name(dev) if cuda else 'cpu'}, torch {torch.__version__}")
    print(title)
    print(f"# {'bytes':>10} {'measure':<7} {'raw us':>9} {'comm+ledger us':>15} {'comm us':>9} {'overhead us':>12}")
    for nbytes in opts["sizes"]:
        for kind in ("issue", "call"):
            v = {r["variant"]: r["us"] for r in rows if r["bytes"] == nbytes and r["measure"] == kind}
            print(f"  {nbytes:>10} {kind:<7} {v['raw']:>9.2f} {v['comm+ledger']:>15.2f} {v['comm']:>9.2f} "
                  f"{v['comm+ledger'] - v['raw']:>12.2f}")
    print(f"# Ledger.record alone: {record_ns:.0f} ns")
    if opts["json"]:
        import datetime

        card = (torch.cuda.get_device_name(dev).lower().replace("nvidia", "").split()[0] if cuda else "cpu")
        path = opts["json"] if opts["json"] != "auto" else \
            f"bench/results/comm-overhead-{card}-{dims.world_size}{'gpu' if cuda else 'proc'}.json"
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(dict(bench="comm_overhead", title=title, torch=torch.__version__, nproc=dims.world_size,
                           device=torch.cuda.get_device_name(dev) if cuda else "cpu",
                           date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                           config=opts, results=rows, ledger_record_ns=record_ns), f, indent=1)
        print(f"# wrote {path}")
    return None


def main(argv=None) -> int:
    import torch

    from plait.launch import detect_launch, run

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=0, help="processes (default: all GPUs, or 2 on CPU)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--sizes", default="8,4096,1048576", help="message sizes in bytes, comma-separated")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", nargs="?", const="auto", default=None, metavar="PATH")
    a = ap.parse_args(argv)
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    le = detect_launch()
    nproc = le.world_size if le else (a.nproc or (torch.cuda.device_count() if device == "cuda" else 2))
    opts = dict(nproc=nproc, device=device, sizes=[int(s) for s in a.sizes.split(",")], iters=a.iters,
                warmup=a.warmup, rounds=a.rounds, json=a.json)
    run(rank_main, (opts,), nproc=nproc, device_type=device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
