"""Run a FlexSP step with megatron-core's own schedule.

A FlexSP plan changes *which ranks work together* per micro-batch, not the order of work on a
rank, so megatron's ``forward_backward_no_pipelining`` already is the right schedule: every rank
runs ``len(plan.micro_batches)`` forward/backward passes, then megatron's ``finalize_model_grads``
reduces gradients over the data-parallel domain. What FlexSP adds lives in the data iterator and
the forward step: each micro-batch hands the rank its shard of its SP group's packed tokens
(``data.sharding``) and a ``UlyssesPackedSeqParams`` naming the group, so the Ulysses attention
all-to-alls with exactly the ranks the plan grouped. A rank left out of a micro-batch runs an
empty pass (no tokens, no collective) so that every rank sees the same number of micro-batches.

Loss is per token (``calculate_per_token_loss``): each pass returns the sum of its shard's token
losses and its token count; megatron sums both over all ranks and divides the gradients once, so
any plan of the same batch gives the same loss and gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from megatron_ext.data.loader import Step
from megatron_ext.data.sharding import IGNORE_INDEX, shard_tokens
from megatron_ext.runtime.attention import UlyssesPackedSeqParams
from megatron_ext.runtime.device import rank_device
from megatron_ext.runtime.groups import SPGroupPool
from megatron_ext.runtime.timing import DeviceClock


@dataclass
class MicroBatchInput:
    """What one rank feeds the model for one micro-batch (tensors are [1, S/d])."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    packed_seq_params: UlyssesPackedSeqParams
    degree: int
    group: str  # e.g. "SP group d4 ranks 0..3: seqs 5, 9" (names its NVTX range)


@dataclass
class StepTimes:
    """Time this rank spent in each micro-batch's forward+backward: a mark on its device's clock at
    each micro-batch's start, read as seconds by ``finish`` (one synchronisation on a GPU); on a GPU
    an NVTX range per micro-batch too."""

    clock: DeviceClock = field(default_factory=DeviceClock)
    marks: list = field(default_factory=list)
    micro_batches: list[float] = field(default_factory=list)
    _range: object = None

    def start_micro_batch(self, what: str = "idle") -> None:
        """``what``: this rank's part of the micro-batch (its SP group), for the NVTX range."""
        self.clock.range_end(self._range)
        self._range = self.clock.range_start(f"micro-batch {len(self.marks)}: {what}")
        self.marks.append(self.clock.mark())

    def finish(self):
        """Close the last micro-batch (each ends where the next starts); returns the end mark."""
        end = self.clock.mark()
        self.clock.range_end(self._range)
        self._range = None
        self.micro_batches = self.clock.intervals(self.marks + [end])
        return end


def micro_batch_inputs(step: Step, pool: SPGroupPool, pad_id: int, device=None):
    """This rank's input for each micro-batch of ``step``, in order; None where it has no work."""
    device = rank_device() if device is None else device
    for shard in step.part(pool.rank):
        if shard is None:
            yield None
            continue
        params = UlyssesPackedSeqParams.build(shard.seq_lengths, pool.get(shard.ranks), device=device)
        st = shard_tokens(shard, step.batch, pad_id)
        labels = np.where(st.labels == IGNORE_INDEX, 0, st.labels)  # masked out below
        yield MicroBatchInput(
            tokens=torch.from_numpy(st.tokens)[None].to(device),
            position_ids=torch.from_numpy(st.positions)[None].to(device),
            labels=torch.from_numpy(labels)[None].to(device),
            loss_mask=torch.from_numpy(st.loss_mask.astype(np.float32))[None].to(device),
            packed_seq_params=params,
            degree=shard.degree,
            group=f"SP group d{shard.degree} ranks {shard.ranks[0]}..{shard.ranks[-1]}: seqs "
                  + ", ".join(map(str, shard.seq_ids)),
        )


def per_token_loss(loss_mask: torch.Tensor, output: torch.Tensor):
    """Megatron's per-token loss contract: (sum of token losses, token count, reported values)."""
    losses = output.float() * loss_mask
    total = losses.sum()
    count = loss_mask.sum().to(torch.int)
    return total, count, {"lm loss": torch.stack([total.detach(), count.detach().float()])}


def flexsp_forward_step(data_iterator, model, times: StepTimes | None = None):
    """megatron ``forward_step_func`` for FlexSP micro-batches (see module doc)."""
    mb = next(data_iterator)
    if times is not None:  # finished in forward_backward_flexsp
        times.start_micro_batch(mb.group if mb is not None else "idle")
    if mb is None:  # idle in this micro-batch: an empty pass that still joins the loss contract
        zero = torch.zeros((), requires_grad=True, device=rank_device())
        return zero, lambda out: (out, torch.zeros((), dtype=torch.int, device=out.device),
                                  {"lm loss": torch.zeros(2, device=out.device)})
    output = model(mb.tokens, mb.position_ids, None, labels=mb.labels, packed_seq_params=mb.packed_seq_params)
    return output, partial(per_token_loss, mb.loss_mask)


def forward_backward_flexsp(step: Step, model, pool: SPGroupPool, pad_id: int, *, forward_only: bool = False,
                            device=None) -> tuple[list[dict], StepTimes]:
    """Forward and backward of every micro-batch of ``step`` on this rank, through megatron's
    ``get_forward_backward_func()`` (pipeline parallel size 1). Returns megatron's per-micro-batch
    loss dicts and this rank's wall time per micro-batch."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = rank_device() if device is None else device
    times = StepTimes(DeviceClock(device))
    num = len(step.plan.micro_batches)
    losses = get_forward_backward_func()(
        forward_step_func=partial(flexsp_forward_step, times=times),
        data_iterator=iter(list(micro_batch_inputs(step, pool, pad_id, device))),
        model=[model],
        num_microbatches=num,
        seq_length=0,  # shapes come from the plan; unused without pipelining
        micro_batch_size=1,
        forward_only=forward_only,
    )
    times.finish()
    return losses, times
