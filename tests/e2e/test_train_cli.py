"""`megatron-ext train` end to end: real training on 4 CPU ranks (torchrun + gloo) with per-step
plans. Five launches: flexsp, static_ulysses, a 2-stage elastic pipeline of SP 2, two replicas
of a 2-stage pipeline of SP 1 and auto (per step FlexSP or one-stage pipeline replicas, on the
same model) on the same seed must report the same loss and grad norm at every step (one function
computed, whatever the layout). Two more launches do the same for groups with a ring, on a model
with 2 KV heads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest

CLI = [sys.executable, "-m", "megatron_ext.commands.cli"]
ARGS = ["train", "--steps", "3", "--global-batch", "6", "--max-seq-len", "2048", "--seed", "7", "--json"]


def _train(planner: str, *extra: str) -> list[dict]:
    # the ranks under NCCL's rules (runtime/device.py): a host tensor in our collectives fails the run
    done = subprocess.run([*CLI, *ARGS, "--planner", planner, *extra], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, MEGATRON_EXT_DEVICE_CHECK="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Warning" not in done.stderr, done.stderr[-3000:]  # (e.g. a collective on a group of other ranks)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


TRACES: dict[str, str] = {}  # --trace files of the runs below, by run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    traces = tmp_path_factory.mktemp("traces")
    TRACES.update(flexsp=str(traces / "flexsp.json"), elastic_pp=str(traces / "elastic_pp.json"))
    runs = {"flexsp": _train("flexsp", "--trace", TRACES["flexsp"]), "static_ulysses": _train("static_ulysses")}
    runs["elastic_pp"] = _train("elastic_pp", "--pp", "2", "--trace", TRACES["elastic_pp"])
    runs["elastic_pp replicas"] = _train("elastic_pp", "--pp", "2", "--sp", "1")
    runs["auto"] = _train("auto")
    return runs


def test_ring_groups_train_the_same_function(tmp_path):
    # 2 KV heads: Ulysses up to 2, so --max-ring 2's degree-4 groups are Ulysses 2 x ring 2
    from megatron_ext.spec import PRESET_DIR

    model = tmp_path / "tiny-kv2.yaml"
    model.write_text((PRESET_DIR / "models" / "tiny.yaml").read_text().replace("num_query_groups: 4",
                                                                                "num_query_groups: 2"))
    ring = _train("static_ulysses", "--model", str(model), "--max-ring", "2")
    plain = _train("static_ulysses", "--model", str(model), "--static-degree", "2")
    assert {d for r in ring for d in r["degrees"]} == {4} and {d for r in plain for d in r["degrees"]} == {2}
    for x, y in zip(ring, plain, strict=True):
        assert x["tokens"] == y["tokens"]
        assert abs(x["loss"] - y["loss"]) / y["loss"] < 1e-4, (x, y)
        assert abs(x["grad_norm"] - y["grad_norm"]) / y["grad_norm"] < 1e-4, (x, y)


def test_records_have_the_contract_keys(runs):
    for recs in runs.values():
        assert [r["step"] for r in recs] == [0, 1, 2]
        for r in recs:
            for key in ("step", "loss", "grad_norm", "tokens", "step_time_s", "predicted_step_time_s", "degrees"):
                assert key in r
            assert r["tokens"] > 0 and r["step_time_s"] > 0 and r["loss"] > 0


@pytest.mark.parametrize("other", ["static_ulysses", "elastic_pp", "elastic_pp replicas", "auto"])
def test_same_loss_and_grad_norm_every_step(runs, other):
    a, b = runs["flexsp"], runs[other]
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) / y["loss"] < 1e-4, (x, y)
        assert abs(x["grad_norm"] - y["grad_norm"]) / y["grad_norm"] < 1e-4, (x, y)
    assert a[-1]["loss"] < a[0]["loss"], "three steps of Adam should lower the loss"


@pytest.mark.parametrize("run", ["flexsp", "elastic_pp"])
def test_trace_holds_every_step_planned_and_measured(runs, run):
    """--trace: two processes (planned, measured) with the same tracks; each step's slices start
    with the step's instant event and name the same groups (FlexSP) or ops (pipelines)."""
    events = json.loads(open(TRACES[run]).read())["traceEvents"]
    tracks = {pid: sorted(e["tid"] for e in events if e["ph"] == "M" and e["pid"] == pid
                          and e["name"] == "thread_name") for pid in (1, 2)}
    assert tracks[1] and tracks[1] == tracks[2]
    steps = sorted((e["ts"], e["name"]) for e in events if e["ph"] == "i")
    assert [name for _, name in steps] == ["step 0", "step 1", "step 2"]
    starts = [ts for ts, _ in steps] + [float("inf")]
    for k, rec in enumerate(runs[run]):
        mine = [e for e in events if e["ph"] == "X" and starts[k] <= e["ts"] < starts[k + 1]]
        planned = {(e["tid"], e["name"]) for e in mine if e["pid"] == 1 and e["cat"] != "p2p"}
        measured = {(e["tid"], e["name"]) for e in mine if e["pid"] == 2}
        # pipelines: the simulator draws a recompute apart; the runtime times it inside its backward
        assert measured == {(t, n) for t, n in planned if not n.startswith("R")}, (k, planned ^ measured)
        if run == "flexsp":  # each group from its last rank's start: the record's micro-batch is its slowest group
            spans = defaultdict(list)
            for e in mine:
                if e["pid"] == 2:
                    spans[(e["args"]["micro_batch"], e["ts"])].append(e["ts"] + e["dur"])
            took = [max(end - ts for (m, ts), ends in spans.items() if m == i for end in ends)
                    for i in range(rec["micro_batches"])]
            assert took == pytest.approx([t * 1e6 for t in rec["micro_batch_times_s"]], rel=1e-6, abs=1e-2)


