"""Ulysses (all-to-all) sequence-parallel core attention for megatron-core, over packed sequences.

How a FlexSP micro-batch runs on one rank
-----------------------------------------
A plan group of degree d packs its sequences end to end into one buffer of T tokens, padded to
``S = ceil(T / d) * d`` (times ``pad_to_multiple_of``). Group rank i (the i-th rank of the plan
group's ``ranks``) holds the contiguous shard ``[i*S/d, (i+1)*S/d)``; shards must be equal for the
all-to-all, hence the padding. Pad tokens form one extra segment at the end: they attend only to
each other (causally), no real token attends to them, and their loss mask is 0, so they change
neither the loss nor any gradient.

Per micro-batch the runtime builds one ``UlyssesPackedSeqParams`` (a megatron ``PackedSeqParams``
with ``qkv_format="sbhd"``, plus the SP group and the shard's true positions) and passes it as
``packed_seq_params`` to ``GPTModel.forward``; megatron hands it to every layer's core attention::

    pool = SPGroupPool()                                      # once, at start-up, on every rank
    model = GPTModel(config, get_gpt_layer_ulysses_spec(), vocab_size, max_sequence_length,
                     position_embedding_type="rope")
    use_true_positions_for_rope(model)                        # once, after building the model
    ...
    plan_group, group = pool.my_group(micro_batch_plan)       # per micro-batch
    params = UlyssesPackedSeqParams.build([len(s) for s in seqs], group)
    tokens = params.shard(torch.cat(seqs))[None]              # [1, S/d]
    labels = params.shard(torch.cat(seq_labels))[None]        # labels of real tokens, per sequence
    loss_mask = params.shard(torch.cat(seq_loss_masks)).float()  # pad tokens get 0
    out = model(tokens, params.position_ids[None], None, labels=labels, packed_seq_params=params)

Carrying the layout in ``packed_seq_params`` (rather than a global "current micro-batch") keeps it
correct under pipeline schedules (the backward of micro-batch k runs after the forward of k+1)
and under activation recomputation, which re-runs the layer forward with the same arguments.

Inside the core attention ("sbhd", b = 1): q, k, v ``[S/d, 1, heads, head_dim]`` -> one fused
all-to-all -> ``[S, 1, heads/d, head_dim]`` -> attention over the packed sequences with a
block-diagonal causal mask -> all-to-all back -> ``[S/d, 1, heads * head_dim]``. Heads and KV heads
(GQA) must divide by d. Degree 1 runs the same attention locally, without a collective. The
all-to-all is an autograd function that captures its group, so backward needs no context.

Backends, chosen per module with ``backend=``: ``"sdpa"`` (torch scaled_dot_product_attention with a
block-diagonal mask on CUDA up to a size, else one causal call per sequence, always on CPU, where
masked calls are slow; a mask, where one is needed, is rebuilt for the backward rather than kept,
so activations stay linear in tokens), ``"flash"`` (flash-attn ``flash_attn_varlen_func``) and ``"te"`` (Transformer Engine
``DotProductAttention`` in "thd" format); the last two need CUDA and are only imported when
chosen. ``"auto"`` picks flash, then TE, where installed and their kernels take the tensors (CUDA,
fp16/bf16, sm80+, head_dim a multiple of 8 up to 256), else SDPA; when TE itself finds no kernel
for the inputs (its cuDNN or GPU), ``"auto"`` runs SDPA instead. ``_resolve_backend`` is the one
place that decides.

RoPE must use each token's position inside its own sequence, not its place in the shard:
``use_true_positions_for_rope(model)`` makes GPTModel's RotaryEmbedding return, for a
``UlyssesPackedSeqParams`` micro-batch, the frequencies at ``params.position_ids`` (see
``rotary_pos_emb_at``). Learned absolute position embeddings get the same positions from the
``position_ids`` argument of GPTModel.forward.

Token-level slices (elastic pipelines): a packed entry may be the piece ``[start, start + n)`` of a
longer sequence (``UlyssesPackedSeqParams.build(..., starts=, keys=, continues=, prefix_cache=)``).
Its tokens sit at their true positions, it attends to the cached K/V of the sequence's earlier
pieces, and the gradient of that prefix is carried back to them (``runtime/slices.py``); without
those arguments nothing changes. Every backend runs slices: flash and TE over keys laid out
``[prefix; own]`` per sequence (``cu_seqlens_kv`` apart from ``cu_seqlens_q``) with the causal mask
aligned bottom-right (flash-attn >= 2.1's ``causal=True``; TE's ``"padding_causal_bottom_right"``),
SDPA without any slice x prefix mask (``prefix_sdpa``: the prefix and the slice's own keys as two
kernel calls merged by their log-sum-exps).

Without ``UlyssesPackedSeqParams`` the module still works: with megatron's own ``thd``
PackedSeqParams (``cu_seqlens_q``) it attends within each packed sequence locally, and with no
packed params it is plain causal (or ``attention_mask``-masked) attention per batch row, like
megatron's DotProductAttention.
"""
from __future__ import annotations

import copy
import functools
import importlib
import math
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_ext.runtime.backends import ATTENTION_BACKENDS, AUTO_ORDER


