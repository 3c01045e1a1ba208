"""Stage-aware chunk-level recompute (the ILP): memory within budget at every moment of the
simulation, at most a stage's layers, the diagonal tying, no worse than the greedy."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ext.cost import CostModel
from megatron_ext.cost.pipeline import PipelineCost
from megatron_ext.errors import InfeasibleError
from megatron_ext.plan import StepPlan
from megatron_ext.planner.pp.checkpointing import greedy_recompute, solve_recompute
from megatron_ext.planner.pp.chunking import balanced_chunks
from megatron_ext.planner.pp.pipeline import _checkpoints, build_pipeline
from megatron_ext.sim import simulate
from megatron_ext.sim.engine import backward_order

COST = CostModel.from_presets("llama-13b", "a800-80g-8x4")
lengths_st = st.lists(st.one_of(st.integers(1, 4096), st.integers(4096, 98_304)), min_size=1, max_size=25)


def _recompute_ms(built, pc):
    return float((pc.recompute_ms(built.table.work, built.table.tokens, 1)[None, :] * built.recompute).sum())


@settings(max_examples=80, deadline=None)
@given(lengths=lengths_st, k=st.integers(1, 8), mem_gb=st.floats(11, 45), tied=st.booleans(),
       cap=st.sampled_from([math.inf, 20000.0]))
def test_ilp_recompute_fits_memory_at_every_moment(lengths, k, mem_gb, tied, cap):
    lengths = np.array(lengths)
    budget = mem_gb * 1024
    pc = PipelineCost(COST, 4, 8, memory_mb=budget)
    ch = balanced_chunks(np.arange(len(lengths)), lengths, pc, float(pc.prefix_ms(lengths.max())) / k, cap, 128,
                         min_tail=128)
    try:
        built = build_pipeline(ch.chunks, pc, "ilp", tied, time_limit=0.5)
    except InfeasibleError as e:
        assert "even with every layer" in str(e)
        with pytest.raises(InfeasibleError):
            build_pipeline(ch.chunks, pc, "full")  # infeasible means: not even full recompute fits
        return
    rec, L_s, P = built.recompute, pc.layers_per_stage, pc.pp
    assert rec.dtype.kind == "i" and (rec >= 0).all() and (rec <= L_s).all()
    if tied:  # ckpt(p, k) = C[b(k) + P - 1 - p]
        bpos = np.empty(built.table.n, dtype=np.int64)
        bpos[backward_order(list(range(built.table.n)), built.table)] = np.arange(built.table.n)
        diag = {}
        for p in range(P):
            for c in range(built.table.n):
                assert diag.setdefault(int(bpos[c]) + P - 1 - p, rec[p, c]) == rec[p, c]
    plan = StepPlan(kind="elastic_pp", num_gpus=32, planner="t", pipelines=[built.to_pipeline(pc)])
    res = simulate(plan, lengths, COST, memory_mb=budget)  # refuses any moment over budget
    assert max(res.peak_memory_mb) <= budget * (1 + 1e-9) + 1e-6
    if rec.any():
        assert res.recompute_ratio > 0
        greedy = build_pipeline(ch.chunks, pc, "greedy", tied)
        assert _recompute_ms(built, pc) <= _recompute_ms(greedy, pc) + 1e-6
        full = build_pipeline(ch.chunks, pc, "full")
        assert _recompute_ms(built, pc) <= _recompute_ms(full, pc) + 1e-6


def test_untied_never_needs_more_recompute_than_tied():
    lengths = np.array([90000, 60000, 30000, 20000] + [3000] * 30)
    pc = PipelineCost(COST, 4, 8, memory_mb=22 * 1024)
    ch = balanced_chunks(np.arange(len(lengths)), lengths, pc, float(pc.prefix_ms(90000)) / 6, 20000, 128)
    tied = build_pipeline(ch.chunks, pc, "ilp", True, time_limit=2.0)
    untied = build_pipeline(ch.chunks, pc, "ilp", False, time_limit=2.0)
    assert tied.recompute.any()
    assert _recompute_ms(untied, pc) <= _recompute_ms(tied, pc) * 1.02 + 1e-6  # 2% MIP gap


def test_no_recompute_when_memory_is_plenty():
    pc = PipelineCost(COST, 4, 8)
    built = build_pipeline([[(0, 0, 30000)], [(1, 0, 2000), (2, 0, 1000)]], pc, "ilp")
    assert not built.recompute.any() and built.status == "no recompute needed"
    assert built.to_pipeline(pc).chunks[0].recompute_layers_per_stage == [0, 0, 0, 0]  # one per stage, always


def test_greedy_and_ilp_refuse_the_impossible():
    pc = PipelineCost(COST, 4, 8, memory_mb=7200)  # ~550 MB of activation room
    table_pieces = [[(0, 0, 60000)], [(1, 0, 60000)]]
    with pytest.raises(InfeasibleError, match="stage 0 is \\d+ MB per GPU over its activation room"):
        build_pipeline(table_pieces, pc, "ilp")
    with pytest.raises(InfeasibleError, match="even with every layer"):
        build_pipeline(table_pieces, pc, "greedy")


def _solver_inputs():
    """Five whole sequences on 4 stages, 18 GB per GPU: (checkpoints, save, recompute ms, room)."""
    lengths = np.array([50000, 40000, 8000, 8000, 8000])
    pc = PipelineCost(COST, 4, 8, memory_mb=18 * 1024)
    built = build_pipeline([[(i, 0, int(s))] for i, s in enumerate(lengths)], pc, "full")
    cps, save = _checkpoints(built.table, built.ops, pc)
    return cps, save, pc.recompute_ms(built.table.work, built.table.tokens, 1), np.full(4, pc.activation_room_mb)


def test_solver_entry_points_directly():
    cps, save, rc, room = _solver_inputs()
    bpos = np.arange(5)
    g = greedy_recompute(cps, save, rc, 10, room, bpos, True)
    r, status = solve_recompute(cps, save, rc, 10, room, bpos, True, 1.0)
    assert status.startswith(("ilp", "greedy"))
    assert (rc[None, :] * r).sum() <= (rc[None, :] * g).sum() + 1e-6
    assert r.max() <= 10 and r.min() >= 0


def test_a_limit_spent_building_the_model_leaves_the_greedy_answer():
    # the time limit covers building the rows and the greedy, not only HiGHS: with none left the
    # greedy answer stands (and still fits), named as such
    cps, save, rc, room = _solver_inputs()
    for tied in (True, False):
        bpos = np.arange(5)
        r, status = solve_recompute(cps, save, rc, 10, room, bpos, tied, 0.0)
        assert status == "greedy (no time left for the ILP)"
        assert (r == greedy_recompute(cps, save, rc, 10, room, bpos, tied)).all() and r.any()
        for p in range(4):
            assert (cps[p].memory(save, r[p]) <= room[p] + 1e-6).all()  # (cps: the moments over it)


def test_an_ilp_plan_no_faster_than_the_search_s_greedy_is_named_in_the_status():
    # tied along the diagonals, the ILP's recompute may cost more than the search's untied greedy:
    # the greedy's plan stands, and the status says the ILP ran and why its plan is not the one shown
    from megatron_ext.planner.pp.elastic_pp import plan_elastic_pp
    from megatron_ext.planner.pp.pipeline import PipelineOptions
    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x4")
    plan = plan_elastic_pp(np.array([200000, 1000]), cost, options=PipelineOptions(recompute="ilp", ties="tied"))
    assert "greedy recompute (the ilp optimal (tied) plan, " in plan.solver_status
    ilp_s = float(plan.solver_status.split("plan, ")[1].split(" s")[0])
    assert ilp_s > plan.estimated_step_time_s


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, k=st.integers(1, 8), mem_gb=st.floats(11, 45))
def test_greedy_recompute_fits_and_lowers_every_chunk_it_can(lengths, k, mem_gb):
    # untied: one variable per stage and chunk; a layer less anywhere it recomputes puts some
    # moment of that stage over its room (the greedy's trim lowered each as far as it could)
    lengths = np.array(lengths)
    pc = PipelineCost(COST, 4, 8, memory_mb=mem_gb * 1024)
    ch = balanced_chunks(np.arange(len(lengths)), lengths, pc, float(pc.prefix_ms(lengths.max())) / k, math.inf, 128,
                         min_tail=128)
    try:
        built = build_pipeline(ch.chunks, pc, "greedy", False)
    except InfeasibleError:
        return
    cps, save = _checkpoints(built.table, built.ops, pc)
    room, r = pc.activation_room_mb, built.recompute
    for p in range(pc.pp):
        assert (cps[p].memory(save, r[p]) <= room + 1e-6).all()
        for c in np.flatnonzero(r[p]):
            lower = r[p].copy()
            lower[c] -= 1
            assert (cps[p].memory(save, lower) > room + 1e-6).any(), (p, c)


@pytest.mark.parametrize("mem_gb", [20, 22, 26])
def test_greedy_recompute_comes_close_to_the_ilp(mem_gb):
    # what the search ranks its candidates by: 4-46% over the ILP when it raised chunks by their
    # own MB per ms and never lowered them. Untied 2-7% over now; tied 4-23% (1-7% while a slice
    # kept its joined prefix K/V: recomputing a late slice then saved far more than its tokens')
    lengths = np.array([90000, 60000, 30000, 20000] + [3000] * 30)
    pc = PipelineCost(COST, 4, 8, memory_mb=mem_gb * 1024)
    ch = balanced_chunks(np.arange(len(lengths)), lengths, pc, float(pc.prefix_ms(90000)) / 6, 20000, 128)
    for tied in (True, False):
        greedy = build_pipeline(ch.chunks, pc, "greedy", tied)
        ilp = build_pipeline(ch.chunks, pc, "ilp", tied, time_limit=2.0)
        assert ilp.recompute.any() and _recompute_ms(greedy, pc) <= (1.3 if tied else 1.1) * _recompute_ms(ilp, pc)