def test_auto_runs_each_step_as_the_kind_it_planned(runs):
    """FlexSP steps report micro-batches, one-stage pipeline steps their stage records (one row
    per replica); which kind a step gets is the planner's choice (on this seed both, when the
    machine is idle)."""
    for r in runs["auto"]:
        assert r["planner"] == "auto" and r["kind"] in ("flexsp", "elastic_pp")
        if r["kind"] == "elastic_pp":  # a row per replica: 4 ranks / its SP degree
            assert r["stages"] == 1 and len(r["ops_per_stage"]) == 4 // r["degrees"][0]
            assert max(r["activation_peak_mb_per_stage"]) <= r["activation_room_mb"], r
            assert all(measured > 0 and predicted > 0 for ops in r["ops_per_stage"] for _, measured, predicted in ops)
        else:
            assert "stages" not in r and r["micro_batch_times_s"]


def test_auto_lines_name_each_steps_layout(runs):
    from megatron_ext.commands.train import _line, _summary, compare_table

    def name(r):  # (a late plan is BatchAda's fallback, and its line says so instead)
        if r["kind"] == "flexsp":
            return "flexsp" if r["planner"] == "auto" else r["planner"]
        sp = r["degrees"][0]
        return f"pp1 x sp{sp}" + (f" x dp{4 // sp}" if sp < 4 else "")

    def counts(recs):
        names = [name(r) for r in recs]
        return ", ".join(f"{names.count(n)} {n}" for n in sorted(set(names), key=lambda n: (-names.count(n),
                                                                                          names.index(n))))

    for r in runs["auto"]:
        if r["planner"] == "auto":
            assert _line(r).startswith(f"step {r['step']:>3}  [{name(r)}]  loss ")
    assert _summary("auto", runs["auto"]).startswith(f"auto: 3 steps ({counts(runs['auto'])})")
    assert "[" not in _line(runs["flexsp"][0]) and "steps (" not in _summary("flexsp", runs["flexsp"])
    # train --compare: what each run ran, in its last column
    table = compare_table({"flexsp": runs["flexsp"], "auto": runs["auto"]}).splitlines()
    assert table[0].endswith("  ran") and table[2].startswith("auto ")
    assert table[1].endswith("  " + counts(runs["flexsp"])) and table[2].endswith("  " + counts(runs["auto"]))


def test_pipeline_run_used_two_stages_of_sp2(runs):
    assert all(r["degrees"] == [2] and r["planner"] == "elastic_pp" for r in runs["elastic_pp"])
    for r in runs["elastic_pp"]:
        _check_stage_records(r)


def test_pipeline_replicas_report_each_replicas_stages(runs):
    for r in runs["elastic_pp replicas"]:
        assert r["degrees"] == [1]
        # rows: replica 0's two stages, then replica 1's; every chunk's F and B once per stage
        assert len(r["activation_peak_mb_per_stage"]) == 4 and len(r["ops_per_stage"]) == 4
        for p in (0, 1):
            ops = r["ops_per_stage"][p] + r["ops_per_stage"][2 + p]
            assert len(ops) == 2 * r["micro_batches"]
            assert all(measured > 0 and predicted > 0 for _, measured, predicted in ops)
        assert max(r["activation_peak_mb_per_stage"]) <= r["activation_room_mb"]


