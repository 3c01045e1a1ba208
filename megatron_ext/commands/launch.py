"""Runs a command's ranks: ``megatron-ext train`` and ``profile`` start one process per rank of the
cluster with torchrun (``runtime/torchrun.py``), on this machine.

``torchrun(module, rest)`` refuses what cannot run before anything starts (the module's
``build_parser`` parses the options, its ``check_before_launch`` checks them and gives the cost
model, whose GPU count is the rank count; too many CPU ranks for this machine are refused too),
then runs ``python -m module`` on every rank, relays the ranks' stderr, and passes a stop signal
(``lifetime.STOP_SIGNALS``) on to every rank as SIGTERM: the first one; a third kills the run.
"""
from __future__ import annotations

import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid

from megatron_ext.commands.args import note_unused_ring
from megatron_ext.errors import ConfigError
from megatron_ext.lifetime import STOP_SIGNALS, exit_text
from megatron_ext.text import plural

# CPU ranks a machine runs well: more than this many a core, or than fit in its free memory at
# CPU_RANK_MB each, and a run crawls or swaps (64 ranks of a GPU preset on 2 cores swap the machine).
CPU_RANKS_PER_CORE = 4
CPU_RANK_MB = 512  # a rank training the tiny model holds ~440 MB resident (torch, megatron-core, gloo)
_PIPE_GRACE_S = 5.0  # how long the launcher reads the ranks' last lines after torchrun exits
RUN_ID_ENV = "MEGATRON_EXT_RUN_ID"  # in the environment of every process of a run (``kill_leftovers``)
LAUNCHER_HELP = f"""
launcher:
  --allow-oversubscribe
                        start the ranks even where there are more than this machine runs well
                        (CPU ranks: over {CPU_RANKS_PER_CORE} a core, or over its free memory at {CPU_RANK_MB} MB each)

exit status: 0 done; 2 bad input (one line says what); 1 a rank or torchrun died or failed (one line
names it, and every other process of the run is stopped); 128+N stopped by signal N (SIGTERM: 143,
SIGINT: 130), which is passed on to every rank"""


