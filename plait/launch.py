"""Start the processes of a run, or join the ones torchrun / srun started; set up and tear down.

The whole API (what `plait train --nproc N` and the benchmarks use):

    run(entry, args, nproc, device_type="cpu") -> list   # per-rank return values of entry(*args)
    spawn(entry, args, nproc, ...) -> list               # always start nproc local processes
    init_distributed(parallel_cfg, device_type) -> ParallelDims   # in each worker: process group + mesh
    shutdown()                                           # in each worker, at the end
    detect_launch() -> LaunchEnv | None                  # torchrun / srun / plait's own workers
    check_launched(nproc, le)                            # what a torchrun / srun run cannot ask for

    def worker(cfg):                                     # module level, so it pickles by name
        dims = init_distributed(cfg.parallel, "cuda")    # sets cuda:<local rank>, timeout, mesh
        try:
            comm = Comm(dims, Ledger())
            ...                                          # dims.device, dims.group("dp"), comm.all_reduce(...)
            return {"loss": ...}
        finally:
            shutdown()

    results = run(worker, (cfg,), nproc=cfg.parallel.nproc, device_type="cuda")

`run` calls `entry` in this process when torchrun or srun already started us (or nproc is 1), and
otherwise starts nproc processes with torch's elastic launcher (one per GPU on CUDA, gloo over
loopback on CPU). The same command line therefore works under `plait ... --nproc N`, `torchrun` and
`srun` (docs/launching.md). A worker that fails ends the run with a `SpawnError` naming the failing
rank and its error on one line; every failed rank's traceback is in `SpawnError.tracebacks`.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager

from plait import fork_server, lifeline
from plait.errors import UserError, bad_value
from plait.launch_env import (  # noqa: F401  (re-exported: the launch API in one place)
    LaunchEnv,
    detect_launch,
    first_host,
    planned_world,
    slurm_port,
    tasks_on_node,
)
from plait.preempt import STOP_FILE_ENV, relay_to

# Modules the fork server imports once, so that each worker starts in ~0.1 s instead of paying for
# `import torch` again (2-4 s per rank on a small CPU, the bulk of a short multi-process test).
# torch._dynamo too: building any model imports it (a meta-device `normal_` goes through its
# disable wrapper), 2 s of CPU per rank otherwise; and plait's trainer with everything it imports.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.device_mesh", "torch._dynamo", "plait.launch",
           "plait.comm", "plait.collectives", "plait.parallel.dims", "plait.run"]


class Stopped(Exception):
    """The launcher was ended by a signal (SIGTERM), and its agent ended the workers with it."""

    def __init__(self, signame: str):
        super().__init__(signame)
        self.signame = signame


class SpawnError(RuntimeError):
    """A worker failed. str() is one line naming the rank; `tracebacks` maps rank -> traceback."""

    def __init__(self, rank: int, message: str, tracebacks: dict[int, str], exitcodes: dict[int, int]):
        others = len(tracebacks) - 1
        super().__init__(f"rank {rank} failed: {message}"
                         + (f" ({others} other rank(s) failed after it)" if others > 0 else ""))
        self.rank, self.message, self.tracebacks, self.exitcodes = rank, message, tracebacks, exitcodes

    @property
    def traceback(self) -> str:
        return self.tracebacks.get(self.rank, "")


# ---- inside a worker ---------------------------------------------------------------------------------


def init_distributed(parallel, device_type: str = "cpu", env=None, agree: dict | None = None):
    """Join the process group and build the mesh; returns the `ParallelDims` with `.mesh` and `.device`.

    Reads the launcher's environment (plait's spawn, torchrun or srun). A process nobody launched
    runs as a world of one, so a single-device run takes the same code path. Every collective on
    every mesh dim then fails after `parallel.timeout_s` instead of hanging. `agree`: {name: value}
    every rank must hold alike (`same_everywhere`), checked before the mesh is built.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from plait.parallel.dims import ParallelDims

    le = detect_launch(env)
    if le is not None and le.world_size > 1:
        _resolvable(le, env)  # before srun's address is published as MASTER_ADDR below
    if le is None:
        if parallel.nproc > 1:
            raise bad_value("parallel.nproc", parallel.nproc, "this process was not started by a launcher; "
                            "use plait.launch.run/spawn (plait train --nproc N), torchrun or srun")
        le = LaunchEnv(0, 1, 0, 1, "127.0.0.1", free_port(), "single")
    elif le.launcher == "slurm":
        # srun sets only SLURM_*: publish the torchrun names too, for env:// and for code that reads them
        os.environ.update(RANK=str(le.rank), WORLD_SIZE=str(le.world_size), LOCAL_RANK=str(le.local_rank),
                          LOCAL_WORLD_SIZE=str(le.local_world_size), MASTER_ADDR=le.master_addr,
                          MASTER_PORT=str(le.master_port))
    if le.master_addr in ("127.0.0.1", "localhost") and sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dims = ParallelDims.from_config(parallel, le.world_size)
    warning = dims.check_placement(le.local_world_size, parallel.allow_cross_node_tp)
    if warning and le.rank == 0:
        print(f"plait: {warning}", file=sys.stderr)

    kwargs = {}
    if device_type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise bad_value("train.device", "cuda", "no GPU is visible to this process; use --train.device cpu")
        # srun may hand each task one visible GPU (local rank 3 sees only device 0), hence the modulo;
        # torchrun and plait's own launcher hand every process all of the node's GPUs, so more processes
        # than GPUs there put two on one GPU, which NCCL refuses (a traceback per rank before this)
        if le.launcher in ("torchrun", "plait") and le.local_world_size > count:
            raise _shared_gpu(le.local_world_size, count)
        device = torch.device("cuda", le.local_rank % count)
        torch.cuda.set_device(device)
        if getattr(parallel, "bind_cpus", "auto") == "auto" and le.local_world_size > 1:
            from plait.affinity import bind

            bind(le.local_rank, le.local_world_size)  # before NCCL starts its threads: they inherit it
        kwargs["device_id"] = device  # eager NCCL init: DeviceMesh then splits groups in one call per dim
        backend = "nccl"
    else:
        device = torch.device(device_type)
        backend = "gloo"
    if le.launcher == "single":
        # a world of one gets its own store, leaving this process's environment untouched: a test or
        # notebook that trains in-process must not look "launched" to a later spawn
        kwargs.update(init_method=f"tcp://127.0.0.1:{le.master_port}", rank=0, world_size=1)
    else:
        kwargs.update(init_method="env://")  # under torchelastic this joins the agent's store
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend, timeout=timedelta(seconds=parallel.timeout_s), **kwargs)
        except RuntimeError as e:  # torch's DistNetworkError / DistStoreError, as a traceback per rank
            text = str(e).lower()
            if "address already in use" in text:  # rank 0 could not open the rendezvous port
                raise UserError(f"MASTER_PORT = {le.master_port}: already in use on {le.master_addr} (another run "
                                f"on this node?): export MASTER_PORT with a free port") from None
            if "timeout" in text or "timed out" in text:  # the world it was told of never gathered
                raise UserError(f"the rendezvous at {le.master_addr}:{le.master_port} waited parallel.timeout_s = "
                                f"{parallel.timeout_s:g} s for {le.world_size} ranks as rank {le.rank}, and they did "
                                "not all come: a process that stopped before joining says why in its own output "
                                "(a refused option, a missing path); else every process must be given the same "
                                "world size (WORLD_SIZE, SLURM_STEP_NUM_TASKS) and reach rank 0's host") from None
            if "duplicate gpu" in text:  # NCCL: two processes on one GPU (srun's binding, set by hand)
                raise _shared_gpu(le.local_world_size, torch.cuda.device_count()) from None
            raise
    if agree is not None and le.world_size > 1:
        same_everywhere(agree)
    dims.build_mesh(device_type, parallel.timeout_s)
    dims.device = device
    return dims


