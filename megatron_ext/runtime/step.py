"""One training step's forward and backward on this rank: ``forward_backward(step, model, ...)``.

A planned ``Step`` (data/loader.py: the plan, the batch's token arrays and lengths) runs through
the executor of its plan's kind:

- ``flexsp``: ``runtime.schedule.forward_backward_flexsp`` -- megatron-core's own schedule over
  the plan's micro-batches, each rank feeding its shard of its SP group's packed tokens;
- ``elastic_pp``: ``runtime.pipeline.forward_backward_elastic`` -- the plan's pipelines on
  megatron's pipeline layout, each stage running its compiled program (plan/program.py).

``runtime/train.py`` and the Megatron-LM path (``megatron_ext/megatron/step.py``) both call it.
Both executors feed the model the same ``ModelInput`` (a micro-batch's or a chunk's shard) through
the same ``forward_step_func`` contract (megatron's: ``(data_iterator, model) -> (output,
loss_func)``, the iterator yielding one ModelInput, or None where a FlexSP rank idles in a
micro-batch); ``forward_step`` is the default: the GPTModel with labels and megatron's per-token
loss (``per_token_loss``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch

from megatron_ext.data.loader import Step
from megatron_ext.errors import InvalidPlanError


@dataclass
class ModelInput:
    """What one rank feeds the model for one micro-batch or pipeline chunk: its shard of the
    packed tokens (tensors [1, S/d]), labels with their loss mask, and the packed layout."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor  # next-token ids; 0 where the loss mask is 0
    loss_mask: torch.Tensor  # float: 1 for tokens that predict one, 0 at sequence ends and in padding
    packed_seq_params: object  # UlyssesPackedSeqParams
    degree: int = 1
    group: str = ""  # e.g. "SP group d4 ranks 0..3: seqs 5, 9" (names a micro-batch's NVTX range)


def per_token_loss(loss_mask: torch.Tensor, output: torch.Tensor):
    """Megatron's per-token loss contract: (sum of token losses, token count, reported values)."""
    losses = output.float() * loss_mask
    total = losses.sum()
    count = loss_mask.sum().to(torch.int)
    return total, count, {"lm loss": torch.stack([total.detach(), count.detach().float()])}


def idle_loss(output: torch.Tensor):
    """The loss of a pass that trains nothing (a rank idle in a micro-batch): zero, zero tokens."""
    zero = output.float().sum() * 0.0
    return zero, torch.zeros((), dtype=torch.int, device=zero.device), {"lm loss": torch.zeros(2, device=zero.device)}


def forward_step(data_iterator, model):
    """The default megatron ``forward_step_func`` of both executors: the GPTModel on one
    ``ModelInput`` with its labels, the per-token loss. None (a FlexSP rank with no sequence in
    the micro-batch): an empty pass that still joins the loss contract."""
    inp: Optional[ModelInput] = next(data_iterator)
    if inp is None:
        from megatron_ext.runtime.device import rank_device

        return torch.zeros((), requires_grad=True, device=rank_device()), idle_loss
    output = model(inp.tokens, inp.position_ids, None, labels=inp.labels, packed_seq_params=inp.packed_seq_params)
    return output, partial(per_token_loss, inp.loss_mask)


def forward_backward(step: Step, model, *, pool=None, pad_id: int = 0, forward_only: bool = False, device=None,
                     forward_step_func: Optional[Callable] = None, **megatron_kwargs):
    """Forward and backward of every micro-batch (FlexSP) or chunk (elastic pipelines) of
    ``step`` on this rank, by the kind of ``step.plan``. ``model``: this rank's (stage's) model,
    megatron-DDP wrapped; ``pool``: the ``SPGroupPool`` (FlexSP: every aligned group; pipelines:
    the replicas' SP groups, needed when the plan's SP degree is below a stage's data-parallel
    size); ``forward_step_func``: see the module doc (default ``forward_step``);
    ``megatron_kwargs``: passed on to megatron's forward_backward_func (FlexSP only; e.g.
    ``seq_length``). Returns (megatron's loss dicts, this rank's timings: ``StepTimes`` for
    FlexSP, ``PipelineStepStats`` for pipelines)."""
    kind = step.plan.kind
    if kind == "flexsp":
        from megatron_ext.runtime.schedule import forward_backward_flexsp

        if pool is None:
            raise ValueError("a FlexSP step needs the SP group pool (pool=SPGroupPool())")
        return forward_backward_flexsp(step, model, pool, pad_id, forward_only=forward_only, device=device,
                                       forward_step_func=forward_step_func, **megatron_kwargs)
    if kind == "elastic_pp":
        from megatron_ext.runtime.pipeline import forward_backward_elastic

        return forward_backward_elastic(step.plan, step.batch, model, pad_id=pad_id, forward_only=forward_only,
                                        device=device, forward_step_func=forward_step_func, sp_groups=pool)
    raise InvalidPlanError(f"unknown plan kind {kind!r}")


__all__ = ["ModelInput", "forward_backward", "forward_step", "idle_loss", "per_token_loss"]
