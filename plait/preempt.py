"""A graceful stop on SIGUSR1: save the step every rank is at, then leave. What a scheduler's
advance notice asks for (SLURM: `#SBATCH --signal=USR1@120` signals every task two minutes before
the time limit; by hand: `kill -USR1` the launcher or any rank).

The signal only sets a flag. At the end of each step every rank's flag is combined (one all-reduce
of one number, max), so all ranks see the request at the same step even if it reached one of them
only - a rank cannot stop alone: its peers would wait for it in the next collective. They save a
checkpoint of that step and leave the loop together; the run reports where to continue.

SIGUSR1 sent to `plait train --nproc N` itself reaches the workers through a file in the launch's
folder (`STOP_FILE_ENV` names it), which each rank checks as it combines its flag.

Why not SIGTERM: launchers send SIGTERM to stop the other workers once one has failed, and a
stuck worker must then end at once (it would not reach a step's end); SIGTERM keeps that meaning.
"""

from __future__ import annotations

import os
import signal
import threading

STOP = signal.SIGUSR1
STOP_FILE_ENV = "PLAIT_STOP_FILE"


_EARLY = {"got": 0}


def catch_early() -> None:
    """Hold a SIGUSR1 that arrives before training starts (import, rendezvous, loading a checkpoint):
    its default action killed the rank silently, and its peers then waited out parallel.timeout_s.
    `StopRequest` takes it over, and the run stops at its first step's end, saved."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(STOP, lambda signum, frame: _EARLY.__setitem__("got", signum))


def stop_requested() -> bool:
    return bool(_EARLY["got"])


class StopRequest:
    def __init__(self):
        self.got = _EARLY["got"]  # the signal number received here, 0 if none (one caught early counts)
        self.file = os.environ.get(STOP_FILE_ENV)
        self.installed = threading.current_thread() is threading.main_thread()  # handlers live there
        self.old = signal.signal(STOP, self._handler) if self.installed else None

    def _handler(self, signum, frame) -> None:
        self.got = signum

    def agreed(self, comm, device) -> str | None:
        """The stopping signal's name once any rank has received it, on every rank at the same step."""
        got = self.got or (int(STOP) if self.file and os.path.exists(self.file) else 0)
        if comm is not None:
            import torch

            flag = torch.tensor([float(got)], device=device)
            comm.all_reduce(flag, "world", op="max")
            got = int(flag.item())
        return signal.Signals(got).name if got else None

    def close(self) -> None:
        if self.installed:  # the previous handler, whatever it was (None: one set outside Python)
            signal.signal(STOP, self.old if self.old is not None else signal.SIG_DFL)
            self.installed = False


def relay_to(path: str):
    """In a launcher: on SIGUSR1, create `path` (its workers stop at the end of the step they are in).
    Returns a function that puts the previous handler back."""
    def relay(signum, frame):
        open(path, "a").close()

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = signal.signal(STOP, relay)
    if _EARLY["got"]:  # a notice the launcher held since it started (`catch_early`) is passed on too:
        open(path, "a").close()  # it was lost, and the run trained to its end
    return lambda: signal.signal(STOP, old)
