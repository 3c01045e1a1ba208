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
    use_true_positions_for_rope(model)                        # once, after building the model (runtime/rope.py)
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
all-to-all (``runtime/comm.py``) is an autograd function that captures its group, so backward
needs no context.

The attention itself is an ``AttentionKernel`` of ``runtime/kernels``, by backend, chosen per module
with ``backend=``: ``"sdpa"`` (torch scaled_dot_product_attention with a block-diagonal mask on
CUDA up to a size, else one causal call per sequence, always on CPU, where masked calls are slow; a
mask, where one is needed, is rebuilt for the backward rather than kept, so activations stay
linear in tokens), ``"flash"`` (flash-attn ``flash_attn_varlen_func``) and ``"te"`` (Transformer
Engine ``DotProductAttention`` in "thd" format); the last two need CUDA and are only imported when
chosen. ``"auto"`` picks flash, then TE, where installed and their kernels take the tensors (CUDA,
fp16/bf16, sm80+, head_dim a multiple of 8 up to 256), else SDPA; when TE itself finds no kernel
for the inputs (its cuDNN or GPU), ``"auto"`` runs SDPA instead. ``kernels.pick_kernel`` is the one
place that decides.

RoPE must use each token's position inside its own sequence, not its place in the shard:
``runtime/rope.py``'s ``use_true_positions_for_rope(model)`` makes GPTModel's RotaryEmbedding
return, for a ``UlyssesPackedSeqParams`` micro-batch, the frequencies at ``params.position_ids``.
Learned absolute position embeddings get the same positions from the ``position_ids`` argument of
GPTModel.forward.

Token-level slices (elastic pipelines): a packed entry may be the piece ``[start, start + n)`` of a
longer sequence (``UlyssesPackedSeqParams.build(..., starts=, keys=, continues=, prefix_cache=)``).
Its tokens sit at their true positions, it attends to the cached K/V of the sequence's earlier
pieces, and the gradient of that prefix is carried back to them (``runtime/slices.py``); without
those arguments nothing changes. Every backend runs slices: flash and TE over keys laid out
``[prefix; own]`` per sequence (``cu_seqlens_kv`` apart from ``cu_seqlens_q``) with the causal mask
aligned bottom-right (flash-attn >= 2.1's ``causal=True``; TE's ``"padding_causal_bottom_right"``),
SDPA without any slice x prefix mask (``kernels.prefix_sdpa``: the prefix and the slice's own keys
as two kernel calls merged by their log-sum-exps).

Groups past the heads' Ulysses limit add a ring (``SPGroup.ring``, ``runtime/ring.py``): the buffer
is cut into r ring blocks, each held by a Ulysses subgroup as above; after the all-to-all within
the subgroup the ring passes K/V blocks between subgroups and merges the partial attentions by
their log-sum-exps. The shards are those of a plain group of the same degree.

Without ``UlyssesPackedSeqParams`` the module still works: with megatron's own ``thd``
PackedSeqParams (``cu_seqlens_q``) it attends within each packed sequence locally, and with no
packed params it is plain causal (or ``attention_mask``-masked) attention per batch row, like
megatron's DotProductAttention.

Attention dropout: the ranks of an SP group hold other heads of the same tokens, so each must draw
its own masks (one process draws every head's from one stream; megatron forks a state per
tensor-parallel rank for the same reason). Groups of degree > 1 draw inside the RNG tracker's
``SP_DROPOUT_RNG`` state, seeded per global rank by ``add_sp_dropout_rng(seed, step)`` after megatron's
``model_parallel_cuda_manual_seed`` and any checkpoint load; megatron's activation checkpointing
saves and restores the tracker's states, so a recomputed layer draws the same masks.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_ext.plan.program import padded_buffer_length
from megatron_ext.runtime.backends import ATTENTION_BACKENDS
from megatron_ext.runtime.comm import all_to_all
from megatron_ext.runtime.device import host_to_device
from megatron_ext.runtime.kernels import LayerKernels
from megatron_ext.runtime.kernels.sdpa import gqa_sdpa
from megatron_ext.runtime.ring import ring_attention
from megatron_ext.runtime.saved import parts_kept
from megatron_ext.runtime.slices import slice_prefixes


SP_DROPOUT_RNG = "megatron-ext-sp-dropout-rng"  # the RNG tracker's state attention dropout draws from
SP_DROPOUT_SEED_OFFSET = 1 << 40  # (clear of megatron's own states: seed + 2718 + tp, seed + 1024 + 100 ep + ...)