# The SDPA backend runs one masked [S, S] call per micro-batch up to this many elements, by device
# type, else one causal call per packed sequence. A masked kernel costs S^2 however short the
# sequences (the cost model's sum of s^2 is the per-sequence calls'); on CUDA it saves launches for
# many short sequences, on CPU the per-sequence calls are always faster (2-10x measured), so 0.
SDPA_DENSE_MASK_MAX_ELEMENTS = {"cuda": 1 << 22, "cpu": 0}


def dense_mask_fits(rows: int, cols: int, device) -> bool:
    return rows * cols <= SDPA_DENSE_MASK_MAX_ELEMENTS.get(torch.device(device).type, 0)


# dtypes the CPU flash-attention kernels (forward and backward) are used for here
_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


# ---- all-to-all ----------------------------------------------------------------------------------

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


# ---- the packed layout of one micro-batch ------------------------------------------------------

@dataclass
class UlyssesPackedSeqParams(PackedSeqParams):
    """The packed layout of one SP group's micro-batch, as seen by one rank of the group.

    Megatron fields: ``qkv_format="sbhd"`` (each rank's tensors are [S/d, b=1, ...]; megatron's
    attention must not squeeze them as "thd"), ``cu_seqlens_q/kv`` (int32 [n+1]) the real sequence
    boundaries in the group's packed buffer, ``cu_seqlens_q/kv_padded`` the same with the last
    boundary at S (the padding sits at the end of the buffer), ``max_seqlen_q/kv`` the longest
    sequence. Extra fields: the group (None for degree 1), this rank's index in it, and
    ``position_ids`` (int64 [S/d]): each local token's position within its own sequence.
    Build it with ``UlyssesPackedSeqParams.build``.
    """

    qkv_format: str = "sbhd"
    sp_group: Optional[dist.ProcessGroup] = None
    sp_degree: int = 1
    sp_rank: int = 0
    seq_lengths: tuple = ()
    num_tokens: int = 0  # real tokens of the group, T
    total_tokens: int = 0  # padded length of the group buffer, S
    position_ids: Optional[Tensor] = None  # [S/d], this rank's shard
    max_position_id: int = 0
    # Token-level slices (runtime/slices.py): per packed sequence, the position of its first token
    # in the whole sequence, a key naming the sequence, and whether later slices of it follow; the
    # cache that carries K/V and prefix gradients between slices. Empty / None: whole sequences.
    seq_starts: tuple = ()
    seq_keys: tuple = ()
    seq_continues: tuple = ()
    prefix_cache: Optional[object] = field(default=None, repr=False, compare=False)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, seq_lengths: Sequence[int], sp_group: Optional[dist.ProcessGroup] = None, *,
              pad_to_multiple_of: int = 1, device=None, starts: Optional[Sequence[int]] = None,
              keys: Optional[Sequence] = None, continues: Optional[Sequence[bool]] = None,
              prefix_cache=None) -> "UlyssesPackedSeqParams":
        """Layout of ``seq_lengths`` (the group's sequences in packing order) over ``sp_group``
        (this rank must be a member; None means degree 1). The buffer is padded to a multiple of
        ``degree * pad_to_multiple_of`` tokens. ``device``: where cu_seqlens and position_ids live
        (default CPU; use the GPU for the flash / TE backends).

        Token-level slices (a packed entry is the piece ``[start, start + length)`` of a longer
        sequence): ``starts`` (true position of each entry's first token), ``keys`` (a hashable per
        entry naming its sequence), ``continues`` (True where later pieces of the sequence follow)
        and ``prefix_cache`` (a ``slices.PrefixKVCache`` shared by all chunks of the step). Pieces
        with a start > 0 attend to the cached K/V of positions [0, start); continuing pieces cache
        their own K/V."""
        lengths = [int(n) for n in seq_lengths]
        if not lengths or min(lengths) < 1:
            raise ValueError(f"a packed micro-batch needs at least one sequence of length >= 1, got {lengths}")
        if pad_to_multiple_of < 1:
            raise ValueError("pad_to_multiple_of must be >= 1")
        starts = tuple(int(a) for a in starts) if starts is not None else ()
        continues = tuple(bool(c) for c in continues) if continues is not None else ()
        keys = tuple(keys) if keys is not None else ()
        for name, vals in (("starts", starts), ("keys", keys), ("continues", continues)):
            if vals and len(vals) != len(lengths):
                raise ValueError(f"{name} has {len(vals)} entries for {len(lengths)} packed sequences")
        if starts and min(starts) < 0:
            raise ValueError(f"starts must be >= 0, got {starts}")
        sliced = any(starts) or any(continues)
        if sliced and (prefix_cache is None or not keys):
            raise ValueError("pieces of split sequences (a start > 0 or continues=True) need keys and a prefix_cache")
        if sliced and len(set(keys)) != len(keys):
            raise ValueError(f"a packed micro-batch holds two pieces of one sequence: keys {keys}")
        d = 1 if sp_group is None else dist.get_world_size(sp_group)
        r = 0 if sp_group is None else dist.get_rank(sp_group)
        if r < 0:
            raise ValueError("this rank is not a member of the SP group it was given")
        real = sum(lengths)
        unit = d * pad_to_multiple_of
        total = -(-real // unit) * unit
        cu = torch.tensor([0] + list(_cumsum(lengths)), dtype=torch.int32, device=device)
        cu_padded = cu.clone()
        cu_padded[-1] = total
        shard = total // d
        start = r * shard
        positions = _positions(lengths, total, starts)[start:start + shard].to(device)
        ends = [a + n for a, n in zip(starts, lengths)] if starts else lengths
        return cls(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                   cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths),
                   sp_group=sp_group if d > 1 else None, sp_degree=d, sp_rank=r, seq_lengths=tuple(lengths),
                   num_tokens=real, total_tokens=total, position_ids=positions,
                   max_position_id=max(max(ends), total - real) - 1,
                   seq_starts=starts if sliced else (), seq_keys=keys, seq_continues=continues if sliced else (),
                   prefix_cache=prefix_cache if sliced else None)

    @property
    def sliced(self) -> bool:
        """Whether some packed sequence is a piece of a split sequence (prefix K/V in play)."""
        return self.prefix_cache is not None and (any(self.seq_starts) or any(self.seq_continues))

    # -- this rank's shard --
    @property
    def shard_len(self) -> int:
        return self.total_tokens // self.sp_degree

    @property
    def shard_range(self) -> tuple[int, int]:
        """[start, end) of this rank's tokens in the group's padded buffer."""
        return self.sp_rank * self.shard_len, (self.sp_rank + 1) * self.shard_len

    def shard(self, packed: Tensor, dim: int = 0, pad_value=0) -> Tensor:
        """This rank's slice of a group-wide packed tensor (T or S long along ``dim``): e.g.
        ``params.shard(torch.cat(token_seqs))`` -> [S/d]. Missing pad positions get pad_value."""
        n = packed.shape[dim]
        if n not in (self.num_tokens, self.total_tokens):
            raise ValueError(f"packed tensor has {n} tokens along dim {dim}; the group has "
                             f"{self.num_tokens} (padded {self.total_tokens})")
        start, end = self.shard_range
        if n < end:
            pad_shape = list(packed.shape)
            pad_shape[dim] = self.total_tokens - n
            packed = torch.cat([packed, packed.new_full(pad_shape, pad_value)], dim=dim)
        return packed.narrow(dim, start, end - start)

    @property
    def loss_mask(self) -> Tensor:
        """float [S/d]: 1 for real tokens, 0 for padding."""
        start, end = self.shard_range
        idx = torch.arange(start, end, device=self.position_ids.device)
        return (idx < self.num_tokens).float()

    # -- the group's whole buffer (after the all-to-all every rank sees all S tokens) --
    def segment_bounds(self) -> list[int]:
        """Boundaries of the segments attention runs within: the sequences, then the padding."""
        b = [0] + list(_cumsum(self.seq_lengths))
        if self.total_tokens > self.num_tokens:
            b.append(self.total_tokens)
        return b


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def _positions(lengths: Sequence[int], total: int, starts: Sequence[int] = ()) -> Tensor:
    """Position of each buffer token within its sequence (a piece starting at ``starts[i]``
    continues from there; padding counts from 0)."""
    pieces = [torch.arange(a, a + n) for a, n in zip(starts or [0] * len(lengths), lengths)]
    if total > sum(lengths):
        pieces.append(torch.arange(total - sum(lengths)))
    return torch.cat(pieces)


