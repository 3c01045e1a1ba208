"""Collectives of the runtime that autograd goes through.

``all_to_all`` is Ulysses' exchange (``runtime/attention.py``): an autograd function that captures
its group, so the backward (the inverse exchange) needs no context. The pipelines' point-to-point
messages are posted by ``runtime/pipeline.py`` itself (one ``batch_isend_irecv`` per program step).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _all_to_all(x: Tensor, group, scatter_dim: int, gather_dim: int) -> Tensor:
    """Split ``x`` into d chunks along scatter_dim, send chunk j to group rank j, and concatenate
    the chunks received along gather_dim in group-rank order."""
    d = dist.get_world_size(group)
    shape = list(x.shape)
    if shape[scatter_dim] % d:
        raise ValueError(f"all-to-all: dimension {scatter_dim} of size {shape[scatter_dim]} does not "
                         f"divide by the group size {d}")
    chunk = list(shape)
    chunk[scatter_dim] //= d
    split = shape[:scatter_dim] + [d, chunk[scatter_dim]] + shape[scatter_dim + 1:]
    send = x.reshape(split).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    out_shape = list(chunk)
    out_shape[gather_dim] *= d
    return recv.movedim(0, gather_dim).reshape(out_shape)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        # The inverse exchange: split what was gathered, send each piece back where it came from.
        return _all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(x: Tensor, group, scatter_dim: int, gather_dim: int) -> Tensor:
    """Autograd-aware all-to-all over ``group`` (identity for a group of one)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)
