"""`plait schedule`: draw a pipeline schedule's timeline and report its simulated bubble."""

from __future__ import annotations

NAME = "schedule"
HELP = "Draw a pipeline schedule (gpipe, 1f1b, interleaved, zb, zbv) as a timeline and simulate its bubble"


# what matplotlib's savefig writes (its Agg, PDF, PS, SVG and PGF backends)
_IMAGE_SUFFIXES = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp", "gif",
                   "avif", "pgf", "raw", "rgba")


def add_arguments(p) -> None:
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step")
    p.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved, zb (ZB-H1) or zbv (ZB-V)")
    p.add_argument("--v", type=int, default=None, help="model chunks per rank (interleaved; default 2)")
    p.add_argument("--f", type=float, default=1.0, help="forward cost of a rank's layers (time units)")
    p.add_argument("--b", type=float, default=None,
                   help="backward cost (default 2 x f; for zb and zbv the input-gradient half, default f)")
    p.add_argument("--w", type=float, default=None, help="zb and zbv only: weight-gradient cost (default f)")
    p.add_argument("--actions", action="store_true", help="also list every rank's actions, sends and receives")
    p.add_argument("--png", help="also draw the timeline into this PNG file (needs matplotlib)")


def run(args, extra) -> int:
    from pathlib import Path

    from plait.errors import bad_value
    from plait.parallel.schedules import SPLIT_BACKWARD, build_schedule, check, check_args, in_flight
    from plait.planner.simulate import render, simulate, unit_durations

    if args.png is not None and not args.png.strip():  # `--png "$OUT"` with OUT unset drew nothing, unsaid
        raise bad_value("--png", args.png, "is empty; give the image's file name")
    if args.png:  # before anything is printed; as `plait plot --out`, a mistyped folder is not created
        folder = Path(args.png).expanduser().parent
        if not folder.exists():
            raise bad_value("--png", args.png, f"its folder {folder} does not exist; create it first")
        suffix = Path(args.png).suffix.lower().lstrip(".")
        if suffix and suffix not in _IMAGE_SUFFIXES:  # was refused by matplotlib after the whole timeline printed
            raise bad_value("--png", args.png, f"cannot be written (matplotlib writes no .{suffix}); use a .png, .pdf or .svg path")
    v = args.v if args.v is not None else (2 if str(args.schedule).lower() in ("interleaved", "zbv", "zb-v") else 1)
    name = check_args(args.schedule, args.pp, args.microbatches, v)
    split = name in SPLIT_BACKWARD
    if args.w is not None and not split:  # the other schedules' B does the weight gradient too: no W to time
        raise bad_value("--w", args.w, f"{name} has no separate weight-gradient pass (only zb and zbv split B "
                        f"from W); leave --w out or use --schedule zb or zbv")
    for flag, val in (("--f", args.f), ("--b", args.b), ("--w", args.w)):
        # inf passed `> 0` and reached the simulation: a traceback from an infinite makespan
        if val is not None and not 0 < val < float("inf"):
            raise bad_value(flag, val, "must be a positive, finite time")
    b = args.b if args.b is not None else (args.f if split else 2 * args.f)
    w = (args.w if args.w is not None else args.f) if split else 0.0
    # ZB-V finds its order by list scheduling over the stages' costs: the ones it is then timed with
    sched = build_schedule(name, args.pp, args.microbatches, v, ((args.f / v, b / v, w / v),) * (args.pp * v))
    rounds = check(sched)  # proves the lists cannot deadlock, even with rendezvous send/recv
    tl = simulate(sched, unit_durations(args.f / v, b / v, w / v))
    p, m = args.pp, args.microbatches
    print(f"{name} schedule, pp = {p}, micro-batches = {m}" + (f", v = {v}" if v > 1 else "")
          + f"; F = {args.f:g}, B = {b:g}" + (f", W = {w:g}" if split else "") + " per rank")
    print(render(tl))
    print(f"makespan {tl.makespan_s:g}; bubble {tl.bubble_fraction:.2%} of the ranks' time "
          f"(idle / busy = {tl.bubble_over_compute:.2%})")
    formula = {"gpipe": (p - 1) / (m + p - 1), "1f1b": (p - 1) / (m + p - 1),
               "interleaved": (p - 1) / (v * m + p - 1)}.get(name)
    if formula is not None:
        print(f"textbook: (p-1)/({'v m' if v > 1 else 'm'} + p-1) = {formula:.2%}")
    peaks = [in_flight(sched, r) for r in range(p)]
    # with v chunks a rank counts each chunk's micro-batch apart (11 of 8 micro-batches at pp 4, v 2)
    what = "micro-batch chunks" if v > 1 else "micro-batches"
    print(f"{what} in flight per rank (F done, B not): " + ", ".join(str(fb) for fb, _ in peaks)
          + (f"; {'chunk ' if v > 1 else ''}weight-gradient passes waiting: " + ", ".join(str(bw) for _, bw in peaks)
             if split else ""))
    print(f"checked: every F before its B, sends and receives paired, no deadlock ({rounds} rendezvous rounds)")
    if args.actions:
        for r, acts in enumerate(sched.ranks):
            print(f"rank {r}: " + " ".join(str(a) for a in acts))
    if args.png:
        from plait.timeline import draw

        spans = [(s.rank, s.start_s, s.end_s, s.action.kind, s.action.microbatch, s.action.chunk) for s in tl.spans]
        title = f"{name}, pp {p}, {m} micro-batches" + (f", v {v}" if v > 1 else "") + f": bubble {tl.bubble_fraction:.1%}"
        try:
            print(f"wrote {draw(spans, p, v, Path(args.png).expanduser(), title, unit='units of --f')}")
        except (ValueError, OSError) as e:  # a suffix matplotlib cannot write, an unwritable folder
            why = f"cannot be written ({e}); use a .png, .pdf or .svg path"  # as `plait plot --out` says it
            raise bad_value("--png", args.png, why) from None
    return 0
