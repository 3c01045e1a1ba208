"""A StepPlan against a batch and a cluster: ``validate`` (is it safe to run?), ``validate_pipelines``
(the layout and order rules of elastic pipelines), ``replica_groups`` (which replica runs which
pipeline), ``group_starts_ms`` (when each group of a FlexSP plan runs) and ``fill_estimates`` (time a
FlexSP plan with the cost model).

``validate`` checks what every plan must satisfy (kind, GPU count, every kept sequence covered
exactly once; FlexSP groups aligned, within memory) and, for elastic_pp plans, the pipelines
(``validate_pipelines``): their layout, their chunks and their per-stage orders, parsed and checked
by plan/program.py's ``chunk_layouts`` and ``parse_order`` -- the same rules, with the same
messages, as the simulator and the pipeline runtime. Whether an order deadlocks and whether memory
fits at every moment is decided by the simulator (megatron_ext.sim), which every planner runs on
its plan.
"""
from __future__ import annotations

import itertools

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.errors import InvalidPlanError, LengthsError
from megatron_ext.plan.program import (BWD, FWD, check_one_pipeline_per_sequence, chunk_layouts, is_int, op_name,
                                       parse_order)
from megatron_ext.plan.schema import KINDS, StepPlan
from megatron_ext.spec import MAX_LENGTH, is_power_of_two


def checked_batch_lengths(lengths) -> np.ndarray:
    """The check of a batch a planner is given: a non-empty 1-D array of whole, positive lengths up
    to ``MAX_LENGTH`` (returned as int64), else LengthsError. Every planner entry point
    (``make_plan``, the pipeline builders) calls it. (Cast as they came, 1000.5 planned as 1,000,
    '100' as 100, NaN raised numpy's ValueError, a 2-D array was "empty".)"""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise LengthsError(f"a batch is a 1-D sequence of lengths, got an array of shape {arr.shape}")
    if arr.size == 0:
        raise LengthsError("the batch is empty: nothing to plan")
    if arr.dtype.kind not in "iuf":
        raise LengthsError(f"sequence lengths must be whole numbers, got {arr.dtype} values (e.g. {arr[0].item()!r})")
    bad = ~np.isfinite(arr) | (arr != np.floor(arr)) if arr.dtype.kind == "f" else np.zeros(arr.size, dtype=bool)
    bad |= (arr < 1) | (arr > MAX_LENGTH)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise LengthsError(f"sequence {i} has length {arr[i].item()!r}: lengths are whole numbers from 1 to {MAX_LENGTH:,}")
    return arr.astype(np.int64)


def _fail(msg: str) -> None:
    raise InvalidPlanError(msg)


def _check_ints(values, what: str) -> None:
    """Ids and ranks from JSON must be lists of integers (Python or numpy), not floats, bools or strings."""
    if not isinstance(values, list) or not all(is_int(v) for v in values):
        _fail(f"{what} must be a list of integers, got {values!r:.60}")


def _check_coverage(seen: list[int], num_seqs: int, dropped: list[int]) -> None:
    negative = [i for i in seen + dropped if i < 0]
    if negative:
        _fail(f"sequence id {negative[0]} does not exist (ids count from 0)")
    counts = np.bincount(np.asarray(seen + dropped, dtype=np.int64), minlength=num_seqs) if (seen or dropped) \
        else np.zeros(num_seqs, dtype=np.int64)
    if len(counts) > num_seqs:
        _fail(f"sequence id {len(counts) - 1} does not exist (the batch has {num_seqs} sequences)")
    if (counts == 0).any():
        _fail(f"sequence {int(np.flatnonzero(counts == 0)[0])} is missing from the plan")
    if (counts > 1).any():
        _fail(f"sequence {int(np.flatnonzero(counts > 1)[0])} appears more than once")


