"""The Megatron-LM glue without a checkout: the CPU launcher's pieces, the --flexsp data, the
step records and logs, the hooks' dispatch, and the Ulysses swap on a megatron-core GPT (one rank)."""
from __future__ import annotations

import dataclasses
import json
import sys
import types
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.megatron.data import MockDocuments, SubsetDocuments, split_ranges
from megatron_ext.megatron.launch import CPU_DEFAULT_FLAGS, cpu_flags_to_add

ROOT = Path(__file__).resolve().parents[2]


# ---- launcher -------------------------------------------------------------------------------------
def test_cpu_flags_are_added_only_when_absent():
    added = cpu_flags_to_add(["--num-layers", "2"])
    assert added[:2] == ["--distributed-backend", "gloo"] and "--transformer-impl" in added
    assert len([a for a in added if a.startswith("--")]) == len(CPU_DEFAULT_FLAGS)
    added = cpu_flags_to_add(["--distributed-backend=gloo", "--transformer-impl", "local", "--masked-softmax-fusion"])
    assert "--distributed-backend" not in added and "--transformer-impl" not in added
    assert "--no-masked-softmax-fusion" not in added and "--no-gradient-accumulation-fusion" in added


def test_launcher_usage_and_missing_script(capsys):
    from megatron_ext.megatron.launch import main

    assert main([]) == 2 and "pretrain_gpt.py" in capsys.readouterr().out
    assert main(["/no/such/pretrain_gpt.py"]) == 2
    assert capsys.readouterr().err == "megatron-ext: error: no such script: /no/such/pretrain_gpt.py\n"
    assert main(["--check-args", "two", "pretrain_gpt.py"]) == 2
    assert capsys.readouterr().err.startswith("megatron-ext: error: usage: --check-args WORLD_SIZE SCRIPT")


def test_run_as_main_gives_the_script_a_main_spec(tmp_path, monkeypatch):
    from megatron_ext.megatron.launch import run_as_main

    script = tmp_path / "script.py"
    out = tmp_path / "out.json"
    script.write_text("import json, sys\n"
                      f"json.dump([__name__, __spec__.name], open({str(out)!r}, 'w'))\n")
    run_as_main(str(script))
    assert json.loads(out.read_text()) == ["__main__", "__main__"]  # spawn children skip re-running it


def test_launcher_destroys_the_process_group_megatron_leaves(tmp_path):
    """After the script, the launcher ends the default group itself (after a barrier), not gloo's
    threads at interpreter teardown."""
    import subprocess

    code = ("import torch.distributed as dist\n"
            "from megatron_ext.megatron.launch import _destroy_process_group\n"
            f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'store'}', rank=0, world_size=1)\n"
            "_destroy_process_group()\n"
            "print(dist.is_initialized())\n"
            "_destroy_process_group()  # nothing left to end: no error\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


# ---- data -----------------------------------------------------------------------------------------
def test_validation_starts_where_megatron_counts_it():
    """After --load, Megatron's consumed_valid_samples says how many validation batches ran: the
    planned validation goes on from there (with --skip-train, from the start, as Megatron's)."""
    from megatron_ext.megatron.step import valid_start_step

    assert valid_start_step(Namespace(consumed_valid_samples=0, global_batch_size=8)) == 0
    assert valid_start_step(Namespace(consumed_valid_samples=48, global_batch_size=8)) == 6
    assert valid_start_step(Namespace(consumed_valid_samples=48, global_batch_size=8, skip_train=True)) == 0


def test_split_ranges():
    assert split_ranges(1000, "969,30,1") == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(10, "100,0,0") == [(0, 10), (10, 10), (10, 10)]
    assert split_ranges(10, None) == [(0, 10), (10, 10), (10, 10)]
    assert split_ranges(7, "1,1") == [(0, 4), (4, 7), (7, 7)] or split_ranges(7, "1,1")[1][1] == 7
    from megatron_ext.data.datasets import DataError

    with pytest.raises(DataError):
        split_ranges(10, "0,0,0")


def test_blend_sources_are_split_one_by_one():
    from megatron_ext.megatron.data import split_sources

    a, b = MockDocuments(100, 50, 49, 1, 4096), MockDocuments(10, 50, 49, 2, 4096)
    train, valid, test = split_sources([(0.25, a), (0.75, b)], "80,10,10")
    docs, sizes, weights = train
    assert sizes == [80, 8] and weights == [0.25, 0.75] and len(docs) == 88
    np.testing.assert_array_equal(docs.get(80), b.get(0))
    assert valid[1] == [10, 1] and test[1] == [10, 1]
    np.testing.assert_array_equal(valid[0].get(10), b.get(8))
    single = split_sources([(None, a)], "80,10,10")
    assert single[0][1:] == (None, None) and len(single[0][0]) == 80
    assert split_sources([(None, a), (None, b)], None)[0][2] is None  # unweighted: one dataset


