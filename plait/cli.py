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


class _Parser(argparse.ArgumentParser):
    """argparse's, but a mistake is one line (argparse prints the whole usage block first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = _Parser(prog="plait", allow_abbrev=False, description="Train Llama-style language models "
                     "on one CPU or many GPUs, every parallelism on one device mesh.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    modules = {}
    parser.subparsers = {}  # name -> its parser: unknown flags are matched against its options
    for mod in _command_modules():
        # no abbreviations: `plan --gpus 8` silently meant --gpus-per-node 8, and a prefix that is
        # unique today picks another flag once a longer one is added
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP, allow_abbrev=False)
        mod.add_arguments(p)
        modules[mod.NAME] = mod
        parser.subparsers[mod.NAME] = p
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    parser, modules = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    mod = modules[args.command]
    try:
        _near_miss(parser.subparsers[mod.NAME], mod.NAME, extra, getattr(mod, "FLAG_HINTS", {}))
        if extra and not getattr(mod, "TAKES_OVERRIDES", False):
            raise UserError(f"unrecognized arguments for `plait {mod.NAME}`: {' '.join(extra)} "
                            f"(see plait {mod.NAME} --help)")
        return int(mod.run(args, extra) or 0)
    except UserError as e:
        if not (e.same_everywhere and _another_rank()):
            print(f"plait {mod.NAME}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"plait {mod.NAME}: interrupted", file=sys.stderr)
        return 130


def _another_rank() -> bool:
    """Whether torchrun or srun started this process as a rank other than the first: a mistake in
    the command itself is said by rank 0 only, not once per process."""
    from plait.launch_env import detect_launch

    try:
        le = detect_launch()
    except Exception:  # noqa: BLE001 - launcher variables it refuses: every process says so
        return False
    return le is not None and le.rank != 0


def _near_miss(sub: argparse.ArgumentParser, name: str, extra: list[str], hints: dict[str, str]) -> None:
    """Refuse an unknown flag that is a prefix of, or close to, one of the command's own (`plan
    --gpus 8` for --gpus-per-node; abbreviations are off) naming the flag meant; dotted overrides
    (`--train.steps`) and anything else go on to the command."""
    import difflib

    own = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if not flag.startswith("--") or "." in flag or flag in own:
            continue
        if flag in hints:  # a flag users reach for that means something else here
            raise UserError(f"unknown flag {flag!r} for `plait {name}`: {hints[flag]} (see plait {name} --help)")
        near = [o for o in own if o.startswith(flag)] or difflib.get_close_matches(flag, own, n=2, cutoff=0.8)
        if near:
            raise UserError(f"unknown flag {flag!r} for `plait {name}`: did you mean {' or '.join(near)}? "
                            f"(see plait {name} --help)")


def entry() -> None:
    """The `plait` console command: main(), then an exit that a late Ctrl-C leaves quiet. Once the
    command is done, a SIGINT during the interpreter's shutdown (joining the fork server, torch's
    exit hooks) would print their tracebacks; the work is finished, so it just ends the process."""
    import os
    import signal

    if sys.argv[1:2] == ["train"]:  # first, before imports and preflight: a scheduler's notice then
        from plait.preempt import catch_early  # killed the rank silently, its peers waiting out the timeout

        catch_early()
    try:
        rc = main()
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # `plait mesh ... | head`: the reader has what it wanted, no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush would raise again
        rc = 128 + signal.SIGPIPE

    def done(*_):
        os._exit(rc)

    signal.signal(signal.SIGINT, done)
    sys.exit(rc)


if __name__ == "__main__":
    entry()
