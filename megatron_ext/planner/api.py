"""Every planner by name, and the one entry point to them: lengths in, validated StepPlan out.

``PLANNERS`` maps each name to its ``Planner``: its kind, its planning function and a line of help
(what the command lines print). Kinds:

- ``"sp"``: FlexSP and its baselines (planner/sp/): micro-batches of sequence-parallel groups. The
  planning function returns ``(degree, seq_ids)`` groups per micro-batch (``sp.step.plan_sp``
  makes the plan).
- ``"pp"``: elastic pipelines and their baselines (planner/pp/): chunks through pipeline stages;
  the function returns the plan, simulated.
- ``"auto"``: per step, whichever of the two runs the batch fastest (planner/auto.py).

``make_plan`` owns what all planners share: input checks, dropping (or refusing) sequences over
the longest a planner can run (``max_seq_len``), and the comparison with baselines on the same
sequences.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.errors import ConfigError, InfeasibleError, LengthsError, MegatronExtError
from megatron_ext.plan import StepPlan
from megatron_ext.plan.validate import checked_batch_lengths
from megatron_ext.planner.auto import plan_auto, plan_units
from megatron_ext.planner.pp.elastic_pp import plan_elastic_pp
from megatron_ext.planner.pp.layouts import pipeline_layouts
from megatron_ext.planner.pp.pipeline import pipeline_cost, pipeline_options, resolve_layout
from megatron_ext.planner.pp.pipeline_baselines import BATCH_1F1B_SLICES, packed_limit, plan_batch_1f1b, plan_seq1f1b
from megatron_ext.planner.pp.sequence_limits import longest_sequence
from megatron_ext.planner.sp.baselines import balanced_cp_scheduler, batchada, megatron_balanced_cp, static_ulysses
from megatron_ext.planner.sp.flexsp import plan_flexsp
from megatron_ext.planner.sp.step import plan_sp
from megatron_ext.planner.sp.timelines import plan_timelines
from megatron_ext.sim.simulator import simulate

KINDS = ("sp", "pp", "auto")
PIPELINE_KINDS = ("pp", "auto")  # kinds whose plans may be pipelines (auto's, on the steps they are faster)


def _elastic_limit(pc, opts) -> int:
    return longest_sequence(pc, opts.granularity, opts.recompute)


@dataclass(frozen=True)
class Planner:
    """A planner: its kind and planning function, ``fn(lengths, cost, PlannerOptions) -> (groups
    per micro-batch, status)`` for kind "sp" (``sp.step.SPPlanFn``), ``fn(lengths, cost,
    options=, seq_ids=, **PipelineOptions overrides) -> StepPlan`` for kinds "pp" and "auto";
    ``plan`` calls either the same way."""

    name: str
    kind: str  # one of KINDS
    fn: Callable
    help: str  # one line, for the command lines
    barrier_free: bool = False  # kind "sp": ``fn`` returns GPU sets run without a barrier (``sp.step.plan_sp``)
    setup: Callable | None = None  # loads what ``fn`` needs, once, outside its planning time
    # kinds "pp" and "auto": the longest sequence a layout runs alone, ``limit(PipelineCost, PipelineOptions)``
    # (default: elastic_pp's, at its finest slicing)
    limit: Callable = _elastic_limit

    def plan(self, lengths: np.ndarray, cost: CostModel, options=None, *, seq_ids=None, **overrides) -> StepPlan:
        """Plan the sequences ``seq_ids`` of the batch (default: all; the others are reported as
        dropped). ``options``: a PlannerOptions or PipelineOptions; ``overrides``: PipelineOptions
        fields, for the pipeline planners (FlexSP-kind planners have none of them)."""
        if self.setup is not None:
            self.setup()
        if self.kind == "sp":
            return plan_sp(self.name, self.fn, lengths, cost, options, seq_ids=seq_ids, barrier_free=self.barrier_free)
        return self.fn(lengths, cost, options=options, seq_ids=seq_ids, **overrides)


PLANNERS: dict[str, Planner] = {p.name: p for p in (
    Planner("static_ulysses", "sp", static_ulysses,
            "DeepSpeed-Ulysses, one SP degree for every group: --static-degree, default the largest"),
    Planner("batchada", "sp", batchada, "BatchAda, the best single SP degree for each batch"),
    Planner("megatron_balanced_cp", "sp", megatron_balanced_cp,
            "megatron-core's BalancedCPScheduler, dynamic context parallelism", setup=balanced_cp_scheduler),
    Planner("flexsp", "sp", plan_flexsp, "FlexSP, SP groups of mixed degrees in each micro-batch, solved with HiGHS"),
    Planner("timelines", "sp", plan_timelines,
            "FlexSP without a barrier between micro-batches: GPU sets run their own passes back to back "
            "(ZeRO 0/1/2)", barrier_free=True),
    Planner("elastic_pp", "pp", plan_elastic_pp,
            "InfiniPipe's elastic pipelines: workload-balanced chunks, per-chunk recompute"),
    Planner("batch_1f1b", "pp", plan_batch_1f1b, "Megatron-style 1F1B pipeline over packed micro-batches",
            limit=lambda pc, opts: packed_limit(pc, opts, BATCH_1F1B_SLICES)),
    Planner("seq1f1b", "pp", plan_seq1f1b, "Seq1F1B, packed micro-batches cut into equal-compute slices",
            limit=lambda pc, opts: packed_limit(pc, opts, opts.seq1f1b_slices)),
    Planner("auto", "auto", plan_auto, "per step, the fastest of FlexSP and elastic pipelines on every layout"),
)}
BASELINES = ("static_ulysses", "batchada", "megatron_balanced_cp")  # what FlexSP-kind plans are compared with
PP_BASELINES = ("flexsp", "static_ulysses", "seq1f1b", "batch_1f1b")  # what pipeline plans are compared with


def planner_names(*kinds: str) -> tuple[str, ...]:
    """The planners of the given kinds (all without), in ``PLANNERS`` order."""
    return tuple(n for n, p in PLANNERS.items() if not kinds or p.kind in kinds)


def planners_help(*kinds: str) -> str:
    """Each planner of the given kinds (all without) with its line of help, for a command line."""
    return ", ".join(f"{n} ({PLANNERS[n].help})" for n in planner_names(*kinds))


def get_planner(name: str, kinds: tuple[str, ...] = KINDS) -> Planner:
    """The planner ``name`` among those of ``kinds``; an error naming the choices otherwise."""
    if name not in PLANNERS or PLANNERS[name].kind not in kinds:
        what = "planner" if "sp" in kinds else "pipeline planner"
        raise ConfigError(f"unknown {what} {name!r}; choose one of {', '.join(planner_names(*kinds))}")
    return PLANNERS[name]


def max_seq_len(name: str, cost: CostModel, options=None) -> int:
    """The longest sequence planner ``name`` can run: FlexSP-kind planners, the longest an SP group
    can hold; pipeline planners, the longest their layout holds alone cut as finely as they cut
    (``Planner.limit``: elastic_pp at its finest slicing, the packed baselines into their slices,
    ``pp.sequence_limits``); ``auto``, the longest either kind can run on any layout."""
    kind = PLANNERS[name].kind if name in PLANNERS else "sp"
    if kind == "sp":
        return _some_tokens(cost.max_seq_len, name, cost)
    opts = pipeline_options(options, {})
    layouts = (pipeline_layouts(cost, opts.pp, opts.sp, opts.memory_mb) if kind == "auto"
               else [resolve_layout(cost, opts.pp, opts.sp)])
    limits, err = [], None
    for pp, sp in layouts:
        try:
            limits.append(PLANNERS[name].limit(pipeline_cost(cost, pp, sp, opts), opts))
        except MegatronExtError as e:
            err = e
    if kind == "auto" and (opts.pp is None or opts.pp == 1) and opts.flexsp:
        try:
            limits.append((cost if opts.memory_mb is None else cost.with_memory(opts.memory_mb)).max_seq_len)
        except MegatronExtError as e:
            err = err or e
    if not limits:
        if err is None:  # auto with a pinned layout that does not exist: say why
            pipeline_cost(cost, opts.pp, opts.sp, opts)
        raise err or ConfigError(f"{name}: no pipeline layout fits {cost.model.name} on {cost.cluster.name}")
    return _some_tokens(max(limits), name, cost)


def group_limit(name: str, cost: CostModel, static_degree: int | None = None) -> int:
    """The longest sequence one group of a FlexSP-kind planner holds: static_ulysses's at its
    degree (``static_degree``, where given), any other's at the largest."""
    if name == "static_ulysses" and static_degree is not None:
        cost.check_degree(static_degree)
        return cost.token_capacity(static_degree)
    return cost.max_seq_len


