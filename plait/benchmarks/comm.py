"""`plait bench comm`: time collectives like nccl-tests, for torch.distributed and plait's ring.

For each size S (bytes; the gathered size for all-gather, the unreduced size for reduce-scatter,
what each rank sends for send_recv):
  time   mean of `iters` back-to-back calls, the slowest rank's (a collective ends when the last ends)
  algbw  S / time
  busbw  algbw x 2(N-1)/N for all-reduce, x (N-1)/N for all-gather and reduce-scatter: what each link
         carries, comparable across N and with the hardware's link bandwidth (nccl-tests' definition);
         for send_recv, algbw
send_recv is a ring exchange, the step of ring attention and of a pipeline's steady state: every
rank sends S bytes to the next rank and receives S from the previous one in one batched call
(torch only; plait's ring collectives are built from it).

Every size is first checked for correctness (integer-valued data, exact in bf16) against the
expected sum, so a fast wrong answer cannot pass. Runs on CPU/gloo or GPU/NCCL; `--nproc N` starts
the processes itself, or run it under torchrun. `--json` writes bench/results/comm-<card>-<n>gpu.json.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

HELP = "collective bandwidth (time, algbw, busbw) of torch.distributed vs plait's ring, like nccl-tests"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def chosen_ops(given: str | None, impls: list[str]) -> list[str]:
    """The ops --ops names; by default all that the implementations measure (plait's rings have no
    send_recv: `--impl ring` alone was refused for a send_recv the user never asked for)."""
    if given is None:
        return [o for o in OPS if o != "send_recv" or "torch" in impls]
    return [o.strip() for o in given.split(",") if o.strip()]


def add_arguments(p) -> None:
    p.add_argument("--nproc", type=int, default=0, help="processes to start (default: all GPUs, or 2 on CPU; "
                   "ignored under torchrun/srun)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--ops", default=None, help=f"comma-separated, from {','.join(OPS)} (default: all of them; "
                   "send_recv only where --impl has torch)")
    p.add_argument("--impl", default="torch,ring,ring-auto",
                   help="comma-separated: torch, ring (one piece per chunk), ring-K (K pieces per chunk, "
                        "pipelined), ring-auto (pieces of about --piece-bytes)")
    p.add_argument("--min-bytes", default="1K", help="smallest size (default 1K)")
    p.add_argument("--max-bytes", default=None, help="largest size (default 1G on GPU, 16M on CPU)")
    p.add_argument("--factor", type=int, default=2, help="size multiplier between rows (default 2)")
    p.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default=None, help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--iters", type=int, default=0, help="timed calls per size (default 20; on CPU 16 MiB / size "
                   "between 3 and 20); each JSON row records its own")
    p.add_argument("--warmup", type=int, default=0, help="untimed calls per size (default 5 on GPU, 1 on CPU)")
    p.add_argument("--piece-bytes", default="16M", help="piece size of ring-auto (default 16M, at most 8 pieces)")
    p.add_argument("--json", nargs="?", const="auto", default=None, metavar="PATH",
                   help="write results as JSON (no PATH: bench/results/comm-<card>-<n>gpu.json)")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")


def parse_bytes(text: str, flag: str = "size") -> int:
    """`64K` -> 65536; a bad one is refused naming `flag`, the option it came from."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", str(text), re.I)
    if not m:
        from plait.errors import bad_value

        raise bad_value(flag, text, "write a byte count like 4096, 64K, 256M or 1G")
    return int(float(m.group(1)) * 1024 ** " kmgt".index((m.group(2) or " ").lower()))


