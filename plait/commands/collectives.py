"""`plait collectives --trace`: watch a ring all-reduce move and add chunks, step by step."""

from __future__ import annotations

NAME = "collectives"
HELP = "walk through plait's reference ring all-reduce step by step on real processes (--trace)"


def add_arguments(p) -> None:
    p.add_argument("--trace", action="store_true", help="print the chunk states after every step (the default)")
    p.add_argument("--nproc", type=int, default=4, help="processes in the ring (default 4, as in the seed example)")


def run(args, extra) -> int:
    from plait.collectives import trace_ring_all_reduce

    text = trace_ring_all_reduce(args.nproc)
    print(text)
    return 0 if text.rstrip().endswith("in all.") and "WRONG" not in text else 1
