"""`plait train`: build the config from defaults, TOML and overrides; check it; run."""

from __future__ import annotations

import sys

NAME = "train"
HELP = "train a model (default: the tiny preset on the Python standard library, on CPU)"
TAKES_OVERRIDES = True

# short flags that are aliases of config fields (the long form --section.key always works too)
ALIASES = {"out": ("train", "out"), "resume": ("checkpoint", "resume"), "nproc": ("parallel", "nproc"),
           "dp": ("parallel", "dp_shard"), "zero": ("parallel", "zero"), "tp": ("parallel", "tp"),
           "sp": ("parallel", "sp"), "pp": ("parallel", "pp"), "schedule": ("parallel", "schedule"),
           "microbatches": ("parallel", "microbatches"), "cp": ("parallel", "cp"),
           "steps": ("train", "steps"), "preset": ("model", "preset")}


def add_arguments(p) -> None:
    p.add_argument("--config", help="TOML file with [model], [data], [train], [checkpoint], [parallel] tables")
    p.add_argument("--out", help="run folder (default runs/<timestamp>)")
    p.add_argument("--resume", nargs="?", const=True, metavar="auto",
                   help="continue the run in --out from its newest valid checkpoint, with the config it was saved "
                        "with (options given here override it; the layout is this command's); `--resume auto` "
                        "starts fresh when there is none")
    p.add_argument("--steps", help="optimizer steps (train.steps)")
    p.add_argument("--preset", help="model preset (model.preset)")
    p.add_argument("--nproc", help="processes to start on this machine")
    p.add_argument("--dp", help="data-parallel degree (parallel.dp_shard)")
    p.add_argument("--zero", help="ZeRO stage 0|1|2|3")
    p.add_argument("--tp", help="tensor-parallel degree")
    p.add_argument("--sp", nargs="?", const="on", metavar="on|off|auto",  # the values of parallel.sp; a bare --sp is on
                   help="sequence parallelism (parallel.sp; --sp alone = on; default auto: on whenever tp > 1)")
    p.add_argument("--pp", help="pipeline stages")
    p.add_argument("--schedule", help="pipeline schedule: gpipe, 1f1b, interleaved, zb (ZB-H1) or zbv")
    p.add_argument("--microbatches", help="pipeline micro-batches")
    p.add_argument("--cp", help="context-parallel degree")
    p.add_argument("--help-config", action="store_true", help="list every config field with its meaning and exit")
    p.epilog = "Any config field can be set as --section.key VALUE, e.g. --train.steps 20 --model.preset small."


def config_from_args(args, extra):
    """The run's config: defaults (or, when resuming, the run's saved config), then --config, then
    flags; when resuming, the line that says where the config came from and what changed; and the
    [model] fields given (which `train.init_from` must not silently replace)."""
    from plait.config import build_config, load_toml, merge, parse_overrides

    from plait.errors import bad_value

    raw = load_toml(args.config) if args.config else {}
    long_form = parse_overrides(extra)
    raw = merge(raw, long_form)
    for flag, (section, key) in ALIASES.items():
        value = getattr(args, flag, None)
        if value is not None:
            other = long_form.get(section, {}).get(key)
            if other is not None and str(other) != str(value):  # neither may silently win
                raise bad_value(f"--{flag}", value, f"and --{section}.{key} {other} set one field: give one of them")
            raw = merge(raw, {section: {key: value}})
    given = raw.get("train", {})
    if given.get("global_batch") and "grad_accum" in given:  # the batch derives the accumulation at each layout
        raise bad_value("train.grad_accum", given["grad_accum"], f"is derived from train.global_batch = "
                        f"{given['global_batch']} (global_batch / (micro_batch x dp)): give one of them")
    cfg = build_config(raw)  # checks every value given, and reads --resume / --out
    typed = getattr(args, "schedule", None) is not None or "schedule" in long_form.get("parallel", {})
    if typed and cfg.parallel.pp == 1:  # 1f1b as well, typed on the command line (a run's config.toml lists it)
        raise bad_value("parallel.schedule", cfg.parallel.schedule, "orders a pipeline's stages: it needs "
                        "parallel.pp > 1 (without a pipeline, drop parallel.schedule)")
    mb, accum = cfg.parallel.microbatches, cfg.train.grad_accum
    if "grad_accum" in given and "microbatches" in raw.get("parallel", {}) and mb and mb != accum:
        # a pipeline's micro-batches are its accumulation: neither may silently win
        raise bad_value("parallel.microbatches", mb, f"sets train.grad_accum, given as {accum} too: give one of them")
    if cfg.checkpoint.resume and cfg.train.out:
        from pathlib import Path

        from plait import resume

        from plait import checkpoint as ckpt
        from plait.preflight import _first_process, warn

        out = Path(cfg.train.out).expanduser()
        saved = resume.saved_config(out, log=warn if _first_process() else (lambda m: None))
        if saved is not None:
            cfg, changed = resume.resumed_config(saved[0], raw)
            later = resume.later_start_changes(out, saved[0], raw) if saved[1].name == "train_state.json" else []
            if later and _first_process():
                warn(f"{out / 'config.toml'} holds {', '.join(later)}: a start that saved no checkpoint after "
                     f"{saved[1].parent.name} set them; the run continues with that checkpoint's config (give "
                     "those options again to keep them)")
            was = saved[0].get("train", {}).get("init_from", "")
            # (the same folder named another way was put back by resumed_config)
            if "init_from" in given and cfg.train.init_from != was and ckpt.list_checkpoints(out / "checkpoints"):
                # the run's own checkpoint decides its weights; the new value would only rewrite its record
                raise bad_value("train.init_from", cfg.train.init_from, f"but the run in {out} continues from its own "
                                f"checkpoint (it started from {was or 'its own initialisation'}); drop "
                                "--train.init_from, or train into a new --out")
            return cfg, resume.describe_resume(saved[1], changed), raw.get("model", {})
    return cfg, None, raw.get("model", {})