def _some_tokens(limit: int, name: str, cost: CostModel) -> int:
    if limit < 1:  # (a batch drawn up to 0 tokens would never fill)
        raise InfeasibleError(f"{name}: {cost.model.name} on {cost.cluster.name} holds no sequence at all: one "
                              f"token's activations do not fit in the memory the model states leave")
    return limit


def make_plan(name: str, lengths, cost: CostModel, options=None, baselines: tuple[str, ...] = (), *,
              kinds: tuple[str, ...] = KINDS, **overrides) -> StepPlan:
    """Plan one step with planner ``name`` (one of ``kinds``); time each named baseline on the
    same sequences. ``options``: a PlannerOptions (default) or PipelineOptions; its
    ``max_seq_len`` (default: the longest the planner can run) bounds the sequences planned, and
    ``drop_over_max`` drops longer ones instead of refusing the batch. ``overrides``:
    PipelineOptions fields for the pipeline planners."""
    planner = get_planner(name, kinds)
    lengths = checked_batch_lengths(lengths)
    ids = _kept(planner, lengths, cost, options, overrides)
    plan = planner.plan(lengths, cost, options, seq_ids=ids, **overrides)
    if baselines:
        _compare(plan, planner, baselines, lengths, ids, cost, options, overrides)
    return plan