def _block_causal_mask(bounds: Sequence[int], causal: bool, device) -> Tensor:
    """bool [S, S], True where query i may attend key j: same segment (and j <= i if causal)."""
    sizes = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], device=device)
    seg = torch.repeat_interleave(torch.arange(len(sizes), device=device), sizes)
    mask = seg[:, None] == seg[None, :]
    if causal:
        mask = torch.tril(mask)  # within a diagonal block, tril is exactly the causal mask
    return mask


# ---- attention over packed segments --------------------------------------------------------------

class _MaskedFlashCPU(torch.autograd.Function):
    """CPU flash attention under a mask that is rebuilt for the backward instead of saved: what
    autograd keeps stays linear in the tokens (q, k, v, out, logsumexp) as on GPU kernels, where
    F.scaled_dot_product_attention would keep the [S, S_k] float mask of every layer."""

    @staticmethod
    def forward(ctx, q, k, v, make_mask, scale):
        groups = q.shape[1] // k.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, _expand_kv(k, groups), _expand_kv(v, groups), 0.0, False, attn_mask=_additive(make_mask(), q.dtype),
            scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.make_mask, ctx.scale, ctx.groups = make_mask, scale, groups
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        g = ctx.groups
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.contiguous(), q, _expand_kv(k, g), _expand_kv(v, g), out, lse, 0.0, False,
            attn_mask=_additive(ctx.make_mask(), q.dtype), scale=ctx.scale)
        return dq, _fold_kv(dk, k.shape[1]), _fold_kv(dv, v.shape[1]), None, None


def _expand_kv(t: Tensor, groups: int) -> Tensor:
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def _fold_kv(grad: Tensor, heads: int) -> Tensor:
    """The gradient of an expanded K/V summed back over the query heads each KV head served."""
    return grad.unflatten(1, (heads, grad.shape[1] // heads)).sum(2) if grad.shape[1] != heads else grad


# A slice's attention over its prefix (every key visible) and its own keys (causal), without a mask
# over the prefix: each part is one fused kernel call that also returns its log-sum-exps, and the
# two are merged by them. Kernels by device: CPU flash attention (no dropout) and, elsewhere, the
# memory-efficient kernel (CUDA; the meta device runs it for shapes only). Their log-sum-exps are
# float32 [b, h, s], padded on CUDA to a multiple of 32 rows with +inf (no weight in the backward).

def _cpu_flash_forward(q, k, v, causal, scale, dropout_p):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, None


def _cpu_flash_backward(grad, q, k, v, out, lse, rng, causal, scale, dropout_p):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal,
                                                                               scale=scale)


def _efficient_forward(q, k, v, causal, scale, dropout_p):
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p,
                                                                                    causal, scale=scale)
    return out, lse, (seed, offset)  # the backward regenerates the dropout mask from the seed


