"""Fault injection, a test hook: make one rank die, hang, produce a NaN, flip a bit, run slow or
fail a checkpoint write at a chosen step, so that the tests exercise the code a real fault takes.

Off unless the environment variable PLAIT_FAULTS is set; nothing else in plait reads it, and the
trainer calls only `install` (once) and `at` (at two points: each step's start, each checkpoint
write). The value is a list of faults separated by ';', each `kind@key=value,key=value`:

    PLAIT_FAULTS="kill@rank=1,step=5"              SIGKILL rank 1 as step 5 starts
    PLAIT_FAULTS="kill@rank=2,step=6,during=write" SIGKILL rank 2 while it writes its checkpoint of step 6
    PLAIT_FAULTS="hang@rank=1,step=3,s=600"        rank 1 sleeps 600 s inside step 3's backward,
                                                   while the other ranks wait in their collectives
    PLAIT_FAULTS="nan@rank=0,step=3,count=2"       a NaN in rank 0's gradient at steps 3 and 4
    PLAIT_FAULTS="flip@rank=1,step=4,bit=0"        flip bit 0 of one of rank 1's parameters before step 4
    PLAIT_FAULTS="slow@rank=1,step=1,ms=40"        rank 1 burns 40 ms of CPU at every step from step 1
    PLAIT_FAULTS="enospc@rank=0,step=4"            rank 0's checkpoint write of step 4 fails: disk full

Steps count from 1, as in metrics.jsonl. Every fault also takes `attempt` (default 0): the launch
attempt it fires in (plait's supervisor numbers its restarts in PLAIT_ATTEMPT, torchrun in
TORCHELASTIC_RESTART_COUNT), so the restarted run is not hit again. PLAIT_FAULTS_LOG=FILE appends
one JSON line per fault fired ({"kind", "rank", "step", "time"}): tests time detection from it.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, fields

import torch

from plait.errors import UserError

KINDS = ("kill", "hang", "nan", "flip", "slow", "enospc")


@dataclass
class Fault:
    kind: str
    rank: int = 0
    step: int = 1
    attempt: int = 0
    count: int = 1  # nan: consecutive steps hit
    during: str = ""  # kill: "" = at the step's start, "write" = inside the checkpoint write
    s: float = 3600.0  # hang: seconds
    ms: float = 0.0  # slow: CPU milliseconds per step
    bit: int = 0  # flip: which bit of the 32-bit word


def parse(spec: str) -> list[Fault]:
    """The faults of a PLAIT_FAULTS value; a malformed one is a one-line UserError."""
    out = []
    types = {f.name: f.type for f in fields(Fault)}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kind, _, args = part.partition("@")
        if kind not in KINDS:
            raise UserError(f"PLAIT_FAULTS: unknown fault {kind!r} in {part!r}; choose {', '.join(KINDS)}")
        fault = Fault(kind)
        for kv in filter(None, (a.strip() for a in args.split(","))):
            key, _, value = kv.partition("=")
            if key not in types or key == "kind":
                raise UserError(f"PLAIT_FAULTS: unknown key {key!r} in {part!r}")
            cast = {"int": int, "float": float, "str": str}[types[key]]
            try:
                setattr(fault, key, cast(value))
            except ValueError:
                raise UserError(f"PLAIT_FAULTS: {key}={value!r} in {part!r} is not a {types[key]}") from None
        out.append(fault)
    return out


class _Injector:
    def __init__(self, faults: list[Fault], rank: int, log_path: str):
        self.faults, self.rank, self.log_path = faults, rank, log_path
        self.step = 0

    def arm(self, model, engine) -> None:
        """NaN and hang act inside backward, through a gradient hook on the first parameter."""
        self.engine = engine
        if any(f.kind in ("nan", "hang") for f in self.faults):
            next(iter(model.parameters())).register_hook(self._on_grad)

    def _fire(self, f: Fault, step: int) -> None:
        if self.log_path:
            with open(self.log_path, "a") as fh:
                fh.write(json.dumps({"kind": f.kind, "rank": self.rank, "step": step, "time": time.time(),
                                     "during": f.during}) + "\n")
        print(f"plait: fault injected on rank {self.rank} at step {step}: {f.kind}", file=sys.stderr, flush=True)

    def _on_grad(self, grad):
        for f in self.faults:
            if f.kind == "nan" and f.step <= self.step < f.step + f.count:
                self._fire(f, self.step)
                grad = grad.clone()
                grad.view(-1)[0] = float("nan")
            elif f.kind == "hang" and f.step == self.step:
                self._fire(f, self.step)
                time.sleep(f.s)
        return grad

    def at(self, point: str, step: int, path=None) -> None:
        if point == "step":
            self.step = step
        for f in self.faults:
            if point == "step" and f.kind == "slow" and step >= f.step:
                end = time.process_time() + f.ms / 1e3
                while time.process_time() < end:  # CPU work, not a sleep: a slower core looks like this
                    pass
            if f.step != step:
                continue
            if f.kind == "kill" and point == ("write" if f.during == "write" else "step"):
                self._fire(f, step)
                os.kill(os.getpid(), signal.SIGKILL)
            elif f.kind == "flip" and point == "step":
                self._fire(f, step)
                words = self.engine.opt.master.view(-1).view(torch.int32)  # fp32 masters
                i = words.numel() // 2
                words[i] = words[i] ^ (1 << f.bit)
            elif f.kind == "enospc" and point == "write":
                self._fire(f, step)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path or ""))


_current: _Injector | None = None


def install(rank: int, model, engine, env=None) -> None:
    """Read PLAIT_FAULTS for this rank and launch attempt (no-op when unset); call once per run."""
    global _current
    env = os.environ if env is None else env
    spec = env.get("PLAIT_FAULTS", "")
    attempt = int(env.get("PLAIT_ATTEMPT") or env.get("TORCHELASTIC_RESTART_COUNT") or 0)
    mine = [f for f in parse(spec) if f.rank == rank and f.attempt == attempt] if spec else []
    _current = _Injector(mine, rank, env.get("PLAIT_FAULTS_LOG", "")) if mine else None
    if _current is not None:
        _current.arm(model, engine)


def at(point: str, step: int, path=None) -> None:
    """Fire the faults due at `point` ("step": a step's start; "write": a checkpoint write of `step`,
    its files written but not yet committed)."""
    if _current is not None:
        _current.at(point, step, path)
