"""The planning data loader: deterministic batches, one-step-ahead planning, the deadline
fallback, plan digests and the cross-rank agreement check."""
import logging
import multiprocessing as mp
import subprocess
import sys

import numpy as np
import pytest

from small_cost import small_cost
from megatron_ext.data.datasets import DataError, InMemoryDocuments
from megatron_ext.data.loader import (PlanMismatchError, PlanningDataLoader, _describe_mismatch,
                                      check_plan_agreement, plan_digest)
from megatron_ext.plan import validate
from megatron_ext.planner import PlannerOptions, make_plan

COST = small_cost()
OPTS = PlannerOptions(time_limit=0.2)


def _docs(n=200, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(6.5, 1.3, n)).astype(int)
    lengths[7] = 50_000  # one long document
    return InMemoryDocuments([rng.integers(0, 256, k) for k in lengths])


DOCS = _docs()


def _loader(**kw):
    kw = {"options": OPTS, "num_steps": 3, "background": False, **kw}
    return PlanningDataLoader(DOCS, COST, 16, **kw)


def test_same_seed_same_batches_for_every_planner():
    runs = {}
    for planner in ("flexsp", "batchada", "static_ulysses"):
        runs[planner] = [s for s in _loader(planner=planner, seed=3)]
    ref = runs["flexsp"]
    assert [s.step for s in ref] == [0, 1, 2]
    for planner, steps in runs.items():
        for a, b in zip(ref, steps):
            np.testing.assert_array_equal(a.samples, b.samples)
            assert all(np.array_equal(x, y) for x, y in zip(a.batch, b.batch))
        for s in steps:
            assert s.plan.planner == planner and s.plan_source == "inline"
            validate(s.plan, s.lengths, COST)
    other = [s.samples for s in _loader(seed=4)]
    assert not all(np.array_equal(a.samples, b) for a, b in zip(ref, other))
    # The batch holds the sampled tokens, unpadded, as int64.
    s = ref[1]
    for i, (d, a, e) in enumerate(s.samples):
        np.testing.assert_array_equal(s.batch[i], DOCS.get(int(d))[a:e])
        assert s.batch[i].dtype == np.int64 and s.lengths[i] == e - a


def test_a_rank_reads_only_the_sequences_it_asks_for():
    class Counting(InMemoryDocuments):
        def get(self, idx, offset=0, length=None):
            reads.append(idx)
            return super().get(idx, offset, length)

    reads = []
    step = next(iter(PlanningDataLoader(Counting([DOCS.get(i) for i in range(len(DOCS))]), COST, 16,
                                        options=OPTS, num_steps=1, background=False)))
    assert reads == [] and len(step.batch) == 16
    first, again = step.batch[5], step.batch[5]
    assert first is again and reads == [int(step.samples[5, 0])]  # read once, kept for the step
    np.testing.assert_array_equal(step.batch[2:4][1], step.batch[3])


def test_epochs_and_resume():
    dl = _loader(max_seq_len=4096, num_steps=None)
    assert dl.steps_per_epoch == len(dl.samples) // 16
    spe = dl.steps_per_epoch
    epoch0 = np.concatenate([dl.batch_sample_ids(k) for k in range(spe)])
    assert len(set(epoch0.tolist())) == len(epoch0), "no sample twice in an epoch"
    epoch1 = np.concatenate([dl.batch_sample_ids(k) for k in range(spe, 2 * spe)])
    assert not np.array_equal(epoch0, epoch1)
    assert (dl.samples[:, 2] - dl.samples[:, 1]).max() <= 4096  # the 50K document was split
    resumed = list(_loader(start_step=spe - 1, num_steps=2))
    assert [s.step for s in resumed] == [spe - 1, spe]
    np.testing.assert_array_equal(resumed[1].samples, _loader().batch_samples(spe))
    assert list(_loader(num_steps=0)) == []
    with pytest.raises(DataError, match="fewer than one global batch"):
        PlanningDataLoader(InMemoryDocuments([np.arange(3)]), COST, 2)
    with pytest.raises(DataError, match="unknown planner"):
        _loader(planner="nope")
    with pytest.raises(DataError, match="needs torch.distributed"):
        next(iter(_loader(sync="broadcast")))


def test_background_plans_equal_inline_plans():
    inline = list(_loader(planner="batchada"))
    with _loader(planner="batchada", background=True, deadline_s=30.0) as dl:
        background = list(dl)
    assert [s.plan_source for s in background] == ["planner"] * 3
    assert [s.digest for s in background] == [s.digest for s in inline]


