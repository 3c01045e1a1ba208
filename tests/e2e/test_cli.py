"""`megatron-ext`: the plan and bench commands, in process (cheap) and once as installed scripts.

Contract (commands/cli.py): every command prints a table, or JSON with --json; bad input is one line on
stderr starting 'megatron-ext: error:' and exit status 2, never a traceback.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.commands.cli import main
from megatron_ext.cost import CostModel
from megatron_ext.data.datasets import IndexedDocuments, write_indexed_dataset
from megatron_ext.errors import ConfigError
from megatron_ext.data.loader import PlanningDataLoader
from megatron_ext.plan import StepPlan, validate
from megatron_ext.planner.api import BASELINES

REPO = Path(__file__).resolve().parents[2]
FAST = ["--time-limit", "0.3"]
C7B = CostModel.from_presets("gpt-7b", "a100-40g-8x8")


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.fixture
def lengths_file(tmp_path) -> str:
    return write(tmp_path, "lengths.txt", "# a small long-tailed batch\n120\n800\n\n3000  # a comment\n250\n"
                                          "60000\n1500\n90\n12000\n")


LENGTHS = [120, 800, 3000, 250, 60000, 1500, 90, 12000]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, out, err, match: str | None = None):
    assert code == 2
    assert out == ""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("megatron-ext: error: ")
    if match:
        assert match in lines[0], lines[0]


# ---- plan ----------------------------------------------------------------------------------

def test_plan_json(capsys, lengths_file):
    code, out, err = run(capsys, "plan", "--lengths", lengths_file, "--json", *FAST)
    assert code == 0, err
    d = json.loads(out)
    for key in ("micro_batches", "solve_time_s", "estimated_step_time_s", "lower_bound_step_time_s", "baselines",
                "version", "kind", "num_gpus", "pipelines"):
        assert key in d
    assert d["kind"] == "flexsp" and d["num_gpus"] == 64 and d["pipelines"] == []
    assert set(d["baselines"]) == set(BASELINES)
    for b in d["baselines"].values():
        assert b["estimated_step_time_s"] >= d["estimated_step_time_s"] * (1 - 1e-9)
        assert b["speedup"] == pytest.approx(b["estimated_step_time_s"] / d["estimated_step_time_s"])
    assert 0 < d["lower_bound_step_time_s"] <= d["estimated_step_time_s"]
    plan = StepPlan.from_json(out)
    validate(plan, LENGTHS, C7B)  # seq_ids index the file's lengths in order
    assert sorted(i for mb in plan.micro_batches for g in mb.groups for i in g.seq_ids) == list(range(8))


def test_plan_table_mentions_speedups(capsys, lengths_file):
    code, out, err = run(capsys, "plan", "--lengths", lengths_file, *FAST)
    assert code == 0, err
    assert "8 sequences (77,760 tokens) of gpt-7b on a100-40g-8x8 (64 GPUs)" in out
    assert "estimated step time" in out and "lower bound" in out
    assert "speedup of flexsp" in out
    for b in BASELINES:
        assert b in out
    assert "x\n" in out or out.rstrip().endswith("x")


def test_plan_dist_small_cluster(capsys):
    code, out, err = run(capsys, "plan", "--dist", "github", "--batch", "40", "--seed", "3", "--model", "tiny",
                         "--cluster", "cpu-4", "--no-baselines", "--json", *FAST)
    assert code == 0, err
    d = json.loads(out)
    assert d["num_gpus"] == 4 and d["baselines"] == {}
    assert sum(len(g["seq_ids"]) for mb in d["micro_batches"] for g in mb["groups"]) == 40


def test_plan_bundled_lengths_file(capsys):
    f = str(REPO / "configs/lengths/stdlib.txt")
    code, out, err = run(capsys, "plan", "--lengths", f, "--no-baselines", "--json", *FAST)
    assert code == 0, err
    d = json.loads(out)
    assert d["dropped_seq_ids"] == []
    assert sum(len(g["seq_ids"]) for mb in d["micro_batches"] for g in mb["groups"]) > 500
    # 16 GPUs cannot hold its longest module: refused, or dropped on request
    assert_one_line_error(*run(capsys, "plan", "--lengths", f, "--cluster", "a100-40g-8x2", "--no-baselines", *FAST),
                          "does not fit even at SP degree 16")
    code, out, err = run(capsys, "plan", "--lengths", f, "--cluster", "a100-40g-8x2", "--drop-over-max",
                         "--no-baselines", "--json", *FAST)
    assert code == 0, err
    assert len(json.loads(out)["dropped_seq_ids"]) >= 1


def test_plan_cost_model_yaml(capsys, tmp_path, lengths_file):
    cm = write(tmp_path, "cm.yaml", "model: gpt-7b\ncluster: h100-80g-8x2\nzero_stage: 2\n")
    code, out, err = run(capsys, "plan", "--lengths", lengths_file, "--cost-model", cm, "--no-baselines", "--json",
                         *FAST)
    assert code == 0, err
    assert json.loads(out)["num_gpus"] == 16


def test_a_cost_model_of_inline_specs_is_named_once(capsys, tmp_path):
    """Its model and cluster are both named after the file: "of cm on cm"; one token was "1 tokens"."""
    model = "{num_layers: 2, hidden_size: 64, num_attention_heads: 4, params_b: 0.001, a1: 1.0e-6, a2: 0.01}"
    cm = write(tmp_path, "cm.yaml", f"model: {model}\ncluster: {{num_nodes: 1, gpus_per_node: 4, memory_gb: 4, "
                                    f"a2a_bandwidth_gbps: {{2: 10.0, 4: 10.0}}}}\n")
    one = write(tmp_path, "one.txt", "1\n")
    code, out, err = run(capsys, "plan", "--lengths", one, "--cost-model", cm, "--no-baselines", *FAST)
    assert code == 0 and out.startswith("flexsp plan for 1 sequence (1 token) of cm (4 GPUs)\n"), err
    code, out, err = run(capsys, "simulate", "--lengths", one, "--cost-model", cm, "--planners", "flexsp", *FAST)
    assert code == 0 and out.startswith("cm (4 GPUs; "), err


# ---- too-long sequences --------------------------------------------------------------------

def test_too_long_sequence_fails_then_drops(capsys, tmp_path):
    f = write(tmp_path, "long.txt", f"1000\n{C7B.max_seq_len + 1}\n2000\n")
    assert_one_line_error(*run(capsys, "plan", "--lengths", f, "--no-baselines", *FAST), "--drop-over-max")

    code, out, err = run(capsys, "plan", "--lengths", f, "--drop-over-max", "--json", *FAST)
    assert code == 0, err
    d = json.loads(out)
    assert d["dropped_seq_ids"] == [1]
    validate(StepPlan.from_json(out), [1000, C7B.max_seq_len + 1, 2000], C7B)

    code, out, err = run(capsys, "plan", "--lengths", f, "--drop-over-max", *FAST)
    assert code == 0, err
    assert f"dropped 1 sequence(s) over the {C7B.max_seq_len}-token limit: ids [1]" in out


def test_max_seq_len_with_lengths_file(capsys, tmp_path):
    f = write(tmp_path, "l.txt", "100\n5000\n300\n")
    assert_one_line_error(*run(capsys, "plan", "--lengths", f, "--max-seq-len", "1K", "--no-baselines", *FAST),
                          "--max-seq-len 1024")
    code, out, err = run(capsys, "plan", "--lengths", f, "--max-seq-len", "1K", "--drop-over-max", "--json", *FAST)
    assert code == 0, err
    d = json.loads(out)
    assert d["dropped_seq_ids"] == [1]  # dropped, not planned anyway
    assert sorted(i for mb in d["micro_batches"] for g in mb["groups"] for i in g["seq_ids"]) == [0, 2]
    code, out, err = run(capsys, "plan", "--lengths", f, "--max-seq-len", "1K", "--drop-over-max", *FAST)
    assert "over the 1024-token limit: ids [1]" in out


# ---- error paths ---------------------------------------------------------------------------

@pytest.mark.parametrize("content, match", [
    ("", "holds no lengths"),
    ("# only a comment\n\n", "holds no lengths"),
    ("100\nabc\n", ":2: expected one integer per line"),
    ("100\n1.5\n", "expected one integer"),
    ("1_000\n", "expected one integer per line, got '1_000'"),
    ("+300\n", "expected one integer per line, got '+300'"),
    ("100\n0\n", "must be positive, got 0"),
    ("100\x0c200\n300\n", ":1: expected one integer per line"),  # (a form feed split one line into two lengths)
    ("100\r200\rx\r", ":3: expected one integer per line, got 'x'"),  # (\r alone ends lines too)
    ("-5\n", "must be positive, got -5"),
    ("100\n99999999999999999999\n", ":2: a sequence length must be at most 1,099,511,627,776 tokens"),
    ("9" * 5000 + "\n", ":1: a sequence length must be at most 1,099,511,627,776 tokens"),  # (past int()'s digits)
    # (two of these summed to 998 tokens with a third of 1,000)
    ("9223372036854775807\n1000\n", ":1: a sequence length must be at most 1,099,511,627,776 tokens, got 9,223,"),
    ("5\n" * (2**20 + 1), "holds more than 1,048,576 lengths, the most a batch may hold: split it into batches "
                          "of at most that many"),  # (the sentence stopped at "may")
])
def test_bad_lengths_file(capsys, tmp_path, content, match):
    f = write(tmp_path, "bad.txt", content)
    assert_one_line_error(*run(capsys, "plan", "--lengths", f, *FAST), match)


def test_a_device_is_not_read_as_a_lengths_file_for_ever(capsys):
    assert_one_line_error(*run(capsys, "plan", "--lengths", "/dev/zero", *FAST),
                          "lengths file /dev/zero is too big to be one: over 268,435,456 bytes")


def test_a_lengths_file_may_start_with_a_byte_order_mark(capsys, tmp_path):
    f = tmp_path / "bom.txt"
    f.write_text("\ufeff5000\n300\n", encoding="utf-8")
    code, out, _ = run(capsys, "plan", "--lengths", str(f), "--no-baselines", *FAST)
    assert code == 0 and "2 sequences (5,300 tokens)" in out


def test_binary_lengths_file(capsys, tmp_path):
    p = tmp_path / "bin.txt"
    p.write_bytes(b"\xff\xfe\x00\x81")
    assert_one_line_error(*run(capsys, "plan", "--lengths", str(p), *FAST), "not text")


def test_nonexistent_lengths_file(capsys, tmp_path):
    assert_one_line_error(*run(capsys, "plan", "--lengths", str(tmp_path / "nope.txt"), *FAST), "cannot read")


@pytest.mark.parametrize("argv, match", [
    (["--model", "gpt-999b"], "unknown model preset 'gpt-999b'"),
    (["--cluster", "tpu-pod"], "unknown cluster preset 'tpu-pod'"),
    (["--cluster", "a100-40g-8x3"], "not a power of two"),
    (["--model", "nope.yaml"], "cannot read"),
    (["--time-limit", "0"], "--time-limit must be a finite number of seconds over 0"),
    (["--time-limit", "-1"], "--time-limit must be a finite number of seconds over 0"),
    (["--planner", "magic"], "unknown planner 'magic'"),
    (["--batch", "0"], "--batch must be from 1 to 1,048,576 sequences, got 0"),
    (["--static-degree", "3", "--planner", "static_ulysses"], "degree 3 is not allowed"),
    (["--model", "gpt-30b", "--cluster", "a100-40g-8x1", "--zero-stage", "0"], "model states"),
    (["--model", ""], "unknown model preset ''"),
    # (documents were cut at 14,333,216,261,830 tokens, over the longest a length may be)
    (["--memory-mb", "1e12"], "the memory budget must be at most 10,240,000 MB (10,000 GB), got 1,000,000,000,000"),
    (["--static-degree", "4", "--no-baselines"], "--static-degree is static_ulysses's degree: it applies to "
                                                 "--planner static_ulysses or its baseline row, which --no-baselines "
                                                 "leaves out of flexsp's plan"),  # (it was ignored)
    (["--cluster", ""], "unknown cluster preset ''"),
])
def test_config_errors(capsys, argv, match):
    assert_one_line_error(*run(capsys, "plan", "--dist", "wikipedia", "--batch", "8", *argv), match)


def test_plan_notes_a_time_limit_below_its_first_plan(capsys):
    code, out, err = run(capsys, "plan", "--dist", "wikipedia", "--batch", "512", "--time-limit", "1e-4",
                         "--no-baselines")
    assert code == 0 and "estimated step time" in out
    note, drawn = err.splitlines()  # (what was drawn: simulate's step with the same --max-seq-len)
    assert drawn == "batch: 512 sequences of --dist wikipedia, seed 0, documents cut at 382,157 tokens"
    assert note.startswith("note: planning 512 sequences takes about ") and note.endswith("--time-limit 0.0001 is too short")


def test_plan_notes_a_pipeline_plan_past_its_time_limit(capsys, tmp_path):
    # (its first candidate, which the limit does not cut short, takes far longer than 1 ms)
    f = write(tmp_path, "long.txt", "640000\n1000\n")
    code, out, err = run(capsys, "plan", "--planner", "elastic_pp", "--model", "llama-13b", "--cluster", "a800-80g-8x4",
                         "--lengths", f, "--time-limit", "0.001", "--no-baselines")
    assert code == 0 and "estimated step time" in out
    assert err.startswith("note: planned in ") and err.count("\n") == 1
    assert "past --time-limit 0.001: a pipeline search is not cut short before its first candidate" in err
    assert ", the longest 640,000 tokens) takes that long here; raise --time-limit, or plan fewer or shorter" in err


@pytest.mark.parametrize("field, value", [("memory_gb", ".inf"), ("memory_gb", ".nan"), ("memory_gb", "-28"),
                                          ("p2p_bandwidth_gbps", ".nan"), ("p2p_latency_ms", ".inf")])
def test_cluster_yaml_numbers_must_be_finite(capsys, tmp_path, field, value):
    fields = {"num_nodes": "1", "gpus_per_node": "8", "memory_gb": "28", "a2a_bandwidth_gbps": "{2: 100.0, 8: 90.0}",
              field: value}
    f = write(tmp_path, "cluster.yaml", "".join(f"{k}: {v}\n" for k, v in fields.items()))
    assert_one_line_error(*run(capsys, "plan", "--batch", "8", "--cluster", f, *FAST),
                          f"cluster 'cluster': {field} must be a ")


@pytest.mark.parametrize("argv, match", [
    (["--lr", "-1"], "--lr must be a finite number, 0 or more, got -1.0"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--time-limit", "-1"], "--time-limit must be a finite number of seconds over 0, got -1.0"),
    (["--time-limit", "0"], "--time-limit must be a finite number of seconds over 0"),
    (["--time-limit", "nan"], "--time-limit must be a finite number of seconds over 0"),
    (["--cost-model", "c.yaml", "--model", "gpt-7b"], "--model with --cost-model: the cost model holds its model"),
    # (static_ulysses's degree, ignored by every other planner)
    (["--static-degree", "2"], "--static-degree is static_ulysses's degree: it applies to --planner static_ulysses or "
                               "a --compare list naming it, not to flexsp"),
    (["--compare", "flexsp,auto", "--static-degree", "2"], "a --compare list naming it, not to flexsp, auto"),
    (["--compare", "flexsp,typo"], "unknown planner 'typo'"),  # before the flexsp run trains
    (["--compare", "flexsp,static_ulysses,flexsp"], "--compare names flexsp more than once"),
    (["--seed", "-1"], "--seed must be from 0 to 2^63 - 1, got -1"),  # (was refused by the ranks, after launching)
    (["--seed", "99999999999999999999"], "--seed must be from 0 to 2^63 - 1"),
    (["--global-batch", "100000000000"], "--global-batch must be from 1 to 1,048,576, got 100000000000"),
    (["--global-batch", "0"], "--global-batch must be from 1 to 1,048,576, got 0"),  # (named --steps too)
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--max-seq-len", "1"], "--max-seq-len must be at least 2 tokens, got 1"),  # (trained, NaN losses)
    (["--compare", ","], "--compare needs a comma-separated list of planners, e.g. flexsp,static_ulysses, got ','"),
    (["--compare", "elastic_pp,flexsp", "--pp", "2"], "--pp 2 needs a pipeline planner"),  # before elastic_pp trains
    (["--max-ring", "3"], "--max-ring must be a power of two (1: no ring), got 3"),
    (["--compare", "flexsp,elastic_pp", "--max-ring", "2"], "--max-ring 2 applies to FlexSP planners"),
    # (the ranks started, then each printed its traceback)
    (["--attention-backend", "flash"], "--attention-backend flash cannot run on this cpu train"),
    (["--compare", "flexsp,static_ulysses", "--planner=auto"], "--compare sets --planner and --json itself"),
    (["--compare", "flexsp,static_ulysses", "--plan", "auto"], "--compare sets --planner"),  # (was overridden)
])
def test_train_refuses_before_launching(capsys, argv, match):
    assert_one_line_error(*run(capsys, "train", "--steps", "1", *argv), match)


def test_a_ring_that_changes_nothing_is_noted(capsys):
    # tiny's 4 KV heads allow Ulysses degree 4: over cpu-4's 4 GPUs a ring adds no degree
    code, out, err = run(capsys, "plan", "--model", "tiny", "--cluster", "cpu-4", "--max-ring", "2", "--batch", "8",
                         "--no-baselines", *FAST)
    assert code == 0 and "note: --max-ring 2 changes nothing here: tiny's Ulysses groups already span all 4 GPUs" in err
    code, out, err = run(capsys, "plan", "--model", "tiny", "--cluster", "cpu-4", "--batch", "8", "--no-baselines",
                         *FAST)
    assert code == 0 and "--max-ring" not in err


def test_compared_runs_write_their_own_outputs(tmp_path):
    """Each planner's records, checkpoints and trace in a place of its own (each run overwrote the
    one before), given after the shared options, which they override."""
    import argparse

    from megatron_ext.commands.train import _own_outputs, build_parser

    base = ["--run-dir", "rd", "--save", "ck", "--load", "ck", "--trace", "out/t.JSON"]
    given = build_parser().parse_known_args(base, argparse.Namespace(planner=None, json=None))[0]
    own = _own_outputs(given, "flexsp")
    assert own == ["--run-dir", "rd/flexsp", "--save", "ck/flexsp", "--load", "ck/flexsp", "--trace",
                   "out/t.flexsp.JSON"]  # (each resumes what it saved)
    args = build_parser().parse_args([*base, *own])
    assert (args.run_dir, args.save, args.load, args.trace) == ("rd/flexsp", "ck/flexsp", "ck/flexsp",
                                                                "out/t.flexsp.JSON")
    # a checkpoint in DIR itself: every planner starts from it, with a tracker or (a first save killed
    # before its tracker) a complete iter_N folder alone
    (tmp_path / "iter_0000002").mkdir()
    given = build_parser().parse_known_args(["--load", str(tmp_path)], argparse.Namespace(planner=None))[0]
    assert _own_outputs(given, "flexsp") == ["--load", str(tmp_path / "flexsp")]  # (a half-saved folder)
    (tmp_path / "iter_0000002" / "megatron_ext.json").write_text("{}")
    assert _own_outputs(given, "flexsp") == []
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2\n")
    assert _own_outputs(given, "flexsp") == []



# ---- --data: a Megatron indexed dataset --------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    rng = np.random.default_rng(5)
    lengths = [*rng.integers(50, 3000, 60).tolist(), 9000, 20000]
    prefix = str(tmp_path_factory.mktemp("corpus") / "docs")
    write_indexed_dataset(prefix, [rng.integers(0, 1000, n).astype(np.uint16) for n in lengths])
    return prefix


def test_plan_and_simulate_draw_the_batches_train_draws(capsys, corpus):
    from megatron_ext.commands.cli import build_parser
    from megatron_ext.commands.plan import lengths_from_args

    docs = IndexedDocuments(corpus)
    loader = PlanningDataLoader(docs, C7B, 16, seed=3, max_seq_len=8192, background=False)
    args = build_parser().parse_args(["plan", "--data", corpus, "--batch", "16", "--seed", "3", "--step", "4"])
    got, _ = lengths_from_args(args, 8192)
    np.testing.assert_array_equal(got, loader.batch_lengths(4))
    # The 20,000-token document is cut into pieces as train cuts it, never dropped.
    all_ids = np.concatenate([loader.batch_sample_ids(k) for k in range(loader.steps_per_epoch)])
    assert (loader.samples[:, 2] - loader.samples[:, 1]).max() == 8192 and len(loader.samples) == 62 + 2 + 1
    assert len(set(all_ids.tolist())) == len(all_ids)

    code, out, err = run(capsys, "plan", "--data", corpus + ".idx", "--batch", "16", "--seed", "3", "--step", "4",
                         "--max-seq-len", "8K", "--json", *FAST)
    assert code == 0, err
    assert f"batch: {corpus}: 62 documents, 2 cut into pieces, batch 16" in err and "step 4 from seed 3" in err
    validate(StepPlan.from_json(out), got, C7B)

    code, out, err = run(capsys, "simulate", "--data", corpus, "--batch", "16", "--steps", "2", "--seed", "3",
                         "--max-seq-len", "8K", "--planners", "flexsp,static_ulysses", "--model", "gpt-7b",
                         "--cluster", "a100-40g-8x1", "--json", *FAST)
    assert code == 0, err
    res = json.loads(out)
    assert corpus in res["config"]["source"] and "steps 0-1 from seed 3" in res["config"]["source"]
    tokens = {(r["step"], r["planner"]): r["tokens"] for r in res["rows"]}
    for k in (0, 1):
        assert tokens[(k, "flexsp")] == tokens[(k, "static_ulysses")] == int(loader.batch_lengths(k).sum())


def test_plan_and_simulate_a_weighted_blend(capsys, corpus, tmp_path):
    from megatron_ext.commands.cli import build_parser
    from megatron_ext.commands.plan import lengths_from_args
    from megatron_ext.data.batches import GlobalBatches

    rng = np.random.default_rng(8)
    other = str(tmp_path / "code")
    write_indexed_dataset(other, [rng.integers(0, 1000, n).astype(np.uint16) for n in rng.integers(10, 400, 30)])
    blend = ["0.25", corpus, "0.75", other + ".bin"]
    args = build_parser().parse_args(["plan", "--data", *blend, "--batch", "16", "--seed", "2", "--step", "5"])
    got, drawn = lengths_from_args(args, 8192)
    a, b = IndexedDocuments(corpus), IndexedDocuments(other)
    ref = GlobalBatches(np.concatenate([a.lengths, b.lengths]), 16, 8192, 2, source_sizes=[62, 30],
                        weights=[0.25, 0.75])
    ids = ref.batch_sample_ids(5)
    np.testing.assert_array_equal(got, ref.batch_lengths(5))
    assert np.count_nonzero(ref.samples[ids, 0] >= 62) == 12  # three quarters of every batch
    assert f"{corpus} (62 documents, 25% of each batch) + {other} (30 documents, 75% of each batch)" in drawn

    code, out, err = run(capsys, "simulate", "--data", *blend, "--batch", "16", "--steps", "2", "--seed", "2",
                         "--max-seq-len", "8K", "--planners", "flexsp", "--model", "gpt-7b",
                         "--cluster", "a100-40g-8x1", "--json", *FAST)
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert [r["tokens"] for r in rows] == [int(ref.batch_lengths(k).sum()) for k in (0, 1)]


def test_train_refuses_a_dataset_smaller_than_a_batch_before_launching(capsys, corpus):
    assert_one_line_error(*run(capsys, "train", "--steps", "1", "--data", corpus, "--global-batch", "1000",
                               "--max-seq-len", "4096", "--vocab-size", "1000"), "fewer than one global batch of 1000")


@pytest.mark.parametrize("argv, match", [
    (["--data", "{corpus}"], "--data needs --max-seq-len"),  # else the batch would hang on the planner's limit
    (["--data", "{tmp}/nothing", "--max-seq-len", "8K"], "no indexed dataset at"),
    (["--data", "{corpus}", "--batch", "100", "--max-seq-len", "8K"], "fewer than one global batch of 100"),
    (["--data", "{corpus}", "--batch", "0", "--max-seq-len", "8K"], "--batch must be from 1 to 1,048,576"),
    (["--data", "{corpus}", "--step", "-1", "--max-seq-len", "8K"], "--step must be a step number"),
    (["--data", "1", "{corpus}", "1", "{corpus}", "--step", "1" + "0" * 20, "--max-seq-len", "8K"],
     "--step must be a step number, from 0 to 8,589,934,591"),  # (a blend's shares: a traceback)
    (["--data", "{corpus}", "--seed", "-2", "--max-seq-len", "8K"], "--seed must be from 0 to 2^63 - 1, got -2"),
    (["--data", "0.5", "{corpus}", "0.5", "--max-seq-len", "8K"], "odd count"),
    (["--data", "{corrupt}", "--max-seq-len", "8K"], "truncated or corrupted"),
    (["--data", "{bigger}", "--max-seq-len", "8K"], "its index describes"),  # .idx lengths the .bin lacks
    (["--data", "{tmp}/folder", "--max-seq-len", "8K"], "folder.idx: Is a directory"),  # (was a traceback)
])
def test_data_errors(capsys, tmp_path, corpus, argv, match):
    import shutil

    corrupt, bigger = tmp_path / "corrupt", tmp_path / "bigger"
    for bad in (corrupt, bigger):
        shutil.copy(corpus + ".bin", str(bad) + ".bin")
    idx = bytearray(Path(corpus + ".idx").read_bytes())
    Path(str(corrupt) + ".idx").write_bytes(idx[:26] + b"\xff" * 8 + idx[34:])  # a huge document count
    last = 34 + 4 * (int.from_bytes(idx[18:26], "little") - 1)  # the last sequence's length (no pointer follows)
    idx[last:last + 4] = (2_000_000_000).to_bytes(4, "little")
    Path(str(bigger) + ".idx").write_bytes(idx)
    (tmp_path / "folder.idx").mkdir()
    (tmp_path / "folder.bin").write_bytes(b"")
    argv = [a.format(tmp=tmp_path, corpus=corpus, corrupt=corrupt, bigger=bigger) for a in argv]
    code, out, err = run(capsys, "plan", *FAST, *argv)
    assert_one_line_error(code, out, err, match)


SMALL = ["--model", "llama-7b", "--cluster", "a800-80g-8x1"]  # one node of 8 GPUs, 32 layers


@pytest.mark.parametrize("argv, match", [
    (["plan", "--planner", "flexsp", "--pp", "4"], "--pp applies only to pipeline planners"),
    (["plan", "--planner", "flexsp", "--recompute", "none", "--b1-scale", "0.5"], "--b1-scale applies only to pipeline"),
    # (the baselines recompute by their own rule: it was ignored)
    (["plan", "--planner", "seq1f1b", "--recompute", "full", "--recompute-ties", "tied"],
     "--recompute, --recompute-ties apply only to elastic pipelines (elastic_pp, auto), not to seq1f1b"),
    (["plan", "--planner", "elastic_pp", "--plot", "out.txt"], "must end in .png, .pdf, .svg"),
    (["plan", "--planner", "elastic_pp", "--seed", "-1"], "--seed must be from 0 to 2^63 - 1, got -1"),
    (["plan", "--planner", "elastic_pp", "--b1-scale", "inf"], "b1_scale (--b1-scale) must be from 0 to 1000, got inf"),
    (["plan", "--planner", "elastic_pp", "--time-limit", "nan"],
     "--time-limit must be a finite number of seconds over 0"),
    (["plan", "--planner", "auto", "--pp", "3"], "pipeline degree 3 does not divide the 8 GPUs of a800-80g-8x1; choose one of 1, 2, 4, 8"),
    (["plan", "--planner", "magic"], "elastic_pp, batch_1f1b, seq1f1b, auto"),
    (["plan", "--planner", "elastic_pp", "--memory-mb", "100"], "below the model states of a stage"),
    (["simulate", "--planners", "flexsp,nope"], "unknown planner(s) 'nope'"),
    (["simulate", "--planners", "flexsp", "--main", "elastic_pp"], "main planner 'elastic_pp' is not among"),
    (["simulate", "--planners", "elastic_pp", "--pp", "3"], "pipeline degree 3 does not divide"),
    (["simulate", "--planners", "flexsp", "--sp", "2"], "--sp applies only to pipeline planners"),
    (["simulate", "--steps", "0"], "--steps from 1 to 10,000, got 8 and 0"),
    (["simulate", "--steps", "1000000000"], "--steps from 1 to 10,000"),  # (ran with no end)
    (["simulate", "--batch", "99999999999"], "--batch must be from 1 to 1,048,576 sequences"),
    (["simulate", "--drop-over-max"], "--drop-over-max applies to --lengths"),
    (["plan", "--planner", "auto", "--sp", "3"], "SP degree 3 is not allowed"),  # not FlexSP alone, silently
    (["plan", "--planner", "auto", "--static-degree", "16"], "SP degree 16 is not allowed"),
    # a pipeline stage's SP group is Ulysses only: the ring reached the FlexSP baseline alone
    (["plan", "--planner", "elastic_pp", "--max-ring", "2"], "--max-ring applies only to planners of SP groups"),
    (["plan", "--planner", "elastic_pp", "--recompute", "full", "--recompute-ties", "untied"],
     "--recompute-ties applies to what the ILP or the greedy recomputes, not to --recompute full"),
    (["plan", "--chunks", "5"], "--chunks applies only to pipeline plans"),
    (["plan", "--pipelines", "all"], "--pipelines applies only to pipeline plans"),
    (["simulate", "--planners", "seq1f1b,batch_1f1b", "--max-ring", "2"], "not to seq1f1b, batch_1f1b"),
])
def test_pipeline_and_simulate_config_errors(capsys, argv, match):
    assert_one_line_error(*run(capsys, argv[0], *FAST, *SMALL, "--batch", "8", *argv[1:]), match)


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_plot_and_trace_files_that_cannot_be_written_are_refused_first(capsys, tmp_path, command):
    """Before planning, and before another output is written (a plot was, then the trace failed)."""
    kept = tmp_path / "kept.svg"
    kept.write_text("kept")
    missing = tmp_path / "missing" / "t.json"
    assert_one_line_error(*run(capsys, command, *FAST, *SMALL, "--batch", "8", "--plot", str(kept), "--trace",
                               str(missing)), f"--trace {missing}: cannot write in {missing.parent}")
    assert kept.read_text() == "kept"
    (tmp_path / "dir.png").mkdir()
    assert_one_line_error(*run(capsys, command, *FAST, *SMALL, "--plot", str(tmp_path / "dir.png")),
                          "is a folder, not a file")
    assert_one_line_error(*run(capsys, command, *FAST, *SMALL, "--trace", ""), "--trace '': the file name must end")


def test_memory_budget_and_length_limits_apply_to_every_planner(capsys, tmp_path):
    """--memory-mb is the budget of FlexSP and its baselines too; pipeline planners drop what no
    layout can run with --drop-over-max; simulate refuses (or drops) lengths over --max-seq-len."""
    cap = CostModel.from_presets("llama-7b", "a800-80g-8x1").with_memory(20000).max_seq_len  # FlexSP's longest
    f = write(tmp_path, "over.txt", f"{cap + 2000}\n3000\n200\n")
    code, out, _ = run(capsys, "plan", "--planner", "elastic_pp", *SMALL, "--lengths", f, "--memory-mb", "20000", *FAST)
    assert code == 0 and "(budget 19.5 GB)" in out  # 2 stages of SP 4 slice it; FlexSP cannot hold it
    flex = next(line for line in out.splitlines() if line.strip().startswith("vs flexsp"))
    # (the limit alone was refused: "use --drop-over-max")
    assert "infeasible" in flex and f"up to {cap:,} tokens" in flex and f"--max-seq-len {cap} --drop-over-max)" in flex
    code, out, _ = run(capsys, "plan", "--planner", "elastic_pp", *SMALL, "--lengths", f, "--memory-mb", "20000",
                       "--max-seq-len", str(cap), "--drop-over-max", *FAST)
    assert code == 0 and "vs flexsp" in out and "dropped 1 sequence" in out
    code, out, _ = run(capsys, "plan", "--planner", "elastic_pp", *SMALL, "--lengths", f, "--memory-mb", "20000",
                       "--drop-over-max", *FAST)  # (dropping already: the limit alone)
    flex = next(line for line in out.splitlines() if line.strip().startswith("vs flexsp"))
    assert code == 0 and f"--max-seq-len {cap})" in flex
    f = write(tmp_path, "huge.txt", "100000000\n5000\n3000\n")
    code, out, _ = run(capsys, "plan", "--planner", "elastic_pp", *SMALL, "--lengths", f, "--drop-over-max",
                       "--no-baselines", *FAST)
    assert code == 0 and "dropped 1 sequence over the length limit" in out and "ids [0]" in out
    assert_one_line_error(*run(capsys, "plan", "--planner", "elastic_pp", *SMALL, "--lengths", f, *FAST),
                          "use --drop-over-max")
    long = write(tmp_path, "long.txt", "60000\n3000\n200\n")
    assert_one_line_error(*run(capsys, "simulate", *SMALL, "--lengths", long, "--max-seq-len", "48K",
                               "--planners", "elastic_pp,flexsp", *FAST), "exceed --max-seq-len 49152")
    code, out, err = run(capsys, "simulate", *SMALL, "--lengths", long, "--max-seq-len", "48K", "--drop-over-max",
                         "--planners", "flexsp,elastic_pp", *FAST)
    assert code == 0 and "dropped 1 sequence(s)" in err and "2 given lengths" in out and "flexsp speedup" in out


def test_simulate_fails_when_no_planner_plans_a_step(capsys, tmp_path):
    """The table says why, planner by planner; the exit status says nothing ran (it was 0)."""
    f = write(tmp_path, "long.txt", "2000000\n1000\n")
    code, out, err = run(capsys, "simulate", *SMALL, "--lengths", f, "--max-seq-len", "2M", "--planners", "flexsp",
                         *FAST)
    assert code == 2 and "flexsp            infeasible: a sequence of 2000000 tokens" in out
    assert err.strip() == "megatron-ext: error: no planner could plan any step: flexsp infeasible"


def test_simulate_compares_the_floor_over_the_steps_every_planner_ran(capsys, monkeypatch):
    """Steps no planner could plan are said (the run exited 0 quietly), and left out of the floor:
    it was the mean of every step, the planners' of the steps they ran (a floor 6x above them)."""
    import megatron_ext.commands.table as table

    batches = {0: [3000, 1000], 1: [2_000_000, 1000], 2: [150_000, 1000], 3: [2_000_000, 1000]}
    monkeypatch.setattr(table, "sample_lengths", lambda dist, n, seed, cap: np.array(batches[seed]))
    code, out, err = run(capsys, "simulate", *SMALL, "--steps", "4", "--max-seq-len", "2M", "--planners",
                         "flexsp,seq1f1b", "--json", *FAST)
    d = json.loads(out)
    assert code == 0 and d["config"]["unplanned_steps"] == [1, 3] and d["floor"]["steps"] == [0]
    assert err.strip() == "warning: no planner could plan 2 of 4 steps (steps 1, 3): every figure leaves them out"
    by = {s["planner"]: s for s in d["summary"]}
    assert by["flexsp"]["steps"] == 1 and by["seq1f1b"]["steps"] == 2  # (150,000 tokens: over FlexSP's longest)
    floor0 = C7B.__class__.from_presets("llama-7b", "a800-80g-8x1").compute_floor_ms(np.array(batches[0])) / 1e3
    assert d["floor"]["step_time_s"] == pytest.approx(floor0)
    flexsp0 = next(r for r in d["rows"] if r["planner"] == "flexsp" and r["step"] == 0)["step_time_s"]
    assert d["floor"]["ceiling"]["flexsp"] == pytest.approx(flexsp0 / floor0)
    code, out, err = run(capsys, "simulate", *SMALL, "--steps", "4", "--max-seq-len", "2M", "--planners",
                         "flexsp,seq1f1b", *FAST)
    assert "the compute floor and the most any plan could gain: over the 1 of 4 steps every planner" in out


