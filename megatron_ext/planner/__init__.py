"""Planners: pure functions from a batch's lengths, a cost model and options to a StepPlan.

``api``: every planner by name (``PLANNERS``) and the one entry point, ``make_plan``; ``sp/``:
FlexSP and its sequence-parallel baselines; ``pp/``: elastic pipelines and theirs; ``auto``: per
step, either; ``options``, ``packing``, ``highs``: what they share.
"""
from megatron_ext.planner.api import PLANNERS, make_plan
from megatron_ext.planner.options import PlannerOptions

__all__ = ["PLANNERS", "PlannerOptions", "make_plan"]
