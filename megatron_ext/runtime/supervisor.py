"""A torchrun run watched from outside its session: ``supervise(TORCHRUN_ARGS)`` is what
``megatron-ext train`` / ``profile`` and ``scripts/run_local.sh`` run their ranks with.

torchrun (``runtime/torchrun.py``: a rank that fails is named in one line) starts in a session of
its own, so a terminal's Ctrl-C reaches it once, from here, and not also every rank (each would
print a KeyboardInterrupt traceback). Here:

- the first stop signal (``lifetime.STOP_SIGNALS``) is passed on as SIGTERM, which the ranks end
  on quietly, or save on first (ours under --save, Megatron's under --exit-signal-handler); a
  second says the run is stopping; a third kills the run now;
- the ranks' stderr is relayed up to the first ``megatron-ext: error:`` line (what follows is the
  run being torn down);
- when torchrun is gone, whatever is left of the run is killed: its process group, and every
  process whose environment holds the run's id (``RUN_ID_ENV``; the ranks' own children);
- the end is one line: ``megatron-ext: stopped by SIGINT`` (status 128 + the signal), or the
  line naming the failed rank (status 1, or 2 for bad input that rank reported).

``python -m megatron_ext.runtime.supervisor TORCHRUN_ARGS`` runs it from a shell.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid

from megatron_ext.lifetime import STOP_SIGNALS, exit_text

_PIPE_GRACE_S = 5.0  # how long the ranks' last lines are read after torchrun exits
RUN_ID_ENV = "MEGATRON_EXT_RUN_ID"  # in the environment of every process of a run (``kill_leftovers``)


def supervise(torchrun_args: list[str], env: dict[str, str] | None = None, capture: bool = False):
    """Run ``torchrun TORCHRUN_ARGS`` (the module doc). Returns the exit status, 0 or 2 (bad input a
    rank reported; with ``capture``, a CompletedProcess holding the ranks' stdout); a run that dies
    (status 1) or is stopped (128 + the signal) raises SystemExit after its one line."""
    env = dict(os.environ if env is None else env)
    env[RUN_ID_ENV] = uuid.uuid4().hex
    # A rank stopped or killed leaves its planner's semaphores to multiprocessing's resource
    # tracker, whose warning about them would follow the run's last line.
    env["PYTHONWARNINGS"] = ",".join(filter(None, [env.get("PYTHONWARNINGS"), "ignore:resource_tracker:UserWarning"]))
    # torchrun keeps per-rank log folders (empty: it does not redirect the ranks' output here) and
    # never removes them: given a folder of the run's own, they go with it. (Not the run's own TMPDIR:
    # multiprocessing's sockets live there, and a deeper path can pass AF_UNIX's 108 bytes.)
    logs = tempfile.mkdtemp(prefix="megatron-ext-torchrun-")
    cmd = [sys.executable, "-m", "megatron_ext.runtime.torchrun", f"--log-dir={logs}", *torchrun_args]
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


def main(argv: list[str] | None = None) -> int:
    try:
        return supervise(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return int(e.code)


if __name__ == "__main__":
    sys.exit(main())
