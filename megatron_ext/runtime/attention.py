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
chosen. ``"auto"`` picks flash, then TE, when installed and the tensors are on CUDA, else SDPA.

RoPE must use each token's position inside its own sequence, not its place in the shard:
``use_true_positions_for_rope(model)`` makes GPTModel's RotaryEmbedding return, for a
``UlyssesPackedSeqParams`` micro-batch, the frequencies at ``params.position_ids`` (see
``rotary_pos_emb_at``). Learned absolute position embeddings get the same positions from the
``position_ids`` argument of GPTModel.forward.

Token-level slices (elastic pipelines): a packed entry may be the piece ``[start, start + n)`` of a
longer sequence (``UlyssesPackedSeqParams.build(..., starts=, keys=, continues=, prefix_cache=)``).
Its tokens sit at their true positions, it attends to the cached K/V of the sequence's earlier
pieces, and the gradient of that prefix is carried back to them (``runtime/slices.py``); without
those arguments nothing changes.

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

BACKENDS = ("auto", "sdpa", "flash", "te")

# The SDPA backend runs one masked [S, S] call per micro-batch up to this many elements, by device
# type, else one causal call per packed sequence. A masked kernel costs S^2 however short the
# sequences (the cost model's sum of s^2 is the per-sequence calls'); on CUDA it saves launches for
# many short sequences, on CPU the per-sequence calls are always faster (2-10x measured), so 0.
SDPA_DENSE_MASK_MAX_ELEMENTS = {"cuda": 1 << 22, "cpu": 0}


def dense_mask_fits(rows: int, cols: int, device) -> bool:
    return rows * cols <= SDPA_DENSE_MASK_MAX_ELEMENTS.get(torch.device(device).type, 0)


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


class _PrefixCausalFlashCPU(torch.autograd.Function):
    """A slice's attention over [its prefix's keys (all visible); its own keys (causal)] as two
    mask-free CPU flash calls merged by their log-sum-exps. The backward runs each part's flash
    backward against the merged output and log-sum-exp, which gives exactly each part's gradient
    (the probabilities are those of the union). q [1, hq, s, d]; prefix and own K/V [1, hk, ., d]."""

    @staticmethod
    def forward(ctx, q, kp, vp, ko, vo, scale):
        g = q.shape[1] // kp.shape[1]
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o1, l1 = flash(q, _expand_kv(kp, g), _expand_kv(vp, g), 0.0, False, scale=scale)
        o2, l2 = flash(q, _expand_kv(ko, g), _expand_kv(vo, g), 0.0, True, scale=scale)
        lse = torch.logaddexp(l1, l2)
        out = o1 * torch.exp(l1 - lse).unsqueeze(-1) + o2 * torch.exp(l2 - lse).unsqueeze(-1)
        ctx.save_for_backward(q, kp, vp, ko, vo, out, lse)
        ctx.scale, ctx.groups = scale, g
        return out

    @staticmethod
    def backward(ctx, grad):
        q, kp, vp, ko, vo, out, lse = ctx.saved_tensors
        g, grad = ctx.groups, grad.contiguous()
        flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        dq1, dkp, dvp = flash_bwd(grad, q, _expand_kv(kp, g), _expand_kv(vp, g), out, lse, 0.0, False, scale=ctx.scale)
        dq2, dko, dvo = flash_bwd(grad, q, _expand_kv(ko, g), _expand_kv(vo, g), out, lse, 0.0, True, scale=ctx.scale)
        hk = kp.shape[1]
        return dq1 + dq2, _fold_kv(dkp, hk), _fold_kv(dvp, hk), _fold_kv(dko, hk), _fold_kv(dvo, hk), None


def prefix_causal_sdpa(q: Tensor, kp: Tensor, vp: Tensor, ko: Tensor, vo: Tensor, scale: float) -> Tensor:
    """Causal attention of a slice at true positions: ``q`` [1, hq, s, d] over its prefix's K/V
    ``kp``/``vp`` (all visible) and its own ``ko``/``vo`` [1, hk, s, d]; no mask built."""
    return _PrefixCausalFlashCPU.apply(q, kp, vp, ko, vo, scale)


