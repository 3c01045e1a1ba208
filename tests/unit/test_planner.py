"""The FlexSP planner: the sequence blaster (brute-force checked), rank placement, and properties
of make_plan('flexsp', ...) on random long-tailed length mixes."""
from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, note, settings, strategies as st

from small_cost import small_cost
from megatron_ext.cost import CostModel
from megatron_ext.errors import ConfigError, InfeasibleError, InvalidPlanError, LengthsError
from megatron_ext.plan import validate
from megatron_ext.planner import PlannerOptions, make_plan
from megatron_ext.planner.sp.blaster import balanced_split, dp_buckets
from megatron_ext.planner.sp.placement import place_groups
from megatron_ext.spec import is_power_of_two

COSTS = {
    "gpt-7b/a100-40g-8x8": CostModel.from_presets("gpt-7b", "a100-40g-8x8"),
    "tiny/cpu-4": small_cost(),
    "gpt-7b/a100-40g-8x2": CostModel.from_presets("gpt-7b", "a100-40g-8x2"),
}
BASELINES = ("static_ulysses", "batchada", "megatron_balanced_cp")
# flexsp starts from the best homogeneous packing, so it is never slower than these two. Against
# megatron_balanced_cp it can be (see test_flexsp_vs_megatron_balanced_cp_on_a_small_cpu_batch).
NEVER_SLOWER_THAN = ("static_ulysses", "batchada")
TIME_LIMIT = 0.5
OPTIONS = PlannerOptions(time_limit=TIME_LIMIT)
# Float noise only: flexsp and a baseline can reach the same groups summed in another order.
REL = 1e-9

small = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
planner_settings = settings(max_examples=40, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---- blaster: balanced_split -------------------------------------------------------------

def brute_min_max(tokens: list[int], parts: int) -> int:
    n = len(tokens)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(tokens[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@small
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=9), parts=st.integers(1, 6),
       descending=st.booleans())
def test_balanced_split_matches_brute_force(lengths, parts, descending):
    lengths = np.array(lengths)
    order = np.argsort(-lengths if descending else lengths, kind="stable")
    pieces = balanced_split(order, lengths, parts)
    # contiguous pieces of the given order, every id exactly once
    assert np.array_equal(np.concatenate(pieces), order)
    assert all(len(p) > 0 for p in pieces)
    k = min(parts, len(lengths))
    assert len(pieces) == k
    got = max(int(lengths[p].sum()) for p in pieces)
    assert got == brute_min_max(lengths[order].tolist(), k)


def test_balanced_split_examples():
    lengths = np.array([10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    order = np.arange(len(lengths))
    pieces = balanced_split(order, lengths, 2)
    assert [p.tolist() for p in pieces] == [[0], list(range(1, 11))]
    assert len(balanced_split(order, lengths, 100)) == len(lengths)  # at most one piece per id
    assert [p.tolist() for p in balanced_split(order, lengths, 1)] == [order.tolist()]


def test_balanced_split_spreads_slack():
    # the min-max bound is 10 (the first piece); later pieces should not be left nearly empty
    lengths = np.array([10] + [1] * 12)
    pieces = balanced_split(np.arange(13), lengths, 3)
    sizes = [int(lengths[p].sum()) for p in pieces]
    assert max(sizes) == 10 and min(sizes) >= 5


# ---- blaster: dp_buckets -------------------------------------------------------------------

def padding(sorted_lengths: np.ndarray, ends) -> float:
    starts = [0, *ends[:-1]]
    return float(sum((sorted_lengths[b - 1] * (b - a) - sorted_lengths[a:b].sum()) for a, b in zip(starts, ends)))


def brute_padding(s: np.ndarray, q: int) -> float:
    n = len(s)
    best = np.inf
    for k in range(0, min(q, n) - 1 + 1):
        for cuts in itertools.combinations(range(1, n), k):
            best = min(best, padding(s, [*cuts, n]))
    return best


@small
@given(lengths=st.lists(st.integers(1, 50), min_size=1, max_size=9), q=st.integers(1, 5))
def test_dp_buckets_matches_brute_force(lengths, q):
    s = np.sort(np.array(lengths))
    ends = dp_buckets(s, q)
    assert ends.dtype.kind == "i"
    assert len(ends) >= 1 and len(ends) <= q
    assert ends[-1] == len(s)
    assert (np.diff(ends) > 0).all() and ends[0] > 0
    assert padding(s, ends.tolist()) == pytest.approx(brute_padding(s, q), abs=1e-9)


def test_dp_buckets_examples():
    assert dp_buckets(np.array([], dtype=np.int64), 4).tolist() == []
    assert dp_buckets(np.array([5, 5, 5]), 4).tolist() == [3]  # one run: one bucket, no padding
    s = np.array([1, 1, 1, 100, 100, 1000])
    assert dp_buckets(s, 3).tolist() == [3, 5, 6]
    assert padding(s, dp_buckets(s, 2).tolist()) == brute_padding(s, 2)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(300, 3000), q=st.integers(1, 20))
def test_dp_buckets_large_batches(seed, n, q):
    """Over 256 distinct lengths the DP runs on geometric atoms: still valid bucket ends."""
    s = np.sort(np.random.default_rng(seed).lognormal(7, 1.5, n).astype(np.int64) + 1)
    ends = dp_buckets(s, q)
    assert 1 <= len(ends) <= q and ends[-1] == n
    assert (np.diff(ends) > 0).all() and ends[0] > 0
    if q > 1:  # more buckets never pad more than a single one
        assert padding(s, ends.tolist()) <= padding(s, [n])


# ---- placement -----------------------------------------------------------------------------

@small
@given(exps=st.lists(st.integers(0, 6), min_size=0, max_size=40))
def test_place_groups_aligned_disjoint(exps):
    n, per_node = 64, 8
    degrees = [2**e for e in exps]
    while sum(degrees) > n:  # keep a prefix that fits
        degrees.pop()
    ranks = place_groups(degrees, n)
    assert len(ranks) == len(degrees)
    used = set()
    for d, r in zip(degrees, ranks):
        assert len(r) == d
        assert r == list(range(r[0], r[0] + d))
        assert r[0] % d == 0 and r[-1] < n
        if d <= per_node:  # never straddles a node
            assert r[0] // per_node == r[-1] // per_node
        assert used.isdisjoint(r)
        used.update(r)


def test_place_groups_order_and_overflow():
    assert place_groups([1, 4, 2], 8) == [[6], [0, 1, 2, 3], [4, 5]]
    assert place_groups([], 8) == []
    assert place_groups([8], 8) == [list(range(8))]
    with pytest.raises(InvalidPlanError, match="need 9 GPUs"):
        place_groups([8, 1], 8)


# ---- make_plan: input handling -------------------------------------------------------------

def test_empty_batch():
    with pytest.raises(LengthsError, match="empty"):
        make_plan("flexsp", [], COSTS["tiny/cpu-4"])


@pytest.mark.parametrize("lengths, says", [
    ([100, 0, 5], "sequence 1 has length 0: lengths are whole numbers from 1 to 1,099,511,627,776"),
    ([100, -3], "sequence 1 has length -3"),
    # (each was planned or raised something else: 1000.5 as 1,000, '100' as 100, NaN numpy's ValueError)
    ([1000.5, 200], "sequence 0 has length 1000.5"),
    ([float("nan")], "sequence 0 has length nan"),
    ([100, 2**41], "sequence 1 has length 2199023255552"),
    (["100", "200"], "sequence lengths must be whole numbers, got <U3 values (e.g. '100')"),
    (np.array([True, False]), "got bool values"),
    ([[100, 200], [300, 400]], "a batch is a 1-D sequence of lengths, got an array of shape (2, 2)"),
    (1000, "got an array of shape ()"),
])
def test_bad_lengths(lengths, says):
    with pytest.raises(LengthsError) as err:
        make_plan("flexsp", lengths, COSTS["tiny/cpu-4"])
    assert says in str(err.value)


def test_whole_float_lengths_are_lengths():
    a, b = (make_plan("flexsp", lens, COSTS["tiny/cpu-4"]) for lens in (np.array([300.0, 200.0]), [300, 200]))
    assert a.estimated_step_time_s == b.estimated_step_time_s
    assert [[g.seq_ids for g in mb.groups] for mb in a.micro_batches] == \
        [[g.seq_ids for g in mb.groups] for mb in b.micro_batches]


def test_unknown_planner():
    with pytest.raises(ConfigError, match="unknown planner"):
        make_plan("nope", [100], COSTS["tiny/cpu-4"])


def test_over_long_sequence_refused_or_dropped():
    cost = COSTS["gpt-7b/a100-40g-8x8"]
    top = cost.max_seq_len
    lengths = np.array([1000, top + 1, 5000, top, 2 * top, 70000, top + 1])
    with pytest.raises(InfeasibleError, match=f"{2 * top} tokens"):
        make_plan("flexsp", lengths, cost, OPTIONS)
    plan = make_plan("flexsp", lengths, cost, PlannerOptions(time_limit=TIME_LIMIT, drop_over_max=True),
                     baselines=BASELINES)
    assert plan.dropped_seq_ids == [1, 4, 6]
    validate(plan, lengths, cost)
    planned = sorted(i for mb in plan.micro_batches for g in mb.groups for i in g.seq_ids)
    assert planned == [0, 2, 3, 5]
    assert plan.lower_bound_step_time_s == pytest.approx(cost.lower_bound_ms(lengths[[0, 2, 3, 5]]) / 1e3)
    for b in BASELINES:  # baselines were timed on the same kept sequences
        assert plan.baselines[b]["estimated_step_time_s"] > 0


def test_drop_over_max_with_nothing_left():
    cost = COSTS["tiny/cpu-4"]
    with pytest.raises(LengthsError, match="every sequence"):
        make_plan("flexsp", [cost.max_seq_len + 1] * 3, cost, PlannerOptions(drop_over_max=True))


def test_drop_over_max_drops_nothing_when_all_fit():
    cost = COSTS["tiny/cpu-4"]
    plan = make_plan("flexsp", [10, cost.max_seq_len], cost, PlannerOptions(drop_over_max=True))
    assert plan.dropped_seq_ids == []


def test_max_seq_len_option_drops_or_refuses():
    cost = COSTS["gpt-7b/a100-40g-8x8"]
    lengths = [100, 5000, 2000, 9000]
    plan = make_plan("flexsp", lengths, cost, PlannerOptions(max_seq_len=4000, drop_over_max=True))
    assert plan.dropped_seq_ids == [1, 3]
    validate(plan, lengths, cost)
    with pytest.raises(LengthsError, match="4000"):
        make_plan("flexsp", lengths, cost, PlannerOptions(max_seq_len=4000))
    assert make_plan("flexsp", lengths, cost, PlannerOptions(max_seq_len=10**9)).dropped_seq_ids == []


def test_single_sequences_at_every_capacity_edge():
    cost = COSTS["gpt-7b/a100-40g-8x2"]
    for d in cost.degrees:
        cap = cost.token_capacity(d)
        plan = make_plan("flexsp", [cap], cost, OPTIONS)
        (mb,) = plan.micro_batches
        (g,) = mb.groups
        assert g.seq_ids == [0] and g.degree >= d
        if d < cost.degrees[-1]:
            plan = make_plan("flexsp", [cap + 1], cost, OPTIONS)
            assert plan.micro_batches[0].groups[0].degree > d


# ---- make_plan('flexsp'): properties on long-tailed mixes ----------------------------------

@st.composite
def length_mixes(draw, cost: CostModel) -> np.ndarray:
    """1..300 lengths: a lognormal body (random median and spread) plus a few long-tail draws and
    capacity edges, clipped to 1..cost.max_seq_len, in random order."""
    top = cost.max_seq_len
    mu = draw(st.floats(2.0, 10.5))
    sigma = draw(st.floats(0.0, 2.5))
    n = draw(st.integers(1, 300))
    z = np.array(draw(st.lists(st.integers(-30, 30), min_size=n, max_size=n))) / 10.0
    body = np.clip(np.exp(mu + sigma * z), 1, top).astype(np.int64)
    edges = sorted({c + k for d in cost.degrees for c in [cost.token_capacity(d)] for k in (-1, 0, 1)
                    if 1 <= c + k <= top})
    tail = draw(st.lists(st.one_of(st.integers(1, top), st.sampled_from(edges)), max_size=4))
    lengths = np.concatenate([body, np.array(tail, dtype=np.int64)])[:300]
    perm = np.random.default_rng(draw(st.integers(0, 2**16))).permutation(len(lengths))
    return lengths[perm]


def _recomputed_step_ms(plan, lengths, cost) -> float:
    return sum(max(cost.group_time_ms(lengths[g.seq_ids], g.degree) for g in mb.groups) for mb in plan.micro_batches)


@pytest.mark.parametrize("case", sorted(COSTS))
@planner_settings
@given(data=st.data())
def test_flexsp_plan_properties(case, data):
    cost = COSTS[case]
    lengths = data.draw(length_mixes(cost), label="lengths")
    note(f"lengths = {lengths.tolist()}")
    plan = make_plan("flexsp", lengths, cost, OPTIONS, baselines=BASELINES)
    note(f"flexsp {plan.estimated_step_time_s:.6f} s [{plan.solver_status}] in {plan.solve_time_s:.3f} s; "
         f"baselines {plan.baselines}")

    # valid: every sequence exactly once, aligned disjoint power-of-two blocks, memory
    assert plan.kind == "flexsp" and plan.num_gpus == cost.num_gpus and plan.dropped_seq_ids == []
    validate(plan, lengths, cost)
    ids = sorted(i for mb in plan.micro_batches for g in mb.groups for i in g.seq_ids)
    assert ids == list(range(len(lengths)))
    for mb in plan.micro_batches:
        taken = set()
        for g in mb.groups:
            d = g.degree
            assert is_power_of_two(d) and d in cost.degrees
            assert g.ranks == list(range(g.ranks[0], g.ranks[0] + d)) and g.ranks[0] % d == 0
            assert taken.isdisjoint(g.ranks)
            taken.update(g.ranks)
            assert int(lengths[g.seq_ids].sum()) <= cost.token_capacity(d)
        assert max(taken) < cost.num_gpus

    # the estimate is the cost model's, and no lower than the lower bound
    assert plan.estimated_step_time_s == pytest.approx(_recomputed_step_ms(plan, lengths, cost) / 1e3, rel=1e-9)
    assert plan.lower_bound_step_time_s == pytest.approx(cost.lower_bound_ms(lengths) / 1e3, rel=1e-12)
    assert plan.lower_bound_step_time_s <= plan.estimated_step_time_s * (1 + REL)
    assert len(plan.micro_batches) >= cost.min_microbatches(lengths)

    # never slower than a static layout on the same batch
    for b in NEVER_SLOWER_THAN:
        other = plan.baselines[b]["estimated_step_time_s"]
        assert plan.estimated_step_time_s <= other * (1 + REL), f"flexsp slower than {b}"

    # deterministic. The planner's search and MILP stop at wall-clock deadlines (fractions of
    # the time limit), so two calls can only be expected to agree when neither came near one.
    if plan.solve_time_s < TIME_LIMIT / 5:
        again = make_plan("flexsp", lengths, cost, OPTIONS)
        if again.solve_time_s < TIME_LIMIT / 5:
            event("determinism compared")
            assert again.micro_batches == plan.micro_batches
            assert again.estimated_step_time_s == plan.estimated_step_time_s
            assert again.solver_status == plan.solver_status


@pytest.mark.parametrize("case", sorted(COSTS))
def test_flexsp_deterministic_on_a_quick_batch(case):
    cost = COSTS[case]
    rng = np.random.default_rng(7)
    lengths = np.clip(rng.lognormal(6.0, 1.2, 24).astype(np.int64), 1, cost.max_seq_len)
    options = PlannerOptions(time_limit=5.0)  # no deadline comes near on 24 sequences
    a = make_plan("flexsp", lengths, cost, options)
    b = make_plan("flexsp", lengths.tolist(), cost, options)
    if max(a.solve_time_s, b.solve_time_s) >= options.time_limit / 5:  # a very slow machine: deadlines may bind
        pytest.skip("a solve came near a deadline; determinism is only promised away from them")
    assert a.micro_batches == b.micro_batches
    assert a.to_dict() | {"solve_time_s": 0} == b.to_dict() | {"solve_time_s": 0}


def test_flexsp_past_its_deadline_still_plans_no_worse_than_batchada():
    """A limit too short for any search: the starting points past the deadline are skipped or cut
    short, the MILP does not run, and the plan is still valid and says so. It is the homogeneous
    packing at the degree of the lowest step-time bound, made whatever the deadline, which on
    this batch is BatchAda's (on 87% of batches of 16-2,048 sequences; at most 1.38x slower)."""
    from megatron_ext.data.lengths import sample_lengths

    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x8")
    lengths = sample_lengths("wikipedia", 512, 2, cost.max_seq_len)
    plan = make_plan("flexsp", lengths, cost, PlannerOptions(time_limit=1e-4))
    assert plan.solver_status == "time_limit"
    validate(plan, lengths, cost)
    batchada = make_plan("batchada", lengths, cost, OPTIONS)
    assert plan.estimated_step_time_s <= batchada.estimated_step_time_s * (1 + REL)


@pytest.mark.parametrize("share", [0.25, 0.0])  # (0: the early starts go after the cut search)
def test_flexsp_early_starts_before_or_after_the_cut_search(monkeypatch, share):
    """Where the re-plan of the best homogeneous packing would take much of the limit (4,096
    GPUs: 0.76 s of 1 s, leaving the cut search that wins there none), it and the cheapest-degree
    start go after the cut search; either way a generous limit finds the same quality of plan."""
    import megatron_ext.planner.sp.flexsp as flexsp
    from megatron_ext.data.lengths import sample_lengths

    monkeypatch.setattr(flexsp, "EARLY_START_SHARE", share)
    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x8")
    lengths = sample_lengths("commoncrawl", 256, 1, cost.max_seq_len)
    plan = make_plan("flexsp", lengths, cost, PlannerOptions(time_limit=5.0))
    validate(plan, lengths, cost)
    assert plan.estimated_step_time_s <= 1.25 * cost.lower_bound_ms(lengths) / 1e3


def test_flexsp_on_a_batch_too_big_for_its_time_limit():
    """20,000 sequences in 0.3 s: the plan is valid, says so, and is no slower than BatchAda's
    (here a single degree is feasible: its packing is the first plan)."""
    from megatron_ext.data.lengths import sample_lengths

    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x8")
    lengths = sample_lengths("wikipedia", 20_000, 0, cost.max_seq_len)
    plan = make_plan("flexsp", lengths, cost, PlannerOptions(time_limit=0.3))
    validate(plan, lengths, cost)
    assert plan.solver_status == "time_limit"
    batchada = make_plan("batchada", lengths, cost, OPTIONS)
    assert plan.estimated_step_time_s <= batchada.estimated_step_time_s * (1 + REL)


def test_a_cut_short_search_packs_the_rest_at_one_degree():
    """The cut search's plan when time ran out after its first part: that part as solved, the
    other sequences in the first homogeneous packing of them; every sequence once, in groups
    that hold it, far faster than one degree for all (BatchAda's 64 here)."""
    from megatron_ext.data.lengths import sample_lengths
    from megatron_ext.planner.sp.flexsp import _Batch, _SplitSearch

    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x8")
    lengths = sample_lengths("wikipedia", 4096, 1, cost.max_seq_len)
    order = np.argsort(-lengths, kind="stable")
    search = _SplitSearch(_Batch(lengths, cost), order, OPTIONS, deadline=math.inf)
    cuts = [0, *np.cumsum([len(p) for p in balanced_split(order, lengths, 12)]).tolist()]
    first = search.part(cuts[0], cuts[1])
    parts, total = search.hurried(cuts)
    assert parts[:len(first)] == first and total == pytest.approx(sum(t for _, t in parts))
    seen = sorted(i for groups, _ in parts for _, ids in groups for i in ids)
    assert seen == list(range(len(lengths)))
    for groups, _ in parts:
        assert sum(d for d, _ in groups) <= cost.num_gpus
        assert all(lengths[ids].sum() <= cost.token_capacity(d) for d, ids in groups)
    batchada = make_plan("batchada", lengths, cost, OPTIONS)
    assert total / 1e3 < batchada.estimated_step_time_s * 0.8


def brute_pack(batch, ids, C):
    """FlexSP's packing rule, sequence by sequence over every group: longest first, into the open
    group where it costs the fewest GPU-ms and fits C and memory (cheapest degree, then most loaded,
    then first opened), else a new group of the smallest degree that runs it within C."""
    gdi, load, room, members, used = [], [], [], [], 0
    for i in sorted(ids.tolist(), key=lambda i: -batch.lengths[i]):
        s, t = batch.lengths[i], batch.time[i]
        fits = [(t[d] * batch.degrees[d], d, -load[g], g) for g, d in enumerate(gdi)
                if load[g] + t[d] <= C and room[g] >= s]
        if fits:
            g = min(fits)[3]
            load[g] += t[gdi[g]]
            room[g] -= s
            members[g].append(i)
            continue
        ok = [d for d in range(len(batch.degrees)) if batch.fits[i, d] and t[d] + batch.lat[d] <= C]
        if not ok or used + batch.degrees[ok[0]] > batch.n:
            return None
        used += batch.degrees[ok[0]]
        gdi.append(ok[0]), load.append(batch.lat[ok[0]] + t[ok[0]]), room.append(batch.cap[ok[0]] - s)
        members.append([i])
    return gdi, members


@small
@given(seed=st.integers(0, 10_000), n=st.integers(1, 200), slack=st.floats(1.0, 3.0))
def test_flexsp_packing_matches_its_rule_checked_group_by_group(seed, n, slack):
    from megatron_ext.data.lengths import sample_lengths
    from megatron_ext.planner.sp.flexsp import _Batch, _pack_at

    cost = COSTS["gpt-7b/a100-40g-8x2"]
    lengths = sample_lengths("github", n, seed, cost.max_seq_len)
    batch = _Batch(lengths, cost)
    ids = np.random.default_rng(seed).permutation(n)[: max(1, n // 2)]
    C = slack * max(batch.best_gpu_ms[ids].sum() / batch.n, batch.fastest[ids].max())
    got, want = _pack_at(batch, ids, C), brute_pack(batch, ids, C)
    event("packed" if want is not None else "GPUs ran out")
    assert got == want


def test_flexsp_polish_improves_a_micro_batch_and_keeps_it_valid():
    """The MILP polish (``_polish``) of a poor plan, every sequence of a micro-batch in one group of
    all 16 GPUs: a faster micro-batch holding each sequence once, in groups that fit the GPUs and
    hold their tokens, its makespan summed right; a plan within 3% of the bound is left as it is."""
    import time

    from megatron_ext.data.lengths import sample_lengths
    from megatron_ext.planner.sp.flexsp import _Batch, _polish, _span

    cost = COSTS["gpt-7b/a100-40g-8x2"]
    lengths = sample_lengths("github", 12, 3, 8 * 1024)
    batch = _Batch(lengths, cost)
    wide = len(batch.degrees) - 1  # (degree 16)
    assert batch.degrees[wide] == 16 and lengths.sum() <= batch.cap[wide]
    poor = ([(16, list(range(12)))], _span(batch, [wide], [list(range(12))]))
    parts, total, improved, cut = _polish(batch, ([poor], poor[1]), lower=0.0, deadline=time.perf_counter() + 30)
    assert improved and not cut and total < poor[1]
    (groups, span), = parts
    assert sorted(i for _, m in groups for i in m) == list(range(12))
    assert sum(d for d, _ in groups) <= 16 and len(groups) > 1
    gdi = [int(np.searchsorted(batch.degrees, d)) for d, _ in groups]
    assert all(lengths[m].sum() <= batch.cap[g] for g, (_, m) in zip(gdi, groups))
    assert span == pytest.approx(_span(batch, gdi, [m for _, m in groups])) and total == pytest.approx(span)
    assert _polish(batch, ([poor], poor[1]), lower=poor[1], deadline=math.inf) == ([poor], poor[1], False, False)


def test_flexsp_mixes_degrees_on_a_long_tailed_batch():
    """The point of FlexSP: one micro-batch holds groups of different degrees."""
    cost = COSTS["gpt-7b/a100-40g-8x8"]
    lengths = np.array([60_000] + [3000] * 40 + [500] * 60)
    plan = make_plan("flexsp", lengths, cost, OPTIONS, baselines=BASELINES)
    validate(plan, lengths, cost)
    assert any(len({g.degree for g in mb.groups}) > 1 for mb in plan.micro_batches)
    for b in BASELINES:
        assert plan.baselines[b]["speedup"] >= 1 - REL
    assert plan.baselines["static_ulysses"]["speedup"] > 1.05


# Batches found by a random search where flexsp was slower than megatron-core's BalancedCPScheduler
# (adapted to our memory model) on the same cost model.
#
# 108 sequences of 6.8K-45K tokens (1.77M tokens, >= 24 micro-batches on 16 A100s): Megatron 56.28 s;
# flexsp as of commit cd23c8d 63.1 s at a 0.5 s time limit (56.7 s even at 8 s); fixed since.
HEAVY_16GPU_BATCH = [
    7553, 23689, 14260, 17032, 30530, 13358, 16086, 12625, 13284, 23365, 15377, 8633, 20273, 21998, 19573,
    20616, 15684, 25896, 14643, 10746, 29901, 10163, 18934, 12198, 20677, 12573, 16922, 19852, 12329, 35257,
    17015, 19887, 17266, 14714, 10069, 14397, 16325, 9528, 15259, 14032, 13134, 19937, 17791, 17041, 12873,
    10777, 11616, 11451, 12423, 19695, 9516, 18420, 17266, 18566, 17650, 10757, 13248, 16948, 18571, 10094,
    8792, 11405, 11609, 10106, 12587, 13616, 16740, 14720, 10145, 17471, 19576, 19362, 19349, 17498, 14934,
    15674, 14071, 16592, 28390, 10531, 11521, 21507, 19264, 13960, 10796, 11902, 17742, 26077, 26246, 11652,
    6787, 12719, 30207, 13433, 45001, 15068, 17998, 11474, 17777, 14750, 9904, 12846, 21160, 6879, 16839, 16943,
    19107, 22087
]
# 62 sequences for tiny on 4 CPU ranks: Megatron's balanced CP runs them faster in 3 micro-batches (the
# third holds 2 sequences) than flexsp in 2, also at a 4 s time limit; both above the lower bound.
TINY_CPU4_BATCH = [
    8403, 8379, 8377, 8346, 8402, 8362, 8421, 8421, 8405, 8371, 8409, 8396, 8403, 8351, 8444, 8420, 8394, 8411,
    8357, 8390, 8421, 8397, 8394, 8338, 8387, 8365, 8406, 8396, 8355, 8390, 8396, 8416, 8435, 8349, 8420, 8367,
    8412, 8360, 8367, 8418, 8408, 8366, 8406, 8367, 8372, 8391, 8374, 8349, 8410, 8386, 8366, 8375, 8356, 8402,
    8307, 8425, 8356, 8396, 8420, 8432, 8341, 8360
]


def test_flexsp_vs_megatron_balanced_cp_on_a_heavy_batch():
    cost = COSTS["gpt-7b/a100-40g-8x2"]
    # A generous clock: the planner's work is bounded by counts; the clock is a guard that a loaded
    # machine could trip, making this comparison depend on the machine.
    plan = make_plan("flexsp", HEAVY_16GPU_BATCH, cost, PlannerOptions(time_limit=30.0),
                     baselines=("megatron_balanced_cp",))
    validate(plan, HEAVY_16GPU_BATCH, cost)
    assert plan.baselines["megatron_balanced_cp"]["speedup"] >= 1 - REL


@pytest.mark.xfail(strict=True, reason="finding: flexsp's 2 micro-batches are slower than the megatron_balanced_cp "
                                       "baseline's 3 on this batch; remove this mark once they are not")
def test_flexsp_vs_megatron_balanced_cp_on_a_small_cpu_batch():
    cost = COSTS["tiny/cpu-4"]
    plan = make_plan("flexsp", TINY_CPU4_BATCH, cost, PlannerOptions(time_limit=1.0),
                     baselines=("megatron_balanced_cp",))
    validate(plan, TINY_CPU4_BATCH, cost)
    assert plan.baselines["megatron_balanced_cp"]["speedup"] >= 1 - REL


@pytest.mark.parametrize("latency_ms", [0.05, 5.0])
def test_flexsp_plans_with_all_to_all_latency(latency_ms):
    """A per-call all-to-all latency (what `profile` measures on CPU ranks) is paid once per group
    and micro-batch: plans stay valid, their estimate is the cost model's, static layouts are
    never faster, and when the latency dwarfs a short sequence's compute, no SP group is formed
    for short sequences alone (degree 1 pays no all-to-all)."""
    import dataclasses

    base = COSTS["gpt-7b/a100-40g-8x2"]
    cost = CostModel(base.model, dataclasses.replace(base.cluster, a2a_latency_ms={2: latency_ms}), base.zero_stage)
    rng = np.random.default_rng(3)
    lengths = np.clip(rng.lognormal(7.5, 1.3, 96).astype(np.int64), 16, cost.max_seq_len)
    plan = make_plan("flexsp", lengths, cost, OPTIONS, baselines=BASELINES)
    validate(plan, lengths, cost)
    assert plan.estimated_step_time_s == pytest.approx(_recomputed_step_ms(plan, lengths, cost) / 1e3, rel=1e-9)
    assert plan.lower_bound_step_time_s <= plan.estimated_step_time_s * (1 + REL)
    for b in NEVER_SLOWER_THAN:
        assert plan.estimated_step_time_s <= plan.baselines[b]["estimated_step_time_s"] * (1 + REL)
    if latency_ms >= 5.0:  # 8 x 32 calls x 5 ms = 1.3 s per group, more than any short sequence costs
        # so an SP group exists only for a sequence degree 1 cannot hold (short ones may ride along
        # as filler: the group pays its latency once, whatever it holds)
        sp_groups = [g for mb in plan.micro_batches for g in mb.groups if g.degree > 1]
        assert sp_groups and all(max(lengths[i] for i in g.seq_ids) > cost.token_capacity(1) for g in sp_groups)


def test_one_gpu_cluster_needs_no_link_table(tmp_path):
    """A single GPU (what scripts/gpu_smoke.sh writes for a one-GPU machine) has no all-to-all
    table: nothing crosses a link, so every planner plans and the links cost nothing."""
    from megatron_ext.planner.api import PLANNERS, make_plan, planner_names
    from small_cost import SMALL_MODEL

    (tmp_path / "one.yaml").write_text("num_nodes: 1\ngpus_per_node: 1\nmemory_gb: 80\n")
    cost = CostModel.from_presets(SMALL_MODEL, str(tmp_path / "one.yaml"))
    # (activations per token over what its output layer keeps, as a pipeline stage needs)
    cost = dataclasses.replace(cost, model=dataclasses.replace(cost.model, act_mb_per_token=0.5))
    assert cost.cluster.intra_node_gbps == cost.cluster.inter_node_gbps == float("inf")
    for name in planner_names():
        zero = 2 if PLANNERS[name].barrier_free else cost.zero_stage  # (barrier-free: ZeRO 0/1/2 only)
        plan = make_plan(name, [300, 120, 40], dataclasses.replace(cost, zero_stage=zero))
        assert plan.num_gpus == 1, name
