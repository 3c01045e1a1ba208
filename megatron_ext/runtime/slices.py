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

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from megatron_ext.runtime.attention import prefix_sdpa, sdpa_packed


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

def prefixed_attention(q: Tensor, k: Tensor, v: Tensor, bounds: Sequence[int], prefixes: Sequence, causal: bool,
                       scale: float, dropout_p: float = 0.0) -> Tensor:
    """SDPA within each packed segment of ``q`` [S, hq, dh], ``k``/``v`` [S, hk, dv], where segment i
    (``bounds[i]:bounds[i+1]``) also attends to ``prefixes[i] = (pk, pv)`` ([C_i, hk, d], all visible:
    they precede the segment) or to nothing (None). No mask covers a prefix: a segment with one runs
    ``prefix_sdpa`` (the prefix and its own keys as two kernel calls merged by log-sum-exps), and
    the runs of segments between such segments go through the packed path of whole sequences."""
    def heads_first(t):
        return t.transpose(0, 1).unsqueeze(0)  # [n, h, d] -> [1, h, n, d]

    def without_prefix(first: int, stop: int) -> Tensor:  # segments first..stop-1
        a, b = bounds[first], bounds[stop]
        return sdpa_packed(q[a:b], k[a:b], v[a:b], [x - a for x in bounds[first:stop + 1]], causal, scale, dropout_p)

    outs, first = [], 0
    for i, prefix in enumerate(prefixes):
        if prefix is None:
            continue
        if first < i:
            outs.append(without_prefix(first, i))
        a, b = bounds[i], bounds[i + 1]
        o = prefix_sdpa(heads_first(q[a:b]), heads_first(prefix[0].to(k.dtype)), heads_first(prefix[1].to(v.dtype)),
                        heads_first(k[a:b]), heads_first(v[a:b]), causal, scale, dropout_p)
        outs.append(o.squeeze(0).transpose(0, 1))
        first = i + 1
    if first < len(prefixes):
        outs.append(without_prefix(first, len(prefixes)))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def sliced_attention(module, q: Tensor, k: Tensor, v: Tensor, params, causal: bool) -> Tensor:
    """UlyssesAttention's attention over a packed buffer holding pieces of split sequences.

    ``q`` [S, hq, dh], ``k``/``v`` [S, hk, dh]: the whole group buffer after the all-to-all (this
    rank's heads). For every real segment with a prefix (start > 0) the prefix K/V comes from
    ``params.prefix_cache``; every segment whose sequence continues in a later chunk stores its K/V
    and, when autograd records, gets its held prefix gradient added to its dK/dV in backward. The
    module's backend runs the attention (``UlyssesAttention._packed``)."""
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
    has_prefix = any(p is not None for p in prefixes)  # first slices only store: plain packed attention
    return module._packed(q, k, v, bounds, causal, params._cache, prefixes if has_prefix else None)
