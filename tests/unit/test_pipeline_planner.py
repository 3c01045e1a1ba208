"""plan_elastic_pp and the pipeline baselines through StepPlan and the simulator; bad input;
simulate_table."""
from __future__ import annotations

import dataclasses
import itertools

import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ext.cost import CostModel
from megatron_ext.errors import ConfigError, InfeasibleError, LengthsError, MegatronExtError
from megatron_ext.plan import StepPlan, validate
from megatron_ext.plan.validate import validate_pipelines
from megatron_ext.planner import PlannerOptions
from megatron_ext.planner.packing import best_fit_bins
from megatron_ext.planner.pp.chunk_search import plan_group
from megatron_ext.planner.pp.chunking import balanced_chunks, check_chunking, split_pack
from megatron_ext.planner.auto import flexsp_bound_s, plan_auto
from megatron_ext.planner.pp.layouts import (estimated_layout, forced_slices, head_excess_s, layout_estimate,
                                             layout_name, layout_order_key, pipeline_layouts)
from megatron_ext.planner.pp.sequence_limits import fit_cap, longest_sequence
from megatron_ext.planner.pp.grouping import group_sequences, pipeline_estimate, split_replicas
from megatron_ext.planner.pp.elastic_pp import plan_elastic_pp
from megatron_ext.planner.pp.pipeline import PipelineOptions, build_pipeline
from megatron_ext.planner.api import PIPELINE_KINDS, make_plan
from megatron_ext.planner.pp.pipeline_baselines import plan_batch_1f1b, plan_seq1f1b
from megatron_ext.planner.sp.baselines import batchada
from megatron_ext.planner.sp.step import plan_sp
from megatron_ext.commands.plan import describe_plan
from megatron_ext.cost.pipeline import PipelineCost
from megatron_ext.data.lengths import sample_lengths
from megatron_ext.commands.table import simulate_table
from megatron_ext.sim import simulate

COST = CostModel.from_presets("llama-13b", "a800-80g-8x4")
lengths_st = st.lists(st.one_of(st.integers(1, 4096), st.integers(4096, 65_536)), min_size=1, max_size=40)


def _check(plan: StepPlan, lengths, cost=COST, **sim):
    validate(plan, lengths, cost)
    validate_pipelines(plan, lengths, cost)
    again = StepPlan.from_json(plan.to_json())
    res = simulate(again, lengths, cost, **sim)
    assert res.step_time_s == pytest.approx(plan.estimated_step_time_s, rel=1e-9)
    assert plan.estimated_step_time_s >= plan.lower_bound_step_time_s * (1 - 1e-9)
    kept = np.delete(np.asarray(lengths), plan.dropped_seq_ids)
    assert plan.estimated_step_time_s * 1e3 >= cost.compute_floor_ms(kept) * (1 - 1e-9)
    for p in plan.pipelines:
        check_chunking([[(x.seq_id, x.start, x.end) for x in c.pieces] for c in p.chunks], lengths,
                       [x.seq_id for c in p.chunks for x in c.pieces])
    return res


@settings(max_examples=30, deadline=None)
@given(lengths=lengths_st, mem_gb=st.sampled_from([None, 30, 20]), ties=st.sampled_from(["tied", "untied", "best"]))
def test_elastic_plans_are_valid_and_simulate_to_their_estimate(lengths, mem_gb, ties):
    lengths = np.array(lengths)
    mem = None if mem_gb is None else mem_gb * 1024
    try:
        plan = plan_elastic_pp(lengths, COST, 4, 8, memory_mb=mem, ties=ties, time_limit=0.3)
    except InfeasibleError:  # only where no plan exists: the longest sequence fits no stage, alone, at its finest
        assert mem is not None and lengths.max() > longest_sequence(PipelineCost(COST, 4, 8, memory_mb=mem))
        return
    assert plan.kind == "elastic_pp" and plan.planner == "elastic_pp"
    res = _check(plan, lengths, memory_mb=mem)
    assert max(res.peak_memory_mb) <= (mem or COST.cluster.memory_mb) + 1e-6
    for p in plan.pipelines:  # never two tails in one chunk
        for c in p.chunks:
            assert sum(1 for x in c.pieces if x.start > 0) <= 1


@settings(max_examples=25, deadline=None)
@given(lengths=lengths_st)
def test_baselines_are_valid(lengths):
    lengths = np.array(lengths)
    b = plan_batch_1f1b(lengths, COST, 4, 8)
    _check(b, lengths)
    assert all(x.start == 0 and x.end == lengths[x.seq_id] for p in b.pipelines for c in p.chunks for x in c.pieces)
    s = plan_seq1f1b(lengths, COST, 4, 8, seq1f1b_slices=(2, 4))
    _check(s, lengths)


def test_seq1f1b_slices_have_equal_compute():
    pc = PipelineCost(COST, 4, 8)
    lengths = np.array([16384])
    parts = split_pack([0], lengths, pc, 4)
    sizes = [b - a for [(s, a, b)] in parts]
    assert sizes == sorted(sizes, reverse=True) and sum(sizes) == 16384
    times = [float(pc.prefix_ms(b) - pc.prefix_ms(a)) for [(s, a, b)] in parts]
    assert max(times) / min(times) < 1.001
    # a pack of several documents: every token once, documents may straddle slices
    lengths = np.array([9000, 5000, 3000, 100])
    parts = split_pack([0, 1, 2, 3], lengths, pc, 3)
    check_chunking(parts, lengths)


def test_elastic_beats_the_packed_baselines_on_a_long_tailed_batch():
    lengths = np.array([45000, 30000, 20000, 12000] + [3000] * 20 + [800] * 60 + [200] * 100)
    plan = make_plan("elastic_pp", lengths, COST, PipelineOptions(time_limit=1.0),
                        baselines=("seq1f1b", "batch_1f1b", "flexsp", "static_ulysses"))
    assert set(plan.baselines) == {"seq1f1b", "batch_1f1b", "flexsp", "static_ulysses"}
    for name in ("seq1f1b", "batch_1f1b"):
        assert plan.baselines[name]["speedup"] > 1.0, name
    text = describe_plan(plan, lengths, simulate(plan, lengths, COST))
    assert "bubble ratio" in text and "vs flexsp" in text


def test_elastic_searches_the_packed_baselines_chunkings_where_memory_binds():
    # gpt-30b on 32 A100-40GB at ZeRO-3: memory binds, and whole packs of 48K in 1F1B order with the
    # ILP's recompute beat every finer chunking; the search tries them first, so elastic_pp is never
    # slower than batch 1F1B or Seq1F1B on the same layout
    cost = CostModel.from_presets("gpt-30b", "a100-40g-8x4", 3)
    lengths = sample_lengths("commoncrawl", 512, 0, 49152)
    plan = plan_elastic_pp(lengths, cost, 4, 8, time_limit=1.0)
    _check(plan, lengths, cost)
    for baseline in (plan_batch_1f1b, plan_seq1f1b):
        assert plan.estimated_step_time_s <= baseline(lengths, cost, 4, 8).estimated_step_time_s, baseline.__name__


def test_a_probe_of_one_pipeline_weighs_whole_packs_however_short_its_time():
    # the same memory-bound batch: a probe of one pipeline builds the context-length packs cut into
    # the estimate's chunks and whole, in both orders as memory binds, even with its deadline gone
    # (a short search must still weigh them: whole in 1F1B order, 178 s; cut in 4, 182 s; greedy
    # order, 265-272 s); a probe of a grouping's pipeline measures the chunk-time targets only
    cost = CostModel.from_presets("gpt-30b", "a100-40g-8x4", 3)
    lengths = sample_lengths("commoncrawl", 512, 0, 49152)
    pc, ids = PipelineCost(cost, 4, 8), np.arange(512)
    whole = plan_group(ids, lengths, pc, PipelineOptions(), time.perf_counter(), probe=True, whole_packs=True)
    assert whole.slices == -1 and whole.order == "1f1b"
    assert len(whole.pieces) == len(best_fit_bins(ids, lengths, 49152))
    targets = plan_group(ids, lengths, pc, PipelineOptions(), time.perf_counter(), probe=True)
    assert targets.slices > 0


