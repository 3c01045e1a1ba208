"""The entry point of every pipeline planner (elastic_pp, its baselines and auto): the pipeline
side of ``api.make_plan``."""
from __future__ import annotations

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.errors import ConfigError, LengthsError, MegatronExtError
from megatron_ext.plan.schema import StepPlan
from megatron_ext.planner.api import plan_flexsp_kind
from megatron_ext.planner.auto import plan_auto
from megatron_ext.planner.pipeline import pipeline_options, plan_elastic_pp
from megatron_ext.planner.pipeline_baselines import plan_batch_1f1b, plan_seq1f1b
from megatron_ext.sim.simulator import simulate

PP_PLANNERS = {"elastic_pp": plan_elastic_pp, "batch_1f1b": plan_batch_1f1b, "seq1f1b": plan_seq1f1b,
               "auto": plan_auto}



def make_pp_plan(name: str, lengths, cost: CostModel, options=None, baselines: tuple[str, ...] = (),
                 **overrides) -> StepPlan:
    """The make_plan of pipeline planners: drop or refuse over-long sequences (``max_seq_len`` /
    ``drop_over_max`` of a PlannerOptions), plan, and time each baseline (pipeline planners and
    FlexSP-kind planners alike) on the same batch."""
    if name not in PP_PLANNERS:
        raise ConfigError(f"unknown pipeline planner {name!r}; choose one of {', '.join(PP_PLANNERS)}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        raise LengthsError("the batch is empty: nothing to plan")
    max_len = getattr(options, "max_seq_len", None)
    ids = np.arange(len(lengths))
    if max_len is not None:
        over = lengths > max_len
        if over.any():
            if not getattr(options, "drop_over_max", False):
                raise LengthsError(f"{int(over.sum())} sequence(s) exceed the maximum length {max_len} "
                                   f"(longest {int(lengths.max())}); use --drop-over-max to drop them")
            ids = np.flatnonzero(~over)
    plan = PP_PLANNERS[name](lengths, cost, options=options, seq_ids=ids, **overrides)
    opts = pipeline_options(options, overrides)
    for b in baselines:
        if b == name or b in plan.baselines:  # (auto reports the alternatives it compared itself)
            continue
        try:
            if b in PP_PLANNERS:
                other = PP_PLANNERS[b](lengths, cost, options=options, seq_ids=ids, **overrides)
                units = sum(len(p.chunks) for p in other.pipelines)
            else:
                other = plan_flexsp_kind(b, lengths, ids, cost, options)
                units = len(other.micro_batches)
            step = simulate(other, lengths, cost, b1_scale=opts.b1_scale, events=False).step_time_s
            plan.baselines[b] = {"estimated_step_time_s": step, "solve_time_s": other.solve_time_s,
                                 "num_micro_batches": units, "speedup": step / plan.estimated_step_time_s,
                                 "status": other.solver_status}
        except (MegatronExtError, ImportError) as e:  # a baseline that cannot run this batch
            plan.baselines[b] = {"error": str(e)}
    return plan



__all__ = ["PP_PLANNERS", "make_pp_plan"]
