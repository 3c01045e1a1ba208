"""--trace: the simulated timeline as Chrome trace-event JSON (sim/trace.py), loaded back and
checked the way Perfetto reads it: named tracks, well-formed slices that hold every sequence,
memory counters against the budget."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest

from megatron_ext.cost import CostModel
from megatron_ext.planner import PlannerOptions, make_plan
from megatron_ext.sim import simulate
from megatron_ext.sim.trace import plan_trace_events, trace_document, write_trace

COST = CostModel.from_presets("gpt-7b", "a100-40g-8x8")
LENGTHS = np.random.default_rng(3).integers(200, 40_000, 48)


def _load(tmp_path, plan):
    path = tmp_path / "t.json"
    write_trace(str(path), trace_document(plan_trace_events(plan, LENGTHS, COST), model="gpt-7b"))
    doc = json.loads(path.read_text())
    assert set(doc) == {"traceEvents", "displayTimeUnit", "metadata"}
    by_phase = defaultdict(list)
    for e in doc["traceEvents"]:
        by_phase[e["ph"]].append(e)
    assert set(by_phase) == {"M", "X", "C"}
    tracks = {e["tid"]: e["args"]["name"] for e in by_phase["M"] if e["name"] == "thread_name"}
    for e in by_phase["X"]:
        assert e["tid"] in tracks and e["ts"] >= 0 and e["dur"] >= 0 and e["name"] and e["cat"]
    step_us = simulate(plan, LENGTHS, COST).step_time_s * 1e6
    assert max(e["ts"] + e["dur"] for e in by_phase["X"]) == pytest.approx(step_us, rel=1e-6)
    for c in by_phase["C"]:
        assert 0 <= c["args"]["used"] <= c["args"]["budget"] * (1 + 1e-6)
    return tracks, by_phase["X"], by_phase["C"]


def test_flexsp_trace_has_a_track_per_gpu_and_every_sequence_once(tmp_path):
    plan = make_plan("flexsp", LENGTHS, COST, PlannerOptions(time_limit=1.0))
    tracks, slices, counters = _load(tmp_path, plan)
    assert sorted(tracks) == list(range(64)) and tracks[5] == "GPU 5"
    groups = {(e["args"]["micro_batch"], tuple(e["args"]["ranks"])): e for e in slices}
    assert len(slices) == sum(len(g) for _, g in groups)  # a slice on each GPU of each group
    seqs = sorted(s for e in groups.values() for s in e["args"]["seq_ids"])
    assert seqs == list(range(len(LENGTHS)))
    assert {c["name"] for c in counters} == {f"memory GPU {r} (GB)" for r in range(64)}


def test_pipeline_trace_has_forward_backward_per_chunk_and_stage(tmp_path):
    plan = make_plan("elastic_pp", LENGTHS, COST, PlannerOptions(time_limit=1.0))
    tracks, slices, _ = _load(tmp_path, plan)
    stages = plan.pipelines[0].stages
    assert len(tracks) == COST.num_gpus // (stages * plan.pipelines[0].sp_degree) * stages
    kinds = defaultdict(set)
    for e in slices:
        kinds[(e["args"]["pipeline"], e["args"]["chunk"], e["cat"])].add(e["tid"])
    for pi, p in enumerate(plan.pipelines):
        for c in p.chunks:
            assert len(kinds[(pi, c.id, "forward")]) == stages and len(kinds[(pi, c.id, "backward")]) == stages
    tokens = defaultdict(int)
    for (pi, cid, cat), _ in kinds.items():
        if cat == "forward":
            chunk = next(c for c in plan.pipelines[pi].chunks if c.id == cid)
            for piece in chunk.pieces:
                tokens[piece.seq_id] += piece.end - piece.start
    assert dict(tokens) == {i: int(n) for i, n in enumerate(LENGTHS)}


def test_plan_cli_writes_a_trace_and_refuses_other_names(tmp_path):
    cli = [sys.executable, "-m", "megatron_ext.commands.cli", "plan", "--dist", "wikipedia", "--model", "gpt-7b",
           "--cluster", "a100-40g-8x8", "--no-baselines"]
    out = tmp_path / "plan.json"
    done = subprocess.run([*cli, "--trace", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ui.perfetto.dev" in done.stderr and json.loads(out.read_text())["traceEvents"]
    bad = subprocess.run([*cli, "--trace", str(tmp_path / "plan.png")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "must end in .json" in bad.stderr


def test_measured_flexsp_step_draws_each_group_from_its_last_rank_s_start():
    """Ranks are not synchronised between micro-batches: ranks 0-1, done early in micro-batch 0,
    start micro-batch 1 at 1 s and wait in its all-to-all for ranks 2-3 (3 s): each rank's own
    interval says 4 s, the group worked 2 s, and the trace draws it from 3 s to 5 s on every GPU."""
    from megatron_ext.plan.schema import MicroBatchPlan, SPGroup, StepPlan
    from megatron_ext.sim.trace import group_spans, measured_flexsp_events, measured_micro_batch_s

    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x1")
    plan = StepPlan(kind="flexsp", num_gpus=8, planner="flexsp", micro_batches=[
        MicroBatchPlan([SPGroup(ranks=[0, 1], seq_ids=[0]), SPGroup(ranks=[2, 3], seq_ids=[1])]),
        MicroBatchPlan([SPGroup(ranks=[0, 1, 2, 3], seq_ids=[2])])])
    rank_s = [[1.0, 4.0]] * 2 + [[3.0, 2.0]] * 2 + [[0.5, 0.5]] * 4  # (ranks 4-7 idle)
    assert group_spans(plan, rank_s)[1] == [(3.0, {0: 5.0, 1: 5.0, 2: 5.0, 3: 5.0})]
    assert measured_micro_batch_s(plan, rank_s) == [3.0, 2.0]
    events = [e for e in measured_flexsp_events(plan, [100, 200, 300], cost, rank_s, pid=2, offset_s=10.0)
              if e["ph"] == "X"]
    assert sorted((e["tid"], e["ts"], e["dur"]) for e in events) == [
        (0, 10e6, 1e6), (0, 13e6, 2e6), (1, 10e6, 1e6), (1, 13e6, 2e6),
        (2, 10e6, 3e6), (2, 13e6, 2e6), (3, 10e6, 3e6), (3, 13e6, 2e6)]
