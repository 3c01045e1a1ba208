"""The FlexSP executor: a FlexSP step with megatron-core's own schedule (``runtime.forward_backward``
dispatches FlexSP steps here).

A FlexSP plan changes *which ranks work together* per micro-batch, not the order of work on a
rank, so megatron's ``forward_backward_no_pipelining`` already is the right schedule: every rank
runs ``len(plan.micro_batches)`` forward/backward passes, then megatron's ``finalize_model_grads``
reduces gradients over the data-parallel domain. What FlexSP adds lives in the data iterator and
the forward step: each micro-batch hands the rank its shard of its SP group's packed tokens
(``data.sharding``) and a ``UlyssesPackedSeqParams`` naming the group, so the Ulysses attention
all-to-alls with exactly the ranks the plan grouped. A rank left out of a micro-batch runs an
empty pass (no tokens, no collective) so that every rank sees the same number of micro-batches.
Nothing synchronises ranks between micro-batches: a pass waits only on its own group's
all-to-alls, and the gradients are reduced once, after the last pass. So a barrier-free plan
(``StepPlan.barrier_free``: GPU sets running different numbers of passes back to back) runs as
it is: a set with fewer passes runs its empty passes at the end, then waits in the reduction.

Loss is per token (``calculate_per_token_loss``): each pass returns the sum of its shard's token
losses and its token count; megatron sums both over all ranks and divides the gradients once, so
any plan of the same batch gives the same loss and gradients. The model input, forward step and
loss are ``runtime/step.py``'s, shared with the elastic pipeline executor.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional

import torch

from megatron_ext.data.loader import Step
from megatron_ext.data.sharding import model_labels, shard_tokens
from megatron_ext.runtime.attention import UlyssesPackedSeqParams
from megatron_ext.runtime.device import host_to_device, rank_device
from megatron_ext.runtime.groups import SPGroupPool
from megatron_ext.runtime.forward import ModelInput, forward_step
from megatron_ext.runtime.timing import DeviceClock


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
    """This rank's ``ModelInput`` for each micro-batch of ``step``, in order; None where it has no work."""
    device = rank_device() if device is None else device
    for shard in step.part(pool.rank):
        if shard is None:
            yield None
            continue
        ulysses_group, ring_ranks = pool.ring_layout(shard.ranks, shard.ring)
        params = UlyssesPackedSeqParams.build(shard.seq_lengths, ulysses_group, ring_ranks=ring_ranks, device=device)
        st = shard_tokens(shard, step.batch, pad_id)
        labels, loss_mask = model_labels(st.labels)
        yield ModelInput(
            tokens=host_to_device(torch.from_numpy(st.tokens)[None], device),
            position_ids=host_to_device(torch.from_numpy(st.positions)[None], device),
            labels=host_to_device(torch.from_numpy(labels)[None], device),
            loss_mask=host_to_device(torch.from_numpy(loss_mask)[None], device),
            packed_seq_params=params,
            degree=shard.degree,
            group=f"SP group d{shard.degree}{f' (ring {shard.ring})' if shard.ring > 1 else ''} ranks "
                  f"{shard.ranks[0]}..{shard.ranks[-1]}: seqs "
                  + ", ".join(map(str, shard.seq_ids)),
        )


def _timed_forward_step(times: StepTimes, step_func: Callable, data_iterator, model, *rest):
    """Marks each micro-batch's start (and names its NVTX range), then runs ``step_func``."""
    mb = next(data_iterator)
    times.start_micro_batch(mb.group if mb is not None else "idle")
    return step_func(iter([mb]), model, *rest)


def forward_backward_flexsp(step: Step, model, pool: SPGroupPool, pad_id: int, *, forward_only: bool = False,
                            device=None, forward_step_func: Optional[Callable] = None,
                            **megatron_kwargs) -> tuple[list[dict], StepTimes]:
    """Forward and backward of every micro-batch of ``step`` on this rank, through megatron's
    ``get_forward_backward_func()`` (pipeline parallel size 1). ``forward_step_func(data_iterator,
    model)``: megatron's contract over ``ModelInput`` or None (an idle micro-batch), default
    ``runtime.forward.forward_step``; ``megatron_kwargs``: further keywords of megatron's function
    (``seq_length``: unused without pipelining; shapes come from the plan). Returns megatron's
    per-micro-batch loss dicts and this rank's wall time per micro-batch."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    if not get_model_config(model).calculate_per_token_loss:  # (else each micro-batch's mean: plan-dependent)
        raise ValueError("the FlexSP runtime needs calculate_per_token_loss=True (per-token loss normalisation "
                         "makes every plan give the same loss)")
    device = rank_device() if device is None else device
    times = StepTimes(DeviceClock(device))
    inputs = list(micro_batch_inputs(step, pool, pad_id, device))
    megatron_kwargs["seq_length"] = int(megatron_kwargs.get("seq_length") or 0)
    losses = get_forward_backward_func()(
        forward_step_func=partial(_timed_forward_step, times, forward_step_func or forward_step),
        data_iterator=iter(inputs),
        model=[model],
        num_microbatches=len(inputs),
        micro_batch_size=1,
        forward_only=forward_only,
        **megatron_kwargs,
    )
    times.finish()
    return losses, times