def print_config_help() -> None:
    from plait.config import Config, field_docs
    from dataclasses import fields

    for f in fields(Config):
        cls = type(getattr(Config(), f.name))
        print(f"[{f.name}]")
        defaults = cls()
        for name, doc in field_docs(cls).items():
            print(f"  --{f.name}.{name} (default {getattr(defaults, name)!r}): {doc}")


def how_to_continue(cfg) -> str:
    """Where a stopped run can go on from: its newest valid checkpoint, or nowhere yet."""
    from pathlib import Path

    from plait import checkpoint as ckpt

    out = Path(cfg.train.out).expanduser()
    folder = ckpt.latest_valid(out / "checkpoints", log=lambda m: None) if (out / "checkpoints").is_dir() else None
    if folder is None:
        return "no checkpoint was saved: run the command again"
    return f"the newest valid checkpoint is {folder.name}: continue {resume_how(out, cfg)}"


def resume_how(out, cfg=None) -> str:
    """How to go on from a run's checkpoint: plait's own command with the layout's flags, or, where
    torchrun or srun holds the processes, their command again (a bare `plait train --resume` went on
    in one process at a fraction of the batch)."""
    from plait.launch_env import detect_launch

    try:
        le = detect_launch()
    except Exception:  # noqa: BLE001 - launcher variables it refuses: said elsewhere
        le = None
    if le is not None and le.launcher in ("torchrun", "slurm"):
        tool = "torchrun" if le.launcher == "torchrun" else "srun"
        return f"by running the same {tool} command again with --resume added (on every node)"
    return f"with `plait train --out {out} --resume{layout_flags(cfg) if cfg is not None else ''}`"


def layout_flags(cfg) -> str:
    """The layout as flags (' --nproc 2 --dp 2 --zero 3'): a resume takes the run's config but not its
    layout, and without them the suggested command went on in one process at a smaller batch."""
    from dataclasses import fields

    from plait.config import ParallelConfig
    from plait.launch_env import detect_launch

    try:
        le = detect_launch()
    except Exception:  # noqa: BLE001 - launcher variables it refuses: said elsewhere; suggest the flags
        le = None
    if le is not None and le.launcher in ("torchrun", "slurm"):
        return ""  # the launcher holds the layout's processes; its own command starts them again
    # (plait's own launcher, even inside a SLURM allocation, takes them as flags)
    short = {key: flag for flag, (section, key) in ALIASES.items() if section == "parallel"}
    default = ParallelConfig()
    out = []
    for f in fields(ParallelConfig):
        value = getattr(cfg.parallel, f.name)
        if value != getattr(default, f.name):
            flag = short.get(f.name, f"parallel.{f.name}")
            out.append(f" --{flag} {str(value).lower() if isinstance(value, bool) else value}")
    return "".join(out)


