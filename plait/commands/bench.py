"""`plait bench <what>`: benchmarks. Each subcommand lives in its own module, listed in SUBCOMMANDS.

A subcommand module defines HELP, `add_arguments(parser)` and `run(args) -> int`, and imports torch
only inside `run` (this file is imported to build `plait --help`). Adding `plait bench train` means
adding one line here and one module.
"""

from __future__ import annotations

import importlib

NAME = "bench"
HELP = ("benchmarks: `plait bench comm` (collectives, like nccl-tests), `plait bench train` (GPU step vs HF), "
        "`plait bench calibrate` (a hardware profile for `plait plan --hardware`)")

SUBCOMMANDS = {
    "comm": "plait.benchmarks.comm",
    "train": "plait.benchmarks.train_step",
    "calibrate": "plait.benchmarks.calibrate",
}


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="bench", metavar="WHAT")
    for name, module in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        mod.add_arguments(sub.add_parser(name, help=mod.HELP, description=mod.HELP, allow_abbrev=False))


def run(args, extra) -> int:
    if not getattr(args, "bench", None):
        from plait.errors import UserError

        raise UserError(f"say what to benchmark: plait bench {{{','.join(SUBCOMMANDS)}}} (see plait bench --help)")
    return importlib.import_module(SUBCOMMANDS[args.bench]).run(args)
