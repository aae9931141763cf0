"""`plait plot RUN [RUN...]`: training curves of runs, overlaid, into an image file."""

from __future__ import annotations

NAME = "plot"
HELP = "draw loss, val loss, LR, tokens/s, MFU and memory of one or more runs into an image"


def add_arguments(p) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (the --out of `plait train`) or metrics.jsonl files")
    p.add_argument("--out", default="curves.png", help="image to write: .png, .pdf or .svg (default curves.png)")
    p.add_argument("--x", choices=("step", "tokens"), default="step", help="horizontal axis")


def run(args, extra) -> int:
    import sys

    from plait.plot import metrics_file, read_metrics, render

    runs = [(r.rstrip("/"), read_metrics(metrics_file(r))) for r in args.runs]
    out = render(runs, args.out, args.x)
    last = ", ".join(f"{label} to step {rows[-1]['step']}" for label, rows in runs)
    print(f"wrote {out}: {last}", file=sys.stderr)
    return 0
