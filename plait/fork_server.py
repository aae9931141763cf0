"""plait's fork server: the process that imports torch once and forks every worker of a launch.

`start` sets what it preloads and starts it (Ctrl-C ignored until it is up, its end registered at
exit); `kill` ends it at once on Ctrl-C. Kept apart from `plait.launch` because each quirk here is a
detail of multiprocessing's server, not of starting a run.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager


def start(preload: list[str]) -> None:
    """Preload `preload` (torch and plait's modules: each worker then starts in milliseconds) and
    start the server if it is not running."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(list(dict.fromkeys(preload)))
    # the resource tracker (started with the server, and given this environment) counts the
    # semaphores of workers that Ctrl-C or a failure ended, and warned about them under the run's
    # one line; it cleans them up either way
    quiet = "ignore::UserWarning:multiprocessing.resource_tracker"
    if quiet not in os.environ.get("PYTHONWARNINGS", ""):
        os.environ["PYTHONWARNINGS"] = ",".join(x for x in (os.environ.get("PYTHONWARNINGS"), quiet) if x)
    with _sigint_ignored():
        forkserver.ensure_running()
    _reap_at_exit()


@contextmanager
def _sigint_ignored():
    """Ignore Ctrl-C while the fork server starts. It runs in this process group, so Ctrl-C reaches it
    too, and it only ignores SIGINT once its preload (torch: seconds, tens on a busy machine) is
    imported: a Ctrl-C before that printed its KeyboardInterrupt traceback under the run's one line.
    An ignored signal stays ignored across fork and exec, so it ignores SIGINT from its first
    instruction; the workers it forks take SIGINT back (`plait.launch._worker`), and this process handles it again
    as soon as the server is started (milliseconds: it does not wait for the preload)."""
    if threading.current_thread() is not threading.main_thread():  # signal() works in the main thread only
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def kill() -> None:
    """End the fork server at once on Ctrl-C. Asked to stop (at exit), it first finishes importing its
    preload, then may still fork a worker asked for before the Ctrl-C, whose parent's semaphores are
    gone by then: the run's one line got a worker's FileNotFoundError traceback under it, and the
    launcher waited for the preload to end. Workers already started are the agent's to end."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid:
        _quietly(lambda: os.kill(pid, signal.SIGKILL))
        _quietly(server._stop)  # reaps it; a later spawn in this process starts a new one


_REAP_REGISTERED = False


def _reap_at_exit() -> None:
    """Stop and wait for the fork server when this process exits, so that it does not outlive us as
    a zombie waiting for an init process that may never reap it."""
    global _REAP_REGISTERED
    if _REAP_REGISTERED:
        return
    import atexit
    from multiprocessing import forkserver

    stop = getattr(getattr(forkserver, "_forkserver", None), "_stop", None)
    if stop is not None:
        atexit.register(lambda: _quietly(stop))
        _REAP_REGISTERED = True


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # already stopped, or a Python whose private API differs: nothing to reap
        pass
    except KeyboardInterrupt:  # Ctrl-C while exiting: the server goes with this process's group
        pass