def _additive(mask: Tensor, dtype) -> Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def masked_sdpa(qb: Tensor, kb: Tensor, vb: Tensor, make_mask, scale: float, dropout_p: float) -> Tensor:
    """Attention of ``qb`` [1, hq, S, d] over ``kb``/``vb`` [1, hk, S_k, d] where ``make_mask()``
    (bool [S, S_k], True = may attend) allows; GQA when hk < hq. On CPU without dropout the mask
    is not kept for the backward (``_MaskedFlashCPU``)."""
    if qb.device.type == "cpu" and dropout_p == 0.0 and qb.dtype in (torch.float32, torch.float64, torch.bfloat16):
        return _MaskedFlashCPU.apply(qb, kb, vb, make_mask, scale)
    return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=make_mask(), dropout_p=dropout_p, scale=scale,
                                          enable_gqa=qb.shape[1] != kb.shape[1])


def _sdpa_packed(q: Tensor, k: Tensor, v: Tensor, bounds: Sequence[int], causal: bool, scale: float,
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


# ---- the core attention module -------------------------------------------------------------------

class UlyssesAttention(MegatronModule):
    """Drop-in ``core_attention`` for megatron-core's SelfAttention (in place of
    DotProductAttention / TEDotProductAttention), doing Ulysses SP over packed sequences when
    given a ``UlyssesPackedSeqParams``. Constructor and forward match DotProductAttention's;
    ``backend`` (one of BACKENDS) is the one extra keyword, set through the layer spec
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
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; one of {', '.join(BACKENDS)}")
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
        self._te_modules: dict = {}  # per (heads, kv heads): TE modules hold no parameters

    # -- backends --
    def _resolve_backend(self, t: Tensor) -> str:
        if self.backend != "auto":
            return self.backend
        if t.is_cuda and t.dtype in (torch.float16, torch.bfloat16):
            if _flash_varlen() is not None:
                return "flash"
            if _te_pytorch() is not None:
                return "te"
        return "sdpa"

    def _packed(self, q, k, v, bounds, causal, cache) -> Tensor:
        """q [S, hq, dh], k/v [S, hk, dh] over the segments ``bounds`` -> [S, hq, dh]."""
        p = self.dropout_p if self.training else 0.0
        backend = self._resolve_backend(q)
        if backend == "sdpa":
            return _sdpa_packed(q, k, v, bounds, causal, self.softmax_scale, p)
        if not q.is_cuda:
            raise RuntimeError(f"attention backend {backend!r} needs CUDA tensors; use 'sdpa' or 'auto' on CPU")
        cu = cache.get("cu") if cache is not None else None
        if cu is None:
            cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
            if cache is not None:
                cache["cu"] = cu
        max_len = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        if backend == "flash":
            fn = _flash_varlen()
            if fn is None:
                raise RuntimeError("attention backend 'flash' needs the flash-attn package")
            return fn(q, k, v, cu, cu, max_len, max_len, dropout_p=p, softmax_scale=self.softmax_scale,
                      causal=causal)
        te = _te_pytorch()
        if te is None:
            raise RuntimeError("attention backend 'te' needs Transformer Engine")
        hq, hk = q.shape[1], k.shape[1]
        mod = self._te_modules.get((hq, hk))
        if mod is None:
            mod = te.DotProductAttention(num_attention_heads=hq, kv_channels=self.head_dim, num_gqa_groups=hk,
                                         attention_dropout=self.dropout_p, qkv_format="thd",
                                         attn_mask_type="padding_causal" if causal else "padding",
                                         softmax_scale=self.softmax_scale, layer_number=self.layer_number)
            self._te_modules[(hq, hk)] = mod
        mod.train(self.training)
        out = mod(q, k, v, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len,
                  max_seqlen_kv=max_len, attn_mask_type="padding_causal" if causal else "padding")
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
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; one of {', '.join(BACKENDS)}")
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
