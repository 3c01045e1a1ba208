from megatron_ext.plan.schema import (Chunk, MicroBatchPlan, Piece, Pipeline, SPGroup, StepPlan, fill_estimates,
                                      validate)

__all__ = ["Chunk", "MicroBatchPlan", "Piece", "Pipeline", "SPGroup", "StepPlan", "fill_estimates", "validate"]