def run(args) -> int:
    import torch

    from plait.errors import bad_value
    from plait.launch import detect_launch, run as launch_run

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise bad_value("--device", "cuda", "no GPU is visible; use --device cpu")
    # each count checked by its flag: --factor 1 ran as 2 unsaid, --min-bytes 0 never ended (0 x factor),
    # negative --iters printed negative times, --timeout 0 and --nproc -1 failed in the workers
    # naming parallel.* fields this command has not
    for flag, val, low, what in (("--nproc", args.nproc, 0, "0 (every GPU, or 2 on CPU) or a number of processes"),
                                 ("--factor", args.factor, 2, "at least 2 (the size multiplier between rows)"),
                                 ("--iters", args.iters, 0, "0 (the default) or a number of timed calls"),
                                 ("--warmup", args.warmup, 0, "0 (the default) or a number of untimed calls")):
        if val < low:
            raise bad_value(flag, val, f"must be {what}")
    if not 0 < args.timeout < float("inf"):
        raise bad_value("--timeout", args.timeout, "must be a positive number of seconds")
    min_bytes = parse_bytes(args.min_bytes, "--min-bytes")
    max_bytes = parse_bytes(args.max_bytes or ("1G" if device == "cuda" else "16M"), "--max-bytes")
    piece_bytes = parse_bytes(args.piece_bytes, "--piece-bytes")
    if min_bytes < 1:
        raise bad_value("--min-bytes", args.min_bytes, "must be at least 1 byte")
    if min_bytes > max_bytes:
        raise bad_value("--min-bytes", args.min_bytes, f"is more than --max-bytes "
                        f"{args.max_bytes or max_bytes}: no size would be measured")
    if piece_bytes < 1:
        raise bad_value("--piece-bytes", args.piece_bytes, "must be at least 1 byte")
    launched = detect_launch()
    nproc = args.nproc or (torch.cuda.device_count() if device == "cuda" else 2)
    if launched is not None:
        nproc = launched.world_size
    if nproc < 2:  # one process has no one to exchange with: the send/recv check failed in gloo
        on = " (this machine has one GPU; --device cpu runs 2 processes)" if device == "cuda" and not args.nproc else ""
        raise bad_value("--nproc", nproc, f"a collective needs 2 or more processes{on}")
    if args.json not in (None, "auto") and os.path.isdir(args.json):  # was a traceback after the whole run
        raise bad_value("--json", args.json, "is a folder; give the file to write, e.g. "
                        f"{os.path.join(args.json, 'comm.json')}")
    if args.json not in (None, "auto") and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise bad_value("--json", args.json, f"its folder {os.path.dirname(os.path.abspath(args.json))} does not "
                        "exist; create it first")
    impls = [i.strip() for i in args.impl.split(",") if i.strip()]
    for i in impls:
        if not re.fullmatch(r"torch|ring|ring-auto|ring-[1-9]\d*", i):  # ring-0: no pieces at all
            raise bad_value("--impl", i, "choose torch, ring, ring-auto or ring-K (K pieces per chunk)")
    ops = chosen_ops(args.ops, impls)
    for o in ops:
        if o not in OPS:
            raise bad_value("--ops", o, f"choose from {', '.join(OPS)}")
    if "send_recv" in ops and "torch" not in impls:
        raise bad_value("--impl", args.impl, "send_recv is measured with torch's point-to-point only: add torch "
                        "to --impl or leave send_recv out of --ops")
    opts = dict(device=device, ops=ops, impls=impls, min_bytes=min_bytes, max_bytes=max_bytes,
                factor=args.factor, dtype=args.dtype or ("bf16" if device == "cuda" else "fp32"),
                iters=args.iters, warmup=args.warmup, piece_bytes=piece_bytes,
                json=args.json, timeout=args.timeout, nproc=nproc)
    from plait.launch import SpawnError, Stopped

    try:
        results = launch_run(bench_rank, (opts,), nproc=nproc, device_type=device)
    except Stopped as e:  # SIGTERM to the launcher: the workers were ended (was the launcher's traceback)
        print(f"plait bench comm: stopped by {e.signame}", file=sys.stderr)
        return 143
    except SpawnError as e:  # a worker failed (a rendezvous that timed out, a collective that raised): one line
        if e.traceback:
            print(e.traceback.rstrip(), file=sys.stderr)
        print(f"plait bench comm: error: {e}", file=sys.stderr)
        return 1
    return 0 if results and all(r is None or r.get("ok", True) for r in results) else 1


