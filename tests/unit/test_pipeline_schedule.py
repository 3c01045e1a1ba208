"""Elastic 1F1B orders and the simulator: every F and B once per stage, dependencies respected,
warm-up counts, no deadlock; a hand-timed two-stage case; refusals of bad plans."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ext.cost import CostModel
from megatron_ext.cost.pipeline import PipelineCost
from megatron_ext.errors import InvalidPlanError
from megatron_ext.plan import Chunk, Piece, Pipeline, StepPlan, validate
from megatron_ext.plan.program import BWD, FWD, list_schedule
from megatron_ext.plan.validate import validate_pipelines
from megatron_ext.planner.pp.chunking import balanced_chunks
from megatron_ext.planner.pp.pipeline import build_pipeline
from megatron_ext.sim import simulate
from megatron_ext.sim.engine import (analyze_chunks, analyze_pieces, backward_order, greedy_orders, memory_checkpoints,
                                     one_f_one_b, op_times, warmup_counts)

COST = CostModel.from_presets("llama-13b", "a800-80g-8x4")

lengths_st = st.lists(st.one_of(st.integers(1, 4096), st.integers(4096, 98_304)), min_size=1, max_size=30)


def _plan(built, pc, lengths) -> StepPlan:
    plan = StepPlan(kind="elastic_pp", num_gpus=pc.cost.num_gpus, planner="test", pipelines=[built.to_pipeline(pc)])
    validate(plan, lengths, pc.cost)
    validate_pipelines(plan, lengths, pc.cost)
    return plan


@settings(max_examples=80, deadline=None)
@given(lengths=lengths_st, k=st.integers(1, 12), layout=st.sampled_from([(4, 8), (2, 16), (8, 4), (1, 32)]))
def test_elastic_1f1b_orders_and_timeline(lengths, k, layout):
    pp, sp = layout
    cost = COST if sp <= 8 else CostModel.from_presets("llama-7b", "a800-80g-8x4")
    pc = PipelineCost(cost, pp, sp)
    lengths = np.array(lengths)
    target = float(pc.prefix_ms(lengths.max())) / k
    ch = balanced_chunks(np.arange(len(lengths)), lengths, pc, target, math.inf, 128, min_tail=128)
    built = build_pipeline(ch.chunks, pc, "none")
    table, ops = built.table, built.ops
    n, P = table.n, pc.pp
    # every F and B exactly once per stage, F before B
    for o in ops:
        assert sorted(o) == sorted([(FWD, k) for k in range(n)] + [(BWD, k) for k in range(n)])
        pos = {op: i for i, op in enumerate(o)}
        assert all(pos[(FWD, k)] < pos[(BWD, k)] for k in range(n))
    # forwards before the first backward: |W_p| = P - p + (slices of the first split sequence - 1)
    first_block = 1
    while first_block < n and first_block - 1 in table.fwd_pred[first_block]:
        first_block += 1
    assert warmup_counts(ops) == [min(n, P - p + first_block - 1) for p in range(P)]
    # times respect every dependency; one operation at a time per stage
    fwd, bwd, _, p2p = op_times(table, pc, built.recompute)
    begin, end = list_schedule(ops, fwd, bwd, p2p, table.fwd_pred, table.bwd_pred)
    assert not np.isnan(end).any()
    eps = 1e-6
    for p in range(P):
        for k in range(n):
            if p:
                assert begin[FWD, p, k] >= end[FWD, p - 1, k] + p2p[k] - eps
            if p < P - 1:
                assert begin[BWD, p, k] >= end[BWD, p + 1, k] + p2p[k] - eps
            assert begin[BWD, p, k] >= end[FWD, p, k] - eps
            for j in table.fwd_pred[k]:  # slice i after slice i-1 (forward)
                assert begin[FWD, p, k] >= end[FWD, p, j] - eps
            for j in table.bwd_pred[k]:  # slice i-1 after slice i (backward)
                assert begin[BWD, p, k] >= end[BWD, p, j] - eps
        spans = sorted(zip(begin[:, p].ravel(), end[:, p].ravel()))
        assert all(b0 >= e1 - eps for (_, e1), (b0, _) in zip(spans, spans[1:]))
    # the StepPlan simulates to the same makespan (no deadlock)
    res = simulate(_plan(built, pc, lengths), lengths, cost)
    assert res.step_time_s * 1e3 == pytest.approx(built.makespan_ms, rel=1e-9)
    assert 0 <= res.bubble_ratio < 1
    assert res.tokens == lengths.sum()


def test_two_stages_by_hand():
    """Two equal whole-sequence chunks on 2 stages: the classic 1F1B timeline."""
    cost = CostModel.from_presets("llama-13b", "a800-80g-8x2")
    pc = PipelineCost(cost, 2, 8)
    lengths = np.array([4096, 4096])
    built = build_pipeline([[(0, 0, 4096)], [(1, 0, 4096)]], pc, "none")
    assert built.ops == [[(FWD, 0), (FWD, 1), (BWD, 0), (BWD, 1)], [(FWD, 0), (BWD, 0), (FWD, 1), (BWD, 1)]]
    w = float(pc.piece_work(4096))
    p = float(pc.p2p_ms(4096))
    f0, b0 = float(pc.fwd_ms(w, 4096, 0)), float(pc.bwd_ms(w, 4096, 0))
    f1, b1 = float(pc.fwd_ms(w, 4096, 1)), float(pc.bwd_ms(w, 4096, 1))  # the last stage runs the output layer
    assert f1 > f0 and b1 > b0
    # s0: F0 [0,f0] F1 [f0,2f0]; s1: F0 [f0+p, f0+p+f1] B0 [.., f0+p+f1+b1]; s0 B0 [f0+2p+f1+b1, +b0];
    # s1 F1 [f0+p+f1+b1, +f1] B1 [.., f0+p+2f1+2b1]; s0 B1 [f0+2p+2f1+2b1, +b0]
    T = f0 + 2 * p + 2 * f1 + 2 * b1 + b0
    assert built.makespan_ms == pytest.approx(T)
    plan = StepPlan(kind="elastic_pp", num_gpus=16, planner="test", pipelines=[built.to_pipeline(pc)])
    res = simulate(plan, lengths, cost)
    assert res.step_time_s == pytest.approx(T / 1e3)
    assert res.warmup == [[2, 1]]
    busy = 2 * (f0 + b0) + 2 * (f1 + b1)  # GPU-ms per SP rank, both stages
    assert res.bubble_ratio == pytest.approx(1 - busy / (2 * T))
    kinds = {e.kind for e in res.events}
    assert {"F", "B", "P2P"} <= kinds
    assert [e.label for e in res.timeline(0) if e.kind in "FB"] == ["p0:0", "p0:1", "p0:0", "p0:1"]


def _two_chunk_plan(order, pieces=None, stages=2):
    cost = CostModel.from_presets("llama-13b", "a800-80g-8x2")
    pieces = pieces or [[Piece(0, 0, 1000)], [Piece(1, 0, 1000)]]
    chunks = [Chunk(i, p) for i, p in enumerate(pieces)]
    return cost, StepPlan(kind="elastic_pp", num_gpus=16, planner="test",
                          pipelines=[Pipeline(stages, 8, chunks, order)])


def test_cross_stage_deadlock_is_refused():
    cost, plan = _two_chunk_plan([["F0", "B0", "F1", "B1"], ["F1", "F0", "B0", "B1"]])
    with pytest.raises(InvalidPlanError, match=r"pipeline 0: the operation order deadlocks: stage \d cannot run"):
        simulate(plan, np.array([1000, 1000]), cost)


def test_pieces_that_do_not_tile_their_sequence_are_refused():
    """simulate times no plan whose pieces leave a gap in a sequence or overlap (as validate)."""
    order = [["F0", "F1", "B1", "B0"]] * 2
    for pieces, match in (([[Piece(0, 0, 600)], [Piece(0, 650, 1000)]], "sequence 0"),
                          ([[Piece(0, 0, 600)], [Piece(0, 500, 1000)]], "sequence 0"),
                          ([[Piece(0, 0, 600)], [Piece(0, 600, 900)]], "end at 900, it has 1000 tokens")):
        cost, plan = _two_chunk_plan(order, pieces)
        with pytest.raises(InvalidPlanError, match=match):
            simulate(plan, np.array([1000]), cost)


def test_slice_order_deadlock_is_refused():
    # chunk 1 holds the second slice of sequence 0: the backward of the first slice cannot run
    # before the second's (a forward out of slice order: test_plan_program.py)
    pieces = [[Piece(0, 0, 600)], [Piece(0, 600, 1000)]]
    cost, plan = _two_chunk_plan([["F0", "F1", "B0", "B1"], ["F0", "F1", "B0", "B1"]], pieces)
    with pytest.raises(InvalidPlanError, match="stage 0 cannot run B0.*waits for .*B1 on stage 0"):
        simulate(plan, np.array([1000]), cost)
    # reversed backward runs
    cost, plan = _two_chunk_plan([["F0", "F1", "B1", "B0"], ["F0", "F1", "B1", "B0"]], pieces)
    assert simulate(plan, np.array([1000]), cost).step_time_s > 0


def test_memory_over_budget_is_refused_naming_stage_and_operation():
    cost = CostModel.from_presets("llama-13b", "a800-80g-8x4")
    pc = PipelineCost(cost, 4, 8)
    lengths = np.array([60000, 50000, 40000, 30000])
    built = build_pipeline([[(i, 0, int(s))] for i, s in enumerate(lengths)], pc, "none")
    plan = StepPlan(kind="elastic_pp", num_gpus=32, planner="test", pipelines=[built.to_pipeline(pc)])
    simulate(plan, lengths, cost)  # fits 72 GB
    with pytest.raises(InvalidPlanError, match=r"pipeline 0, stage 0: (after|during) [FB]\d+ needs \d+ MB per GPU"):
        simulate(plan, lengths, cost, memory_mb=20_000)


def test_bad_orders_and_layouts_are_refused():
    # (a malformed order, refused alike by every layer: test_plan_program.py)
    lengths = np.array([1000, 1000])
    cost, plan = _two_chunk_plan([["F0", "F1", "B0", "B1"], ["B0", "F0", "F1", "B1"]])
    with pytest.raises(InvalidPlanError, match="B0 comes before F0"):
        validate_pipelines(plan, lengths, cost)
    cost, plan = _two_chunk_plan([["F0", "F1", "B0", "B1"]] * 3, stages=3)
    with pytest.raises(InvalidPlanError, match="3 stages x SP 8 = 24 GPUs does not divide"):
        validate_pipelines(plan, lengths, cost)
    plan.pipelines[0].chunks[0].recompute_layers_per_stage = [99, 0]
    plan.pipelines[0].stages = 2
    plan.pipelines[0].order_per_stage = plan.pipelines[0].order_per_stage[:2]
    with pytest.raises(InvalidPlanError, match="recompute"):
        validate_pipelines(plan, lengths, cost)
    with pytest.raises(InvalidPlanError, match=r"recompute_layers_per_stage must be 2 integers in 0..20, got \[99, 0\]"):
        simulate(plan, lengths, cost)


def test_backward_order_reverses_each_split_sequence():
    pc = PipelineCost(COST, 4, 8)
    pieces = [[Piece(0, 0, 10)], [Piece(0, 10, 20)], [Piece(0, 20, 25), Piece(2, 0, 5)], [Piece(1, 0, 9)],
              [Piece(3, 0, 4)], [Piece(3, 4, 8)]]
    table = analyze_chunks([Chunk(i, p) for i, p in enumerate(pieces)], pc)
    assert backward_order(list(range(6)), table) == [2, 1, 0, 3, 5, 4]
    ops = one_f_one_b(list(range(6)), [2, 1, 0, 3, 5, 4], 4)
    assert warmup_counts(ops) == [6, 5, 4, 3]  # P - p + e, e = 2 (three slices of sequence 0)


def test_two_pipelines_run_back_to_back():
    pc = PipelineCost(COST, 4, 8)
    lengths = np.array([50000, 3000, 2000, 40000, 1000])
    a = build_pipeline([[(0, 0, 25000)], [(0, 25000, 50000), (1, 0, 3000)], [(2, 0, 2000)]], pc, "none")
    b = build_pipeline([[(3, 0, 40000)], [(4, 0, 1000)]], pc, "none")
    plan = StepPlan(kind="elastic_pp", num_gpus=32, planner="t", pipelines=[a.to_pipeline(pc), b.to_pipeline(pc)])
    validate(plan, lengths, COST)
    validate_pipelines(plan, lengths, COST)
    res = simulate(plan, lengths, COST)
    # the second pipeline starts on each stage when that stage is done with the first
    assert max(a.makespan_ms, b.makespan_ms) < res.step_time_s * 1e3 <= a.makespan_ms + b.makespan_ms + 1e-6
    assert len(res.warmup) == 2 and res.tokens == lengths.sum()
    # a sequence may not straddle two pipelines
    bad = StepPlan(kind="elastic_pp", num_gpus=32, planner="t", pipelines=[
        Pipeline(4, 8, [Chunk(0, [Piece(0, 0, 100)])], [["F0", "B0"]] * 4),
        Pipeline(4, 8, [Chunk(0, [Piece(0, 100, 200)])], [["F0", "B0"]] * 4)])
    with pytest.raises(InvalidPlanError, match="pipelines 0 and 1"):
        simulate(bad, np.array([200]), COST)
    with pytest.raises(InvalidPlanError, match="pipelines 0 and 1"):
        validate_pipelines(bad, np.array([200]), COST)


def test_flexsp_plans_simulate_to_their_estimate():
    from megatron_ext.planner import make_plan

    lengths = np.array([60000, 20000, 9000, 3000, 3000, 800, 500, 100])
    plan = make_plan("flexsp", lengths, COST)
    res = simulate(plan, lengths, COST)
    assert res.kind == "flexsp"
    assert res.step_time_s == pytest.approx(plan.estimated_step_time_s, rel=1e-9)
    assert len(res.peak_memory_mb) == 32 and max(res.peak_memory_mb) <= COST.cluster.memory_mb + 1e-6
    assert 0 <= res.bubble_ratio < 1
    with pytest.raises(InvalidPlanError, match="over the 20000 MB budget"):
        simulate(plan, lengths, COST, memory_mb=20000)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, k=st.integers(1, 8), layout=st.sampled_from([(4, 8), (8, 4), (2, 16)]),
       room_gb=st.sampled_from([None, 30, 12]))
def test_greedy_orders_are_valid_and_list_schedule_reproduces_them(lengths, k, layout, room_gb):
    pp, sp = layout
    cost = COST if sp <= 8 else CostModel.from_presets("llama-7b", "a800-80g-8x4")
    pc = PipelineCost(cost, pp, sp)
    lengths = np.array(lengths)
    ch = balanced_chunks(np.arange(len(lengths)), lengths, pc, float(pc.prefix_ms(lengths.max())) / k, math.inf,
                         128, min_tail=128)
    plan_chunks = [Chunk(i, [Piece(*x) for x in c]) for i, c in enumerate(ch.chunks)]
    table = analyze_chunks(plan_chunks, pc)
    n, P = table.n, pp
    fwd, bwd, _, p2p = op_times(table, pc, np.zeros((P, n)))
    forward = list(range(n))
    backward = backward_order(forward, table)
    full = [pc.chunk_memory(table.tokens, table.cached_tokens, p == P - 1)[0] for p in range(P)]
    room = None if room_gb is None else room_gb * 1024.0
    ops, makespan, holds = greedy_orders(forward, backward, table, fwd, bwd, p2p, P, full if room else None, room)
    for o in ops:  # every F and B once per stage, F before B, forwards and backwards in their orders
        assert sorted(o) == sorted([(FWD, c) for c in range(n)] + [(BWD, c) for c in range(n)])
        assert [c for kind, c in o if kind == FWD] == forward
        assert [c for kind, c in o if kind == BWD] == backward
    begin, end = list_schedule(ops, fwd, bwd, p2p, table.fwd_pred, table.bwd_pred)
    assert np.nanmax(end) == pytest.approx(makespan, rel=1e-12)
    assert holds == 0 or room is not None
    # the moments that can peak: every chunk between its forward and its backward is in flight there
    # (none during its own backward), in forward order, and one backwarded before its forward (a
    # deadlock the scheduler refuses) from its forward on
    for p, o in enumerate(ops + [one_f_one_b(forward, backward, P)[0][::-1]]):
        moments = memory_checkpoints(o, table, full[min(p, P - 1)], pc)
        assert moments.pos.tolist() == list(range(2 * n))
        live: dict[int, None] = {}
        at: dict[int, list[int]] = {c: [] for c in range(n)}  # the moments each chunk is in flight at
        for r, (kind, c) in enumerate(o):
            if kind == FWD:
                live[c] = None
            assert moments.in_flight(r).tolist() == [j for j in live if not (kind == BWD and j == c)]
            for j in moments.in_flight(r).tolist():
                at[j].append(r)
            if kind == BWD:
                live.pop(c, None)
        lo, hi = moments.runs(np.arange(len(moments)))
        assert all(at[c] == list(range(lo[c], hi[c])) for c in range(n))
    # with uniform chunks and no memory limit, list scheduling is no slower than 1F1B
    if room is None:
        ops1 = one_f_one_b(forward, backward, P)
        _, end1 = list_schedule(ops1, fwd, bwd, p2p, table.fwd_pred, table.bwd_pred)
        if len(set(np.round(table.tokens))) == 1 and not any(table.fwd_pred):
            assert makespan <= np.nanmax(end1) * (1 + 1e-9)


def test_greedy_order_fills_the_warm_up_wait_and_holds_back_for_memory():
    """A big first chunk then small ones: 1F1B's stage 0 idles after its P forwards while the big
    chunk's backward comes back; list scheduling runs more forwards meanwhile, unless memory binds."""
    pc = PipelineCost(COST, 4, 8)
    lengths = np.array([40000] + [2000] * 12)
    pieces = [[(0, 0, 40000)]] + [[(i, 0, 2000)] for i in range(1, 13)]
    one = build_pipeline(pieces, pc, "none", order="1f1b")
    greedy = build_pipeline(pieces, pc, "none", order="greedy")
    assert greedy.makespan_ms < one.makespan_ms
    assert warmup_counts(greedy.ops)[0] > warmup_counts(one.ops)[0]
    best = build_pipeline(pieces, pc, "none", order="best")
    assert best.makespan_ms == pytest.approx(min(one.makespan_ms, greedy.makespan_ms))
    tight = PipelineCost(COST, 4, 8, memory_mb=13 * 1024)
    held = build_pipeline(pieces, tight, "greedy", order="greedy")
    assert held.held > 0
    res = simulate(_plan(held, tight, lengths), lengths, COST, memory_mb=13 * 1024)
    assert res.max_peak_memory_mb <= 13 * 1024 + 1e-6