def test_late_plan_uses_fallback_and_warns(caplog):
    delay = 1.0
    with caplog.at_level(logging.WARNING, logger="megatron_ext.data.loader"):
        with _loader(background=True, num_steps=2, deadline_s=0.1, plan_delay_s=delay) as dl:
            steps = list(dl)
    assert [s.plan_source for s in steps] == ["fallback", "fallback"]
    for s in steps:
        assert s.plan.planner == "batchada" and s.plan.solver_status.startswith("fallback")
        validate(s.plan, s.lengths, COST)
    # What became of the worker's plans races close()'s wait for it (a loaded machine may stop it
    # first): each came late (discarded), was skipped as stale, or never came; none was used.
    assert dl.stats["fallback"] == 2 and dl.stats["planner"] == 0
    assert dl.stats["late_discarded"] + dl.stats["skipped"] <= 2, dl.stats
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    # each step waited its deadline, not for the slow planner
    for step, warning in enumerate(warnings):
        assert (f"step {step}: the flexsp plan was not ready within the 0.10s deadline; "
                "using the batchada fallback") in warning
    # The fallback is the batch's own plan: same batches as a run without the delay.
    np.testing.assert_array_equal(steps[1].samples, _loader().batch_samples(1))


def test_fallback_of_auto_slices_what_no_group_holds():
    """auto's FlexSP-kind fallbacks cannot hold a sequence only its pipelines slice: the last
    resort, Seq1F1B on the same one stage, can."""
    from megatron_ext.data.loader import fallback_plan
    from megatron_ext.errors import MegatronExtError

    from megatron_ext.cost import CostModel

    cost = CostModel.from_presets("tiny", "cpu-4")  # one-stage pipelines slice up to 13,151 tokens
    options = PlannerOptions(pp=1, recompute="auto")
    lengths = np.array([cost.max_seq_len + 500, 300, 40])
    with pytest.raises(MegatronExtError):
        fallback_plan(lengths, cost, options)
    plan = fallback_plan(lengths, cost, options, reason="late", last_resorts=("seq1f1b",))
    assert plan.planner == "seq1f1b" and plan.kind == "elastic_pp" and plan.solver_status.startswith("fallback (late)")
    assert {p.stages for p in plan.pipelines} == {1}
    assert len({(x.start, x.end) for p in plan.pipelines for c in p.chunks for x in c.pieces if x.seq_id == 0}) > 1
    plan = fallback_plan(lengths[1:], cost, options, last_resorts=("seq1f1b",))  # the usual fallback first
    assert plan.planner == "batchada"


def test_a_pipeline_run_falls_back_to_slices_where_whole_sequences_do_not_fit(monkeypatch):
    """batch 1F1B (a pipeline run's fallback) holds whole sequences only (it refuses those over
    the longest its packs hold): where the run's longest do not fit it, the last resort is
    elastic_pp in a hurry, which slices them (a late plan ended such runs)."""
    from megatron_ext.cost import CostModel
    from megatron_ext.data.loader import FALLBACK_LIMIT_S, fallback_plan
    from megatron_ext.errors import LengthsError

    cost = CostModel.from_presets("tiny", "cpu-4", zero_stage=0)
    options = PlannerOptions(time_limit=1.0, pp=2, sp=2, flexsp=False)
    lengths = np.array([6144, 3000, 800, 500, 200, 100, 4000, 6144])
    with pytest.raises(LengthsError, match="exceed the longest batch_1f1b can run, 4096 tokens"):
        fallback_plan(lengths, cost, options, "batch_1f1b")
    docs = InMemoryDocuments([np.arange(n) % 256 for n in lengths])
    with PlanningDataLoader(docs, cost, len(lengths), planner="elastic_pp", options=options, fallback="batch_1f1b",
                            num_steps=1, max_seq_len=6144, deadline_s=0.05, plan_delay_s=5.0) as dl:
        step = next(iter(dl))
    assert step.plan_source == "fallback" and step.plan.planner == "elastic_pp"
    assert step.plan.solver_status.startswith("fallback (late)")
    validate(step.plan, step.lengths, cost)
    # in a hurry: the last resort plans at FALLBACK_LIMIT_S, not the run's limit
    from megatron_ext.data import loader as loader_module

    limits = []
    real = loader_module.make_plan
    monkeypatch.setattr(loader_module, "make_plan", lambda name, *a, **k: limits.append((name, a[2].time_limit))
                        or real(name, *a, **k))
    fallback_plan(lengths, cost, options, "batch_1f1b", last_resorts=("elastic_pp",))
    assert limits == [("batch_1f1b", 1.0), ("elastic_pp", FALLBACK_LIMIT_S)]
    # a run of the fallback planner itself keeps to it: its refusal ends the step
    with PlanningDataLoader(docs, cost, len(lengths), planner="batch_1f1b", options=options, fallback="batch_1f1b",
                            num_steps=1, max_seq_len=6144, deadline_s=0.05, plan_delay_s=5.0) as dl:
        with pytest.raises(LengthsError, match="exceed the longest batch_1f1b can run, 4096 tokens"):
            next(iter(dl))


