"""A graceful stop on SIGTERM: what a scheduler sends before it takes the machines back (SLURM at
the time limit or on preemption, with `--signal=TERM@120` for a head start; Kubernetes; torchrun's
and plait's own launcher when they are stopped).

The signal only sets a flag. At the end of each step every rank's flag is combined (one all-reduce
of one number, max), so all ranks see the request at the same step even if it reached them at
different moments - a rank cannot stop alone, its peers would wait for it in the next collective.
They then save a checkpoint of that step and leave the loop together; the run reports where to
continue. The default action of SIGTERM (end at once, losing everything since the last checkpoint)
is restored when training ends.
"""

from __future__ import annotations

import signal
import threading

import torch

STOP = signal.SIGTERM


class StopRequest:
    def __init__(self):
        self.got = 0  # the signal number received here, 0 if none
        self.old = None
        if threading.current_thread() is threading.main_thread():  # handlers live in the main thread
            self.old = signal.signal(STOP, self._handler)

    def _handler(self, signum, frame) -> None:
        self.got = signum

    def agreed(self, comm, device) -> str | None:
        """The stopping signal's name once any rank has received it, on every rank at the same step."""
        got = self.got
        if comm is not None:
            flag = torch.tensor([float(got)], device=device)
            comm.all_reduce(flag, "world", op="max")
            got = int(flag.item())
        return signal.Signals(got).name if got else None

    def close(self) -> None:
        if self.old is not None:
            signal.signal(STOP, self.old)
            self.old = None