# failures whose line says all a user acts on: a timed-out or broken collective, a replica check, a
# rank the watchdog found still running (their stacks go to the run folder, not the terminal)
SAYS_ENOUGH = ("CollectiveError", "ReplicaMismatch", "TimeoutError: rank", "DistNetworkError")
TRACEBACKS = "failure-tracebacks.txt"


def keep_tracebacks(cfg, e) -> str:
    """Write every failed rank's traceback into the run folder; returns where, for the error line."""
    from pathlib import Path

    if not any(e.tracebacks.values()):
        return ""
    path = Path(cfg.train.out).expanduser() / TRACEBACKS
    try:
        path.write_text("".join(f"--- rank {r} ---\n{tb.rstrip()}\n" for r, tb in sorted(e.tracebacks.items()) if tb))
    except OSError:  # a full or read-only disk: the line says the rest
        return ""
    return f" (each failed rank's traceback: {path})"


def failure_line(cfg, e, kept: str = "") -> str:
    """What failed, and how the run goes on from what it saved (`kept`: where the tracebacks went)."""
    from plait.supervise import NOT_RESTARTED

    final = str(e.message).startswith(NOT_RESTARTED)  # the supervisor does not restart over these
    # any other failure ends the run only once the supervisor's restarts are spent
    tried = f" after {cfg.train.max_restarts} restart(s)" if cfg.train.max_restarts and not final else ""
    auto = "" if final or cfg.train.max_restarts else "; --train.max_restarts K restarts it by itself"
    program = final and not str(e.message).startswith("ReplicaMismatch")  # a replica mismatch has its own advice
    repeats = "; a restart meets it again: fix its cause first" if program else ""
    return f"{e}{kept}{tried}{repeats}; {how_to_continue(cfg)}{auto}"


def _peer_loss_line(e: BaseException) -> str | None:
    """One line for a rank whose collective failed (a peer died, hung or never came), else None."""
    import torch.distributed as dist

    from plait.comm import CollectiveError

    network = getattr(dist, "DistNetworkError", ())
    if isinstance(e, CollectiveError) or (network and isinstance(e, network)):
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"{first[:400]} (another rank stopped first: its own output says why)"
    return None


def run(args, extra) -> int:
    if args.help_config:
        print_config_help()
        return 0
    from plait.errors import UserError
    from plait.launch import SpawnError, Stopped
    from plait.run import launch_training

    try:
        cfg, note, model_given = config_from_args(args, extra)
    except UserError as e:
        raise e.everywhere()
    try:
        summary = launch_training(cfg, note, model_given)
    except Stopped as e:  # SIGTERM to the launcher: its agent ended the workers (SIGUSR1 is the stop that saves)
        print(f"plait {NAME}: stopped by {e.signame}; {how_to_continue(cfg)}", file=sys.stderr)
        return 143
    except SpawnError as e:  # a worker died or raised: not the user's input, but one report, not the launcher's stack
        kept = keep_tracebacks(cfg, e)
        if e.traceback and not str(e.message).startswith(SAYS_ENOUGH):
            print(e.traceback.rstrip(), file=sys.stderr)  # a Python error: where it came from
        print(f"plait {NAME}: error: {failure_line(cfg, e, kept)}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - only a peer's loss is turned into a line; anything else is re-raised
        line = _peer_loss_line(e)
        if line is None:
            raise
        # under torchrun or srun this process is the rank: a dead peer surfaced as a collective's
        # traceback, with no word of where the run can go on from
        print(f"plait {NAME}: error: {line}; {how_to_continue(cfg)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: every worker stops at once (plait.launch); a save it cut short goes at the next start
        print(f"plait {NAME}: interrupted; {how_to_continue(cfg)}", file=sys.stderr)
        return 130
    if summary and summary.get("stopped"):  # SIGUSR1: every rank saved the step it was at (plait.preempt)
        print(f"plait {NAME}: stopped by {summary['stopped']}; {how_to_continue(cfg)}", file=sys.stderr)
        return 143
    if summary and summary.get("val_loss") is not None:
        print(f"final val loss {summary['val_loss']:.4f}; run folder {summary['out']}", file=sys.stderr)
    return 0