def _kept(planner: Planner, lengths: np.ndarray, cost: CostModel, options, overrides) -> np.ndarray:
    """The ids of the sequences to plan: all of them, or (``drop_over_max``) those within the
    limit; a batch with longer ones is refused otherwise."""
    drop = getattr(options, "drop_over_max", False)
    given = getattr(options, "max_seq_len", None)
    if planner.kind == "sp":  # (what a group can hold caps the limit given; dropping, static_ulysses's at its
        # degree: else its own error says which degree the longest needs)
        cap = group_limit(planner.name, cost, getattr(options, "static_degree", None)) if drop else cost.max_seq_len
        limit = cap if given is None else min(given, cap)
        too_long = lengths > limit
        if too_long.any() and not drop:
            try:
                cost.check_lengths(lengths)  # raises with the reason
            except InfeasibleError as e:
                raise InfeasibleError(f"{e} (--drop-over-max drops it)") from None
            raise LengthsError(f"{int(too_long.sum())} sequence(s) exceed the maximum length {limit} "
                               f"(longest {int(lengths.max())}); use --drop-over-max to drop them")
        if too_long.all():
            raise LengthsError(f"every sequence is over the {limit}-token limit: nothing left to plan")
        return np.flatnonzero(~too_long)
    limit = given
    if given is None or drop:  # (dropping: what the planner can run caps the limit given)
        own = max_seq_len(planner.name, cost, pipeline_options(options, overrides))
        limit = own if given is None else min(given, own)
    over = lengths > limit
    if not over.any():
        return np.arange(len(lengths))
    what = "the maximum length" if limit == given else f"the longest {planner.name} can run,"
    if not drop:
        raise LengthsError(f"{int(over.sum())} sequence(s) exceed {what} {limit} tokens "
                           f"(longest {int(lengths.max())}); use --drop-over-max to drop them")
    if over.all():
        raise LengthsError(f"every sequence exceeds {what} {limit} tokens: nothing left to plan")
    return np.flatnonzero(~over)


def _compare(plan: StepPlan, planner: Planner, baselines, lengths: np.ndarray, ids: np.ndarray, cost: CostModel,
             options, overrides) -> None:
    """Each baseline (a planner of any kind) on the sequences ``ids`` into ``plan.baselines``:
    its step time (a FlexSP-kind plan's cost-model estimate; a pipeline or auto plan's, the
    simulator's, the baselines' too), planning time, size and speedup; or why it cannot run."""
    pipelined = planner.kind != "sp"
    b1_scale = pipeline_options(options, overrides).b1_scale if pipelined else None
    ran = "flexsp" if planner.kind == "auto" and plan.kind == "flexsp" else planner.name  # what the plan is
    for b in baselines:
        if b in (planner.name, ran) or b in plan.baselines:  # (auto reports the alternatives it compared itself)
            continue
        try:
            base = get_planner(b)
            memory = pipeline_options(options, overrides).memory_mb if pipelined and base.kind == "sp" else None
            # (a FlexSP-kind baseline reads no PipelineOptions: the pipelines' budget is given it here)
            other = base.plan(lengths, cost if memory is None else cost.with_memory(memory), options, seq_ids=ids,
                              **overrides)
            step = (simulate(other, lengths, cost, b1_scale=b1_scale, events=False).step_time_s if pipelined
                    else other.estimated_step_time_s)
        except (MegatronExtError, ImportError) as e:  # a baseline that cannot run this batch
            plan.baselines[b] = {"error": _baseline_error(b, e, lengths[ids], cost, options)}
            continue
        plan.baselines[b] = {"estimated_step_time_s": step, "solve_time_s": other.solve_time_s, **plan_units(other),
                             "speedup": step / plan.estimated_step_time_s}
        if pipelined:
            plan.baselines[b]["status"] = other.solver_status


def _baseline_error(name: str, err: Exception, lengths: np.ndarray, cost: CostModel, options) -> str:
    """Why a baseline could not run the batch; when it is the batch's length, the limit that
    would make the comparison (the batch reaches the pipeline's limit, longer than others run)."""
    try:
        limit = max_seq_len(name, cost, options)
    except MegatronExtError:
        return str(err)
    if int(lengths.max()) <= limit:
        return str(err)
    return (f"it runs sequences of up to {limit:,} tokens, this batch's longest has {int(lengths.max()):,} "
            f"(to compare on a batch both can run, pass --max-seq-len {limit})")


__all__ = ["BASELINES", "KINDS", "PIPELINE_KINDS", "PLANNERS", "PP_BASELINES", "Planner",
           "get_planner", "group_limit", "make_plan", "max_seq_len", "planner_names", "planners_help"]