def _greedy(pieces, pc, forwards_first):
    table = analyze_pieces(pieces, pc)
    fwd, bwd, _, p2p = op_times(table, pc, np.zeros((pc.pp, table.n)))
    forward = list(range(table.n))
    return greedy_orders(forward, backward_order(forward, table), table, fwd, bwd, p2p, pc.pp,
                         forwards_first=forwards_first)


def test_greedy_order_sends_forwards_ahead_to_the_last_stage():
    """On a tie the stages before the last run the forward, so the last stage (which also runs the
    output layer) is fed; it runs the backward itself. Chunks of uneven sizes: 11% faster than
    backwards first everywhere."""
    pc = PipelineCost(COST, 4, 8)
    pieces = [[(i, 0, n)] for i, n in enumerate([2000, 500, 4000, 4000, 16000, 8000, 32000])]
    fed, fed_ms, _ = _greedy(pieces, pc, True)
    first, first_ms, _ = _greedy(pieces, pc, False)
    assert fed_ms < 0.9 * first_ms
    assert warmup_counts(fed)[:-1] > warmup_counts(first)[:-1]  # (more forwards sent ahead)
    assert warmup_counts(fed)[-1] == warmup_counts(first)[-1] == 1  # (the last stage: each F then its B)
    assert build_pipeline(pieces, pc, "none", order="greedy").makespan_ms == pytest.approx(fed_ms, rel=1e-12)


