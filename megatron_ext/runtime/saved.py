"""What autograd saves for the backward: concatenations kept as their parts, and a count of the rest.

A slice's attention runs over its prefix's K/V and its own, joined: the cached slices of the
prefix into one tensor (``slices.PrefixKVCache.prefix``), and for the varlen kernels prefix and
own into ``[prefix; own]`` (``kernels.base.prepend_prefixes``). The kernels save what they were
given for their backward, so every slice in flight would keep a second copy of its prefix's
K/V beside the cache's until its backward: for gpt-13b on 8 stages x SP 16, a 192K sequence cut
into 8 slices, 4.3 GB on a stage, 60% of the activations it keeps.

Inside ``parts_kept()`` (one layer's attention), what ``concatenate`` joins is saved for the
backward as its parts (the cache's tensors, the slice's own K/V: held anyway) and joined again
when the backward asks for it: one layer's copy at a time, the same values. ``counted(on_save)``
shows ``on_save`` every tensor a region of code keeps for the backward (runtime/pipeline.py: a
chunk's activations), the parts of a concatenation but the cache's leaves. Both run on one pair
of autograd's saved-tensor hooks, installed by the outermost of them: autograd runs only the
innermost pair, so any other pair installed around them is not run inside (megatron's
checkpointing is reentrant and installs none).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor


class _State(threading.local):  # per thread, as autograd's hooks are
    def __init__(self):
        self.regions: list[dict[int, tuple[int, list[Tensor]]]] = []  # storage address -> (bytes, parts)
        self.counters: list[Callable[[Tensor], None]] = []
        self.installed = False


_state = _State()


class _Parts:
    """A saved tensor as the parts of its concatenation and its view of the joined storage."""

    __slots__ = ("parts", "size", "stride", "offset")

    def __init__(self, parts: list[Tensor], t: Tensor):
        self.parts, self.size, self.stride, self.offset = parts, t.size(), t.stride(), t.storage_offset()

    def join(self) -> Tensor:
        return torch.cat(self.parts).as_strided(self.size, self.stride, self.offset)


def _registered(t: Tensor) -> tuple[int, list[Tensor]] | None:
    storage = t.untyped_storage()
    if not _state.regions or not storage.data_ptr():  # (meta tensors have no address)
        return None
    entry = _state.regions[-1].get(storage.data_ptr())
    return entry if entry is not None and entry[0] == storage.nbytes() else None


def concatenate(parts: Sequence[Tensor]) -> Tensor:
    """``torch.cat(parts)`` (a single part as it is); inside ``parts_kept``, saved for a backward as
    the parts (a part that is itself such a concatenation, whole, as its own parts)."""
    if len(parts) == 1:
        return parts[0]
    out = torch.cat(list(parts))
    if _state.regions and out.untyped_storage().data_ptr():
        flat = []
        for t in parts:
            inner = _registered(t)
            whole = inner is not None and t.storage_offset() == 0 and t.is_contiguous() and \
                t.numel() * t.element_size() == inner[0]
            flat.extend(inner[1] if whole else [t])
        _state.regions[-1][out.untyped_storage().data_ptr()] = (out.untyped_storage().nbytes(), flat)
    return out


def _pack(t: Tensor):
    entry = _registered(t)
    kept = [t] if entry is None else [p for p in entry[1] if not p.is_leaf]  # (the cache's leaves: its own count)
    for on_save in _state.counters:
        for x in kept:
            on_save(x)
    return t if entry is None else _Parts(entry[1], t)


def _unpack(saved):
    return saved.join() if isinstance(saved, _Parts) else saved


@contextlib.contextmanager
def _hooks() -> Iterator[None]:
    if _state.installed:
        yield
        return
    _state.installed = True
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _state.installed = False


@contextlib.contextmanager
def parts_kept() -> Iterator[None]:
    """A region whose ``concatenate`` results autograd saves as their parts (module doc). The
    results must stay alive and unmodified until the region ends (one layer's attention), and
    the parts until the backward."""
    _state.regions.append({})
    try:
        with _hooks():
            yield
    finally:
        _state.regions.pop()


@contextlib.contextmanager
def counted(on_save: Callable[[Tensor], None]) -> Iterator[None]:
    """``on_save(t)`` for every tensor autograd keeps for the backward within the region (module doc)."""
    _state.counters.append(on_save)
    try:
        with _hooks():
            yield
    finally:
        _state.counters.pop()


__all__ = ["concatenate", "counted", "parts_kept"]