def _efficient_backward(grad, q, k, v, out, lse, rng, causal, scale, dropout_p):
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, None, out, lse, rng[0], rng[1], dropout_p, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def _lse_kernels(q: Tensor, dropout_p: float):
    """(forward, backward) of a fused kernel that takes ``q`` and returns log-sum-exps, or None."""
    if q.device.type == "cpu":
        return (_cpu_flash_forward, _cpu_flash_backward) if dropout_p == 0.0 and q.dtype in _CPU_FLASH_DTYPES else None
    if q.dtype in (torch.float16, torch.bfloat16, torch.float32) and q.shape[-1] % 8 == 0:
        return _efficient_forward, _efficient_backward
    return None


class _PrefixAttention(torch.autograd.Function):
    """q [1, hq, s, d] over its prefix's K/V (all visible) and its own K/V [1, hk, ., d] (causal or
    not) as two kernel calls merged by their log-sum-exps. The backward runs each part's kernel
    backward against the merged output and log-sum-exp, which gives exactly that part's gradient
    (the probabilities are those of the union). Saved: q, the K/V, the output and the log-sum-exps."""

    @staticmethod
    def forward(ctx, q, kp, vp, ko, vo, causal, scale, dropout_p, kernels):
        g, s = q.shape[1] // kp.shape[1], q.shape[2]
        forward_kernel = kernels[0]
        o1, l1, rng1 = forward_kernel(q, _expand_kv(kp, g), _expand_kv(vp, g), False, scale, dropout_p)
        o2, l2, rng2 = forward_kernel(q, _expand_kv(ko, g), _expand_kv(vo, g), causal, scale, dropout_p)
        lse = torch.logaddexp(l1, l2)
        w1, w2 = (torch.exp(l[..., :s] - lse[..., :s]).unsqueeze(-1) for l in (l1, l2))
        out = (o1 * w1 + o2 * w2).to(q.dtype)
        ctx.save_for_backward(q, kp, vp, ko, vo, out, lse)
        ctx.causal, ctx.scale, ctx.dropout_p, ctx.kernels, ctx.rng = causal, scale, dropout_p, kernels, (rng1, rng2)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, kp, vp, ko, vo, out, lse = ctx.saved_tensors
        g, hk, grad = q.shape[1] // kp.shape[1], kp.shape[1], grad.contiguous()
        backward_kernel, p = ctx.kernels[1], ctx.dropout_p
        dq1, dkp, dvp = backward_kernel(grad, q, _expand_kv(kp, g), _expand_kv(vp, g), out, lse, ctx.rng[0], False,
                                        ctx.scale, p)
        dq2, dko, dvo = backward_kernel(grad, q, _expand_kv(ko, g), _expand_kv(vo, g), out, lse, ctx.rng[1],
                                        ctx.causal, ctx.scale, p)
        return (dq1 + dq2, _fold_kv(dkp, hk), _fold_kv(dvp, hk), _fold_kv(dko, hk), _fold_kv(dvo, hk),
                None, None, None, None)


def _prefix_attention_unfused(q, kp, vp, ko, vo, causal: bool, scale: float, dropout_p: float) -> Tensor:
    """The same attention with explicit scores, for inputs no fused kernel above takes (dropout on
    CPU, float64 on CUDA, ...): like any unfused attention it holds slice x (prefix + slice) scores
    per head; the only mask is the slice's own [s, s] triangle."""
    g, s, c = q.shape[1] // kp.shape[1], q.shape[2], kp.shape[2]
    prefix_scores = torch.matmul(q, _expand_kv(kp, g).transpose(-1, -2)) * scale
    own_scores = torch.matmul(q, _expand_kv(ko, g).transpose(-1, -2)) * scale
    if causal:
        own_scores = own_scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)  # at least fp32 for half inputs
    probs = torch.softmax(torch.cat([prefix_scores, own_scores], -1), -1, dtype=softmax_dtype).to(q.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs[..., :c], _expand_kv(vp, g)) + torch.matmul(probs[..., c:], _expand_kv(vo, g))


def prefix_sdpa(q: Tensor, kp: Tensor, vp: Tensor, ko: Tensor, vo: Tensor, causal: bool, scale: float,
                dropout_p: float = 0.0) -> Tensor:
    """Attention of a slice at its true positions: ``q`` [1, hq, s, d] over its prefix's K/V
    ``kp``/``vp`` [1, hk, c, d] (all visible) and its own ``ko``/``vo`` [1, hk, s, d] (up to each
    query when ``causal``). No [s, c] mask is built and nothing of that size is kept for the backward."""
    kernels = _lse_kernels(q, dropout_p)
    if kernels is None:
        return _prefix_attention_unfused(q, kp, vp, ko, vo, causal, scale, dropout_p)
    return _PrefixAttention.apply(q, kp, vp, ko, vo, causal, scale, dropout_p, kernels)