def test_builds_of_a_few_chunks_price_no_larger_ones(monkeypatch):
    # a probe of one pipeline builds its packs cut into the estimate's chunks, its whole packs (a
    # few chunks), then the targets' chunkings: whole packs' fixed cost, scaled by chunks,
    # overpriced those past a deadline they would make. A replica of gpt-13b on 8 x 8 x 4 (256
    # A100-40GB) holding the most 192K sequences; on a clock of its own (deterministic under any
    # load), its builds of under PRICED_CHUNKS take 0.05 s each, the others 0.2 ms a chunk: its
    # targets are built all the same
    import types

    import megatron_ext.planner.pp.chunk_search as chunk_search
    cost = CostModel.from_presets("gpt-13b", "a100-40g-8x32", 1)
    lengths = sample_lengths("github", 512, 0, 196608)
    pc = PipelineCost(cost, 8, 8)
    part = split_replicas(np.arange(512), lengths, pc, pc.replicas)[0]
    real, sizes, now = chunk_search.build_pipeline, [], [0.0]

    def slow_when_small(pieces, *a, **k):
        sizes.append(len(pieces))
        now[0] += 0.05 if len(pieces) < chunk_search.PRICED_CHUNKS else 2e-4 * len(pieces)
        return real(pieces, *a, **k)

    monkeypatch.setattr(chunk_search, "build_pipeline", slow_when_small)
    monkeypatch.setattr(chunk_search, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    # (priced from the whole packs, 0.05 s for a few chunks, the targets' ~150 chunks would end
    # seconds past the deadline, and be skipped; priced from the estimate's cut, ~0.03 s each)
    plan_group(part, lengths, pc, PipelineOptions(), 1.0, probe=True, whole_packs=True)
    small = [i for i, n in enumerate(sizes) if n < chunk_search.PRICED_CHUNKS]
    assert sizes[0] >= chunk_search.PRICED_CHUNKS and len(small) == 2  # (the estimate's cut first; whole packs)
    assert sum(n >= chunk_search.PRICED_CHUNKS for n in sizes[max(small) + 1:]) >= 3  # (targets, after them)
    assert now[0] < 1.0, sizes  # (the deadline never bound: every target was wanted)


def test_a_build_is_priced_by_candidates_of_its_own_order(monkeypatch):
    # a search alternates greedy and 1F1B orders, and a greedy build costs about 4x a 1F1B one:
    # priced from the last 1F1B build, a greedy one of 773 chunks ran 0.18 s past the search's end
    # (gpt-13b on 8 x 4, 32 A800s, 192K CommonCrawl). On a clock of its own (0.4 ms a chunk
    # greedy, 0.1 ms 1F1B), no build ends past the deadline: priced from the 1F1B build of 636
    # chunks, a greedy one of 773 would start at 0.45 s and end at 0.76 s
    import types

    import megatron_ext.planner.pp.chunk_search as chunk_search
    cost = CostModel.from_presets("gpt-13b", "a800-80g-8x4", 1)
    lengths = sample_lengths("commoncrawl", 512, 0, 192 * 1024)
    pc = PipelineCost(cost, 8, 4)
    real, ends, now = chunk_search.build_pipeline, [], [0.0]

    def timed(pieces, *a, **k):
        now[0] += (4e-4 if k.get("order") == "greedy" else 1e-4) * len(pieces)
        ends.append((now[0], len(pieces), k.get("order")))
        return real(pieces, *a, **k)

    monkeypatch.setattr(chunk_search, "build_pipeline", timed)
    monkeypatch.setattr(chunk_search, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    plan_group(np.arange(512), lengths, pc, PipelineOptions(), 0.6)
    assert {o for _, _, o in ends} == {"greedy", "1f1b"} and len(ends) > 6
    assert max(t for t, _, _ in ends[1:]) <= 0.6, ends


def test_a_search_with_nothing_built_hunts_at_the_replica_s_prices(monkeypatch):
    # a grouping's second pipeline has built nothing of its own: with another plan standing, its
    # hunt is priced by what the replica's other searches' builds cost (BuildCache.priced), and it
    # gives up rather than start a build that would end past its give-up time (priced by nothing,
    # one of 1,402 chunks ran 0.18 s past it); with no such record it builds
    import types

    import megatron_ext.planner.pp.chunk_search as chunk_search
    from megatron_ext.errors import OutOfTimeError
    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x4", 1)
    lengths = sample_lengths("github", 128, 0, 96 * 1024)
    pc = PipelineCost(cost, 4, 8)
    monkeypatch.setattr(chunk_search, "time", types.SimpleNamespace(perf_counter=lambda: 0.0))
    opts = PipelineOptions()
    assert plan_group(np.arange(128), lengths, pc, opts, 1.0, give_up=0.5).makespan_ms > 0
    builds = chunk_search.BuildCache()
    builds.priced.update(greedy=(16, 1.0), **{"1f1b": (16, 0.25)})  # (1 s for 16 greedy chunks)
    with pytest.raises(OutOfTimeError, match="nothing fitted before the time ran out"):
        plan_group(np.arange(128), lengths, pc, opts, 1.0, builds=builds, give_up=0.5)


def test_a_search_first_cuts_the_packs_into_the_chunks_the_estimate_finds_best(monkeypatch):
    # gpt-7b on 4 x 8 at 96K (32 A100-40GB): the 1F1B estimate's best chunk count over the packs
    # is the best k of packs cut into 4-32 within 2%, and the full search builds it first
    import megatron_ext.planner.pp.chunk_search as chunk_search
    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x4", 1)
    pc = PipelineCost(cost, 4, 8)
    lengths = sample_lengths("github", 512, 0, 96 * 1024)
    ids = np.arange(len(lengths))
    packs = best_fit_bins(ids, lengths, 96 * 1024)
    likeliest = round(pipeline_estimate(lengths, pc)[1] / len(packs))
    made = {k: build_pipeline([c for p in packs for c in split_pack(p, lengths, pc, k)], pc, "greedy").makespan_ms
            for k in (4, 8, 12, 16, 24, 32, likeliest)}
    assert made[likeliest] <= 1.02 * min(made.values())
    sizes, real = [], chunk_search.build_pipeline
    monkeypatch.setattr(chunk_search, "build_pipeline", lambda pieces, *a, **k: sizes.append(len(pieces)) or real(pieces, *a, **k))
    plan_group(ids, lengths, pc, PipelineOptions(), time.perf_counter() + 5.0)
    assert sizes[0] == likeliest * len(packs) > 96


def test_a_probe_out_of_time_keeps_the_packs_cut_into_the_estimates_chunks_not_whole_packs():
    # a replica of gpt-13b on 4 x 4 x 16 (256 A800s, 48K, ZeRO-1), planned with its share of a
    # layout's 0.13 s: past its deadline at once, its probe builds one chunking; whole packs first,
    # some replicas ran twice as long (15.0 s against 7.6 s) and so the whole step
    cost = CostModel.from_presets("gpt-13b", "a800-80g-8x32", 1)
    lengths = sample_lengths("commoncrawl", 512, 0, 48 * 1024)
    pc = PipelineCost(cost, 4, 4)
    part = split_replicas(np.arange(512), lengths, pc, pc.replicas)[0]
    packs = best_fit_bins(part, lengths, 48 * 1024)
    likeliest = round(pipeline_estimate(lengths[part], pc)[1] / len(packs))
    whole = build_pipeline([c for p in packs for c in split_pack(p, lengths, pc, 1)], pc, "greedy", order="greedy")
    probe = plan_group(part, lengths, pc, PipelineOptions(), time.perf_counter(), probe=True, whole_packs=True)
    assert likeliest > 1 and probe.slices == -likeliest
    assert probe.makespan_ms < 0.7 * whole.makespan_ms


def test_a_grouping_probe_that_would_end_past_the_plan_s_check_is_not_started(monkeypatch):
    # a probe builds its first candidates whatever its deadline: on a clock of its own, each probe
    # takes 0.35 s and the plan's check twice the most its pipelines' builds took (the grouping's
    # three, 0.05 s each): after two probes (0.7 s) a third would end at 1.05 s, past 1.0 - 0.3 s
    import types

    import megatron_ext.planner.pp.elastic_pp as elastic_pp
    cost = CostModel.from_presets("llama-13b", "a800-80g-8x4", 1)
    lengths = sample_lengths("github", 64, 0, 48 * 1024)
    pc = PipelineCost(cost, 2, 8)
    ids = np.arange(64)
    built = build_pipeline([[(int(i), 0, int(lengths[i]))] for i in ids], pc, "greedy", order="greedy")
    built = dataclasses.replace(built, recompute=np.ones_like(built.recompute), build_s=0.05)  # (memory binds)
    now, probed = [0.0], []

    def probe(groups, lengths, pc, opts, start, end, is_probe, *args):
        if is_probe:  # (the full searches after the probes are not this test's)
            probed.append(len(groups))
        now[0] += 0.35
        return [built] * len(groups)

    monkeypatch.setattr(elastic_pp, "_plan_structure", probe)
    monkeypatch.setattr(elastic_pp, "group_sequences", lambda ids, *a: np.array_split(ids, 3))
    monkeypatch.setattr(elastic_pp, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    elastic_pp._plan_replica(ids, lengths, pc, PipelineOptions(recompute="greedy"), 0.0, 1.0)
    assert probed == [1, 3]  # (one pipeline, then the grouping; not the longest sequence apart)
    now[0], probed[:] = 0.0, []
    elastic_pp._plan_replica(ids, lengths, pc, PipelineOptions(recompute="greedy"), 0.0, 1.4)
    assert probed == [1, 3, 2]  # (with 1.4 s, the longest sequence in a pipeline of its own too)


def test_a_one_stage_probe_cuts_a_long_sequence_only_where_memory_needs_it():
    # llama-13b on one stage of SP 8 (32 A800s, 96K GitHub, ZeRO-3), replica 2: its 98K sequence
    # fits in two slices within its cap (68K), not in two equal-time ones; the probe's
    # equal-time slicings fit at four (73.7 s), the capped slices run it in 71.5 s
    cost = CostModel.from_presets("llama-13b", "a800-80g-8x4", 3)
    lengths = sample_lengths("github", 512, 0, 96 * 1024)
    pc = PipelineCost(cost, 1, 8)
    part = split_replicas(np.arange(512), lengths, pc, pc.replicas)[2]
    longest = int(part[np.argmax(lengths[part])])
    cap = fit_cap(int(lengths[longest]), pc, 128)
    assert lengths[longest] == 96 * 1024 and cap < lengths[longest]
    probe = plan_group(part, lengths, pc, PipelineOptions(), time.perf_counter() + 1.0, probe=True, whole_packs=True)
    slices = sorted(b - a for c in probe.pieces for s, a, b in c if s == longest)
    assert len(slices) == 2 and slices[1] <= cap
    t_max = float(pc.prefix_ms(lengths[longest]))
    fitted = []
    for k in (2, 3, 4):  # the equal-time slicings, each sequence cut in k at most
        try:
            ch = balanced_chunks(part, lengths, pc, t_max / k, granularity=128, min_tail=128)
            fitted.append(build_pipeline(ch.chunks, pc, "greedy", order="greedy").makespan_ms)
        except InfeasibleError:
            assert k < 4
    assert len(fitted) < 3 and probe.makespan_ms < 0.98 * min(fitted)


def test_a_full_search_tries_the_best_targets_other_ramps_before_finer_token_caps(monkeypatch):
    # llama-13b on 2 x 8 x 2 (32 A800s, 96K GitHub, ZeRO-3), replica 0: memory binds (recompute),
    # so finer chunk token caps follow the uncapped targets; the best target's ramps go between
    # them (planned at 1 s: 71.01 s with ramp 0+3, found in 0.6 s; 71.12 s when they came last)
    import megatron_ext.planner.pp.chunk_search as chunk_search
    cost = CostModel.from_presets("llama-13b", "a800-80g-8x4", 3)
    lengths = sample_lengths("github", 512, 0, 96 * 1024)
    pc = PipelineCost(cost, 2, 8)
    part = split_replicas(np.arange(512), lengths, pc, pc.replicas)[0]
    events, chunks, ramp = [], chunk_search.balanced_chunks, chunk_search.ramp_chunks

    def chunked(ids, lengths, pc, target, cap, *a, **k):
        events.append(("cap", cap))
        return chunks(ids, lengths, pc, target, cap, *a, **k)

    def ramped(ch, lengths, pc, slice_ms, front, back, **k):
        events.append(("ramp", (front, back)))
        return ramp(ch, lengths, pc, slice_ms, front, back, **k)

    monkeypatch.setattr(chunk_search, "balanced_chunks", chunked)
    monkeypatch.setattr(chunk_search, "ramp_chunks", ramped)
    best = plan_group(part, lengths, pc, PipelineOptions(), time.perf_counter() + 5.0)
    assert best.recompute.any()
    default = chunk_search._ramps(pc.pp, PipelineOptions())[0]
    first_ramp = next(i for i, e in enumerate(events) if e[0] == "ramp" and e[1] != default)
    first_cap = next(i for i, e in enumerate(events) if e[0] == "cap" and math.isfinite(e[1]))
    assert first_ramp < first_cap


def test_a_search_takes_the_candidates_built_before_from_builds(monkeypatch):
    # a grouping's full search starts with its probe's candidates: with the probe's builds it
    # builds only the new ones, and chunks only the new targets, and finds what it finds alone; a
    # cache keeps no more than its chunks x stages and pieces, and a search with a full one plans
    # the same
    import megatron_ext.planner.pp.chunk_search as chunk_search
    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x4", 1)
    lengths = sample_lengths("github", 128, 0, 98304)
    pc, ids, opts = PipelineCost(cost, 4, 8), np.arange(128), PipelineOptions()
    alone = plan_group(ids, lengths, pc, opts, None)
    builds = chunk_search.BuildCache()
    chunked, chunk = [], chunk_search.balanced_chunks

    def recorded(ids, lengths, pc, target, cap, *a, **k):
        chunked.append((target, cap))
        return chunk(ids, lengths, pc, target, cap, *a, **k)

    monkeypatch.setattr(chunk_search, "balanced_chunks", recorded)
    plan_group(ids, lengths, pc, opts, None, probe=True, builds=builds)
    probed, probe_chunked = dict(builds.built), list(chunked)
    made = []
    real = chunk_search.build_pipeline
    monkeypatch.setattr(chunk_search, "build_pipeline",
                        lambda pieces, *a, **k: made.append(pieces) or real(pieces, *a, **k))
    full = plan_group(ids, lengths, pc, opts, None, builds=builds)
    assert probed and len(made) == len(builds.built) - len(probed)
    assert probe_chunked and len(chunked) > len(probe_chunked) and len(set(chunked)) == len(chunked)
    same = (alone.makespan_ms, alone.pieces, alone.slices, alone.ramp)
    assert (full.makespan_ms, full.pieces, full.slices, full.ramp) == same
    monkeypatch.setattr(chunk_search, "KEPT_CHUNK_STAGES", builds.size // 2)
    monkeypatch.setattr(chunk_search, "KEPT_PIECES", builds.pieces // 2)
    small = chunk_search.BuildCache()
    capped = plan_group(ids, lengths, pc, opts, None, builds=small)
    assert 0 < small.size <= builds.size // 2 and len(small.built) < len(builds.built)
    assert 0 < small.pieces <= builds.pieces // 2 and len(small.chunked) < len(builds.chunked)
    assert (capped.makespan_ms, capped.pieces, capped.slices, capped.ramp) == same


def test_make_pp_plan_takes_planner_options_and_drops():
    lengths = np.array([200_000, 3000, 2000])
    with pytest.raises(LengthsError, match="exceed"):
        make_plan("elastic_pp", lengths, COST, PlannerOptions(max_seq_len=100_000))
    plan = make_plan("elastic_pp", lengths, COST, PlannerOptions(max_seq_len=100_000, drop_over_max=True))
    assert plan.dropped_seq_ids == [0]
    _check(plan, lengths)
    with pytest.raises(ConfigError, match="unknown pipeline planner"):
        make_plan("nope", lengths, COST, kinds=PIPELINE_KINDS)


def test_a_baseline_that_cannot_hold_the_longest_sequence_names_the_length_to_compare_at():
    # a pipeline slices what no SP group holds whole: FlexSP says how long a batch both run
    limit = COST.max_seq_len
    lengths = np.array([limit + 20_000, 3000, 2000])
    plan = make_plan("elastic_pp", lengths, COST, PipelineOptions(time_limit=1.0), baselines=("flexsp", "seq1f1b"))
    assert plan.baselines["flexsp"]["error"] == (
        f"it runs sequences of up to {limit:,} tokens, this batch's longest has {limit + 20_000:,} "
        f"(to compare on a batch both can run, pass --max-seq-len {limit})")
    assert "speedup" in plan.baselines["seq1f1b"]


def test_grouping_dp_returns_consecutive_groups():
    pc = PipelineCost(COST, 4, 8, memory_mb=20 * 1024)
    lengths = np.array([90000, 80000, 1000, 500] + [4000] * 50)
    groups = group_sequences(np.arange(len(lengths)), lengths, pc, 3)
    flat = np.concatenate(groups)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    assert all(len(g) for g in groups)
    assert list(lengths[flat]) == sorted(lengths, reverse=True)


def test_bad_input_errors():
    lengths = np.array([1000, 2000])
    with pytest.raises(ConfigError, match="pipeline degree 3 does not divide the 40 layers"):
        plan_elastic_pp(lengths, COST, 3, 8)
    with pytest.raises(ConfigError, match="20 GPUs does not divide the 32 GPUs"):
        plan_elastic_pp(lengths, COST, 5, 4)
    with pytest.raises(InfeasibleError, match="below the model states"):
        plan_elastic_pp(lengths, COST, 4, 8, memory_mb=4096)
    with pytest.raises(InfeasibleError, match="sequence 1 of 2000000 tokens does not fit a stage even cut into"):
        plan_elastic_pp(np.array([1000, 2_000_000]), COST, 4, 8)
    with pytest.raises(LengthsError):
        plan_elastic_pp(np.array([0, 5]), COST, 4, 8)
    with pytest.raises(LengthsError):
        plan_elastic_pp(np.array([], dtype=int), COST, 4, 8)
    with pytest.raises(ConfigError, match="pack_tokens"):
        plan_batch_1f1b(np.array([5000]), COST, 4, 8, pack_tokens=4096)


def test_layout_defaults_and_other_models():
    lengths = np.array([20000, 5000, 3000, 1000, 100])
    plan = plan_elastic_pp(lengths, COST)  # default: 4 stages x SP 8
    assert (plan.pipelines[0].stages, plan.pipelines[0].sp_degree) == (4, 8)
    c7 = CostModel.from_presets("llama-7b", "a800-80g-8x4")
    _check(plan_elastic_pp(lengths, c7, 2, 16), lengths, c7)
    _check(plan_elastic_pp(lengths, c7, 32, 1), lengths, c7)


def test_simulate_table_small():
    small = CostModel.from_presets("llama-7b", "a800-80g-8x1")  # 8 GPUs: 2 stages x SP 4
    out = simulate_table(small, dist="github", batch=24, steps=2, max_seq_len=32768, pp=2, sp=4, time_limit=0.2)
    names = [s["planner"] for s in out["summary"]]
    assert names == ["elastic_pp", "flexsp", "seq1f1b", "batch_1f1b", "static_ulysses", "auto"]
    assert len(out["rows"]) == 2 * 6
    assert sum(out["config"]["auto_choices"].values()) == 2 and "auto chose" in out["table"]
    for s in out["summary"]:
        assert "error" not in s, s
        assert s["step_time_s"] > 0 and 0 <= s["bubble_ratio"] < 1 and s["tokens_per_s"] > 0
    assert "elastic_pp speedup" in out["table"] and "static_ulysses" in out["table"]
    # the compute floor: a1 s^2 + a2 s of every sequence over every GPU, below every planner's time
    floor, m = out["floor"], small.model
    assert "(compute floor)" in out["table"] and f"{floor['ceiling']['flexsp']:.2f}x over flexsp" in out["table"]
    want = [float(np.sum(m.a1 * x.astype(float) ** 2 + m.a2 * x)) / 8 / 1e3
            for x in (sample_lengths("github", 24, s, 32768) for s in range(2))]
    assert floor["step_time_s"] == pytest.approx(np.mean(want), rel=1e-9)
    assert set(floor["ceiling"]) == set(names)
    for s in out["summary"]:
        assert floor["ceiling"][s["planner"]] >= 1.0
        assert floor["ceiling"][s["planner"]] == pytest.approx(s["total_time_s"] / sum(want), rel=1e-9)
    # the planners as given (duplicates once), the first the main one unless named
    one = simulate_table(small, lengths=[3000, 200, 100, 50], planners=("flexsp", "static_ulysses", "flexsp"))
    assert [s["planner"] for s in one["summary"]] == ["flexsp", "static_ulysses"] and one["config"]["main"] == "flexsp"
    assert "flexsp speedup" in one["table"]
    # a bad setup fails before any planning, naming what is wrong
    for kw, msg in ((dict(planners=("flexsp", "nope")), "unknown planner.*'nope'"),
                    (dict(planners=("flexsp",), main="elastic_pp"), "main planner 'elastic_pp' is not among"),
                    (dict(planners=("elastic_pp",), pp=3), "pipeline degree 3 does not divide"),
                    (dict(planners=("elastic_pp",), b1_scale=-1.0), r"b1_scale \(--b1-scale\) must be from 0"),
                    (dict(planners=("flexsp",), cost=small.with_memory(100)), "exceed the 100 MB")):
        with pytest.raises(MegatronExtError, match=msg):
            simulate_table(**{"cost": small, "lengths": [3000, 200], **kw})
    # ... but a planner that cannot run where others can is a row saying why (ZeRO-1 on 40 GB: no
    # room for FlexSP's model states of llama-13b, the pipelines' stages hold theirs)
    z1 = CostModel.from_presets("llama-13b", "a100-40g-8x4", zero_stage=1)
    out = simulate_table(z1, lengths=[8192, 4096, 2048], planners=("flexsp", "batch_1f1b"), time_limit=0.2)
    rows = {r["planner"]: r for r in out["rows"]}
    assert "model states of llama-13b" in rows["flexsp"]["error"] and rows["batch_1f1b"]["step_time_s"] > 0



def test_speedups_skip_only_the_steps_a_planner_could_not_run():
    """A planner that cannot run a step (FlexSP past its longest sequence at a 40 GB budget) shows
    the error; the others' speedups are over the steps they and the main planner both ran."""
    tight = COST.with_memory(40_000)
    longest = tight.max_seq_len
    out = simulate_table(tight, lengths=[longest + 8000, 20000, 3000] + [500] * 40,
                         planners=("elastic_pp", "flexsp", "seq1f1b"), time_limit=1.0)
    by = {s["planner"]: s for s in out["summary"]}
    assert "error" in by["flexsp"] and f"at most {longest} tokens" in by["flexsp"]["error"]
    assert by["seq1f1b"]["speedup_of_elastic_pp"] == pytest.approx(
        by["seq1f1b"]["total_time_s"] / by["elastic_pp"]["total_time_s"], rel=1e-9)
    assert "n/a" not in out["table"]

def test_tight_memory_plans_recompute_or_split_into_pipelines():
    from megatron_ext.data.lengths import sample_lengths

    lengths = sample_lengths("github", 128, 3, 96 * 1024)
    plan = plan_elastic_pp(lengths, COST, 4, 8, memory_mb=18 * 1024, time_limit=0.5)
    res = _check(plan, lengths, memory_mb=18 * 1024)
    assert res.recompute_ratio > 0 or len(plan.pipelines) > 1
    assert max(res.peak_memory_mb) <= 18 * 1024 + 1e-6


def test_cli_glue(capsys):
    import argparse
    import json

    from megatron_ext.commands.args import add_pipeline_args
    from megatron_ext.commands.plan import run_pp_plan
    from megatron_ext.commands.simulate import add_simulate_command

    ap = argparse.ArgumentParser(prog="megatron-ext")
    sub = ap.add_subparsers(dest="command", required=True)
    add_simulate_command(sub)
    args = ap.parse_args(["simulate", "--model", "llama-7b", "--cluster", "a800-80g-8x1", "--dist", "github",
                          "--batch", "16", "--steps", "1", "--max-seq-len", "16K", "--pp", "2", "--sp", "4",
                          "--planners", "elastic_pp,seq1f1b", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["planner"] for s in out["summary"]] == ["elastic_pp", "seq1f1b"]

    p = argparse.ArgumentParser()
    p.add_argument("--planner", default="elastic_pp")
    p.add_argument("--json", action="store_true")
    p.add_argument("--time-limit", type=float, default=0.5)
    add_pipeline_args(p)
    args = p.parse_args(["--pp", "4", "--sp", "8"])
    lengths = np.array([30000, 9000, 4000, 1000, 500, 500])
    assert run_pp_plan(args, COST, lengths) == 0
    text = capsys.readouterr().out
    assert "elastic_pp plan" in text and "vs flexsp" in text and "bubble ratio" in text
    assert "pipeline 0 chunks" in text and "  stage 3: F" in text and "stage recomputes" in text
    args = p.parse_args(["--planner", "seq1f1b", "--json"])
    assert run_pp_plan(args, COST, lengths) == 0
    assert json.loads(capsys.readouterr().out)["planner"] == "seq1f1b"



def test_plan_prints_chunks_orders_and_the_recompute_table():
    """`plan --planner elastic_pp` shows every chunk with its pieces and the layers each stage
    recomputes (when anything does), and each stage's order exactly as planned; with a cap on the
    chunks, the first and last ones, a line counting the rest, and each stage's first operations;
    with a cap on the pipelines, the first ones."""
    from megatron_ext.commands.plan import pipeline_tables

    lengths = sample_lengths("github", 128, 3, 96 * 1024)
    plan = plan_elastic_pp(lengths, COST, 4, 8, memory_mb=26000, time_limit=2.0)
    assert any(any(c.recompute_layers_per_stage) for p in plan.pipelines for c in p.chunks)  # memory binds

    def blocks(text):  # each pipeline's lines
        parts = text.split("pipeline ")[1:]
        return [("pipeline " + "pipeline ".join(b for b in parts if b.startswith(f"{k} "))).split("\n")
                for k in range(len(plan.pipelines))]

    def orders(lines, stage):  # wrapped lines joined back
        i = next(j for j, ln in enumerate(lines) if ln.startswith(f"  stage {stage}:"))
        ops = lines[i].split()[2:]
        while i + 1 < len(lines) and lines[i + 1].startswith("           "):
            i += 1
            ops += lines[i].split()
        return ops

    # (a document over 96K cut into pieces, as training cuts it, makes this batch two pipelines:
    # each pipeline's block of the print is checked)
    for pipe, lines in zip(plan.pipelines, blocks(pipeline_tables(plan, lengths, COST))):
        recomputes = any(any(c.recompute_layers_per_stage) for c in pipe.chunks)
        assert ("recompute: layers of" in lines[0]) == recomputes and ("no stage recomputes" in lines[0]) != recomputes
        rows = {int(ln.split()[0]): ln.split() for ln in lines if ln.split() and ln.split()[0].isdigit()}
        assert sorted(rows) == sorted(c.id for c in pipe.chunks)
        for c in pipe.chunks:
            row = rows[c.id]
            assert int(row[2].replace(",", "")) == sum(x.end - x.start for x in c.pieces)
            assert f"{c.pieces[0].seq_id}[{c.pieces[0].start}:{c.pieces[0].end})" in " ".join(row)
            if recomputes:
                assert row[4:4 + pipe.stages] == [str(x or ".") for x in c.recompute_layers_per_stage
                                                  or [0] * pipe.stages]
        for stage, order in enumerate(pipe.order_per_stage):
            assert orders(lines, stage) == order
    quiet = plan_elastic_pp(lengths[:8], COST, 4, 8)
    assert "no stage recomputes" in pipeline_tables(quiet, lengths[:8], COST)

    assert max(len(p.chunks) for p in plan.pipelines) > 8
    for pipe, lines in zip(plan.pipelines, blocks(pipeline_tables(plan, lengths, COST, max_chunks=8))):
        n = len(pipe.chunks)
        rows = [int(ln.split()[0]) for ln in lines if ln.split() and ln.split()[0].isdigit()]
        if n <= 8:
            assert rows == [c.id for c in pipe.chunks]
            continue
        assert rows == [c.id for c in pipe.chunks[:6] + pipe.chunks[-2:]]
        assert any(ln.split()[:3] == ["...", str(n - 8), "chunks"] for ln in lines)
        for stage, order in enumerate(pipe.order_per_stage):
            assert orders(lines, stage) == order[:16] + ["...", f"+{len(order) - 16:,}", "more"]
    # with a cap on the pipelines (4,096 GPUs run hundreds), the first ones and a line counting the rest
    many = plan_elastic_pp(lengths[:16], COST, 2, 8)  # (2 replicas)
    assert len(many.pipelines) == 2
    for text in (pipeline_tables(many, lengths[:16], COST, max_pipelines=1),
                 describe_plan(many, lengths[:16], max_pipelines=1)):
        assert "pipeline 0 (replica 0)" in text and "pipeline 1 (replica 1)" not in text
        assert "  ... 1 more pipeline (--pipelines all describes them" in text
    assert "more pipeline" not in pipeline_tables(many, lengths[:16], COST, max_pipelines=2)


def test_recompute_ties_best_keeps_the_faster_of_tied_and_untied():
    """Untied per-(stage, chunk) recompute beats the paper's diagonal tying on some batches;
    ``ties="best"`` (the default) solves both on the chosen chunking and keeps the faster
    simulated plan, so it is never slower than tied (the same search) and sometimes faster."""
    gains = []
    cost = CostModel.from_presets("gpt-13b", "a800-80g-8x4")  # memory-bound at 26 GB: recompute decides
    for dist in ("commoncrawl", "github"):
        lengths = sample_lengths(dist, 256, 0, 48 * 1024)
        t = {ties: plan_elastic_pp(lengths, cost, 4, 8, memory_mb=26000, ties=ties, time_limit=4.0)
             for ties in ("tied", "untied", "best")}
        assert "(tied)" in t["tied"].solver_status and "(untied)" in t["untied"].solver_status
        assert t["best"].estimated_step_time_s <= t["tied"].estimated_step_time_s + 1e-9
        gains.append(t["tied"].estimated_step_time_s / t["best"].estimated_step_time_s)
    assert max(gains) > 1.005  # untied pays off on these memory-bound batches
    with pytest.raises(ConfigError, match="unknown ties 'diagonal'"):
        PipelineOptions(ties="diagonal")


def test_fixed_recompute_rules_search_chunks_that_fit_under_them():
    """``recompute="none"`` finds chunks small enough to need no recompute where the ILP's plan
    recomputes; ``"full"`` recomputes every layer of every chunk; both within the budget."""
    lengths = sample_lengths("github", 256, 0, 48 * 1024)
    ilp = plan_elastic_pp(lengths, COST, 4, 8, memory_mb=24000)
    none = plan_elastic_pp(lengths, COST, 4, 8, memory_mb=24000, recompute="none")
    full = plan_elastic_pp(lengths, COST, 4, 8, memory_mb=24000, recompute="full")
    rec = lambda plan: [r for c in plan.pipelines[0].chunks for r in c.recompute_layers_per_stage]  # noqa: E731
    assert any(rec(ilp)) and not any(rec(none)) and set(rec(full)) == {COST.model.num_layers // 4}
    for plan in (ilp, none, full):
        assert _check(plan, lengths, memory_mb=24000).max_peak_memory_mb <= 24000 + 1e-6


def test_layouts_and_their_estimate():
    # 40 layers, 40 heads: sp <= 8, pp | 40, pp x sp | 32 (the rest replicas); pp 2 x sp 1 cannot
    # hold 20 layers' model states on one GPU, nor one stage 40 layers' on 1-2 GPUs
    assert pipeline_layouts(COST) == [(1, 4), (1, 8), (2, 2), (2, 4), (2, 8), (4, 1), (4, 2), (4, 4), (4, 8), (8, 1),
                                      (8, 2), (8, 4)]
    assert pipeline_layouts(COST, pp=8) == [(8, 1), (8, 2), (8, 4)] and pipeline_layouts(COST, sp=16) == []
    assert pipeline_layouts(COST, pp=2) == [(2, 2), (2, 4), (2, 8)]  # sp 16 is not allowed
    assert pipeline_layouts(COST, sp=8) == [(1, 8), (2, 8), (4, 8)] and pipeline_layouts(COST, pp=1) == [(1, 4), (1, 8)]
    assert pipeline_layouts(COST, pp=2, sp=8) == [(2, 8)]
    # ring degrees past the head limit are FlexSP's: a stage's group stays Ulysses
    ringed = COST.with_max_ring(4)
    assert 16 in ringed.degrees and pipeline_layouts(ringed) == pipeline_layouts(COST)
    c7 = CostModel.from_presets("llama-7b", "a800-80g-8x4")  # 32 layers, 32 heads
    assert [x for x in pipeline_layouts(c7) if x[0] * x[1] == 32] == [(1, 32), (2, 16), (4, 8), (8, 4), (16, 2),
                                                                               (32, 1)]
    lengths = np.array([40000, 20000] + [2000] * 50)
    pc = PipelineCost(COST, 4, 8)
    W = float(pc.prefix_ms(lengths).sum())
    est = layout_estimate(lengths, pc)[0] * 1e3
    b = pc.fixed_ms
    # up to a chunk per 1,024 tokens: 157 (more than the 52 sequences; long ones are cut into slices)
    assert est == pytest.approx(min(W + n * b + 3 * (W / n + b) for n in range(1, 158)))
    # and the chunk count at that n (what building a candidate costs: chunks x stages)
    assert layout_estimate(lengths, pc)[1] == min(range(1, 158), key=lambda n: W + n * b + 3 * (W / n + b))
    assert est > W + 4 * b
    # two replicas: the slower of the shares elastic_pp gives them, and the step's sync between them
    pc2 = PipelineCost(COST, 2, 8)
    shares = [lengths[p] for p in split_replicas(np.arange(len(lengths)), lengths, pc2, 2)]
    assert pc2.step_sync_ms > 0
    assert layout_estimate(lengths, pc2)[0] * 1e3 == pytest.approx(max(
        min(Wr + n * pc2.fixed_ms + (Wr / n + pc2.fixed_ms) for n in range(1, max(len(x), math.ceil(x.sum() / 1024)) + 1))
        for x, Wr in ((x, float(pc2.prefix_ms(x).sum())) for x in shares)) + pc2.step_sync_ms)
    # three long sequences over two replicas: one replica runs two of them, whatever the average
    three = np.array([40000] * 3 + [1000] * 4)
    assert layout_estimate(three, pc2)[0] * 1e3 >= 2 * float(pc2.prefix_ms(40000)) > float(pc2.prefix_ms(three).sum()) / 2
    # the estimate never undercuts the layout's lower bound, which deep pipelines' 1F1B formula
    # does: 32 stages pay 31 fills and drains of a chunk's fixed cost outside any stage's work
    mixes = (lengths, three, sample_lengths("github", 300, 3, 48 * 1024), np.array([30000] + [100] * 2000))
    raised = 0
    for (P, d), x in itertools.product(pipeline_layouts(COST), mixes):
        pc = PipelineCost(COST, P, d)
        est = layout_estimate(x, pc)[0]
        assert est * 1e3 >= pc.lower_bound_ms(x) * (1 - 1e-12)
        raised += est * 1e3 == pytest.approx(pc.lower_bound_ms(x), rel=1e-12)
    assert raised


@pytest.mark.parametrize("layout", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_estimates_of_many_replicas_at_once_are_each_ones_alone(layout):
    # (parts of different sizes and chunk counts share one grid of n: each keeps its own)
    from megatron_ext.planner.pp.grouping import pipeline_estimates

    pc = PipelineCost(COST, *layout)
    lengths = np.concatenate([sample_lengths("github", 300, 5, 96 * 1024), [98_304] * 3, [100] * 40])
    parts = [np.arange(0, 300, 7), np.arange(1, 300, 2), np.array([300, 301, 302]), np.arange(303, 343),
             np.array([5])]
    ms, chunks = pipeline_estimates(lengths, parts, pc, 1024)
    for p, m, c in zip(parts, ms, chunks):
        alone = pipeline_estimate(lengths[p], pc, 1024)
        assert (m, c) == (pytest.approx(alone[0], rel=1e-12), alone[1])


def test_layout_estimate_charges_the_waves_of_sequences_a_stage_holds_one_at_a_time():
    # a sequence two of which a stage cannot hold in flight runs through the stages in waves of
    # its slices, each with its own fill and drain: beyond its work, 2 sqrt((P - 1) t b) at the
    # best slice count k of (P - 1) t / k + k b, t its time scaled from none at half the room
    # (other chunks fill the other half) to all of it at the whole room
    def held_share(pc, s):  # of the room, a sequence's activations, K/V and logits, whole
        return s * ((pc.act_layer_mb + pc.kv_layer_mb) * pc.layers_per_stage + pc.head_mb) / pc.activation_room_mb

    # gpt-7b on 40 GB at ZeRO-3, 32 stages of SP 1: a 48K sequence's layers and logits
    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x4", 3)
    pc = PipelineCost(cost, 32, 1)
    short = np.full(30, 2048)
    with_long = np.concatenate([np.full(3, 49152), short])
    g = min(1.0, 2 * held_share(pc, 49152) - 1)
    t, b = float(pc.prefix_ms(49152)), pc.fixed_ms
    extra = (layout_estimate(with_long, pc)[0] - layout_estimate(short, pc)[0]) * 1e3
    assert g > 0.1 and extra >= 3 * (t + 2 * math.sqrt(31 * t * g * b))
    # gpt-7b on 40 GB at ZeRO-1, 4 stages of SP 8: no cliff at half the room; at 0.95 of it, the waves
    pc = PipelineCost(CostModel.from_presets("gpt-7b", "a100-40g-8x4", 1), 4, 8)
    half = 0.5 / held_share(pc, 1)
    per_work = [layout_estimate(x, pc)[0] * 1e3 / float(pc.prefix_ms(x).sum())
                for x in (np.full(10, int(0.99 * half)), np.full(10, int(1.01 * half)))]
    assert per_work[1] == pytest.approx(per_work[0], rel=0.01)
    s = int(1.9 * half)
    g, t, W = min(1.0, 2 * held_share(pc, s) - 1), float(pc.prefix_ms(s)), 10 * float(pc.prefix_ms(s))
    assert layout_estimate(np.full(10, s), pc)[0] * 1e3 == pytest.approx(W + 10 * 2 * math.sqrt(3 * t * g * pc.fixed_ms),
                                                                         rel=1e-3)


def test_layout_estimate_of_one_stage_recomputes_what_a_sequence_holds_over_the_room():
    # one stage holds every slice of a sequence until their backwards: the share of it over the
    # room is recomputed (a forward of that share of its work), whatever the chunk count
    cost = CostModel.from_presets("llama-13b", "a800-80g-8x4", 3)
    pc = PipelineCost(cost, 1, 8)
    held = (pc.act_layer_mb + pc.kv_layer_mb) * pc.layers_per_stage + pc.head_mb
    save = (pc.act_layer_mb - pc.input_layer_mb) * pc.layers_per_stage
    fits, over = int(0.9 * pc.activation_room_mb / held), 98304
    assert over * held > pc.activation_room_mb
    short = np.full(40, 2048)
    share = (over * held - pc.activation_room_mb) / (over * save)
    base = pipeline_estimate(np.concatenate([short, [fits]]), pc)[0] - float(pc.prefix_ms(fits))
    with_long = pipeline_estimate(np.concatenate([short, [over]]), pc)[0] - float(pc.prefix_ms(over))
    assert with_long - base == pytest.approx(share * float(pc.prefix_ms(over)) / 3, rel=0.02)
    # a batch that presses memory is estimated near its plan (67.0 s against 72.8 s before)
    lengths = sample_lengths("github", 512, 0, 96 * 1024)
    plan = plan_elastic_pp(lengths, cost, 1, 8, time_limit=0.5)
    assert layout_estimate(lengths, pc)[0] == pytest.approx(plan.estimated_step_time_s, rel=0.05)


def test_layout_order_key_charges_the_last_stage_its_output_layer():
    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x4", 1)
    lengths = sample_lengths("commoncrawl", 512, 0, 48 * 1024)
    for P, d in ((8, 4), (4, 8), (2, 8)):
        pc = PipelineCost(cost, P, d)
        # what the simulator's last stage runs beyond the average stage, each sequence a chunk
        share = lengths[split_replicas(np.arange(len(lengths)), lengths, pc, pc.replicas)[0]] if pc.replicas > 1 \
            else lengths
        work = cost.a1 * share.astype(float) ** 2 + cost.a2 * share
        last = pc.stage_ms(work, share, P - 1) - pc.stage_ms(work, share)
        assert head_excess_s(lengths, pc) * 1e3 == pytest.approx(float(last.sum()), rel=0.1 if pc.replicas > 1 else 1e-9)
    assert head_excess_s(lengths, PipelineCost(COST, 1, 8)) == 0.0
    # 8 x 4's last stage runs the output layer over 4 GPUs, 4 x 8's over 8: 4 x 8 (planned at
    # 29.9 s) goes before 8 x 4 (32.1 s), which the estimates alone tie
    def key(P, d):
        pc = PipelineCost(cost, P, d)
        return layout_order_key(lengths, pc, layout_estimate(lengths, pc)[0])

    assert key(4, 8) < key(8, 4)


def _auto_checks(plan, lengths, cost=COST, **sim):
    assert plan.planner == "auto" and plan.kind in ("flexsp", "elastic_pp")
    validate(plan, lengths, cost)
    validate_pipelines(plan, lengths, cost)
    assert simulate(plan, lengths, cost, **sim).step_time_s == pytest.approx(plan.estimated_step_time_s, rel=1e-9)
    times = {k: v["estimated_step_time_s"] for k, v in plan.baselines.items() if "estimated_step_time_s" in v}
    assert all(plan.estimated_step_time_s <= t * (1 + 1e-12) for t in times.values())
    for v in plan.baselines.values():  # skipped layouts: their optimistic estimate is no better
        if "skipped" in v and "estimated_lower_s" in v:
            assert v["estimated_lower_s"] >= plan.estimated_step_time_s
    assert 0 < plan.lower_bound_step_time_s <= plan.estimated_step_time_s * (1 + 1e-12)  # (every candidate's)
    chosen = plan.solver_status.split("auto chose ", 1)[1].split(" (", 1)[0]
    assert chosen not in plan.baselines
    assert (chosen == "flexsp") == (plan.kind == "flexsp")
    return chosen


def test_auto_picks_the_fastest_of_flexsp_and_every_layout():
    from megatron_ext.data.lengths import sample_lengths

    lengths = sample_lengths("github", 256, 1, 96 * 1024)
    # the derived fixed cost (cost/fixed.py): one-stage replicas of SP 8 gather their ZeRO-3
    # shards inside a node, FlexSP's micro-batches over all four nodes' IB: the replicas win
    plan = plan_auto(lengths, COST, time_limit=1.0)
    assert _auto_checks(plan, lengths) == "elastic_pp pp1 x sp8 x dp4"
    # its bound: the least of FlexSP's and those of the layouts that hold the longest sequence
    held = [PipelineCost(COST, P, d) for P, d in pipeline_layouts(COST)]
    held = [pc for pc in held if longest_sequence(pc) >= lengths.max()]
    assert 0 < len(held) < len(pipeline_layouts(COST))
    assert plan.lower_bound_step_time_s == pytest.approx(
        min([flexsp_bound_s(lengths, COST)] + [pc.lower_bound_ms(lengths) / 1e3 for pc in held]), rel=1e-12)
    # the InfiniPipe formula's per-chunk cost, b1 / pp (257 ms on pp 4 x sp 8 with the old b1 of
    # 1027 ms, 3.0x the derived 86 ms): FlexSP's single pass per micro-batch wins
    plan = plan_auto(lengths, COST, b1_scale=3.0, time_limit=1.0)
    assert _auto_checks(plan, lengths, b1_scale=3.0) == "flexsp"
    # a small per-chunk fixed cost (parameters gathered inside a node): the pipelines win, and
    # every layout is either simulated or skipped with a reason
    plan = plan_auto(lengths, COST, b1_scale=0.06, time_limit=5.0)
    chosen = _auto_checks(plan, lengths, b1_scale=0.06)
    assert chosen.startswith("elastic_pp pp") and plan.kind == "elastic_pp"
    names = {"flexsp"} | {layout_name(PipelineCost(COST, p, d)) for p, d in pipeline_layouts(COST)}
    assert set(plan.baselines) | {chosen} == names and "elastic_pp pp2 x sp8 x dp2" in names
    for k, v in plan.baselines.items():
        assert "estimated_step_time_s" in v or "skipped" in v, (k, v)
    # pinned: pp 8 and sp 4 leave one pipeline layout, pp 8 its layouts of every degree; FlexSP
    # (one stage, its own degrees) stays a candidate unless the options leave it out (a run whose
    # model is cut into stages)
    plan = plan_auto(lengths, COST, pp=8, sp=4, time_limit=5.0)
    assert set(plan.baselines) | {_auto_checks(plan, lengths)} == {"elastic_pp pp8 x sp4", "flexsp"}
    plan = plan_auto(lengths, COST, pp=8, sp=4, flexsp=False, time_limit=5.0)
    assert _auto_checks(plan, lengths) == "elastic_pp pp8 x sp4" and not plan.baselines
    plan = plan_auto(lengths, COST, pp=8, flexsp=False, time_limit=5.0)
    chosen = _auto_checks(plan, lengths)
    assert set(plan.baselines) | {chosen} == {"elastic_pp pp8 x sp1 x dp4", "elastic_pp pp8 x sp2 x dp2",
                                                              "elastic_pp pp8 x sp4"}
    plan = plan_auto(lengths, COST, pp=1, b1_scale=0.06)
    assert _auto_checks(plan, lengths, b1_scale=0.06) == "elastic_pp pp1 x sp8 x dp4"
    assert set(plan.baselines) == {"flexsp", "elastic_pp pp1 x sp4 x dp8"}
    with pytest.raises(ConfigError, match="does not divide"):  # a pinned layout that does not exist
        plan_auto(lengths, COST, pp=5)


def test_auto_plans_timelines_first_where_the_zero_stage_allows():
    """Under ZeRO 0/1/2 FlexSP without barriers is a candidate, planned first (milliseconds); a
    long-tailed batch on 256 GPUs, where one long sequence holds every FlexSP micro-batch, runs it."""
    from megatron_ext.commands.scale import scaled_cost

    cost = scaled_cost(CostModel.from_presets("gpt-7b", "a100-40g-8x8", 2), 256)
    lengths = sample_lengths("wikipedia", 2048, 1, 170 * 1024)
    plan = plan_auto(lengths, cost)
    assert plan.barrier_free and plan.solver_status.startswith("auto chose timelines")
    assert plan.estimated_step_time_s <= make_plan("timelines", lengths, cost).estimated_step_time_s * 1.001
    assert "timelines" not in plan_auto(lengths, dataclasses.replace(cost, zero_stage=3)).solver_status


def test_auto_with_no_time_to_build_a_layout_runs_one_where_flexsp_cannot():
    """At a limit no layout's first candidate fits in (every one "slow") and FlexSP unable to hold
    the model states (gpt-7b at ZeRO-1 on 40 GB), the slow layouts are all that can run: auto
    plans one, rather than raise FlexSP's model-state error (it asked FlexSP's sequence limit)."""
    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x8", 1)
    lengths = sample_lengths("github", 512, 0, 96 * 1024)
    plan = plan_auto(lengths, cost, time_limit=0.01)
    assert plan.solver_status.startswith("auto chose elastic_pp")
    validate(plan, lengths, cost)


@pytest.mark.parametrize("dist, zero", [("github", 3), ("commoncrawl", 1)])
def test_auto_is_within_two_percent_of_its_best_candidate_planned_alone(dist, zero):
    """auto, at its default time limit, against FlexSP (with and, under ZeRO 1, without barriers)
    and elastic_pp on every layout auto considers, each planned alone at the same limit: never
    more than 2% slower."""
    cost = CostModel.from_presets("llama-13b", "a800-80g-8x4", zero)
    for seed in (0, 1):
        lengths = sample_lengths(dist, 24, seed, 32 * 1024)
        auto = plan_auto(lengths, cost).estimated_step_time_s
        alone = []
        for name in ("flexsp", "timelines") if zero < 3 else ("flexsp",):  # (timelines: ZeRO 0/1/2)
            try:
                alone.append(make_plan(name, lengths, cost).estimated_step_time_s)
            except MegatronExtError:
                pass
        for P, d in pipeline_layouts(cost):
            try:
                alone.append(plan_elastic_pp(lengths, cost, P, d).estimated_step_time_s)
            except MegatronExtError:
                pass
        assert auto <= 1.02 * min(alone), (dist, zero, seed, auto, min(alone))


def test_auto_does_not_start_a_layout_it_cannot_build_within_the_limit():
    # gpt-7b on 32 A100-40GB, 48K: one candidate of 32 stages x SP 1 (~900 chunks) takes more than
    # the 0.5 s limit to build and check; with FlexSP and shallower layouts to plan, it is not started
    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x4", 3)
    lengths = sample_lengths("github", 512, 0, 48 * 1024)
    plan = plan_auto(lengths, cost, time_limit=0.5)
    deep = plan.baselines["elastic_pp pp32 x sp1"]
    assert "to build one candidate" in deep["skipped"] and "over the 0.5 s limit" in deep["skipped"]
    assert "elastic_pp pp32 x sp1" not in plan.solver_status.split(";")[0].split("(")[0]


def test_auto_keeps_a_layout_to_its_limit_once_a_plan_stands_and_skips_it_past_that(monkeypatch):
    # ZeRO-3 (no timelines plan first): the first layout planned runs however long it takes, the
    # later ones are kept to their limits (elastic_pp raises OutOfTimeError rather than run on)
    import megatron_ext.planner.auto as auto
    from megatron_ext.errors import OutOfTimeError

    kept = []

    def second_runs_out(lengths, cost, P, d, opts, **k):
        kept.append(k["keep_to_limit"])
        if len(kept) == 2:
            raise OutOfTimeError("7 replicas left to plan")
        return plan_elastic_pp(lengths, cost, P, d, opts, **k)

    monkeypatch.setattr(auto, "plan_elastic_pp", second_runs_out)
    cost = CostModel.from_presets("llama-13b", "a800-80g-8x4", 3)
    plan = plan_auto(sample_lengths("github", 256, 0, 48 * 1024), cost, flexsp=False, time_limit=1.0)
    assert len(kept) >= 2 and kept[0] is False and all(kept[1:])
    skipped = [v["skipped"] for v in plan.baselines.values() if "7 replicas" in v.get("skipped", "")]
    assert skipped == ["time limit reached (7 replicas left to plan)"]


def _spy_sub_plans(monkeypatch) -> list[dict]:
    """Every layout plan and FlexSP-kind plan auto makes, in order: who ((pp, sp) or the name), the
    time limit auto gave it, the candidates built before it (layouts), its plan, and the
    perf_counter seconds around the real planner's call."""
    import megatron_ext.planner.auto as auto

    calls = []
    real_layout, real_sp = auto.plan_elastic_pp, auto.plan_sp

    def layout(lengths, cost, P, d, opts, **k):
        call = {"who": (P, d), "limit": opts.time_limit, "builds": k["builds"], "before": len(k["builds"].built),
                "t0": time.perf_counter()}
        calls.append(call)
        call["plan"] = real_layout(lengths, cost, P, d, opts, **k)
        call["t1"] = time.perf_counter()
        return call["plan"]

    def sp(name, fn, lengths, cost, opts=None, **k):
        call = {"who": name, "limit": getattr(opts, "time_limit", None), "t0": time.perf_counter()}
        calls.append(call)
        call["plan"] = real_sp(name, fn, lengths, cost, opts, **k)
        call["t1"] = time.perf_counter()
        return call["plan"]

    monkeypatch.setattr(auto, "plan_elastic_pp", layout)
    monkeypatch.setattr(auto, "plan_sp", sp)
    return calls


def _assert_given_only_the_time_left(calls, time_limit: float) -> None:
    # auto's clock starts before the first call and is read after each call before the next: a
    # layout or FlexSP may plan in at most what the limit, less the reserve, leaves after the calls
    # before it (0.05 s at least); however slow the machine, auto's own choice
    import megatron_ext.planner.auto as auto

    first, after = calls[0]["t0"], calls[0]["t0"]
    for c in calls:
        if c["who"] == "flexsp" or isinstance(c["who"], tuple):
            left = time_limit * (1 - auto.AUTO_RESERVE) - (after - first)
            assert c["limit"] <= max(0.05, left) + 1e-9, (c["who"], c["limit"], left)
        after = c.get("t1", after)


@pytest.mark.parametrize("batch, pins, again", [
    # no FlexSP (a run cut into stages), one layout, done early: planned again in the time left,
    # from the candidates it built
    (64, {"pp": 2, "sp": 8, "flexsp": False}, True),
    # FlexSP runs (its lower bound, 67.8 s, beats the layouts' plans, 71 s and over): the time left is its
    (512, {}, False),
])
def test_auto_plans_its_fastest_layout_again_in_time_no_flexsp_takes(monkeypatch, batch, pins, again):
    calls = _spy_sub_plans(monkeypatch)
    cost = CostModel.from_presets("llama-13b", "a800-80g-8x4", 3)
    lengths = sample_lengths("github", batch, 0, 96 * 1024)
    plan = plan_auto(lengths, cost, time_limit=1.0, **pins)
    _assert_given_only_the_time_left(calls, 1.0)
    layouts = [c["who"] for c in calls if isinstance(c["who"], tuple)]
    assert (len(set(layouts)) < len(layouts)) == again
    if again:
        first, last = calls[0], calls[-1]
        assert layouts == [(2, 8), (2, 8)] and last["builds"] is first["builds"]
        assert first["before"] == 0 < last["before"]
        assert last["limit"] < first["limit"]  # (what the first plan left)
        assert plan.estimated_step_time_s == min(c["plan"].estimated_step_time_s for c in (first, last))
    else:
        assert any(c["who"] == "flexsp" for c in calls)
        assert "estimated_step_time_s" in plan.baselines.get("flexsp", {}) or "auto chose flexsp" in plan.solver_status


@pytest.fixture
def layout_deadlines(monkeypatch):
    """When each layout auto plans must end (perf_counter seconds: its start + its time limit)."""
    import megatron_ext.planner.auto as auto

    deadlines = []

    def recorded(lengths, cost, P, d, opts, **k):
        deadlines.append(time.perf_counter() + opts.time_limit)
        return plan_elastic_pp(lengths, cost, P, d, opts, **k)

    monkeypatch.setattr(auto, "plan_elastic_pp", recorded)
    return deadlines


def test_auto_keeps_the_reserve_where_no_flexsp_follows_the_layouts(layout_deadlines):
    # without FlexSP after them, each layout's deadline leaves AUTO_RESERVE of the limit for the
    # last one's check and the choice (it ran 1-5% past the limit without it)
    import megatron_ext.planner.auto as auto

    lengths = sample_lengths("github", 256, 0, 48 * 1024)
    cost = CostModel.from_presets("llama-13b", "a800-80g-8x4", 1)  # (several layouts planned)
    start = time.perf_counter()
    plan = plan_auto(lengths, cost, flexsp=False, time_limit=1.0)
    assert layout_deadlines and "flexsp" not in plan.baselines
    # (the time a layout may plan in is taken just before it starts: 10 ms' slack, a third of the reserve)
    assert max(layout_deadlines) <= start + 1.0 * (1 - auto.AUTO_RESERVE) + 0.01


def test_auto_resumes_the_fastest_layout_in_the_time_flexsp_leaves(monkeypatch):
    # gpt-30b on 256 A800s, 192K CommonCrawl, ZeRO-3: the layouts keep the floor share (FlexSP's
    # likely step beats their bounds), FlexSP solves in a fraction of the rest and loses; the
    # fastest layout is then planned again, from its candidates, in the time left
    calls = _spy_sub_plans(monkeypatch)
    cost = CostModel.from_presets("gpt-30b", "a800-80g-8x32", 3)
    lengths = sample_lengths("commoncrawl", 512, 0, 192 * 1024)
    plan = plan_auto(lengths, cost, time_limit=2.0)  # (slack for a loaded machine)
    _assert_given_only_the_time_left(calls, 2.0)
    i = next(i for i, c in enumerate(calls) if c["who"] == "flexsp")
    again = [c for c in calls[i + 1:] if isinstance(c["who"], tuple)]
    assert again and again[0]["builds"] is next(c["builds"] for c in calls[:i] if c["who"] == again[0]["who"])
    P, d = again[0]["who"]
    assert plan.solver_status.startswith(f"auto chose elastic_pp pp{P} x sp{d}")
    assert plan.estimated_step_time_s < plan.baselines["flexsp"]["estimated_step_time_s"]


@pytest.mark.parametrize("model, cluster, ctx, dist, keeps", [
    # gpt-13b on 32 A800-80GB, 96K GitHub: FlexSP's likely step (68.3 s + a tenth of the way to
    # BatchAda's 75.6 s) beats the likeliest layout's order key (70.9 s); FlexSP wins, 72.2 s
    ("gpt-13b", "a800-80g-8x4", 96, "github", "share"),
    # gpt-13b on 128 A100-40GB, 192K CommonCrawl: FlexSP's lower bound (40.8 s) falls between the
    # likeliest layout's estimate (39.2 s) and its order key (41.3 s), its likely step (41.6 s)
    # does not; the layout planned 39.7 s in the whole second, 41.2 s in what FlexSP's share left
    # it, FlexSP 44.0 s
    ("gpt-13b", "a100-40g-8x16", 192, "commoncrawl", "floor"),
    # gpt-30b on 128 A100-40GB, 96K GitHub: FlexSP's likely step (52.2 s) beats every layout's
    # lower bound (53.7 s and over): the layouts keep the floor share, FlexSP the rest
    ("gpt-30b", "a100-40g-8x16", 96, "github", "most"),
])
def test_auto_keeps_flexsp_its_share_where_its_likely_step_beats_the_likeliest_layouts_order_key(
        layout_deadlines, model, cluster, ctx, dist, keeps):
    import megatron_ext.planner.auto as auto

    cost = CostModel.from_presets(model, cluster, 3)
    lengths = sample_lengths(dist, 512, 0, ctx * 1024)
    lb = cost.lower_bound_ms(lengths) / 1e3
    ub = plan_sp("batchada", batchada, lengths, cost, PlannerOptions()).estimated_step_time_s
    likely = lb + auto.AUTO_FLEXSP_GAP * (ub - lb)
    keys, bounds = [], []
    for P, d in pipeline_layouts(cost):
        pc = PipelineCost(cost, P, d)
        if lengths.max() <= longest_sequence(pc, 128):
            keys.append(layout_order_key(lengths, pc, layout_estimate(lengths, pc)[0]))
            bounds.append(pc.lower_bound_ms(lengths) / 1e3)
    assert lb < min(keys) and (likely < min(keys)) == (keeps != "floor")
    assert (likely <= min(bounds)) == (keeps == "most")
    start = time.perf_counter()
    plan_auto(lengths, cost, time_limit=1.0)
    assert layout_deadlines
    share_end = start + 1.0 * (1 - auto.AUTO_FLEXSP_SHARE)
    if keeps == "share":  # the layouts end at 1 - AUTO_FLEXSP_SHARE of the limit
        assert max(layout_deadlines) <= share_end + 0.01
    elif keeps == "floor":  # ... at 1 - AUTO_FLEXSP_FLOOR
        assert share_end + 0.1 < max(layout_deadlines) <= start + 1.0 * (1 - auto.AUTO_FLEXSP_FLOOR) + 0.01
    else:  # ... at AUTO_FLEXSP_FLOOR
        assert max(layout_deadlines) <= start + 1.0 * auto.AUTO_FLEXSP_FLOOR + 0.01


def test_auto_holds_every_candidate_to_one_memory_budget():
    """``memory_mb`` binds FlexSP too: at 40 GB an 85K-token sequence fits no SP-8 group, so FlexSP
    (and its BatchAda bound) cannot run and a pipeline, which slices it, is chosen; layouts whose
    model states are over the budget are left out, not an error. (At 30 GB the pipeline's plan
    is slower than with the cluster's memory.)"""
    lengths = np.array([85_000, 30_000] + [2_000] * 60)
    plan = plan_auto(lengths, COST, memory_mb=30_000, time_limit=2.0)
    assert _auto_checks(plan, lengths, memory_mb=30_000).startswith("elastic_pp pp")
    assert "does not fit" in plan.baselines["flexsp"]["error"]
    # (a limit no layout comes near, on a loaded machine too: this is about memory, not time)
    assert plan_auto(lengths, COST, time_limit=5.0).estimated_step_time_s < plan.estimated_step_time_s


def test_make_plan_auto_and_the_cli_summary(capsys):
    from megatron_ext.planner import make_plan
    from megatron_ext.commands.plan import run_pp_plan
    import argparse
    from megatron_ext.commands.args import add_pipeline_args

    lengths = np.array([45000, 30000, 20000, 12000] + [3000] * 20 + [800] * 60 + [200] * 100)
    plan = make_plan("auto", lengths, COST, PlannerOptions(time_limit=1.0), baselines=("seq1f1b", "flexsp"))
    _auto_checks(plan, lengths)
    assert "seq1f1b" in plan.baselines and "speedup" in plan.baselines["seq1f1b"]
    assert ("flexsp" in plan.baselines) == (plan.kind == "elastic_pp")  # never a baseline of itself
    text = describe_plan(plan, lengths, simulate(plan, lengths, COST))
    assert "auto chose" in text and "vs " in text
    # over-long sequences are dropped (or refused) for auto as for the other planners
    plan = make_plan("auto", np.array([200_000, 3000, 2000]), COST, PlannerOptions(max_seq_len=100_000,
                                                                                     drop_over_max=True))
    assert plan.dropped_seq_ids == [0]
    p = argparse.ArgumentParser()
    p.add_argument("--planner", default="auto")
    p.add_argument("--json", action="store_true")
    p.add_argument("--time-limit", type=float, default=0.5)
    add_pipeline_args(p)
    assert run_pp_plan(p.parse_args([]), COST, lengths[:30]) == 0
    assert "auto plan" in capsys.readouterr().out


def test_a_layouts_candidate_is_priced_per_replicas_pipeline():
    """What building one candidate costs, for auto's time checks: each replica's pipeline at the
    rate of its own chunk count (few chunks, few in flight: half ``CHUNK_STAGE_S`` at 64 or fewer),
    not one pipeline of all of them (4,096 A100s: 4 x 8 x 128 replicas were priced at 1.8 s and
    never started, though they plan the fastest step in under 1 s)."""
    from megatron_ext.planner.pp.chunk_search import CHUNK_STAGE_S, FEW_CHUNKS, chunk_stage_s
    from megatron_ext.planner.pp.layouts import estimated_layout

    assert chunk_stage_s(1) == chunk_stage_s(FEW_CHUNKS / 2) == CHUNK_STAGE_S / 2
    assert chunk_stage_s(0.75 * FEW_CHUNKS) == pytest.approx(0.75 * CHUNK_STAGE_S)
    assert chunk_stage_s(FEW_CHUNKS) == chunk_stage_s(40 * FEW_CHUNKS) == CHUNK_STAGE_S
    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x512", 1)
    lengths = sample_lengths("commoncrawl", 4096, 0, 65536)
    opts = PipelineOptions()
    many = estimated_layout(lengths, PipelineCost(cost, 4, 8), opts)  # 128 replicas of a few chunks each
    assert many.name == "elastic_pp pp4 x sp8 x dp128" and many.chunk_stages / 4 / 128 <= FEW_CHUNKS / 2
    assert many.build_s == pytest.approx(many.chunk_stages * CHUNK_STAGE_S / 2)
    one = estimated_layout(lengths, PipelineCost(CostModel.from_presets("gpt-7b", "a100-40g-8x4", 1), 4, 8), opts)
    assert one.chunk_stages / 4 >= FEW_CHUNKS and one.build_s == pytest.approx(one.chunk_stages * CHUNK_STAGE_S)


def test_one_replica_is_planned_again_in_the_time_its_search_left(monkeypatch):
    """A replica's search keeps time for the ILP and the check, which it often leaves: with one
    replica, that time plans it again (resuming from the candidates built), as the slowest of
    several is, and the faster of the two plans stands."""
    from megatron_ext.planner.pp import elastic_pp as module

    budgets, made = [], []
    real = module._plan_replica

    def planned(*args, **kwargs):
        budgets.append(args[5])
        built = real(*args, **kwargs)
        made.append(sum(b.makespan_ms for b in built))
        return built

    monkeypatch.setattr(module, "_plan_replica", planned)
    lengths = sample_lengths("github", 48, 1, 48 * 1024)
    plan = plan_elastic_pp(lengths, COST, 4, 8, time_limit=3.0)
    assert len(budgets) >= 2 and budgets[1] < budgets[0]  # (the second in what the first left)
    validate(plan, lengths, COST)
    sync = PipelineCost(COST, 4, 8).step_sync_ms
    assert plan.estimated_step_time_s * 1e3 == pytest.approx(min(made) + sync, rel=1e-9)


def test_auto_counts_the_slices_memory_forces_before_starting_a_layout():
    # gpt-13b on 32 A800s at ZeRO-1: 2 stages x SP 4 (4 replicas) hold a 128,630-token sequence
    # (the longest they hold) only cut into 128-token slices (1,005 of them); the 1F1B estimate sees a
    # few hundred chunks, a candidate has thousands (seconds to build), so the layout is not started
    cost = CostModel.from_presets("gpt-13b", "a800-80g-8x4", 1)
    pc = PipelineCost(cost, 2, 4)
    lengths = np.array([128630] * 6 + [30000, 8000] + [2000] * 40)
    caps = {s: fit_cap(s, pc, 128) for s in (128630, 30000, 8000, 2000)}
    assert longest_sequence(pc) == 128630 and caps[128630] == 128 and caps[2000] is None
    want = sum(math.ceil(s / caps[s]) for s in lengths.tolist() if caps[s] is not None)
    assert forced_slices(lengths, pc) == want >= 6 * 1005
    assert layout_estimate(lengths, pc)[1] * pc.replicas < want / 10
    # 8 x 4 has room for every sequence whole: only its tokens over what one chunk holds
    deep = PipelineCost(cost, 8, 4)
    held = deep.activation_room_mb / (deep.act_layer_mb * deep.layers_per_stage + float(deep.head_mb))
    assert forced_slices(lengths, deep) == math.ceil(lengths.sum() / held) == 3
    plan = plan_auto(lengths, cost, time_limit=0.5)
    assert "to build one candidate" in plan.baselines["elastic_pp pp2 x sp4 x dp4"]["skipped"]


def test_auto_does_not_estimate_a_layout_whose_bound_is_far_past_the_likeliest_order_key(monkeypatch):
    """Bounds first, then estimates in the bounds' order, up to AUTO_BOUND_CUT x the least order
    key: every layout cut is past it (no layout's key is below its bound, so none cut could have
    lowered that key), the others were estimated, and the choice is the one a run estimating every
    layout makes."""
    from megatron_ext.planner import auto

    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x32", 1)
    lengths = sample_lengths("commoncrawl", 512, 1, 48 * 1024)
    plan = plan_auto(lengths, cost, time_limit=1.0)
    runnable = [PipelineCost(cost, P, d) for P, d in pipeline_layouts(cost)]
    runnable = [pc for pc in runnable if longest_sequence(pc) >= lengths.max()]
    bounds = {layout_name(pc): pc.lower_bound_ms(lengths) / 1e3 for pc in runnable}
    keys = {layout_name(pc): estimated_layout(lengths, pc, PipelineOptions()).key for pc in runnable}
    cut = {k for k, v in plan.baselines.items() if "likeliest layout's order key" in v.get("skipped", "")}
    assert len(cut) >= 5 and all(keys[k] >= bounds[k] for k in keys)
    least = min(keys[k] for k in keys if k not in cut)
    assert least == min(keys.values())
    assert all(bounds[k] > auto.AUTO_BOUND_CUT * least for k in cut)
    assert all(bounds[k] <= auto.AUTO_BOUND_CUT * least for k in set(keys) - cut)
    monkeypatch.setattr(auto, "AUTO_BOUND_CUT", math.inf)
    everything = plan_auto(lengths, cost, time_limit=1.0)
    assert not any("likeliest layout's order key" in v.get("skipped", "") for v in everything.baselines.values())
    assert everything.solver_status.split(" (")[0] == plan.solver_status.split(" (")[0]


def test_drop_over_max_drops_what_the_pipeline_cannot_run_under_a_given_maximum():
    """A --max-seq-len over what the layout holds: with --drop-over-max, the sequences past what it
    holds are dropped (the given maximum alone was the limit, and the plan refused them); and
    auto's limit follows the memory budget given (its FlexSP part's at the cluster's memory)."""
    from megatron_ext.planner.api import make_plan, max_seq_len
    from megatron_ext.planner.pp.pipeline import PipelineOptions

    tiny = CostModel.from_presets("tiny", "cpu-4")
    own = max_seq_len("elastic_pp", tiny, PipelineOptions())
    lengths = np.array([own + 100, 3000, 500])
    plan = make_plan("elastic_pp", lengths, tiny, PlannerOptions(max_seq_len=own + 1000, drop_over_max=True))
    assert plan.dropped_seq_ids == [0]
    with pytest.raises(LengthsError, match="exceed the maximum length"):
        make_plan("elastic_pp", lengths, tiny, PlannerOptions(max_seq_len=own + 50))
    tight = max_seq_len("auto", tiny, PipelineOptions(memory_mb=22))
    assert tight < max_seq_len("auto", tiny, PipelineOptions())
    plan = make_plan("auto", [tight + 1, 500, 300], tiny, PlannerOptions(drop_over_max=True), memory_mb=22.0)
    assert plan.dropped_seq_ids == [0]


def test_auto_keeps_flexsp_what_its_packing_and_checks_take(monkeypatch, layout_deadlines):
    """FlexSP packs, times and checks its plan as BatchAda does before it solves: the layouts end
    AUTO_FLEXSP_MIN_X x BatchAda's time before the limit's reserve, whatever FlexSP's share;
    with no FlexSP to plan, at the limit."""
    import megatron_ext.planner.auto as auto_mod

    cost = CostModel.from_presets("llama-13b", "a800-80g-8x4", 1)
    lengths = sample_lengths("github", 128, 0, 16 * 1024)  # (layouts planned, and FlexSP after them)
    real_plan_sp = auto_mod.plan_sp

    def slow_batchada(name, *a, **k):
        if name == "batchada":
            time.sleep(0.25)  # (as 32,768 sequences on 4,096 GPUs take)
        return real_plan_sp(name, *a, **k)

    monkeypatch.setattr(auto_mod, "plan_sp", slow_batchada)
    start = time.perf_counter()
    plan_auto(lengths, cost, time_limit=1.0, flexsp=True)
    latest_end = start + 1.0 * (1 - auto_mod.AUTO_RESERVE) - auto_mod.AUTO_FLEXSP_MIN_X * 0.25
    assert layout_deadlines and max(layout_deadlines) <= latest_end + 1e-3
    layout_deadlines.clear()
    start = time.perf_counter()
    plan_auto(lengths, cost, time_limit=1.0, flexsp=False)  # (BatchAda is not planned)
    assert layout_deadlines and max(layout_deadlines) <= start + 1.0 + 1e-3
