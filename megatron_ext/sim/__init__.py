"""Discrete-event simulation of StepPlans (elastic pipelines and FlexSP micro-batches).

``simulate(plan, lengths, cost)`` -> SimResult; ``simulate_table(...)`` runs every planner on many
steps and prints one comparison table (imported lazily: it needs the planners).
"""
from megatron_ext.sim.simulator import Event, SimResult, simulate

__all__ = ["Event", "SimResult", "simulate", "simulate_table"]


def __getattr__(name):
    if name == "simulate_table":
        from megatron_ext.sim.table import simulate_table

        return simulate_table
    raise AttributeError(name)