def validate(plan: StepPlan, lengths, cost: CostModel) -> StepPlan:
    """Raise InvalidPlanError unless the plan is well formed for this batch and cluster (the
    module doc); whether a pipeline order deadlocks or passes the memory budget at some moment
    is the simulator's to say (``sim.simulate``, which every planner runs on its plan)."""
    lengths = np.asarray(lengths)
    if plan.kind not in KINDS:
        _fail(f"unknown plan kind {plan.kind!r}")
    if not is_int(plan.num_gpus) or plan.num_gpus != cost.num_gpus:
        _fail(f"plan is for {plan.num_gpus} GPUs, the cluster has {cost.num_gpus}")
    _check_ints(plan.dropped_seq_ids, "dropped_seq_ids")
    if any(not 0 <= i < len(lengths) for i in plan.dropped_seq_ids):
        _fail("a dropped sequence id is out of range")
    if plan.barrier_free not in (False, True):
        _fail(f"barrier_free must be true or false, got {plan.barrier_free!r}")
    if plan.barrier_free and plan.kind != "flexsp":
        _fail(f"barrier_free applies to flexsp plans only, not to {plan.kind!r}")
    if plan.kind == "flexsp":
        _validate_flexsp(plan, lengths, cost)
    else:
        validate_pipelines(plan, lengths, cost)  # (each sequence's pieces tile it, in one pipeline)
        _check_coverage(list({x.seq_id for p in plan.pipelines for c in p.chunks for x in c.pieces}), len(lengths),
                        plan.dropped_seq_ids)
    return plan


def _validate_flexsp(plan: StepPlan, lengths: np.ndarray, cost: CostModel) -> None:
    n = cost.num_gpus
    if plan.barrier_free and cost.zero_stage == 3:
        _fail("a barrier-free plan needs ZeRO 0, 1 or 2: under ZeRO-3 every pass gathers parameters over every GPU")
    def where_of(m: int, g) -> str:
        return f"micro-batch {m}, group {g.ranks[:1]}..(degree {g.degree})"

    for m, mb in enumerate(plan.micro_batches):
        if not mb.groups:
            _fail(f"micro-batch {m} has no groups")
        used = np.zeros(n, dtype=bool)
        for g in mb.groups:
            _check_ints(g.ranks, f"micro-batch {m}: group ranks")
            _check_ints(g.seq_ids, f"micro-batch {m}: group seq_ids")
            where = where_of(m, g)
            d = g.degree
            if not is_power_of_two(d) or d not in cost.degrees:
                _fail(f"{where}: degree {d} is not allowed (powers of two up to {cost.degrees[-1]})")
            if g.ring != cost.ring_degree(d):
                _fail(f"{where}: ring degree {g.ring!r}, but a degree-{d} group is Ulysses "
                      f"{cost.ulysses_degree(d)} x ring {cost.ring_degree(d)} (Ulysses up to the head limit)")
            start = g.ranks[0]
            if g.ranks != list(range(start, start + d)) or start % d or start < 0 or start + d > n:
                _fail(f"{where}: ranks must be an aligned block [k*{d}, (k+1)*{d}) within {n} GPUs")
            if used[start:start + d].any():
                _fail(f"{where}: overlaps another group")
            used[start:start + d] = True
            if not g.seq_ids:
                _fail(f"{where}: has no sequences")
    # the groups' sequences and memory, all at once (one group at a time: 0.1 s for 19,000 groups)
    groups = [(m, g) for m, mb in enumerate(plan.micro_batches) for g in mb.groups]
    seen, owner = _members([g for _, g in groups])
    try:
        ids = np.array(seen, dtype=np.int64)
    except OverflowError:  # (an id past int64, from JSON: out of range whatever the batch)
        ids = np.array([i if -2**63 <= i < 2**63 else -1 for i in seen], dtype=np.int64)
    out = np.flatnonzero((ids < 0) | (ids >= len(lengths)))
    if out.size:
        _fail(f"{where_of(*groups[owner[out[0]]])}: sequence id out of range")
    tokens = np.bincount(owner, weights=lengths[ids].astype(np.float64), minlength=len(groups))
    mem = cost.group_memory_mb(tokens, np.array([g.degree for _, g in groups], dtype=np.float64))
    over = np.flatnonzero(mem > cost.cluster.memory_mb * (1 + 1e-9))
    if over.size:
        k = int(over[0])
        _fail(f"{where_of(*groups[k])}: needs {mem[k]:.0f} MB per GPU, over the {cost.cluster.memory_mb:.0f} MB budget")
    _check_coverage(seen, len(lengths), plan.dropped_seq_ids)