def test_planned_splits_of_every_data_argument(tmp_path):
    from megatron_ext.data.datasets import write_indexed_dataset
    from megatron_ext.megatron.data import planned_splits

    a = write_indexed_dataset(tmp_path / "a", [np.arange(n) for n in range(1, 101)])
    b = write_indexed_dataset(tmp_path / "b", [np.arange(n) for n in range(1, 11)])
    tok = Namespace(vocab_size=50, eod=49)
    blend = planned_splits(Namespace(data_path=["0.25", a, "0.75", b], split="80,10,10"), tok)
    assert [len(d) for d, *_ in blend] == [88, 11, 11] and blend[0][1:] == ([80, 8], [0.25, 0.75], f"0.25 x {a} + 0.75 x {b}")
    (tmp_path / "args.txt").write_text(f"0.25 {a}\n0.75 {b}\n")
    from_file = planned_splits(Namespace(data_args_path=str(tmp_path / "args.txt"), split="80,10,10"), tok)
    assert [x[1:] for x in from_file] == [x[1:] for x in blend]
    per_split = planned_splits(Namespace(train_data_path=["0.25", a, "0.75", b], valid_data_path=[b], split=None), tok)
    docs, sizes, weights, name = per_split[0]
    assert len(docs) == 110 and sizes == [100, 10] and weights == [0.25, 0.75]  # whole: no --split
    np.testing.assert_array_equal(docs.get(100), np.arange(1))
    assert len(per_split[1][0]) == 10 and per_split[1][3] == b and len(per_split[2][0]) == 0
    mock = planned_splits(Namespace(mock_data=True, seed=3, seq_length=1024, split="90,10,0", global_batch_size=8), tok)
    assert [x[3] for x in mock] == ["mock"] * 3 and len(mock[0][0]) + len(mock[1][0]) == 16384


def test_mock_documents_are_deterministic_and_long_tailed():
    a = MockDocuments(2000, vocab_size=100, eod=99, seed=5, max_len=4096)
    b = MockDocuments(2000, vocab_size=100, eod=99, seed=5, max_len=4096)
    assert np.array_equal(a.lengths, b.lengths) and len(a) == 2000
    assert a.lengths.max() <= 4096 and a.lengths.min() >= 2
    assert np.percentile(a.lengths, 99) > 4 * np.median(a.lengths)
    doc = a.get(3)
    assert doc.size == a.lengths[3] and doc[-1] == 99 and doc.max() < 100
    assert np.array_equal(a.get(3, 1, 5), doc[1:6]) and np.array_equal(doc, b.get(3))
    assert not np.array_equal(MockDocuments(10, 100, 99, 6, 4096).lengths, MockDocuments(10, 100, 99, 5, 4096).lengths)
    with pytest.raises(IndexError):
        a.get(3, 0, int(a.lengths[3]) + 1)


def test_mock_data_holds_two_batches_in_every_split_it_serves():
    from megatron_ext.megatron.data import MOCK_DOCUMENTS, mock_document_count, split_ranges

    assert mock_document_count(None, 512) == mock_document_count("100,0,0", 64) == MOCK_DOCUMENTS
    n = mock_document_count("990,9,1", 512)  # (the default count left validation 147 documents)
    assert [b - a >= 1024 for a, b in split_ranges(n, "990,9,1")] == [True, True, True]
    assert mock_document_count("999999,1,0", 512) == 2**24  # (as far as it goes)


def test_subset_documents():
    docs = MockDocuments(50, 100, 99, 1, 512)
    sub = SubsetDocuments(docs, 10, 20)
    assert len(sub) == 10 and np.array_equal(sub.lengths, docs.lengths[10:20])
    assert np.array_equal(sub.get(0), docs.get(10))
    with pytest.raises(IndexError):
        sub.get(10)


