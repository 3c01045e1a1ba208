"""The cost model a Megatron-LM run plans with (``--cost-model``), and the SP-degree cap.

Pure Python (no torch, no megatron): the planner process of the data loader unpickles the cost
model, so this module must import in a process that has neither.

``--cost-model`` takes one of:

* a cost-model YAML file (``model:`` and ``cluster:``, preset names or inline fields, and
  optionally ``zero_stage:``; see ``megatron_ext.cost.model.CostModel.from_yaml``), e.g.
  ``configs/megatron/cost/tiny-cpu2.yaml``;
* ``MODEL:CLUSTER[:ZERO]``, a model and a cluster preset (or YAML paths; ``megatron_ext.spec``)
  and optionally the ZeRO stage, e.g. ``gpt-7b:a100-40g-8x8:1``.

The bytes a parameter of model states (``megatron_state_bytes``: 16, 18 with ``--bf16``'s fp32
gradient buffers) and the ZeRO stage (how much of them each GPU holds, the rest of its memory
being the planner's room for activations) are the ones Megatron's own arguments build
(``megatron_zero_stage``): 1 with ``--use-distributed-optimizer`` (fp32 master weights and Adam
states sharded over the data-parallel ranks), else 0 (DDP: every rank holds all of them).
Megatron-FSDP and torch FSDP2 are refused (``arguments.py`` says why). A ``--cost-model`` that
states no stage (``MODEL:CLUSTER``, a YAML without ``zero_stage``) takes that one; one that states
another is an error, as the planner would budget memory the run does not have (or leave memory it
has unused). Everything in a run that plans (argument validation, the planning data loader) gets
its cost model from ``megatron_cost_model(args)``.

The cluster's GPU count must equal the job's data-parallel size (the ranks FlexSP spreads
sequences over). The Ulysses degrees the planner may use are capped by ``--flexsp-max-sp-size``
and by the heads of the model actually built (heads and KV heads per tensor-parallel rank must
divide by the degree), whatever the cost model's ModelSpec says.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from functools import cached_property

from megatron_ext.cost import CostModel
from megatron_ext.errors import ConfigError


@dataclass(frozen=True)
class CappedCostModel(CostModel):
    """A CostModel whose Ulysses degrees stop at ``max_degree`` (a power of two: what the run's
    heads per TP rank and ``--flexsp-max-sp-size`` allow); a ring (``max_ring``) extends groups
    past it."""

    max_degree: int | None = None

    def ulysses_degree(self, degree: int) -> int:
        return min(degree, self.model.max_sp_degree, self.max_degree or degree)

    @cached_property
    def degrees(self) -> tuple[int, ...]:
        top = min(self.num_gpus, self.ulysses_degree(self.num_gpus) * self.max_ring)
        return tuple(2**i for i in range(int(math.log2(top)) + 1))


def _looks_like_file(ref: str) -> bool:
    return ref.endswith((".yaml", ".yml")) or os.path.isfile(ref)


def load_cost_model(ref: str, zero_stage: int = 3) -> CostModel:
    """The cost model named by a ``--cost-model`` value (see the module doc); ``zero_stage`` is
    its stage where ``ref`` states none."""
    if not ref:
        raise ConfigError("--cost-model is empty")
    if _looks_like_file(ref):
        if not os.path.isfile(ref):
            raise ConfigError(f"--cost-model {ref}: no such file")
        return CostModel.from_yaml(ref, zero_stage)
    parts = ref.split(":")
    if len(parts) == 3 and parts[2].isdigit():
        parts, zero_stage = parts[:2], int(parts[2])
    if len(parts) == 2 and all(parts):
        return CostModel.from_presets(parts[0], parts[1], zero_stage)
    raise ConfigError(f"--cost-model {ref!r}: expected a cost-model YAML file or MODEL:CLUSTER[:ZERO] presets "
                      f"(e.g. gpt-7b:a100-40g-8x8:1)")


def megatron_zero_stage(args) -> tuple[int, str]:
    """The ZeRO stage of the model states that Megatron's arguments build, and why, in words.
    (Megatron-FSDP and torch FSDP2 never get here: ``arguments.validate_args`` refuses them.)"""
    if getattr(args, "use_distributed_optimizer", False):
        return 1, "--use-distributed-optimizer shards the optimizer states over the data-parallel ranks"
    return 0, "without --use-distributed-optimizer every rank holds all model states"


def megatron_state_bytes(args) -> tuple[int, int, int]:
    """Bytes a parameter of the model states Megatron's arguments build, (weights, gradients,
    optimizer): with --bf16, fp32 gradient buffers unless --grad-reduce-in-bf16 or
    --main-grads-dtype bf16 (as Megatron's argument check sets them); with --fp16, fp32 ones only
    under --accumulate-allreduce-grads-in-fp32; both with fp32 master weights and Adam moments. An
    fp32 run keeps 4-byte weights and gradients and no master copy."""
    if getattr(args, "bf16", False):
        bf16_grads = getattr(args, "grad_reduce_in_bf16", False) or "bf" in str(getattr(args, "main_grads_dtype", ""))
        return 2, 2 if bf16_grads else 4, 12
    if getattr(args, "fp16", False):
        return 2, 4 if getattr(args, "accumulate_allreduce_grads_in_fp32", False) else 2, 12
    return 4, 4, 8


def megatron_recompute(args) -> tuple[str, int | None]:
    """The recompute policy the run's model runs, as a cost model states one (``ModelSpec``'s
    ``recompute``, ``recompute_layers``): none where the planner decides it per chunk (--elastic-pp,
    --flexsp-planner auto: Megatron's full recompute is refused there); else Megatron's: full with
    --recompute-method block, its --recompute-num-layers layers; uniform, every layer (each keeps at
    most its input); selective (the attention core alone) counts as none, its small saving left out
    (memory over-, never under-estimated)."""
    if getattr(args, "elastic_pp", False) or getattr(args, "flexsp_planner", None) == "auto":
        return "none", None
    if getattr(args, "recompute_granularity", None) != "full":
        return "none", None
    if getattr(args, "recompute_method", None) == "block":
        return "full", min(int(args.recompute_num_layers), int(args.num_layers))
    return "full", None


def megatron_cost_model(args) -> CostModel:
    """The planner's cost model of a --flexsp / --elastic-pp run: ``args.cost_model`` at the ZeRO
    stage of Megatron's arguments (``megatron_zero_stage``; one stating another stage is refused),
    with the bytes a parameter of its model states (``megatron_state_bytes``) and the recompute
    policy the run's model runs (``megatron_recompute``: a preset's own, which its published memory
    figure implies, is not what this run keeps)."""
    ref = args.cost_model
    stage, why = megatron_zero_stage(args)
    cost = dataclasses.replace(load_cost_model(ref, stage).with_max_ring(getattr(args, "flexsp_max_ring", None) or 1),
                               state_bytes=megatron_state_bytes(args))
    cost = cost.with_recompute(*megatron_recompute(args))
    if cost.zero_stage != stage:
        stated = f"zero_stage: {cost.zero_stage}" if _looks_like_file(ref) else f"ZeRO stage {cost.zero_stage}"
        run = dataclasses.replace(cost, zero_stage=stage)
        raise ConfigError(f"--cost-model {ref} says {stated}, but Megatron's arguments give stage {stage} ({why}): "
                          f"the planner would count {cost.model_states_mb:,.0f} MB of model states a GPU, not the "
                          f"run's {run.model_states_mb:,.0f} MB; drop the stage from --cost-model (it then follows "
                          f"the arguments) or make it {stage}")
    return cost


def head_degree_limit(num_attention_heads: int, num_query_groups: int | None, tensor_parallel: int = 1) -> int:
    """Largest power of two dividing the attention heads and KV heads of one TP rank."""
    heads = num_attention_heads // tensor_parallel
    kv = (num_query_groups or num_attention_heads) // tensor_parallel
    d = 1
    while heads % (2 * d) == 0 and kv % (2 * d) == 0:
        d *= 2
    return d


def cap_cost_model(cost: CostModel, max_degree: int | None) -> CostModel:
    """``cost`` with its Ulysses degrees capped at ``max_degree`` (unchanged if the cap does not bind)."""
    if max_degree is None or max_degree >= min(cost.num_gpus, cost.model.max_sp_degree):
        return cost
    fields = {f.name: getattr(cost, f.name) for f in dataclasses.fields(cost) if f.name != "max_degree"}
    return CappedCostModel(**fields, max_degree=int(max_degree))
