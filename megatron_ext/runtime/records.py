"""The step record: one JSON object per training step, the same for both writers, read by
``megatron-ext report``.

Two writers emit it: ``megatron-ext train --run-dir DIR`` (``DIR/steps.jsonl``; ``--json`` prints
the same records) and Megatron-LM's ``pretrain_gpt.py --flexsp`` / ``--elastic-pp`` with
``--planner-log FILE`` (``megatron/step.py``). ``step_record`` builds the keys they share:

- ``step``: the step's number (0 first); ``tokens``: the tokens it trained;
  ``longest_sequence``: its longest sequence, in tokens;
- ``step_time_s``: the measured step (slowest rank); ``predicted_step_time_s``: the plan's estimate;
- ``micro_batches``: a FlexSP plan's micro-batches, or a pipeline plan's chunks (every pipeline's);
- ``degrees``: the SP degrees the step used, largest first;
- ``planner``, ``kind`` (``flexsp`` or ``elastic_pp``: auto runs either), ``plan_source`` (where the
  plan came from: the planner, or a fallback when it was late);
- ``micro_batch_times_s`` / ``predicted_micro_batch_times_s``: each micro-batch measured (its
  slowest group's span, ``sim.trace.measured_micro_batch_s``) and predicted (FlexSP plans; empty
  for pipelines);
- pipeline plans only: ``stages`` (of each pipeline) and ``replicas`` (pipelines side by side).

Each writer adds what only it knows. ``train``: ``loss``, ``grad_norm``, ``model`` (the preset or
YAML, without --cost-model) and, for pipeline steps, each stage measured against the simulator
(``activation_room_mb``, ``activation_peak_mb_per_stage``, ``planned_activation_mb_per_stage``,
``forward_s_per_stage``, ``backward_s_per_stage``, ``p2p_wait_s_per_stage``,
``predicted_busy_s_per_stage``, ``ops_per_stage``). Megatron-LM: ``iteration``, ``mode``,
``solver_status``, ``solve_time_s``, ``plan_wait_s``, ``sequences``, ``dropped_seq_ids``,
``cost_model_error``, ``digest``, ``plan`` (the StepPlan), ``groups_by_degree`` (FlexSP steps),
``pipelines`` and ``measured_stage_busy_s`` (pipeline steps).
"""
from __future__ import annotations

from megatron_ext.plan.validate import replica_groups
from megatron_ext.sim.trace import measured_micro_batch_s


def step_record(plan, lengths, *, step: int, tokens: int, step_time_s: float, rank_micro_batch_s,
                plan_source: str) -> dict:
    """The keys every step record holds (the module doc) for a step of ``plan`` over a batch of
    ``lengths``, measured ``step_time_s`` and, for a FlexSP plan, every rank's seconds in each
    micro-batch (``rank_micro_batch_s``, see ``sim.trace.group_spans``; None for pipelines)."""
    degrees = sorted({g.degree for mb in plan.micro_batches for g in mb.groups} | {p.sp_degree for p in plan.pipelines},
                     reverse=True)
    rec = {
        "step": int(step), "tokens": int(tokens), "longest_sequence": int(max(lengths)) if len(lengths) else 0,
        "step_time_s": float(step_time_s), "predicted_step_time_s": float(plan.estimated_step_time_s),
        "micro_batches": len(plan.micro_batches) or sum(len(p.chunks) for p in plan.pipelines),
        "degrees": degrees, "planner": plan.planner, "kind": plan.kind, "plan_source": plan_source,
        "micro_batch_times_s": (measured_micro_batch_s(plan, rank_micro_batch_s) if rank_micro_batch_s is not None
                                else []),
        "predicted_micro_batch_times_s": [mb.estimated_time_s for mb in plan.micro_batches],
    }
    if plan.kind == "elastic_pp" and plan.pipelines:
        rec.update(stages=plan.pipelines[0].stages, replicas=len(replica_groups(plan, plan.num_gpus)))
    return rec
