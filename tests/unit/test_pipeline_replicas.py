"""Data-parallel replicas of an elastic pipeline (pp x sp below the GPU count): the sequences are
shared out, each replica runs its pipelines on its own GPUs, side by side; the simulator's step is
the slowest replica's, exactly what each replica simulates alone on a cluster of its size."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ext.cost import CostModel
from megatron_ext.cost.pipeline import PipelineCost
from megatron_ext.data.lengths import sample_lengths
from megatron_ext.errors import InvalidPlanError
from megatron_ext.plan import StepPlan, validate
from megatron_ext.plan.validate import replica_groups, validate_pipelines
from megatron_ext.planner.pp.grouping import split_replicas
from megatron_ext.planner.pp.elastic_pp import plan_elastic_pp
from megatron_ext.planner.pp.pipeline_baselines import plan_batch_1f1b, plan_seq1f1b
from megatron_ext.sim import simulate
from megatron_ext.text import numbered

COST = CostModel.from_presets("llama-13b", "a800-80g-8x4")  # 32 GPUs
HALF = dataclasses.replace(COST, cluster=dataclasses.replace(COST.cluster, num_nodes=2))  # one replica's 16


def _alone(plan: StepPlan, r: int) -> StepPlan:
    """Replica r's pipelines as a plan of their own on a cluster of one replica's GPUs."""
    pipes = [dataclasses.replace(p, replica=0) for p in plan.pipelines if p.replica == r]
    return StepPlan(kind="elastic_pp", num_gpus=HALF.num_gpus, planner="alone", pipelines=pipes)


@pytest.mark.parametrize("planner", [plan_elastic_pp, plan_seq1f1b, plan_batch_1f1b])
def test_replicas_run_side_by_side_and_the_step_is_the_slowest(planner):
    rng = np.random.default_rng(3)
    lengths = np.concatenate([rng.integers(20_000, 90_000, 4), rng.integers(100, 6000, 60)])
    plan = planner(lengths, COST, 2, 8)
    assert {p.replica for p in plan.pipelines} == {0, 1}
    assert all((p.stages, p.sp_degree) == (2, 8) for p in plan.pipelines)
    validate(plan, lengths, COST)  # every sequence exactly once over both replicas
    validate_pipelines(plan, lengths, COST)
    res = simulate(plan, lengths, COST)
    assert res.step_time_s == pytest.approx(plan.estimated_step_time_s, rel=1e-12)
    alone = [simulate(_alone(plan, r), lengths, HALF) for r in (0, 1)]
    # (and then the replicas' gradient sync, which a replica alone has none of: ZeRO-3's shards)
    sync_s = PipelineCost(COST, 2, 8).step_sync_ms / 1e3
    assert sync_s > 0
    assert res.step_time_s == pytest.approx(max(a.step_time_s for a in alone) + sync_s, rel=1e-12)
    assert res.peak_memory_mb == pytest.approx(alone[0].peak_memory_mb + alone[1].peak_memory_mb)
    assert res.busy_s == pytest.approx(alone[0].busy_s + alone[1].busy_s)
    busy_gpu_s = sum(a.step_time_s * (1 - a.bubble_ratio) * HALF.num_gpus for a in alone)
    assert res.bubble_ratio == pytest.approx(1 - busy_gpu_s / (COST.num_gpus * res.step_time_s))
    assert {e.where for e in res.events} == set(range(4))  # rows: replica x stages + stage
    assert res.tokens == int(lengths.sum())


def test_the_status_and_bound_name_the_replicas():
    lengths = np.array([60_000, 30_000, 5000, 4000, 3000, 2000])
    plan = plan_elastic_pp(lengths, COST, pp=2)  # sp 16 is over the head limit: 8, and 2 replicas
    assert "x SP 8 over 2 replicas" in plan.solver_status
    pc = PipelineCost(COST, 2, 8)  # the busier replica does at least half of every stage's work, and a chunk
    assert plan.lower_bound_step_time_s == pytest.approx(pc.lower_bound_ms(lengths) / 1e3)
    assert plan.lower_bound_step_time_s * 1e3 >= float(pc.prefix_ms(lengths).sum()) / 2 + pc.fixed_ms + pc.step_sync_ms
    assert plan.lower_bound_step_time_s <= plan.estimated_step_time_s


def test_a_replica_with_nothing_to_run_idles():
    lengths = np.array([30_000])
    plan = plan_elastic_pp(lengths, COST, 2, 8)
    assert [p.replica for p in plan.pipelines] == [0]
    res = simulate(plan, lengths, COST)
    alone = simulate(_alone(plan, 0), lengths, HALF)
    assert res.step_time_s == pytest.approx(alone.step_time_s + PipelineCost(COST, 2, 8).step_sync_ms / 1e3)
    states = PipelineCost(COST, 2, 8).model_states_mb
    assert res.busy_s[2:] == [0.0, 0.0] and res.peak_memory_mb[2:] == pytest.approx([states, states])
    assert res.bubble_ratio > 0.5  # half the GPUs idle all step
    assert len(res.memory) == 4


def test_replica_rules_are_checked():
    lengths = np.array([3000, 2000])
    plan = plan_elastic_pp(lengths, COST, 2, 8)
    bad = StepPlan.from_json(plan.to_json())
    bad.pipelines[0].replica = 2
    with pytest.raises(InvalidPlanError, match="replica 2, but 2 stages x SP 8 on 32 GPUs makes 2 replicas"):
        simulate(bad, lengths, COST)
    bad.pipelines[0].replica = -1
    with pytest.raises(InvalidPlanError, match="replica must be a non-negative integer"):
        validate_pipelines(bad, lengths, COST)
    bad.pipelines[0].replica = 0
    assert len(bad.pipelines) == 2 and replica_groups(bad, COST.num_gpus) == [[0], [1]]
    bad.pipelines[1].stages = 4  # a second layout beside a replicated one
    with pytest.raises(InvalidPlanError, match="different layouts"):
        replica_groups(bad, COST.num_gpus)
    # ... and without replicas (8 x 4 then 4 x 8 on 32 GPUs: the simulator kept the last's stage
    # statistics only, and no runtime runs two layouts a step)
    bad.pipelines[0].stages, bad.pipelines[0].sp_degree, bad.pipelines[1].sp_degree = 8, 4, 8
    with pytest.raises(InvalidPlanError, match="share one layout .*got different layouts: 8 x 4, 4 x 8"):
        replica_groups(bad, COST.num_gpus)


def test_json_keeps_the_replica_and_old_plans_load_as_replica_zero():
    lengths = np.array([40_000, 3000, 2000, 1000])
    plan = plan_elastic_pp(lengths, COST, 2, 8)
    back = StepPlan.from_json(plan.to_json())
    assert [p.replica for p in back.pipelines] == [p.replica for p in plan.pipelines]
    d = json.loads(plan_elastic_pp(lengths, COST, 4, 8).to_json())
    for p in d["pipelines"]:
        del p["replica"]  # a plan written before replicas existed
    assert all(p.replica == 0 for p in StepPlan.from_dict(d).pipelines)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.one_of(st.integers(1, 120_000), st.sampled_from([512, 4096, 32_768, 2**31 + 1, 2**40])),
                       min_size=1, max_size=80), replicas=st.sampled_from([1, 2, 3, 4, 16, 100]))
def test_split_replicas_is_a_partition_balanced_longest_first(lengths, replicas):
    lengths = np.array(lengths)
    pc = PipelineCost(COST, 4, 8)
    ids = np.arange(len(lengths))
    parts = split_replicas(ids, lengths, pc, replicas)
    assert len(parts) == replicas
    assert sorted(np.concatenate(parts).tolist()) == ids.tolist()
    assert all((np.diff(p) > 0).all() for p in parts)
    work = pc.prefix_ms(lengths)
    loads = [float(work[p].sum()) for p in parts]
    # longest processing time first: no replica ends more than one sequence over the average
    assert max(loads) <= sum(loads) / replicas + float(work.max()) + 1e-6
    # ... exactly (equal lengths too, which tie): each sequence, longest first (ties by id), to the
    # least loaded (ties: lowest index), one at a time
    want, load = [[] for _ in range(replicas)], [0.0] * replicas
    for i in sorted(ids.tolist(), key=lambda i: (-work[i], i)):
        r = min(range(replicas), key=lambda r: (load[r], r))
        want[r].append(i)
        load[r] += float(work[i])
    assert [p.tolist() for p in parts] == [sorted(w) for w in want]


def test_one_of_pp_and_sp_gives_the_other_the_most_the_gpus_allow():
    from megatron_ext.errors import ConfigError
    from megatron_ext.planner.auto import plan_auto
    from megatron_ext.planner.pp.pipeline import resolve_layout

    assert resolve_layout(COST, 2, None) == (2, 8)  # sp 16 is over the 40 heads' limit: 2 replicas
    assert resolve_layout(COST, None, 1) == (8, 1)  # 32 stages do not divide 40 layers: 8, 4 replicas
    assert resolve_layout(COST, None, 8) == (4, 8)
    with pytest.raises(ConfigError, match="pipeline degree 5 does not divide the 32 GPUs of a800-80g-8x4; "
                                          "choose one of 1, 2, 4, 8"):
        resolve_layout(COST, 5, None)
    lengths = np.array([3000, 2000, 1000])
    one_stage = plan_auto(lengths, COST, pp=1, sp=8, flexsp=False)  # one-stage replicas of SP 8 alone
    assert one_stage.kind == "elastic_pp" and set(one_stage.baselines) == set()
    assert {(p.stages, p.sp_degree) for p in one_stage.pipelines} == {(1, 8)}
    plan = plan_elastic_pp(np.array([50_000, 40_000, 3000, 2000]), COST, 2, 8)
    assert "; pipeline 0: " in plan.solver_status and "; pipeline 1: " in plan.solver_status


def test_pipelines_chunked_alike_are_named_once_in_ranges():
    assert numbered("pipeline", [3]) == "pipeline 3"
    assert numbered("pipeline", [0, 1, 2, 3, 4, 5, 7, 9, 10]) == "pipelines 0-5, 7, 9-10"


def test_rebalancing_moves_work_from_the_slowest_replica_to_the_fastest():
    import time

    from megatron_ext.planner.pp.elastic_pp import _plan_replica, _rebalance
    from megatron_ext.planner.pp.pipeline import pipeline_options

    opts = pipeline_options(None, {"time_limit": 5.0})
    pc = PipelineCost(COST, 2, 8)
    lengths = np.array([80_000] + [6000] * 30 + [3000] * 4)
    parts = [np.arange(31), np.arange(31, 35)]  # a lopsided share: replica 0 has nearly everything
    plans = {r: _plan_replica(p, lengths, pc, opts, time.perf_counter(), 2.0) for r, p in enumerate(parts)}
    before = max(sum(b.makespan_ms for b in plans[r]) for r in plans)
    _rebalance(parts, plans, lengths, pc, opts, time.perf_counter() + 20.0)
    after = [sum(b.makespan_ms for b in plans[r]) for r in sorted(plans)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(35))  # every sequence, once
    assert 0 in parts[0]  # the slow replica keeps its longest sequence
    assert max(after) < 0.8 * before and len(parts[1]) > 4
    for r in plans:  # each replica's plan covers exactly its sequences
        assert sorted({x[0] for b in plans[r] for c in b.pieces for x in c}) == sorted(parts[r].tolist())


def test_the_slowest_replica_gets_the_time_left_and_resumes_its_search(monkeypatch):
    import time

    from megatron_ext.planner.pp import elastic_pp

    calls = []  # (ids, budget, builds, makespan, candidates built, end) of each search; budget None: a replay
    plan_replica, replay = elastic_pp._plan_replica, elastic_pp.replay

    def recorded(ids, lengths, pc, opts, start, budget, builds=None, stands=None):
        built = plan_replica(ids, lengths, pc, opts, start, budget, builds, stands)
        if builds is not None:  # (not the rebalancing's)
            calls.append((tuple(ids.tolist()), budget, builds, sum(b.makespan_ms for b in built), len(builds.built),
                          start + budget))
        return built

    def replayed(ids, *a, **k):
        built = replay(ids, *a, **k)
        calls.append((tuple(ids.tolist()), None, None, built.makespan_ms, 0, time.perf_counter()))
        return built

    monkeypatch.setattr(elastic_pp, "_plan_replica", recorded)
    monkeypatch.setattr(elastic_pp, "replay", replayed)
    rng = np.random.default_rng(5)
    lengths = np.concatenate([rng.integers(30_000, 90_000, 6), rng.integers(200, 8000, 120)])
    limit, t0 = 1.0, time.perf_counter()
    plan = plan_elastic_pp(lengths, COST, 2, 8, time_limit=limit)
    # the first pass: each replica once (the second replays the first's chunking, or, where that
    # ends past it, is searched too), in REPLICA_FIRST_PASS of the time before rebalancing
    parts = {tuple(p.tolist()) for p in split_replicas(np.arange(len(lengths)), lengths, PipelineCost(COST, 2, 8), 2)}
    pass_end = t0 + elastic_pp.REPLICA_FIRST_PASS * elastic_pp.REBALANCE_AFTER * limit + 0.01
    n_first = next(i for i, c in enumerate(calls) if c[5] > pass_end)
    first, rest = calls[:n_first], calls[n_first:]
    assert calls[0][1] is not None and {c[0] for c in first} == parts and all(c[1] is not None for c in rest)
    assert rest, "the time left went to no replica"
    ends = {k: min(c[3] for c in first if c[0] == k) for k in parts}  # (the faster of a replay and a search)
    slowest = max(ends, key=ends.get)
    assert rest[0][0] == slowest  # ... in the time left before rebalancing
    assert rest[0][5] <= t0 + elastic_pp.REBALANCE_AFTER * limit + 0.01 and rest[0][5] > max(c[5] for c in first)
    # one cache for all: the replica planned again starts from every candidate built before
    searched = [c for c in calls if c[1] is not None]
    assert all(c[2] is searched[0][2] for c in searched) and rest[0][4] >= searched[0][4]
    sync_ms = PipelineCost(COST, 2, 8).step_sync_ms  # (a plan again is kept only where it is faster)
    assert plan.estimated_step_time_s * 1e3 <= max(ends.values()) + sync_ms + 1e-6
    validate(plan, lengths, COST)


def test_a_replica_that_gains_nothing_in_its_share_gets_all_the_time_left_once_more(monkeypatch):
    # two replicas ending within REPLICA_TIE share the time left; the slowest, planned again in its
    # half, gains nothing (here: its first plan again), so it gets all the time left, then stops
    import time

    from megatron_ext.planner.pp import elastic_pp

    first, again = {}, []
    plan_replica = elastic_pp._plan_replica

    def replanned_without_gain(ids, lengths, pc, opts, start, budget, builds=None, stands=None):
        key = tuple(ids.tolist())
        if builds is None:  # (the rebalancing's)
            return plan_replica(ids, lengths, pc, opts, start, budget, builds, stands)
        if key in first:
            again.append((key, budget, start))
            return first[key]
        first[key] = plan_replica(ids, lengths, pc, opts, start, budget, builds)
        return first[key]

    def replayed(ids, *a, **k):  # (a replay is a replica's first plan too)
        built = replay(ids, *a, **k)
        first.setdefault(tuple(ids.tolist()), [built])
        return built

    replay = elastic_pp.replay
    monkeypatch.setattr(elastic_pp, "_plan_replica", replanned_without_gain)
    monkeypatch.setattr(elastic_pp, "replay", replayed)
    lengths = sample_lengths("github", 512, 0, 96 * 1024)
    cost = CostModel.from_presets("llama-13b", "a800-80g-8x4", 3)
    limit, t0 = 0.6, time.perf_counter()
    plan_elastic_pp(lengths, cost, 2, 8, time_limit=limit)
    ends = sorted(sum(b.makespan_ms for b in built) for built in first.values())
    assert len(first) == 2 and ends[1] * (1 - elastic_pp.REPLICA_TIE) <= ends[0]  # (tied)
    assert len(again) == 2 and again[0][0] == again[1][0]
    first_end = t0 + elastic_pp.REBALANCE_AFTER * limit
    (_, half, at0), (_, whole, at1) = again
    assert half == pytest.approx((first_end - at0) / 2, abs=1e-3)
    assert whole == pytest.approx(first_end - at1, abs=1e-3) and whole > 1.5 * half


def test_kept_to_its_limit_a_layout_of_many_replicas_stops_once_they_cannot_all_be_planned_in_time(monkeypatch):
    from megatron_ext.errors import InfeasibleError, OutOfTimeError
    from megatron_ext.planner.pp import elastic_pp

    cost = CostModel.from_presets("llama-13b", "a800-80g-8x16")  # 128 GPUs: 16 replicas of 2 x SP 4
    rng = np.random.default_rng(11)
    lengths = np.concatenate([rng.integers(20_000, 40_000, 16), rng.integers(500, 6000, 200)])
    # the first replica, with nothing feasible yet when the limit passes, gives up its hunt
    with pytest.raises(OutOfTimeError, match="pipeline 0: nothing fitted before the time ran out"):
        plan_elastic_pp(lengths, cost, 2, 4, time_limit=1e-6, keep_to_limit=True)
    # ... and let hunt on, the first replica is searched, the second replays its chunking (the first
    # pass has no time for a search), and 14 more at what that took cannot fit in a microsecond
    plan_replica = elastic_pp._plan_replica
    monkeypatch.setattr(elastic_pp, "_plan_replica", lambda *a: plan_replica(*a[:7]))  # (no ``stands``)
    with pytest.raises(OutOfTimeError, match=r"14 replicas left to plan at [\d.]+ s or more each, and the plan's "
                                             r"check, past the 1e-06 s"):
        plan_elastic_pp(lengths, cost, 2, 4, time_limit=1e-6, keep_to_limit=True)
    plan = plan_elastic_pp(lengths, cost, 2, 4, time_limit=1e-6)  # (not kept to it: a plan, however late)
    assert {p.replica for p in plan.pipelines} == set(range(16))
    validate(plan, lengths, cost)
    # a replay that cannot run its replica's sequences: that replica is searched, and the 14 left
    # are priced at a search's time
    def cannot(*a, **k):
        raise InfeasibleError("no")

    monkeypatch.setattr(elastic_pp, "replay", cannot)
    with pytest.raises(OutOfTimeError, match=r"14 replicas left to plan at [\d.]+ s or more each"):
        plan_elastic_pp(lengths, cost, 2, 4, time_limit=1e-6, keep_to_limit=True)
    plan = plan_elastic_pp(lengths, cost, 2, 4, time_limit=1e-6)
    assert {p.replica for p in plan.pipelines} == set(range(16))
    # the replicas fit in the limit, but not the plan's check after them (priced as those planned)
    monkeypatch.undo()
    monkeypatch.setattr(elastic_pp, "CHECK_PIPELINE_S", 1.0)
    with pytest.raises(OutOfTimeError, match="and the plan's check, past the 3 s limit"):
        plan_elastic_pp(lengths, cost, 2, 4, time_limit=3.0, keep_to_limit=True)


def test_replicas_given_less_time_than_a_search_replay_the_first_ones_chunking(monkeypatch):
    """Many replicas in no time: the first is searched, the others build its chunking on their own
    sequences (one build each, ``chunk_search.replay``), and the plan is whole and valid; given
    time, every replica is searched."""
    from megatron_ext.planner.pp import elastic_pp

    searched, replayed = [], []
    plan_replica, replay = elastic_pp._plan_replica, elastic_pp.replay
    monkeypatch.setattr(elastic_pp, "_plan_replica", lambda ids, *a, **k: searched.append(tuple(ids.tolist()))
                        or plan_replica(ids, *a, **k))
    monkeypatch.setattr(elastic_pp, "replay", lambda ids, *a, **k: replayed.append(tuple(ids.tolist()))
                        or replay(ids, *a, **k))
    cost = CostModel.from_presets("llama-13b", "a800-80g-8x16")  # 128 GPUs: 16 replicas of 2 x SP 4
    lengths = sample_lengths("github", 640, 4, 32_768)
    plan = plan_elastic_pp(lengths, cost, 2, 4, time_limit=1e-6)
    validate(plan, lengths, cost)
    assert {p.replica for p in plan.pipelines} == set(range(16))
    parts = [tuple(p.tolist()) for p in split_replicas(np.arange(640), lengths, PipelineCost(cost, 2, 4), 16)]
    assert searched[:1] == parts[:1] and replayed == parts[1:]
    res = simulate(plan, lengths, cost)
    assert res.step_time_s == pytest.approx(plan.estimated_step_time_s, rel=1e-12)
    # the replicas' plans are alike, the first one's chunking and order: named once
    clauses = plan.solver_status.split("; ")
    assert clauses[0] == "16 pipelines x 2 stages x SP 4 over 16 replicas", plan.solver_status
    assert "pipeline" not in clauses[1] and clauses[1].endswith(" order"), plan.solver_status
    searched.clear(), replayed.clear()
    plan_elastic_pp(lengths[:64], cost, 2, 4, time_limit=2.0)
    assert not replayed and set(searched) >= {tuple(p.tolist()) for p in split_replicas(
        np.arange(64), lengths, PipelineCost(cost, 2, 4), 16) if p.size}


@pytest.mark.parametrize("probe", [True, False])
def test_a_replayed_chunking_means_the_same_on_other_sequences(probe):
    """``replay`` builds a chunking's recipe (chunk-time target and token cap, or pack size and
    slices) on other sequences: their pieces tile them, the order (and its tie-break) is the same, and replayed on
    its own sequences it is the same pipeline."""
    from megatron_ext.errors import InfeasibleError
    from megatron_ext.planner.pp.chunk_search import plan_group, replay
    from megatron_ext.planner.pp.pipeline import PipelineOptions

    pc, opts = PipelineCost(COST, 4, 8), PipelineOptions()
    lengths = sample_lengths("commoncrawl", 400, 2, 49_152)
    a, b = np.arange(0, 400, 2), np.arange(1, 400, 2)
    built = plan_group(a, lengths, pc, opts, probe=probe, whole_packs=True)
    assert built.recipe is not None
    again = replay(a, lengths, pc, opts, built)
    assert again.pieces == built.pieces and again.makespan_ms == pytest.approx(built.makespan_ms)
    other = replay(b, lengths, pc, opts, built)
    assert (other.order, other.slices, other.recipe, other.forwards_first) == (
        built.order, built.slices if built.slices < 0 else other.slices, built.recipe, built.forwards_first)
    tiles = sorted((int(s), int(x), int(y)) for c in other.pieces for s, x, y in c)
    assert {s for s, _, _ in tiles} == set(b.tolist())
    assert sum(y - x for _, x, y in tiles) == int(lengths[b].sum())
    with pytest.raises(InfeasibleError, match="no recipe"):
        replay(b, lengths, pc, opts, dataclasses.replace(built, recipe=None))


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.one_of(st.integers(1, 4096), st.integers(4096, 140_000)), min_size=4, max_size=40),
       layout=st.sampled_from([(2, 8), (4, 4), (8, 1)]), probe=st.booleans())
def test_a_replayed_chunking_runs_the_other_sequences_exactly_once_or_says_why_not(lengths, layout, probe):
    # another replica's sequences (here: the odd ones) chunked by the even ones' search, token-capped
    # slices and packs included: every token once, slices in order, a valid order, within memory
    from megatron_ext.errors import InfeasibleError
    from megatron_ext.planner.pp.chunk_search import plan_group, replay
    from megatron_ext.planner.pp.chunking import check_chunking
    from megatron_ext.planner.pp.pipeline import PipelineOptions

    lengths = np.array(lengths)
    pc, opts = PipelineCost(COST, *layout), PipelineOptions()
    a, b = np.arange(0, len(lengths), 2), np.arange(1, len(lengths), 2)
    try:
        model = plan_group(a, lengths, pc, opts, probe=probe, whole_packs=probe)
        other = replay(b, lengths, pc, opts, model)
    except InfeasibleError:
        return  # (a sequence no stage holds, or a chunking that cannot run the others: searched instead)
    check_chunking(other.pieces, lengths, b)
    plan = StepPlan(kind="elastic_pp", num_gpus=COST.num_gpus, planner="replay",
                    pipelines=[other.to_pipeline(pc)], dropped_seq_ids=a.tolist())
    validate(plan, lengths, COST)
    assert simulate(plan, lengths, COST).step_time_s * 1e3 == pytest.approx(other.makespan_ms + pc.step_sync_ms)
