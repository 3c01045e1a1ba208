"""Token-level slices: attention to the cached K/V of a sequence's earlier slices (prefix K/V).

A long sequence cut into slices ``[0, a_1), [a_1, a_2), ...`` (pieces of chunks, see
``megatron_ext.plan.schema.Piece``) runs one slice at a time (InfiniPipe / Seq1F1B, PAPERS.md 2-3):

* Forward of slice i, in every layer: the queries of the slice attend to the cached K/V of slices
  ``< i`` of the same sequence (its prefix, positions ``[0, a_i)``) and causally to the slice's own
  keys. Tokens carry their true positions (RoPE at ``a_i + offset``), so the slice's keys enter the
  cache exactly as an uncut forward would have computed them. Unless it is the sequence's last
  slice, the slice stores its own K/V for the later slices.
* Backward of slice i produces the gradient of the prefix K/V. It is accumulated per (layer,
  sequence, earlier slice) and held until the backward of that earlier slice, which adds it to
  its own dK/dV (a gradient hook on the slice's K/V). Slices therefore run backward last first.
* No autograd graph spans two slices: the prefix enters attention as a fresh leaf made from the
  detached cache, whose gradient hook deposits into the accumulator. A layer's entry of a sequence
  is freed when the sequence's first slice finishes that layer's backward.

With Ulysses SP inside the stage, the cache holds what attention sees after the all-to-all: all
tokens of the slice, this rank's heads (``kv_heads / d``): prefix attention needs no extra
communication. Recomputation (activation checkpointing) re-runs a layer's forward with the same
``UlyssesPackedSeqParams``: the slice reads the same prefix (the cache is keyed by positions, so
later slices' entries are ignored) and does not store its K/V twice.

One ``PrefixKVCache`` per step (or per pipeline) and rank, shared by the ``UlyssesPackedSeqParams``
of every chunk (``prefix_cache=``); ``UlyssesAttention`` calls ``sliced_attention`` when a
micro-batch has pieces of split sequences. A rank's cache holds its own layers only.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_ext.runtime.attention import dense_mask_fits, masked_sdpa, prefix_causal_sdpa



@dataclass
class _Entry:
    """The cached K/V of one sequence in one layer, and the gradients waiting for its slices."""

    k: dict = field(default_factory=dict)  # slice start -> [len, kv_heads_local, dh] (detached)
    v: dict = field(default_factory=dict)
    end: dict = field(default_factory=dict)  # slice start -> slice end
    dk: dict = field(default_factory=dict)  # slice start -> accumulated gradient of its K
    dv: dict = field(default_factory=dict)
    prefixed: set = field(default_factory=set)  # starts (> 0) of slices that ran forward with a prefix
    delivered_k: set = field(default_factory=set)  # ... whose backward delivered their prefix dK
    delivered_v: set = field(default_factory=set)
    injected: set = field(default_factory=set)  # (start, "k" | "v") already added to a slice's dK/dV

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.k, self.v, self.dk, self.dv) for t in d.values())


class PrefixKVCache:
    """Per-rank store of the K/V of token-level slices and of their pending prefix gradients
    (module doc). Keys are ``(layer_number, seq_key)``; ``seq_key`` is any hashable naming the
    sequence (the plan's seq_id)."""

    def __init__(self):
        self._entries: dict[tuple, _Entry] = {}

    # -- inspection --
    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[tuple]:
        return list(self._entries)

    def nbytes(self) -> int:
        return sum(e.nbytes() for e in self._entries.values())

    def clear(self) -> None:
        self._entries.clear()

    def _entry(self, layer: int, key) -> _Entry:
        return self._entries.setdefault((layer, key), _Entry())

    # -- forward --
    def store(self, layer: int, key, start: int, k: Tensor, v: Tensor) -> None:
        """Keep slice ``[start, start + len)``'s K/V (a detached copy; no-op if already stored,
        e.g. when a checkpointed layer is recomputed)."""
        e = self._entry(layer, key)
        if start in e.k:
            if e.k[start].shape != k.shape:
                raise RuntimeError(f"layer {layer}, sequence {key!r}: slice at {start} stored twice with "
                                   f"different shapes {tuple(e.k[start].shape)} and {tuple(k.shape)}")
            return
        e.k[start] = k.detach().clone()
        e.v[start] = v.detach().clone()
        e.end[start] = start + k.shape[0]

    def prefix(self, layer: int, key, start: int) -> tuple[Tensor, Tensor]:
        """K/V of positions ``[0, start)`` as new leaves. When autograd records, their gradients go
        to the accumulators of the slices they came from (see ``_deposit``)."""
        e = self._entries.get((layer, key))
        have = sorted(s for s in (e.k if e else {}) if s < start)
        pos = 0
        for s in have:
            if s != pos:
                break
            pos = e.end[s]
        if pos != start:
            raise RuntimeError(f"layer {layer}, sequence {key!r}: the slice at {start} needs the K/V of positions "
                               f"[0, {start}), but only [0, {pos}) is cached; the earlier slices' forward must run "
                               f"first, on this rank")
        pk = torch.cat([e.k[s] for s in have]) if len(have) > 1 else e.k[have[0]]
        pv = torch.cat([e.v[s] for s in have]) if len(have) > 1 else e.v[have[0]]
        pk, pv = pk.detach(), pv.detach()
        if torch.is_grad_enabled():
            e.prefixed.add(start)
            pk = pk.requires_grad_()
            pv = pv.requires_grad_()
            bounds = [(s, e.end[s]) for s in have]
            pk.register_hook(_Deposit(self, layer, key, start, bounds, "k"))
            pv.register_hook(_Deposit(self, layer, key, start, bounds, "v"))
        else:
            e.prefixed.add(start)
        return pk, pv

    # -- backward --
    def _deposit(self, layer, key, consumer: int, bounds, which: str, grad: Tensor) -> None:
        e = self._entries.get((layer, key))
        if e is None:
            raise RuntimeError(f"layer {layer}, sequence {key!r}: a prefix gradient arrived after the sequence's "
                               f"first slice finished its backward")
        acc = e.dk if which == "k" else e.dv
        for s, t in bounds:
            g = grad[s:t]
            if s in acc:
                acc[s] = acc[s] + g
            else:
                acc[s] = g.clone()
        (e.delivered_k if which == "k" else e.delivered_v).add(consumer)

    def _take(self, layer, key, start: int, which: str) -> Tensor:
        """The accumulated gradient of slice ``start``'s K (or V), for its own backward."""
        e = self._entries.get((layer, key))
        if e is None:
            raise RuntimeError(f"layer {layer}, sequence {key!r}: no cache entry at the backward of its slice at {start}")
        delivered = e.delivered_k if which == "k" else e.delivered_v
        missing = sorted(c for c in e.prefixed if c > start and c not in delivered)
        if missing:
            raise RuntimeError(f"layer {layer}, sequence {key!r}: the backward of the slice at {start} ran before the "
                               f"backward of the later slice(s) at {missing}; slices of a sequence run backward "
                               f"last first")
        acc = e.dk if which == "k" else e.dv
        if start not in acc:
            raise RuntimeError(f"layer {layer}, sequence {key!r}: no later slice delivered the gradient of the slice "
                               f"at {start}; its later slices must run forward and backward on this rank first")
        g = acc.pop(start)
        e.injected.add((start, which))
        if start == 0 and (0, "k") in e.injected and (0, "v") in e.injected:
            del self._entries[(layer, key)]  # the first slice is done: nothing needs this entry any more
        return g


class _Deposit:
    """Gradient hook of a prefix leaf: split the gradient over the slices it came from."""

    def __init__(self, cache: PrefixKVCache, layer, key, consumer, bounds, which):
        self.cache, self.layer, self.key, self.consumer, self.bounds, self.which = cache, layer, key, consumer, bounds, which

    def __call__(self, grad: Tensor):
        self.cache._deposit(self.layer, self.key, self.consumer, self.bounds, self.which, grad)
        return None


class _Inject:
    """Gradient hook on a chunk's K (or V) after the all-to-all: add the held prefix gradients of
    its continuing slices to their rows."""

    def __init__(self, cache: PrefixKVCache, layer, which, rows: list[tuple[int, int, object, int]]):
        self.cache, self.layer, self.which, self.rows = cache, layer, which, rows

    def __call__(self, grad: Tensor) -> Tensor:
        grad = grad.clone()
        for a, b, key, start in self.rows:
            grad[a:b] += self.cache._take(self.layer, key, start, self.which).to(grad.dtype)
        return grad


# ---- attention over packed segments, some with a prefix ---------------------------------------

def _prefixed_layout(bounds: Sequence[int], prefix_lens: Sequence[int]) -> list[int]:
    """Key-buffer boundaries when every segment's keys are [its prefix; its own keys]."""
    kb = [0]
    for (a, b), c in zip(zip(bounds[:-1], bounds[1:]), prefix_lens):
        kb.append(kb[-1] + c + (b - a))
    return kb


def _prefixed_mask(bounds, kbounds, prefix_lens, causal: bool, device) -> Tensor:
    """bool [S, S_ext]: query t of segment i sees its segment's keys (prefix first) up to its own
    true position (prefix length + t) when causal, all of them otherwise."""
    qs = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], device=device)
    ks = torch.tensor([b - a for a, b in zip(kbounds[:-1], kbounds[1:])], device=device)
    qseg = torch.repeat_interleave(torch.arange(len(qs), device=device), qs)
    kseg = torch.repeat_interleave(torch.arange(len(ks), device=device), ks)
    mask = qseg[:, None] == kseg[None, :]
    if causal:
        c = torch.tensor(list(prefix_lens), device=device)
        qpos = torch.arange(int(qs.sum()), device=device) - torch.tensor(list(bounds[:-1]), device=device)[qseg] + c[qseg]
        kpos = torch.arange(int(ks.sum()), device=device) - torch.tensor(list(kbounds[:-1]), device=device)[kseg]
        mask &= kpos[None, :] <= qpos[:, None]
    return mask