def _additive(mask: Tensor, dtype) -> Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def masked_sdpa(qb: Tensor, kb: Tensor, vb: Tensor, make_mask, scale: float, dropout_p: float) -> Tensor:
    """Attention of ``qb`` [1, hq, S, d] over ``kb``/``vb`` [1, hk, S_k, d] where ``make_mask()``
    (bool [S, S_k], True = may attend) allows; GQA when hk < hq. On CPU without dropout the mask
    is not kept for the backward (``_MaskedFlashCPU``)."""
    if qb.device.type == "cpu" and dropout_p == 0.0 and qb.dtype in _CPU_FLASH_DTYPES:
        return _MaskedFlashCPU.apply(qb, kb, vb, make_mask, scale)
    return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=make_mask(), dropout_p=dropout_p, scale=scale,
                                          enable_gqa=qb.shape[1] != kb.shape[1])


def sdpa_packed(q: Tensor, k: Tensor, v: Tensor, bounds: Sequence[int], causal: bool, scale: float,
                dropout_p: float) -> Tensor:
    """q [S, hq, dh], k/v [S, hk, dh] -> [S, hq, dh], attention within each segment."""
    S = q.shape[0]
    gqa = q.shape[1] != k.shape[1]
    qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, h, S, dh]
    if len(bounds) == 2:
        o = F.scaled_dot_product_attention(qb, kb, vb, dropout_p=dropout_p, is_causal=causal, scale=scale,
                                           enable_gqa=gqa)
    elif dense_mask_fits(S, S, q.device):
        o = masked_sdpa(qb, kb, vb, functools.partial(_block_causal_mask, tuple(bounds), causal, q.device), scale,
                        dropout_p)
    else:
        o = torch.cat([F.scaled_dot_product_attention(qb[:, :, a:b], kb[:, :, a:b], vb[:, :, a:b],
                                                      dropout_p=dropout_p, is_causal=causal, scale=scale,
                                                      enable_gqa=gqa)
                       for a, b in zip(bounds[:-1], bounds[1:])], dim=2)
    return o.squeeze(0).transpose(0, 1)


@functools.lru_cache(maxsize=None)
def _optional(module: str):
    """An optional GPU package's module, or None."""
    try:
        return importlib.import_module(module)
    except Exception:  # noqa: BLE001 - absent, or a CUDA build that cannot load here
        return None


def _flash_varlen():
    flash = _optional("flash_attn")
    return getattr(flash, "flash_attn_varlen_func", None)


def _te_pytorch():
    return _optional("transformer_engine.pytorch")


def available_backends() -> list[str]:
    """Backends usable in this process ("sdpa" always)."""
    cuda = torch.cuda.is_available()
    return ([b for b, ok in (("flash", cuda and _flash_varlen() is not None),
                             ("te", cuda and _te_pytorch() is not None)) if ok] + ["sdpa"])


def _te_mask_types() -> tuple:
    """The attn_mask_type values the installed Transformer Engine knows ("padding_causal_bottom_right",
    which slices need, since TE 1.9)."""
    return getattr(_optional("transformer_engine.pytorch.constants"), "AttnMaskTypes", ())


def _gpu_refusal(t: Tensor, auto: bool) -> Optional[str]:
    """Why flash-attn's and TE's kernels cannot take ``t``, or None. A backend asked for by name needs
    CUDA tensors (the library reports anything else itself); "auto" also wants what both libraries'
    fast kernels need, so that it never picks one that then refuses."""
    if not t.is_cuda:
        return "needs CUDA tensors; use 'sdpa' or 'auto' on CPU"
    if not auto:
        return None
    if t.dtype not in (torch.float16, torch.bfloat16):
        return f"runs fp16 / bf16, not {t.dtype}"
    if torch.cuda.get_device_capability(t.device) < (8, 0):
        return "needs compute capability 8.0 or newer"
    if t.shape[-1] % 8 or t.shape[-1] > 256:
        return f"needs head_dim a multiple of 8 up to 256, not {t.shape[-1]}"
    return None


def _backend_refusal(backend: str, t: Tensor, sliced: bool, auto: bool) -> Optional[str]:
    """Why ``backend`` cannot run attention over ``t`` (with prefix K/V when ``sliced``), or None."""
    if backend == "sdpa":
        return None
    reason = _gpu_refusal(t, auto)
    if reason is not None:
        return reason
    if backend == "flash":
        return None if _flash_varlen() is not None else "needs the flash-attn package"
    if _te_pytorch() is None:
        return "needs Transformer Engine"
    if sliced and "padding_causal_bottom_right" not in _te_mask_types():
        return ("cannot attend from a slice to its prefix K/V: this Transformer Engine has no "
                "'padding_causal_bottom_right' mask (TE >= 1.9 has); use 'flash' or 'sdpa'")
    return None


def _is_te_refusal(err: Exception) -> bool:
    """Whether ``err`` is DotProductAttention finding no kernel for its inputs (a ValueError since TE
    1.12, a plain Exception before; raised before any work is done)."""
    return str(err).startswith("No dot product attention")


