"""elastic_pp at the edges: batches at the memory limit (the per-sequence check and the search
agree: what the check passes plans, what it refuses says what to change), large batches (the
grouping DP over blocks, the time limit's stages) and the plan's recompute lists (one entry per
stage, always)."""
from __future__ import annotations

import json
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ext.cost import CostModel
from megatron_ext.data.lengths import sample_lengths
from megatron_ext.errors import InfeasibleError, OutOfTimeError
from megatron_ext.plan import StepPlan, validate
from megatron_ext.plan.schema import Chunk, Piece
from megatron_ext.plan.validate import validate_pipelines
from megatron_ext.planner.pp.chunking import balanced_chunks, capped_mesh, check_chunking
from megatron_ext.planner.pp.grouping import GROUP_BLOCKS, _group_bounds, _group_estimates, group_sequences
from megatron_ext.planner.pp.chunk_search import MAX_CHUNKS, plan_group
from megatron_ext.planner.pp.elastic_pp import plan_elastic_pp
from megatron_ext.planner.pp.pipeline import PipelineOptions, build_pipeline, pipeline_cost
from megatron_ext.planner.pp.sequence_limits import (MAX_SLICES, finest_slice, fit_cap, longest_sequence,
                                                     sequence_peak_mb)
from megatron_ext.sim import simulate
from megatron_ext.sim.engine import analyze_chunks, backward_order, memory_levels, one_f_one_b

TINY4 = CostModel.from_presets("tiny4", "cpu-4")  # 4 layers: its output layer's logits dominate the last stage
COST = CostModel.from_presets("llama-13b", "a800-80g-8x4")


def _valid(plan: StepPlan, lengths, cost, **sim):
    """Valid, simulates to its estimate, within the memory budget; returns the SimResult."""
    validate(plan, lengths, cost)
    validate_pipelines(plan, lengths, cost)
    res = simulate(StepPlan.from_json(plan.to_json()), lengths, cost, **sim)
    assert res.step_time_s == pytest.approx(plan.estimated_step_time_s, rel=1e-9)
    assert res.max_peak_memory_mb <= res.budget_mb * (1 + 1e-9)
    return res


# ---- A: the per-sequence check and the search agree ------------------------------------------

