"""The entry point of every pipeline planner (elastic_pp, its baselines and auto): the pipeline
side of ``api.make_plan``."""
from __future__ import annotations

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.data.lengths import batch_lengths
from megatron_ext.errors import ConfigError, LengthsError, MegatronExtError
from megatron_ext.plan.schema import StepPlan
from megatron_ext.planner.api import plan_flexsp_kind
from megatron_ext.planner.auto import pipeline_layouts, plan_auto, plan_units
from megatron_ext.planner.elastic_pp import plan_elastic_pp
from megatron_ext.planner.pipeline import pipeline_cost, pipeline_options, resolve_layout
from megatron_ext.planner.pipeline_baselines import plan_batch_1f1b, plan_seq1f1b
from megatron_ext.planner.sequence_limits import longest_sequence
from megatron_ext.sim.simulator import simulate

PP_PLANNERS = {"elastic_pp": plan_elastic_pp, "batch_1f1b": plan_batch_1f1b, "seq1f1b": plan_seq1f1b,
               "auto": plan_auto}


def max_seq_len(name: str, cost: CostModel, options=None) -> int:
    """The longest sequence planner ``name`` can run: FlexSP-kind planners, the longest an SP group
    can hold; pipeline planners, the longest their layout holds alone at the finest slicing
    (``pipeline.longest_sequence``); ``auto``, the longest either kind can run on any layout."""
    if name not in PP_PLANNERS:
        return cost.max_seq_len
    opts = pipeline_options(options, {})
    layouts = (pipeline_layouts(cost, opts.pp, opts.sp, opts.memory_mb) if name == "auto"
               else [resolve_layout(cost, opts.pp, opts.sp)])
    limits, err = [], None
    for pp, sp in layouts:
        try:
            limits.append(longest_sequence(pipeline_cost(cost, pp, sp, opts), opts.granularity))
        except MegatronExtError as e:
            err = e
    if name == "auto" and (opts.pp is None or opts.pp == 1):
        try:
            limits.append(cost.max_seq_len)
        except MegatronExtError as e:
            err = err or e
    if not limits:
        if err is None:  # auto with a pinned layout that does not exist: say why
            pipeline_cost(cost, opts.pp, opts.sp, opts)
        raise err or ConfigError(f"{name}: no pipeline layout fits {cost.model.name} on {cost.cluster.name}")
    return max(limits)


def make_pp_plan(name: str, lengths, cost: CostModel, options=None, baselines: tuple[str, ...] = (),
                 **overrides) -> StepPlan:
    """The make_plan of pipeline planners: drop or refuse over-long sequences (over ``max_seq_len``
    of a PlannerOptions, or over what the planner can run: ``drop_over_max`` drops them), plan,
    and time each baseline (pipeline planners and FlexSP-kind planners alike) on the same batch."""
    if name not in PP_PLANNERS:
        raise ConfigError(f"unknown pipeline planner {name!r}; choose one of {', '.join(PP_PLANNERS)}")
    lengths = batch_lengths(lengths)
    drop = getattr(options, "drop_over_max", False)
    given = getattr(options, "max_seq_len", None)
    ids = np.arange(len(lengths))
    limit = given if given is not None else max_seq_len(name, cost, pipeline_options(options, overrides))
    over = lengths > limit
    if over.any():
        what = "the maximum length" if given is not None else f"the longest {name} can run,"
        if not drop:
            raise LengthsError(f"{int(over.sum())} sequence(s) exceed {what} {limit} tokens "
                               f"(longest {int(lengths.max())}); use --drop-over-max to drop them")
        ids = np.flatnonzero(~over)
        if not ids.size:
            raise LengthsError(f"every sequence exceeds {what} {limit} tokens: nothing left to plan")
    plan = PP_PLANNERS[name](lengths, cost, options=options, seq_ids=ids, **overrides)
    opts = pipeline_options(options, overrides)
    ran = "flexsp" if name == "auto" and plan.kind == "flexsp" else name  # what the plan is
    for b in baselines:
        if b in (name, ran) or b in plan.baselines:  # (auto reports the alternatives it compared itself)
            continue
        try:
            if b in PP_PLANNERS:
                other = PP_PLANNERS[b](lengths, cost, options=options, seq_ids=ids, **overrides)
            else:
                other = plan_flexsp_kind(b, lengths, ids, cost, options)
            step = simulate(other, lengths, cost, b1_scale=opts.b1_scale, events=False).step_time_s
            plan.baselines[b] = {"estimated_step_time_s": step, "solve_time_s": other.solve_time_s,
                                 **plan_units(other), "speedup": step / plan.estimated_step_time_s,
                                 "status": other.solver_status}
        except (MegatronExtError, ImportError) as e:  # a baseline that cannot run this batch
            plan.baselines[b] = {"error": _baseline_error(b, e, lengths[ids], cost, options)}
    return plan


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


__all__ = ["PP_PLANNERS", "make_pp_plan", "max_seq_len"]
