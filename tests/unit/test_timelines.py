"""Barrier-free FlexSP plans: the timelines planner, their validation, timing (a DAG of groups) and
lower bound (cost/bounds.py's ``barrier_free_bound_ms``)."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from small_cost import small_cost
from megatron_ext.commands.scale import scaled_cost
from megatron_ext.cost import CostModel
from megatron_ext.data.lengths import sample_lengths
from megatron_ext.errors import ConfigError, InvalidPlanError
from megatron_ext.plan import MicroBatchPlan, SPGroup, StepPlan, fill_estimates, group_starts_ms, validate
from megatron_ext.planner import PlannerOptions, make_plan
from megatron_ext.planner.sp.timelines import _Batch, _bisect
from megatron_ext.sim import simulate

SMALL = dataclasses.replace(small_cost(), zero_stage=2)
WIDE = scaled_cost(CostModel.from_presets("gpt-7b", "a100-40g-8x8", zero_stage=2), 64)


def _plan(groups_per_mb, barrier_free=True, cost=SMALL) -> StepPlan:
    mbs = [MicroBatchPlan([SPGroup(r, ids, ring=cost.ring_degree(len(r))) for r, ids in groups])
           for groups in groups_per_mb]
    return StepPlan(kind="flexsp", num_gpus=cost.num_gpus, micro_batches=mbs, barrier_free=barrier_free)


def test_zero3_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="ZeRO 0, 1 or 2.*--zero-stage 2"):
        make_plan("timelines", [100, 200], small_cost())
    plan = _plan([[([0, 1, 2, 3], [0])]])
    with pytest.raises(InvalidPlanError, match="barrier-free plan needs ZeRO 0, 1 or 2"):
        validate(plan, np.array([100]), small_cost())


def test_barrier_free_is_for_flexsp_plans_only():
    plan = StepPlan(kind="elastic_pp", num_gpus=4, barrier_free=True)
    with pytest.raises(InvalidPlanError, match="flexsp plans only"):
        validate(plan, np.array([100]), SMALL)


def test_groups_start_when_their_own_ranks_are_free():
    lengths = np.array([3000, 500, 400, 300, 200, 900])
    t = [SMALL.group_time_ms(lengths[[i]], d) for i, d in zip(range(6), (2, 1, 1, 1, 1, 4))]
    groups = [[([0, 1], [0]), ([2], [1]), ([3], [2])], [([2], [3]), ([3], [4])], [([0, 1, 2, 3], [5])]]
    starts, times, end = group_starts_ms(_plan(groups), lengths, SMALL)
    assert times == [t[:3], t[3:5], t[5:]]
    assert starts[:2] == [[0.0, 0.0, 0.0], [t[1], t[2]]]
    assert starts[2] == [max(t[0], t[1] + t[3], t[2] + t[4])]  # the widest waits for the last of its ranks
    assert end == starts[2][0] + t[5]
    plan = fill_estimates(_plan(groups), lengths, SMALL)
    assert plan.estimated_step_time_s * 1e3 == pytest.approx(end + SMALL.step_sync_ms)
    assert plan.lower_bound_step_time_s * 1e3 == pytest.approx(SMALL.barrier_free_bound_ms(lengths))
    # with a barrier, every group of a micro-batch starts when the one before has ended
    synced, _, synced_end = group_starts_ms(_plan(groups, barrier_free=False), lengths, SMALL)
    assert synced[1] == [max(t[:3])] * 2 and synced_end == max(t[:3]) + max(t[3:5]) + t[5]
    assert simulate(_plan(groups), lengths, SMALL).step_time_s == pytest.approx(plan.estimated_step_time_s)


def test_bound_of_one_sequence_is_its_fastest_pass_and_the_sync():
    s = 5000
    fastest = min(SMALL.group_time_ms([s], d) for d in SMALL.degrees if s <= SMALL.token_capacity(d))
    assert SMALL.barrier_free_bound_ms([s]) == pytest.approx(fastest + SMALL.step_sync_ms)


def test_bound_of_many_short_sequences_is_their_work_and_the_passes_memory_forces():
    lengths = np.full(400, 100)  # degree 1 is the cheapest: no all-to-all, the fewest fixed GPU-ms a token
    cap, fixed = SMALL.token_capacity(1), SMALL.group_fixed_ms(1)
    work = lengths.sum() * fixed / cap + float(SMALL.seq_time_ms(lengths, 1).sum())
    assert SMALL.barrier_free_bound_ms(lengths) == pytest.approx(work / 4 + SMALL.step_sync_ms)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 60_000), min_size=1, max_size=60), wide=st.booleans())
def test_plans_are_valid_exact_and_above_the_bound(lengths, wide):
    cost = WIDE if wide else SMALL
    lengths = np.array(lengths)
    plan = make_plan("timelines", lengths, cost, PlannerOptions(drop_over_max=True))
    assert plan.barrier_free and plan.kind == "flexsp" and plan.solver_status == "timelines"
    assert all(g.ring == cost.ring_degree(g.degree) for mb in plan.micro_batches for g in mb.groups)
    assert plan.estimated_step_time_s >= plan.lower_bound_step_time_s * (1 - 1e-9)
    res = simulate(plan, lengths, cost)
    assert res.step_time_s == pytest.approx(plan.estimated_step_time_s)
    for r in range(cost.num_gpus):  # a rank's passes run one after another, in micro-batch order
        events = res.timeline(r)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(events, events[1:]))
        order = [int(e.label.split(":")[0][2:]) for e in events]
        assert order == sorted(order)


def test_at_scale_gpu_sets_run_different_numbers_of_passes_and_beat_the_barrier():
    cost = scaled_cost(CostModel.from_presets("gpt-7b", "a100-40g-8x8", zero_stage=2), 1024)
    lengths = sample_lengths("wikipedia", 8192, 0, 393216)
    options = PlannerOptions(drop_over_max=True)
    plan = make_plan("timelines", lengths, cost, options)
    passes = np.zeros(cost.num_gpus, dtype=np.int64)
    for mb in plan.micro_batches:
        for g in mb.groups:
            passes[g.ranks] += 1
    assert passes.min() < passes.max()
    assert plan.estimated_step_time_s <= plan.lower_bound_step_time_s * 1.05
    assert plan.estimated_step_time_s < make_plan("flexsp", lengths, cost, options).estimated_step_time_s


def test_few_sequences_a_gpu_pack_into_wider_groups():
    """One sequence a GPU: each at its narrowest degree would get a pass (and a fixed cost) of its
    own, two or three after another on some GPUs; timelines raises the narrowest degree and packs
    them, as fast as the best single degree (BatchAda) or faster."""
    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x8", 2)
    for seed in (0, 1):
        lengths = sample_lengths("wikipedia", 64, seed, 32 * 1024)
        timelines = make_plan("timelines", lengths, cost)
        # (within the bisection's tolerance, REL_TOL)
        assert timelines.estimated_step_time_s <= make_plan("batchada", lengths, cost).estimated_step_time_s * 1.003


def test_the_first_feasible_target_is_sought_close_above_the_bound():
    """The smallest feasible makespan target is mostly a few % over the lower bound: the search
    walks up from the bound in growing steps, so a limit that cuts the bisection short still keeps
    a near-best target (doubling the bound then halving kept one 20% over at 4,096 GPUs)."""
    cost = scaled_cost(CostModel.from_presets("gpt-7b", "a100-40g-8x8", zero_stage=2), 512)
    batch = _Batch(sample_lengths("github", 4096, 1, 64 * 1024), cost)
    full, _, cut = _bisect(batch, time.perf_counter() + 60)
    hurried, layout, hurry_cut = _bisect(batch, time.perf_counter() - 1)  # no bisection at all
    assert not cut and hurry_cut and layout is not None
    assert full <= hurried <= 1.05 * full


def test_a_clock_cut_of_the_narrowest_degree_search_is_said(monkeypatch):
    """Raising the narrowest degree stops on the clock too: the status says time_limit then (it
    said timelines, and the plan moved with the machine's speed)."""
    from megatron_ext.planner.sp import timelines

    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x8", 2)
    lengths = sample_lengths("wikipedia", 80, 0, 32768)  # (few sequences a GPU: raising it is tried)
    assert make_plan("timelines", lengths, cost, PlannerOptions(time_limit=5.0)).solver_status == "timelines"
    monkeypatch.setattr(timelines, "FLOOR_SHARE", 0.0)
    plan = make_plan("timelines", lengths, cost, PlannerOptions(time_limit=5.0))
    assert plan.solver_status == "time_limit"
    validate(plan, lengths, cost)
