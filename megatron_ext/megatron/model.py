"""The model of a ``--flexsp`` or ``--elastic-pp`` run: Megatron's GPT, with Ulysses core attention.

``ulysses_model_builder(builder)`` wraps Megatron-LM's ``gpt_builder``: the model is built exactly as
without our flags (same layer spec -- local or Transformer Engine --, same parameters, same
initialization from the same seed; with ``--elastic-pp`` Megatron builds this rank's pipeline stage,
``pre_process`` / ``post_process`` as usual), then each self-attention's ``core_attention`` (which
holds no parameters) is replaced by ``megatron_ext.runtime.attention.UlyssesAttention``, and RoPE
is made to use each token's position within its own sequence. UlyssesAttention also serves the
token-level slices of elastic pipelines: given a ``UlyssesPackedSeqParams`` with a prefix cache it
attends to the cached K/V of the sequence's earlier slices (``runtime/slices.py``). Checkpoints
keep Megatron's parameter names.
"""
from __future__ import annotations

import functools

from megatron_ext.megatron.arguments import mode_flag


def use_ulysses_attention(model, backend: str = "auto") -> int:
    """Replace the core attention of every SelfAttention in ``model`` (any wrapper) by
    UlyssesAttention with ``backend``, and install true-position RoPE. Returns how many were
    replaced (idempotent: 0 the second time)."""
    from megatron.core.transformer.attention import SelfAttention

    from megatron_ext.runtime.attention import UlyssesAttention, ulysses_core_attention
    from megatron_ext.runtime.rope import use_true_positions_for_rope

    make = ulysses_core_attention(backend)
    replaced = 0
    for module in model.modules():
        if not isinstance(module, SelfAttention) or isinstance(module.core_attention, UlyssesAttention):
            continue
        old = module.core_attention
        if any(True for _ in old.parameters()):
            raise NotImplementedError(f"megatron_ext: the core attention {type(old).__name__} holds parameters "
                                      f"(e.g. learnable softmax offsets); UlyssesAttention cannot replace it")
        module.core_attention = make(config=getattr(old, "config", module.config), layer_number=module.layer_number,
                                     attn_mask_type=module.attn_mask_type, attention_type=module.attention_type,
                                     softmax_scale=module.config.softmax_scale, pg_collection=module.pg_collection)
        replaced += 1
    use_true_positions_for_rope(model)
    return replaced


def ulysses_model_builder(builder):
    """Wrap a Megatron-LM model builder (``gpt_builder(args, pre_process, post_process, vp_stage,
    config=, pg_collection=)``): with ``args.flexsp`` or ``args.elastic_pp`` the built model gets
    Ulysses attention."""

    @functools.wraps(builder)
    def build(args, pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
        model = builder(args, pre_process, post_process, vp_stage, config=config, pg_collection=pg_collection)
        if mode_flag(args) is not None:
            n = use_ulysses_attention(model, getattr(args, "flexsp_attention_backend", "auto"))
            if n == 0:
                raise NotImplementedError("megatron_ext: the model has no SelfAttention layer to give Ulysses "
                                          "attention")
        return model

    return build
