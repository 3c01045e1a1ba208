"""Discrete-event simulation of StepPlans (elastic pipelines and FlexSP micro-batches).

``simulate(plan, lengths, cost)`` -> SimResult. (``megatron-ext simulate``'s table of every planner
over many steps is ``commands/table.py``: it needs the planners, a layer above.)

- ``simulator``: ``simulate``, a plan of either kind timed and its memory checked, and
  ``simulated_op_times``, its operation times for the runtime's message order;
- ``engine``: the elastic pipeline's event loop, list scheduling and 1F1B orders, memory levels;
- ``trace``: the simulated and measured steps as a Chrome trace (Perfetto).
"""
from megatron_ext.sim.simulator import Event, SimResult, simulate, simulated_op_times

__all__ = ["Event", "SimResult", "simulate", "simulated_op_times"]