def _check_stage_records(r: dict) -> None:
    """Measured activation memory of each stage (bytes saved for backward by the chunks in flight,
    plus the prefix K/V cache) within the activation room the planner was given; every stage's
    every operation timed and paired with the simulator's prediction."""
    assert len(r["activation_peak_mb_per_stage"]) == 2 and min(r["activation_peak_mb_per_stage"]) > 0
    assert max(r["activation_peak_mb_per_stage"]) <= r["activation_room_mb"], r
    assert max(r["planned_activation_mb_per_stage"]) <= r["activation_room_mb"] * (1 + 1e-9)
    for ops in r["ops_per_stage"]:
        names = [op for op, _, _ in ops]
        assert sorted(names) == sorted([f"F{c}" for c in range(r["micro_batches"])] + [f"B{c}" for c in range(r["micro_batches"])])
        assert all(measured > 0 and predicted > 0 for _, measured, predicted in ops)


LONG = ["train", "--steps", "2", "--global-batch", "4", "--max-seq-len", "6144", "--seed", "3", "--pp", "2", "--json"]


def test_a_sequence_too_long_for_unsliced_pipelines_trains_when_sliced():
    """Documents cut at 6,144 tokens: more than a 2-stage pipeline of SP 2 holds unsliced (batch
    1F1B's packs hold 4,096 even with full recompute: refused before any rank starts); elastic_pp
    slices them and trains, within memory."""
    done = subprocess.run([*CLI, *LONG, "--planner", "elastic_pp"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    recs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["plan_source"] for r in recs] == ["planner", "planner"]
    assert max(r["longest_sequence"] for r in recs) > 5000 and all(r["loss"] > 0 for r in recs)
    for r in recs:
        _check_stage_records(r)
    unsliced = subprocess.run([*CLI, *LONG, "--planner", "batch_1f1b"], capture_output=True, text=True, timeout=600)
    assert unsliced.returncode == 2 and unsliced.stdout == ""
    assert unsliced.stderr.startswith("megatron-ext: error: --max-seq-len 6144 is over the 4096 tokens a 2-stage "
                                      "pipeline of SP 2 holds in its packs"), unsliced.stderr
    assert "Traceback" not in unsliced.stderr


def test_static_ulysses_uses_only_its_degree(runs):
    assert all(r["degrees"] == [4] for r in runs["static_ulysses"])


def test_flexsp_refuses_a_length_no_group_holds():
    done = subprocess.run([*CLI, "train", "--max-seq-len", "9000", "--steps", "1"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("megatron-ext: error: --max-seq-len 9000")


def test_bad_option_is_one_line_error():
    done = subprocess.run([*CLI, "train", "--no-such-flag"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().startswith("megatron-ext: error:") and "Traceback" not in done.stderr


def test_a_run_dir_holding_a_run_is_refused_unless_resumed(tmp_path):
    """Its steps.jsonl was replaced: the earlier run's records lost."""
    from megatron_ext.commands.train import _check_run_dir

    (tmp_path / "steps.jsonl").write_text('{"step": 0}\n')
    done = subprocess.run([*CLI, "train", "--steps", "1", "--run-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"megatron-ext: error: --run-dir {tmp_path} holds the records of an earlier run")
    assert (tmp_path / "steps.jsonl").read_text() == '{"step": 0}\n'
    _check_run_dir(str(tmp_path), load=str(tmp_path / "ckpt"))  # a resume continues them
    (tmp_path / "steps.jsonl").write_text("")
    _check_run_dir(str(tmp_path), load=None)  # (a run that trained no step)


@pytest.mark.parametrize("argv, match", [
    (["--planner", "elastic_pp", "--pp", "2", "--sp", "3"], "SP degree 3 is not allowed for tiny on cpu-4"),
    (["--sp", "2"], "--sp applies only to pipeline planners (elastic_pp, batch_1f1b, seq1f1b, auto)"),
    (["--planner", "elastic_pp", "--pp", "2", "--sp", "1"],
     "--max-seq-len 4096 is over the 3431 tokens a 2-stage pipeline of SP 1 holds even at the finest slicing"),
])
def test_bad_pipeline_layout_is_refused_before_launching(argv, match):
    done = subprocess.run([*CLI, "train", "--steps", "1", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("megatron-ext: error: ") and match in done.stderr


@pytest.mark.parametrize("argv, match", [
    (["--pp", "0"], "--pp 0 must divide the 4 ranks and the 2 layers"),
    (["--pp", "2", "--sp", "4"], "pp 2 x sp 4 = 8 GPUs does not divide the 4 GPUs of cpu-4"),
    (["--pp", "2", "--sp", "0"], "SP degree 0 is not allowed for tiny on cpu-4"),
])
def test_check_args_refuses_layouts_the_ranks_cannot_hold(argv, match):
    from megatron_ext.cost import CostModel
    from megatron_ext.errors import ConfigError
    from megatron_ext.commands.train import build_parser
    from megatron_ext.runtime.train import check_args

    args = build_parser().parse_args(["--planner", "elastic_pp", "--max-seq-len", "2048", *argv])
    with pytest.raises(ConfigError, match=match):
        check_args(args, CostModel.from_presets("tiny", "cpu-4"), 4)


def test_check_args_runs_replicas_when_sp_is_below_ranks_per_stage():
    from megatron_ext.cost import CostModel
    from megatron_ext.commands.train import build_parser
    from megatron_ext.runtime.train import check_args, stage_sp

    cost = CostModel.from_presets("tiny", "cpu-4")
    for argv, sp in ((["--pp", "2"], 2), (["--pp", "2", "--sp", "1"], 1), (["--sp", "2"], 2)):
        args = build_parser().parse_args(["--planner", "elastic_pp", "--max-seq-len", "2048", *argv])
        assert check_args(args, cost, 4) and stage_sp(args, cost) == sp


@pytest.mark.parametrize("argv, match", [
    (["--planner", "static_ulysses", "--static-degree", "3"], "SP degree 3 is not allowed for tiny on cpu-4"),
    (["--planner", "flexsp", "--static-degree", "8"], "SP degree 8 is not allowed"),
    (["--planner", "static_ulysses", "--static-degree", "1"], "over the 2028 tokens a group of --static-degree 1"),
])
def test_check_args_refuses_a_static_degree_that_cannot_run(argv, match):
    """Not a silent fallback to BatchAda on every step."""
    from megatron_ext.cost import CostModel
    from megatron_ext.errors import ConfigError
    from megatron_ext.commands.train import build_parser
    from megatron_ext.runtime.train import check_args

    cost = CostModel.from_presets("tiny", "cpu-4")
    with pytest.raises(ConfigError, match=match):
        check_args(build_parser().parse_args(["--max-seq-len", "2048", *argv]), cost, 4)
    argv[-1] = "2"  # a degree that holds 2048 tokens runs, under any planner (--compare passes it to all)
    assert not check_args(build_parser().parse_args(["--max-seq-len", "2048", *argv]), cost, 4)


@pytest.mark.parametrize("argv, layout", [
    ([], "planner flexsp (SP groups per micro-batch)"),
    (["--planner", "auto"], "planner auto (FlexSP or one-stage pipeline replicas per step)"),
    (["--planner", "auto", "--pp", "2"], "planner auto (pipelines of 2 stages, their SP degree per step)"),
    (["--planner", "elastic_pp", "--pp", "2", "--sp", "1"], "planner elastic_pp (pipelines of 2 stages x SP 1, 2 replicas)"),
])
def test_the_run_says_what_it_trains(argv, layout):
    from megatron_ext.cost import CostModel
    from megatron_ext.commands.train import _header, build_parser
    from megatron_ext.runtime.train import check_args

    cost = CostModel.from_presets("tiny", "cpu-4")
    args = build_parser().parse_args(["--max-seq-len", "2048", "--steps", "1", *argv])
    check_args(args, cost, 4)
    assert _header(args, cost, 4, "C") == (f"train: tiny on cpu-4 (4 ranks), {layout}; 8 sequences a step "
                                           f"of up to 2,048 tokens, 1 step, seed 0; data C")


def test_check_args_takes_auto_at_any_stage_count():
    """auto plans per step, on the run's stages: any --pp, an optional --sp; its length limit is the
    longest either kind runs on those stages."""
    from megatron_ext.cost import CostModel
    from megatron_ext.errors import ConfigError
    from megatron_ext.planner import PlannerOptions
    from megatron_ext.planner.api import max_seq_len
    from megatron_ext.commands.train import build_parser
    from megatron_ext.runtime.train import check_args

    cost = CostModel.from_presets("tiny", "cpu-4")
    for argv in ([], ["--pp", "2"], ["--pp", "1", "--sp", "2"]):
        assert check_args(build_parser().parse_args(["--planner", "auto", "--max-seq-len", "2048", *argv]), cost, 4)
    limit = max_seq_len("auto", cost, PlannerOptions(pp=2))
    args = build_parser().parse_args(["--planner", "auto", "--pp", "2", "--max-seq-len", str(limit + 1)])
    with pytest.raises(ConfigError, match=f"over the {limit} tokens a 2-stage pipeline of any SP degree holds"):
        check_args(args, cost, 4)


# ---- --data: an indexed dataset or a blend ---------------------------------------------------------
def _docs(seed: int, n: int, lo: int, hi: int, top: int = 1000) -> list:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, top, k).astype(np.uint16) for k in rng.integers(lo, hi, n)]


def test_train_on_a_weighted_blend_of_megatron_datasets(tmp_path):
    """A blend of two indexed datasets without a tokenizer manifest (as Megatron's
    preprocess_data.py writes them), with --vocab-size: every step trains the documents
    GlobalBatches draws for that blend."""
    import numpy as np

    from megatron_ext.data.batches import GlobalBatches
    from megatron_ext.data.datasets import IndexedDocuments, write_indexed_dataset

    long = write_indexed_dataset(tmp_path / "long", _docs(1, 20, 800, 1800))
    short = write_indexed_dataset(tmp_path / "short", _docs(2, 80, 10, 300))
    done = subprocess.run([*CLI, "train", "--steps", "2", "--global-batch", "8", "--max-seq-len", "2048", "--seed", "5",
                           "--json", "--data", "0.25", long, "0.75", short, "--vocab-size", "1000"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    recs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    ref = GlobalBatches(np.concatenate([IndexedDocuments(long).lengths, IndexedDocuments(short).lengths]), 8, 2048,
                        5, source_sizes=[20, 80], weights=[0.25, 0.75])
    assert [r["tokens"] for r in recs] == [int((ref.batch_lengths(k) - 1).sum()) for k in range(2)]  # labelled
    assert all(np.isfinite(r["loss"]) for r in recs)


def test_data_it_cannot_train_is_refused_before_launching(tmp_path):
    import numpy as np

    from megatron_ext.cost import CostModel
    from megatron_ext.data.corpus import stdlib_corpus
    from megatron_ext.data.datasets import write_indexed_dataset
    from megatron_ext.errors import ConfigError, MegatronExtError
    from megatron_ext.commands.train import build_parser
    from megatron_ext.runtime.train import check_args, open_training_data

    plain = write_indexed_dataset(tmp_path / "plain", _docs(3, 10, 10, 100) + [np.array([999, 1], np.uint16)])
    byte = stdlib_corpus(tmp_path / "byte", max_files=4, tokenizer="byte")
    bpe = stdlib_corpus(tmp_path / "bpe", max_files=4, vocab_size=300)
    signed = write_indexed_dataset(tmp_path / "signed", [np.array([5, -3, 7], dtype=np.int32)], dtype=np.int32)
    data = open_training_data([plain], 1000)
    assert (data.vocab_size, data.pad, len(data.documents)) == (1000, 0, 11)
    data = open_training_data(["1", byte, "3", byte], None)  # the manifest's tokenizer
    assert (data.vocab_size, data.pad, data.source_sizes, data.weights) == (258, 257, [4, 4], [1.0, 3.0])
    data = open_training_data(["1", byte, "1", plain], 1000)  # --vocab-size covers any source, manifest or not
    assert data.vocab_size == 1000 and data.source_sizes == [4, 11]
    for values, vocab, match in (([plain], None, f"{plain} has no tokenizer manifest .*give --vocab-size"),
                                 ([plain], 0, "--vocab-size must be at least 1"),
                                 ([str(tmp_path / "nothing")], 0, "--vocab-size must be at least 1"),
                                 ([plain], 999, f"{plain} holds token id 999, outside the vocabulary \\[0, 999\\)"),
                                 ([byte], 100, f"{byte} holds token id 2[0-9][0-9], outside the vocabulary"),
                                 ([signed], 10, f"{signed} holds token id -3, outside the vocabulary"),
                                 (["0.5", byte, "0.5", bpe], None, f"{bpe} and {byte} were made by different "
                                                                   f"tokenizers"),
                                 ([str(tmp_path / "nothing")], 9, "no indexed dataset at")):
        with pytest.raises(MegatronExtError, match=match):
            open_training_data(values, vocab)
    with pytest.raises(ConfigError, match="--vocab-size applies to --data"):
        check_args(build_parser().parse_args(["--max-seq-len", "2048", "--vocab-size", "300"]),
                   CostModel.from_presets("tiny", "cpu-4"), 4)
    done = subprocess.run([*CLI, "train", "--data", plain], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith(f"megatron-ext: error: {plain} has no tokenizer manifest")
    done = subprocess.run([*CLI, "train", "--data", plain, "--vocab-size", "500"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and done.stderr.startswith(f"megatron-ext: error: {plain} holds token id 9")