def _members(groups) -> tuple[list[int], np.ndarray]:
    """The groups' sequence ids one after another, and the index of the group each belongs to."""
    seen = list(itertools.chain.from_iterable(g.seq_ids for g in groups))
    return seen, np.repeat(np.arange(len(groups)), [len(g.seq_ids) for g in groups])


def replica_groups(plan: StepPlan, num_gpus: int) -> list[list[int]]:
    """The plan's pipelines by data-parallel replica (``Pipeline.replica``), in plan order; a
    replica may run none. A layout of ``stages x sp_degree`` GPUs runs ``num_gpus / (stages x
    sp_degree)`` replicas side by side; a plan has one layout (a run's stages are fixed, and its
    runtime builds one layout's SP groups a step)."""
    layouts = {}
    for i, p in enumerate(plan.pipelines):
        if not (is_int(p.stages) and is_int(p.sp_degree)) or p.stages < 1 or p.sp_degree < 1:
            raise InvalidPlanError(f"pipeline {i}: stages and sp_degree must be positive integers")
        if not is_int(p.replica) or p.replica < 0:
            raise InvalidPlanError(f"pipeline {i}: replica must be a non-negative integer, got {p.replica!r}")
        if num_gpus % (p.stages * p.sp_degree):
            raise InvalidPlanError(f"pipeline {i}: {p.stages} stages x SP {p.sp_degree} = {p.stages * p.sp_degree} "
                                   f"GPUs does not divide the cluster's {num_gpus}")
        layouts.setdefault((p.stages, p.sp_degree), i)
    if len(layouts) > 1:
        raise InvalidPlanError("a plan's pipelines share one layout (stages x SP), got different layouts: "
                               + ", ".join(f"{a} x {b}" for a, b in layouts))
    R = num_gpus // (plan.pipelines[0].stages * plan.pipelines[0].sp_degree) if layouts else 1
    for i, p in enumerate(plan.pipelines):
        if p.replica >= R:
            raise InvalidPlanError(f"pipeline {i}: replica {p.replica}, but {p.stages} stages x SP {p.sp_degree} on "
                                   f"{num_gpus} GPUs makes {R} replica{'s' if R > 1 else ''} (0..{R - 1})")
    return [[i for i, p in enumerate(plan.pipelines) if p.replica == r] for r in range(R)]


