"""The fixed cost of a pass and of a step, derived from its parts (PAPERS.md section 6).

FlexSP fits one constant b1 per model: what a forward+backward pass costs whatever it runs. On
its runtime (ZeRO-3 over all 64 GPUs) that is mostly parameter traffic. Here it is built from:

- the launch constant ``ModelSpec.launch_ms``: kernel launches and per-layer synchronisation of a
  pass over the whole model (a stage pays its layers' share);
- under ZeRO-3, per pass and per layer the pass runs: the all-gather of the layer's parameters
  before its forward and again before its backward (the compute waits for them: exposed), and
  the reduce-scatter of its gradients, which nothing waits for until the optimizer step: it
  runs behind the rest of the backward (as Megatron's --overlap-grad-reduce and FSDP's
  post-backward stream do), except the last layer's (the model's first), which ends the pass;
- under ZeRO 0/1/2, no pass gathers parameters: once per step, the gradient reduction (0:
  all-reduce = reduce-scatter + all-gather; 1/2: reduce-scatter, then the all-gather of the
  updated parameters of the distributed optimizer) overlaps the backward and the next forward
  (--overlap-grad-reduce, --overlap-param-gather) except for one layer's worth each way; under
  ZeRO-3, pipeline replicas (each sharding a stage over its own SP ranks) all-reduce each GPU's
  gradient shard with its peers in the other replicas the same way (hybrid sharding).

A collective over a group of n GPUs on k nodes (g of them on each) moves, for a tensor of S bytes
(ring algorithms, large messages): inside one node, S (n - 1) / n per GPU over NVLink
(``ClusterSpec.intra_node_gbps``, per GPU); across nodes, S (k - 1) / k into every node over
its NICs, of which the group's g GPUs get g / gpus_per_node (``inter_node_gbps``, per node;
the other GPUs of the node run their own groups' collectives at the same time), the NVLink
phase inside the node running alongside (the slower of the two counts); plus a latency per call.
Parameters and gradients move in ``activation_bytes`` (bf16: 2) bytes each; a layer holds
``params_b / num_layers`` of them (the embeddings spread over the layers).

A FlexSP micro-batch runs the whole model over all GPUs; a pipeline chunk runs its stage's
layers, sharded over the stage's own group (its SP ranks, inside one node). Calibration
(tests/unit/test_fixed_cost.py): the a100-40g-8x8 preset's published link figures reproduce the
FlexSP paper's fitted b1 for gpt-7b, 13b and 30b at ZeRO-3 within 6% with one launch constant per
layer (0.87 ms, fwd+bwd) fitted over the three.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

GATHERS_PER_PASS = 2  # ZeRO-3: before the forward and again before the backward of every layer
EXPOSED_REDUCES_PER_PASS = 1  # ZeRO-3: the last layer's gradient reduce-scatter ends the pass
EXPOSED_STEP_COLLECTIVES = 2  # ZeRO 0/1/2: one layer's reduce and one layer's gather per step


def group_span(cluster, ranks: Sequence[int]) -> tuple[int, int]:
    """(nodes, most GPUs on one node) of a group of ranks (rank r on node r // gpus_per_node)."""
    if not len(ranks):
        return 0, 0
    per_node = np.unique(np.asarray(ranks) // cluster.gpus_per_node, return_counts=True)[1]
    return len(per_node), int(per_node.max())


def collective_ms(cluster, nbytes: float, ranks: Sequence[int]) -> float:
    """One all-gather or reduce-scatter of a tensor of ``nbytes`` (the whole, unsharded) over the
    group of ``ranks``."""
    n = len(ranks)
    if n <= 1 or nbytes <= 0:
        return 0.0
    k, g = group_span(cluster, ranks)
    intra = nbytes * (g - 1) / g / (cluster.intra_node_gbps * 1e6) if g > 1 else 0.0  # GB/s -> bytes/ms
    if k == 1:
        return intra + cluster.intra_node_latency
    share = cluster.inter_node_gbps * g / cluster.gpus_per_node
    inter = nbytes * (k - 1) / k / (share * 1e6)
    return max(inter, intra) + cluster.inter_node_latency


def layer_param_bytes(model) -> float:
    return model.params_b * 1e9 / model.num_layers * model.activation_bytes


def pass_fixed_ms(model, cluster, zero_stage: int, layers: int, ranks: Sequence[int]) -> float:
    """Fixed cost of one fwd+bwd pass of ``layers`` layers whose parameters are sharded over
    ``ranks`` (under ZeRO-3): launch share, exposed gathers and the last reduce-scatter."""
    launch = model.launch_ms * layers / model.num_layers
    if zero_stage != 3 or len(ranks) <= 1 or layers <= 0:
        return launch
    one = collective_ms(cluster, layer_param_bytes(model), ranks)
    return launch + (GATHERS_PER_PASS * layers + EXPOSED_REDUCES_PER_PASS) * one


def step_sync_ms(model, cluster, ranks: Sequence[int]) -> float:
    """What a once-per-step gradient sync adds to a step beyond the passes: one layer's reduction
    and one layer's parameter gather (an all-reduce's two halves) over the ``ranks`` that hold
    copies (or shards) of the same parameters ``model`` has. ZeRO 0/1/2: the model's (or a stage's)
    parameters over its data-parallel GPUs. ZeRO-3 reduces per pass inside the group that shards
    them; only replicas of that group (pipeline replicas, each sharding a stage over its own SP
    ranks) still all-reduce each GPU's shard with its peers once a step."""
    if len(ranks) <= 1:
        return 0.0
    return EXPOSED_STEP_COLLECTIVES * collective_ms(cluster, layer_param_bytes(model), ranks)


__all__ = ["collective_ms", "group_span", "layer_param_bytes", "pass_fixed_ms", "step_sync_ms"]