def test_static_degree_reaches_static_ulysses_from_every_planner(capsys, lengths_file):
    """--static-degree is the degree of the static_ulysses row, whichever planner leads; one too
    small for the batch makes that row say so, and the plan still prints."""
    code, out, _ = run(capsys, "plan", "--lengths", lengths_file, "--static-degree", "1", *FAST)
    row = next(line for line in out.splitlines() if line.startswith("static_ulysses"))
    assert code == 0 and "infeasible: at SP degree 1 a group holds at most" in row
    steps = {}
    for d in ("4", "8"):
        code, out, _ = run(capsys, "plan", "--planner", "elastic_pp", *SMALL, "--dist", "github", "--batch", "16",
                           "--static-degree", d, "--json", *FAST)
        steps[d] = json.loads(out)["baselines"]["static_ulysses"]["estimated_step_time_s"]
    assert steps["4"] != steps["8"]


def test_one_node_pipelines_default_to_two_stages(capsys):
    code, out, _ = run(capsys, "plan", "--planner", "elastic_pp", *SMALL, "--dist", "github", "--batch", "16",
                       "--no-baselines", *FAST)
    assert code == 0 and "2 stages x SP 4" in out

def test_pipeline_replicas_from_pp_and_sp(capsys):
    # 2 stages x SP 8 on 32 GPUs: two replicas side by side, each with its pipelines
    args = ("--model", "llama-13b", "--cluster", "a800-80g-8x4", "--dist", "github", "--batch", "64", "--pp", "2")
    code, out, _ = run(capsys, "plan", "--planner", "elastic_pp", *args, "--sp", "8", *FAST)
    assert code == 0 and "x SP 8 over 2 replicas" in out and "(replica 1)" in out and "vs seq1f1b" in out
    code, out, _ = run(capsys, "plan", "--planner", "elastic_pp", *args, "--json", *FAST)  # sp 8 follows
    plan = StepPlan.from_json(out)
    assert {p.replica for p in plan.pipelines} == {0, 1} and {p.sp_degree for p in plan.pipelines} == {8}
    code, out, _ = run(capsys, "simulate", *args, "--steps", "1", "--planners", "elastic_pp,seq1f1b", *FAST)
    assert code == 0 and "pp 2 x sp 8 x 2 replicas" in out
    assert_one_line_error(*run(capsys, "plan", "--planner", "elastic_pp", *args[:-1], "5", "--sp", "4"),
                          "pp 5 x sp 4 = 20 GPUs does not divide the 32 GPUs")


