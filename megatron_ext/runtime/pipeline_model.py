"""This rank's stage of a GPTModel for megatron's pipeline layout (``build_pipeline_model``), and
its share of a whole model's weights (``stage_state_dict``). The elastic pipeline executor that
runs it is runtime/pipeline.py."""
from __future__ import annotations


def unwrap_model(model):
    """The GPTModel inside megatron's wrappers (DDP, Float16Module)."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def build_pipeline_model(spec, vocab_size: int, max_seq_len: int, backend: str = "auto", *, ddp: bool = True,
                         on_host: bool = False, share_embeddings_and_output_weights: bool = False,
                         **config_overrides):
    """This rank's stage of a GPTModel (fp32; ``bf16=True`` overrides give Megatron's Float16Module;
    RoPE, Ulysses core attention with prefix K/V) for megatron's pipeline layout (parallel_state
    must be initialized with the pipeline size), wrapped in megatron DDP over the stage's data-parallel (= SP) group with ``finalize_model_grads``.
    ``spec``: a ModelSpec (layers, hidden size, heads, KV heads, FFN size, SwiGLU or GELU MLP).
    ``on_host``: left in host memory (a whole model whose weights the stages load). Returns (model, config)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.runtime.attention import get_gpt_layer_ulysses_spec
    from megatron_ext.runtime.rope import use_true_positions_for_rope
    from megatron_ext.runtime.device import rank_device

    P = ps.get_pipeline_model_parallel_world_size()
    kw = dict(num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
              num_query_groups=spec.kv_heads, ffn_hidden_size=spec.ffn_hidden_size or 4 * spec.hidden_size,
              hidden_dropout=0.0, attention_dropout=0.0, calculate_per_token_loss=True, use_cpu_initialization=True,
              params_dtype=torch.float32, pipeline_dtype=torch.float32, pipeline_model_parallel_size=P)
    if spec.swiglu:  # LLaMA's gated MLP (megatron's default: GPT's GELU)
        kw.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    kw.update(config_overrides)
    config = TransformerConfig(**kw)
    if spec.num_layers % P:
        raise ValueError(f"{P} pipeline stages do not divide the {spec.num_layers} layers")
    padded_vocab = -(-vocab_size // 128) * 128
    model = GPTModel(config, get_gpt_layer_ulysses_spec(backend=backend), vocab_size=padded_vocab,
                     max_sequence_length=max_seq_len, position_embedding_type="rope",
                     pre_process=ps.is_pipeline_first_stage(ignore_virtual=True),
                     post_process=ps.is_pipeline_last_stage(ignore_virtual=True),
                     share_embeddings_and_output_weights=share_embeddings_and_output_weights)
    use_true_positions_for_rope(model)
    device = rank_device()
    # built on the host (use_cpu_initialization: the same weights on any layout)
    if device.type == "cuda" and not on_host:
        model.cuda(device)
    if config.bf16 or config.fp16:
        # Megatron's own mixed precision: every parameter (norms too, which CUDA's layer_norm
        # needs in the input's dtype) cast, the first stage's inputs cast, fp32 out of the last
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    if not ddp:
        return model, config
    wrapped = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    config.no_sync_func = wrapped.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped, config


def stage_state_dict(full_state_dict: dict, stage_model) -> dict:
    """The entries of a whole (one-stage) GPTModel's state dict that belong to ``stage_model``,
    renamed to its local layer numbering (``decoder.layers.<global - offset>``)."""
    m = unwrap_model(stage_model)
    mine = m.state_dict()
    offset = m.decoder.layers[0].layer_number - 1 if len(m.decoder.layers) else 0
    out = {}
    for name in mine:
        src = name
        if name.startswith("decoder.layers."):
            rest = name[len("decoder.layers."):]
            i, tail = rest.split(".", 1)
            src = f"decoder.layers.{int(i) + offset}.{tail}"
        if src not in full_state_dict and name == "output_layer.weight":
            src = "embedding.word_embeddings.weight"  # tied embeddings: the last stage's copy
        if src not in full_state_dict:
            raise KeyError(f"{src} (for {name}) is not in the full model's state dict")
        out[name] = full_state_dict[src]
    return out


__all__ = ["build_pipeline_model", "stage_state_dict", "unwrap_model"]
