"""What clusters do to runs, done to `megatron-ext train` on 4 CPU ranks once its first step is
out: rank 0 (which holds the planner process) killed, another rank killed, the planner process
killed, the launcher sent SIGTERM. A run that cannot go on ends within 30 s with one line saying
why and the documented exit status; one that can (the planner's death) trains to its end on
fallback plans. Either way no process of the run is left: the launcher's process tree is taken
before the blow, and after it neither those processes nor any whose command line holds the run's
unique --run-dir may live on, and nothing of the run's stays in its TMPDIR. Too many ranks for the
machine are refused before launching."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc")

CLI = [sys.executable, "-m", "megatron_ext.commands.cli"]
FIRST_STEP_S = 300  # starting 4 ranks on a loaded 2-core machine can take minutes
ENDS_WITHIN_S = 30  # from the blow to the launcher's exit, and to the last process of the run gone


@dataclass(frozen=True)
class Proc:
    pid: int
    start: int  # clock ticks after boot: with the pid, which process this is (pids are reused)
    ppid: int = field(compare=False)  # (an orphan's changes)
    cmdline: str = field(compare=False)


def _proc(pid: int) -> Proc | None:
    """The process ``pid`` unless it is gone or a zombie (dead, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)", which may hold spaces
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    if fields[0] in "ZX":
        return None
    return Proc(pid, int(fields[19]), int(fields[1]), cmdline)


def _processes() -> list[Proc]:
    return [p for p in map(_proc, (int(d) for d in os.listdir("/proc") if d.isdigit())) if p is not None]