def test_cluster_yaml_with_three_nodes(capsys, tmp_path):
    f = write(tmp_path, "three.yaml", "num_nodes: 3\ngpus_per_node: 8\nmemory_gb: 28\n"
                                      "a2a_bandwidth_gbps: {2: 100.0, 8: 90.0, 16: 10.0}\n")
    assert_one_line_error(*run(capsys, "plan", "--batch", "8", "--cluster", f, *FAST),
                          "num_nodes=3 is not a power of two")


@pytest.mark.parametrize("text, match", [
    ("model: gpt-7b\ncluster: cpu-4\nzero_stage: abc\n", "zero_stage"),
    ("model: gpt-7b\n", "needs 'model' and 'cluster'"),
    ("model: 5\ncluster: cpu-4\n", "'model' must be"),
    ("model: [\n", "not valid YAML"),
])
def test_bad_cost_model_yaml(capsys, tmp_path, text, match):
    f = write(tmp_path, "cm.yaml", text)
    assert_one_line_error(*run(capsys, "plan", "--batch", "8", "--cost-model", f, *FAST), match)


def test_bad_model_yaml(capsys, tmp_path):
    f = write(tmp_path, "m.yaml", "num_layers: 4\nhidden_size: 128\nnum_attention_heads: 8\nnum_query_groups: four\n"
                                  "params_b: 0.01\nact_mb_per_token: 0.05\na1: 1.0e-6\na2: 0.02\nlaunch_ms: 15\n")
    assert_one_line_error(*run(capsys, "plan", "--batch", "8", "--model", f, "--cluster", "cpu-4", *FAST),
                          "num_query_groups")