@pytest.mark.parametrize("sp, replicas", [(2, [0]), (1, [0, 1]), ("auto", None)])
def test_elastic_loader_plans_stages_of_the_given_sp(sp, replicas):
    """--elastic-pp-sp D (validate_args sets the data-parallel size when it is not given): the
    loader plans 2 stages x SP D, and below a stage's 2 ranks, 2 / D replicas each running
    pipelines; so does its fallback. auto: the auto planner on the 2 stages, any degree (and so
    replicas or not) per step; batch 1F1B on 2 stages when late."""
    from megatron_ext.megatron.cost import load_cost_model
    from megatron_ext.megatron.data import make_loader
    from megatron_ext.plan.validate import replica_groups
    from megatron_ext.planner import make_plan

    cost = load_cost_model(str(ROOT / "configs/megatron/cost/tiny-cpu4.yaml"))
    args = Namespace(elastic_pp=True, elastic_pp_sp=sp, pipeline_model_parallel_size=2, seq_length=2048,
                     planner_time_limit=0.5, adaptive_recompute=False, global_batch_size=8, plan_ahead=0)
    loader = make_loader(MockDocuments(64, 100, 99, 3, 4096), cost, args, num_steps=1, start_step=0, seed=3)
    auto = sp == "auto"
    assert (loader.planner, loader.fallback) == ("auto" if auto else "elastic_pp", "batch_1f1b")
    assert (loader.options.pp, loader.options.sp) == (2, None if auto else sp)
    for planner in (loader.planner, loader.fallback):
        plan = make_plan(planner, loader.batch_lengths(0), cost, loader.options)
        degree = plan.pipelines[0].sp_degree if auto else sp
        assert {(p.stages, p.sp_degree) for p in plan.pipelines} == {(2, degree)}, planner
        assert sorted({p.replica for p in plan.pipelines}) == (replicas or list(range(2 // degree))), planner
        assert all(replica_groups(plan, cost.num_gpus)), planner


def test_static_ulysses_loader_cuts_documents_at_what_its_degree_holds():
    """--flexsp-planner static_ulysses --flexsp-static-degree D: documents are cut at what a
    degree-D group holds (the loader drops what no plan runs: a longer piece would be dropped
    on every step, its tokens never trained)."""
    from megatron_ext.megatron.cost import load_cost_model
    from megatron_ext.megatron.data import make_loader

    cost = load_cost_model(str(ROOT / "configs/megatron/cost/tiny-cpu2.yaml"))
    args = Namespace(elastic_pp=False, flexsp_planner="static_ulysses", flexsp_static_degree=1, seq_length=65536,
                     planner_time_limit=0.5, adaptive_recompute=False, global_batch_size=4, plan_ahead=0)
    loader = make_loader(MockDocuments(64, 100, 99, 3, 65536), cost, args, num_steps=1, start_step=0, seed=3)
    assert loader.max_seq_len == cost.token_capacity(1) < cost.max_seq_len
    args.flexsp_planner = "flexsp"  # (the degree is static_ulysses's: FlexSP's groups hold more)
    assert make_loader(MockDocuments(64, 100, 99, 3, 65536), cost, args, num_steps=1, start_step=0,
                       seed=3).max_seq_len == cost.max_seq_len


def test_flexsp_auto_loader_plans_one_stage_and_logs_under_flexsp(tmp_path):
    """--flexsp-planner auto: the loader plans with auto on one stage (FlexSP or one-stage
    pipeline replicas), over FlexSP's length limit up to what the pipelines slice; a pipeline
    step of it logs under flexsp/, the run's flag."""
    from megatron_ext.data.loader import Step
    from megatron_ext.megatron.cost import load_cost_model
    from megatron_ext.megatron.data import make_loader
    from megatron_ext.megatron.step import report_step
    from megatron_ext.planner import make_plan

    cost = load_cost_model(str(ROOT / "configs/megatron/cost/tiny-cpu2.yaml"))
    args = Namespace(elastic_pp=False, flexsp_planner="auto", flexsp_static_degree=None, seq_length=8192,
                     planner_time_limit=0.5, adaptive_recompute=True, global_batch_size=4, plan_ahead=0)
    loader = make_loader(MockDocuments(64, 100, 99, 3, 8192), cost, args, num_steps=1, start_step=0, seed=3)
    assert (loader.planner, loader.fallback) == ("auto", "batchada")
    assert (loader.options.pp, loader.options.recompute) == (1, "ilp")
    assert cost.max_seq_len < loader.max_seq_len == loader.options.max_seq_len < 8192
    lengths = np.array([cost.max_seq_len + 1000, 300, 200, 50])  # no FlexSP group holds the first
    plan = make_plan("auto", lengths, cost, loader.options)
    assert plan.kind == "elastic_pp" and {p.stages for p in plan.pipelines} == {1}
    step = Step(0, plan, [np.arange(n) for n in lengths], lengths,
                np.stack([np.arange(4), np.zeros(4, int), lengths], axis=1), "d1g3st", "planner", 0.002)
    lines, writer = [], FakeWriter()
    report_step(step, 1.0, [1.0], args=Namespace(flexsp=True, curr_iteration=0, log_interval=1, planner_log=None),
                writer=writer, printer=lines.append)
    assert lines[0].startswith(" flexsp iteration        1 | plan auto (planner") and " x 1 stage x SP " in lines[0]
    assert {name.split("/")[0] for name, _, _ in writer.scalars} == {"flexsp"}


# ---- step records and logs ---------------------------------------------------------------------------
def _step():
    from megatron_ext.data.loader import Step
    from megatron_ext.megatron.cost import load_cost_model
    from megatron_ext.planner import make_plan

    lengths = np.array([900, 300, 200, 50])
    plan = make_plan("flexsp", lengths, load_cost_model(str(ROOT / "configs/megatron/cost/tiny-cpu4.yaml")))
    batch = [np.arange(n) for n in lengths]
    samples = np.stack([np.arange(4), np.zeros(4, int), lengths], axis=1)
    return Step(7, plan, batch, lengths, samples, "d1g3st", "planner", 0.004)


class FakeWriter:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))


class FakeWandb:  # W&B's run.log(dict, step)
    def __init__(self):
        self.logged = []

    def log(self, values, step):
        self.logged.append((dict(values), step))


def test_report_step_logs_line_tensorboard_and_planner_log(tmp_path):
    from megatron_ext.megatron.step import report_step, summary_line

    step = _step()
    lines, writer, wandb = [], FakeWriter(), FakeWandb()
    log = tmp_path / "plans.jsonl"
    args = Namespace(curr_iteration=9, log_interval=5, planner_log=str(log))
    n = len(step.plan.micro_batches)
    rec = report_step(step, 1.5, [1.5 / n] * n, args=args, writer=writer, wandb=wandb, printer=lines.append)
    # W&B gets what TensorBoard gets, at the same iteration
    assert wandb.logged == [({name: value for name, value, _ in writer.scalars}, 10)]
    assert rec["iteration"] == 10 and rec["tokens"] == 1450 and rec["sequences"] == 4
    assert rec["step_time_s"] == 1.5 and rec["predicted_step_time_s"] == step.plan.estimated_step_time_s
    assert rec["cost_model_error"] == pytest.approx((rec["predicted_step_time_s"] - 1.5) / 1.5)
    assert lines == [summary_line(rec)] and "flexsp iteration       10 | plan flexsp (planner" in lines[0]
    names = {name for name, _, it in writer.scalars if it == 10}
    assert {"flexsp/predicted-fwd-bwd-time", "flexsp/measured-fwd-bwd-time", "flexsp/cost-model-error",
            "flexsp/num-microbatches", "flexsp/max-sp-degree", "flexsp/plan-fallback"} <= names
    saved = json.loads(log.read_text())
    assert saved["plan"]["kind"] == "flexsp" and saved["iteration"] == 10
    # off the log interval: no line, still TensorBoard and the planner log
    report_step(step, 1.0, [1.0 / n] * n, args=Namespace(curr_iteration=10, log_interval=5, planner_log=str(log)),
                writer=writer, printer=lines.append)
    assert len(lines) == 1 and len(log.read_text().splitlines()) == 2


def test_planner_log_records_have_trains_schema():
    """One step-record schema (runtime/records.py): a Megatron-LM record holds every key `train`'s
    does, with the same values for the same step."""
    from megatron_ext.megatron.step import step_record
    from megatron_ext.runtime import records

    step = _step()
    n = len(step.plan.micro_batches)
    ranks = [[1.5 / n] * n] * step.plan.num_gpus
    rec = step_record(step, 8, 1.5, ranks)
    common = records.step_record(step.plan, step.lengths, step=step.step, tokens=int(step.trained_lengths.sum()),
                                 step_time_s=1.5, rank_micro_batch_s=ranks, plan_source=step.plan_source)
    assert {k: rec[k] for k in common} == common
    assert "measured_step_s" not in rec and "predicted_step_s" not in rec


def test_report_reads_the_planner_log(tmp_path, capsys):
    """`megatron-ext report plans.jsonl`: the cost model's error over a Megatron-LM run."""
    from megatron_ext.commands.cli import main
    from megatron_ext.data.loader import Step
    from megatron_ext.megatron.cost import load_cost_model
    from megatron_ext.megatron.step import report_step
    from megatron_ext.planner import PlannerOptions, make_plan
    from megatron_ext.commands.report import fidelity, load_run

    step = _step()
    log = tmp_path / "plans.jsonl"
    n = len(step.plan.micro_batches)
    predicted = step.plan.estimated_step_time_s
    for k, scale in enumerate([9.0, 1 / 1.1, 1 / 0.9, 1 / 1.1]):  # errors (p - m) / m: (first left out) +10% -10% +10%
        measured = predicted * scale
        report_step(step, measured, [measured / n] * n, writer=None, printer=lambda line: None,
                    args=Namespace(curr_iteration=k, log_interval=1, planner_log=str(log)))
    lengths = np.array([3000, 300, 200, 50])
    plan = make_plan("elastic_pp", lengths, load_cost_model(str(ROOT / "configs/megatron/cost/tiny-cpu4.yaml")),
                     PlannerOptions(pp=2, sp=1))
    elastic = Step(3, plan, [np.arange(n) for n in lengths], lengths,
                   np.stack([np.arange(4), np.zeros(4, int), lengths], axis=1), "d1g3st", "planner", 0.002)
    t = plan.estimated_step_time_s / 1.1
    report_step(elastic, t, [t, t], writer=None, printer=lambda line: None,
                args=Namespace(curr_iteration=4, log_interval=1, planner_log=str(log)))
    f = fidelity(load_run(log))
    assert f["steps"] == 4 and f["step_median_abs_error"] == pytest.approx(0.1)
    assert f["step_bias"] == pytest.approx(0.1) and f["micro_batch_median_abs_error"] is not None
    assert f["layouts"] == {"flexsp": 3, "pp2 x sp1 x dp2": 1}
    assert main(["report", str(log)]) == 0
    out = capsys.readouterr().out
    assert "4 steps (the first is left out); ran 3 flexsp, 1 pp2 x sp1 x dp2" in out
    assert "step time error:        median 10.0%" in out and "the cost model fits this run" in out


@pytest.mark.parametrize("sp, layout", [(2, "x 2 stages x SP 2 |"), (1, "x 2 stages x SP 1 over 2 replicas |")])
def test_elastic_step_record_line_and_scalars(tmp_path, sp, layout):
    from megatron_ext.data.loader import Step
    from megatron_ext.megatron.cost import load_cost_model
    from megatron_ext.megatron.step import report_step
    from megatron_ext.planner import PlannerOptions, make_plan

    lengths = np.array([3000, 300, 200, 50])
    plan = make_plan("elastic_pp", lengths, load_cost_model(str(ROOT / "configs/megatron/cost/tiny-cpu4.yaml")),
                     PlannerOptions(pp=2, sp=sp))
    step = Step(3, plan, [np.arange(n) for n in lengths], lengths,
                np.stack([np.arange(4), np.zeros(4, int), lengths], axis=1), "d1g3st", "planner", 0.002)
    lines, writer = [], FakeWriter()
    log = tmp_path / "plans.jsonl"
    rec = report_step(step, 2.0, [1.2, 1.5], args=Namespace(curr_iteration=3, log_interval=1, planner_log=str(log)),
                      writer=writer, printer=lines.append)
    chunks = sum(len(p.chunks) for p in plan.pipelines)
    assert rec["kind"] == "elastic_pp" and rec["micro_batches"] == chunks and rec["measured_stage_busy_s"] == [1.2, 1.5]
    assert rec["pipelines"][0]["stages"] == 2 and rec["pipelines"][0]["sp_degree"] == sp
    assert rec["replicas"] == 2 // sp
    assert [p["replica"] for p in rec["pipelines"]] == [p.replica for p in plan.pipelines]
    sliced = sum(any(x.start > 0 or x.end < lengths[x.seq_id] for x in c.pieces) for p in plan.pipelines
                 for c in p.chunks)
    assert sum(p["sliced_chunks"] for p in rec["pipelines"]) == sliced
    assert lines[0].startswith(" elastic-pp iteration        4 | plan elastic_pp (planner")
    recomputed = sum(sum(c.recompute_layers_per_stage or []) for p in plan.pipelines for c in p.chunks)
    assert f"{layout} chunks {chunks} ({sliced} with slices) | recomputed layers {recomputed} |" in lines[0]
    names = {name for name, _, _ in writer.scalars}
    assert {"elastic-pp/num-microbatches", "elastic-pp/max-sp-degree", "elastic-pp/recomputed-layers",
            "elastic-pp/measured-fwd-bwd-time"} <= names
    assert json.loads(log.read_text())["plan"]["kind"] == "elastic_pp"


def test_pad_id_falls_back_to_eod():
    from megatron_ext.megatron.step import _pad_id

    class NoPad:
        eod = 7

        @property
        def pad(self):
            raise NotImplementedError

    assert _pad_id(NoPad()) == 7 and _pad_id(types.SimpleNamespace(pad=3, eod=7)) == 3
    assert _pad_id(object()) == 0


# ---- hooks ------------------------------------------------------------------------------------------
@pytest.fixture
def fake_megatron_args(monkeypatch):
    """A stand-in megatron.training module whose get_args returns a namespace we control, with a
    training module whose FLOPs count has the shape of Megatron's: per sample of --seq-length
    tokens, a linear term and attention's quadratic one (and, like Megatron's, it sets a field of
    its args)."""
    state = Namespace(flexsp=False)
    mod = types.ModuleType("megatron.training")
    mod.get_args = lambda: state

    def num_floating_point_operations(args, batch_size):
        args.num_query_groups = 4
        return batch_size * args.seq_length * (100.0 + 3.0 * args.seq_length)

    mod.training = types.SimpleNamespace(num_floating_point_operations=num_floating_point_operations)
    mod.checkpointing = types.SimpleNamespace(check_checkpoint_args=lambda checkpoint_args: None)
    monkeypatch.setitem(sys.modules, "megatron.training", mod)
    return state


def test_a_resume_that_would_cut_documents_otherwise_is_refused(fake_megatron_args, monkeypatch):
    """Megatron's check of a resumed checkpoint's arguments keeps them; the planned data records
    the length it cuts documents at in the run's arguments (saved with every checkpoint) and
    refuses a resume that would cut at another (another GPU count under a capped --seq-length)."""
    from megatron_ext.data.datasets import DataError
    from megatron_ext.megatron import step as mstep
    from megatron_ext.megatron.hooks import wrap_pretrain_gpt

    checkpointing = sys.modules["megatron.training"].checkpointing
    seen = []
    monkeypatch.setattr(checkpointing, "check_checkpoint_args", seen.append)
    monkeypatch.setattr(mstep.STATE, "checkpoint_args", None)
    wrap_pretrain_gpt(lambda n: None, lambda *a, **k: None, lambda it, m: None)
    args = Namespace(seq_length=8192)
    mstep.check_sample_cut(args, 3810, "--flexsp")  # a fresh run: nothing to compare, the cut recorded
    assert args.planned_max_seq_len == 3810
    checkpointing.check_checkpoint_args(args)  # load_checkpoint's call on resuming
    assert seen == [args] and mstep.STATE.checkpoint_args is args
    mstep.check_sample_cut(Namespace(seq_length=8192), 3810, "--flexsp")  # the same cut: resumes
    with pytest.raises(DataError, match="cut documents into samples of at most 3,810 tokens, this one would cut "
                                        "them at 7,072 .*: resume on the GPU count it was saved with, or with "
                                        "--seq-length 3810$"):
        mstep.check_sample_cut(Namespace(seq_length=8192), 7072, "--flexsp")
    with pytest.raises(DataError, match=r"at 2,048 \(--seq-length 2048\), .*: resume with --seq-length 3810$"):
        mstep.check_sample_cut(Namespace(seq_length=2048), 2048, "--flexsp")


def test_hooks_call_megatrons_functions_without_flexsp(fake_megatron_args, monkeypatch):
    from megatron_ext.megatron.hooks import wrap_pretrain_gpt
    from megatron_ext.megatron.step import elastic_forward_backward, flexsp_forward_backward

    calls = []

    def datasets(num_samples, vp_stage=None):
        calls.append(("datasets", num_samples, vp_stage))
        return "train", "valid", "test"

    datasets.is_distributed = True

    def builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
        calls.append(("builder", pre_process))
        return "model"

    def forward_step(data_iterator, model):
        calls.append(("forward", data_iterator, model))
        return "out"

    ds, build, fwd, extra = wrap_pretrain_gpt(datasets, builder, forward_step, None)
    assert ds([1, 2, 3], vp_stage=0) == ("train", "valid", "test") and ds.is_distributed
    assert build(fake_megatron_args, True, True) == "model"
    assert fwd("it", "m") == "out"
    assert calls == [("datasets", [1, 2, 3], 0), ("builder", True), ("forward", "it", "m")]
    import megatron.core.pipeline_parallel as pp

    monkeypatch.setattr(pp, "get_forward_backward_func", lambda: "megatron's schedule")
    assert fwd.get_forward_backward_func() == "megatron's schedule"
    fake_megatron_args.flexsp = True
    assert fwd.get_forward_backward_func() is flexsp_forward_backward
    with pytest.raises(RuntimeError, match="training.py is not patched"):
        fwd("it", "m")
    fake_megatron_args.flexsp, fake_megatron_args.elastic_pp = False, True
    assert fwd.get_forward_backward_func() is elastic_forward_backward and ds.is_distributed
    with pytest.raises(RuntimeError, match="--elastic-pp: .*training.py is not patched"):
        fwd("it", "m")
    assert callable(extra)


def test_megatron_flops_count_the_documents_the_last_step_trained(fake_megatron_args, monkeypatch):
    """Megatron's FLOPs count (its TFLOP/s/GPU line) takes every sample as --seq-length tokens; in a
    planned run it is the count of each document the last training step trained, at its length."""
    from megatron_ext.megatron import step as mstep
    from megatron_ext.megatron.hooks import wrap_pretrain_gpt

    training = sys.modules["megatron.training"].training
    stock = training.num_floating_point_operations
    wrap_pretrain_gpt(lambda n: None, lambda *a, **k: None, lambda it, m: None)
    wrap_pretrain_gpt(lambda n: None, lambda *a, **k: None, lambda it, m: None)  # a second import wraps once
    count = training.num_floating_point_operations
    assert count is not stock and count.stock is stock
    static = Namespace(flexsp=False, elastic_pp=False, seq_length=1024)
    assert count(static, 8) == 8 * 1024 * (100 + 3 * 1024)
    monkeypatch.setattr(mstep.STATE, "last_step", None)
    planned = Namespace(flexsp=True, elastic_pp=False, seq_length=1024)
    assert count(planned, 8) == 8 * 1024 * (100 + 3 * 1024)  # before the first step: Megatron's own
    step = _step()
    step = dataclasses.replace(step, lengths=np.array([900, 300, 300, 50]),
                               plan=dataclasses.replace(step.plan, dropped_seq_ids=[3]))
    mstep.report_step(step, 1.0, [0.5, 0.5], args=Namespace(curr_iteration=0, log_interval=1, planner_log=None),
                      writer=None, printer=lambda line: None)
    planned = Namespace(flexsp=True, elastic_pp=False, seq_length=1024)
    first = sum(s * (100 + 3 * s) for s in (900, 300, 300))
    assert count(planned, 4) == first
    assert planned.seq_length == 1024 and not hasattr(planned, "num_query_groups")  # Megatron's args stay
    assert count(static, 8) == 8 * 1024 * (100 + 3 * 1024)  # not planned: Megatron's own
    # the next step, then Megatron's log: the throughput's count is the mean step of the interval
    step = dataclasses.replace(step, lengths=np.array([2000, 10, 10, 10]))
    mstep.report_step(step, 1.0, [0.5, 0.5], args=Namespace(curr_iteration=1, log_interval=2, planner_log=None),
                      writer=None, printer=lambda line: None)
    second = sum(s * (100 + 3 * s) for s in (2000, 10, 10))
    assert count(planned, 4) == second  # the iteration's own count (Megatron's FLOPs so far)
    assert count(planned, 4) == (first + second) / 2  # training_log's
    assert count(planned, 4) == 0.0  # (no step since that log)


# ---- the model swap, on one rank ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    import torch.distributed as dist

    from megatron_ext.runtime.compat import apply_cpu_compat

    apply_cpu_compat()
    from megatron.core import parallel_state

    init = f"file://{tmp_path_factory.mktemp('rdzv') / 'store'}"
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_ulysses_swap_keeps_parameters_and_outputs(one_rank):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.megatron.model import ulysses_model_builder, use_ulysses_attention
    from megatron_ext.runtime.attention import UlyssesAttention, UlyssesPackedSeqParams

    def build(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
        torch.manual_seed(3)
        model_parallel_cuda_manual_seed(3)
        cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                                ffn_hidden_size=128, hidden_dropout=0.0, attention_dropout=0.0,
                                use_cpu_initialization=True)
        return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=64,
                        position_embedding_type="rope")

    stock = build(None, True, True)
    flex = ulysses_model_builder(build)(Namespace(flexsp=True, flexsp_attention_backend="sdpa"), True, True)
    assert [n for n, _ in stock.named_parameters()] == [n for n, _ in flex.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(stock.parameters(), flex.parameters()))
    assert sum(isinstance(m, UlyssesAttention) for m in flex.modules()) == 2
    assert use_ulysses_attention(flex) == 0  # idempotent
    plain = ulysses_model_builder(build)(Namespace(flexsp=False), True, True)
    assert not any(isinstance(m, UlyssesAttention) for m in plain.modules())

    tokens = torch.randint(0, 128, (1, 48))
    with torch.no_grad():
        ref = stock(tokens, torch.arange(48)[None], None, labels=tokens)
        # two documents packed: each gives what it gives alone
        params = UlyssesPackedSeqParams.build([30, 18])
        out = flex(tokens, params.position_ids[None], None, labels=tokens, packed_seq_params=params)
        alone = stock(tokens[:, 30:], torch.arange(18)[None], None, labels=tokens[:, 30:])
    assert torch.allclose(out[:, :29], ref[:, :29], atol=1e-5)
    assert torch.allclose(out[:, 30:47], alone[:, :17], atol=1e-5)