def _resolvable(le, env=None) -> None:
    """Rank 0's host must resolve: a name that does not (a typo, a node list cut short) waited the whole
    parallel.timeout_s in the rendezvous, printing native stack frames, and then blamed ranks that
    "did not all come"."""
    import socket

    try:
        socket.getaddrinfo(le.master_addr, le.master_port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        given = "MASTER_ADDR" in (os.environ if env is None else env)
        where = f"MASTER_ADDR = {le.master_addr!r}" if given else (
            f"rank 0's host {le.master_addr!r} (the first of the SLURM node list)")
        raise UserError(f"{where}: no such host ({getattr(e, 'strerror', None) or e}); set MASTER_ADDR to rank 0's "
                        "hostname or IP address") from None


def _shared_gpu(procs: int, gpus: int) -> UserError:
    return UserError(f"{procs} processes on this node share {gpus} visible GPU(s), and NCCL needs one GPU a "
                     f"process: start at most {gpus} a node (--nproc, --nproc_per_node, srun --ntasks-per-node "
                     "with --gpus-per-task 1), or run on the CPU (train: --train.device cpu; bench comm: --device cpu)")


def same_everywhere(values: dict) -> None:
    """Every rank's `values` against rank 0's, in one all-gather: a field that differs raises the same
    one-line UserError on every rank. Nodes started by hand (torchrun, srun) with different
    commands otherwise trained different layouts until a collective met its counterpart in
    another shape or never met it: a hang of parallel.timeout_s, then a failed collective."""
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, values)
    for r, theirs in enumerate(everyone):
        diff = next((k for k in values if theirs.get(k) != everyone[0].get(k)), None)
        if diff is not None:
            raise UserError(f"rank {r} was started with {diff} = {theirs.get(diff)!r}, rank 0 with "
                            f"{everyone[0].get(diff)!r}: start every node with the same command")


