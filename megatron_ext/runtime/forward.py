"""What one rank feeds the model for a micro-batch or a pipeline chunk, and the default forward step.

Both executors (``runtime/schedule.py`` for FlexSP, ``runtime/pipeline.py`` for elastic
pipelines) feed the model a ``ModelInput`` (a micro-batch's or a chunk's shard) through
megatron's ``forward_step_func`` contract: ``(data_iterator, model) -> (output, loss_func)``, the
iterator yielding one ModelInput, or None where a FlexSP rank idles in a micro-batch.
``forward_step`` is the default: the GPTModel with labels and megatron's per-token loss
(``per_token_loss``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch


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


__all__ = ["ModelInput", "forward_step", "idle_loss", "per_token_loss"]