def torchrun(module: str, rest: list[str], capture: bool = False):
    """Run ``module`` (``megatron_ext.commands.train`` or ``.profile``) on one process per rank of
    the cluster with torchrun (``runtime/torchrun.py``), relaying the ranks' stderr. Returns the
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
    env[RUN_ID_ENV] = uuid.uuid4().hex
    if choose_device(targs.device, cost.num_gpus) == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # megatron runs on CPU ranks only where CUDA is absent (runtime/compat)
        if not oversubscribe:
            _check_cpu_ranks_fit(cost.num_gpus, cost.cluster.name)
    # A rank killed outright leaves its planner's semaphores to multiprocessing's resource tracker,
    # whose warning about them would follow the line naming the rank.
    env["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"),
                                                   "ignore:resource_tracker:UserWarning"]))
    # torchrun keeps per-rank log folders (empty: it does not redirect the ranks' output here) and
    # never removes them: given a folder of the run's own, they go with it. (Not the run's own TMPDIR:
    # multiprocessing's sockets live there, and a deeper path can pass AF_UNIX's 108 bytes.)
    logs = tempfile.mkdtemp(prefix="megatron-ext-torchrun-")
    cmd = [sys.executable, "-m", "megatron_ext.runtime.torchrun", "--standalone", f"--nproc-per-node={cost.num_gpus}",
           f"--log-dir={logs}", "-m", module, *rest]
    # The stop signals received. The first is passed on to torchrun as SIGTERM, which every process
    # of the run ends on quietly, even before it sets its handlers (SIGINT would print a
    # KeyboardInterrupt traceback from each rank still importing torch), and ranks under --save save
    # on first. A second is the same stop (as Slurm sends it to every process); a third kills the run.
    stopped: list[int] = []
    proc = None

    def pass_on(signum, frame):
        stopped.append(signum)
        if proc is None:
            return
        if len(stopped) == 1:
            proc.send_signal(signal.SIGTERM)
        elif len(stopped) == 2:
            print("megatron-ext: stopping after the ranks' step (and its save, under --save); a third signal "
                  "kills them now", file=sys.stderr, flush=True)
        else:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # (gone already)
                pass

    handlers = {sig: signal.signal(sig, pass_on) for sig in STOP_SIGNALS}
    try:
        # In a session of its own, torchrun gets a terminal's Ctrl-C once (from here, not also from the
        # terminal), and its process group can be killed whole.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        if stopped:  # (a signal before Popen returned)
            proc.send_signal(signal.SIGTERM)
        said: list[str] = []
        out: list[str] = []
        readers = [threading.Thread(target=_relay_stderr, args=(proc.stderr, said), daemon=True)]
        if capture:
            readers.append(threading.Thread(target=_read_lines, args=(proc.stdout, out), daemon=True))
        for reader in readers:
            reader.start()
        code = proc.wait()
        # A process that outlives torchrun holding the pipes (it dies with its parent, soon) is not waited for.
        for reader in readers:
            reader.join(_PIPE_GRACE_S)
    finally:
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # the usual case: nothing is left in it
                pass
            proc.wait()
            kill_leftovers(env[RUN_ID_ENV])
        shutil.rmtree(logs, ignore_errors=True)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if not stopped and code - 128 in STOP_SIGNALS:  # torchrun alone was stopped: it exits 128 + the signal
        stopped.append(code - 128)
    if stopped:
        print(f"megatron-ext: stopped by {signal.Signals(stopped[0]).name}", file=sys.stderr, flush=True)
        raise SystemExit(128 + stopped[0])
    if code and not said:  # torchrun itself died or failed before it named a rank
        print(f"megatron-ext: error: torchrun {exit_text(code)}; the run stopped", file=sys.stderr, flush=True)
    if code not in (0, 2):
        raise SystemExit(1)
    return subprocess.CompletedProcess(cmd, code, "".join(out)) if capture else code


def kill_leftovers(run_id: str) -> None:
    """Kill what is left of the run once torchrun is gone: the processes whose environment holds
    its id. The ranks die with torchrun, but not their own children: one killed outright orphans
    them (after a save, megatron-core's checkpoint writer's queue manager, which would wait on for
    ever). Linux (/proc); elsewhere nothing to read."""
    if not os.path.isdir("/proc"):
        return
    mark = f"{RUN_ID_ENV}={run_id}".encode()
    for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    os.kill(pid, signal.SIGKILL)
        except OSError:  # gone meanwhile, or another user's
            pass


def _relay_stderr(stream, said: list) -> None:
    """Copy the ranks' stderr to ours until its first "megatron-ext: error:" line (bad input a rank
    reports, or the line naming the rank that died): what follows is the ranks being torn down,
    which says nothing more. Reads to the end, so that no writer blocks."""
    for line in stream:
        if not said:
            sys.stderr.write(line)
            sys.stderr.flush()
            if line.startswith("megatron-ext: error:"):
                said.append(line)


def _read_lines(stream, lines: list) -> None:
    for line in stream:
        lines.append(line)


def _check_cpu_ranks_fit(ranks: int, cluster: str) -> None:
    """Refuse, in one line before anything starts, more CPU ranks than this machine runs well:
    over CPU_RANKS_PER_CORE a core (of those this process may use), or over its free memory at
    CPU_RANK_MB a rank."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    free_mb = _free_memory_mb()
    if ranks > CPU_RANKS_PER_CORE * cores:
        why = (f"are over the {CPU_RANKS_PER_CORE * cores} this machine runs well ({CPU_RANKS_PER_CORE} a core, "
               f"{plural(cores, 'core')})")
    elif free_mb is not None and ranks * CPU_RANK_MB > free_mb:
        why = f"need about {ranks * CPU_RANK_MB / 1024:.1f} GB of memory, over the {free_mb / 1024:.1f} GB free"
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