def shutdown() -> None:
    """Tear down the process group so that gloo's threads cannot abort the interpreter at exit.

    Without it a gloo worker intermittently dies with SIGABRT after finishing its work (upstream
    pytorch issue 190489), and the launcher then reports a failed run.
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    finally:
        gc.collect()


# ---- starting processes ------------------------------------------------------------------------------


def run(entry, args=(), nproc: int = 1, device_type: str = "cpu", isolate: bool = False, **kw) -> list:
    """Run `entry(*args)` on every rank: here if already launched (or nproc is 1 and not `isolate`),
    else via `spawn` (`isolate`: even one rank gets its own process, which may die without us)."""
    le = detect_launch()
    if le is not None and le.launcher != "plait":
        check_launched(nproc, le)
        return [_call(entry, args)]
    if nproc == 1 and not isolate:
        return [_call(entry, args)]
    return spawn(entry, args, nproc, device_type=device_type, **kw)


def check_launched(nproc: int, le: LaunchEnv | None, env=None) -> None:
    """What a run that torchrun or srun started cannot ask for; `plait train` checks it before the run
    folder is made (preflight), `run` again for its other callers."""
    if le is None or le.launcher == "plait":
        return
    if nproc > 1 and nproc != le.local_world_size:
        raise bad_value("parallel.nproc", nproc, f"{le.launcher} already started {le.local_world_size} "
                        f"process(es) on this node; drop --nproc when launching with {le.launcher}")
    env = os.environ if env is None else env
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0").strip()
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if le.launcher == "torchrun" and restarts not in ("", "0") and shared:
        # torchrun hands its workers its own rendezvous store, the same one on every attempt, and the
        # process group's keys carry no attempt: a restarted worker reads the dead attempt's addresses
        # and its process group fails to connect (gloo and NCCL alike; pytorch issues 135712, 167288).
        # With the variable set, the c10d rendezvous gives every attempt a store of its own; the static
        # one (--master_addr/--node_rank) always shares it.
        raise UserError(f"torchrun --max-restarts {restarts} shares its rendezvous store with the workers "
                        "(TORCHELASTIC_USE_AGENT_STORE=True), and a restarted worker would then fail to connect "
                        "to its peers: export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun and use "
                        "--rdzv_backend c10d (or --standalone)").everywhere()  # every rank sees the same variables


def _call(entry, args):
    try:
        return entry(*args)
    finally:
        shutdown()


def spawn(entry, args=(), nproc: int = 2, *, device_type: str = "cpu", timeout_s: float | None = None,
          start_method: str = "forkserver", preload: tuple[str, ...] = (), env: dict | None = None) -> list:
    """Start `nproc` local processes running `entry(*args)` and return their results in rank order.

    entry: a module-level function (it is pickled by name). timeout_s: bound on the whole run; a
    rank still running then dumps its stacks and fails (for tests and benchmarks; training uses
    parallel.timeout_s per collective instead). env: extra variables for the workers.
    """
    import torch
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1:
        raise bad_value("parallel.nproc", nproc, "must be a positive number of processes")
    if device_type == "cuda" and torch.cuda.device_count() < nproc:
        raise bad_value("parallel.nproc", nproc, f"only {torch.cuda.device_count()} GPU(s) are visible; "
                        f"start at most one process per GPU")
    child_env = dict(os.environ)
    child_env.update(env or {}, PLAIT_SPAWNED="1", PLAIT_LAUNCHER_PID=str(os.getpid()))
    _loopback_env(child_env)
    if device_type == "cpu" and "OMP_NUM_THREADS" not in child_env:
        # nproc ranks share the cores: oversubscribed intra-op threads slow every rank down
        child_env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    if start_method == "forkserver":
        fork_server.start(PRELOAD + list(preload))
    workdir = tempfile.mkdtemp(prefix="plait-launch-")
    child_env[STOP_FILE_ENV] = os.path.join(workdir, "stop")  # SIGUSR1 to this process: the workers stop
    unrelay = relay_to(child_env[STOP_FILE_ENV])
    try:
        for attempt in range(3):
            port = free_port()
            config = LaunchConfig(
                min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"plait-{os.getpid()}-{port}",
                rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"rank": 0},
                max_restarts=0, monitor_interval=0.05, start_method=start_method,
                logs_specs=DefaultLogsSpecs(log_dir=os.path.join(workdir, f"logs{attempt}")),
                local_addr="127.0.0.1")
            try:
                with _quiet_elastic(), _own_signals(), _tempdir(workdir):
                    out = elastic_launch(config, _worker)(entry, tuple(args), child_env, timeout_s, workdir,
                                                          _ParentFd(1), _ParentFd(2))
                return [out[r] for r in range(nproc)]
            except ChildFailedError as e:
                raise _failure(e, workdir, nproc) from None
            except Exception as e:  # the free port was taken between probing and binding it
                if attempt == 2 or "address already in use" not in str(e).lower():
                    raise
    except KeyboardInterrupt:
        if start_method == "forkserver":
            fork_server.kill()
        raise
    finally:
        unrelay()
        shutil.rmtree(workdir, ignore_errors=True)


def _worker(entry, args, env, timeout_s, workdir, stdout_fd=None, stderr_fd=None):
    """A launched rank: `_rank` under Ctrl-C's quiet end. A KeyboardInterrupt that reached
    multiprocessing's bootstrap printed its traceback under the run's one line (Ctrl-C as the
    workers start, before the loop's own handling); the launcher says "interrupted"."""
    try:
        return _rank(entry, args, env, timeout_s, workdir, stdout_fd, stderr_fd)
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def _rank(entry, args, env, timeout_s, workdir, stdout_fd=None, stderr_fd=None):
    for k, v in env.items():  # the fork server's environment is from when it started, not from now
        os.environ.setdefault(k, v)
    for k in [k for k in os.environ if k.startswith("PLAIT_")]:  # ... but plait's own say this launch
        del os.environ[k]
    os.environ.update({k: v for k, v in env.items() if k.startswith("PLAIT_")})
    # ... and so are its stdout/stderr: write where the caller's go now (a terminal, a log, pytest's capture)
    for fd, target in ((stdout_fd, 1), (stderr_fd, 2)):
        if fd is not None:
            os.dup2(fd, target)
            os.close(fd)
    # Everything imported so far (torch and the fork server's preload: ~300k objects) lives as long
    # as the process: frozen, the collector no longer walks it - not in training's collections, nor
    # in shutdown's, which took 0.3 s a worker and 7% of the CPU test suite's time.
    gc.freeze()
    # the fork server ignores Ctrl-C and its children inherit that: a worker must stop on it as a
    # process of its own would (KeyboardInterrupt), not run on until the agent's grace period ends
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rank = int(os.environ.get("RANK", 0))
    lifeline.watch(int(os.environ.get("PLAIT_LAUNCHER_PID") or 0), rank)  # end with the launcher
    lifeline.after_ctrl_c()  # and within seconds of Ctrl-C, even blocked inside a collective
    if os.environ.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    done = threading.Event()
    if timeout_s:
        threading.Thread(target=_watchdog, args=(done, timeout_s, rank, workdir), daemon=True).start()
    try:
        out = entry(*args)
        open(os.path.join(workdir, f"rank{rank}.done"), "w").close()  # not a suspect if a peer fails after
        return out
    except BaseException as e:
        kind = "UserError" if isinstance(e, UserError) else type(e).__name__  # subclasses too: one line, exit 2
        _write_report(workdir, rank, f"{kind}: {e}", traceback.format_exc())
        if _PEER_LOSS.search(str(e)):
            # a peer ended first: let the agent, polling every 50 ms, see that rank's end before this
            # one's, or it reports this rank alone (it names the first failed rank in rank order),
            # and the run's line blames the survivor with its "connection reset" traceback
            time.sleep(1.0)
        raise
    finally:
        done.set()
        shutdown()
        sys.stdout.flush()
        sys.stderr.flush()


class _ParentFd:
    """Pickles as a duplicate of the caller's file descriptor `fd`, handed to the new process by
    multiprocessing itself (fork server and spawn alike); unpickles to the child's copy of it."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        try:
            os.fstat(self.fd)
        except OSError:  # closed in the caller: nothing to inherit
            return (type(None), ())
        return (_detach, (reduction.DupFd(self.fd),))


def _detach(dup) -> int:
    return dup.detach()


def _watchdog(done: threading.Event, timeout_s: float, rank: int, workdir: str) -> None:
    if done.wait(timeout_s):
        return
    frames = sys._current_frames()
    stacks = "\n".join(f"Thread {tid}:\n" + "".join(traceback.format_stack(f)) for tid, f in frames.items())
    _write_report(workdir, rank, f"TimeoutError: rank {rank} still running after {timeout_s:g} s", stacks)
    sys.stderr.flush()
    os._exit(124)  # no clean shutdown: the rank is stuck, possibly inside a collective


def _write_report(workdir: str, rank: int, message: str, tb: str) -> None:
    path = os.path.join(workdir, f"rank{rank}.json")
    if not os.path.exists(path):  # the first report of a rank is its root cause
        # whole or absent: the agent stops the other ranks once one fails, maybe mid-write, and the
        # launcher read an empty file (a JSONDecodeError in place of the run's failure line)
        part = f"{path}.{os.getpid()}.part"
        try:
            with open(part, "w") as f:
                json.dump({"rank": rank, "time": time.time(), "message": message, "traceback": tb}, f)
            os.replace(part, path)
        except FileNotFoundError:  # the launcher already ended (Ctrl-C) and removed its folder: no one reads it
            pass


# Errors a rank raises because a peer died first: the peer, not this rank, is the root cause.
_PEER_LOSS = re.compile(r"connection (closed|reset)|broken pipe|peer|DistNetworkError|recv.*0 bytes", re.I)


def _failure(e, workdir: str, nproc: int = 0) -> Exception:
    reports = {}
    for name in os.listdir(workdir):  # every rank that raised, also those stopped before the agent saw it
        if re.fullmatch(r"rank\d+\.json", name):
            try:
                with open(os.path.join(workdir, name)) as f:
                    rep = json.load(f)
            except (OSError, ValueError):  # not whole: that rank counts as one that recorded no error
                continue
            reports[rep["rank"]] = rep
    for r, failure in e.failures.items():
        if r not in reports:  # died before or outside `entry` (import error, signal, os._exit): no Python error
            how = (f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}")
            reports[r] = {"time": float("inf"), "traceback": "",
                          "message": f"process ended with {how} and recorded no Python error (whatever it printed is above)"}
    root = min(reports, key=lambda r: (bool(_PEER_LOSS.search(reports[r]["message"])), reports[r]["time"], r))
    # the same error on several ranks (a bad config, say) is reported for the lowest of them
    root = min(r for r in reports if reports[r]["message"] == reports[root]["message"])
    msg = reports[root]["message"].strip().splitlines()[0] if reports[root]["message"].strip() else "failed"
    done = {r for r in range(nproc) if os.path.exists(os.path.join(workdir, f"rank{r}.done"))}
    silent = sorted(r for r in range(nproc) if r != root and r not in done and not (reports.get(r) or {}).get("traceback"))
    if "did not complete within parallel.timeout_s" in msg and silent:
        # the rank that timed out is the one that waited: the one it waited for raised nothing, and
        # was still running when the agent stopped it (a hang named only the healthy rank)
        msg += f"; rank(s) {', '.join(map(str, silent))} raised no error and were still running: look there first"
    if msg.startswith("UserError: "):
        return UserError(f"rank {root}: {msg[len('UserError: '):]}")
    return SpawnError(root, msg, {r: rep["traceback"] for r, rep in reports.items()},
                      {r: f.exitcode for r, f in e.failures.items()})


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loopback_env(env) -> None:
    """Keep a local run's traffic on loopback (gloo otherwise picks the interface of the hostname)."""
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")


@contextmanager
def _quiet_elastic():
    """Silence torchelastic's multi-line logs: SpawnError already says which rank failed and why."""
    import logging

    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing", "torchelastic")
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.startswith(prefixes)]
    loggers += [logging.getLogger(p) for p in prefixes]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, old):
            lg.setLevel(level)


@contextmanager
def _own_signals():
    """The elastic agent installs signal handlers for good; put the caller's back afterwards, and turn
    its SignalException for Ctrl-C back into KeyboardInterrupt."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT]
    main = threading.current_thread() is threading.main_thread()
    saved = [signal.getsignal(s) for s in sigs] if main else []
    try:
        yield
    except SignalException as e:
        if e.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        if e.sigval == signal.SIGTERM:  # the agent ended the workers with it: one line, not its stack
            raise Stopped(signal.Signals(e.sigval).name) from None
        raise
    finally:
        for s, h in zip(sigs, saved):
            signal.signal(s, h)


@contextmanager
def _tempdir(path: str):
    """Point tempfile at the run's folder: torch.multiprocessing leaves error-file pickles behind in
    the temp dir when a worker fails, and this folder is deleted afterwards."""
    old = tempfile.tempdir
    tempfile.tempdir = path
    try:
        yield
    finally:
        tempfile.tempdir = old
