"""Discrete-event simulation of StepPlans (elastic pipelines and FlexSP micro-batches).

``simulate(plan, lengths, cost)`` -> SimResult. (``megatron-ext simulate``'s table of every planner
over many steps is ``commands/table.py``: it needs the planners, a layer above.)
"""
from megatron_ext.sim.simulator import Event, SimResult, simulate

__all__ = ["Event", "SimResult", "simulate"]
