"""In-job restarts (`--train.max_restarts K`): when a worker dies (kill -9, out of memory), hangs
past `parallel.timeout_s` or fails a collective, the launcher's elastic agent stops every worker;
plait then starts them all again from the newest valid checkpoint, up to K times.

What is not restarted, because the same would happen again or a person should look first: a user
error (a bad value, a full or read-only disk, `train.max_bad_steps` reached), a replica mismatch,
and an error of the program's own kind (ValueError, TypeError, ... : a shape that does not split,
a bug) - a fault that a restart cures kills a process, times out a collective, or fails in the
device or its links (RuntimeError, out of memory included).

Each restart is reported twice: one line on stderr when it happens, and in metrics.jsonl a
`"restart"` object in the first step record the restarted run logs - {"count", "max", "cause",
"rank", "from_step", "steps_lost", "detected_at"} - so it survives the trimming of the entries past
the checkpoint that a resume does. Before each start, `.tmp-` folders that the failed attempt left
are removed, so no half-written checkpoint stays behind.

Under an outer launcher - torchrun with `--max-restarts`, SLURM with `--requeue` - that launcher
restarts the processes. plait sees TORCHELASTIC_RESTART_COUNT / SLURM_RESTART_COUNT above 0,
resumes from the newest valid checkpoint without being told, and logs the restart the same way
(the cause is in the outer launcher's log, not known to plait). A multi-node torchrun job restarts
the healthy nodes' workers with the count still 0: they know the job by its rendezvous run id,
which the run folder records (`rejoined`).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path

from plait import checkpoint as ckpt
from plait.errors import UserError

# a SpawnError's message starts with the worker's exception type: these end the run at once
NOT_RESTARTED = ("ReplicaMismatch", "ValueError", "TypeError", "AssertionError", "NotImplementedError", "KeyError",
                 "IndexError", "AttributeError", "ZeroDivisionError", "NameError")
OUTER = (("TORCHELASTIC_RESTART_COUNT", "torchrun"), ("SLURM_RESTART_COUNT", "SLURM"))


def outer_restart(env=None) -> tuple[str, int] | None:
    """(launcher, count) when torchrun or SLURM restarted this process; None on a first start."""
    env = os.environ if env is None else env
    for var, who in OUTER:
        if int(env.get(var) or 0) > 0:
            return who, int(env[var])
    return None


ELASTIC_RUN = ".torchelastic_run_id"
"""The run folder's record of the torchrun job (its rendezvous run id) that trains in it."""


def rejoined(out, env=None) -> bool:
    """Whether this process starts again inside the torchrun job that already trains in `out`.
    After a node fails, torch restarts the workers of the healthy nodes too, but with
    TORCHELASTIC_RESTART_COUNT still 0: they refused the run's checkpoints ("pass --resume"), which
    cost a restart each and ended two-node jobs before their --max-restarts were spent."""
    env = os.environ if env is None else env
    rid = _job_id(env)
    if not rid or not out:
        return False
    try:
        return (Path(out).expanduser() / ELASTIC_RUN).read_text().strip() == rid
    except OSError:
        return False


def _job_id(env) -> str | None:
    """torchrun's rendezvous run id, where it names one job: not the static rendezvous' "none" (every
    job's), nor plait's own launcher's (it restarts its workers itself, with PLAIT_ATTEMPT)."""
    rid = env.get("TORCHELASTIC_RUN_ID")
    return None if not rid or rid == "none" or env.get("PLAIT_SPAWNED") else rid


def record_elastic_run(out: Path) -> None:
    """Rank 0, at the start: note the torchrun job training here (`rejoined`)."""
    rid = _job_id(os.environ)
    if rid:
        from plait.checkpoint import write_atomic

        write_atomic(Path(out) / ELASTIC_RUN, rid)


def resume_after_outer_restart(cfg):
    """A restarted process resumes whatever its command line says (it is the same command)."""
    if (outer_restart() is not None or rejoined(cfg.train.out)) and not cfg.checkpoint.resume:
        cfg.checkpoint.resume = "auto"
    return cfg


def run_workers(cfg, attempt_fn) -> list:
    """`attempt_fn(cfg, env)` runs every worker once (`plait.launch.run`); on a restartable
    failure run it again, from the newest valid checkpoint, up to `train.max_restarts` times."""
    from plait.launch import SpawnError

    limit = cfg.train.max_restarts
    root = Path(cfg.train.out).expanduser() / "checkpoints"
    # one id for every attempt of this invocation (`invocation`)
    env = {"PLAIT_ATTEMPT": "0", "PLAIT_INVOCATION": f"{os.getpid()}-{time.time_ns()}"}
    for attempt in range(limit + 1):
        try:
            return attempt_fn(cfg, env)
        except (SpawnError, UserError) as e:
            ckpt.remove_partial(root)  # every worker has ended: what they left half-written goes
            from plait.preempt import stop_requested

            if (attempt == limit or not isinstance(e, SpawnError) or str(e.message).startswith(NOT_RESTARTED)
                    or stop_requested()):  # a scheduler's notice between attempts: no new attempt
                raise
            note = _restart_note(cfg, e, attempt + 1, limit, root)
            print(f"plait: restart {note['count']} of {limit}: {note['cause']}; resuming from step "
                  f"{note['from_step']} ({note['steps_lost']} step(s) to redo)", file=sys.stderr, flush=True)
            cfg = copy.deepcopy(cfg)
            if not cfg.checkpoint.resume:
                cfg.checkpoint.resume = "auto"  # no checkpoint yet: start over
            env = {**env, "PLAIT_ATTEMPT": str(attempt + 1), "PLAIT_RESTART": json.dumps(note)}
    raise AssertionError("unreachable")


