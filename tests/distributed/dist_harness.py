"""Run many checks in one launch of N gloo ranks (process start-up costs seconds; checks cost ms).

A worker module lists its checks with ``@check`` and may define ``preload()`` (heavy imports, run
once before the ranks fork) and ``setup()`` (per rank, after the process group exists; a failure
there aborts the launch). The pytest side calls ``launch(worker, nprocs)`` once (module fixture)
and gets, per check name, the failures of every rank; ``check_names(worker)`` lists the names for
parametrization.

``launch`` starts one fresh interpreter (``python dist_harness.py WORKER N INIT OUT``) that
imports torch / megatron once via ``preload()`` and forks the N ranks, which rendezvous through a
``file://`` store in a new temporary directory (parallel runs never collide on a port). Each rank
runs every check, records a traceback or success in ``OUT/rank<R>.json`` and meets the others at
a barrier; its output goes to ``OUT/rank<R>.log``. A check that raises on some ranks only should
do so after its last collective (``Failures`` helps), or the others wait for the
30 s gloo timeout.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from datetime import timedelta
from pathlib import Path

CHECKS: list = []
LOGS_KEPT = "(logs kept in "


def check(fn):
    CHECKS.append(fn)
    return fn


def _load(script: Path, name: str):
    CHECKS.clear()
    spec = importlib.util.spec_from_file_location(name, script)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(script.parent))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(script.parent))
    return mod


class Failures:
    """Collects mismatches and raises them at the end of a check, so that a failing rank still
    takes part in every collective of the check and the other ranks do not hang."""

    def __init__(self):
        self.messages: list[str] = []

    def close(self, actual, expected, what: str, **tol) -> None:
        import torch

        try:
            torch.testing.assert_close(actual, expected, **tol)
        except AssertionError as e:
            self.messages.append(f"{what}: {e}")

    def true(self, cond: bool, what: str) -> None:
        if not cond:
            self.messages.append(what)

    def raise_any(self) -> None:
        if self.messages:
            raise AssertionError(f"{len(self.messages)} mismatch(es):\n" + "\n".join(self.messages[:6]))


def preload_megatron(*modules: str) -> None:
    """For a worker's ``preload()``: megatron-core on CPU (runtime.compat) and the heavy imports
    (megatron's GPT model and ``modules``) done once, before the ranks fork."""
    from megatron_ext.runtime.compat import apply_cpu_compat

    apply_cpu_compat()
    for name in ("pytest", "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.models.gpt.gpt_model",
                 "megatron_ext.runtime.attention", "megatron_ext.runtime.groups", *modules):
        importlib.import_module(name)


def model_and_reference(spec, vocab_size: int, max_seq_len: int):
    """The DDP-wrapped stage model ``train`` runs (one stage, SDPA), its weights rank 0's on every
    rank, and a plain megatron GPTModel with the same weights: the single-process reference."""
    import torch
    import torch.distributed as dist
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_ext.runtime.pipeline_model import build_pipeline_model

    torch.manual_seed(0)
    ddp, config = build_pipeline_model(spec, vocab_size=vocab_size, max_seq_len=max_seq_len, backend="sdpa")
    for p in ddp.module.parameters():  # identical weights on every rank
        dist.broadcast(p.data, src=0)
    reference = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=-(-vocab_size // 128) * 128,
                         max_sequence_length=max_seq_len, position_embedding_type="rope")
    reference.load_state_dict(ddp.module.state_dict())
    return ddp, reference


def setup_megatron(seed: int = 1234):
    """For a worker's ``setup()``: megatron's parallel_state with tp = pp = 1, its RNG seeded, and
    the SP group pool of the whole world (returned)."""
    from megatron.core import parallel_state, tensor_parallel

    from megatron_ext.runtime.groups import SPGroupPool

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return SPGroupPool()


def check_names(script: Path) -> list[str]:
    """Names of the checks a worker module defines (imports it without running anything)."""
    _load(script, f"_names_{script.stem}")
    names = [f.__name__ for f in CHECKS]
    CHECKS.clear()
    return names


def _run_rank(mod, rank: int, world: int, init_method: str, out_dir: Path) -> None:
    import torch
    import torch.distributed as dist

    from megatron_ext.runtime.device import enable_device_check

    torch.set_num_threads(1)
    enable_device_check()  # every check runs under NCCL's rules (runtime/device.py)
    t0 = time.perf_counter()
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    if hasattr(mod, "setup"):
        mod.setup()
    timings = {"setup": time.perf_counter() - t0}
    results: dict[str, str | None] = {}
    report = out_dir / f"rank{rank}.json"
    for fn in CHECKS:
        t0 = time.perf_counter()
        try:
            fn()
            results[fn.__name__] = None
        except Exception:  # noqa: BLE001 - reported to the parent
            results[fn.__name__] = traceback.format_exc(limit=8)
        report.write_text(json.dumps({"done": False, "results": results}))  # survives a later hang
        dist.barrier()
        timings[fn.__name__] = time.perf_counter() - t0
    print("timings:", json.dumps({k: round(v, 3) for k, v in timings.items()}), flush=True)
    report.write_text(json.dumps({"done": True, "results": results}))
    dist.barrier()
    dist.destroy_process_group()


def _launcher_main(script: Path, world: int, init_method: str, out_dir: Path, timeout: float) -> int:
    """Import the worker once, fork the ranks, wait for them (killing stragglers at the deadline)."""
    mod = _load(script, script.stem)
    if hasattr(mod, "preload"):
        mod.preload()
    children = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:  # the rank
            code = 1
            try:
                log = os.open(out_dir / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(log, 1)
                os.dup2(log, 2)
                _run_rank(mod, rank, world, init_method, out_dir)
                code = 0
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = rank
    deadline = time.monotonic() + timeout
    status = 0
    while children and time.monotonic() < deadline:
        pid, st = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
            continue
        children.pop(pid, None)
        status |= os.waitstatus_to_exitcode(st) != 0
    for pid, rank in children.items():  # hung ranks: only our own children
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        with open(out_dir / f"rank{rank}.log", "a") as f:
            f.write(f"\nkilled after the {timeout:.0f} s launch deadline\n")
        status = 1
    return status


def launch(script: Path, nprocs: int, timeout: float = 240.0) -> dict[str, list[str]]:
    """Run the checks of ``script`` on ``nprocs`` ranks; returns {check name: [failure message per
    failing rank]} (empty list = passed everywhere). Checks a rank did not report fail, with the
    ranks' log tails."""
    from megatron_ext.runtime.supervisor import RUN_ID_ENV, kill_leftovers

    out = Path(tempfile.mkdtemp(prefix="mx-dist-"))
    init = f"file://{out / 'rendezvous'}"
    run_id = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **{RUN_ID_ENV: run_id})
    try:
        proc = subprocess.run([sys.executable, __file__, str(script), str(nprocs), init, str(out), str(timeout)],
                              env=env, cwd=script.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout + 60)
    finally:  # the ranks end with os._exit: what they started (a checkpoint's writer queue manager) is left
        kill_leftovers(run_id)
    results: dict[str, list[str]] = {}
    reported: dict[str, int] = {}
    problems = [f"launcher exited {proc.returncode}:\n{proc.stdout[-3000:]}"] if proc.returncode else []
    for r in range(nprocs):
        f = out / f"rank{r}.json"
        report = json.loads(f.read_text()) if f.exists() else {"done": False, "results": {}}
        if not report["done"]:
            log = out / f"rank{r}.log"
            tail = log.read_text()[-3000:] if log.exists() else "(no log)"
            problems.append(f"rank {r} did not finish:\n{tail}")
        for name, err in report["results"].items():
            results.setdefault(name, [])
            reported[name] = reported.get(name, 0) + 1
            if err is not None:
                results[name].append(f"rank {r}: {err}")
    for name, k in reported.items():
        if k < nprocs:
            results[name].append(f"reported by only {k} of {nprocs} ranks")
    if problems or any(results.values()):
        results["__launch__"] = problems + [f"{LOGS_KEPT}{out})"]
    else:
        shutil.rmtree(out, ignore_errors=True)
    return results


def assert_check(results: dict[str, list[str]], name: str) -> None:
    failures = results.get(name, [f"check {name} was not reported by any rank"])
    if failures:  # the launch notes (unfinished ranks, where the logs are) go along
        raise AssertionError("\n".join(failures + results.get("__launch__", [])))


def checks_as_tests(script: Path, nprocs: int):
    """The pytest side of a worker module, in one line of its test file::

        results, test_checks, test_every_check_reported = checks_as_tests(WORKER, nprocs=4)

    ``results`` is a module fixture making the one launch; ``test_checks`` reports each check as
    its own test; ``test_every_check_reported`` fails if a check never reported, or if the launch
    went wrong (a rank that did not finish, the launcher's failure)."""
    import pytest

    names = check_names(script)

    @pytest.fixture(scope="module")
    def results():
        return launch(script, nprocs=nprocs)

    @pytest.mark.parametrize("name", names)
    def test_checks(results, name):
        assert_check(results, name)

    def test_every_check_reported(results):
        assert set(names) <= set(results), sorted(set(names) - set(results))
        # a launch that went wrong around checks that passed (a rank hung in an unmatched
        # collective and was killed, the launcher's own exit) fails too
        problems = [p for p in results.get("__launch__", []) if not p.startswith(LOGS_KEPT)]
        assert not problems, "\n".join(problems)

    return results, test_checks, test_every_check_reported


if __name__ == "__main__":
    sys.modules.setdefault("dist_harness", sys.modules["__main__"])  # one CHECKS list for the worker
    sys.exit(_launcher_main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]),
                            float(sys.argv[5])))
