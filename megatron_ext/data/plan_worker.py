"""The planner process of the planning data loader (started with the ``spawn`` context).

Kept apart from ``loader.py`` so the child imports only numpy, highspy and the planner modules:
no torch, no torch.distributed, no megatron-core. It receives ``(step, lengths)`` tasks, answers
``("ok", step, StepPlan)`` or ``("error", step, message)`` on its end of a one-way pipe, and skips a task whose step the
trainer has already passed (it ran that step on a fallback plan).
"""
from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import time

from megatron_ext.lifetime import die_with_parent


def worker_main(planner: str, cost, options, baselines: tuple[str, ...], tasks, results, floor,
                imports: tuple[str, ...] = (), delay_s: float = 0.0) -> None:
    """Loop until a ``None`` task. ``floor`` is a shared integer: tasks for steps below it are
    stale. ``imports`` are modules to import first (e.g. ones that register extra planners);
    ``delay_s`` makes every plan that much later (tests and demos of the fallback path)."""
    # The trainer stops this process (a None task, else terminate), unless it is killed outright:
    # then this one goes too, not to plan for no one and hold the trainer's pipes (its stderr is
    # the launcher's) open. Ctrl-C is the trainer's to handle, not a traceback here, and so is
    # Slurm's warning before the time limit (SIGUSR1 reaches every process of the job step; its
    # default action would kill this one), and a closed terminal's SIGHUP.
    die_with_parent(signal.SIGKILL, multiprocessing.parent_process().pid)
    for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    # Below the trainer in CPU priority: planning a step ahead must use idle cycles, not take them
    # from training (it has the whole step to finish, and a fallback if it does not).
    os.nice(10)
    try:
        for name in imports:
            importlib.import_module(name)
        from megatron_ext.planner import make_plan
    except BaseException as e:  # report, then die: the loader falls back for every step
        results.send(("dead", -1, f"{type(e).__name__}: {e}"))
        raise
    results.send(("ready", -1, os.getpid()))
    while True:
        task = tasks.get()
        if task is None:
            return
        step, lengths = task
        if step < floor.value:
            results.send(("skipped", step, None))
            continue
        if delay_s:
            time.sleep(delay_s)
        try:
            plan = make_plan(planner, lengths, cost, options, baselines)
        except Exception as e:  # noqa: BLE001 -- every planner error goes back to the trainer
            results.send(("error", step, f"{type(e).__name__}: {e}"))
        else:
            results.send(("ok", step, plan))