def _prepend_prefixes(k: Tensor, v: Tensor, bounds: Sequence[int], prefixes: Sequence):
    """Keys and values laid out ``[prefix; own]`` per segment, and their segment boundaries (the
    ``cu_seqlens_kv`` of varlen kernels, whose ``cu_seqlens_q`` stays ``bounds``)."""
    ks, vs, kv_bounds = [], [], [0]
    for (a, b), prefix in zip(zip(bounds[:-1], bounds[1:]), prefixes):
        if prefix is not None:
            ks.append(prefix[0].to(k.dtype))
            vs.append(prefix[1].to(v.dtype))
        ks.append(k[a:b])
        vs.append(v[a:b])
        kv_bounds.append(kv_bounds[-1] + (b - a) + (0 if prefix is None else prefix[0].shape[0]))
    return torch.cat(ks), torch.cat(vs), kv_bounds


def _te_no_kernel_message(sliced: bool) -> str:
    mask = "'padding_causal_bottom_right' over THD, cu_seqlens_kv != cu_seqlens_q" if sliced else "THD"
    return (f"Transformer Engine has no kernel for this attention ({mask}): it needs flash-attn installed, or "
            "a cuDNN FusedAttention that takes it (recent TE: THD on sm90+, bottom-right causal from cuDNN 9.6 "
            "and without dropout); NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 prints TE's reasons. Use 'flash', 'sdpa' "
            "or 'auto'")


# ---- the core attention module -------------------------------------------------------------------

