"""Activation memory per token from a transformer's shape and its recompute policy.

What autograd keeps for the backward of one layer, per token, with flash attention (no s x s
score matrix is stored) and no tensor parallelism; e = activation_bytes (2 for bf16), h hidden,
kvd = kv_heads x head_dim, f the FFN width (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", Table 2, without the 5 a s / h term that flash
attention removes):

    attention  e h (norm input) + e h (QKV input) + e (h + 2 kvd) (Q, K, V) + e h (output O,
               the output projection's input) + 4 heads (fp32 log-sum-exp) [+ h: dropout mask]
    MLP        e h (norm input) + e h (FC1 input) + GPT: 2 e f (GeLU input, FC2 input);
               SwiGLU: 3 e f (gate and up, FC2 input) [+ h: dropout mask]

For GPT (kvd = h, f = 4h, dropout): 34 h + 4 heads bytes, the paper's 34 s b h. The output layer and
the loss keep, per token, fp32 logits (4 vocab) and the inputs of the final norm and of the output
layer (2 e h): the whole model's figure includes them once (a pipeline puts them on its last stage).

Recompute ``full`` of n layers (Megatron's block method): such a layer keeps only its input
(e h) between forward and backward; while one of them runs its backward, its activations exist
again (one layer's worth, the working set). gpt-7b (32 x 4096, no recompute): 4.464 MB per token
against the FlexSP paper's published 4.48 (-0.4%).
"""
from __future__ import annotations

from megatron_ext.spec import MB


def layer_bytes_per_token(model) -> float:
    """Bytes one layer keeps per token for its backward (no recompute)."""
    e, h, heads = model.activation_bytes, model.hidden_size, model.num_attention_heads
    kvd = model.kv_heads * (h // heads)
    f = model.ffn_hidden_size or 4 * h
    mask = h if model.dropout else 0  # one byte per element
    attention = e * h + e * h + e * (h + 2 * kvd) + e * h + 4 * heads + mask
    mlp = e * h + e * h + (3 if model.swiglu else 2) * e * f + mask
    return float(attention + mlp)


def head_bytes_per_token(model) -> float:
    """Bytes the output layer and the loss keep per token: fp32 logits, the final norm's and the
    output layer's inputs."""
    return float(model.vocab_size * 4 + 2 * model.hidden_size * model.activation_bytes)


def act_mb_per_token(model) -> float:
    """The whole model's activation memory per token on one GPU, MB, under its recompute policy."""
    L = model.num_layers
    n = model.recomputed_layers
    layer = layer_bytes_per_token(model)
    kept = (L - n) * layer + n * model.hidden_size * model.activation_bytes
    working = layer if n else 0.0  # a recomputed layer's activations during its backward
    return (kept + working + head_bytes_per_token(model)) / MB


def recompute_time_factor(model) -> float:
    """A pass's compute with the model's recompute, over that without: every recomputed layer runs
    its forward (a third of its fwd+bwd) once more."""
    return 1.0 + model.recomputed_layers / model.num_layers / 3.0


__all__ = ["act_mb_per_token", "head_bytes_per_token", "layer_bytes_per_token", "recompute_time_factor"]
