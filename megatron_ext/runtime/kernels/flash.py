"""The flash backend: flash-attn's ``flash_attn_varlen_func`` (CUDA, imported when first used)."""
from __future__ import annotations

from megatron_ext.runtime.kernels.base import VarlenKernel, optional_module


def _flash_varlen():
    flash = optional_module("flash_attn")
    return getattr(flash, "flash_attn_varlen_func", None)


class FlashKernel(VarlenKernel):
    """flash-attn's varlen kernel. ``causal=True`` aligns bottom-right (flash-attn >= 2.1): a slice
    sees its prefix."""

    name = "flash"

    @classmethod
    def library_refusal(cls, sliced):
        return None if _flash_varlen() is not None else "needs the flash-attn package"

    def varlen(self, q, k, v, cu_q, cu_kv, max_q, max_kv, causal, sliced, training):
        return _flash_varlen()(q, k, v, cu_q, cu_kv, max_q, max_kv, dropout_p=self.dropout(training),
                               softmax_scale=self.softmax_scale, causal=causal)