def prefixed_attention(q: Tensor, k: Tensor, v: Tensor, bounds: Sequence[int], prefixes: Sequence, causal: bool,
                       scale: float, dropout_p: float = 0.0, backend: str = "sdpa") -> Tensor:
    """Attention within each packed segment of ``q`` [S, hq, dh], ``k``/``v`` [S, hk, dv], where
    segment i (``bounds[i]:bounds[i+1]``) also attends to ``prefixes[i] = (pk, pv)`` ([C_i, hk, d])
    or to nothing (None). Causal masking is at true positions: prefix keys are all visible, own
    keys up to the query. Backends: "sdpa" (dense mask, or per segment when large) and "flash"
    (varlen with separate key boundaries; flash-attn >= 2.1 aligns causal masks bottom-right)."""
    plens = [0 if p is None else int(p[0].shape[0]) for p in prefixes]
    ks, vs = [], []
    for (a, b), p in zip(zip(bounds[:-1], bounds[1:]), prefixes):
        if p is not None:
            ks.append(p[0].to(k.dtype))
            vs.append(p[1].to(v.dtype))
        ks.append(k[a:b])
        vs.append(v[a:b])
    k_ext, v_ext = torch.cat(ks), torch.cat(vs)
    kbounds = _prefixed_layout(bounds, plens)
    if backend == "flash":
        from megatron_ext.runtime.attention import _flash_varlen

        fn = _flash_varlen()
        if fn is None or not q.is_cuda:
            raise RuntimeError("prefix attention with backend 'flash' needs flash-attn and CUDA tensors")
        cu_q = torch.tensor(list(bounds), dtype=torch.int32, device=q.device)
        cu_k = torch.tensor(kbounds, dtype=torch.int32, device=q.device)
        max_q = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        max_k = max(b - a for a, b in zip(kbounds[:-1], kbounds[1:]))
        return fn(q, k_ext, v_ext, cu_q, cu_k, max_q, max_k, dropout_p=dropout_p, softmax_scale=scale, causal=causal)
    if backend != "sdpa":
        raise NotImplementedError(f"prefix K/V attention supports the 'sdpa' and 'flash' backends, not {backend!r}")
    gqa = q.shape[1] != k.shape[1]
    S, S_ext = q.shape[0], k_ext.shape[0]
    qb = q.transpose(0, 1).unsqueeze(0)
    kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (k_ext, v_ext))
    if dense_mask_fits(S, S_ext, q.device):
        o = masked_sdpa(qb, kb, vb, functools.partial(_prefixed_mask, tuple(bounds), tuple(kbounds), tuple(plens),
                                                      causal, q.device), scale, dropout_p)
    else:
        outs = []
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            ka, kz = kbounds[i], kbounds[i + 1]
            if plens[i] and causal and q.device.type == "cpu" and dropout_p == 0.0:
                kc = ka + plens[i]  # the prefix's keys end here, the slice's own begin
                outs.append(prefix_causal_sdpa(qb[:, :, a:b], kb[:, :, ka:kc], vb[:, :, ka:kc], kb[:, :, kc:kz],
                                               vb[:, :, kc:kz], scale))
            elif plens[i] and causal:
                m = functools.partial(_prefixed_mask, (0, b - a), (0, kz - ka), (plens[i],), True, q.device)
                outs.append(masked_sdpa(qb[:, :, a:b], kb[:, :, ka:kz], vb[:, :, ka:kz], m, scale, dropout_p))
            else:
                outs.append(F.scaled_dot_product_attention(qb[:, :, a:b], kb[:, :, ka:kz], vb[:, :, ka:kz],
                                                           is_causal=causal, dropout_p=dropout_p, scale=scale,
                                                           enable_gqa=gqa))
        o = torch.cat(outs, dim=2)
    return o.squeeze(0).transpose(0, 1)


