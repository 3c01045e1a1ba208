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
* No autograd graph spans two slices: each cached slice of the prefix enters attention as a
  fresh leaf sharing the cache's storage, whose gradient hook deposits into that slice's
  accumulator; the leaves are joined by ``saved.concatenate``, which autograd keeps as the leaves
  (no copy of the prefix per slice in flight). A layer's entry of a sequence is freed when the
  sequence's first slice finishes that layer's backward.

With Ulysses SP inside the stage, the cache holds what attention sees after the all-to-all: all
tokens of the slice, this rank's heads (``kv_heads / d``): prefix attention needs no extra
communication. Recomputation (activation checkpointing) re-runs a layer's forward with the same
``UlyssesPackedSeqParams``: the slice reads the same prefix (the cache is keyed by positions, so
later slices' entries are ignored) and does not store its K/V twice.

One ``PrefixKVCache`` per step (or per pipeline) and rank, shared by the ``UlyssesPackedSeqParams``
of every chunk (``prefix_cache=``); ``UlyssesAttention`` asks ``slice_prefixes`` for the prefix
K/V of a micro-batch with pieces of split sequences and hands them to its attention kernel
(``runtime/kernels``: ``AttentionKernel.prefixed``). A rank's cache holds its own layers only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from megatron_ext.runtime.saved import concatenate


@dataclass
class _Entry:
    """The cached K/V of one sequence in one layer, and the gradients waiting for its slices."""

    k: dict = field(default_factory=dict)  # slice start -> [len, kv_heads_local, dh] (detached)
    v: dict = field(default_factory=dict)
    end: dict = field(default_factory=dict)  # slice start -> slice end
    dk: dict = field(default_factory=dict)  # slice start -> accumulated gradient of its K
    dv: dict = field(default_factory=dict)
    prefixed: set = field(default_factory=set)  # starts (> 0) of slices that ran forward with a prefix
    delivered_k: set = field(default_factory=set)  # (consumer, slice start): a backward delivered that dK
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
        """K/V of positions ``[0, start)``: the cached slices as new leaves (the cache's storage),
        joined. When autograd records, each leaf's gradient goes to the accumulator of its slice
        (see ``_deposit``)."""
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
        ks, vs = [e.k[s].detach() for s in have], [e.v[s].detach() for s in have]
        e.prefixed.add(start)
        if torch.is_grad_enabled():
            for s, pk, pv in zip(have, ks, vs):
                pk.requires_grad_().register_hook(_Deposit(self, layer, key, start, s, "k"))
                pv.requires_grad_().register_hook(_Deposit(self, layer, key, start, s, "v"))
        return concatenate(ks), concatenate(vs)

    # -- backward --
    def _deposit(self, layer, key, consumer: int, start: int, which: str, grad: Tensor) -> None:
        e = self._entries.get((layer, key))
        if e is None:
            raise RuntimeError(f"layer {layer}, sequence {key!r}: a prefix gradient arrived after the sequence's "
                               f"first slice finished its backward")
        acc = e.dk if which == "k" else e.dv
        acc[start] = acc[start] + grad if start in acc else grad.clone()
        (e.delivered_k if which == "k" else e.delivered_v).add((consumer, start))

    def _take(self, layer, key, start: int, which: str) -> Tensor:
        """The accumulated gradient of slice ``start``'s K (or V), for its own backward."""
        e = self._entries.get((layer, key))
        if e is None:
            raise RuntimeError(f"layer {layer}, sequence {key!r}: no cache entry at the backward of its slice at {start}")
        delivered = e.delivered_k if which == "k" else e.delivered_v
        missing = sorted(c for c in e.prefixed if c > start and (c, start) not in delivered)
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
    """Gradient hook of a prefix leaf (one cached slice, as the slice at ``consumer`` saw it): into
    that slice's accumulator."""

    def __init__(self, cache: PrefixKVCache, layer, key, consumer, start, which):
        self.cache, self.layer, self.key, self.consumer, self.start, self.which = cache, layer, key, consumer, start, which

    def __call__(self, grad: Tensor):
        self.cache._deposit(self.layer, self.key, self.consumer, self.start, self.which, grad)
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


# ---- the prefixes of one packed buffer -----------------------------------------------------------

def slice_prefixes(params, layer: int, k: Tensor, v: Tensor) -> Optional[list]:
    """For UlyssesAttention's attention over a packed buffer holding pieces of split sequences: the
    prefix K/V of each segment (``AttentionKernel.prefixed``), or None where no segment has one.

    ``k``/``v`` [S, hk, dh]: the whole group buffer after the all-to-all (this rank's heads), of
    layer ``layer``. For every real segment with a prefix (start > 0) the prefix K/V comes from
    ``params.prefix_cache``; every segment whose sequence continues in a later chunk stores its K/V
    and, when autograd records, gets its held prefix gradient added to its dK/dV in backward."""
    cache: PrefixKVCache = params.prefix_cache
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
    return prefixes if has_prefix else None