class UlyssesAttention(MegatronModule):
    """Drop-in ``core_attention`` for megatron-core's SelfAttention (in place of
    DotProductAttention / TEDotProductAttention), doing Ulysses SP over packed sequences when
    given a ``UlyssesPackedSeqParams``. Constructor and forward match DotProductAttention's;
    ``backend`` (one of ATTENTION_BACKENDS) is the one extra keyword, set through the layer spec
    (``get_gpt_layer_ulysses_spec(backend=...)``)."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None, backend: str = "auto"):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("UlyssesAttention replaces context parallelism: use context_parallel_size=1")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError(f"UlyssesAttention supports softmax_type='vanilla' only, "
                                      f"got {config.softmax_type!r}")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise NotImplementedError("UlyssesAttention does not support sliding-window attention")
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; one of {', '.join(ATTENTION_BACKENDS)}")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.backend = backend
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        tp = pg_collection.tp.size() if pg_collection.tp is not None else 1
        self.num_heads = config.num_attention_heads // tp  # per tensor-parallel partition
        self.num_kv_heads = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        # apply_query_key_layer_scaling divides the scale by layer_number and multiplies it back in
        # the softmax (an fp16 range trick): the net scale is the plain one.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self._te_modules: dict = {}  # per (heads, kv heads, sliced): TE modules hold no parameters

    # -- backends --
    def _resolve_backend(self, t: Tensor, sliced: bool = False) -> str:
        """The backend of one call over ``t`` (``sliced``: some segment attends to prefix K/V). A
        named backend that cannot run it is refused with the reason; "auto" takes the first of
        AUTO_ORDER that can, else SDPA."""
        if self.backend != "auto":
            reason = _backend_refusal(self.backend, t, sliced, auto=False)
            if reason is not None:
                raise RuntimeError(f"attention backend {self.backend!r} {reason}")
            return self.backend
        return next((b for b in AUTO_ORDER if _backend_refusal(b, t, sliced, auto=True) is None), "sdpa")

    def _packed(self, q, k, v, bounds, causal, cache, prefixes=None) -> Tensor:
        """q [S, hq, dh], k/v [S, hk, dh] over the segments ``bounds`` -> [S, hq, dh]. ``prefixes``
        (pieces of split sequences): per segment None or the (K, V) [C, hk, dh] of its sequence's
        earlier positions, which it sees whole. ``cache``: per-micro-batch dict for cu_seqlens."""
        p = self.dropout_p if self.training else 0.0
        sliced = prefixes is not None
        backend = self._resolve_backend(q, sliced)
        if backend != "sdpa":
            k_all, v_all, kv_bounds = _prepend_prefixes(k, v, bounds, prefixes) if sliced else (k, v, bounds)
            cu = cache.get("cu") if cache is not None else None
            if cu is None:
                cu_q = torch.tensor(bounds, dtype=torch.int32, device=q.device)
                cu = (cu_q, torch.tensor(kv_bounds, dtype=torch.int32, device=q.device) if sliced else cu_q)
                if cache is not None:
                    cache["cu"] = cu
            max_q = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
            max_kv = max(b - a for a, b in zip(kv_bounds[:-1], kv_bounds[1:]))
            if backend == "flash":  # causal=True aligns bottom-right (flash-attn >= 2.1): a slice sees its prefix
                return _flash_varlen()(q, k_all, v_all, cu[0], cu[1], max_q, max_kv, dropout_p=p,
                                       softmax_scale=self.softmax_scale, causal=causal)
            try:
                return self._te(q, k_all, v_all, cu, max_q, max_kv, causal, sliced)
            except Exception as err:  # noqa: BLE001 - TE's "no kernel" is a plain Exception before TE 1.12
                if not _is_te_refusal(err):
                    raise
                if self.backend != "auto":
                    raise RuntimeError(_te_no_kernel_message(sliced)) from err
                warnings.warn(f"{_te_no_kernel_message(sliced)}; 'auto' runs SDPA for it", stacklevel=2)
        if sliced:
            from megatron_ext.runtime.slices import prefixed_attention

            return prefixed_attention(q, k, v, bounds, prefixes, causal, self.softmax_scale, p)
        return sdpa_packed(q, k, v, bounds, causal, self.softmax_scale, p)

    def _te(self, q, k, v, cu, max_q, max_kv, causal, sliced) -> Tensor:
        """Transformer Engine's DotProductAttention in "thd" format. With prefixes the keys outnumber
        the queries per segment: cross-attention, causal aligned bottom-right."""
        hq, hk = q.shape[1], k.shape[1]
        if causal:
            mask_type = "padding_causal_bottom_right" if sliced else "padding_causal"
        else:
            mask_type = "padding"
        mod = self._te_modules.get((hq, hk, sliced))
        if mod is None:
            mod = _te_pytorch().DotProductAttention(
                num_attention_heads=hq, kv_channels=self.head_dim, num_gqa_groups=hk, attention_dropout=self.dropout_p,
                qkv_format="thd", attn_mask_type=mask_type, attention_type="cross" if sliced else "self",
                softmax_scale=self.softmax_scale, layer_number=self.layer_number)
            self._te_modules[(hq, hk, sliced)] = mod
        mod.train(self.training)
        out = mod(q, k, v, qkv_format="thd", cu_seqlens_q=cu[0], cu_seqlens_kv=cu[1], max_seqlen_q=max_q,
                  max_seqlen_kv=max_kv, attn_mask_type=mask_type)
        return out.view(q.shape[0], hq, -1)

    # -- forward --
    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> Tensor:
        if attention_bias is not None:
            raise NotImplementedError("UlyssesAttention does not support attention_bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = "causal" in mask_type.name
        if isinstance(packed_seq_params, UlyssesPackedSeqParams):
            if attention_mask is not None:
                raise ValueError("with UlyssesPackedSeqParams the packed layout defines the mask; "
                                 "pass attention_mask=None")
            return self._ulysses(query, key, value, packed_seq_params, causal)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._thd_local(query, key, value, packed_seq_params, causal)
        if packed_seq_params is not None:
            raise NotImplementedError(f"UlyssesAttention: PackedSeqParams with qkv_format="
                                      f"{packed_seq_params.qkv_format!r} (use UlyssesPackedSeqParams)")
        return self._batched(query, key, value, attention_mask, causal)

    def _ulysses(self, q, k, v, params: UlyssesPackedSeqParams, causal: bool) -> Tensor:
        s_local, b = q.shape[0], q.shape[1]
        d = params.sp_degree
        if b != 1 or s_local != params.shard_len:
            raise ValueError(f"UlyssesAttention expects this rank's shard [S/d={params.shard_len}, b=1, heads, "
                             f"head_dim], got {list(q.shape)}")
        hq, hk = q.shape[2], k.shape[2]
        if hq % d or hk % d:
            raise ValueError(f"Ulysses degree {d} must divide the attention heads ({hq}) and KV heads ({hk})")
        if d > 1:
            q, k, v = self._exchange_qkv(q, k, v, params.sp_group, d)
        if params.sliced:  # pieces of split sequences: prefix K/V from earlier chunks (runtime/slices.py)
            from megatron_ext.runtime.slices import sliced_attention

            out = sliced_attention(self, q[:, 0], k[:, 0], v[:, 0], params, causal)
        else:
            out = self._packed(q[:, 0], k[:, 0], v[:, 0], params.segment_bounds(), causal, params._cache)
        out = out.unsqueeze(1)  # [S, 1, hq/d, dh]
        if d > 1:
            out = all_to_all(out, params.sp_group, scatter_dim=0, gather_dim=2)
        return out.reshape(s_local, 1, -1)

    @staticmethod
    def _exchange_qkv(q, k, v, group, d):
        """One all-to-all for q, k and v: [S/d, 1, h, dh] each -> [S, 1, h/d, dh] each."""
        s, b, hq, dh = q.shape
        hk = k.shape[2]
        if v.shape[3] != dh:  # different value width: three exchanges
            return tuple(all_to_all(t, group, scatter_dim=2, gather_dim=0) for t in (q, k, v))
        per_rank = [t.reshape(s, b, d, t.shape[2] // d, dh) for t in (q, k, v)]
        qkv = torch.cat(per_rank, dim=3).reshape(s, b, hq + 2 * hk, dh)
        qkv = all_to_all(qkv, group, scatter_dim=2, gather_dim=0)
        # Own storage for each: a view would keep the whole fused buffer alive for as long as the
        # attention keeps its q for the backward (an extra k + v per token per layer).
        return tuple(t.contiguous() for t in torch.split(qkv, [hq // d, hk // d, hk // d], dim=2))

    def _thd_local(self, q, k, v, params: PackedSeqParams, causal: bool) -> Tensor:
        """Megatron's own packed format at degree 1: q [t, h, dh] (or [t, 1, h, dh])."""
        if params.cu_seqlens_q_padded is not None and not torch.equal(params.cu_seqlens_q_padded,
                                                                        params.cu_seqlens_q):
            raise NotImplementedError("UlyssesAttention: thd with per-sequence padding is not supported")
        squeeze = q.dim() == 4
        if squeeze:
            q, k, v = q[:, 0], k[:, 0], v[:, 0]
        bounds = [int(x) for x in params.cu_seqlens_q.tolist()]
        if bounds[-1] < q.shape[0]:
            bounds.append(q.shape[0])
        out = self._packed(q, k, v, bounds, causal, None)
        return out.reshape(out.shape[0], 1, -1) if squeeze else out.reshape(out.shape[0], -1)

    def _batched(self, q, k, v, attention_mask, causal: bool) -> Tensor:
        """Ordinary [s, b, h, dh] attention, one sequence per batch row."""
        s, b = q.shape[0], q.shape[1]
        qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, dh]
        p = self.dropout_p if self.training else 0.0
        gqa = qb.shape[1] != kb.shape[1]
        if attention_mask is not None:  # megatron: True = masked out
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=~attention_mask.bool(), dropout_p=p,
                                               scale=self.softmax_scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qb, kb, vb, dropout_p=p, is_causal=causal,
                                               scale=self.softmax_scale, enable_gqa=gqa)
        return o.permute(2, 0, 1, 3).reshape(s, b, -1)


