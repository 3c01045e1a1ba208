"""A FlexSP-kind step plan from a planning function's groups.

A FlexSP-kind planning function (``flexsp``, ``static_ulysses``, ``batchada``,
``megatron_balanced_cp``) takes the lengths of the sequences to plan, the cost model and the
options, and returns its micro-batches as lists of ``(degree, seq_ids)`` groups plus a status
word; a barrier-free one (``timelines``) returns the degrees of its GPU sets and every pass
``(micro-batch, set, offset of its GPUs in the set, degree, seq_ids)`` instead. ``plan_sp`` turns
them into a StepPlan of the whole batch: groups (or sets) placed on aligned rank blocks, seq ids
mapped back to the batch, the others reported as dropped, cost estimates filled in and the plan
validated.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.errors import LengthsError
from megatron_ext.plan import MicroBatchPlan, SPGroup, StepPlan, fill_estimates, validate
from megatron_ext.planner.options import PlannerOptions, planner_options
from megatron_ext.planner.sp.placement import place_groups

# Seconds a sequence costs to place, time and check once the planning function returns (32,768
# sequences on 4,096 GPUs: 0.1 s, most of it the bounds), and what FlexSP's solve runs past its
# limit (10-25 ms there): kept from the function's time limit
CHECK_S_PER_SEQ = 4e-6

Groups = list[tuple[int, list[int]]]  # (degree, seq_ids) per group of one micro-batch
SPPlanFn = Callable[[np.ndarray, CostModel, PlannerOptions], tuple[list[Groups], str]]


def plan_sp(name: str, fn: SPPlanFn, lengths, cost: CostModel, options=None, *, seq_ids=None,
            barrier_free: bool = False) -> StepPlan:
    """Plan the sequences ``seq_ids`` of the batch (default: all) with FlexSP-kind planning
    function ``fn`` (named ``name`` in the plan); ``options`` may be any options object (its
    PlannerOptions fields are used; ``fn`` gets the time limit less ``CHECK_S_PER_SEQ`` a sequence, for
    what follows it). ``barrier_free``: ``fn`` returns GPU sets (module docstring)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ids = np.arange(len(lengths)) if seq_ids is None else np.asarray(seq_ids, dtype=np.int64)
    if ids.size == 0:
        raise LengthsError("the batch is empty: nothing to plan")
    cost.check_lengths(lengths[ids])  # (a sequence no group holds: the cost model says why)
    opts = planner_options(options)
    opts = dataclasses.replace(opts, time_limit=max(opts.time_limit / 2, opts.time_limit - CHECK_S_PER_SEQ * ids.size))
    start = time.perf_counter()
    micro_batches, status = fn(lengths[ids], cost, opts)
    solve_time = time.perf_counter() - start

    mbs = _set_passes(micro_batches, ids, cost) if barrier_free else [_placed(groups, ids, cost)
                                                                       for groups in micro_batches]
    plan = StepPlan(kind="flexsp", num_gpus=cost.num_gpus, planner=name, micro_batches=mbs,
                    solve_time_s=solve_time, solver_status=status, barrier_free=barrier_free,
                    dropped_seq_ids=[int(i) for i in np.setdiff1d(np.arange(len(lengths)), ids)])
    validate(fill_estimates(plan, lengths, cost), lengths, cost)
    return plan


def _placed(groups: Groups, ids: np.ndarray, cost: CostModel) -> MicroBatchPlan:
    """One micro-batch's groups on aligned rank blocks, in rank order."""
    ranks = place_groups([d for d, _ in groups], cost.num_gpus)
    return MicroBatchPlan([SPGroup(r, sorted(int(ids[i]) for i in members), ring=cost.ring_degree(len(r)))
                           for r, (_, members) in sorted(zip(ranks, groups), key=lambda x: x[0][0])])


def _set_passes(sets, ids: np.ndarray, cost: CostModel) -> list[MicroBatchPlan]:
    """The micro-batches of a barrier-free plan: GPU sets placed on aligned blocks once, each pass
    on its block of the set's GPUs, in the micro-batch the planner gave it."""
    degrees, passes = sets
    base = [r[0] for r in place_groups(degrees, cost.num_gpus)]
    mbs = [MicroBatchPlan([]) for _ in range(max((m for m, *_ in passes), default=-1) + 1)]
    for m, k, offset, d, members in passes:
        start = base[k] + offset
        mbs[m].groups.append(SPGroup(list(range(start, start + d)), sorted(int(ids[i]) for i in members),
                                     ring=cost.ring_degree(d)))
    for mb in mbs:
        mb.groups.sort(key=lambda g: g.ranks[0])
    return mbs


__all__ = ["CHECK_S_PER_SEQ", "Groups", "SPPlanFn", "plan_sp"]
