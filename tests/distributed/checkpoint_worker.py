"""Worker for test_checkpoint_states.py: 2 gloo ranks save a checkpoint (runtime/checkpoint.py),
move on (another optimizer step, more random draws), load it, and must be back where they saved:
the weights, Adam's moments and step count, and every rank's own random streams (Python, numpy,
torch, megatron's tracker), which the training losses cannot show (the model has no dropout)."""
from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dist_harness import Failures, check, preload_megatron, setup_megatron


def preload():
    preload_megatron("megatron_ext.runtime.checkpoint", "megatron_ext.runtime.pipeline", "megatron_ext.runtime.train")


def setup():
    setup_megatron()


def _train_step(model, optimizer, grad: float) -> None:
    for p in model.module.parameters():  # the same gradient on every rank, as DDP's reduction leaves it
        p.main_grad.fill_(grad)
    optimizer.step()


def _draws() -> list:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork():
        tracked = torch.rand(3)
    return [random.random(), float(np.random.rand()), torch.rand(3), tracked]


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    state = optimizer.state_dict()["state"]
    return [t.clone() for k in sorted(state) for _, t in sorted(state[k].items())]


@check
def load_restores_weights_optimizer_and_every_ranks_rng():
    from megatron_ext.cost import CostModel
    from megatron_ext.runtime.checkpoint import load_checkpoint, save_checkpoint
    from megatron_ext.runtime.pipeline_model import build_pipeline_model
    from megatron_ext.runtime.train import build_optimizer

    torch.manual_seed(0)  # the same weights on every rank, as training starts
    model, _ = build_pipeline_model(CostModel.from_presets("tiny", "cpu-4").model, 97, 64, "sdpa")
    optimizer = build_optimizer(model, lr=1e-2)
    rank = dist.get_rank()  # then a different random stream on each rank: each must get its own back
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(rank)
    _train_step(model, optimizer, 0.1)
    root = [tempfile.mkdtemp(prefix="ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root, src=0)
    if rank == 0:  # what a run killed while saving step 9 left: cleared by the next save
        (Path(root[0]) / ".iter_0000009.saving").mkdir()
    save_checkpoint(root[0], 3, model, optimizer, {})
    _train_step(model, optimizer, 0.2)  # then the same step saved again: the second save replaces the first whole
    save_checkpoint(root[0], 3, model, optimizer, {})
    weights = [p.detach().clone() for p in model.module.parameters()]
    moments = _optimizer_tensors(optimizer)
    draws = _draws()

    _train_step(model, optimizer, -0.3)  # weights, moments and random streams move on
    _draws()
    steps_done, _ = load_checkpoint(root[0], model, optimizer)

    f = Failures()
    f.true(steps_done == 3, f"steps done {steps_done}, saved 3")
    left = sorted(p.name for p in Path(root[0]).iterdir())
    f.true(left == ["iter_0000003", "latest_checkpointed_iteration.txt"], f"save folder holds {left}")
    for i, (p, w) in enumerate(zip(model.module.parameters(), weights)):
        f.close(p.detach(), w, f"weight {i}", rtol=0, atol=0)
    after = _optimizer_tensors(optimizer)
    f.true(len(after) == len(moments) > 0, f"{len(after)} optimizer tensors loaded, {len(moments)} saved")
    for i, (a, m) in enumerate(zip(after, moments)):
        f.close(a, m, f"optimizer tensor {i}", rtol=0, atol=0)
    for what, got, want in zip(("python", "numpy", "torch", "tracker"), _draws(), draws):
        f.close(torch.as_tensor(got), torch.as_tensor(want), f"{what} draw after loading", rtol=0, atol=0)
    dist.barrier()  # every rank has loaded
    if rank == 0:
        shutil.rmtree(root[0])
    f.raise_any()


@check
def a_stop_requested_on_one_rank_stops_every_rank():
    """(Last: the request stays for the rest of the process, as for the rest of a run.)"""
    from megatron_ext.runtime.checkpoint import request_stop, stop_requested_anywhere
    from megatron_ext.runtime.device import rank_device

    f = Failures()
    f.true(not stop_requested_anywhere(rank_device()), "a stop before any was requested")
    if dist.get_rank() == 1:
        request_stop()
    f.true(stop_requested_anywhere(rank_device()), "no stop after rank 1 requested one")
    f.raise_any()