def add_sp_dropout_rng(seed: int, step: int = 0) -> None:
    """(Re)seed this rank's attention-dropout stream (``SP_DROPOUT_RNG``) from ``seed``, the global
    rank and the ``step`` the run starts at. Call after megatron's ``model_parallel_cuda_manual_seed``
    (which resets the tracker) and after loading a checkpoint: Megatron-LM saves one RNG state per
    data-parallel group (unless --data-parallel-random-init), so a restored stream could be one
    rank's on all of them. After a resume the masks differ from an uninterrupted run's; their
    statistics do not."""
    tracker = get_cuda_rng_tracker()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    states = tracker.get_states()
    states.pop(SP_DROPOUT_RNG, None)
    tracker.set_states(states)
    own = int(seed) + SP_DROPOUT_SEED_OFFSET + rank + world * int(step)
    tracker.seeds_.discard(own)  # (the tracker refuses a seed it has seen: a second call at the same step)
    tracker.add(SP_DROPOUT_RNG, own)


# ---- the packed layout of one micro-batch ------------------------------------------------------

@dataclass
class UlyssesPackedSeqParams(PackedSeqParams):
    """The packed layout of one SP group's micro-batch, as seen by one rank of the group.

    Megatron fields: ``qkv_format="sbhd"`` (each rank's tensors are [S/d, b=1, ...]; megatron's
    attention must not squeeze them as "thd"), ``cu_seqlens_q/kv`` (int32 [n+1]) the real sequence
    boundaries in the group's packed buffer, ``cu_seqlens_q/kv_padded`` the same with the last
    boundary at S (the padding sits at the end of the buffer), ``max_seqlen_q/kv`` the longest
    sequence. Extra fields: the Ulysses group (None for Ulysses degree 1), this rank's index in it,
    and ``position_ids`` (int64 [S/d]): each local token's position within its own sequence. A
    group with a ring (``runtime/ring.py``) adds the global ranks of this rank's ring, in ring
    order, and its place there: the Ulysses group is then the subgroup holding its ring block.
    Build it with ``UlyssesPackedSeqParams.build``.
    """

    qkv_format: str = "sbhd"
    sp_group: Optional[dist.ProcessGroup] = None
    sp_degree: int = 1
    sp_rank: int = 0
    ring_ranks: tuple = ()  # global ranks of this rank's ring, in ring order; () without a ring
    ring_rank: int = 0  # this rank's place in the ring: the ring block it holds
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
              prefix_cache=None, ring_ranks: Sequence[int] = ()) -> "UlyssesPackedSeqParams":
        """Layout of ``seq_lengths`` (the group's sequences in packing order) over ``sp_group``
        (this rank must be a member; None means degree 1). The buffer is padded to a multiple of
        ``degree * pad_to_multiple_of`` tokens. ``device``: where cu_seqlens and position_ids live
        (default CPU; use the GPU for the flash / TE backends).

        A group with a ring of r Ulysses subgroups (``SPGroupPool.ring_layout``): ``sp_group`` is
        this rank's Ulysses subgroup and ``ring_ranks`` the global ranks of its ring, this rank
        among them; the group's degree is their product and this rank holds shard
        ``ring position * u + Ulysses rank`` of the buffer (ring block ``ring position``).

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
        ring_ranks = tuple(int(x) for x in ring_ranks) if len(ring_ranks) > 1 else ()
        if ring_ranks and dist.get_rank() not in ring_ranks:
            raise ValueError(f"this rank ({dist.get_rank()}) is not in the ring {list(ring_ranks)} it was given")
        if ring_ranks and sliced:
            raise ValueError("pieces of split sequences (token-level slices) run without a ring")
        ring_rank = ring_ranks.index(dist.get_rank()) if ring_ranks else 0
        degree = d * max(1, len(ring_ranks))  # the whole group's: every shard of the buffer
        real = sum(lengths)
        total = padded_buffer_length(real, degree * pad_to_multiple_of)
        cu = host_to_device(torch.tensor([0] + list(_cumsum(lengths)), dtype=torch.int32), device)
        cu_padded = cu.clone()
        cu_padded[-1] = total
        shard = total // degree
        start = (ring_rank * d + r) * shard
        positions = host_to_device(_positions(lengths, total, starts)[start:start + shard], device)
        ends = [a + n for a, n in zip(starts, lengths)] if starts else lengths
        return cls(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                   cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths),
                   sp_group=sp_group if d > 1 else None, sp_degree=d, sp_rank=r, ring_ranks=ring_ranks,
                   ring_rank=ring_rank, seq_lengths=tuple(lengths),
                   num_tokens=real, total_tokens=total, position_ids=positions,
                   max_position_id=max(max(ends), total - real) - 1,
                   seq_starts=starts if sliced else (), seq_keys=keys, seq_continues=continues if sliced else (),
                   prefix_cache=prefix_cache if sliced else None)

    @property
    def sliced(self) -> bool:
        """Whether some packed sequence is a piece of a split sequence (prefix K/V in play)."""
        return self.prefix_cache is not None and (any(self.seq_starts) or any(self.seq_continues))

    @property
    def ring_degree(self) -> int:
        return max(1, len(self.ring_ranks))

    # -- this rank's shard --
    @property
    def shard_len(self) -> int:
        return self.total_tokens // (self.sp_degree * self.ring_degree)

    @property
    def shard_range(self) -> tuple[int, int]:
        """[start, end) of this rank's tokens in the group's padded buffer."""
        start = (self.ring_rank * self.sp_degree + self.sp_rank) * self.shard_len
        return start, start + self.shard_len

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

    # -- the group's whole buffer (after the all-to-all every rank sees all S tokens, or with a
    # ring all S/r tokens of its ring block) --
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
        self._kernels = LayerKernels(backend, self.head_dim, self.softmax_scale, self.dropout_p, self.layer_number)

    # -- backends (runtime/kernels) --
    def _resolve_backend(self, t: Tensor, sliced: bool = False) -> str:
        """The backend of one call over ``t`` (``sliced``: some segment attends to prefix K/V), as
        ``kernels.pick_kernel`` decides: a named backend that cannot run it is refused with the
        reason; "auto" takes the first of AUTO_ORDER that can, else SDPA."""
        return self._kernels.pick(t, sliced).name

    def _packed(self, q, k, v, bounds, causal, cache, prefixes=None) -> Tensor:
        """q [S, hq, dh], k/v [S, hk, dh] over the segments ``bounds`` -> [S, hq, dh]. ``prefixes``
        (pieces of split sequences): per segment None or the (K, V) [C, hk, dh] of its sequence's
        earlier positions, which it sees whole. ``cache``: per-micro-batch dict for cu_seqlens."""
        return self._kernels.attend(q, k, v, bounds, causal, training=self.training, prefixes=prefixes, cache=cache)

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
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
        with self._dropout_rng(d):
            if params.ring_degree > 1:  # this rank's ring block, over the blocks passed around the ring
                out = ring_attention(q, k, v, params, causal, self.softmax_scale,
                                     self.dropout_p if self.training else 0.0)
            else:
                # pieces of split sequences: prefix K/V from earlier chunks (runtime/slices.py), kept
                # for the backward as the cache's tensors, not as the joined copy (runtime/saved.py)
                with parts_kept() if params.sliced else contextlib.nullcontext():
                    prefixes = slice_prefixes(params, self.layer_number, k, v) if params.sliced else None
                    out = self._packed(q, k, v, params.segment_bounds(), causal, params._cache, prefixes)
        out = out.unsqueeze(1)  # [S, 1, hq/d, dh]
        if d > 1:
            out = all_to_all(out, params.sp_group, scatter_dim=0, gather_dim=2)
        return out.reshape(s_local, 1, -1)

    def _dropout_rng(self, d: int):
        """Where a group of degree ``d`` draws its dropout masks (module doc): this rank's own
        stream past degree 1, else the default generator."""
        if d == 1 or not self.training or self.dropout_p == 0.0:
            return contextlib.nullcontext()
        tracker = get_cuda_rng_tracker()
        if SP_DROPOUT_RNG not in tracker.get_states():
            raise RuntimeError(f"attention dropout {self.dropout_p} over an SP group of {d} ranks needs each rank's "
                               f"own stream: call megatron_ext.runtime.attention.add_sp_dropout_rng(seed) after "
                               f"model_parallel_cuda_manual_seed (or set attention_dropout 0)")
        return tracker.fork(SP_DROPOUT_RNG)

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
        squeeze = q.dim() == 4
        if squeeze:
            q, k, v = q[:, 0], k[:, 0], v[:, 0]
        # read from the GPU once for the micro-batch's layers (each read waits for the GPU)
        bounds = getattr(params, "_megatron_ext_bounds", None)
        if bounds is None:
            if params.cu_seqlens_q_padded is not None and not torch.equal(params.cu_seqlens_q_padded,
                                                                            params.cu_seqlens_q):
                raise NotImplementedError("UlyssesAttention: thd with per-sequence padding is not supported")
            bounds = [int(x) for x in params.cu_seqlens_q.tolist()]
            params._megatron_ext_bounds = bounds
        bounds = list(bounds)
        if bounds[-1] < q.shape[0]:
            bounds.append(q.shape[0])
        out = self._packed(q, k, v, bounds, causal, None)
        return out.reshape(out.shape[0], 1, -1) if squeeze else out.reshape(out.shape[0], -1)

    def _batched(self, q, k, v, attention_mask, causal: bool) -> Tensor:
        """Ordinary [s, b, h, dh] attention, one sequence per batch row."""
        s, b = q.shape[0], q.shape[1]
        qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, dh]
        p = self.dropout_p if self.training else 0.0
        if attention_mask is not None:  # megatron: True = masked out
            o = gqa_sdpa(qb, kb, vb, attn_mask=~attention_mask.bool(), dropout_p=p, scale=self.softmax_scale)
        else:
            o = gqa_sdpa(qb, kb, vb, dropout_p=p, is_causal=causal, scale=self.softmax_scale)
        return o.permute(2, 0, 1, 3).reshape(s, b, -1)


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
