"""What an attention backend implements (``AttentionKernel``), and what flash-attn and Transformer
Engine share (``VarlenKernel``: CUDA varlen kernels over ``cu_seqlens``).

Tensors are token-major: ``q`` [S, hq, dh], ``k``/``v`` [S, hk, dh] (GQA when hk < hq), one packed
buffer whose segments are ``bounds`` (0, the cumulative segment ends, S). Attention stays within
each segment; the result is [S, hq, dh].
"""
from __future__ import annotations

import functools
import importlib
from typing import ClassVar, Optional, Sequence

import torch
from torch import Tensor

from megatron_ext.runtime.saved import concatenate

# backend name -> its kernel class; filled by the subclasses (AttentionKernel.__init_subclass__)
KERNELS: dict[str, type["AttentionKernel"]] = {}


class NoKernel(RuntimeError):
    """A backend's library found no kernel for these inputs, before doing any work: a backend asked
    for by name reports it (this error), "auto" runs SDPA instead."""


class AttentionKernel:
    """One attention backend, as one attention layer uses it (its softmax scale, dropout, head size
    and layer number).

    A backend is a subclass that sets ``name`` (its entry in ``runtime/backends.py``) and implements
    the two operations UlyssesAttention asks for:

    * ``packed``: attention within each segment of a packed buffer (causal or not);
    * ``prefixed``: the same, where segment i also attends to ``prefixes[i] = (pk, pv)``
      ([C_i, hk, dh]: the K/V of its sequence's earlier positions, all visible; a token-level slice,
      ``runtime/slices.py``) or to nothing (None). Causal masks align bottom-right: a slice's last
      query sees its prefix and all its own keys.

    ``refusal`` says why the backend cannot run a call (None: it can); ``installed`` whether this
    process can use it at all. ``training`` switches dropout on; ``cache`` is a per-micro-batch dict
    (or None) where a kernel may keep what depends only on the layout (cu_seqlens), for every layer.
    """

    name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.name:
            KERNELS[cls.name] = cls

    def __init__(self, head_dim: int, softmax_scale: float, dropout_p: float = 0.0, layer_number: int = 1):
        self.head_dim = head_dim
        self.softmax_scale = softmax_scale
        self.dropout_p = dropout_p
        self.layer_number = layer_number

    @classmethod
    def refusal(cls, t: Tensor, sliced: bool, auto: bool) -> Optional[str]:
        """Why this backend cannot attend with queries ``t`` (with prefix K/V when ``sliced``), or
        None. ``auto``: the question of "auto", which must never pick a kernel that then refuses."""
        return None

    @classmethod
    def installed(cls) -> bool:
        """Whether this process can run the backend at all (``available_backends``)."""
        return True

    def packed(self, q: Tensor, k: Tensor, v: Tensor, bounds: Sequence[int], causal: bool, *, training: bool,
               cache: Optional[dict] = None) -> Tensor:
        raise NotImplementedError

    def prefixed(self, q: Tensor, k: Tensor, v: Tensor, bounds: Sequence[int], prefixes: Sequence, causal: bool, *,
                 training: bool, cache: Optional[dict] = None) -> Tensor:
        raise NotImplementedError

    def attend(self, q: Tensor, k: Tensor, v: Tensor, bounds: Sequence[int], causal: bool, *, training: bool,
               prefixes: Optional[Sequence] = None, cache: Optional[dict] = None) -> Tensor:
        """``prefixed`` where there are prefixes, else ``packed``."""
        if prefixes is not None:
            return self.prefixed(q, k, v, bounds, prefixes, causal, training=training, cache=cache)
        return self.packed(q, k, v, bounds, causal, training=training, cache=cache)

    def dropout(self, training: bool) -> float:
        return self.dropout_p if training else 0.0


# ---- optional GPU libraries ---------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _optional(module: str):
    """An optional GPU package's module, or None."""
    try:
        return importlib.import_module(module)
    except Exception:  # noqa: BLE001 - absent, or a CUDA build that cannot load here
        return None


