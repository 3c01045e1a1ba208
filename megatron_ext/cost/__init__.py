"""The cost model: time and memory of what a plan runs, pure Python + numpy.

- ``model``: ``CostModel``, FlexSP's groups and micro-batches (compute, all-to-all, memory per GPU,
  lower bound, compute floor);
- ``fixed``: the fixed cost of a pass and of a step, derived from the launch constant, the ZeRO
  stage and the links;
- ``activations``: activation memory per token from the model's shape and recompute policy;
- ``bounds``: the lower bounds of a step (FlexSP's micro-batches, barrier-free sets, relaxed, a pipeline layout's);
- ``pipeline``: ``PipelineCost``, a chunk on a pipeline stage (time with its prefix, p2p,
  recompute, memory).
"""
from megatron_ext.cost.model import CostModel

__all__ = ["CostModel"]
