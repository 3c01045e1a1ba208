"""One entry point for every planner: lengths in, validated StepPlan out.

A planner function takes the kept lengths (over-long ones already dropped or refused), the cost
model and the options, and returns its micro-batches as lists of ``(degree, seq_ids)`` groups plus a
status word. ``make_plan`` owns what all planners share: input checks, dropping, timing, placing
groups on aligned rank blocks, cost estimates, validation and baseline comparisons.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.data.lengths import batch_lengths
from megatron_ext.errors import ConfigError, LengthsError, MegatronExtError
from megatron_ext.plan import MicroBatchPlan, SPGroup, StepPlan, fill_estimates, validate
from megatron_ext.planner.placement import place_groups

Groups = list[tuple[int, list[int]]]  # (degree, seq_ids) per group of one micro-batch


@dataclass(frozen=True)
class PlannerOptions:
    time_limit: float = 1.0  # seconds the solver may spend on a step
    static_degree: int | None = None  # static_ulysses: the fixed degree (default: the largest)
    drop_over_max: bool = False  # drop (and report) sequences no group can hold, instead of failing
    max_seq_len: int | None = None  # longest sequence to plan (default and cap: the longest a group can hold)
    num_buckets: int = 16  # sequence-blaster buckets per micro-batch
    extra_microbatches: int = 4  # try M_min .. M_min + this many micro-batches
    search_budget: int = 48  # part solves the flexsp cut search may make: bounds work deterministically
    pp: int | None = None  # pipeline planners: stages (default: one per node)
    sp: int | None = None  # pipeline planners: Ulysses degree inside a stage (default: GPUs / pp)
    recompute: str = "ilp"  # elastic_pp: per-chunk recompute "ilp" | "greedy", or "auto" (none if it fits, else full)


PlannerFn = Callable[[np.ndarray, CostModel, PlannerOptions], tuple[list[Groups], str]]
PLANNERS: dict[str, PlannerFn] = {}
BASELINES = ("static_ulysses", "batchada", "megatron_balanced_cp")


def register(name: str) -> Callable[[PlannerFn], PlannerFn]:
    def deco(fn: PlannerFn) -> PlannerFn:
        PLANNERS[name] = fn
        return fn
    return deco


def make_plan(name: str, lengths, cost: CostModel, options: PlannerOptions = PlannerOptions(),
              baselines: tuple[str, ...] = ()) -> StepPlan:
    """Plan one step with planner ``name``; time each named baseline on the same batch."""
    from megatron_ext.planner.pipeline_api import PP_PLANNERS, make_pp_plan  # lazy: it imports this module

    if name in PP_PLANNERS:  # elastic pipelines: their own chunking, schedule and simulator timing
        return make_pp_plan(name, lengths, cost, options, baselines)
    if name not in PLANNERS:
        raise ConfigError(f"unknown planner {name!r}; choose one of {', '.join([*PLANNERS, *PP_PLANNERS])}")
    lengths = batch_lengths(lengths)
    limit = cost.max_seq_len if options.max_seq_len is None else min(options.max_seq_len, cost.max_seq_len)
    too_long = lengths > limit
    if too_long.any() and not options.drop_over_max:
        cost.check_lengths(lengths)  # raises with the reason
        raise LengthsError(f"{int(too_long.sum())} sequence(s) exceed the maximum length {limit} "
                           f"(longest {int(lengths.max())}); use --drop-over-max to drop them")
    kept = np.flatnonzero(~too_long)
    if kept.size == 0:
        raise LengthsError(f"every sequence is over the {limit}-token limit: nothing left to plan")

    start = time.perf_counter()
    micro_batches, status = PLANNERS[name](lengths[kept], cost, options)
    solve_time = time.perf_counter() - start

    mbs = []
    for groups in micro_batches:
        ranks = place_groups([d for d, _ in groups], cost.num_gpus)
        mbs.append(MicroBatchPlan([SPGroup(r, sorted(int(kept[i]) for i in ids))
                                   for r, (_, ids) in sorted(zip(ranks, groups), key=lambda x: x[0][0])]))
    plan = StepPlan(kind="flexsp", num_gpus=cost.num_gpus, planner=name, micro_batches=mbs,
                    solve_time_s=solve_time, solver_status=status,
                    dropped_seq_ids=[int(i) for i in np.flatnonzero(too_long)])
    validate(fill_estimates(plan, lengths, cost), lengths, cost)
    for b in baselines:
        if b == name:
            continue
        try:
            other = make_plan(b, lengths, cost, options)
        except MegatronExtError as e:  # e.g. a --static-degree too small for the batch: the row says why
            plan.baselines[b] = {"error": str(e)}
            continue
        plan.baselines[b] = {
            "estimated_step_time_s": other.estimated_step_time_s,
            "solve_time_s": other.solve_time_s,
            "num_micro_batches": len(other.micro_batches),
            "speedup": other.estimated_step_time_s / plan.estimated_step_time_s,
        }
    return plan


def plan_flexsp_kind(name: str, lengths: np.ndarray, ids: np.ndarray, cost: CostModel, options) -> StepPlan:
    """``make_plan`` of a FlexSP-kind planner (flexsp, static_ulysses, ...) on the sequences ``ids``
    of the batch (already kept by the caller), with seq ids mapped back to the batch; ``options``
    may be any options object (its PlannerOptions fields are used)."""
    fields = {f.name for f in dataclasses.fields(PlannerOptions)}
    kw = {k: getattr(options, k) for k in fields if options is not None and hasattr(options, k)}
    kw["drop_over_max"] = False
    kw["max_seq_len"] = None
    sub = make_plan(name, lengths[ids], cost, PlannerOptions(**kw))
    for mb in sub.micro_batches:
        for g in mb.groups:
            g.seq_ids = [int(ids[i]) for i in g.seq_ids]
    sub.dropped_seq_ids = [int(i) for i in np.setdiff1d(np.arange(len(lengths)), ids)]
    return sub


# Importing the planner modules fills PLANNERS.
from megatron_ext.planner import baselines as _baselines, flexsp as _flexsp  # noqa: E402,F401
