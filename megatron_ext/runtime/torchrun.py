"""torchrun as the ``megatron-ext`` launcher runs it: ``python -m megatron_ext.runtime.torchrun
ARGS`` is ``torchrun ARGS`` (torch.distributed.run, its failure detection: with no restarts, the
first rank to fail stops the others), except that

- it receives SIGTERM when its parent (the launcher) exits, and then stops the ranks;
- a stop signal (``lifetime.STOP_SIGNALS``, and SIGQUIT) reaches the ranks as SIGTERM, once:
  later ones are ignored while torchrun gives the ranks their 30 s to finish the step and save
  (Slurm signals every process of the job step, and the launcher passes its own on; torchrun's
  own handler took each as a new stop and killed the ranks mid-save);
- when a rank fails it prints one line naming the rank that stopped the run (``root_cause``),
  e.g. ``megatron-ext: error: rank 0 died (signal 9 SIGKILL); the run stopped``, in place
  of torchrun's traceback and failure table, and exits 2 if that rank exited with status 2 (bad
  input, which it reported itself), else 1;
- stopped, it exits 128 + the (first) signal without a word: the launcher says so;
- torchrun's own log lines are off: they would repeat those lines;
- the one exception torch's rendezvous leaves at exit is not printed (``quiet_rendezvous_stop``).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

from megatron_ext.lifetime import STOP_SIGNALS, die_with_parent, exit_process, exit_text, ignore

_HANDLED = (*STOP_SIGNALS, signal.SIGQUIT)  # torchrun's own are SIGTERM, SIGINT, SIGHUP and SIGQUIT
_received: list[int] = []


def _stop_once(signum, frame):
    """torchrun's handler of a stop signal: the ranks are sent SIGTERM (torchrun passes on the
    signal its handler raises) and every later signal is ignored."""
    from torch.distributed.elastic.multiprocessing import SignalException

    for sig in _HANDLED:
        signal.signal(sig, ignore)
    _received.append(signum)
    raise SignalException(f"stopped by {signal.Signals(signum).name}", sigval=signal.SIGTERM)


def root_cause(failures: dict) -> tuple:
    """The rank (and its ProcessFailure) that stopped the run: the first torchrun saw fail, unless
    it was slow to look and saw several fail in the same second: then one killed by a signal other
    than the SIGTERM torchrun stops ranks with (the others' collectives broke on its death)."""
    first = min(f.timestamp for f in failures.values())
    together = [r for r, f in failures.items() if f.timestamp == first]  # in the order torchrun saw them
    rank = next((r for r in together if failures[r].exitcode < 0 and failures[r].exitcode != -signal.SIGTERM),
                together[0])
    return rank, failures[rank]


def quiet_rendezvous_stop(unraisable) -> None:
    """``sys.unraisablehook`` that drops one race of torch's: the rendezvous keep-alive timer is
    stopped by a weakref finalizer that joins the timer's thread, and when the collector runs it
    on that very thread (as a stopped run ends) the join raises "cannot join current thread",
    printed as a traceback after the run's last line (1 of ~50 stops). The thread is ending
    anyway; anything else goes to the default hook."""
    e = unraisable.exc_value
    frames = traceback.extract_tb(unraisable.exc_traceback) if unraisable.exc_traceback else []
    if isinstance(e, RuntimeError) and str(e) == "cannot join current thread" and \
            any(f.name == "_stop_thread" and "rendezvous" in f.filename for f in frames):
        return
    sys.__unraisablehook__(unraisable)


def main(argv: list[str] | None = None) -> int:
    die_with_parent(signal.SIGTERM)
    sys.unraisablehook = quiet_rendezvous_stop
    import torch.distributed.elastic.multiprocessing.api as processes
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.disable(logging.ERROR)
    # torchrun sets its handler (this one, so patched) on the signals it is told to handle as it
    # starts the ranks (its --signals-to-handle, copied to the variable; older versions: the variable)
    names = ",".join(signal.Signals(s).name for s in _HANDLED)
    config = parse_args(sys.argv[1:] if argv is None else argv)
    if hasattr(config, "signals_to_handle"):
        config.signals_to_handle = names
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = names
    processes._terminate_process_handler = _stop_once
    try:
        run(config)
    except SignalException as e:
        return 128 + (_received[0] if _received else e.sigval)
    except ChildFailedError as e:
        rank, failure = root_cause(e.failures)
        print(f"megatron-ext: error: rank {rank} {exit_text(failure.exitcode)}; the run stopped", file=sys.stderr,
              flush=True)
        return 2 if failure.exitcode == 2 else 1
    return 0


if __name__ == "__main__":
    exit_process(main())
