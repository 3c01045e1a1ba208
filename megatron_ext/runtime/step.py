"""One training step's forward and backward on this rank: ``forward_backward(step, model, ...)``.

A planned ``Step`` (data/loader.py: the plan, the batch's token arrays and lengths) runs through
the executor of its plan's kind:

- ``flexsp``: ``runtime.schedule.forward_backward_flexsp`` -- megatron-core's own schedule over
  the plan's micro-batches, each rank feeding its shard of its SP group's packed tokens;
- ``elastic_pp``: ``runtime.pipeline.forward_backward_elastic`` -- the plan's pipelines on
  megatron's pipeline layout, each stage running its compiled program (plan/program.py).

``runtime/train.py`` and the Megatron-LM path (``megatron_ext/megatron/step.py``) both call it.
Both executors feed the model through the same ``forward_step_func`` contract
(``runtime/forward.py``).
"""
from __future__ import annotations

from typing import Callable, Optional

from megatron_ext.data.loader import Step
from megatron_ext.errors import InvalidPlanError
from megatron_ext.runtime.pipeline import forward_backward_elastic
from megatron_ext.runtime.schedule import forward_backward_flexsp


def forward_backward(step: Step, model, *, pool=None, pad_id: int = 0, forward_only: bool = False, device=None,
                     forward_step_func: Optional[Callable] = None, cost=None, **megatron_kwargs):
    """Forward and backward of every micro-batch (FlexSP) or chunk (elastic pipelines) of
    ``step`` on this rank, by the kind of ``step.plan``. ``model``: this rank's (stage's) model,
    megatron-DDP wrapped; ``pool``: the ``SPGroupPool`` (FlexSP: every aligned group; pipelines:
    the replicas' SP groups, needed when the plan's SP degree is below a stage's data-parallel
    size); ``forward_step_func``: see the module doc (default ``runtime.forward.forward_step``);
    ``cost``: the run's cost model (pipelines: their messages ordered by its times,
    ``sim.simulated_op_times``); ``megatron_kwargs``: passed on to megatron's forward_backward_func
    (FlexSP only; e.g. ``seq_length``). Returns (megatron's loss dicts, this rank's timings: ``StepTimes`` for
    FlexSP, ``PipelineStepStats`` for pipelines)."""
    kind = step.plan.kind
    if kind == "flexsp":
        if pool is None:
            raise ValueError("a FlexSP step needs the SP group pool (pool=SPGroupPool())")
        return forward_backward_flexsp(step, model, pool, pad_id, forward_only=forward_only, device=device,
                                       forward_step_func=forward_step_func, **megatron_kwargs)
    if kind == "elastic_pp":
        return forward_backward_elastic(step.plan, step.batch, model, pad_id=pad_id, forward_only=forward_only,
                                        device=device, forward_step_func=forward_step_func, sp_groups=pool,
                                        lengths=step.lengths, cost=cost)
    raise InvalidPlanError(f"unknown plan kind {kind!r}")


__all__ = ["forward_backward"]
