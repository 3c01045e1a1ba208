"""Planners: pure functions from a batch's lengths, a cost model and options to a StepPlan."""
from megatron_ext.planner.api import PLANNERS, PlannerOptions, make_plan

__all__ = ["PLANNERS", "PlannerOptions", "make_plan"]
