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
    """Read torchrun-style variables (RANK, WORLD_SIZE, ...) or srun's SLURM_* ones; None if neither."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise UserError("RANK and WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not: set both "
                            "(rank 0's host and a free port) or start the run with torchrun")
        world = int(env["WORLD_SIZE"])
        launcher = "plait" if env.get("PLAIT_SPAWNED") else "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env"
        return LaunchEnv(int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)),
                         int(env.get("LOCAL_WORLD_SIZE", world)), env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                         launcher)
    # SLURM_STEP_ID is set by srun only: a batch script run directly (no srun) also has SLURM_PROCID=0
    # and SLURM_NTASKS=N, and treating it as rank 0 of N would wait forever for peers that never come.
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        world = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        addr = env.get("MASTER_ADDR") or first_host(nodelist) or "127.0.0.1"
        port = int(env.get("MASTER_PORT") or slurm_port(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "0"))
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world)
        local_world = tasks_on_node(per_node, int(env.get("SLURM_NODEID", 0)))
        return LaunchEnv(int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)), local_world,
                         addr, port, "slurm")
    return None


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


def slurm_port(job_id: str) -> int:
    """A port every task of a job computes alike, below Linux's ephemeral range (32768+)."""
    digits = re.sub(r"\D", "", str(job_id)) or "0"
    return 15000 + int(digits) % 15000


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Expand SLURM's '4(x2),3' into [4, 4, 3] and pick this node's count."""
    counts = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m:
            counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node_id] if 0 <= node_id < len(counts) else (counts[0] if counts else 1)


def planned_world(parallel, env=None) -> tuple[int, int]:
    """(world size, processes on this node) the run will have: the launcher's if launched, else nproc."""
    le = detect_launch(env)
    if le is not None:
        return le.world_size, le.local_world_size
    return parallel.nproc, parallel.nproc