def optional_module(module: str):
    """An optional GPU package's module (imported once, when first asked for), or None."""
    return _optional(module)


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


# ---- CUDA varlen kernels --------------------------------------------------------------------------

class VarlenKernel(AttentionKernel):
    """A library's varlen kernel over ``cu_seqlens`` on CUDA tensors. Slices attend to keys laid out
    ``[prefix; own]`` per segment (``cu_seqlens_kv`` apart from ``cu_seqlens_q``) under a causal mask
    aligned bottom-right. A subclass implements ``varlen`` and says what its library lacks
    (``library_refusal``)."""

    @classmethod
    def library_refusal(cls, sliced: bool) -> Optional[str]:
        """Why the library (or its installed version) cannot run the call, or None."""
        return None

    @classmethod
    def refusal(cls, t: Tensor, sliced: bool, auto: bool) -> Optional[str]:
        reason = _gpu_refusal(t, auto)
        return reason if reason is not None else cls.library_refusal(sliced)

    @classmethod
    def installed(cls) -> bool:
        return torch.cuda.is_available() and cls.library_refusal(False) is None

    def varlen(self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_kv: Tensor, max_q: int, max_kv: int,
               causal: bool, sliced: bool, training: bool) -> Tensor:
        """q [t_q, hq, dh], k/v [t_kv, hk, dh] over int32 ``cu_q`` / ``cu_kv`` -> [t_q, hq, dh]."""
        raise NotImplementedError

    def packed(self, q, k, v, bounds, causal, *, training, cache=None):
        return self._run(q, k, v, bounds, bounds, causal, False, training, cache)

    def prefixed(self, q, k, v, bounds, prefixes, causal, *, training, cache=None):
        k_all, v_all, kv_bounds = prepend_prefixes(k, v, bounds, prefixes)
        return self._run(q, k_all, v_all, bounds, kv_bounds, causal, True, training, cache)

    def _run(self, q, k, v, bounds, kv_bounds, causal, sliced, training, cache):
        cu = cache.get("cu") if cache is not None else None
        if cu is None:  # (through pinned memory: a pageable copy would wait for every queued kernel)
            from megatron_ext.runtime.device import host_to_device

            cu_q = host_to_device(torch.tensor(bounds, dtype=torch.int32), q.device)
            cu = (cu_q, host_to_device(torch.tensor(kv_bounds, dtype=torch.int32), q.device) if sliced else cu_q)
            if cache is not None:
                cache["cu"] = cu
        max_q, max_kv = max(segment_sizes(bounds)), max(segment_sizes(kv_bounds))
        return self.varlen(q, k, v, cu[0], cu[1], max_q, max_kv, causal, sliced, training)


def segment_sizes(bounds: Sequence[int]) -> list[int]:
    """Tokens of each packed segment, from its boundaries (``cu_seqlens``)."""
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def prepend_prefixes(k: Tensor, v: Tensor, bounds: Sequence[int], prefixes: Sequence):
    """Keys and values laid out ``[prefix; own]`` per segment, and their segment boundaries (the
    ``cu_seqlens_kv`` of varlen kernels, whose ``cu_seqlens_q`` stays ``bounds``)."""
    ks, vs, kv_bounds = [], [], [0]
    sizes = segment_sizes(bounds)
    # split, not a slice per segment: each slice's backward would write a buffer-sized zero gradient
    for n, own_k, own_v, prefix in zip(sizes, k.split(sizes), v.split(sizes), prefixes):
        if prefix is not None:
            ks.append(prefix[0].to(k.dtype))
            vs.append(prefix[1].to(v.dtype))
        ks.append(own_k)
        vs.append(own_v)
        kv_bounds.append(kv_bounds[-1] + n + (0 if prefix is None else prefix[0].shape[0]))
    return concatenate(ks), concatenate(vs), kv_bounds
