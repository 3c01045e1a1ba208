"""The flash backend: flash-attn's ``flash_attn_varlen_func`` (CUDA, imported when first used)."""
from __future__ import annotations

import re

from megatron_ext.runtime.kernels.base import VarlenKernel, optional_module

# ``causal=True`` aligns bottom-right from flash-attn 2.1 on; before, top-left, where a slice's
# queries would miss part of their prefix
FLASH_SLICES_VERSION = (2, 1)


def _flash_varlen():
    flash = optional_module("flash_attn")
    return getattr(flash, "flash_attn_varlen_func", None)


def _flash_version() -> tuple[int, ...]:
    text = str(getattr(optional_module("flash_attn"), "__version__", "0"))
    return tuple(int(x) for x in re.findall(r"\d+", text)[:2])


class FlashKernel(VarlenKernel):
    """flash-attn's varlen kernel. ``causal=True`` aligns bottom-right (flash-attn >= 2.1): a slice
    sees its prefix."""

    name = "flash"

    @classmethod
    def library_refusal(cls, sliced):
        if _flash_varlen() is None:
            return "needs the flash-attn package"
        if sliced and _flash_version() < FLASH_SLICES_VERSION:
            return (f"cannot attend from a slice to its prefix K/V: flash-attn "
                    f"{getattr(optional_module('flash_attn'), '__version__', '(unknown version)')} aligns the causal "
                    f"mask top-left (2.1 and later align it bottom-right); use 'te' or 'sdpa'")
        return None

    def varlen(self, q, k, v, cu_q, cu_kv, max_q, max_kv, causal, sliced, training):
        return _flash_varlen()(q, k, v, cu_q, cu_kv, max_q, max_kv, dropout_p=self.dropout(training),
                               softmax_scale=self.softmax_scale, causal=causal)
