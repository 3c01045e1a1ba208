"""Ring attention across the Ulysses subgroups of a group with a ring (``SPGroup.ring`` r > 1).

A group of degree d = u x r cuts its padded buffer of S tokens into r contiguous ring blocks of
S/r tokens; ring block i is held by the Ulysses subgroup ``ranks[i*u:(i+1)*u]``, each of whose u
ranks holds S/d tokens of it (the same shard as a plain group of degree d). After the Ulysses
all-to-all inside the subgroup a rank holds all S/r tokens of its block for heads/u of the heads.
The r ranks with the same Ulysses position (``ranks[p % u::u]``) form a ring over those heads:

* Forward: r steps. At step t the rank holds the K/V of block (i - t) mod r and attends its own
  queries to it, per packed segment (a document, or the padding) with tokens in both blocks: its
  own block causally, an earlier block wholly (those keys precede every query), a later one not at
  all (causal). Each step's partial outputs and log-sum-exps merge into the running ones
  (``kernels.lse_merge``). The next block's K/V travel while the current one is attended.
* Backward (exact, from the saved output and log-sum-exp): the K/V go around again, this time
  with their dK/dV accumulators: each rank adds its queries' gradient for the block in hand and
  passes the block on; after r steps every accumulator is back with the block's owner.

The p2p messages go over the default group between global ranks (``dist.batch_isend_irecv``):
a ring needs no communicator of its own. The block work runs SDPA's fused kernels that return
log-sum-exps (``kernels.lse_kernels``: CPU flash attention, CUDA's memory-efficient kernel), for
every attention backend.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_ext.runtime.kernels import expand_kv, fold_kv, lse_kernels, lse_merge


def ring_pieces(bounds: Sequence[int], block: int, q_block: int, kv_block: int, causal: bool) -> list[tuple]:
    """What the queries of ring block ``q_block`` attend to in ring block ``kv_block`` (blocks of
    ``block`` tokens of a buffer whose segments are ``bounds``): per segment with tokens in both,
    ``(q_lo, q_hi, k_lo, k_hi, causal)`` in block coordinates. Causal: nothing in a later block,
    the own block causally, an earlier block wholly."""
    if causal and kv_block > q_block:
        return []
    q0, k0 = q_block * block, kv_block * block
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qa, qb, ka, kb = max(a, q0), min(b, q0 + block), max(a, k0), min(b, k0 + block)
        if qa < qb and ka < kb:
            pieces.append((qa - q0, qb - q0, ka - k0, kb - k0, causal and q_block == kv_block))
    return pieces


def _shift(tensors: list[Tensor], ring_ranks: Sequence[int], position: int):
    """Post sending ``tensors`` to the next rank of the ring and receiving their like from the
    previous one; returns (the receive buffers, the requests to wait on)."""
    r = len(ring_ranks)
    nxt, prev = ring_ranks[(position + 1) % r], ring_ranks[(position - 1) % r]
    received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt) for t in tensors] + [dist.P2POp(dist.irecv, t, prev) for t in received]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests) -> None:
    for req in requests:
        req.wait()


class _RingAttention(torch.autograd.Function):
    """q [1, hq, B, d], k/v [1, hk, B, d] (heads first, contiguous) of this rank's ring block ->
    its attention over the whole group buffer [1, hq, B, dv] (module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, bounds, ring_ranks, position, causal, scale, dropout_p, kernels):
        r, block, g = len(ring_ranks), q.shape[2], q.shape[1] // k.shape[1]
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape[:3] + (v.shape[3],), dtype=acc_dtype, device=q.device)
        lse = None
        kv, meta = (k, v), {}  # meta: (step, piece) -> (the kernel's rng state, its log-sum-exp length)
        for t in range(r):
            if t < r - 1:
                incoming, requests = _shift(list(kv), ring_ranks, position)
            pieces = ring_pieces(bounds, block, position, (position - t) % r, causal)
            for n, (qa, qb, ka, kb, c) in enumerate(pieces):
                o, l, rng = kernels[0](q[:, :, qa:qb], expand_kv(kv[0][:, :, ka:kb], g),
                                       expand_kv(kv[1][:, :, ka:kb], g), c, scale, dropout_p)
                meta[(t, n)] = (rng, l.shape[-1])
                if lse is None:
                    lse = torch.full(q.shape[:3], float("-inf"), dtype=l.dtype, device=q.device)
                if t == 0:  # the own block comes first and reaches every query: nothing to merge yet
                    out[:, :, qa:qb], lse[:, :, qa:qb] = o, l[..., :qb - qa]
                else:
                    out[:, :, qa:qb], lse[:, :, qa:qb] = lse_merge(out[:, :, qa:qb], lse[:, :, qa:qb], o.to(acc_dtype),
                                                                   l[..., :qb - qa])
            if t < r - 1:
                _wait(requests)
                kv = tuple(incoming)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (bounds, ring_ranks, position, causal, scale, dropout_p, kernels, meta)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        bounds, ring_ranks, position, causal, scale, dropout_p, kernels, meta = ctx.args
        r, block, hk = len(ring_ranks), q.shape[2], k.shape[1]
        g, grad = q.shape[1] // hk, grad.contiguous()
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        kv = (k, v)
        dkv = [torch.zeros(k.shape, dtype=acc_dtype, device=k.device), torch.zeros(v.shape, dtype=acc_dtype,
                                                                                   device=v.device)]
        for t in range(r):
            if t < r - 1:
                incoming, requests = _shift(list(kv), ring_ranks, position)
            pieces = ring_pieces(bounds, block, position, (position - t) % r, causal)
            for n, (qa, qb, ka, kb, c) in enumerate(pieces):
                rng, lse_len = meta[(t, n)]
                piece_lse = lse[:, :, qa:qb]
                if lse_len > qb - qa:  # the kernel's padding rows: +inf, no weight
                    piece_lse = torch.cat([piece_lse, piece_lse.new_full(piece_lse.shape[:2] + (lse_len - (qb - qa),),
                                                                         float("inf"))], dim=-1)
                dq_p, dk_p, dv_p = kernels[1](grad[:, :, qa:qb], q[:, :, qa:qb], expand_kv(kv[0][:, :, ka:kb], g),
                                              expand_kv(kv[1][:, :, ka:kb], g), out[:, :, qa:qb],
                                              piece_lse.contiguous(), rng, c, scale, dropout_p)
                dq[:, :, qa:qb] += dq_p
                dkv[0][:, :, ka:kb] += fold_kv(dk_p, hk)
                dkv[1][:, :, ka:kb] += fold_kv(dv_p, hk)
            if t < r - 1:
                _wait(requests)
                kv = tuple(incoming)
            # the block's gradient follows it; after the last step it reaches the block's owner
            dkv, requests = _shift(dkv, ring_ranks, position)
            _wait(requests)
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)) + (None,) * 7


def ring_attention(q: Tensor, k: Tensor, v: Tensor, params, causal: bool, scale: float,
                   dropout_p: float = 0.0) -> Tensor:
    """Attention of this rank's ring block over the whole group buffer: ``q`` [S/r, hq, dh] and
    ``k``/``v`` [S/r, hk, dh] (after the Ulysses all-to-all; token-major) -> [S/r, hq, dv].
    ``params``: the micro-batch's ``UlyssesPackedSeqParams`` (its segments, ring ranks and ring
    position)."""
    kernels = lse_kernels(q, dropout_p)
    if kernels is None:
        raise ValueError(f"ring attention needs a fused kernel with log-sum-exps, which takes none of {q.dtype} on "
                         f"{q.device.type} with dropout {dropout_p} and head_dim {q.shape[-1]} (CPU: no attention "
                         f"dropout; CUDA: head_dim a multiple of 8, bf16 from Ampere on)")
    heads_first = [t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v)]
    out = _RingAttention.apply(*heads_first, tuple(params.segment_bounds()), tuple(params.ring_ranks),
                               params.ring_rank, causal, scale, dropout_p, kernels)
    return out.squeeze(0).transpose(0, 1)