# ---- idle micro-batches under DDP with --overlap-grad-reduce (2 gloo ranks, a subprocess) --------------
IDLE_SCRIPT = r'''
import os, sys, tempfile
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, world, init, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from megatron_ext.runtime.compat import apply_cpu_compat
    apply_cpu_compat()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_ext.data.loader import Step
    from megatron_ext.megatron import step as mstep
    from megatron_ext.megatron.model import use_ulysses_attention
    from megatron_ext.plan.schema import MicroBatchPlan, SPGroup, StepPlan
    from megatron_ext.runtime.groups import SPGroupPool

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               hidden_dropout=0.0, attention_dropout=0.0, calculate_per_token_loss=True,
                               use_cpu_initialization=True)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=256,
                     position_embedding_type="rope")
    # the reference: megatron's stock model, the same weights, each sequence alone in one process
    ref = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=256,
                   position_embedding_type="rope")
    ref.load_state_dict(model.state_dict())
    use_ulysses_attention(model, "sdpa")
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=2000,
                                                                        grad_reduce_in_fp32=True), model)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    mstep.STATE.pool, mstep.STATE.pad_id, mstep.STATE.device = SPGroupPool(), 0, "cpu"
    mstep.report_step = lambda *a, **k: None  # no Megatron-LM here
    mstep._args = lambda: __import__("types").SimpleNamespace(check_for_nan_in_loss_and_grad=True)
    import megatron.core.rerun_state_machine as rsm
    rsm.initialize_rerun_state_machine(mode=rsm.RerunMode.DISABLED)
    rng = np.random.default_rng(1)
    lengths = np.array([40, 25, 60])
    batch = [rng.integers(0, 64, n) for n in lengths]
    plans = {  # "full" first: DDP records every parameter's gradient-ready count in its first batch
        "full": [MicroBatchPlan([SPGroup([0, 1], [0, 1, 2])])],
        # then rank 1 is idle in the last micro-batch: its hooks must still fire there, or DDP
        # asserts "Communication call has not been issued for this bucket"
        "idle": [MicroBatchPlan([SPGroup([0], [0]), SPGroup([1], [1])]), MicroBatchPlan([SPGroup([0], [2])])],
    }
    total = sum(ref(torch.from_numpy(t[None, :-1]), torch.arange(len(t) - 1)[None], None,
                    labels=torch.from_numpy(t[None, 1:])).sum() for t in batch)
    count = int(sum(lengths - 1))
    (total / count).backward()
    losses = {"reference": float(total / count)}
    grads = {"reference": torch.cat([dict(ref.named_parameters())[n].grad.reshape(-1)
                                     for n, _ in model.named_parameters()])}
    for name, mbs in plans.items():
        for _ in range(2):  # the second step runs DDP's steady state (after its first-batch bookkeeping)
            ddp.zero_grad_buffer()
            step = Step(0, StepPlan("flexsp", 2, "test", mbs), batch, lengths, np.zeros((3, 3), int), "", "t", 0.0)
            reported = mstep.flexsp_forward_backward(data_iterator=iter([step]), model=[ddp], forward_only=False)
        total = torch.stack([d["lm loss"] for d in reported]).sum(0)
        dist.all_reduce(total)
        losses[name] = float(total[0] / total[1])
        grads[name] = torch.cat([p.main_grad.reshape(-1).clone() for p in ddp.module.parameters()])
    torch.save({"losses": losses, "grads": grads}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1]
    mp.spawn(run, args=(2, f"file://{out}/store", out), nprocs=2)
'''