def _environ(pid: int) -> dict[bytes, bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:  # gone meanwhile
        return {}


def _has_taken(p: Proc, sig: int) -> bool:
    """Whether ``p`` has taken ``sig`` sent to it: no longer pending, or ``p`` is gone; a process
    that blocks it (the planner process, SIGUSR1) keeps it pending and counts as having taken it."""
    try:
        with open(f"/proc/{p.pid}/status") as f:
            masks = {k: int(v, 16) for k, v in (line.split(":", 1) for line in f)
                     if k in ("SigPnd", "ShdPnd", "SigBlk")}
    except (FileNotFoundError, ProcessLookupError):
        return True
    bit = 1 << (sig - 1)
    return _proc(p.pid) != p or not (masks["SigPnd"] | masks["ShdPnd"]) & bit or bool(masks["SigBlk"] & bit)


def _rank(pid: int) -> int | None:
    env = _environ(pid)
    return int(env[b"RANK"]) if b"RANK" in env else None


class Run:
    """``megatron-ext train`` with a unique --run-dir and a unique marker in its environment (which
    every process of the run inherits), its stdout and stderr read as they come."""

    def __init__(self, tmp_path, steps: int, *extra: str):
        self.marker = str(tmp_path / f"faults-{uuid.uuid4().hex}")
        self.tmp = tmp_path / "tmp"  # the run's TMPDIR
        self.tmp.mkdir()
        self.proc = subprocess.Popen([*CLI, "train", "--steps", str(steps), "--global-batch", "4", "--max-seq-len",
                                      "1024", "--run-dir", self.marker, *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, TMPDIR=str(self.tmp), FAULTS_RUN=self.marker))
        self.out: list[str] = []
        self.err: list[str] = []
        self.stepped = threading.Event()
        self.saved = threading.Event()
        self.readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
                        threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True)]
        for r in self.readers:
            r.start()

    def _read(self, stream, lines: list) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))
            if line.startswith("step "):
                self.stepped.set()
            if line.startswith("saved step "):
                self.saved.set()

    def tree(self) -> dict[str, Proc]:
        """The run's processes by role, once its first step is out: "launcher", "torchrun", "rank
        0".."rank 3", "planner" (rank 0's), and the rest by pid (e.g. the resource tracker)."""
        assert self.stepped.wait(FIRST_STEP_S), f"no step within {FIRST_STEP_S} s:\n" + "\n".join(self.err[-30:])
        procs = _processes()
        tree = {"launcher": next(p for p in procs if p.pid == self.proc.pid)}
        parents = [tree["launcher"]]
        while parents:
            children = [p for p in procs if p.ppid in {q.pid for q in parents}]
            for p in children:
                if "megatron_ext.runtime.torchrun" in p.cmdline:
                    tree["torchrun"] = p
                elif "megatron_ext.commands.train" in p.cmdline:
                    tree[f"rank {_rank(p.pid)}"] = p
                elif "spawn_main" in p.cmdline and "rank 0" in tree and p.ppid == tree["rank 0"].pid:
                    tree["planner"] = p
                else:
                    tree[str(p.pid)] = p
            parents = children
        assert {"torchrun", "rank 0", "rank 1", "rank 2", "rank 3", "planner"} <= set(tree), tree
        return tree

    def ended(self, since: float, within: float = ENDS_WITHIN_S) -> tuple[int, float]:
        """The launcher's exit status and its seconds since ``since`` (failing past ``within``)."""
        try:
            code = self.proc.wait(timeout=max(since + within - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"still running {within} s after the blow:\n" + "\n".join(self.err[-30:])) from None
        took = time.monotonic() - since
        for r in self.readers:
            r.join(5)
        return code, took

    def assert_nothing_left(self, tree: dict[str, Proc], by: float) -> None:
        """No process of ``tree`` and none naming the run's --run-dir or holding its marker in its
        environment lives at time ``by`` (polled: the last of them may be on its way out as the
        launcher returns)."""
        mark = self.marker.encode()

        def left():
            mine = [p for p in tree.values() if _proc(p.pid) == p]
            return mine + [p for p in _processes() if p not in mine and
                           (self.marker in p.cmdline or _environ(p.pid).get(b"FAULTS_RUN") == mark)]

        while left() and time.monotonic() < by:
            time.sleep(0.2)
        assert not left(), left()
        # nor torchrun's log folders in its TMPDIR (one was left a run); torch's compile cache may
        # stay, and multiprocessing's folders of processes killed outright (Python's, not the run's)
        kept = [n for n in os.listdir(self.tmp) if not n.startswith(("torchinductor_", "pymp-"))]
        assert not kept, kept

    def stderr_says(self, line: str) -> None:
        """``line`` ends stderr and is its only "megatron-ext:" line, with no traceback anywhere."""
        text = "\n".join(self.err)
        assert self.err and self.err[-1] == line, text[-3000:]
        assert [e for e in self.err if e.startswith("megatron-ext:")] == [line], text[-3000:]
        assert "Traceback" not in text, text[-3000:]


@pytest.mark.parametrize("rank, save", [(0, False), (2, True)])
def test_a_killed_rank_ends_the_run_naming_it(tmp_path, rank, save):
    """Rank 0's planner process outlived it and held the launcher's stderr open: the run hung.
    Killed after a save, a rank orphaned its checkpoint writer's queue manager, and under --save
    the others printed the tracebacks of their broken collectives."""
    run = Run(tmp_path, 50, *(["--save", str(tmp_path / "ckpt"), "--save-interval", "1"] if save else []))
    tree = run.tree()
    assert not save or run.saved.wait(FIRST_STEP_S), "\n".join(run.err[-30:])
    blow = time.monotonic()
    os.kill(tree[f"rank {rank}"].pid, signal.SIGKILL)
    code, took = run.ended(blow)
    print(f"rank {rank} killed: the launcher exited {took:.1f} s later")
    assert code == 1
    run.stderr_says(f"megatron-ext: error: rank {rank} died (signal 9 SIGKILL); the run stopped")
    run.assert_nothing_left(tree, blow + ENDS_WITHIN_S)


def test_a_killed_planner_leaves_the_run_on_fallback_plans(tmp_path):
    run = Run(tmp_path, steps=12)
    tree = run.tree()
    blow = time.monotonic()
    os.kill(tree["planner"].pid, signal.SIGKILL)
    code, took = run.ended(blow, within=FIRST_STEP_S)
    assert code == 0, "\n".join(run.err[-30:])
    steps = [line for line in run.out if line.startswith("step ")]
    assert len(steps) == 12 and steps[-1].endswith("[fallback]"), run.out
    assert any("the planner process exited (code -9); every further step uses the batchada fallback plan" in line
               for line in run.err), run.err
    assert "Traceback" not in "\n".join(run.err)
    run.assert_nothing_left(tree, time.monotonic() + ENDS_WITHIN_S)


@pytest.mark.parametrize("save", [False, True])
def test_sigterm_stops_the_run_quietly(tmp_path, save):
    """The launcher passes it to torchrun, which passes it to the ranks: each ends quietly. Under
    --save (as Slurm's signal before the time limit) the step running ends first and is saved, so
    a requeued run resumes after it."""
    ckpt = tmp_path / "ckpt"
    run = Run(tmp_path, 50, *(["--save", str(ckpt), "--save-interval", "1000"] if save else []))
    tree = run.tree()
    blow = time.monotonic()
    os.kill(run.proc.pid, signal.SIGTERM)
    code, took = run.ended(blow)
    print(f"launcher sent SIGTERM{' under --save' if save else ''}: it exited {took:.1f} s later")
    assert code == 128 + signal.SIGTERM
    run.stderr_says("megatron-ext: stopped by SIGTERM")
    if save:
        saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
        steps = [line for line in run.out if line.startswith("step ")]
        assert saved == len(steps) >= 1 and f"saved step {saved} to" in "\n".join(run.err), (saved, steps)
    run.assert_nothing_left(tree, blow + ENDS_WITHIN_S)


def test_a_stop_signal_to_every_process_twice_still_saves(tmp_path):
    """Slurm's ``--signal=USR1`` (without ``B:``) reaches every process of the job step at once,
    and here a SIGTERM follows to torchrun: every process takes the first stop it gets, and the
    later ones are the same stop (torchrun took each as a new one and killed the ranks mid-save).
    After a save on the interval: megatron-core's checkpoint writer had started its queue's
    Manager process at that save, the signal ended it, and the save on the stop failed unsaid."""
    ckpt = tmp_path / "ckpt"
    run = Run(tmp_path, 50, "--save", str(ckpt), "--save-interval", "2")
    tree = run.tree()
    assert run.saved.wait(FIRST_STEP_S), "\n".join(run.err[-30:])
    blow = time.monotonic()
    for p in tree.values():
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    # SIGTERM only once every process has taken SIGUSR1: the second stop, not a race for the first
    waited = time.monotonic() + ENDS_WITHIN_S
    while not all(_has_taken(p, signal.SIGUSR1) for p in tree.values()) and time.monotonic() < waited:
        time.sleep(0.01)
    assert all(_has_taken(p, signal.SIGUSR1) for p in tree.values()), tree
    os.kill(tree["torchrun"].pid, signal.SIGTERM)
    code, took = run.ended(blow)
    print(f"SIGUSR1 to every process, then SIGTERM to torchrun: the launcher exited {took:.1f} s later")
    assert code == 128 + signal.SIGUSR1
    run.stderr_says("megatron-ext: stopped by SIGUSR1")
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    steps = [line for line in run.out if line.startswith("step ")]
    assert saved == len(steps) >= 1, (saved, steps)
    run.assert_nothing_left(tree, blow + ENDS_WITHIN_S)


def test_a_terminals_ctrl_c_reaches_supervised_ranks_once_as_sigterm(tmp_path):
    """``python -m megatron_ext.runtime.supervisor TORCHRUN_ARGS`` (how scripts/run_local.sh runs
    Megatron-LM's ranks): Ctrl-C goes to the terminal's whole foreground process group, but the
    ranks run in torchrun's own session: they get SIGTERM once, from it, and end without a
    KeyboardInterrupt traceback each (plain torchrun printed one per rank, and its own)."""
    rank = tmp_path / "rank.py"
    rank.write_text("import os, time\nos.write(1, f\"ready {os.environ['RANK']}\\n\".encode())\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-m", "megatron_ext.runtime.supervisor", "--standalone",
                             "--nproc-per-node=2", str(rank)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # (its own group: the "terminal's" here)
    ready = [proc.stdout.readline() for _ in range(2)]
    assert sorted(ready) == ["ready 0\n", "ready 1\n"], ready
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=ENDS_WITHIN_S)
    assert proc.returncode == 128 + signal.SIGINT
    assert err.strip().splitlines() == ["megatron-ext: stopped by SIGINT"], err


@pytest.mark.parametrize("command", [["train"], ["profile", "--out", "unused.yaml"]])
def test_more_ranks_than_the_machine_runs_are_refused_before_launching(command, capsys):
    """1,024 CPU ranks: over 4 a core and over 512 MB each of free memory, on any machine."""
    from megatron_ext.commands.cli import main

    assert main([*command, "--cluster", "a100-40g-8x128"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("megatron-ext: error: a100-40g-8x128 has 1024 GPUs: 1024 CPU ranks "), err
    assert err.endswith("; use --cluster cpu-4, or --allow-oversubscribe to start them anyway\n")


def test_allow_oversubscribe_is_the_launchers_option(capsys):
    """Taken by the launcher, not passed to the ranks (whose parser would refuse it)."""
    from megatron_ext.commands.cli import main

    assert main(["train", "--allow-oversubscribe", "--no-such-flag"]) == 2
    assert capsys.readouterr().err == ("megatron-ext: error: unknown option(s): --no-such-flag "
                                       "(see megatron-ext train --help)\n")


def test_exit_text_names_the_signal():
    from megatron_ext.lifetime import exit_text

    assert exit_text(-9) == "died (signal 9 SIGKILL)"
    assert exit_text(128 + 15) == "died (signal 15 SIGTERM)"  # a rank that exits on SIGTERM (lifetime.py)
    assert exit_text(1) == "failed (exit status 1)"


def test_exit_process_ends_as_the_interpreter_would_without_its_teardown():
    # a rank's __main__ ends so: its threads finish, its exit handlers run, its output (a pipe's
    # buffer, here) is all written, and the status is the one given
    script = ("import atexit, sys, threading, time\n"
              "from megatron_ext.lifetime import exit_process\n"
              "atexit.register(lambda: print('handler'))\n"
              "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
              "print('main')\n"
              "exit_process(3)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (3, "main\nthread\nhandler\n", "")


def test_a_rank_other_than_0_leaves_rank_0_to_say_a_shared_error(monkeypatch, capsys):
    # every rank raises the same bad-input error together; torchrun stops the rest at the first
    # exit, so a rank 1 that exited first took rank 0 down before it printed (the run said only
    # "rank 1 failed (exit status 2)")
    from megatron_ext import lifetime
    from megatron_ext.errors import ConfigError

    waited = []
    monkeypatch.setattr(lifetime.time, "sleep", waited.append)
    assert lifetime.say_rank_error(ConfigError("bad"), 0) == 2 and waited == []
    assert lifetime.say_rank_error(ConfigError("bad"), 3) == 2 and waited == [lifetime.RANK_ERROR_WAIT_S]
    assert capsys.readouterr().err == "megatron-ext: error: bad\n" * 2


def test_root_cause_is_a_killed_rank_among_those_failing_together():
    """torchrun slow to look: the ranks whose collectives broke on the dead one failed in the same
    second, and torchrun's order would name the lowest of them."""
    from types import SimpleNamespace

    from megatron_ext.runtime.torchrun import root_cause

    def failure(t, code):
        return SimpleNamespace(timestamp=t, exitcode=code)

    together = {0: failure(100, 1), 1: failure(100, 1), 2: failure(100, -9), 3: failure(101, 143)}
    assert root_cause(together)[0] == 2
    # else the first torchrun saw: not the lowest rank, nor one it stopped with SIGTERM
    assert root_cause({3: failure(100, 2), 0: failure(100, 143), 1: failure(100, -15)})[0] == 3
    assert root_cause({0: failure(101, -9), 1: failure(100, 1)})[0] == 1


def test_only_the_rendezvous_timers_join_race_is_silenced(monkeypatch, capsys):
    # torch's rendezvous timer stopped by its finalizer on its own thread: dropped; the same error
    # elsewhere, or another error there, still reaches stderr
    from megatron_ext.runtime.torchrun import quiet_rendezvous_stop

    def unraisable(filename: str, message: str):
        """What the interpreter passes its hook for an error raised in a finalizer, by
        ``_stop_thread`` of ``filename``."""
        scope: dict = {}
        exec(compile(f"def _stop_thread():\n    raise RuntimeError({message!r})\n", filename, "exec"), scope)

        class Finalized:
            def __del__(self):
                scope["_stop_thread"]()

        seen = []
        monkeypatch.setattr(sys, "unraisablehook", seen.append)
        Finalized()  # (collected at once: its __del__ raises, unraisable)
        monkeypatch.undo()
        return seen[0]

    torch_file = "/x/torch/distributed/elastic/rendezvous/utils.py"
    quiet_rendezvous_stop(unraisable(torch_file, "cannot join current thread"))
    assert capsys.readouterr().err == ""
    for args in ((torch_file, "something else"), ("/x/ours.py", "cannot join current thread")):
        quiet_rendezvous_stop(unraisable(*args))
        err = capsys.readouterr().err
        assert "Traceback" in err and args[1] in err
