"""How the processes of a run end: each with its parent, and quietly when asked to stop.

A run is a tree: the launcher (``megatron-ext train``), torchrun under it, the ranks under
torchrun, rank 0's planner process under rank 0. A process whose parent is gone (killed, crashed)
must neither train on nor hold its parent's pipes open (the launcher reads the ranks' stderr to
its end), so each dies with its parent: by Linux's parent-death signal, or elsewhere by a thread
that watches the parent's pid. Imports nothing of torch: the planner process uses it.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from typing import NoReturn

# What stops a run: a kill, Ctrl-C, a closed terminal, Slurm's warning before the time limit
# (``--signal=USR1@SECONDS``, sent to every process of the job step unless ``B:`` is given).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_WATCH_S = 1.0  # how often the fallback watch looks at the parent's pid


def die_with_parent(sig: int, parent_pid: int | None = None) -> None:
    """Receive ``sig`` when the parent (``parent_pid``, default the current one) exits, and now
    if it is gone already. On Linux the kernel sends it when the parent *thread* that started
    this process exits: start children from a thread that lives as long as they should."""
    parent = os.getppid() if parent_pid is None else parent_pid
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:
        threading.Thread(target=_watch_parent, args=(parent, sig), name="parent-watch", daemon=True).start()
    if os.getppid() != parent:  # it exited before the signal was armed
        os.kill(os.getpid(), sig)


def _watch_parent(parent: int, sig: int) -> None:
    while os.getppid() == parent:
        time.sleep(_WATCH_S)
    os.kill(os.getpid(), sig)


def ignore(signum, frame) -> None:
    """A handler that does nothing: what a process sets on a signal it has had enough of. Not
    SIG_IGN: a signal that arrived as the handler was changed would raise OSError ("ignored due
    to race condition") in the main thread, wherever it is."""


@contextlib.contextmanager
def blocked_in_children(*signals: int):
    """Processes started in the block never receive ``signals`` (they start with them blocked, as
    a mask survives exec and Python leaves it; a handler would not: it is reset to the default,
    which for SIGUSR1 and SIGHUP ends the process). This thread gets any of them that arrived
    meanwhile when the block ends. For multiprocessing's processes: its resource tracker, started
    here if it is not running, is one of them."""
    from multiprocessing import resource_tracker

    saved = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    # (starting the tracker, multiprocessing unblocks SIGINT and SIGTERM after it: they would reach
    # the processes started next)
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, saved)


@contextlib.contextmanager
def main_module_hidden():
    """Processes spawned in the block do not import this process's ``__main__`` module again
    (multiprocessing's spawn imports it, as ``__mp_main__``, by its module name or file, to find
    what it defines: a target defined in a proper module needs none of it, and a training
    script's imports are torch and megatron)."""
    main = sys.modules["__main__"]
    saved = {k: getattr(main, k) for k in ("__spec__", "__file__") if hasattr(main, k)}
    if "__file__" in saved:
        del main.__file__
    main.__spec__ = None  # (spawn reads it: it must be there)
    try:
        yield
    finally:
        if "__spec__" not in saved:
            del main.__spec__
        for k, v in saved.items():
            setattr(main, k, v)


def exit_quietly_on_stop_signals() -> None:
    """A stop signal (``STOP_SIGNALS``) ends this process as ``SystemExit(128 + signal)``: its
    ``finally`` blocks and context managers run, and nothing is printed (Python's KeyboardInterrupt
    would print a traceback from every rank). Main thread only, as every signal handler."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)


def exit_process(code: int) -> NoReturn:
    """End this process with ``code`` as the interpreter would (non-daemon threads joined, exit
    handlers run, output flushed) but without the teardown of every module and object after:
    torch's and megatron-core's took each of a 4-rank CPU run's ranks 1.3-3 s after its work was
    done, 3 s of a 23 s ``train`` launch on 2 cores. For ``__main__`` blocks only."""
    threading._shutdown()  # (what the interpreter does first at exit)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # (a reader gone, a stream closed)
            stream.flush()
    os._exit(code)


def exit_text(code: int) -> str:
    """How a process ended, from its exit code as ``subprocess`` gives it: "died (signal 9
    SIGKILL)" for -9 and for 128 + 9 (a process that exits on the signal, as the shell reports
    it), else "failed (exit status 1)"."""
    signum = -code if code < 0 else code - 128
    try:
        return f"died (signal {signum} {signal.Signals(signum).name})"
    except ValueError:  # not a signal's number
        return f"failed (exit status {code})"


RANK_ERROR_WAIT_S = 1.0  # how long a rank other than 0 leaves rank 0 to say an error they share


def say_rank_error(error, rank: int) -> int:
    """Print a rank's bad-input error (``megatron-ext: error: ...``) once for the run and return
    the exit status 2. Ranks on the same input raise the same error together, and torchrun stops
    the others when the first exits: a rank other than 0 waits a moment, in which rank 0 says it
    and the run is stopped, and says it only if it is still running (the error was its own)."""
    if rank != 0:
        time.sleep(RANK_ERROR_WAIT_S)
    print(f"megatron-ext: error: {error}", file=sys.stderr, flush=True)
    return 2
