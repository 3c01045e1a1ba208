"""The te backend: Transformer Engine's ``DotProductAttention`` in "thd" format (CUDA, imported when
first used)."""
from __future__ import annotations

from megatron_ext.runtime.kernels.base import NoKernel, VarlenKernel, optional_module


def _te_pytorch():
    return optional_module("transformer_engine.pytorch")


def _te_mask_types() -> tuple:
    """The attn_mask_type values the installed Transformer Engine knows ("padding_causal_bottom_right",
    which slices need, since TE 1.9)."""
    return getattr(optional_module("transformer_engine.pytorch.constants"), "AttnMaskTypes", ())


def _is_te_refusal(err: Exception) -> bool:
    """Whether ``err`` is DotProductAttention finding no kernel for its inputs (a ValueError since TE
    1.12, a plain Exception before; raised before any work is done)."""
    return str(err).startswith("No dot product attention")


def _te_no_kernel_message(sliced: bool) -> str:
    mask = "'padding_causal_bottom_right' over THD, cu_seqlens_kv != cu_seqlens_q" if sliced else "THD"
    return (f"Transformer Engine has no kernel for this attention ({mask}): it needs flash-attn installed, or "
            "a cuDNN FusedAttention that takes it (recent TE: THD on sm90+, bottom-right causal from cuDNN 9.6 "
            "and without dropout); NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 prints TE's reasons. Use 'flash', 'sdpa' "
            "or 'auto'")


class TEKernel(VarlenKernel):
    """Transformer Engine's DotProductAttention over THD. With prefixes the keys outnumber the queries
    per segment: cross-attention, mask "padding_causal_bottom_right" (TE >= 1.9). When TE finds no
    kernel for the inputs (its cuDNN or GPU) it raises ``NoKernel``."""

    name = "te"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._te_modules: dict = {}  # per (heads, kv heads, sliced): TE modules hold no parameters

    @classmethod
    def library_refusal(cls, sliced):
        if _te_pytorch() is None:
            return "needs Transformer Engine"
        if sliced and "padding_causal_bottom_right" not in _te_mask_types():
            return ("cannot attend from a slice to its prefix K/V: this Transformer Engine has no "
                    "'padding_causal_bottom_right' mask (TE >= 1.9 has); use 'flash' or 'sdpa'")
        return None

    def varlen(self, q, k, v, cu_q, cu_kv, max_q, max_kv, causal, sliced, training):
        try:
            return self._attend(q, k, v, cu_q, cu_kv, max_q, max_kv, causal, sliced, training)
        except Exception as err:  # noqa: BLE001 - TE's "no kernel" is a plain Exception before TE 1.12
            if not _is_te_refusal(err):
                raise
            raise NoKernel(_te_no_kernel_message(sliced)) from err

    def _attend(self, q, k, v, cu_q, cu_kv, max_q, max_kv, causal, sliced, training):
        hq, hk = q.shape[1], k.shape[1]
        if causal:
            mask_type = "padding_causal_bottom_right" if sliced else "padding_causal"
        else:
            mask_type = "padding"
        mod = self._te_modules.get((hq, hk, sliced))
        if mod is None:
            mod = _te_pytorch().DotProductAttention(
                num_attention_heads=hq, kv_channels=self.head_dim, num_gqa_groups=hk, attention_dropout=self.dropout_p,
                qkv_format="thd", attn_mask_type=mask_type, attention_type="cross" if sliced else "self",
                softmax_scale=self.softmax_scale, layer_number=self.layer_number)
            self._te_modules[(hq, hk, sliced)] = mod
        mod.train(training)
        out = mod(q, k, v, qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=max_q,
                  max_seqlen_kv=max_kv, attn_mask_type=mask_type)
        return out.view(q.shape[0], hq, -1)
