"""Runs a command's ranks: ``megatron-ext train`` and ``profile`` start one process per rank of the
cluster with torchrun (``runtime/torchrun.py``), on this machine.

``torchrun(module, rest)`` refuses what cannot run before anything starts (the module's
``build_parser`` parses the options, its ``check_before_launch`` checks them and gives the cost
model, whose GPU count is the rank count; too many CPU ranks for this machine, or ranks whose
model states, its ``rank_model_states_mb``, overflow its memory, are refused too),
then runs ``python -m module`` on every rank under ``runtime/supervisor.py``: it relays the ranks'
stderr and passes a stop signal (``lifetime.STOP_SIGNALS``) on to every rank as SIGTERM: the first
one; a third kills the run.
"""
from __future__ import annotations

import argparse
import importlib
import os

from megatron_ext.commands.args import note_unused_ring
from megatron_ext.errors import ConfigError
from megatron_ext.runtime.supervisor import supervise
from megatron_ext.text import plural

# CPU ranks a machine runs well: more than this many a core, or than fit in its free memory at
# CPU_RANK_MB each plus the model states a rank holds, and a run crawls or swaps (64 ranks of a GPU
# preset on 2 cores swap the machine; 4 ranks of gpt-7b ran 95 s, then one was killed out of memory).
CPU_RANKS_PER_CORE = 4
CPU_RANK_MB = 512  # a rank training the tiny model holds ~440 MB resident (torch, megatron-core, gloo)
EXIT_STATUS = """exit status: 0 done; 2 bad input (one line says what); 1 a rank or torchrun died or failed (one line
names it, and every other process of the run is stopped); 128+N stopped by signal N (SIGTERM: 143,
SIGINT: 130), which is passed on to every rank"""


def with_launcher_help(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A command's ranks' parser with the launcher's option and exit status, for its --help (the
    launcher takes --allow-oversubscribe before the ranks parse the rest)."""
    parser.add_argument_group("launcher").add_argument(
        "--allow-oversubscribe", action="store_true",
        help=f"start the ranks even where there are more than this machine runs well (CPU ranks: over "
             f"{CPU_RANKS_PER_CORE} a core, or over its free memory at {CPU_RANK_MB} MB each plus the model states a "
             f"rank holds)")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # (the exit status's lines as written)
    parser.epilog = EXIT_STATUS
    return parser


def torchrun(module: str, rest: list[str], capture: bool = False):
    """Run ``module`` (``megatron_ext.commands.train`` or ``.profile``) on one process per rank of
    the cluster with torchrun (``runtime/supervisor.py``), relaying the ranks' stderr. Returns the
    exit status: 0, or 2 for bad input a rank reported (with ``capture``, a CompletedProcess
    holding the ranks' stdout). A run that dies (a rank or torchrun: status 1) or is stopped
    (SIGTERM or SIGINT: 128 + the signal) ends the command here, with one line."""
    from megatron_ext.runtime.device import choose_device

    oversubscribe = "--allow-oversubscribe" in rest  # the launcher's option, not the ranks'
    rest = [a for a in rest if a != "--allow-oversubscribe"]
    ranks = importlib.import_module(module)
    parser = ranks.build_parser()
    targs, unknown = parser.parse_known_args(rest)
    if unknown:
        raise ConfigError(f"unknown option(s): {' '.join(unknown)} (see {parser.prog} --help)")
    cost = ranks.check_before_launch(targs)
    note_unused_ring(cost)  # (once a command: train --compare launches a run per planner)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if choose_device(targs.device, cost.num_gpus) == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # megatron runs on CPU ranks only where CUDA is absent (runtime/compat)
        if not oversubscribe:
            _check_cpu_ranks_fit(cost.num_gpus, cost.cluster.name, cost.model.name,
                                 ranks.rank_model_states_mb(targs, cost))
    return supervise(["--standalone", f"--nproc-per-node={cost.num_gpus}", "-m", module, *rest], env, capture)


def _check_cpu_ranks_fit(ranks: int, cluster: str, model: str, states_mb: float) -> None:
    """Refuse, in one line before anything starts, more CPU ranks than this machine runs well:
    over CPU_RANKS_PER_CORE a core (of those this process may use), or over its free memory at
    CPU_RANK_MB a rank, or at that plus ``states_mb``, the states of ``model`` a rank holds."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    free_mb = _free_memory_mb()
    if ranks > CPU_RANKS_PER_CORE * cores:
        why = (f"are over the {CPU_RANKS_PER_CORE * cores} this machine runs well ({CPU_RANKS_PER_CORE} a core, "
               f"{plural(cores, 'core')})")
    elif free_mb is not None and ranks * CPU_RANK_MB > free_mb:
        why = f"need about {ranks * CPU_RANK_MB / 1024:.1f} GB of memory, over the {free_mb / 1024:.1f} GB free"
    elif free_mb is not None and ranks * (CPU_RANK_MB + states_mb) > free_mb:
        raise ConfigError(f"{ranks} CPU ranks of {model} need about {ranks * (CPU_RANK_MB + states_mb) / 1024:,.1f} GB "
                          f"of memory ({states_mb / 1024:,.1f} GB of model states a rank), over the "
                          f"{free_mb / 1024:.1f} GB free; use a smaller --model (e.g. tiny), or --allow-oversubscribe "
                          f"to start them anyway")
    else:
        return
    raise ConfigError(f"{cluster} has {ranks} GPUs: {ranks} CPU ranks {why}; use --cluster cpu-4, or "
                      f"--allow-oversubscribe to start them anyway")


def _free_memory_mb() -> float | None:
    """MemAvailable of /proc/meminfo (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None