def test_greedy_order_where_memory_held_a_forward_back_keeps_the_faster_tie_break(monkeypatch):
    """Forwards sent ahead may fill the memory that later, larger chunks need: where memory held
    one back, both tie-breaks are built and the faster kept (here backwards first, 8% faster);
    where none was, forwards first alone; where one is given, that one alone."""
    import megatron_ext.planner.pp.pipeline as pipeline
    pc = PipelineCost(COST, 4, 8)
    tight = PipelineCost(COST, 4, 8, memory_mb=14 * 1024)
    pieces = [[(i, 0, n)] for i, n in enumerate([4000, 2000, 4000, 8000, 24000, 1000, 1000, 1000, 24000])]
    real = pipeline.greedy_orders
    calls = []

    def spy(*args, forwards_first=True, **kw):
        calls.append(forwards_first)
        return real(*args, forwards_first=forwards_first, **kw)

    def forced(value):
        def order(*args, forwards_first=True, **kw):
            return real(*args, forwards_first=value, **kw)
        return order

    monkeypatch.setattr(pipeline, "greedy_orders", spy)
    assert build_pipeline(pieces, pc, "greedy", order="greedy").held == 0 and calls == [True]
    calls.clear()
    kept = build_pipeline(pieces, tight, "greedy", order="greedy")
    assert calls == [True, False]
    each = []
    for value in (True, False):
        monkeypatch.setattr(pipeline, "greedy_orders", forced(value))
        each.append(build_pipeline(pieces, tight, "greedy", order="greedy").makespan_ms)
    assert kept.held > 0 and each[1] < 0.95 * each[0]
    assert kept.makespan_ms == pytest.approx(each[1], rel=1e-12) and kept.forwards_first is False
    # a tie-break given (a replica replaying another's pipeline) is built alone
    monkeypatch.setattr(pipeline, "greedy_orders", spy)
    calls.clear()
    alone = build_pipeline(pieces, tight, "greedy", order="greedy", forwards_first=True)
    assert calls == [True] and alone.forwards_first is True
    assert alone.makespan_ms == pytest.approx(each[0], rel=1e-12)


