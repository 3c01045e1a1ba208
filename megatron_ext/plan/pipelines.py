"""Structural checks of elastic_pp plans (the part of validation that needs no simulation).

``validate(plan, ...)`` in schema.py checks that the pieces tile every kept sequence exactly once;
``validate_pipelines`` adds the pipeline layout and order rules below. Whether an order deadlocks
and whether memory fits at every moment is decided by the simulator (megatron_ext.sim), which
every planner runs on its plan.
"""
from __future__ import annotations

from numbers import Integral

from megatron_ext.cost import CostModel
from megatron_ext.errors import InvalidPlanError
from megatron_ext.plan.schema import StepPlan


def _int(v) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


def replica_groups(plan: StepPlan, num_gpus: int) -> list[list[int]]:
    """The plan's pipelines by data-parallel replica (``Pipeline.replica``), in plan order; a
    replica may run none. A layout of ``stages x sp_degree`` GPUs runs ``num_gpus / (stages x
    sp_degree)`` replicas side by side; pipelines of different layouts (one after another on
    every GPU) are allowed only without replicas."""
    layouts = {}
    for i, p in enumerate(plan.pipelines):
        if not (_int(p.stages) and _int(p.sp_degree)) or p.stages < 1 or p.sp_degree < 1:
            raise InvalidPlanError(f"pipeline {i}: stages and sp_degree must be positive integers")
        if not _int(p.replica) or p.replica < 0:
            raise InvalidPlanError(f"pipeline {i}: replica must be a non-negative integer, got {p.replica!r}")
        if num_gpus % (p.stages * p.sp_degree):
            raise InvalidPlanError(f"pipeline {i}: {p.stages} stages x SP {p.sp_degree} = {p.stages * p.sp_degree} "
                                   f"GPUs does not divide the cluster's {num_gpus}")
        layouts.setdefault((p.stages, p.sp_degree), i)
    R = {num_gpus // (a * b) for a, b in layouts}
    if len(layouts) > 1 and R != {1}:
        raise InvalidPlanError("pipelines of different layouts run one after another on every GPU: each needs "
                               f"stages x SP = {num_gpus} GPUs, got " + ", ".join(f"{a} x {b}" for a, b in layouts))
    R = R.pop() if R else 1
    for i, p in enumerate(plan.pipelines):
        if p.replica >= R:
            raise InvalidPlanError(f"pipeline {i}: replica {p.replica}, but {p.stages} stages x SP {p.sp_degree} on "
                                   f"{num_gpus} GPUs makes {R} replica{'s' if R > 1 else ''} (0..{R - 1})")
    return [[i for i, p in enumerate(plan.pipelines) if p.replica == r] for r in range(R)]


def validate_pipelines(plan: StepPlan, lengths, cost: CostModel) -> StepPlan:
    """Raise InvalidPlanError unless every pipeline of an elastic_pp plan is well formed:
    - ``stages`` divides the layers, ``sp_degree`` is an allowed Ulysses degree, stages x sp divides
      the GPUs and ``replica`` is one of the replicas that makes (``replica_groups``);
    - chunk ids are unique integers, every chunk has pieces within its sequence;
    - ``recompute_layers_per_stage`` is empty or one integer in [0, layers per stage] per stage;
    - ``order_per_stage`` has one list per stage naming each chunk's F and B exactly once, the F
      before the B;
    - a sequence's pieces stay in one pipeline."""
    if plan.kind != "elastic_pp":
        return plan
    if not plan.pipelines:
        raise InvalidPlanError("an elastic_pp plan needs at least one pipeline")
    L = cost.model.num_layers
    replica_groups(plan, cost.num_gpus)
    owner: dict[int, int] = {}
    for i, p in enumerate(plan.pipelines):
        where = f"pipeline {i}"
        if L % p.stages:
            raise InvalidPlanError(f"{where}: {p.stages} stages do not divide the {L} layers of {cost.model.name}")
        if p.sp_degree not in cost.degrees:
            raise InvalidPlanError(f"{where}: SP degree {p.sp_degree} is not allowed (allowed: "
                                   f"{', '.join(map(str, cost.degrees))})")
        if not p.chunks:
            raise InvalidPlanError(f"{where}: has no chunks")
        layers = L // p.stages
        ids = set()
        for c in p.chunks:
            if not _int(c.id) or c.id in ids:
                raise InvalidPlanError(f"{where}: chunk id {c.id!r} is not a unique integer")
            ids.add(c.id)
            if not c.pieces:
                raise InvalidPlanError(f"{where}, chunk {c.id}: has no pieces")
            for x in c.pieces:
                if not (_int(x.seq_id) and _int(x.start) and _int(x.end)):
                    raise InvalidPlanError(f"{where}, chunk {c.id}: piece seq_id, start and end must be integers")
                if not 0 <= x.seq_id < len(lengths) or not 0 <= x.start < x.end <= lengths[x.seq_id]:
                    raise InvalidPlanError(f"{where}, chunk {c.id}: piece {x.seq_id}[{x.start}:{x.end}] is outside "
                                           f"its sequence")
                if owner.setdefault(int(x.seq_id), i) != i:
                    raise InvalidPlanError(f"sequence {x.seq_id} has pieces in pipelines {owner[int(x.seq_id)]} and "
                                           f"{i}: a sequence must stay in one pipeline")
            r = c.recompute_layers_per_stage
            if r and (len(r) != p.stages or not all(_int(v) and 0 <= v <= layers for v in r)):
                raise InvalidPlanError(f"{where}, chunk {c.id}: recompute_layers_per_stage must be {p.stages} integers "
                                       f"in 0..{layers}, got {r!r:.60}")
        if len(p.order_per_stage) != p.stages:
            raise InvalidPlanError(f"{where}: order_per_stage has {len(p.order_per_stage)} lists for {p.stages} stages")
        want = {f"F{c}" for c in ids} | {f"B{c}" for c in ids}
        for s, order in enumerate(p.order_per_stage):
            if len(order) != len(want) or set(order) != want:
                missing = sorted(want - set(order))[:3]
                raise InvalidPlanError(f"{where}, stage {s}: the order must run each chunk's F and B exactly once"
                                       + (f" (missing {', '.join(missing)})" if missing else " (duplicates or unknown)"))
            pos = {op: j for j, op in enumerate(order)}
            for c in ids:
                if pos[f"B{c}"] < pos[f"F{c}"]:
                    raise InvalidPlanError(f"{where}, stage {s}: B{c} comes before F{c}")
    return plan