def test_dead_worker_falls_back(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_ext.data.loader"):
        with _loader(background=True, num_steps=2, worker_imports=("megatron_ext_no_such_module",)) as dl:
            steps = list(dl)
    assert [s.plan_source for s in steps] == ["fallback", "fallback"]
    assert "failed to start" in caplog.text and "No module named 'megatron_ext_no_such_module'" in caplog.text


def test_a_worker_killed_halfway_through_sending_a_plan_falls_back(caplog):
    """A plan larger than a pipe's buffer is half written when the worker dies: the step gets the
    fallback within its deadline, not a read that blocks for ever."""
    import os
    import signal
    import threading
    import time

    rng = np.random.default_rng(1)
    docs = InMemoryDocuments([rng.integers(0, 256, k) for k in rng.integers(2, 40, 70_000)])
    dl = PlanningDataLoader(docs, COST, 60_000, planner="batchada", options=OPTS, num_steps=2, deadline_s=5.0)
    it = iter(dl)
    next(it)
    waited = time.monotonic() + 60
    while not dl._results.poll(0.05) and time.monotonic() < waited:  # step 1's plan (~180 KB) is on its way
        pass
    os.kill(dl._proc.pid, signal.SIGKILL)
    got = []
    with caplog.at_level(logging.WARNING, logger="megatron_ext.data.loader"):
        reader = threading.Thread(target=lambda: got.append(next(it)), daemon=True)
        reader.start()
        reader.join(30)
    assert not reader.is_alive(), "the step waited on a dead worker's pipe"
    assert got[0].plan_source == "fallback" and "planner process exited" in caplog.text
    dl.close()


def test_a_worker_that_never_starts_costs_its_start_up_wait_once(tmp_path, monkeypatch, caplog):
    (tmp_path / "slow_planner_import.py").write_text("import time\ntime.sleep(30)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # (the spawned worker gets this process's path)
    with caplog.at_level(logging.WARNING, logger="megatron_ext.data.loader"):
        with _loader(background=True, num_steps=3, deadline_s=0.2, startup_timeout_s=1.0,
                     worker_imports=("slow_planner_import",)) as dl:
            steps = list(dl)
    assert steps[0].plan_wait_s >= 1.0
    assert [s.plan_source for s in steps] == ["fallback"] * 3
    # which wait each step had: the start-up wait on the first only, the deadline after it
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [w.split(";")[0] for w in warnings] == [
        "step 0: the planner process did not start within 1.0s",
        "step 1: the flexsp plan was not ready within the 0.20s deadline",
        "step 2: the flexsp plan was not ready within the 0.20s deadline"], warnings


SPAWNING_SCRIPT = """
import sys
if __name__ == "__mp_main__":  # the planner process importing the script that started it
    open(sys.argv[1], "w").write("re-imported")
if __name__ == "__main__":
    import numpy as np
    from megatron_ext.cost import CostModel
    from megatron_ext.data.datasets import InMemoryDocuments
    from megatron_ext.data.loader import PlanningDataLoader

    docs = InMemoryDocuments([np.arange(5) for _ in range(40_000)])
    loader = PlanningDataLoader(docs, CostModel.from_presets("tiny", "cpu-4"), 20_000, planner="static_ulysses",
                                fallback="static_ulysses", num_steps=3, deadline_s=0.1, plan_delay_s=30.0)
    assert next(iter(loader)).plan_source == "fallback"
    loader.close()
"""


def test_the_planner_process_neither_imports_the_script_nor_holds_its_exit(tmp_path):
    """The planner process is spawned: it imported the training script again (as __mp_main__: torch
    and megatron with it, 238 MB and a second to start), and a task left in its queue when it was
    stopped (the next step's, a global batch of 20,000 sequences: over a pipe's buffer) held the
    script's exit for ever."""
    script, marker = tmp_path / "train_script.py", tmp_path / "marker"
    script.write_text(SPAWNING_SCRIPT)
    subprocess.run([sys.executable, str(script), str(marker)], check=True, timeout=120)
    assert not marker.exists()


def test_a_planner_defined_in_the_script_is_refused_for_the_planner_process(monkeypatch):
    """The planner process does not import the script that starts it: a planner registered there
    would be unknown to it (every step fell back, with a warning a step)."""
    import dataclasses

    from megatron_ext.planner import api

    mine = dataclasses.replace(api.PLANNERS["batchada"], name="mine")
    in_main = type(mine.fn)(mine.fn.__code__, {**mine.fn.__globals__, "__name__": "__main__"})  # (as if defined there)
    mine = dataclasses.replace(mine, fn=in_main)
    monkeypatch.setitem(api.PLANNERS, "mine", mine)
    with pytest.raises(DataError, match="planner 'mine' is defined in the script being run.*worker_imports"):
        _loader(planner="mine", background=True)
    assert _loader(planner="mine").planner == "mine"  # (inline: planned where it is defined)
    # a module the worker imports may register it there (a script run as `python -m pkg.script`)
    with _loader(planner="mine", background=True, worker_imports=("json",)) as dl:
        assert dl.planner == "mine"


def test_worker_side_imports_no_torch():
    code = ("import sys, megatron_ext.data.plan_worker, megatron_ext.data.sharding, megatron_ext.planner;"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_digest_covers_decisions_and_batch_not_timings():
    lengths = np.array([300, 2000, 50, 7000])
    plan = make_plan("batchada", lengths, COST, OPTS)
    samples = np.array([[0, 0, 300], [1, 0, 2000], [2, 0, 50], [3, 0, 7000]])
    d = plan_digest(plan, samples)
    plan.solve_time_s += 1.0
    plan.micro_batches[0].estimated_time_s += 1.0
    plan.solver_status = "something else"
    assert plan_digest(plan, samples) == d
    samples2 = samples.copy()
    samples2[0, 0] = 9
    assert plan_digest(plan, samples2) != d
    g = plan.micro_batches[0].groups[0]
    g.seq_ids = list(reversed(g.seq_ids)) if len(g.seq_ids) > 1 else g.seq_ids + [0]
    assert plan_digest(plan, samples) != d


def test_describe_mismatch():
    assert _describe_mismatch(["a", "a", "a"], [0, 1, 2]) is None
    msg = _describe_mismatch(["a", "b", "a", "c"], [4, 5, 6, 7])
    assert "differs from rank 4's on rank(s) [5, 7]" in msg
    check_plan_agreement("anything")  # no process group: nothing to compare


def test_step_part():
    s = next(iter(_loader(planner="batchada")))
    covered = 0
    for r in range(COST.num_gpus):
        for shard in s.part(r):
            if shard is not None:
                covered += shard.real_tokens
    assert covered == int(s.lengths.sum()), "each sequence lies in one micro-batch, its tokens on one rank each"
    assert s.num_loss_tokens == int((s.lengths - 1).sum())


# ---- two gloo ranks ---------------------------------------------------------------------------
def _rank_main(rank, world, init_file, out):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    res = {}
    try:
        with PlanningDataLoader(DOCS, COST, 16, options=OPTS, num_steps=2, sync="broadcast",
                                deadline_s=30.0) as dl:
            steps = list(dl)
        res["digests"] = [s.digest for s in steps]
        res["sources"] = [s.plan_source for s in steps]
        res["worker"] = dl._ticket > 0
        # Each rank plans inline with a deterministic planner: identical plans. (A time-limited
        # solver may stop at different incumbents on different ranks: that is what "broadcast" is for.)
        steps = list(_loader(planner="batchada", num_steps=1, sync="check"))
        res["check"] = steps[0].digest
        try:  # a rank with another seed draws other batches: every rank learns which one differs
            list(_loader(planner="batchada", num_steps=1, sync="check", seed=rank))
        except PlanMismatchError as e:
            res["mismatch"] = str(e)
    except BaseException as e:  # report rather than hang the parent
        res["error"] = repr(e)
    finally:
        out.put((rank, res))
        dist.destroy_process_group()


def test_two_ranks_broadcast_and_agreement(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, str(tmp_path / "init"), out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert "error" not in results[0] and "error" not in results[1], results
    assert results[0]["digests"] == results[1]["digests"]
    assert results[0]["sources"] == ["planner", "planner"]
    assert results[1]["sources"] == ["broadcast:planner"] * 2
    assert results[0]["worker"] and not results[1]["worker"], "only the source rank plans"
    assert results[0]["check"] == results[1]["check"]
    for r in (0, 1):
        assert "differs from rank 0's on rank(s) [1]" in results[r]["mismatch"]
