"""Which launcher started this process, and where it put us: torchrun's variables or srun's.

torchrun (and plait's own spawn) export RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
and MASTER_PORT. srun exports only SLURM_* variables, so rank 0's address is the first host of the
step's node list and the port is derived from the job id, the same on every task without talking.
Nothing here imports torch: the config check uses it before any process starts.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from plait.errors import UserError


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits, as the launcher that started it describes it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "plait" (spawn), "torchrun", "slurm", "env" (variables set by hand) or "single"


def detect_launch(env=None) -> LaunchEnv | None:
    """Read torchrun-style variables (RANK, WORLD_SIZE, ...) or srun's SLURM_* ones; None if neither.

    A launcher's variables that cannot describe a world (a rank outside it, half of them, a word
    where a number goes) are refused in one line naming the variable: joining with them would wait
    for peers that never come, or fail deep inside torch."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise UserError("RANK and WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not: set both "
                            "(rank 0's host and a free port) or start the run with torchrun")
        world = _count(env, "WORLD_SIZE")
        # (srun's task once plait exported RANK etc. for it stays srun's: a resume hint, a stop, a
        # restart all depend on which launcher holds the processes)
        launcher = ("plait" if env.get("PLAIT_SPAWNED") else "torchrun" if "TORCHELASTIC_RUN_ID" in env
                    else "slurm" if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env)
                    else "env")
        le = LaunchEnv(_number(env, "RANK"), world, _number(env, "LOCAL_RANK", 0),
                       _count(env, "LOCAL_WORLD_SIZE", world), env["MASTER_ADDR"], _number(env, "MASTER_PORT"),
                       launcher)
        return _checked(le, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"), env)
    # half of torchrun's pair: a script that set one by hand meant a world of several processes, and
    # running it as a world of one would silently train alone (or, as rank 1, beside rank 0's run)
    for have, lack, alone in (("WORLD_SIZE", "RANK", "1"), ("RANK", "WORLD_SIZE", "0")):
        if have in env and lack not in env and env[have].strip() != alone:
            raise UserError(f"{have} = {env[have]!r} is set but {lack} is not: set {lack} too (with MASTER_ADDR "
                            f"and MASTER_PORT) for each process, start the run with torchrun or plait train "
                            f"--nproc N, or unset {have}")
    # SLURM_STEP_ID is set by srun only: a batch script run directly (no srun) also has SLURM_PROCID=0
    # and SLURM_NTASKS=N, and treating it as rank 0 of N would wait forever for peers that never come.
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        tasks = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
        world = _count(env, tasks, 1)
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        addr = env.get("MASTER_ADDR") or first_host(nodelist) or "127.0.0.1"
        port = (_number(env, "MASTER_PORT") if env.get("MASTER_PORT")
                else slurm_port(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "0",
                                env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "0"))
        per_node_var = "SLURM_STEP_TASKS_PER_NODE" if env.get("SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
        per_node = env.get(per_node_var) or str(world)
        counts = node_counts(per_node)
        if len(set(counts)) > 1:  # each rank judged TP placement by its own node's count: ranks disagreed
            raise UserError(f"{per_node_var} = {per_node!r}: plait places ranks on nodes in equal blocks (the mesh's "
                            "node-local dims assume it); start the same number of tasks on every node "
                            "(srun --ntasks-per-node N)")
        local_world = tasks_on_node(per_node, _number(env, "SLURM_NODEID", 0))
        le = LaunchEnv(_number(env, "SLURM_PROCID"), world, _number(env, "SLURM_LOCALID", 0), local_world,
                       addr, port, "slurm")
        return _checked(le, ("SLURM_PROCID", tasks, "SLURM_LOCALID", per_node_var, "MASTER_ADDR", "MASTER_PORT"), env)
    return None


def one_process(command: str, env=None) -> None:
    """Refuse (one line) a single-process command that a launcher started on every rank: each
    process would repeat the whole work and print it again (plait eval, plait generate)."""
    le = detect_launch(env)
    if le is not None and le.world_size > 1 and le.launcher != "plait":
        who = {"slurm": "srun", "env": "RANK / WORLD_SIZE"}.get(le.launcher, le.launcher)
        raise UserError(f"plait {command} runs in one process, but {who} started it as rank {le.rank} of "
                        f"{le.world_size} (each would repeat the whole {command}): start it once, without a launcher")


def _number(env, name: str, default: int | None = None) -> int:
    """The integer a launcher variable holds (`default` when unset); anything else is one line."""
    raw = env.get(name)
    if raw is None or (default is not None and not str(raw).strip()):
        return default
    try:
        return int(str(raw).strip())
    except ValueError:
        raise UserError(f"{name} = {raw!r}: must be a whole number; it is set by the launcher (torchrun, srun): "
                        f"fix or unset it") from None


def _count(env, name: str, default: int | None = None) -> int:
    n = _number(env, name, default)
    if n < 1:
        raise UserError(f"{name} = {env.get(name)!r}: must be a number of processes, 1 or more; fix or unset it")
    return n


def _checked(le: LaunchEnv, names: tuple[str, ...], env) -> LaunchEnv:
    """Refuse a rank outside the world and a port no socket has. `names`: the variables that gave
    rank, world size, local rank, local world size, address and port."""
    rank, world, local, local_world, addr, port = names

    def said(name, value):  # what the variable holds, or that the count is a default
        return f"{name} = {value}" if name in env else f"{name} unset, so {value}"

    if not 0 <= le.rank < le.world_size:
        raise UserError(f"{rank} = {le.rank}: must be 0 to {le.world_size - 1} ({said(world, le.world_size)}); "
                        "each process needs its own rank below the number of processes")
    if not 0 <= le.local_rank < le.local_world_size:
        raise UserError(f"{local} = {le.local_rank}: must be 0 to {le.local_world_size - 1} "
                        f"({said(local_world, le.local_world_size)} process(es) on this node)")
    if le.local_world_size > le.world_size:
        raise UserError(f"{local_world} = {le.local_world_size}: more processes on this node than "
                        f"{said(world, le.world_size)} in all")
    if not le.master_addr.strip():
        raise UserError(f"{addr} = {le.master_addr!r}: must name rank 0's host; set it or unset it")
    if not 0 < le.master_port < 65536:
        raise UserError(f"{port} = {le.master_port}: must be a TCP port, 1 to 65535")
    return le


def first_host(nodelist: str) -> str:
    """First hostname of a SLURM node list: 'gpu[01-04,07],cpu1' -> 'gpu01', 'a[1-2]-b[3]' -> 'a1-b3'."""
    depth, first = 0, ""
    for ch in nodelist.strip():  # the first top-level comma ends the first entry; commas inside [] do not
        if ch == "," and depth == 0:
            break
        depth += (ch == "[") - (ch == "]")
        first += ch
    # each bracket group contributes its first value, zero padding kept ('[007-009]' -> '007')
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], first)


def slurm_port(job_id: str, step_id: str = "0") -> int:
    """A port every task of a job step computes alike, below Linux's ephemeral range (32768+). The
    step moves it: two `srun` steps of one allocation running at once (a sweep) took the same port,
    and the second failed to bind it."""
    job, step = (int(re.sub(r"\D", "", str(x)) or "0") for x in (job_id, step_id))
    return 15000 + (job + 7919 * step) % 15000  # 7919, a prime: consecutive steps land far apart


def node_counts(tasks_per_node: str) -> list[int]:
    """Expand SLURM's '4(x2),3' into [4, 4, 3]."""
    counts = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m:
            counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """This node's count of SLURM's '4(x2),3' ([4, 4, 3])."""
    counts = node_counts(tasks_per_node)
    return counts[node_id] if 0 <= node_id < len(counts) else (counts[0] if counts else 1)


def planned_world(parallel, env=None) -> tuple[int, int]:
    """(world size, processes on this node) the run will have: the launcher's if launched, else nproc."""
    le = detect_launch(env)
    if le is not None:
        return le.world_size, le.local_world_size
    return parallel.nproc, parallel.nproc
