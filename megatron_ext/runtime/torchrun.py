"""torchrun as the ``megatron-ext`` launcher runs it: ``python -m megatron_ext.runtime.torchrun
ARGS`` is ``torchrun ARGS`` (torch.distributed.run, its failure detection: with no restarts, the
first rank to fail stops the others), except that

- it receives SIGTERM when its parent (the launcher) exits, and then stops the ranks;
- when a rank fails it prints one line naming the rank that stopped the run (``root_cause``),
  e.g. ``megatron-ext: error: rank 0 died (signal 9 SIGKILL); the run stopped``, in place
  of torchrun's traceback and failure table, and exits 2 if that rank exited with status 2 (bad
  input, which it reported itself), else 1;
- stopped by SIGTERM or SIGINT (which torchrun passes on to the ranks) it exits 128 + the
  signal without a word: the launcher that sent it says so;
- torchrun's own log lines are off: they would repeat those lines.
"""
from __future__ import annotations

import logging
import signal
import sys

from megatron_ext.lifetime import die_with_parent, exit_text


def root_cause(failures: dict) -> tuple:
    """The rank (and its ProcessFailure) that stopped the run: the first torchrun saw fail, unless
    it was slow to look and saw several fail in the same second: then one killed by a signal other
    than the SIGTERM torchrun stops ranks with (the others' collectives broke on its death)."""
    first = min(f.timestamp for f in failures.values())
    together = [r for r, f in failures.items() if f.timestamp == first]  # in the order torchrun saw them
    rank = next((r for r in together if failures[r].exitcode < 0 and failures[r].exitcode != -signal.SIGTERM),
                together[0])
    return rank, failures[rank]


def main(argv: list[str] | None = None) -> int:
    die_with_parent(signal.SIGTERM)
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.disable(logging.ERROR)
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except SignalException as e:
        return 128 + e.sigval
    except ChildFailedError as e:
        rank, failure = root_cause(e.failures)
        print(f"megatron-ext: error: rank {rank} {exit_text(failure.exitcode)}; the run stopped", file=sys.stderr,
              flush=True)
        return 2 if failure.exitcode == 2 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
