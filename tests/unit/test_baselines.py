"""Baseline planners: static Ulysses, BatchAda, Megatron-core's BalancedCPScheduler."""
from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from small_cost import small_cost
from megatron_ext.cost import CostModel
from megatron_ext.data.lengths import sample_lengths
from megatron_ext.errors import ConfigError, InfeasibleError
from megatron_ext.plan import validate
from megatron_ext.planner import PlannerOptions, make_plan
from megatron_ext.planner.sp.baselines import adapt_megatron_schedule, step_time_ms

COSTS = {
    "gpt-7b": CostModel.from_presets("gpt-7b", "a100-40g-8x8"),
    "tiny": small_cost(),
}
BASELINES = ("static_ulysses", "batchada", "megatron_balanced_cp")
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def batches(draw):
    """A cost model and a length mix: mostly short, some mid, a few near the memory limits."""
    name = draw(st.sampled_from(sorted(COSTS)))
    cost = COSTS[name]
    cap1, top = cost.token_capacity(1), cost.max_seq_len
    edges = [c + k for d in cost.degrees for c in [cost.token_capacity(d)] for k in (-1, 0, 1) if 1 <= c + k <= top]
    length = st.one_of(st.integers(1, max(1, cap1 // 16)), st.integers(1, cap1), st.integers(cap1, top),
                       st.sampled_from(edges))
    return name, np.array(draw(st.lists(length, min_size=1, max_size=40)), dtype=np.int64)


def _layout(plan):
    return [[(g.ranks, g.seq_ids) for g in mb.groups] for mb in plan.micro_batches]


def _degrees(plan):
    return {g.degree for mb in plan.micro_batches for g in mb.groups}


@pytest.mark.parametrize("name", BASELINES)
@SETTINGS
@given(batch=batches())
def test_plans_are_valid_complete_and_deterministic(name, batch):
    cost = COSTS[batch[0]]
    lengths = batch[1]
    plan = make_plan(name, lengths, cost)
    validate(plan, lengths, cost)
    ids = sorted(i for mb in plan.micro_batches for g in mb.groups for i in g.seq_ids)
    assert ids == list(range(len(lengths)))
    for mb in plan.micro_batches:
        assert sum(g.degree for g in mb.groups) <= cost.num_gpus
        for g in mb.groups:
            assert g.degree in cost.degrees
            assert lengths[g.seq_ids].sum() <= cost.token_capacity(g.degree)
    assert plan.estimated_step_time_s >= plan.lower_bound_step_time_s * (1 - 1e-9)
    again = make_plan(name, lengths, cost)
    assert _layout(again) == _layout(plan)
    assert again.solver_status == plan.solver_status
    assert again.estimated_step_time_s == plan.estimated_step_time_s


@SETTINGS
@given(batch=batches())
def test_batchada_is_no_slower_than_static_at_any_feasible_degree(batch):
    cost = COSTS[batch[0]]
    lengths = batch[1]
    ada = make_plan("batchada", lengths, cost)
    assert len(_degrees(ada)) == 1
    lowest = cost.min_degree(int(lengths.max()))
    for d in cost.degrees:
        if d < lowest:
            with pytest.raises(InfeasibleError):
                make_plan("static_ulysses", lengths, cost, PlannerOptions(static_degree=d))
            continue
        static = make_plan("static_ulysses", lengths, cost, PlannerOptions(static_degree=d))
        assert _degrees(static) == {d}
        assert all(len(mb.groups) <= cost.num_gpus // d for mb in static.micro_batches)
        assert ada.estimated_step_time_s <= static.estimated_step_time_s * (1 + 1e-12)


def test_static_default_degree_is_the_largest():
    cost = COSTS["gpt-7b"]
    plan = make_plan("static_ulysses", [1000, 2000, 3000], cost)
    assert _degrees(plan) == {64}
    assert plan.solver_status == "degree 64"


@pytest.mark.parametrize("model, degree, length, count, micro_batches, seqs_on_critical_path", [
    # tiny on cpu-4, degree 2 holds 162,578 tokens: two 80K sequences per group, not three; 5 -> 3
    # groups at least, 2 groups per micro-batch -> 2 micro-batches; the slowest groups hold 2 + 1
    ("tiny", 2, 80_000, 5, 2, 3),
    # degree 1 holds 81,289 tokens: one 80K sequence per group, 4 groups per micro-batch -> 2; 1 + 1
    ("tiny", 1, 80_000, 5, 2, 2),
    # degree 4 holds 325,156: four 80K per group, one group per micro-batch -> 2 (4 + 1 or 3 + 2)
    ("tiny", 4, 80_000, 5, 2, 5),
    # gpt-7b on 64 GPUs, degree 8 holds 47,611: two 23K per group, 24 -> 12 groups, 8 per
    # micro-batch -> 2; spread over the 16 slots: 8 groups of 2 then 8 groups of 1 -> 2 + 1
    ("gpt-7b", 8, 23_000, 24, 2, 3),
    # degree 64 holds 380,891: one 200K sequence per group, one group per micro-batch
    ("gpt-7b", 64, 200_000, 3, 3, 3),
])
def test_static_microbatch_count_by_hand(model, degree, length, count, micro_batches, seqs_on_critical_path):
    cost = COSTS[model]
    plan = make_plan("static_ulysses", [length] * count, cost, PlannerOptions(static_degree=degree))
    assert _degrees(plan) == {degree}
    assert len(plan.micro_batches) == micro_batches
    expected = micro_batches * cost.micro_batch_fixed_ms + seqs_on_critical_path * float(cost.seq_time_ms(length, degree))
    assert plan.estimated_step_time_s == pytest.approx(expected / 1e3)


def test_static_balances_time_across_groups():
    """16 equal sequences at degree 8 on 64 GPUs: one micro-batch, 8 groups of 2, all equal."""
    cost = COSTS["gpt-7b"]
    plan = make_plan("static_ulysses", [1000] * 16, cost, PlannerOptions(static_degree=8))
    (mb,) = plan.micro_batches
    assert [len(g.seq_ids) for g in mb.groups] == [2] * 8
    expected = (cost.micro_batch_fixed_ms + 2 * float(cost.seq_time_ms(1000, 8))) / 1e3
    assert plan.estimated_step_time_s == pytest.approx(expected)


def test_static_degree_errors():
    cost = COSTS["gpt-7b"]
    with pytest.raises(ConfigError, match="degree 3 is not allowed"):
        make_plan("static_ulysses", [100], cost, PlannerOptions(static_degree=3))
    with pytest.raises(ConfigError, match="degree 128 is not allowed"):
        make_plan("static_ulysses", [100], cost, PlannerOptions(static_degree=128))
    too_long = cost.token_capacity(4) + 1
    with pytest.raises(InfeasibleError, match=f"at SP degree 4 .*{too_long} tokens.*needs degree 8"):
        make_plan("static_ulysses", [100, too_long], cost, PlannerOptions(static_degree=4))
    tiny = COSTS["tiny"]  # 8 heads, 4 KV heads, 4 CPU ranks: degrees 1, 2, 4
    with pytest.raises(ConfigError, match="allowed: 1, 2, 4"):
        make_plan("static_ulysses", [100], tiny, PlannerOptions(static_degree=8))


@pytest.mark.parametrize("seed", [0, 1])
def test_wikipedia_batches(seed):
    cost = COSTS["gpt-7b"]
    lengths = sample_lengths("wikipedia", 512, seed, cost.max_seq_len)
    plans = {name: make_plan(name, lengths, cost) for name in BASELINES}
    for plan in plans.values():
        validate(plan, lengths, cost)
        assert plan.estimated_step_time_s >= plan.lower_bound_step_time_s
    static = plans["static_ulysses"]
    assert _degrees(static) == {64}
    assert plans["batchada"].estimated_step_time_s <= static.estimated_step_time_s
    # the same timing as make_plan's, from the planner's own helper
    groups = [[(g.degree, g.seq_ids) for g in mb.groups] for mb in static.micro_batches]
    assert step_time_ms(groups, lengths, cost) / 1e3 == pytest.approx(static.estimated_step_time_s)


def test_megatron_groups_follow_its_gpu_sets():
    """Each sample keeps the CP size Megatron gave it, and samples share a group only if Megatron
    put them on the same GPUs; the only change is splitting groups over our memory limit."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core warns at import that TE / Apex are absent
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    cost = COSTS["gpt-7b"]
    lengths = sample_lengths("wikipedia", 512, 3, cost.max_seq_len)

    class Group:
        def size(self):
            return cost.num_gpus

    sched = BalancedCPScheduler(cost.token_capacity(1), Group())
    _, sample_id_groups = sched.get_groups_and_subsamples([(i, int(s)) for i, s in enumerate(lengths)], None)
    gpu_set = {}
    for m, per_gpu in enumerate(sample_id_groups):
        for g, ids in enumerate(per_gpu):
            for i in ids:
                gpu_set.setdefault(i, (m, set()))[1].add(g)
    plan = make_plan("megatron_balanced_cp", lengths, cost)
    groups_per_set = {}
    for mb in plan.micro_batches:
        for g in mb.groups:
            (key,) = {(gpu_set[i][0], frozenset(gpu_set[i][1])) for i in g.seq_ids}  # one Megatron set
            assert g.degree == len(key[1])
            groups_per_set[key] = groups_per_set.get(key, 0) + 1
    assert len(groups_per_set) == len({(m, frozenset(gpus)) for m, gpus in gpu_set.values()})
    split = sum(n > 1 for n in groups_per_set.values())
    assert split > 0  # its degree-1 GPUs get more tokens than one pass holds (see baselines.py)
    assert f"{split} groups over memory split" in plan.solver_status
    # each Megatron micro-batch becomes as many of ours as its most-split GPU set needs
    assert len(plan.micro_batches) == sum(max(n for (m, _), n in groups_per_set.items() if m == k)
                                          for k in range(len(sample_id_groups)))


def test_megatron_adapter_repairs():
    cost = COSTS["tiny"]  # 4 ranks; degree 1 holds 81,289 tokens, degree 2 162,578
    lengths = np.array([100_000, 50_000, 60_000, 70_000, 1_000, 2_000])
    per_gpu = [[0, 1], [0, 1], [2, 3, 4], [5]]  # {0,1}: degree 2; {2}: 131K tokens at degree 1
    mbs, repairs = adapt_megatron_schedule([per_gpu], lengths, cost)
    # {2}'s 131K tokens split best-fit into [70K + 1K] and [60K]; the slower part runs first
    assert mbs == [[(2, [0, 1]), (1, [3, 4]), (1, [5])], [(1, [2])]]
    assert repairs["split_groups"] == 1 and repairs["extra_micro_batches"] == 1 and not repairs["missing"]

    # GPU sets that overlap (sum of degrees 5 > 4) spill into another micro-batch
    mbs, repairs = adapt_megatron_schedule([[[0, 1], [0], [0], [0]]], np.array([10, 20]), cost)
    assert mbs == [[(4, [0])], [(1, [1])]] and repairs["spilled_groups"] == 1

    # a sample listed again in a later micro-batch is kept once; one never listed is reported
    mbs, repairs = adapt_megatron_schedule([[[0], [1], [2], [3]], [[3], [4], [4], [4]]],
                                           np.array([10, 20, 30, 40, 50, 60]), cost)
    assert repairs["duplicates"] == 1 and repairs["missing"] == [5]
    assert mbs == [[(1, [0]), (1, [1]), (1, [2]), (1, [3])], [(2, [4])]]  # GPU set {1,2,3} -> degree 2


def test_megatron_sequences_at_the_limit_are_not_lost():
    """Megatron's CP size rounds len / max_seq_len_per_rank up to a power of two; for sequences just
    under the largest group's capacity that exceeds the GPU count, and Megatron asserts. They are
    shown to it at the largest allowed degree instead."""
    cost = COSTS["gpt-7b"]
    assert cost.max_seq_len > 64 * cost.token_capacity(1)
    lengths = np.array([cost.max_seq_len, 3000, 500, 64 * cost.token_capacity(1) + 1])
    plan = make_plan("megatron_balanced_cp", lengths, cost)
    validate(plan, lengths, cost)
    assert "2 sequences shown at degree 64" in plan.solver_status
    assert len(plan.micro_batches) >= 2


def test_planner_package_imports_without_megatron_or_torch():
    code = ("import sys; sys.modules['megatron'] = None; sys.modules['torch'] = None\n"
            "from megatron_ext.planner.api import PLANNERS\n"
            "assert {'static_ulysses', 'batchada', 'megatron_balanced_cp'} <= set(PLANNERS)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


@pytest.mark.parametrize("seed", [5, 6])
def test_batchada_is_the_static_plan_at_its_degree(seed):
    cost = COSTS["gpt-7b"]
    lengths = sample_lengths("wikipedia", 128, seed, cost.max_seq_len)
    ada = make_plan("batchada", lengths, cost)
    (d,) = _degrees(ada)
    assert ada.solver_status.startswith(f"degree {d} ")
    static = make_plan("static_ulysses", lengths, cost, PlannerOptions(static_degree=d))
    assert _layout(static) == _layout(ada)
    assert static.estimated_step_time_s == ada.estimated_step_time_s


@pytest.mark.parametrize("planner", ["flexsp", *BASELINES])
def test_groups_past_the_head_limit_get_their_ring(planner):
    # 1 KV head: Ulysses degree 1, so every wider group is a ring; the plan validates only with
    # each group's ring set to the cost model's split (plan/validate.py)
    import dataclasses

    base = small_cost()
    cost = dataclasses.replace(base, model=dataclasses.replace(base.model, num_query_groups=1)).with_max_ring(4)
    lengths = [cost.token_capacity(1) * 3, 100, 50, 700]  # the first needs degree 4
    plan = make_plan(planner, lengths, cost, PlannerOptions(time_limit=1.0))
    groups = [g for mb in plan.micro_batches for g in mb.groups]
    assert all(g.ring == g.degree for g in groups) and max(g.degree for g in groups) == 4
    validate(plan, lengths, cost)


def test_plan_sp_keeps_time_for_checking_the_plan():
    """The planning function gets the limit less what placing, timing and checking its groups will
    take (``CHECK_S_PER_SEQ`` a sequence), never under half of it."""
    from megatron_ext.planner.options import PlannerOptions
    from megatron_ext.planner.sp.step import CHECK_S_PER_SEQ, plan_sp

    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x4", 3)
    given_limits = []

    def one_group_each(lengths, cost, options):
        given_limits.append(options.time_limit)
        return [[(8, [i]) for i in range(4 * k, 4 * k + 4)] for k in range(len(lengths) // 4)], "ok"

    lengths = np.full(4000, 1000)
    plan = plan_sp("test", one_group_each, lengths, cost, PlannerOptions(time_limit=1.0))
    assert len(plan.micro_batches) == 1000
    plan_sp("test", one_group_each, lengths, cost, PlannerOptions(time_limit=0.01))
    assert given_limits == [pytest.approx(1.0 - 4000 * CHECK_S_PER_SEQ), 0.005]