def sliced_attention(module, q: Tensor, k: Tensor, v: Tensor, params, causal: bool) -> Tensor:
    """UlyssesAttention's attention over a packed buffer holding pieces of split sequences.

    ``q`` [S, hq, dh], ``k``/``v`` [S, hk, dh]: the whole group buffer after the all-to-all (this
    rank's heads). For every real segment with a prefix (start > 0) the prefix K/V comes from
    ``params.prefix_cache``; every segment whose sequence continues in a later chunk stores its K/V
    and, when autograd records, gets its held prefix gradient added to its dK/dV in backward."""
    cache: PrefixKVCache = params.prefix_cache
    layer = module.layer_number
    bounds = params.segment_bounds()
    n_real = len(params.seq_lengths)
    starts = params.seq_starts or (0,) * n_real
    continues = params.seq_continues or (False,) * n_real
    keys = params.seq_keys
    prefixes: list = [None] * (len(bounds) - 1)
    rows = []
    for i in range(n_real):
        a, b = bounds[i], bounds[i + 1]
        if starts[i] > 0:
            prefixes[i] = cache.prefix(layer, keys[i], starts[i])
        if continues[i]:
            cache.store(layer, keys[i], starts[i], k[a:b], v[a:b])
            rows.append((a, b, keys[i], starts[i]))
    if rows and torch.is_grad_enabled():
        if k.requires_grad:
            k.register_hook(_Inject(cache, layer, "k", rows))
        if v.requires_grad:
            v.register_hook(_Inject(cache, layer, "v", rows))
    p = module.dropout_p if module.training else 0.0
    backend = module._resolve_backend(q)
    if backend == "te":
        raise NotImplementedError("token-level slices (prefix K/V) are not supported with the 'te' backend; "
                                  "use 'flash' or 'sdpa'")
    return prefixed_attention(q, k, v, bounds, prefixes, causal, module.softmax_scale, p, backend)