def test_idle_micro_batches_with_overlapped_grad_reduce(tmp_path):
    import os
    import subprocess

    import torch

    script = tmp_path / "idle.py"
    script.write_text(IDLE_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for res in results:
        for plan in ("full", "idle"):
            assert res["losses"][plan] == pytest.approx(res["losses"]["reference"], rel=1e-6), plan
            torch.testing.assert_close(res["grads"][plan], res["grads"]["reference"], atol=3e-6, rtol=1e-4)
    assert torch.equal(results[0]["grads"]["idle"], results[1]["grads"]["idle"])


def test_bf16_stage_is_megatrons_float16_module(one_rank):
    """profile's bf16 model: every parameter bf16 (CUDA's layer_norm refuses an fp32 norm weight
    under bf16 input), fp32 loss out, the same forward as the fp32 model cast by hand."""
    import torch
    from megatron.core.transformer.module import Float16Module
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_ext.runtime.attention import UlyssesPackedSeqParams
    from megatron_ext.runtime.pipeline_model import build_pipeline_model, unwrap_model
    from small_cost import small_cost

    spec = small_cost().model
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    half, _ = build_pipeline_model(spec, 128, 64, "sdpa", ddp=False, params_dtype=torch.bfloat16,
                                   pipeline_dtype=torch.bfloat16, bf16=True)
    assert isinstance(half, Float16Module)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    full, _ = build_pipeline_model(spec, 128, 64, "sdpa", ddp=False)
    unwrap_model(half).load_state_dict({k: v.bfloat16() for k, v in full.state_dict().items() if v is not None})
    tokens = torch.randint(0, 128, (1, 40))
    params = UlyssesPackedSeqParams.build([40])
    with torch.no_grad():
        loss = half(tokens, params.position_ids[None], None, labels=tokens, packed_seq_params=params)
        fp32 = full(tokens, params.position_ids[None], None, labels=tokens, packed_seq_params=params)
        ref = full.bfloat16()(tokens, params.position_ids[None], None, labels=tokens, packed_seq_params=params)
    assert loss.dtype == torch.float32
    assert torch.equal(loss, ref.float())
    # the fp32 model lands within 1e-3 of it: only exact equality shows the stage ran in bf16
    assert not torch.equal(loss, fp32)


def test_the_model_yaml_shape_and_recompute_are_built(one_rank):
    """A model YAML's swiglu builds LLaMA's gated MLP (three FFN matrices, as params_b counts them),
    and its recompute: full runs Megatron's full recompute of that many layers under FlexSP, with
    the gradients of the model that keeps every activation."""
    import dataclasses

    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_ext.runtime.attention import UlyssesPackedSeqParams
    from megatron_ext.runtime.pipeline_model import build_pipeline_model
    from megatron_ext.runtime.train import model_recompute
    from small_cost import small_cost

    spec = dataclasses.replace(small_cost().model, swiglu=True, recompute="full", recompute_layers=1)
    ffn, h = spec.ffn_hidden_size or 4 * spec.hidden_size, spec.hidden_size
    grads, runs = [], []
    for overrides in ({}, model_recompute(spec)):
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        model, config = build_pipeline_model(spec, 128, 64, "sdpa", ddp=False, **overrides)
        fc1 = model.decoder.layers[0].mlp.linear_fc1.weight
        assert tuple(fc1.shape) == (2 * ffn, h)  # gate and up
        tokens = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
        params = UlyssesPackedSeqParams.build([40])
        calls = [0] * len(model.decoder.layers)
        for i, layer in enumerate(model.decoder.layers):
            layer.mlp.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        model(tokens, params.position_ids[None], None, labels=tokens, packed_seq_params=params).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        runs.append(calls)
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "block", 1)
    # the first layer's forward ran again for its backward
    assert runs == [[1] * spec.num_layers, [2] + [1] * (spec.num_layers - 1)]
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)
    assert model_recompute(dataclasses.replace(spec, recompute="none")) == {}