def test_cached_kv_of_a_slice_lives_until_its_sequence_s_first_slice_runs_backward():
    """The prefix cache frees a sequence's K/V with its first slice's backward: after the middle
    slice's backward its K/V (100 tokens) is still held, next to the dK/dV of its prefix."""
    from megatron_ext.sim.engine import memory_checkpoints, memory_levels

    pc = PipelineCost(COST, 4, 8)
    table = analyze_chunks([Chunk(i, [Piece(0, 100 * i, 100 * i + 100)]) for i in range(3)], pc)
    assert table.cached_tokens.tolist() == [100, 100, 0]  # the last slice's K/V is not cached
    full, save = pc.chunk_memory(table.tokens, table.cached_tokens, False)
    ops = [(FWD, 0), (FWD, 1), (FWD, 2), (BWD, 2), (BWD, 1), (BWD, 0)]
    zero = np.zeros(3)
    before, during, after = memory_levels(ops, table, full, save, zero, pc)
    tok = float(pc.dkv_mb(1))
    assert after[3] == pytest.approx(full[0] + full[1] + 200 * tok)  # slice 2 done: dK/dV of [0, 200)
    assert after[4] == pytest.approx(full[0] + 100 * tok + 100 * tok)  # dK/dV of [0, 100), slice 1's cache
    assert after[5] == pytest.approx(0.0)
    # the checkpoints (what the recompute ILP constrains) agree with the levels at their moments
    moments = memory_checkpoints(ops, table, full, pc)
    assert moments.const[moments.kind == BWD].tolist() == pytest.approx(during[3:].tolist())