def test_bench_bad_counts(capsys):
    for argv, says in ((["--batches", "0"], "--batches must be from 1 to 10,000, got 0"),
                       (["--batches", "99999999999"], "--batches must be from 1 to 10,000"),  # (ran with no end)
                       (["--batch", "0"], "--batch must be from 1 to 1,048,576 sequences, got 0"),
                       (["--per-gpu", "0"], "--per-gpu applies with --gpus"),  # (was accepted, unused)
                       (["--planner", "auto"], "measures FlexSP-kind planners"),  # (was a KeyError)
                       (["--planner", "elastic_pp", "--max-ring", "2"], "compare pipeline planners and auto with"),
                       (["--drop-over-max"], "unrecognized arguments: --drop-over-max"),  # (always on in bench)
                       (["--static-degree", "3"], "SP degree 3 is not allowed")):  # (was "a 16-sequence batch")
        assert_one_line_error(*run(capsys, "bench", "planner", "--no-scale", "--dist", "wikipedia", *argv, *FAST),
                              says)
    for argv, says in ((["--batch", "7", "--no-scale"], "--batch, --no-scale do not apply with --gpus"),
                       (["--per-gpu", "100000"], "6,400,000 sequences a batch, over 1,048,576"),
                       (["--planner", "timelines"], "ZeRO-3 cannot")):  # (an empty table)
        assert_one_line_error(*run(capsys, "bench", "planner", "--gpus", "64", "--dist", "wikipedia", *argv, *FAST),
                              says)
    assert_one_line_error(*run(capsys, "bench", "planner", "--no-scale", "--dist", "wikipedia,nope", "--batches",
                               "1", "--batch", "4", *FAST), "unknown length distribution 'nope'")