def validate_pipelines(plan: StepPlan, lengths, cost: CostModel) -> StepPlan:
    """Raise InvalidPlanError unless every pipeline of an elastic_pp plan is well formed:
    - ``stages`` divides the layers, ``sp_degree`` is an allowed Ulysses degree, stages x sp divides
      the GPUs and ``replica`` is one of the replicas that makes (``replica_groups``);
    - a sequence's pieces stay in one pipeline;
    - chunks: unique integer ids, pieces within their sequence tiling it, and
      ``recompute_layers_per_stage`` empty or one integer in [0, layers per stage] per stage
      (``program.chunk_layouts``);
    - ``order_per_stage`` has one list per stage naming each chunk's F and B exactly once
      (``program.parse_order``), the F before the B."""
    if plan.kind != "elastic_pp":
        return plan
    if not plan.pipelines:
        raise InvalidPlanError("an elastic_pp plan needs at least one pipeline")
    L = cost.model.num_layers
    replica_groups(plan, cost.num_gpus)
    check_one_pipeline_per_sequence(plan.pipelines)
    for i, p in enumerate(plan.pipelines):
        where = f"pipeline {i}"
        if L % p.stages:
            raise InvalidPlanError(f"{where}: {p.stages} stages do not divide the {L} layers of {cost.model.name}")
        if p.sp_degree not in cost.stage_degrees:
            raise InvalidPlanError(f"{where}: SP degree {p.sp_degree} is not allowed (a stage runs Ulysses only: "
                                   f"{', '.join(map(str, cost.stage_degrees))})")
        if not p.chunks:
            raise InvalidPlanError(f"{where}: has no chunks")
        ids = list(chunk_layouts(p, lengths, L // p.stages, where))
        for s, ops in enumerate(parse_order(p.order_per_stage, ids, p.stages, where)):
            forwarded = set()
            for kind, k in ops:
                if kind == FWD:
                    forwarded.add(k)
                elif k not in forwarded:
                    raise InvalidPlanError(f"{where}, stage {s}: {op_name(BWD, ids[k])} comes before "
                                           f"{op_name(FWD, ids[k])}")
    return plan


def group_starts_ms(plan: StepPlan, lengths, cost: CostModel) -> tuple[list[list[float]], list[list[float]], float]:
    """When each group of a FlexSP plan starts and how long it runs (ms, per micro-batch and group),
    and when the last one ends. With a barrier between micro-batches, every group of a micro-batch
    starts when the one before it has ended; without (``barrier_free``), a group starts when the
    last of its own ranks is free (a DAG: micro-batch order on each rank)."""
    lengths = np.asarray(lengths)
    # every group's time (``CostModel.group_time_ms``) at once: its fixed cost and its sequences'
    # times at its degree (19,000 groups of 32,768 sequences one by one: 0.16 s)
    groups = [g for mb in plan.micro_batches for g in mb.groups]
    seen, owner = _members(groups)
    ids = np.array(seen, dtype=np.int64)
    degree = np.array([g.degree for g in groups], dtype=np.int64)
    seq_ms = np.zeros(len(ids))
    group_ms = np.zeros(len(groups))
    for d in np.unique(degree).tolist():
        on = degree[owner] == d
        seq_ms[on] = cost.seq_time_ms(lengths[ids[on]], d)
        group_ms[degree == d] = cost.group_fixed_ms(d)
    group_ms = (group_ms + np.bincount(owner, weights=seq_ms, minlength=len(groups))).tolist()
    ready = np.zeros(cost.num_gpus)
    starts, times = [], []
    first = 0
    for mb in plan.micro_batches:
        ms = group_ms[first:first + len(mb.groups)]
        first += len(mb.groups)
        if plan.barrier_free:
            t0 = [float(ready[g.ranks].max()) for g in mb.groups]
            for g, t, d in zip(mb.groups, t0, ms):
                ready[g.ranks] = t + d
        else:
            t0 = [float(ready.max())] * len(mb.groups)
            ready[:] = t0[0] + max(ms, default=0.0)
        starts.append(t0)
        times.append(ms)
    return starts, times, float(ready.max())


def fill_estimates(plan: StepPlan, lengths, cost: CostModel) -> StepPlan:
    """Time every group, micro-batch and the step of a FlexSP plan with the cost model: the step is
    the last group's end (``group_starts_ms``) plus the exposed gradient sync (ZeRO 0/1/2), as the
    simulator has it; a micro-batch's time is its slowest group's. The bounds are reported with the
    same sync; a barrier-free plan's ``lower_bound_step_time_s`` is ``CostModel.barrier_free_bound_ms``
    (the micro-batch bounds assume a barrier between micro-batches, which it does not have)."""
    lengths = np.asarray(lengths)
    _, times, end = group_starts_ms(plan, lengths, cost)
    for mb, ms in zip(plan.micro_batches, times):
        for g, t in zip(mb.groups, ms):
            g.estimated_time_s = t / 1e3
        mb.estimated_time_s = max(ms, default=0.0) / 1e3
    sync = cost.step_sync_ms if plan.micro_batches else 0.0
    plan.estimated_step_time_s = (end + sync) / 1e3
    kept = np.delete(lengths, plan.dropped_seq_ids)
    lower = cost.barrier_free_bound_ms(kept) if plan.barrier_free else cost.lower_bound_ms(kept) + cost.step_sync_ms
    plan.lower_bound_step_time_s = lower / 1e3
    plan.relaxed_bound_step_time_s = (cost.relaxed_bound_ms(kept) + cost.step_sync_ms) / 1e3
    return plan
