"""Shared by the fault-tolerance tests: the `plait train` command line of a micro run, its metrics and
weights, a time bound, and the check that no process outlived a run.

Faults are injected through plait's test hook (`plait.faults`, the PLAIT_FAULTS variable).
"""

from __future__ import annotations

import json
import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from dp_runs import UNEVEN
from plait.parallel.sharded_state import full_weights


def train_args(corpus, out, steps=10, nproc=1, zero=0, extra=()) -> list[str]:
    """`plait train` arguments of a ~68K-parameter run that takes well under a second per step."""
    args = ["train", "--out", str(out), "--steps", str(steps), "--data.path", str(corpus),
            "--train.seq_len", "32", "--train.micro_batch", "2", "--train.eval_batches", "1",
            "--train.eval_every", "0", "--train.progress", "false", "--train.sample_tokens", "0",
            "--train.compile", "off", "--train.tensorboard", "false", "--train.device", "cpu",
            "--train.eps", "1e-6", "--parallel.timeout_s", "20"]
    if nproc > 1:
        args += ["--nproc", str(nproc), "--dp", str(nproc), "--zero", str(zero)]
    for k, v in UNEVEN.items():
        args += [f"--model.{k}", str(v)]
    return args + [str(a) for a in extra]


def rows(run) -> list[dict]:
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(run) -> dict[int, float]:
    """step -> loss, as the run finally logged them."""
    return {r["step"]: r["loss"] for r in rows(run) if isinstance(r.get("step"), int)}


def step_dir(run, step: int) -> Path:
    return Path(run) / "checkpoints" / f"step_{step:08d}"


def optimizer_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's optimizer files, keyed by file and name."""
    out = {}
    for f in sorted(Path(folder).glob("optim*.pt")):
        obj = torch.load(f, weights_only=True)
        for name, entry in (obj.get("pieces") or obj.get("moments")).items():
            for k, v in entry.items():
                if isinstance(v, torch.Tensor):
                    out[f"{f.name}:{name}:{k}"] = v
        out[f"{f.name}:steps"] = torch.tensor(obj["steps"])
    return out


def assert_same_state(a: Path, b: Path) -> None:
    """Bitwise: the full weights and every optimizer tensor of two checkpoints."""
    wa, wb = full_weights(a), full_weights(b)
    assert wa.keys() == wb.keys()
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []
    oa, ob = optimizer_tensors(a), optimizer_tensors(b)
    assert oa.keys() == ob.keys()
    assert [k for k in oa if not torch.equal(oa[k], ob[k])] == []


def _children() -> dict[int, int]:
    """pid -> parent pid of every process."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
                if rest[0] != "Z":
                    out[int(d)] = int(rest[1])
            except (OSError, IndexError):
                pass
    return out


BACKGROUND: set[int] = set()
"""Processes the session runs beside the tests (conftest's default job): not a test's leftovers."""


def _below(parents: dict[int, int], roots: set[int]) -> set[int]:
    found, frontier = set(), set(roots)
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def descendants(root: int | None = None) -> set[int]:
    """Living processes below `root` (default: this one), except the long-lived helpers that
    multiprocessing keeps for the whole session (fork server, resource tracker) and the session's
    BACKGROUND processes with theirs."""
    import multiprocessing.forkserver as fs
    import multiprocessing.resource_tracker as rt

    keep = {getattr(fs._forkserver, "_forkserver_pid", None), getattr(rt._resource_tracker, "_pid", None)}
    parents = _children()
    # torch.compile's pool of compile workers, which lives as long as the process that compiled (on
    # a GPU machine, the test session's): the suite run with pytest-xdist found it below a worker
    pools = {p for p in parents if "_inductor/compile_worker" in _cmdline(p)}
    keep |= BACKGROUND | _below(parents, BACKGROUND) | pools | _below(parents, pools)
    return {p for p in _below(parents, {os.getpid() if root is None else root}) if p not in keep}


def with_marker(marker: str) -> set[int]:
    """Processes whose environment carries PLAIT_TEST_MARKER=marker (a launcher and all it started)."""
    found = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if f"PLAIT_TEST_MARKER={marker}".encode() in f.read().split(b"\0"):
                        found.add(int(d))
            except OSError:
                pass
    return found


def assert_no_workers_left(grace: float = 5.0) -> None:
    """No worker (no process started below this one) survives a run."""
    deadline = time.monotonic() + grace
    while (left := descendants()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {[(p, _cmdline(p)) for p in sorted(left)]}"


def _cmdline(pid: int) -> str:
    """What a process runs (its parent pid first), for the message of a leftover one."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
        with open(f"/proc/{pid}/stat") as f:
            ppid = f.read().rsplit(")", 1)[1].split()[1]
        return f"ppid {ppid}: {cmd}"
    except OSError:
        return "gone"


@contextmanager
def bounded(seconds: float):
    """Fail the test (instead of hanging the suite) if the body runs longer than `seconds`."""
    def expire(*_):
        raise TimeoutError(f"test body still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def fault_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()] if Path(path).is_file() else []


def blocked_in_a_collective(ready_prefix: str) -> None:
    """A worker entry (`plait.launch.spawn`) whose two ranks block inside collectives that never
    complete, as a rank does in NCCL's wait once its peer has gone: rank 0 in the world's barrier,
    rank 1 in another group's. Neither returns to Python, so neither can run a KeyboardInterrupt."""
    import torch.distributed as dist

    from plait.config import ParallelConfig
    from plait.launch import init_distributed

    dims = init_distributed(ParallelConfig(nproc=2, timeout_s=300), "cpu")
    other = dist.new_group([0, 1])
    Path(f"{ready_prefix}{dims.rank}").touch()
    if dims.rank == 0:
        dist.barrier()
    else:
        dist.barrier(group=other)
