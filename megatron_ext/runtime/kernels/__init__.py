"""Attention kernels, one module per backend, behind one seam (``AttentionKernel``, ``base.py``).

The backends are the names of ``runtime/backends.py``: ``sdpa.py`` (torch's fused kernels, any
device; slices over their prefix K/V without a mask), ``flash.py`` (flash-attn varlen) and ``te.py``
(Transformer Engine, THD); the last two run CUDA tensors and import their library when first
asked. Backend ``<name>`` is the ``AttentionKernel`` subclass with ``name = "<name>"`` in
``kernels/<name>.py``: a new backend is that module and its name in ``backends.py``.

``pick_kernel`` is the one place that decides which kernel runs a call: a backend named is used
or refused with the reason; ``"auto"`` takes the first of ``AUTO_ORDER`` that takes the tensors
(CUDA, fp16/bf16, sm80+, head_dim a multiple of 8 up to 256, the library installed), else SDPA.
``LayerKernels`` is one attention layer's use of them: a kernel per backend, picked per call, and
"auto" running SDPA where Transformer Engine itself finds no kernel for the inputs (``NoKernel``).
"""
from __future__ import annotations

import importlib
import warnings
from typing import Optional, Sequence

from torch import Tensor

from megatron_ext.errors import ConfigError
from megatron_ext.runtime.backends import ATTENTION_BACKENDS, AUTO_ORDER
from megatron_ext.runtime.kernels.base import KERNELS, AttentionKernel, NoKernel, VarlenKernel
from megatron_ext.runtime.kernels.sdpa import (SDPA_DENSE_MASK_MAX_ELEMENTS, SdpaKernel, dense_mask_fits,
                                               expand_kv, fold_kv, lse_kernels, lse_merge, masked_sdpa, prefix_sdpa,
                                               prefixed_attention, sdpa_packed)

__all__ = ["AttentionKernel", "KERNELS", "LayerKernels", "NoKernel", "SDPA_DENSE_MASK_MAX_ELEMENTS", "SdpaKernel",
           "VarlenKernel", "available_backends", "check_backend", "dense_mask_fits", "expand_kv", "fold_kv", "kernel_class",
           "lse_kernels", "lse_merge", "masked_sdpa", "pick_kernel", "prefix_sdpa", "prefixed_attention", "sdpa_packed"]


def _load_backends() -> None:
    """Import ``kernels/<name>.py`` of every backend name: each defines (and so registers) its kernel."""
    for name in ATTENTION_BACKENDS:
        if name == "auto":
            continue
        importlib.import_module(f"{__name__}.{name}")
        if name not in KERNELS:
            raise ImportError(f"attention backend {name!r}: kernels/{name}.py defines no AttentionKernel with "
                              f"name = {name!r}")


_load_backends()


def kernel_class(backend: str) -> type[AttentionKernel]:
    """The kernel of a backend name (not "auto")."""
    if backend not in KERNELS:
        raise ValueError(f"unknown attention backend {backend!r}; one of {', '.join(ATTENTION_BACKENDS)}")
    return KERNELS[backend]


def pick_kernel(backend: str, t: Tensor, sliced: bool = False) -> type[AttentionKernel]:
    """The kernel of one call with queries ``t`` (``sliced``: some segment attends to prefix K/V). A
    named backend that cannot run it is refused with the reason (RuntimeError); "auto" takes the
    first of AUTO_ORDER that can, else SDPA."""
    if backend != "auto":
        kernel = kernel_class(backend)
        reason = kernel.refusal(t, sliced, auto=False)
        if reason is not None:
            raise RuntimeError(f"attention backend {backend!r} {reason}")
        return kernel
    return next((KERNELS[b] for b in AUTO_ORDER if KERNELS[b].refusal(t, sliced, auto=True) is None), SdpaKernel)


def available_backends() -> list[str]:
    """Backends usable in this process, in "auto"'s order ("sdpa" always, last)."""
    order = [*AUTO_ORDER, *(b for b in ATTENTION_BACKENDS if b not in AUTO_ORDER and b not in ("auto", "sdpa"))]
    return [b for b in order if KERNELS[b].installed()] + ["sdpa"]


def check_backend(backend: str, device: str, dtype: str, run: str, fp32_fix: str) -> None:
    """Refuse, before any rank starts, an attention backend that ranks of ``device`` running a
    model in ``dtype`` cannot use (``run``: "profile", "train"; ``fp32_fix``: what to do about
    flash in fp32); named, such a backend would fail on every rank's first attention call."""
    usable = available_backends() if device == "cuda" else ["sdpa"]  # flash and TE run on CUDA tensors only
    if backend not in ("auto", *usable):
        raise ConfigError(f"--attention-backend {backend} cannot run on this {device} {run} (flash needs flash-attn, "
                          f"te Transformer Engine, both on CUDA); usable here: auto, {', '.join(usable)}")
    if backend == "flash" and dtype == "fp32":
        raise ConfigError(f"--attention-backend flash runs bf16 only (flash-attn has no fp32 kernels); {fp32_fix}")


class LayerKernels:
    """The kernels of one attention layer (``backend``: a name of ATTENTION_BACKENDS): one instance
    per backend used (Transformer Engine's modules are built once per layer), picked per call by
    ``pick_kernel``."""

    def __init__(self, backend: str, head_dim: int, softmax_scale: float, dropout_p: float = 0.0,
                 layer_number: int = 1):
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; one of {', '.join(ATTENTION_BACKENDS)}")
        self.backend = backend
        self._settings = dict(head_dim=head_dim, softmax_scale=softmax_scale, dropout_p=dropout_p,
                              layer_number=layer_number)
        self._kernels: dict[str, AttentionKernel] = {}

    def kernel(self, name: str) -> AttentionKernel:
        if name not in self._kernels:
            self._kernels[name] = kernel_class(name)(**self._settings)
        return self._kernels[name]

    def pick(self, t: Tensor, sliced: bool = False) -> AttentionKernel:
        return self.kernel(pick_kernel(self.backend, t, sliced).name)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, bounds: Sequence[int], causal: bool, *, training: bool,
               prefixes: Optional[Sequence] = None, cache: Optional[dict] = None) -> Tensor:
        """``AttentionKernel.attend`` on the kernel picked for ``q``. Where the library finds no kernel
        for the inputs (``NoKernel``), a named backend raises it and "auto" warns and runs SDPA."""
        kernel = self.pick(q, prefixes is not None)
        try:
            return kernel.attend(q, k, v, bounds, causal, training=training, prefixes=prefixes, cache=cache)
        except NoKernel as err:
            if self.backend != "auto":
                raise
            warnings.warn(f"{err}; 'auto' runs SDPA for it", stacklevel=3)
        return self.kernel("sdpa").attend(q, k, v, bounds, causal, training=training, prefixes=prefixes, cache=cache)