def _restart_note(cfg, e, count: int, limit: int, root: Path) -> dict:
    folder = ckpt.latest_valid(root, log=lambda m: None)
    from_step = ckpt.load_manifest(folder)["step"] if folder is not None else 0
    last = last_logged_step(Path(cfg.train.out).expanduser() / "metrics.jsonl")
    return {"count": count, "max": limit, "cause": str(e), "rank": e.rank, "from_step": from_step,
            "steps_lost": max(0, last - from_step), "detected_at": time.time()}


def last_logged_step(path: Path) -> int:
    """The last step metrics.jsonl records (0 if none); a line cut short by a kill is skipped."""
    last = 0
    if not path.is_file():  # a link to a device (/dev/full) reads without end
        return 0
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return 0
    for line in lines:
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int):
            last = step
    return last


def restart_note(out: Path, start: int) -> dict | None:
    """In a worker (rank 0), before the resume trims metrics.jsonl: what the first step record
    after a restart carries; None on a first start. `start`: the step resumed from."""
    if os.environ.get("PLAIT_RESTART"):
        return json.loads(os.environ["PLAIT_RESTART"])
    outer = outer_restart()
    if outer is None and rejoined(out) and start > 0:  # restarted with a failed peer node: torch counts no restart
        outer = ("torchrun", 0)
    if outer is None:
        return None
    who, count = outer
    lost = max(0, last_logged_step(Path(out) / "metrics.jsonl") - start)
    what = (f"restart {count} by {who}" if count else
            f"torchrun job {_job_id(os.environ)} started again (after a node's failure torch restarts every node)")
    print(f"plait: {what}; resumed from step {start} ({lost} step(s) to redo)", file=sys.stderr, flush=True)
    return {"count": count, "by": who, "cause": f"restarted by {who} (its log names the failure)",
            "from_step": start, "steps_lost": lost, "detected_at": time.time()}


END_FILE = "end_step.json"
"""Where a run that stops after `train.max_steps_this_run` steps records the step it stops at, so
that a restart of the same invocation (plait's own, torchrun's or SLURM's) stops there too."""


def restarted(env=None) -> bool:
    """Whether this worker belongs to a restart of the invocation (not to its first attempt)."""
    env = os.environ if env is None else env
    return int(env.get("PLAIT_ATTEMPT") or 0) > 0 or outer_restart(env) is not None


def invocation(env=None) -> str:
    """Which invocation this worker belongs to, the same on every restart inside it: the SLURM job
    (a requeue keeps its id), torchrun's named rendezvous, plait's own launcher's, or else the
    process that started this one (torchrun's agent under a static rendezvous, whose id "none" is
    every job's). Read on the main rank only: `planned_end`'s caller shares its answer."""
    env = os.environ if env is None else env
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}"
    if rid := _job_id(env):
        return f"torchrun:{rid}"
    if env.get("PLAIT_INVOCATION"):
        return f"plait:{env['PLAIT_INVOCATION']}"
    import socket

    return f"parent:{socket.gethostname()}:{os.getppid()}"


def planned_end(out: Path, end: int, env=None) -> int:
    """The step this invocation stops at (the main rank's answer; the caller broadcasts it). `end`:
    the attempt's own (its start + max_steps_this_run). A restart resumes from an older checkpoint
    than its first attempt started at plus the steps it made, and counting max_steps_this_run from
    there again ran past the stop the first attempt planned (a job sized to its allocation then
    overran it): a restart keeps the first attempt's. The record names its invocation: a file left
    by an earlier invocation (whose first attempt died before writing this one's) planned another
    run's stop, and a restart that took it ended at once, at that older step."""
    path = Path(out) / END_FILE
    me = invocation(env)
    if restarted(env):
        try:
            rec = json.loads(path.read_text())
            if rec.get("invocation") == me:
                return int(rec["end"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # the first attempt ended before it wrote one: it had made no step
    ckpt.write_atomic(path, json.dumps({"end": end, "invocation": me}) + "\n")
    return end


STOP_FILE = "stopped.json"
"""Where rank 0 records a stop on SIGUSR1 (the signal and the step saved). torchrun counts the
workers' exit (143) as a failure and restarts them: without it the restart resumed and trained on,
right before the scheduler that sent the notice ended the job."""


def record_stop(out: Path, signame: str, step: int, env=None) -> None:
    """Note the stop with the torchrun job that made it (its rendezvous id, where it names one)."""
    env = os.environ if env is None else env
    ckpt.write_atomic(Path(out) / STOP_FILE, json.dumps({"signal": signame, "step": step, "job": _job_id(env)}) + "\n")


def stopped_before(out: str | Path, env=None) -> dict | None:
    """Under a torchrun restart, the stop its previous attempt made on purpose ({"signal", "step"});
    else None. A first start forgets an older stop (a new invocation continues the run); a SLURM
    requeue is a new allocation, meant to continue. A stop another torchrun job recorded (one that
    a requeue kept: the requeue counts as restarted) is not this job's: its restart after a crash
    read it, said it had stopped on SIGUSR1, and ended."""
    env = os.environ if env is None else env
    path = Path(out).expanduser() / STOP_FILE
    if (outer_restart(env) or ("",))[0] == "torchrun":
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        mine = _job_id(env)
        return rec if not isinstance(rec, dict) or mine is None or rec.get("job") in (None, mine) else None
    if not restarted(env) and path.exists():
        try:
            path.unlink()
        except OSError:  # a read-only folder: preflight says so in its own line
            pass
    return None