def test_sequence_peak_is_the_simulators_peak_of_a_sequence_alone():
    """sequence_peak_mb (what the check and the slice caps use) is exactly the simulator's peak
    of one sequence cut at those points with every layer recomputed, on its worst stage."""
    for cost, pp in ((COST, 4), (TINY4, 4), (TINY4, 2)):
        pc = pipeline_cost(cost, pp, None, PipelineOptions())
        for s, cuts in ((3000, []), (3000, [1000, 2000]), (20011, list(range(128, 20011, 128))), (20011, [700, 5000])):
            bounds = [0, *cuts, s]
            chunks = [Chunk(i, [Piece(0, a, b)]) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
            table = analyze_chunks(chunks, pc)
            forward = list(range(table.n))
            ops = one_f_one_b(forward, backward_order(forward, table), pp)
            rec = np.full(table.n, pc.layers_per_stage)
            _, save = pc.chunk_memory(table.tokens, table.cached_tokens, False)
            sim = 0.0
            for p in range(pp):  # (the simulator's measure: memory during each operation)
                full, _ = pc.chunk_memory(table.tokens, table.cached_tokens, p == pp - 1)
                sim = max(sim, memory_levels(ops[p], table, full, save, rec, pc)[1].max())
            assert sequence_peak_mb(pc, bounds) == pytest.approx(sim, rel=1e-9)


def test_the_reviewers_tiny4_batch_is_refused_up_front_with_what_to_change():
    """wikipedia x 16 on tiny4 / cpu-4 / pp 4: its 4,524-token sequence cannot run at any
    slicing (the last stage keeps every slice's logits: ~37 MB of a 33.5 MB room). The check
    says so before the search, with the longest length that fits and the knobs to turn."""
    pc = pipeline_cost(TINY4, 4, None, PipelineOptions())
    lim = longest_sequence(pc)
    assert 3000 < lim < 4096
    lengths = sample_lengths("wikipedia", 16, 0, 30413)  # the CLI's default limit for this layout
    assert lengths.max() == 4524
    with pytest.raises(InfeasibleError) as e:
        plan_elastic_pp(lengths, TINY4, pp=4)
    msg = str(e.value)
    assert msg.startswith(f"sequence {int(np.argmax(lengths))} of 4524 tokens does not fit a stage even cut into")
    assert "last stage" in msg and f"sequences up to {lim} tokens fit" in msg
    for knob in ("--max-seq-len", "--pp", "--sp", "--memory-mb"):
        assert knob in msg
    with pytest.raises(InfeasibleError, match=f"of {lim + 1} tokens does not fit"):
        plan_elastic_pp(np.array([lim + 1, 100]), TINY4, pp=4)


@pytest.mark.parametrize("pp", [4, 2])
def test_tiny4_plans_within_memory_up_to_the_longest_sequence_the_check_passes(pp):
    """The reviewer's batch capped at the longest sequence a stage holds, and batches holding
    sequences of exactly that length (the old planner passed its check on them and then failed:
    'stage 3 is N MB over its activation room even with every layer recomputed'), plan and
    simulate within the budget."""
    pc = pipeline_cost(TINY4, pp, None, PipelineOptions())
    lim = longest_sequence(pc)
    batches = [sample_lengths("wikipedia", 16, 0, lim), np.array([lim]), np.array([lim, 100, 2000, 50]),
               np.array([lim, lim - 7, int(0.9 * lim)] + [300] * 10)]
    for lengths in batches:
        plan = plan_elastic_pp(lengths, TINY4, pp=pp, time_limit=0.3)
        _valid(plan, lengths, TINY4)


@settings(max_examples=12, deadline=None)
@given(pp=st.sampled_from([4, 2]), top=st.lists(st.floats(0.6, 1.0), min_size=1, max_size=4),
       short=st.lists(st.integers(1, 900), max_size=25))
def test_whatever_the_check_passes_plans_within_memory(pp, top, short):
    pc = pipeline_cost(TINY4, pp, None, PipelineOptions())
    lim = longest_sequence(pc)
    lengths = np.array([max(1, int(f * lim)) for f in top] + short)
    plan = plan_elastic_pp(lengths, TINY4, pp=pp, time_limit=0.2)
    _valid(plan, lengths, TINY4)


def test_memory_bound_sequences_are_sliced_as_finely_as_memory_needs():
    """llama-13b, 4 x 8, 20 GB: sequences at 99.9% and 100% of the longest a stage holds need
    slices far below min_slice_tokens (equal-time slicing would need them too fine to search;
    the old planner gave up: 'stage 0 is 3109 MB per GPU over its activation room'); they are
    token-capped (chunking.capped_mesh) and the plan fits."""
    pc = pipeline_cost(COST, 4, 8, PipelineOptions(memory_mb=20000))
    lim = longest_sequence(pc)
    for top in (int(0.999 * lim), lim):
        lengths = np.array([top, 30000, 5000, 700])
        plan = plan_elastic_pp(lengths, COST, 4, 8, memory_mb=20000, time_limit=0.3)
        _valid(plan, lengths, COST, memory_mb=20000)
        pieces = [x.end - x.start for p in plan.pipelines for c in p.chunks for x in c.pieces if x.seq_id == 0]
        assert max(pieces) < 1024 and len(pieces) > top // 1024  # finer than min_slice_tokens...
        assert len(pieces) <= MAX_SLICES  # ...but no finer than the finest slicing


def test_capped_mesh_and_chunks():
    pc = pipeline_cost(COST, 4, 8, PipelineOptions())
    for s, k, cap in ((650_000, 40, 640), (650_000, 3, 5000), (129_000, 1, 128), (5000, 8, 10**9)):
        step = float(pc.prefix_ms(s)) / k
        mesh = capped_mesh(s, step, pc, 128, min(cap, s))
        bounds = np.concatenate([[0], mesh, [s]])
        assert (np.diff(bounds) > 0).all() and (mesh % 128 == 0).all()
        assert np.diff(bounds).max() <= max(128, min(cap, s) // 128 * 128)
        granule = float(pc.prefix_ms(s) - pc.prefix_ms(s - 128))
        assert (np.diff(pc.prefix_ms(bounds.astype(float))) <= step + granule + 1e-6).all()
    # equal-time slicing under the same cap needs ~(s / cap)^2 slices where attention dominates
    lengths = np.array([650_000, 300_000, 20_000, 3000, 100])
    ids = np.arange(len(lengths))
    ch = balanced_chunks(ids, lengths, pc, float(pc.prefix_ms(650_000)) / 8, 40_000, 128, min_tail=128,
                         max_slice_tokens=lambda s: 2048 if s > 400_000 else None)
    check_chunking(ch.chunks, lengths)
    own = [b - a for c in ch.chunks for x, a, b in c if x == 0]
    other = [b - a for c in ch.chunks for x, a, b in c if x == 1]
    assert max(own) <= 2048 and max(other) > 2048  # each long sequence at its own cap
    plain = balanced_chunks(ids, lengths, pc, float(pc.prefix_ms(650_000)) / 8, 2048, 128, min_tail=128)
    assert len(ch.chunks) < len(plain.chunks) / 4


# ---- B: large batches ------------------------------------------------------------------------

def _exact_grouping(seq_ids, lengths, pc, max_groups):
    """The grouping DP over single sequences (the reference for up to GROUP_BLOCKS sequences)."""
    order = seq_ids[np.lexsort((seq_ids, -lengths[seq_ids]))]
    n = len(order)
    est = _group_estimates(order, lengths, pc)
    G = max(1, min(max_groups, n))
    dp = np.full((G + 1, n + 1), np.inf)
    arg = np.zeros((G + 1, n + 1), dtype=np.int64)
    dp[0, 0] = 0.0
    for g in range(1, G + 1):
        for j in range(1, n + 1):
            v = dp[g - 1, :j] + est[:j, j]
            i = int(np.argmin(v))
            dp[g, j], arg[g, j] = v[i], i
    g = int(np.argmin(dp[1:, n])) + 1
    if not np.isfinite(dp[g, n]):
        return None
    cuts, j = [], n
    for gg in range(g, 0, -1):
        i = int(arg[gg, j])
        cuts.append((i, j))
        j = i
    return [order[i:j].tolist() for i, j in reversed(cuts) if j > i]


@pytest.mark.parametrize("mem", [None, 30000, 20000])
def test_grouping_is_the_exact_dp_up_to_group_blocks_sequences(mem):
    pc = pipeline_cost(COST, 4, 8, PipelineOptions(memory_mb=mem))
    for dist, n in (("github", 300), ("commoncrawl", GROUP_BLOCKS)):
        lengths = sample_lengths(dist, n, 1, 96 * 1024)
        ids = np.arange(n)
        order = ids[np.lexsort((ids, -lengths))]
        assert _group_bounds(order, lengths, pc).tolist() == list(range(n + 1))
        want = _exact_grouping(ids, lengths, pc, 3)
        if want is not None:
            assert [g.tolist() for g in group_sequences(ids, lengths, pc, 3)] == want


def test_large_batch_plans_a_valid_step():
    """20,000 sequences: the grouping DP runs over at most GROUP_BLOCKS blocks (not a 20,001^2
    matrix), its groups are consecutive in the sorted order, and the plan is valid with a sane
    number of pipelines and chunks (every stage past the first feasible candidate yields to the
    time limit; wall time is not asserted here)."""
    lengths = sample_lengths("commoncrawl", 20000, 0, 48 * 1024)
    ids = np.arange(len(lengths))
    pc = pipeline_cost(COST, 4, 8, PipelineOptions())
    order = ids[np.lexsort((ids, -lengths))]
    bounds = _group_bounds(order, lengths, pc)
    assert bounds[0] == 0 and bounds[-1] == len(lengths) and len(bounds) <= GROUP_BLOCKS + 3
    assert (np.diff(bounds) > 0).all()
    tracemalloc.start()
    try:
        groups = group_sequences(ids, lengths, pc, 3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20  # the per-sequence DP's matrix alone would be 3.2 GB
    assert 1 <= len(groups) <= 3 and all(len(g) for g in groups)
    assert np.concatenate(groups).tolist() == order.tolist()
    plan = plan_elastic_pp(lengths, COST, 4, 8, time_limit=0.3)
    _valid(plan, lengths, COST)
    assert 1 <= len(plan.pipelines) <= 3 and not plan.dropped_seq_ids
    assert {x.seq_id for p in plan.pipelines for c in p.chunks for x in c.pieces} == set(range(len(lengths)))
    assert all(1 <= len(p.chunks) <= 4096 for p in plan.pipelines)  # (which plan depends on the clock)


def test_a_pipeline_out_of_time_with_nothing_feasible_falls_back_to_a_chunking_of_sane_size():
    """A pipeline whose deadline passed before anything fitted (a grouping probed after a failed
    one) goes straight to the last resort: each sequence at its own slice cap makes ~5,000 chunks
    of these 51 long sequences, over MAX_CHUNKS, where elastic_pp refused this batch of 205 at
    0.5 s; it then takes the fewest equal-time slices that let the longest sequence fit."""
    cost = CostModel.from_presets("llama-13b", "a800-80g-8x1", 2)
    pc = pipeline_cost(cost, 4, 2, PipelineOptions())
    lengths = np.random.default_rng(7).integers(1, longest_sequence(pc) + 1, 205)
    ids = np.argsort(-lengths, kind="stable")[:51]
    built = plan_group(ids, lengths, pc, PipelineOptions(), time.perf_counter() - 1)
    assert built.table.n <= MAX_CHUNKS
    assert sorted({p[0] for c in built.pieces for p in c}) == sorted(ids.tolist())
    # where another grouping's plan stands (``give_up``), the same search past its time drops the
    # grouping rather than hunt on for a feasible chunking (which ran elastic_pp past its limit)
    with pytest.raises(OutOfTimeError, match="nothing fitted before the time ran out"):
        plan_group(ids, lengths, pc, PipelineOptions(), time.perf_counter() - 1, give_up=time.perf_counter() - 1)
    # a search that finds a feasible chunking before it is given up keeps it
    built = plan_group(ids, lengths, pc, PipelineOptions(), time.perf_counter() - 1, give_up=time.perf_counter() + 60)
    assert sorted({p[0] for c in built.pieces for p in c}) == sorted(ids.tolist())


def test_many_sequences_at_the_longest_a_layout_holds_plan_in_as_many_pipelines_as_their_slices_need():
    """gpt-7b on 8 A100-40GB at ZeRO-1, 4 x 2 (the one layout whose model states fit and which holds
    26,741 tokens, the CLI's default --max-seq-len): such a sequence fits only in 209 slices of 128
    tokens. Forty of them beside 60 short ones were refused (every grouping's first pipeline, its
    sequences sliced on the longest's time step, had more than MAX_CHUNKS chunks); each sequence
    now sliced only as its memory needs, they spread over more pipelines than ``max_pipelines``."""
    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x1", 1)
    pc = pipeline_cost(cost, 4, 2, PipelineOptions())
    assert longest_sequence(pc) == 26741 and fit_cap(26741, pc, 128) == 128
    lengths = np.concatenate([[26741] * 40, np.random.default_rng(0).integers(100, 4000, 60)])
    plan = plan_elastic_pp(lengths, cost, 4, 2, time_limit=0.5)
    validate(plan, lengths, cost)
    assert simulate(plan, lengths, cost).step_time_s == plan.estimated_step_time_s
    assert len(plan.pipelines) > PipelineOptions().max_pipelines
    assert all(len(p.chunks) <= MAX_CHUNKS for p in plan.pipelines)
    # one pipeline of 18 of them and the 60: sliced on the longest's time step, more than MAX_CHUNKS;
    # sliced as memory needs, each a chunk (3,822); with 20 of them that is too many (4,240), and
    # the error says what was tried
    fewest = {n: sum(-(-int(s) // (fit_cap(int(s), pc, 128) or int(s))) for s in lengths[40 - n:])
              for n in (18, 20)}
    assert fewest[18] < MAX_CHUNKS < fewest[20]
    built = plan_group(np.arange(78), lengths[22:], pc, PipelineOptions(), time.perf_counter() - 1)
    assert built.table.n == fewest[18] and max(b - a for c in built.pieces for _, a, b in c) <= 4000
    with pytest.raises(InfeasibleError, match=f"{fewest[20]} chunks, .* \\(each sequence sliced only as its memory"):
        plan_group(np.arange(80), lengths[20:], pc, PipelineOptions(), time.perf_counter() - 1)


# ---- C: recompute lists ----------------------------------------------------------------------

def test_every_chunk_lists_recompute_for_every_stage():
    """The StepPlan contract: recompute_layers_per_stage is one integer per stage for every
    chunk, zeros when nothing is recomputed (not an empty list)."""
    quiet = sample_lengths("github", 8, 0, 48 * 1024)
    tight = sample_lengths("github", 256, 0, 48 * 1024)
    for lengths, mem in ((quiet, None), (tight, 24000)):  # (time for the whole search: a busy machine's
        # cut-short search may stop at a chunking fine enough to need no recompute)
        plan = plan_elastic_pp(lengths, COST, 4, 8, memory_mb=mem, time_limit=5.0)
        data = json.loads(plan.to_json())
        recs = [c["recompute_layers_per_stage"] for p in data["pipelines"] for c in p["chunks"]]
        assert recs and all(len(r) == p["stages"] for p in data["pipelines"]
                            for r in (c["recompute_layers_per_stage"] for c in p["chunks"]))
        assert all(isinstance(v, int) and 0 <= v <= 10 for r in recs for v in r)
        assert any(any(r) for r in recs) == (mem is not None)
    pc = pipeline_cost(COST, 4, 8, PipelineOptions())
    built = build_pipeline([[(0, 0, 30000)], [(1, 0, 2000), (2, 0, 1000)]], pc, "ilp")
    assert [c.recompute_layers_per_stage for c in built.to_pipeline(pc).chunks] == [[0, 0, 0, 0]] * 2


def test_finest_slice():
    assert finest_slice(100, 128) == 128 and finest_slice(128 * MAX_SLICES, 128) == 128
    assert finest_slice(128 * MAX_SLICES + 1, 128) == 256
    assert finest_slice(650_000, 128) % 128 == 0 and 650_000 / finest_slice(650_000, 128) <= MAX_SLICES


@pytest.mark.parametrize("field, value", [("min_slice_tokens", 0), ("pack_slices", ()), ("seq1f1b_slices", ()),
                                          ("granularity", -128), ("pack_slices", (2, 0))])
def test_pipeline_options_out_of_range_are_refused(field, value):
    # (they ended in ZeroDivisionError, ValueError or "raise None" inside a planner)
    from megatron_ext.errors import ConfigError
    from megatron_ext.planner.pp.pipeline import PipelineOptions

    with pytest.raises(ConfigError, match=field.replace("_", " ")):
        PipelineOptions(**{field: value})


@pytest.mark.parametrize("field, value", [("num_buckets", 0), ("search_budget", 0), ("extra_microbatches", -1)])
def test_planner_options_out_of_range_are_refused(field, value):
    from megatron_ext.errors import ConfigError
    from megatron_ext.planner import PlannerOptions

    with pytest.raises(ConfigError, match=field.replace("_", " ")):
        PlannerOptions(**{field: value})


def test_a_negative_sequence_id_is_an_invalid_plan():
    from megatron_ext.cost import CostModel
    from megatron_ext.errors import InvalidPlanError
    from megatron_ext.plan import StepPlan
    from megatron_ext.plan.validate import validate
    from megatron_ext.planner import make_plan
    from megatron_ext.planner.pp.pipeline import PipelineOptions

    cost = CostModel.from_presets("tiny4", "cpu-4", 0)
    lengths = np.array([100, 200, 300])
    d = make_plan("elastic_pp", lengths, cost, PipelineOptions(time_limit=0.2)).to_dict()
    d["pipelines"][0]["chunks"][0]["pieces"][0]["seq_id"] = -1
    with pytest.raises(InvalidPlanError, match=r"piece -1\[0:\d+\] is outside its sequence"):
        validate(StepPlan.from_dict(d), lengths, cost)


def test_flexsp_baselines_of_a_pipeline_plan_get_its_memory_budget():
    from megatron_ext.cost import CostModel
    from megatron_ext.planner import make_plan
    from megatron_ext.planner.pp.pipeline import PipelineOptions

    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x1", 3)
    lengths = np.random.default_rng(0).integers(1000, 12000, 64)
    plan = make_plan("elastic_pp", lengths, cost, PipelineOptions(time_limit=0.3, memory_mb=20_000),
                     baselines=("static_ulysses",))
    # (under the whole 40 GB it runs, at 28.6 GB a GPU: a comparison of different budgets)
    assert "error" in plan.baselines["static_ulysses"]
    assert "error" not in make_plan("elastic_pp", lengths, cost, PipelineOptions(time_limit=0.3),
                                    baselines=("static_ulysses",)).baselines["static_ulysses"]


def test_auto_runs_a_slow_layout_when_flexsp_cannot_hold_the_batch():
    """A layout slow to build is left out only while something else can run: here FlexSP holds
    no sequence of the batch (it refused the batch elastic_pp plans)."""
    from megatron_ext.planner import make_plan
    from megatron_ext.planner.api import max_seq_len
    from megatron_ext.planner.pp.pipeline import PipelineOptions

    cost = CostModel.from_presets("gpt-13b", "h100-80g-8x2", 3)
    opts = PipelineOptions(time_limit=0.3, pp=4, sp=4)
    longest = max_seq_len("auto", cost, opts)
    assert longest > cost.max_seq_len  # (past FlexSP's largest group)
    plan = make_plan("auto", np.array([longest, longest]), cost, opts)
    assert plan.kind == "elastic_pp" and not plan.dropped_seq_ids


def test_a_hurried_pipeline_of_short_sequences_plans_them_whole():
    """Past its deadline with nothing built, a pipeline's last resort sliced from the longest
    sequence's half down to the finest slice: a group of sequences under 256 tokens had nothing to
    try, and the step was refused (the longest in a pipeline of its own, the rest short)."""
    from megatron_ext.cost.pipeline import PipelineCost
    from megatron_ext.planner.pp.sequence_limits import longest_sequence

    cost = CostModel.from_presets("tiny", "cpu-4", 3)
    lengths = np.array([longest_sequence(PipelineCost(cost, 2, 2)), 129, 67, 6])  # (the longest the layout holds)
    plan = plan_elastic_pp(lengths, cost, options=PipelineOptions(time_limit=1e-3))
    validate(plan, lengths, cost)
    assert len(plan.pipelines) == 2 and sum(len(p.chunks) for p in plan.pipelines) > 1


def test_a_stage_runs_ulysses_only():
    """A ring degree (past the heads' Ulysses limit) is not a stage's SP degree: the runtime's
    Ulysses attention would fail mid-step; the cost model and the validator refuse it."""
    from megatron_ext.errors import ConfigError, InvalidPlanError

    cost = CostModel.from_presets("llama-13b", "a800-80g-8x4", 3)  # 40 heads: Ulysses up to 8
    with pytest.raises(ConfigError, match="SP degree 16 of a pipeline stage is past llama-13b's Ulysses limit"):
        pipeline_cost(cost.with_max_ring(2), 2, 16, PipelineOptions())
    lengths = np.array([9000, 3000])
    plan = plan_elastic_pp(lengths, cost, 4, 8)
    for p in plan.pipelines:
        p.sp_degree = 16  # (2 x 16 GPUs would hold 2 x 8's chunks)
        p.stages = 2
    with pytest.raises(InvalidPlanError, match="SP degree 16 is not allowed \\(a stage runs Ulysses only"):
        validate_pipelines(plan, lengths, cost.with_max_ring(2))


def test_with_no_recompute_the_longest_sequence_is_the_longest_that_fits_whole():
    """``--recompute none``: cutting a sequence recomputes nothing and only adds the prefix cache,
    so the limit (the CLI's default --max-seq-len, the error's advice) is the longest that fits
    whole; a sequence of that length plans within memory, one token more is refused up front
    saying so, and the limit is below the one with recompute."""
    pc = pipeline_cost(COST, 4, 8, PipelineOptions(memory_mb=20000))
    lim = longest_sequence(pc, recompute="none")
    assert 0 < lim < longest_sequence(pc)
    assert sequence_peak_mb(pc, [0, lim]) <= pc.activation_room_mb < sequence_peak_mb(pc, [0, lim + 1])
    lengths = np.array([lim, 3000, 700])
    plan = plan_elastic_pp(lengths, COST, 4, 8, memory_mb=20000, recompute="none", time_limit=0.3)
    _valid(plan, lengths, COST, memory_mb=20000)
    assert not any(v for p in plan.pipelines for c in p.chunks for v in c.recompute_layers_per_stage)
    with pytest.raises(InfeasibleError) as e:
        plan_elastic_pp(np.array([lim + 1, 700]), COST, 4, 8, memory_mb=20000, recompute="none", time_limit=0.3)
    msg = str(e.value)
    assert f"of {lim + 1} tokens does not fit a stage whole with no layer recomputed" in msg
    assert f"at most {lim})" in msg and "--recompute ilp" in msg


@pytest.mark.parametrize("name", ["batch_1f1b", "seq1f1b"])
def test_packed_baselines_run_up_to_their_own_limit(name):
    """A packed baseline's longest sequence (``max_seq_len``, the CLI's default --max-seq-len) is
    what fits alone in its pack (the sequence rounded up to 1K) cut into its slices, below
    elastic_pp's at its finest slicing: it plans within memory beside a few short sequences (its
    fixed 1F1B order may hold long neighbours' slices in flight beside it, so not with any batch),
    and one token more is refused up front with the limit and what else to change (the default
    was elastic_pp's, at which a packed baseline failed)."""
    from megatron_ext.planner.api import PLANNERS, max_seq_len

    opts = PipelineOptions(memory_mb=20000)
    lim = max_seq_len(name, COST, opts)
    assert 0 < lim < max_seq_len("elastic_pp", COST, opts) and lim % 1024 == 0
    lengths = np.array([lim, 700, 300])
    _valid(PLANNERS[name].plan(lengths, COST, opts), lengths, COST, memory_mb=20000)
    with pytest.raises(InfeasibleError) as e:
        PLANNERS[name].plan(np.array([lim + 1, 700]), COST, opts)
    msg = str(e.value)
    assert f"of {lim + 1} tokens does not fit a stage in a pack of up to {lim + 1024} tokens" in msg
    assert f"at most {lim})" in msg and "elastic_pp" in msg
    # several at the limit: each fits alone, not with the others' packs in flight, and the error says so
    with pytest.raises(InfeasibleError, match="keeps up to 4 micro-batches in flight on stage 0, .* shorter "
                                              "--max-seq-len or elastic_pp"):
        PLANNERS[name].plan(np.array([lim] * 8 + [700]), COST, opts)