def say(line: str) -> None:
    """Rank 0's table line; once its reader has gone (`| head`), the rest of the table goes nowhere
    instead of ending the run in a BrokenPipeError."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def bench_rank(opts: dict) -> dict | None:
    """One rank of the benchmark; rank 0 prints the table and writes the JSON."""
    import torch

    from plait.config import ParallelConfig
    from plait.launch import init_distributed

    dims = init_distributed(ParallelConfig(nproc=opts["nproc"], timeout_s=opts["timeout"]), opts["device"])
    n, rank, dev = dims.world_size, dims.rank, dims.device
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[opts["dtype"]]
    esize = torch.empty((), dtype=dtype).element_size()
    header = _header(opts, n, dev)
    if rank == 0:
        say(header["title"])
        say(f"# {'size':>12}  {'op':<15} {'impl':<10} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}  check")
    rows, ok, size = [], True, opts["min_bytes"]
    while size <= opts["max_bytes"]:
        for op in opts["ops"]:
            numel = max(n, size // esize // n * n)  # divisible by N for all-gather / reduce-scatter
            for impl in opts["impls"]:
                if op == "send_recv" and impl != "torch":
                    continue  # the exchange is the primitive plait's rings are built from
                fn, check = _make(op, impl, numel, n, rank, dtype, dev, opts["piece_bytes"])
                good = check()
                ok &= good
                t, iters, warmup = _time(fn, dev, opts, numel * esize)
                nbytes = numel * esize
                algbw = nbytes / t / 1e9
                busbw = algbw * (2 * (n - 1) / n if op == "all_reduce" else 1.0 if op == "send_recv" else (n - 1) / n)
                rows.append(dict(op=op, impl=impl, bytes=nbytes, time_us=t * 1e6, algbw_GBps=algbw,
                                 busbw_GBps=busbw, correct=good, iters=iters, warmup=warmup))
                if rank == 0:
                    say(f"  {nbytes:>12}  {op:<15} {impl:<10} {t * 1e6:>10.1f} {algbw:>12.2f} {busbw:>12.2f}  "
                        f"{'ok' if good else 'WRONG'}")
        size *= opts["factor"]
    if rank != 0:
        return None
    summary = _summary(rows)
    for line in summary["lines"]:
        say(line)
    if opts["json"]:
        path = opts["json"] if opts["json"] != "auto" else _auto_path(header, n)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            # 0 asked for the defaults, which depend on the size: each row has the counts it ran
            config = {k: ("per row" if k in ("iters", "warmup") and not v else v) for k, v in opts.items()
                      if k != "json"}
            json.dump(dict(header, config=config, results=rows, summary=summary["ratios"]), f, indent=1)
        say(f"# wrote {path}")
    return {"ok": ok}


def _make(op, impl, numel, n, rank, dtype, dev, piece_bytes):
    """(timed callable, correctness check) for one op / implementation / size, buffers allocated once."""
    import torch
    import torch.distributed as dist

    from plait import collectives as C
    from plait.comm import _all_gather_single, _reduce_scatter_single

    esize = torch.empty((), dtype=dtype).element_size()
    chunk = numel // n
    if impl == "ring-auto":
        # big enough pieces that the CPU, issuing one batch_isend_irecv + one add per piece, stays ahead
        pieces = max(1, min(8, chunk * esize // max(1, piece_bytes)))
    else:
        pieces = int(impl.split("-")[1]) if impl.startswith("ring-") else 1
    # small integers: exact in bf16, so every implementation must match the expected sum exactly
    base = (torch.arange(numel, device=dev) % 7).to(dtype)
    x = base + rank
    total = base * n + n * (n - 1) // 2
    if op == "send_recv":
        got = torch.empty_like(x)
        fn = ring_exchange(x, got)

        def check():
            fn()
            return torch.equal(got, base + (rank - 1) % n)
    elif op == "all_reduce":
        fn = (lambda: dist.all_reduce(x)) if impl == "torch" else (lambda: C.ring_all_reduce(x, pipeline=pieces))

        def check():
            x.copy_(base + rank)
            fn()
            return torch.equal(x, total)
    elif op == "all_gather":
        mine = (base[rank * chunk:(rank + 1) * chunk] + rank).contiguous()
        out = torch.empty(numel, dtype=dtype, device=dev)
        fn = ((lambda: _all_gather_single(out, mine)) if impl == "torch"
              else (lambda: C.ring_all_gather(mine, pipeline=pieces, out=out)))
        expect = base + torch.arange(n, device=dev).repeat_interleave(chunk).to(dtype)

        def check():
            fn()
            return torch.equal(out, expect)
    else:
        out = torch.empty(chunk, dtype=dtype, device=dev)
        fn = ((lambda: _reduce_scatter_single(out, x)) if impl == "torch"
              else (lambda: C.ring_reduce_scatter(x, pipeline=pieces, inplace=True)))

        def check():
            x.copy_(base + rank)
            got = fn() if impl != "torch" else (fn(), out)[1]
            return torch.equal(got.reshape(-1), total[rank * chunk:(rank + 1) * chunk])
    return fn, lambda: _all_agree(check(), dev)


def ring_exchange(send, recv, async_op: bool = False):
    """A callable that sends `send` to the next rank and receives the previous rank's into `recv` in
    one batched call (plait.collectives' ring step); with `async_op` it returns a handle to wait on."""
    from plait import collectives as C

    ring = C._Ring(None)

    def call():
        works = C._exchange(ring, send, recv)
        return _Pending(works) if async_op else C._wait(works)

    return call


class _Pending:
    """A batched exchange's works, waited on as one."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        from plait import collectives as C

        C._wait(self.works)


def _all_agree(flag: bool, dev) -> bool:
    import torch
    import torch.distributed as dist

    t = torch.tensor([0.0 if flag else 1.0], device=dev)
    dist.all_reduce(t)
    return t.item() == 0.0


def _time(fn, dev, opts, nbytes) -> tuple[float, int, int]:
    """Seconds per call on the slowest rank (warmup first; one barrier, then back-to-back calls),
    and the timed and untimed calls made (recorded with each row: on CPU they depend on the size)."""
    import torch
    import torch.distributed as dist

    cuda = dev.type == "cuda"
    iters = opts["iters"] or (20 if cuda else max(3, min(20, (1 << 24) // max(nbytes, 1))))
    warmup = opts["warmup"] or (5 if cuda else 1)
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize(dev)
    dist.barrier()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(dev)
        t = start.elapsed_time(end) / 1e3 / iters
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t = (time.perf_counter() - t0) / iters
    worst = torch.tensor([t], dtype=torch.float64, device=dev)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item(), iters, warmup


def _header(opts, n, dev) -> dict:
    import datetime
    import platform

    import torch

    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None
        backend = f"NCCL {nccl}"
    else:
        name, nccl, backend = _cpu_name() or platform.machine() or "cpu", None, "gloo"
    title = (f"# plait bench comm: {n} x {name}, torch {torch.__version__}, {backend}, {opts['dtype']}, "
             f"busbw per nccl-tests (all-reduce x 2(N-1)/N, all-gather / reduce-scatter x (N-1)/N)")
    return dict(bench="comm", title=title, device=name, device_type=dev.type, nproc=n, torch=torch.__version__,
                nccl=nccl, date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                dtype=opts["dtype"], nvls=os.environ.get("NCCL_NVLS_ENABLE"))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        return ""


def _auto_path(header, n) -> str:
    if header["device_type"] == "cuda":
        words = [w for w in re.split(r"[^a-z0-9]+", header["device"].lower()) if w and w != "nvidia"]
        return f"bench/results/comm-{words[0] if words else 'gpu'}-{n}gpu.json"
    return f"bench/results/comm-cpu-{n}proc.json"


def _summary(rows) -> dict:
    """plait's ring busbw as a share of torch's, per op, over the sizes >= 256 MiB (the issue's goal)."""
    lines, ratios = [], {}
    big = [r for r in rows if r["bytes"] >= 256 * 2**20]
    for op in OPS:
        ref = {r["bytes"]: r["busbw_GBps"] for r in big if r["op"] == op and r["impl"] == "torch"}
        for impl in sorted({r["impl"] for r in big if r["op"] == op and r["impl"] != "torch"}):
            shares = [r["busbw_GBps"] / ref[r["bytes"]] for r in big
                      if r["op"] == op and r["impl"] == impl and ref.get(r["bytes"])]
            if shares:
                ratios[f"{op}/{impl}"] = min(shares)
                lines.append(f"# {op} {impl}: busbw >= {100 * min(shares):.0f}% of torch's at every size >= 256 MiB")
    return {"lines": lines, "ratios": ratios}
