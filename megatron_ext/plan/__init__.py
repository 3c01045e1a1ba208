"""StepPlans: the data (``schema``), their checks against a batch and a cluster (``validate``) and
the pipeline program compiler of elastic pipelines (``program``, torch-free)."""
from megatron_ext.plan.schema import Chunk, MicroBatchPlan, Piece, Pipeline, SPGroup, StepPlan
from megatron_ext.plan.validate import fill_estimates, group_starts_ms, replica_groups, validate, validate_pipelines

__all__ = ["Chunk", "MicroBatchPlan", "Piece", "Pipeline", "SPGroup", "StepPlan", "fill_estimates", "group_starts_ms",
           "replica_groups", "validate", "validate_pipelines"]
