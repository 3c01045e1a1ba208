"""`megatron-ext bench planner --gpus 64,256,...`: plan quality and latency across cluster sizes.

The cluster of the cost model scaled to each GPU count (its nodes, links and memory as they are),
batches of ``per_gpu`` sequences per GPU. Per plan: plan time and whether it held the time limit
(within 5%), the step against the FlexSP lower bound and against the any-degree bound
(cost/bounds.py), and two shares of the step that say what the rest is made of:

- idle: GPU-time idle inside micro-batches (GPUs in no group, and groups done before the
  micro-batch's slowest), over N x step. What timelines without a barrier between micro-batches
  could reclaim at most, if each set of GPUs ran its own passes back to back.
- path: the longest sequence alone at its fastest allowed degree, with one pass's fixed cost,
  over the step: the part of the step no layout bound by the head limit can shorten.
"""
from __future__ import annotations

import dataclasses
import statistics

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.data.lengths import sample_lengths
from megatron_ext.errors import ConfigError
from megatron_ext.planner import PlannerOptions, make_plan
from megatron_ext.planner.api import get_planner, planner_names

LIMIT_SLACK = 1.05  # a plan "held" its time limit when it took at most 5% more


def parse_gpu_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--gpus takes comma-separated GPU counts, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise ConfigError(f"--gpus takes positive GPU counts, got {text!r}")
    return counts


def scaled_cost(cost: CostModel, gpus: int) -> CostModel:
    """The same model on ``gpus`` GPUs of the cost model's cluster kind (whole nodes)."""
    per_node = cost.cluster.gpus_per_node
    if gpus % per_node:
        raise ConfigError(f"{gpus} GPUs is not a whole number of {cost.cluster.name}'s {per_node}-GPU nodes")
    cluster = dataclasses.replace(cost.cluster, num_nodes=gpus // per_node, name=f"{cost.cluster.name} x {gpus} GPUs")
    return dataclasses.replace(cost, cluster=cluster)


def step_shares(plan, lengths: np.ndarray, cost: CostModel) -> tuple[float, float]:
    """(idle, path) of a FlexSP-kind plan, as fractions of its step (module docstring)."""
    step_ms = plan.estimated_step_time_s * 1e3
    idle = 0.0
    for mb in plan.micro_batches:
        busy = sum(g.degree * cost.group_time_ms(lengths[g.seq_ids], g.degree) for g in mb.groups)
        idle += cost.num_gpus * mb.estimated_time_s * 1e3 - busy
    longest = int(np.delete(lengths, plan.dropped_seq_ids).max())
    path = cost.micro_batch_fixed_ms + min(cost.group_time_ms([longest], d) - cost.micro_batch_fixed_ms
                                           for d in cost.degrees if longest <= cost.token_capacity(d))
    return idle / (cost.num_gpus * step_ms), path / step_ms


def bench_scale(cost: CostModel, gpus: list[int], dists: list[str], batches: int, per_gpu: int, max_seq_len: int,
                options: PlannerOptions, planner: str = "flexsp") -> dict:
    if per_gpu < 1:
        raise ConfigError(f"--per-gpu must be at least 1, got {per_gpu}")
    if get_planner(planner).kind != "sp":  # (the shares and the any-degree bound are of micro-batch plans)
        raise ConfigError(f"--gpus measures FlexSP-kind planners ({', '.join(planner_names('sp'))}), not {planner}")
    options = dataclasses.replace(options, drop_over_max=True)
    rows = []
    for n in gpus:
        big = scaled_cost(cost, n)
        for dist in dists:
            for seed in range(batches):
                lengths = sample_lengths(dist, per_gpu * n, seed, max_seq_len)
                plan = make_plan(planner, lengths, big, options)
                idle, path = step_shares(plan, lengths, big)
                step = plan.estimated_step_time_s
                rows.append({
                    "num_gpus": n, "dist": dist, "seed": seed, "seqs": len(lengths), "dropped": len(plan.dropped_seq_ids),
                    "micro_batches": len(plan.micro_batches), "solve_time_s": plan.solve_time_s,
                    "held_time_limit": plan.solve_time_s <= options.time_limit * LIMIT_SLACK, "status": plan.solver_status,
                    "step_time_s": step, "lower_bound_s": plan.lower_bound_step_time_s,
                    "relaxed_bound_s": plan.relaxed_bound_step_time_s,
                    "ratio_to_bound": step / plan.lower_bound_step_time_s,
                    "ratio_to_relaxed_bound": step / plan.relaxed_bound_step_time_s,
                    "idle_share": idle, "path_share": path,
                })
    head = (f"{planner} on {cost.model.name} / {cost.cluster.name} scaled, {per_gpu} sequences per GPU, "
            f"max length {max_seq_len:,}, time limit {options.time_limit:g} s")
    cols = (f"{'GPUs':>5}{'seqs':>7} {'dist':<12}{'seed':>4}{'drop':>5}{'mbs':>4}{'plan s':>8}{'held':>5}"
            f"{'step s':>8}{'bound':>8}{'x':>7}{'any-deg':>8}{'x':>7}{'idle':>6}{'path':>6}")
    lines = [head, "", cols]
    for r in rows:
        lines.append(f"{r['num_gpus']:>5}{r['seqs']:>7} {r['dist']:<12}{r['seed']:>4}{r['dropped']:>5}"
                     f"{r['micro_batches']:>4}{r['solve_time_s']:>8.2f}{'yes' if r['held_time_limit'] else 'NO':>5}"
                     f"{r['step_time_s']:>8.2f}{r['lower_bound_s']:>8.2f}{r['ratio_to_bound']:>7.3f}"
                     f"{r['relaxed_bound_s']:>8.2f}{r['ratio_to_relaxed_bound']:>7.3f}"
                     f"{r['idle_share']:>6.0%}{r['path_share']:>6.0%}")
    summary = []
    lines.append("")
    for n in gpus:
        mine = [r for r in rows if r["num_gpus"] == n]
        s = {"num_gpus": n, "held": sum(r["held_time_limit"] for r in mine), "plans": len(mine),
             "max_solve_time_s": max(r["solve_time_s"] for r in mine),
             "median_ratio_to_bound": statistics.median(r["ratio_to_bound"] for r in mine),
             "median_ratio_to_relaxed_bound": statistics.median(r["ratio_to_relaxed_bound"] for r in mine)}
        summary.append(s)
        lines.append(f"{n:>5} GPUs: time limit held by {s['held']}/{s['plans']} plans (max {s['max_solve_time_s']:.2f} s); "
                     f"step / bound median {s['median_ratio_to_bound']:.3f}, "
                     f"/ any-degree bound median {s['median_ratio_to_relaxed_bound']:.3f}")
    lines.append("idle: GPU-time idle inside micro-batches over N x step; path: the longest sequence alone at its "
                 "fastest allowed degree (with b1) over the step")
    return {"rows": rows, "summary": summary, "table": "\n".join(lines)}


__all__ = ["bench_scale", "parse_gpu_counts", "scaled_cost", "step_shares"]
