"""Each rank's part of a FlexSP plan: the pad rule, full coverage, positions and labels."""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from small_cost import small_cost
from megatron_ext.data.sharding import (IGNORE_INDEX, group_shards, num_loss_tokens, padded_buffer_length, rank_part,
                                        shard_bounds, shard_tokens)
from megatron_ext.errors import InvalidPlanError
from megatron_ext.plan import MicroBatchPlan, SPGroup, StepPlan
from megatron_ext.planner import PlannerOptions, make_plan

PAD = 257


def test_pad_rule():
    assert padded_buffer_length(0, 4) == 0
    assert padded_buffer_length(8, 4) == 8
    assert padded_buffer_length(9, 4) == 12
    assert padded_buffer_length(7, 1) == 7
    assert [shard_bounds(9, 4, p) for p in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    with pytest.raises(ValueError):
        padded_buffer_length(5, 0)
    with pytest.raises(ValueError):
        shard_bounds(5, 2, 2)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([1, 2, 4, 8, 16]))
def test_pad_rule_properties(n, d):
    padded = padded_buffer_length(n, d)
    assert padded % d == 0 and n <= padded < n + d
    bounds = [shard_bounds(n, d, p) for p in range(d)]
    assert bounds[0][0] == 0 and bounds[-1][1] == padded
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert len({e - s for s, e in bounds}) == 1


def _hand_plan():
    # 8 ranks; micro-batch 0: a degree-4 group and a degree-2 group (ranks 6, 7 idle);
    # micro-batch 1: one degree-8 group.
    return StepPlan(kind="flexsp", num_gpus=8, micro_batches=[
        MicroBatchPlan([SPGroup([0, 1, 2, 3], [0, 3]), SPGroup([4, 5], [1])]),
        MicroBatchPlan([SPGroup(list(range(8)), [2, 4])]),
    ])


def _batch(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(n)) for n in lengths]


def _check_coverage(plan, lengths, batch):
    """Across the ranks of each group, every token of every sequence is held exactly once, at its
    true position, with the next token of its own sequence as label; the rest is padding."""
    seen = {sid: np.zeros(int(lengths[sid]), dtype=np.int64) for g in
            (g for mb in plan.micro_batches for g in mb.groups) for sid in g.seq_ids}
    for m, mb in enumerate(plan.micro_batches):
        for g in mb.groups:
            total = int(sum(lengths[i] for i in g.seq_ids))
            pads = 0
            for r in g.ranks:
                shard = rank_part(plan, r, lengths)[m]
                assert shard.ranks == tuple(g.ranks) and shard.ranks[shard.position] == r
                assert shard.seq_ids == tuple(g.seq_ids)
                assert shard.pad == padded_buffer_length(total, len(g.ranks)) - total
                st_ = shard_tokens(shard, batch, PAD)
                assert len(st_.tokens) == shard.end - shard.start == padded_buffer_length(total, g.degree) // g.degree
                real = st_.seq_index >= 0
                assert real.sum() == shard.real_tokens
                pads += int((~real).sum())
                assert (st_.tokens[~real] == PAD).all() and (st_.labels[~real] == IGNORE_INDEX).all()
                for k in np.flatnonzero(real):
                    sid, pos = int(st_.seq_index[k]), int(st_.positions[k])
                    seen[sid][pos] += 1
                    assert st_.tokens[k] == batch[sid][pos]
                    want = batch[sid][pos + 1] if pos + 1 < lengths[sid] else IGNORE_INDEX
                    assert st_.labels[k] == want
            assert pads == padded_buffer_length(total, g.degree) - total
    for sid, counts in seen.items():
        assert (counts == 1).all(), f"sequence {sid} not covered exactly once"


def test_hand_plan_parts():
    lengths = np.array([5, 3, 10, 6, 1])
    plan, batch = _hand_plan(), _batch([5, 3, 10, 6, 1])
    _check_coverage(plan, lengths, batch)
    part6 = rank_part(plan, 6, lengths)
    assert part6[0] is None and part6[1].position == 6
    s = rank_part(plan, 2, lengths)[0]  # group [0..3] holds seqs 0 and 3: 11 tokens -> 12, shards of 3
    assert (s.start, s.end, s.pad, s.num_tokens) == (6, 9, 1, 11)
    assert s.cu_seqlens.tolist() == [0, 5, 11]
    assert len(group_shards(plan, lengths)[1][0]) == 8


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=40), st.sampled_from(["flexsp", "batchada",
                                                                                 "static_ulysses"]))
def test_planned_parts_cover_every_token(lengths, planner):
    cost = small_cost()
    lengths = np.array(lengths)
    plan = make_plan(planner, lengths, cost, PlannerOptions(time_limit=0.2))
    _check_coverage(plan, lengths, _batch(lengths, seed=len(lengths)))
    assert num_loss_tokens(lengths) == int((lengths - 1).sum())


def test_errors():
    plan = _hand_plan()
    lengths = np.array([5, 3, 10, 6, 1])
    with pytest.raises(InvalidPlanError, match="rank 8"):
        rank_part(plan, 8, lengths)
    with pytest.raises(InvalidPlanError, match="out of range"):
        rank_part(plan, 0, lengths[:3])
    with pytest.raises(InvalidPlanError, match="elastic_pp"):
        rank_part(StepPlan(kind="elastic_pp", num_gpus=8), 0, lengths)
    shard = rank_part(plan, 0, lengths)[0]
    with pytest.raises(InvalidPlanError, match="sequence 0 has 4 tokens"):
        shard_tokens(shard, _batch([4, 3, 10, 6, 1]), PAD)
    assert num_loss_tokens(lengths, dropped_seq_ids=[2]) == 4 + 2 + 5 + 0


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=30))
def test_ring_groups_cut_the_same_shards_and_know_their_ring_block(lengths):
    # one KV head: Ulysses degree 1, so every group of degree 2 or 4 is a ring (--max-ring 4)
    cost = small_cost()
    cost = dataclasses.replace(cost, model=dataclasses.replace(cost.model, num_query_groups=1)).with_max_ring(4)
    lengths = np.array(lengths)
    plan = make_plan("flexsp", lengths, cost, PlannerOptions(time_limit=0.2))
    _check_coverage(plan, lengths, _batch(lengths, seed=len(lengths)))
    for m, mb in enumerate(plan.micro_batches):
        for g in mb.groups:
            assert g.ring == g.degree and g.ulysses == 1
            for r in g.ranks:
                s = rank_part(plan, r, lengths)[m]
                assert (s.ring, s.ulysses, s.ring_position) == (g.ring, 1, s.position)
                assert s.block == (s.start, s.end)  # Ulysses 1: a rank's shard is its whole ring block


def test_ulysses_x_ring_shards_lie_in_their_ring_block():
    plan = StepPlan(kind="flexsp", num_gpus=8, micro_batches=[
        MicroBatchPlan([SPGroup(list(range(8)), [0, 1, 2], ring=2)])])
    lengths = np.array([30, 7, 9])  # 46 tokens -> 48: ring blocks [0, 24) and [24, 48), shards of 6
    for r in range(8):
        s = rank_part(plan, r, lengths)[0]
        assert (s.ulysses, s.ring_position, s.block) == (4, r // 4, (24 * (r // 4), 24 * (r // 4 + 1)))
        assert (s.start, s.end) == (6 * r, 6 * r + 6)
