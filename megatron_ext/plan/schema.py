"""The decisions of one training step, as data: StepPlan and its parts, and their JSON.

The JSON layout is the contract of DESIGN.md (keys may be added, never renamed). ``seq_ids``
index the batch's lengths in the order given. ``micro_batches`` holds FlexSP plans, ``pipelines``
elastic-pipeline plans. Checking a plan against a batch and a cluster is plan/validate.py's; an
elastic pipeline's per-stage programs are plan/program.py's.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from megatron_ext.errors import InvalidPlanError

VERSION = 1
KINDS = ("flexsp", "elastic_pp")


@dataclass
class SPGroup:
    """One Ulysses group: an aligned block of ranks and the sequences it packs."""

    ranks: list[int]
    seq_ids: list[int]
    estimated_time_s: float = 0.0
    # ring (context-parallel) degree r: the group is r rings of Ulysses subgroups of degree / r
    # ranks, Ulysses inner (ranks[i] holds ring block i // (degree / r)); 1: plain Ulysses
    ring: int = 1

    @property
    def degree(self) -> int:
        return len(self.ranks)

    @property
    def ulysses(self) -> int:
        return len(self.ranks) // self.ring


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
    # no plan of this kind is faster; barrier-free plans: CostModel.barrier_free_bound_ms (the others
    # assume a barrier between micro-batches)
    lower_bound_step_time_s: float = 0.0
    # FlexSP-kind plans: the bound of any degree per sequence (micro-batches with a barrier)
    relaxed_bound_step_time_s: float = 0.0
    solver_status: str = ""  # how the plan was found, e.g. "milp", "lp_rounded", "fallback"
    dropped_seq_ids: list[int] = field(default_factory=list)
    baselines: dict[str, dict] = field(default_factory=dict)
    # FlexSP plans: no barrier between micro-batches; a group starts when its own ranks are free,
    # so GPU sets run different numbers of passes back to back (ZeRO 0/1/2 only: ZeRO-3 gathers
    # parameters over every GPU in each pass). The step: the slowest rank, then the gradient sync.
    barrier_free: bool = False
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
