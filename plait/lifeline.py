"""Workers end when their launcher does.

Killing `plait train --nproc N` (kill -9, its terminal closed) used to leave its workers running:
they trained a few steps, then waited for ever for a launcher that was gone. Now each worker of
plait's own launcher watches two things and ends itself within about a second:
  - its parent process: the fork server, which exits as soon as the launcher's end of its pipe
    closes. On Linux the kernel sends the parent-death signal (prctl PR_SET_PDEATHSIG, SIGKILL) at
    once; a thread checks `getppid()` every `interval` seconds as well (other systems, and the race
    where the parent ended before prctl ran);
  - the launcher itself (its pid), in case the fork server outlives it.
A worker that ends this way is killed, not stopped cleanly: its peers are going too, so there is no
one to finish a collective with. The same holds after Ctrl-C (`after_ctrl_c`): a worker blocked
inside a collective whose peer already left cannot run its KeyboardInterrupt, and ends itself a few
seconds later instead of when the launcher's agent kills it (30 s). Checkpoints stay valid because they only ever appear by an atomic
rename; a half-written one is left under a `.tmp-` name, which the next start removes.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


def _set_parent_death_signal(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie (ended, not yet reaped by its parent) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def watch(launcher_pid: int | None, rank: int, interval: float = 0.5) -> None:
    """Arm the parent-death signal and start the watching thread (call first thing in a worker)."""
    parent = os.getppid()
    _set_parent_death_signal(signal.SIGKILL)

    def gone() -> str | None:
        if os.getppid() != parent:
            return f"its parent process {parent} ended"
        if launcher_pid and not alive(launcher_pid):
            return f"the launcher (pid {launcher_pid}) ended"
        return None

    def loop() -> None:
        while (why := gone()) is None:
            time.sleep(interval)
        print(f"plait: rank {rank} stops: {why}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=loop, name="plait-lifeline", daemon=True).start()


def after_ctrl_c(grace_s: float = 5.0, term_line=None) -> None:
    """End this worker `grace_s` seconds after a Ctrl-C (SIGINT) if it is still running then.

    Python runs a signal's handler (here: raise KeyboardInterrupt) only when the main thread next
    runs Python code; a rank blocked in a collective's wait (NCCL's barrier, a CUDA synchronize
    behind a collective) whose peer already stopped never gets there. Measured on 4 x H200 (1b,
    ZeRO-3, Ctrl-C during a checkpoint's barrier): rank 0 left, ranks 1-3 sat in the barrier until
    the launcher's agent killed them. The signal's C-level handler writes its number to the wakeup
    fd at once, whatever the main thread is doing: a thread reading it gives the clean stop its
    grace, then exits with 130 as Ctrl-C does. Call from the main thread, after SIGINT's handler is
    set; a process that already has a wakeup fd (an event loop) is left alone.

    `term_line` (a rank torchrun or srun started): SIGTERM is its agent ending the rank - another
    rank failed (torchrun stops a node's others within milliseconds, before any collective could
    tell them), or the job is being stopped. The rank ended silently; now it says so in the line
    `term_line()` gives (where the run goes on from), then ends at once with 143, blocked in a
    collective or not: a stuck rank must still end when told."""
    import socket

    recv, send = socket.socketpair()
    send.setblocking(False)
    try:
        old = signal.set_wakeup_fd(send.fileno(), warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        return
    if old != -1:  # someone else's (an event loop): put it back
        signal.set_wakeup_fd(old)
        return

    said = threading.Lock()

    def on_term(*_) -> None:
        if said.acquire(blocking=False):  # the handler or the thread, whichever runs first
            try:
                print(term_line(), file=sys.stderr, flush=True)
            except Exception:  # noqa: BLE001 - ending is what matters
                pass
            os._exit(143)

    if term_line is not None:
        signal.signal(signal.SIGTERM, on_term)  # (installed, its C-level handler writes the wakeup fd)

    def loop() -> None:
        while True:
            got = recv.recv(64)
            if not got:
                return
            if term_line is not None and signal.SIGTERM in got:
                on_term()
            if signal.SIGINT in got:
                time.sleep(grace_s)
                os._exit(130)

    threading.Thread(target=loop, args=(), name="plait-ctrl-c", daemon=True).start()
    after_ctrl_c.sockets = (recv, send)  # kept open for the process's life