def test_an_elastic_step_reads_only_the_sequences_its_rank_runs(one_rank):
    """The executor takes each sequence's length from the step, not from the batch: a rank reads
    the tokens of its own chunks only (``data.loader.BatchTokens`` reads a sequence when asked)."""
    import collections.abc

    import torch

    from megatron_ext.cost import CostModel
    from megatron_ext.plan.schema import Chunk, Piece, Pipeline, StepPlan
    from megatron_ext.runtime.pipeline import forward_backward_elastic
    from megatron_ext.runtime.pipeline_model import build_pipeline_model

    class Counted(collections.abc.Sequence):
        def __init__(self, seqs):
            self.seqs, self.read = seqs, set()

        def __len__(self):
            return len(self.seqs)

        def __getitem__(self, i):
            self.read.add(i)
            return self.seqs[i]

    torch.manual_seed(0)
    model, _ = build_pipeline_model(CostModel.from_presets("tiny", "cpu-4").model, 97, 64, "sdpa")
    rng = np.random.default_rng(0)
    batch = Counted([rng.integers(0, 97, n) for n in (20, 30, 40, 50)])
    plan = StepPlan(kind="elastic_pp", num_gpus=1, planner="t",
                    pipelines=[Pipeline(1, 1, [Chunk(0, [Piece(0, 0, 20)])], [["F0", "B0"]])])
    forward_backward_elastic(plan, batch, model, lengths=[20, 30, 40, 50])
    assert batch.read == {0}