def test_bench_refuses_every_unknown_distribution_before_planning(capsys, monkeypatch):
    """(The batches of the names before it were planned first: 9 s, then the error.)"""
    import megatron_ext.commands.bench as bench

    monkeypatch.setattr(bench, "sample_lengths", lambda *a: pytest.fail("planned before refusing"))
    for dist, says in (("wikipedia,nope", "--dist 'wikipedia,nope': unknown length distribution 'nope'; give "
                                          "comma-separated names of wikipedia, commoncrawl, github, lmsys"),
                       ("wikipedia,", "unknown length distribution ''"),
                       ("x,github,y", "unknown length distributions 'x', 'y'")):
        assert_one_line_error(*run(capsys, "bench", "planner", "--dist", dist), says)


def test_bench_across_cluster_sizes(capsys):
    code, out, _ = run(capsys, "bench", "planner", "--gpus", "4,8", "--per-gpu", "4", "--dist", "wikipedia",
                       "--batches", "1", "--model", "tiny", "--cluster", "cpu-4", "--max-seq-len", "8K", "--json", *FAST)
    assert code == 0
    d = json.loads(out)
    assert [(r["num_gpus"], r["seqs"]) for r in d["rows"]] == [(4, 16), (8, 32)]
    for r in d["rows"]:
        assert r["relaxed_bound_s"] <= r["lower_bound_s"] <= r["step_time_s"] * (1 + 1e-9)
        assert 0 <= r["idle_share"] < 1 and 0 < r["path_share"] <= 1 + 1e-9
    assert [s["plans"] for s in d["summary"]] == [1, 1] and d["left_out"] == ["timelines"]
    code, out, _ = run(capsys, "bench", "planner", "--gpus", "4,8", "--per-gpu", "4", "--dist", "wikipedia",
                       "--batches", "1", "--model", "tiny", "--cluster", "cpu-4", "--max-seq-len", "8K", "--json",
                       "--zero-stage", "2", *FAST)
    d = json.loads(out)
    assert [(r["num_gpus"], r["planner"]) for r in d["rows"]] == [(4, "flexsp"), (4, "timelines"), (8, "flexsp"),
                                                                  (8, "timelines")] and d["left_out"] == []
    for r in d["rows"]:
        assert r["barrier_free_bound_s"] <= r["step_time_s"] * (1 + 1e-9)
    code, out, _ = run(capsys, "bench", "planner", "--gpus", "4", "--per-gpu", "2", "--dist", "wikipedia",
                       "--batches", "1", "--model", "tiny", "--cluster", "cpu-4", "--max-seq-len", "8K", *FAST)
    assert code == 0 and "any-deg" in out and "time limit held by" in out
    # (every count checked before any is planned: the last one's error, nothing planned first)
    for gpus, match in (("4,8,6", "--gpus 6: 6 GPUs is not a whole number"), ("4,x", "comma-separated"),
                        ("4,24", "--gpus 24: cluster 'cpu-4 x 24 GPUs': the GPU count must be a power of two"),
                        ("99999999999999999992", "GPU counts from 1 to 1,048,576")):
        assert_one_line_error(*run(capsys, "bench", "planner", "--gpus", gpus, "--model", "tiny", "--cluster", "cpu-4",
                                   *FAST), match)
    assert_one_line_error(*run(capsys, "bench", "planner", "--gpus", "4", "--planner", "elastic_pp", "--model", "tiny",
                               "--cluster", "cpu-4", *FAST), "FlexSP-kind")


