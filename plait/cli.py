"""`plait <command>`: find the command modules, parse, run; user mistakes become one line + exit 2."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import plait.commands
from plait.errors import UserError


def _command_modules():
    for info in sorted(pkgutil.iter_modules(plait.commands.__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            yield importlib.import_module(f"plait.commands.{info.name}")


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="plait", description="Train Llama-style language models "
                                     "on one CPU or many GPUs, every parallelism on one device mesh.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for mod in _command_modules():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        modules[mod.NAME] = mod
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    parser, modules = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    mod = modules[args.command]
    try:
        if extra and not getattr(mod, "TAKES_OVERRIDES", False):
            raise UserError(f"unrecognized arguments for `plait {mod.NAME}`: {' '.join(extra)} "
                            f"(see plait {mod.NAME} --help)")
        return int(mod.run(args, extra) or 0)
    except UserError as e:
        print(f"plait {mod.NAME}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"plait {mod.NAME}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