@settings(max_examples=60, deadline=None)
@given(data=st.data(), lengths=st.lists(st.integers(1, 6000), min_size=1, max_size=12))
def test_analyze_pieces_matches_its_definition(data, lengths):
    """Tokens, work, split tokens and the slice chains of random chunkings (sequences cut into up to
    four slices, pieces scattered over chunks, ids given out of order), against the definitions
    walked one piece at a time."""
    pc = PipelineCost(COST, 4, 8)
    n = data.draw(st.integers(1, 8))
    pieces = [[] for _ in range(n)]
    for sid, s in enumerate(lengths):
        cuts = sorted(set(data.draw(st.lists(st.integers(1, s - 1), max_size=3)) if s > 1 else []))
        bounds = [0, *cuts, s]
        homes = data.draw(st.lists(st.integers(0, n - 1), min_size=len(bounds) - 1, max_size=len(bounds) - 1,
                                   unique=True)) if len(bounds) - 1 <= n else None
        if homes is None:
            homes, bounds = [data.draw(st.integers(0, n - 1))], [0, s]
        for i, (a, b) in zip(homes, zip(bounds, bounds[1:])):
            pieces[i].append((sid, a, b))
    keep = [i for i in range(n) if pieces[i]]
    pieces = [pieces[i] for i in keep]
    ids = data.draw(st.permutations(range(100, 100 + len(pieces))))
    table = analyze_pieces(pieces, pc, ids=ids)
    assert table.ids == list(ids)
    assert table.tokens.tolist() == [float(sum(b - a for _, a, b in c)) for c in pieces]
    assert table.work == pytest.approx([sum(float(pc.piece_work(b - a, a)) for _, a, b in c) for c in pieces])
    slices = {}  # split sequence -> its (start, end, chunk) in token order
    for i, c in enumerate(pieces):
        for sid, a, b in c:
            slices.setdefault(sid, []).append((a, b, i))
    slices = {sid: sorted(ps) for sid, ps in slices.items() if len(ps) > 1}
    assert table.seq_end == {sid: ps[-1][1] for sid, ps in slices.items()}
    assert table.cached_tokens.tolist() == [float(sum(b - a for sid, a, b in c if sid in slices and b < lengths[sid]))
                                            for c in pieces]
    assert [sorted(x) for x in table.split_pieces] == [sorted((sid, a, b) for sid, a, b in c if sid in slices)
                                                       for c in pieces]
    for i in range(len(pieces)):
        assert sorted(table.fwd_pred[i]) == sorted(ps[j - 1][2] for ps in slices.values() for j in range(1, len(ps))
                                                   if ps[j][2] == i)
        assert sorted(table.bwd_pred[i]) == sorted(ps[j + 1][2] for ps in slices.values()
                                                   for j in range(len(ps) - 1) if ps[j][2] == i)


def test_analyze_pieces_refuses_a_sequence_twice_in_a_chunk_and_repeated_ids():
    pc = PipelineCost(COST, 4, 8)
    with pytest.raises(InvalidPlanError, match="chunk 7: holds two pieces of sequence 3"):
        analyze_pieces([[(0, 0, 5)], [(3, 0, 2), (1, 0, 4), (3, 4, 6)]], pc, ids=[2, 7])
    with pytest.raises(InvalidPlanError, match="chunk ids are not unique"):
        analyze_pieces([[(0, 0, 5)], [(1, 0, 4)]], pc, ids=[2, 2])
