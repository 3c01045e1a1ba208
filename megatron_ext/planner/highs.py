"""The one place a HiGHS solver is made: silent, single-threaded, banner kept off stdout."""

from __future__ import annotations

import os
import sys

import highspy


def _swallow_banner() -> None:
    # HiGHS >= 1.16 prints a banner on stdout when a process builds its first solver, before any
    # option can silence it; that would break `--json` output. It prints once per process, so
    # build the first solver here, at import time, with file descriptor 1 on /dev/null.
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


_swallow_banner()


def new_highs(time_limit: float | None = None) -> highspy.Highs:
    """A HiGHS instance with no output, one thread and an optional time limit in seconds (kept:
    no heuristic that ignores it)."""
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    if time_limit is not None:
        h.setOptionValue("time_limit", float(time_limit))
        # the feasibility jump heuristic runs to its end whatever the limit: a recompute ILP given
        # 0.07 s ran 0.3-0.5 s in it (and our solves start from a feasible point anyway)
        h.setOptionValue("mip_heuristic_run_feasibility_jump", False)
    return h
