"""The decisions of one training step, as data: StepPlan and its parts, JSON, validation.

The JSON layout is the contract of DESIGN.md (keys may be added, never renamed). ``seq_ids``
index the batch's lengths in the order given. ``micro_batches`` holds FlexSP plans, ``pipelines``
elastic-pipeline plans.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from numbers import Integral

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.errors import InvalidPlanError
from megatron_ext.spec import is_power_of_two

VERSION = 1
KINDS = ("flexsp", "elastic_pp")


@dataclass
class SPGroup:
    """One Ulysses group: an aligned block of ranks and the sequences it packs."""

    ranks: list[int]
    seq_ids: list[int]
    estimated_time_s: float = 0.0

    @property
    def degree(self) -> int:
        return len(self.ranks)


@dataclass
class MicroBatchPlan:
    groups: list[SPGroup]
    estimated_time_s: float = 0.0


@dataclass
class Piece:
    """Tokens [start, end) of one sequence."""

    seq_id: int
    start: int
    end: int


@dataclass
class Chunk:
    id: int
    pieces: list[Piece]
    recompute_layers_per_stage: list[int] = field(default_factory=list)


@dataclass
class Pipeline:
    stages: int
    sp_degree: int
    chunks: list[Chunk]
    order_per_stage: list[list[str]] = field(default_factory=list)
    # data-parallel replica that runs it: replicas run side by side on disjoint GPUs (replica r
    # on the r-th block of stages x sp_degree), a replica's pipelines one after another
    replica: int = 0


@dataclass
class StepPlan:
    kind: str
    num_gpus: int
    planner: str = ""
    micro_batches: list[MicroBatchPlan] = field(default_factory=list)
    pipelines: list[Pipeline] = field(default_factory=list)
    solve_time_s: float = 0.0
    estimated_step_time_s: float = 0.0
    lower_bound_step_time_s: float = 0.0
    solver_status: str = ""  # how the plan was found, e.g. "milp", "lp_rounded", "fallback"
    dropped_seq_ids: list[int] = field(default_factory=list)
    baselines: dict[str, dict] = field(default_factory=dict)
    version: int = VERSION

    # ---- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, d: dict) -> "StepPlan":
        try:
            if d.get("version") != VERSION:
                raise InvalidPlanError(f"plan version {d.get('version')!r} is not supported (expected {VERSION})")
            d = dict(d)
            d["micro_batches"] = [
                MicroBatchPlan([SPGroup(**g) for g in mb["groups"]], mb.get("estimated_time_s", 0.0))
                for mb in d.get("micro_batches", [])
            ]
            d["pipelines"] = [
                Pipeline(p["stages"], p["sp_degree"],
                         [Chunk(c["id"], [Piece(**x) for x in c["pieces"]], c.get("recompute_layers_per_stage", []))
                          for c in p["chunks"]],
                         p.get("order_per_stage", []), p.get("replica", 0))
                for p in d.get("pipelines", [])
            ]
            return cls(**d)
        except (KeyError, TypeError, AttributeError) as e:
            raise InvalidPlanError(f"malformed plan JSON: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> "StepPlan":
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise InvalidPlanError(f"plan is not valid JSON: {e}") from None


def fill_estimates(plan: StepPlan, lengths, cost: CostModel) -> StepPlan:
    """Time every group, micro-batch and the step of a FlexSP plan with the cost model."""
    lengths = np.asarray(lengths)
    total = 0.0
    for mb in plan.micro_batches:
        for g in mb.groups:
            g.estimated_time_s = cost.group_time_ms(lengths[g.seq_ids], g.degree) / 1e3
        mb.estimated_time_s = max((g.estimated_time_s for g in mb.groups), default=0.0)
        total += mb.estimated_time_s
    plan.estimated_step_time_s = total
    plan.lower_bound_step_time_s = cost.lower_bound_ms(np.delete(lengths, plan.dropped_seq_ids)) / 1e3
    return plan


def _fail(msg: str) -> None:
    raise InvalidPlanError(msg)


def _check_ints(values, what: str) -> None:
    """Ids and ranks from JSON must be lists of integers (Python or numpy), not floats, bools or strings."""
    if not isinstance(values, list) or not all(isinstance(v, Integral) and not isinstance(v, bool) for v in values):
        _fail(f"{what} must be a list of integers, got {values!r:.60}")


def _check_coverage(seen: list[int], num_seqs: int, dropped: list[int]) -> None:
    counts = np.bincount(np.asarray(seen + dropped, dtype=np.int64), minlength=num_seqs) if (seen or dropped) \
        else np.zeros(num_seqs, dtype=np.int64)
    if len(counts) > num_seqs:
        _fail(f"sequence id {len(counts) - 1} does not exist (the batch has {num_seqs} sequences)")
    if (counts == 0).any():
        _fail(f"sequence {int(np.flatnonzero(counts == 0)[0])} is missing from the plan")
    if (counts > 1).any():
        _fail(f"sequence {int(np.flatnonzero(counts > 1)[0])} appears more than once")


def validate(plan: StepPlan, lengths, cost: CostModel) -> StepPlan:
    """Raise InvalidPlanError unless the plan is safe to run on this batch and cluster."""
    lengths = np.asarray(lengths)
    if plan.kind not in KINDS:
        _fail(f"unknown plan kind {plan.kind!r}")
    if not isinstance(plan.num_gpus, Integral) or plan.num_gpus != cost.num_gpus:
        _fail(f"plan is for {plan.num_gpus} GPUs, the cluster has {cost.num_gpus}")
    _check_ints(plan.dropped_seq_ids, "dropped_seq_ids")
    if any(not 0 <= i < len(lengths) for i in plan.dropped_seq_ids):
        _fail("a dropped sequence id is out of range")
    if plan.kind == "flexsp":
        _validate_flexsp(plan, lengths, cost)
    else:
        from megatron_ext.plan.pipelines import validate_pipelines

        _validate_pieces(plan, lengths)
        validate_pipelines(plan, lengths, cost)
    return plan


def _validate_flexsp(plan: StepPlan, lengths: np.ndarray, cost: CostModel) -> None:
    n = cost.num_gpus
    seen: list[int] = []
    for m, mb in enumerate(plan.micro_batches):
        if not mb.groups:
            _fail(f"micro-batch {m} has no groups")
        used = np.zeros(n, dtype=bool)
        for g in mb.groups:
            _check_ints(g.ranks, f"micro-batch {m}: group ranks")
            _check_ints(g.seq_ids, f"micro-batch {m}: group seq_ids")
            where = f"micro-batch {m}, group {g.ranks[:1]}..(degree {g.degree})"
            d = g.degree
            if not is_power_of_two(d) or d not in cost.degrees:
                _fail(f"{where}: degree {d} is not allowed (powers of two up to {cost.degrees[-1]})")
            start = g.ranks[0]
            if g.ranks != list(range(start, start + d)) or start % d or start + d > n:
                _fail(f"{where}: ranks must be an aligned block [k*{d}, (k+1)*{d}) within {n} GPUs")
            if used[start:start + d].any():
                _fail(f"{where}: overlaps another group")
            used[start:start + d] = True
            if not g.seq_ids:
                _fail(f"{where}: has no sequences")
            if any(not 0 <= i < len(lengths) for i in g.seq_ids):
                _fail(f"{where}: sequence id out of range")
            mem = cost.group_memory_mb(float(lengths[g.seq_ids].sum()), d)
            if mem > cost.cluster.memory_mb * (1 + 1e-9):
                _fail(f"{where}: needs {mem:.0f} MB per GPU, over the {cost.cluster.memory_mb:.0f} MB budget")
            seen.extend(g.seq_ids)
    _check_coverage(seen, len(lengths), plan.dropped_seq_ids)


def _validate_pieces(plan: StepPlan, lengths: np.ndarray) -> None:
    """Every token of every kept sequence lies in exactly one piece."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for p in plan.pipelines:
        for c in p.chunks:
            for x in c.pieces:
                _check_ints([x.seq_id, x.start, x.end], f"chunk {c.id}: piece seq_id, start and end")
                spans.setdefault(x.seq_id, []).append((x.start, x.end))
    _check_coverage(list(spans), len(lengths), plan.dropped_seq_ids)
    for sid, s in spans.items():
        pos = 0
        for start, end in sorted(s):
            if start != pos or end <= start:
                _fail(f"sequence {sid}: pieces do not tile [0, {lengths[sid]}) (gap or overlap at {pos})")
            pos = end
        if pos != lengths[sid]:
            _fail(f"sequence {sid}: pieces end at {pos}, the sequence has {lengths[sid]} tokens")