def test_step_shares_by_hand():
    # two sequences on one GPU each, side by side in one micro-batch of a 4-GPU cluster: two GPUs
    # idle the whole pass, the shorter one's GPU idles while the longer runs
    from megatron_ext.commands.scale import step_shares
    from megatron_ext.planner import PlannerOptions, make_plan
    cost = CostModel.from_presets("tiny", "cpu-4")
    lengths = np.array([1500, 500])
    plan = make_plan("static_ulysses", lengths, cost, PlannerOptions(static_degree=1))
    assert [[g.degree for g in mb.groups] for mb in plan.micro_batches] == [[1, 1]]
    t = [cost.group_time_ms([s], 1) for s in lengths]
    idle, path = step_shares(plan, lengths, cost)
    assert idle == pytest.approx((4 * t[0] - t[0] - t[1]) / (4 * t[0]), rel=1e-9)
    fastest = min(cost.group_time_ms([1500], d) for d in cost.degrees if 1500 <= cost.token_capacity(d))
    assert path == pytest.approx(fastest / t[0], rel=1e-9)


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--max-seq-len", "lots"])
    assert e.value.code == 2
    assert "expected a token count" in capsys.readouterr().err
    for argv, says in ((["plan", "--max-seq-len", "1e17"], "expected a token count from 1 to 1,099,511,627,776"),
                       (["plan", "--max-seq-len", "1.5"], "expected a whole number of tokens, got '1.5'"),
                       (["train", "--max-seq-len", "0"], "expected a token count from 1 to")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["plan", "--planner", "elastic_pp", "--chunks", "0"])
    assert e.value.code == 2
    assert "expected a positive number of chunks or 'all', got '0'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["plan", "--planner", "elastic_pp", "--pipelines", "-1"])
    assert e.value.code == 2
    assert "expected a positive number of pipelines or 'all', got '-1'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["plan", "--pp", "x"])
    assert e.value.code == 2  # one line, as any bad input (not argparse's usage block)
    assert capsys.readouterr().err == ("megatron-ext: error: argument --pp: expected a positive integer, got 'x' "
                                       "(see megatron-ext plan --help)\n")
    assert_one_line_error(*run(capsys, "plan", "--bogus"), "unrecognized arguments: --bogus (see megatron-ext plan --help)")
    # (were taken as not given: --cost-model "" planned the default model)
    for argv in (["plan", "--lengths", ""], ["report", ""], ["plan", "--cost-model", ""],
                 ["train", "--cost-model", ""]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "expected a path, got ''" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2


def test_help_names_every_option_and_its_default(capsys):
    """(--compare and --allow-oversubscribe were missing from train's usage, defaults and some
    options' help from several commands.)"""
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    usage = out.split("\n\n", 1)[0]
    assert "[--compare P1,P2,...] [--allow-oversubscribe]" in usage
    assert "\ncomparing planners:\n  --compare P1,P2,..." in out and "\nlauncher:\n  --allow-oversubscribe" in out
    for default in ("tiny", "cpu-4", "5", "8", "4096", "0.003", "1.0", "auto"):
        assert f"(default: {default})" in " ".join(out.split()), default
    assert out.rstrip().endswith("which is passed on to every rank")
    assert main(["profile", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for default in ("tiny", "cpu-4", "128,256,512,1024,2048,3072", "3"):
        assert f"(default: {default})" in out, default
    for argv, says in ((["bench", "planner"], ["batches per distribution (default: 5)", "--json the rows, summary"]),
                       (["report"], ["--json the figures"])):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert all(x in out for x in says), out


# ---- the installed command -----------------------------------------------------------------

def _console_script() -> list[str]:
    script = Path(sys.executable).with_name("megatron-ext")
    return [str(script)] if script.exists() else [sys.executable, "-m", "megatron_ext.commands.cli"]


def test_console_script_plan():
    r = subprocess.run([*_console_script(), "plan", "--dist", "wikipedia", "--batch", "64", "--json"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["num_gpus"] == 64
    assert sum(len(g["seq_ids"]) for mb in d["micro_batches"] for g in mb["groups"]) + len(d["dropped_seq_ids"]) == 64
    assert set(d["baselines"]) == set(BASELINES)
    assert d["lower_bound_step_time_s"] <= d["estimated_step_time_s"]


def test_console_script_error_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "megatron_ext.commands.cli", "plan", "--lengths", str(tmp_path / "none.txt")],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("megatron-ext: error: cannot read lengths file") and r.stderr.count("\n") == 1


def test_console_script_bench_planner():
    r = subprocess.run([*_console_script(), "bench", "planner", "--batches", "1", "--batch", "64", "--dist",
                        "wikipedia", "--no-scale", "--json"], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["scale"] is None and len(d["rows"]) == 1
    s = d["summary"]
    for key in ("median_solve_time_s", "max_solve_time_s", "median_ratio_to_bound", "max_ratio_to_bound",
                "min_speedup", "median_speedup"):
        assert key in s
    assert set(s["min_speedup"]) == set(BASELINES)
    assert s["max_ratio_to_bound"] >= 1 - 1e-9
    assert all(v >= 1 - 1e-9 for v in s["min_speedup"].values())
    row = d["rows"][0]
    assert row["dist"] == "wikipedia" and row["seqs"] == 64
    assert "plan time: median" in d["table"]


def test_compared_runs_note_an_unused_ring_once(capsys, monkeypatch):
    import subprocess as sp

    import megatron_ext.commands.launch as launch
    import megatron_ext.runtime.supervisor as supervisor

    # each run's torchrun, replaced by a process that prints one step's record
    record = {"step_time_s": 1.0, "predicted_step_time_s": 1.0, "tokens": 8, "loss": 2.0, "grad_norm": 1.0,
              "planner": "flexsp"}
    started, popen = [], sp.Popen
    monkeypatch.setattr(supervisor.subprocess, "Popen", lambda cmd, **kw: started.append(cmd) or popen(
        [sys.executable, "-c", f"print({json.dumps(record)!r})"], **kw))
    monkeypatch.setattr(launch, "_check_cpu_ranks_fit", lambda *a: None)
    code, out, err = run(capsys, "train", "--steps", "1", "--compare", "flexsp,static_ulysses", "--max-ring", "2")
    assert code == 0 and len(started) == 2 and "static_ulysses" in out, err
    assert err.count("note: --max-ring 2 changes nothing here") == 1, err


def test_compared_runs_that_trained_nothing_are_refused(capsys, monkeypatch):
    import subprocess as sp

    import megatron_ext.commands.launch as launch
    import megatron_ext.runtime.supervisor as supervisor

    popen = sp.Popen  # (a --load checkpoint already at --steps: the runs print no step)
    monkeypatch.setattr(supervisor.subprocess, "Popen", lambda cmd, **kw: popen([sys.executable, "-c", ""], **kw))
    monkeypatch.setattr(launch, "_check_cpu_ranks_fit", lambda *a: None)
    code, out, err = run(capsys, "train", "--steps", "1", "--compare", "flexsp,static_ulysses")
    assert_one_line_error(code, out, err.split("\n", 1)[1], "the flexsp run trained no steps")


def test_ctrl_c_before_a_command_sets_its_handlers_is_one_line(capsys, monkeypatch):
    import megatron_ext.commands.cli as cli

    def interrupted(name):  # (Ctrl-C while train imports torch)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    code, out, err = run(capsys, "train", "--steps", "1")
    assert code == 130 and out == "" and err == "megatron-ext: stopped by SIGINT\n"


@pytest.mark.parametrize("command", [["plan", "--batch", "16"], ["simulate", "--steps", "1", "--batch", "8"],
                                     ["bench", "planner", "--batches", "1", "--batch", "8", "--no-scale"]])
def test_a_one_token_limit_is_refused_not_drawn_for_ever(capsys, command):
    # (every piece of one token is left out: the batch never filled)
    assert_one_line_error(*run(capsys, *command, "--max-seq-len", "1"), "--max-seq-len must be at least 2 tokens")


def test_a_plot_named_only_by_its_extension_is_drawn(capsys, tmp_path):
    code, out, err = run(capsys, "plan", "--batch", "16", "--no-baselines", *FAST, "--plot", str(tmp_path / ".svg"))
    assert code == 0 and (tmp_path / ".svg").read_text().lstrip().startswith("<?xml")


def test_report_reads_a_line_only_up_to_its_limit(capsys, tmp_path, monkeypatch):
    import megatron_ext.commands.report as report

    monkeypatch.setattr(report, "RECORD_LINE_LIMIT", 1000)  # (/dev/zero: one endless line)
    (tmp_path / "steps.jsonl").write_text("0" * 5000)
    assert_one_line_error(*run(capsys, "report", str(tmp_path)), "line 1 is over 1,000 characters")


def test_bench_notes_a_ring_only_where_no_cluster_of_its_table_uses_it(capsys):
    ring = ["bench", "planner", "--zero-stage", "2", "--max-ring", "16", "--batches", "1", "--dist", "wikipedia",
            "--max-seq-len", "8K", "--per-gpu", "2", "--time-limit", "0.05"]
    _, _, err = run(capsys, *ring, "--gpus", "64,128")  # (gpt-7b's 64 heads: a ring reaches past 64 GPUs)
    assert "--max-ring" not in err
    _, _, err = run(capsys, *ring, "--gpus", "64")
    assert "note: --max-ring 16 changes nothing here" in err


@pytest.mark.parametrize("argv, match", [
    (["plan", "--step", "1", "--batch", "4"], "--seed 9223372036854775807 + --step 1 passes the largest seed"),
    (["simulate", "--steps", "2", "--batch", "4", "--planners", "flexsp"], "+ 2 steps passes the largest seed"),
])
def test_a_seed_valid_alone_but_not_for_its_steps_names_both(capsys, argv, match):
    assert_one_line_error(*run(capsys, *argv, "--seed", str(2**63 - 1), *FAST), match)


def test_plan_writes_its_files_before_a_reader_closes_stdout(tmp_path):
    """`plan ... | head -c 100`: the plot and trace are written before the plan goes to stdout, so
    a reader that stops early loses neither (the broken pipe is not an error)."""
    import fcntl
    import os

    plot, trace = tmp_path / "p.png", tmp_path / "t.json"
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, getattr(fcntl, "F_SETPIPE_SZ", 1031), 4096)  # (the plan's JSON cannot fit in the pipe)
    proc = subprocess.Popen([sys.executable, "-m", "megatron_ext.commands.cli", "plan", "--dist", "wikipedia",
                             "--batch", "256", "--json", "--no-baselines", "--plot", str(plot), "--trace", str(trace),
                             *FAST], stdout=write_end, stderr=subprocess.PIPE)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        assert reader.read(100)  # (then closed, as head does)
    assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()[-2000:]
    assert plot.stat().st_size > 0 and json.loads(trace.read_text())["traceEvents"]