# ---- RoPE at true positions ----------------------------------------------------------------------

def rotary_pos_emb_at(rotary: RotaryEmbedding, position_ids: Tensor, max_position: Optional[int] = None) -> Tensor:
    """Megatron's rotary frequencies for given positions: ``[n, 1, 1, dim]`` for ``n`` position ids,
    i.e. rows ``position_ids`` of ``rotary(L)`` (which covers positions 0..L-1). Feed it to the
    attention layers as ``rotary_pos_emb`` of a packed shard whose tokens sit at those positions."""
    pos = position_ids.reshape(-1).long()
    n = (int(pos.max()) if max_position is None else int(max_position)) + 1
    table = RotaryEmbedding.forward(rotary, n, 0, True)  # packed_seq=True: no CP slicing; lru-cached
    return table.index_select(0, pos.to(table.device))


class TruePositionRotaryEmbedding(RotaryEmbedding):
    """GPTModel's RotaryEmbedding, made to honour ``UlyssesPackedSeqParams.position_ids``.

    GPTModel._preprocess calls ``get_rotary_seq_len(..., packed_seq_params)`` and then
    ``forward(seq_len, ...)``. For a UlyssesPackedSeqParams micro-batch the first call remembers the
    params and the second returns ``rotary_pos_emb_at(self, params.position_ids)``: one row per local
    token, at its position in its own sequence. Any other call behaves as RotaryEmbedding.
    Installed on an existing model by ``use_true_positions_for_rope``.
    """

    _pending_params: Optional[UlyssesPackedSeqParams] = None

    def get_rotary_seq_len(self, inference_context, transformer, transformer_input, transformer_config,
                           packed_seq_params=None, **kwargs) -> int:
        if isinstance(packed_seq_params, UlyssesPackedSeqParams):
            self._pending_params = packed_seq_params
            return packed_seq_params.shard_len
        self._pending_params = None
        return super().get_rotary_seq_len(inference_context, transformer, transformer_input, transformer_config,
                                           packed_seq_params, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> Tensor:
        params, self._pending_params = self._pending_params, None
        if params is None:
            return super().forward(max_seq_len, offset, packed_seq, cp_group)
        if max_seq_len != params.shard_len or offset:
            raise ValueError("TruePositionRotaryEmbedding: call get_rotary_seq_len with the same "
                             "UlyssesPackedSeqParams right before forward")
        return rotary_pos_emb_at(self, params.position_ids, params.max_position_id)


def _unwrap(model):
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def use_true_positions_for_rope(model) -> None:
    """Make a GPTModel's RoPE use UlyssesPackedSeqParams.position_ids (idempotent; a no-op for
    models without RoPE). Works through DDP / Float16Module wrappers."""
    m = _unwrap(model)
    rope = getattr(m, "rotary_pos_emb", None)
    if rope is None or isinstance(rope, TruePositionRotaryEmbedding):
        return
    if type(rope) is not RotaryEmbedding:
        raise NotImplementedError(f"true-position RoPE supports megatron's RotaryEmbedding, not {type(rope).__name__}")
    rope.__class__ = TruePositionRotaryEmbedding  # same state, position-aware methods


# ---- layer specs -------------------------------------------------------------------------------------

def ulysses_core_attention(backend: str = "auto"):
    """The ``core_attention`` entry of a SelfAttentionSubmodules: UlyssesAttention with a backend."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; one of {', '.join(ATTENTION_BACKENDS)}")
    return UlyssesAttention if backend == "auto" else functools.partial(UlyssesAttention, backend=backend)


def with_ulysses_attention(spec, backend: str = "auto"):
    """A copy of a GPT layer spec (ModuleSpec of a TransformerLayer) or decoder block spec
    (with ``layer_specs``) whose self-attention uses UlyssesAttention."""
    spec = copy.deepcopy(spec)
    layers = spec.layer_specs if hasattr(spec, "layer_specs") else [spec]
    for layer in layers:
        attn = layer.submodules.self_attention
        if not hasattr(attn, "submodules") or not hasattr(attn.submodules, "core_attention"):
            raise ValueError("the layer spec has no self_attention.submodules.core_attention to replace")
        if not hasattr(attn.submodules, "linear_qkv"):
            raise NotImplementedError("UlyssesAttention supports SelfAttention (not MLA)")
        attn.submodules.core_attention = ulysses_core_attention(backend)
    return spec


def get_gpt_layer_ulysses_spec(backend: str = "auto", **local_spec_kwargs):
    """megatron's ``get_gpt_layer_local_spec(**local_spec_kwargs)`` with UlyssesAttention as the
    core attention (use ``with_ulysses_attention`` on a Transformer Engine spec for GPUs)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return with_ulysses_attention(get_gpt_layer_local_spec(**local_spec_kwargs), backend)
