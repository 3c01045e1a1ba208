"""`megatron-ext bench planner --gpus 64,256,...`: plan quality and latency across cluster sizes.

The cluster of the cost model scaled to each GPU count (its nodes, links and memory as they are),
batches of ``per_gpu`` sequences per GPU, each planned by every planner asked for (``bench``: the
``--planner`` and ``timelines``, the barrier-free one, which needs ZeRO 0/1/2: under ZeRO-3 its
rows are left out and the table says so). Per plan: plan time and whether it held the time limit
(within 5%), the step against three bounds (cost/bounds.py): FlexSP's with a barrier between
micro-batches (a barrier-free plan may beat it: that is the barrier's cost), the any-degree bound,
and the barrier-free bound that no FlexSP-kind plan beats; and two shares of the step that say
what the rest is made of:

- idle: GPU-time idle before the last pass ends (GPUs in no group, groups done before a
  micro-batch's slowest, sets done before the slowest set), over N x step.
- path: the longest sequence alone at its fastest allowed degree, with one pass's fixed cost,
  over the step: the part of the step no layout bound by the head limit can shorten.
"""
from __future__ import annotations

import dataclasses
import statistics

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.data.lengths import MAX_BATCH, sample_lengths
from megatron_ext.errors import ConfigError, MegatronExtError
from megatron_ext.planner import PlannerOptions, make_plan
from megatron_ext.plan import group_starts_ms
from megatron_ext.planner.api import PLANNERS
from megatron_ext.spec import MAX_GPUS, validate_cluster

LIMIT_SLACK = 1.05  # a plan "held" its time limit when it took at most 5% more


def parse_gpu_counts(text: str) -> list[int]:
    try:
        counts = list(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))  # (each once, in order)
    except ValueError:
        raise ConfigError(f"--gpus takes comma-separated GPU counts, got {text!r}") from None
    if not counts or min(counts) < 1 or max(counts) > MAX_GPUS:
        raise ConfigError(f"--gpus takes GPU counts from 1 to {MAX_GPUS:,}, got {text!r}")
    return counts


def scaled_cost(cost: CostModel, gpus: int) -> CostModel:
    """The same model on ``gpus`` GPUs of the cost model's cluster kind (whole nodes)."""
    per_node = cost.cluster.gpus_per_node
    if gpus % per_node:
        raise ConfigError(f"{gpus} GPUs is not a whole number of {cost.cluster.name}'s {per_node}-GPU nodes")
    cluster = validate_cluster(dataclasses.replace(cost.cluster, num_nodes=gpus // per_node,
                                                   name=f"{cost.cluster.name} x {gpus} GPUs"))
    return dataclasses.replace(cost, cluster=cluster)


def step_shares(plan, lengths: np.ndarray, cost: CostModel) -> tuple[float, float]:
    """(idle, path) of a FlexSP-kind plan, as fractions of its step (module docstring)."""
    step_ms = plan.estimated_step_time_s * 1e3
    _, times, end = group_starts_ms(plan, lengths, cost)
    busy = sum(g.degree * t for mb, ts in zip(plan.micro_batches, times) for g, t in zip(mb.groups, ts))
    longest = int(np.delete(lengths, plan.dropped_seq_ids).max())
    path = cost.micro_batch_fixed_ms + min(cost.group_time_ms([longest], d) - cost.micro_batch_fixed_ms
                                           for d in cost.degrees if longest <= cost.token_capacity(d))
    return (cost.num_gpus * end - busy) / (cost.num_gpus * step_ms), path / step_ms


def bench_scale(cost: CostModel, gpus: list[int], dists: list[str], batches: int, per_gpu: int, max_seq_len: int,
                options: PlannerOptions, planners: tuple[str, ...] = ("flexsp",)) -> dict:
    if per_gpu < 1:
        raise ConfigError(f"--per-gpu must be at least 1, got {per_gpu}")
    if per_gpu * max(gpus) > MAX_BATCH:
        raise ConfigError(f"--per-gpu {per_gpu:,} x {max(gpus):,} GPUs is {per_gpu * max(gpus):,} sequences a batch, "
                          f"over {MAX_BATCH:,}")
    left_out = [p for p in planners if PLANNERS[p].barrier_free and cost.zero_stage == 3]
    planners = tuple(p for p in planners if p not in left_out)
    if not planners:
        raise ConfigError(f"{', '.join(left_out)} runs passes without barriers, which ZeRO-3 cannot (every pass "
                          f"gathers the parameters over every GPU): use --zero-stage 0, 1 or 2")
    options = dataclasses.replace(options, drop_over_max=True)
    scaled = {}  # (every count refused or accepted before any is planned)
    for n in gpus:
        try:
            scaled[n] = scaled_cost(cost, n)
            _ = scaled[n].tokens_per_gpu  # (raises where the model states leave FlexSP no activation room)
        except MegatronExtError as e:
            raise ConfigError(f"--gpus {n}: {e}") from None
    rows = []
    for n in gpus:
        big = scaled[n]
        for dist in dists:
            for seed in range(batches):
                lengths = sample_lengths(dist, per_gpu * n, seed, max_seq_len)
                for planner in planners:
                    rows.append(_row(planner, n, dist, seed, lengths, big, options))
    head = (f"{', '.join(planners)} on {cost.model.name} / {cost.cluster.name} scaled, ZeRO-{cost.zero_stage}"
            + (f", ring up to {cost.max_ring}" if cost.max_ring > 1 else "")
            + f", {per_gpu} sequences per GPU, max length {max_seq_len:,}, time limit {options.time_limit:g} s")
    w = max(len("planner"), *map(len, planners)) + 1
    cols = (f"{'GPUs':>8}{'seqs':>10} {'dist':<12}{'seed':>4} {'planner':<{w}}{'drop':>5}{'mbs':>4}{'plan s':>8}"
            f"{'held':>5}{'step s':>8}{'mb-bd':>8}{'x':>7}{'any-deg':>8}{'x':>7}{'no-bar':>8}{'x':>7}{'idle':>6}"
            f"{'path':>6}")
    lines = [head, "", cols]
    for r in rows:
        lines.append(f"{r['num_gpus']:>8,}{r['seqs']:>10,} {r['dist']:<12}{r['seed']:>4} {r['planner']:<{w}}"
                     f"{r['dropped']:>5}{r['micro_batches']:>4}{r['solve_time_s']:>8.3f}"
                     f"{'yes' if r['held_time_limit'] else 'NO':>5}{r['step_time_s']:>8.2f}"
                     f"{r['lower_bound_s']:>8.2f}{r['ratio_to_bound']:>7.3f}"
                     f"{r['relaxed_bound_s']:>8.2f}{r['ratio_to_relaxed_bound']:>7.3f}"
                     f"{r['barrier_free_bound_s']:>8.2f}{r['ratio_to_barrier_free_bound']:>7.3f}"
                     f"{r['idle_share']:>6.0%}{r['path_share']:>6.0%}")
    summary = []
    lines.append("")
    for n in gpus:
        for planner in planners:
            mine = [r for r in rows if r["num_gpus"] == n and r["planner"] == planner]
            s = {"num_gpus": n, "planner": planner, "held": sum(r["held_time_limit"] for r in mine),
                 "plans": len(mine), "max_solve_time_s": max(r["solve_time_s"] for r in mine),
                 "median_step_time_s": statistics.median(r["step_time_s"] for r in mine),
                 **{f"median_{k}": statistics.median(r[k] for r in mine)
                    for k in ("ratio_to_bound", "ratio_to_relaxed_bound", "ratio_to_barrier_free_bound")}}
            summary.append(s)
            lines.append(f"{n:>7,} GPUs, {planner:<{w - 1}}: time limit held by {s['held']}/{s['plans']} plans (max "
                         f"{s['max_solve_time_s']:.3f} s); step median {s['median_step_time_s']:.2f} s, / bound "
                         f"{s['median_ratio_to_bound']:.3f}, / any-degree bound "
                         f"{s['median_ratio_to_relaxed_bound']:.3f}, / barrier-free bound "
                         f"{s['median_ratio_to_barrier_free_bound']:.3f}")
    lines.append("mb-bd: FlexSP's bound with a barrier between micro-batches (a barrier-free plan may beat it); "
                 "any-deg: the same, any number of GPUs per sequence; no-bar: the barrier-free bound, below every "
                 "FlexSP-kind plan; mbs: passes of the busiest GPU; idle: GPU-time idle before the last pass ends over "
                 "N x step; path: the longest sequence alone at its fastest allowed degree (with b1) over the step")
    for p in left_out:
        lines.append(f"{p}: no rows at ZeRO-3 (without a barrier, GPU sets cannot share ZeRO-3's parameter gathers "
                     f"over every GPU in each pass); pass --zero-stage 2 (or 1, 0) to bench it")
    return {"rows": rows, "summary": summary, "left_out": left_out, "table": "\n".join(lines)}


def _row(planner: str, n: int, dist: str, seed: int, lengths: np.ndarray, cost: CostModel,
         options: PlannerOptions) -> dict:
    plan = make_plan(planner, lengths, cost, options)
    idle, path = step_shares(plan, lengths, cost)
    step = plan.estimated_step_time_s
    kept = np.delete(lengths, plan.dropped_seq_ids)
    bound = (cost.lower_bound_ms(kept) + cost.step_sync_ms) / 1e3  # (a barrier-free plan's own is the next)
    free = cost.barrier_free_bound_ms(kept) / 1e3
    passes = np.zeros(cost.num_gpus, dtype=np.int64)
    for mb in plan.micro_batches:
        for g in mb.groups:
            passes[g.ranks] += 1
    return {
        "num_gpus": n, "dist": dist, "seed": seed, "planner": planner, "seqs": len(lengths),
        "dropped": len(plan.dropped_seq_ids), "micro_batches": int(passes.max()), "solve_time_s": plan.solve_time_s,
        "held_time_limit": plan.solve_time_s <= options.time_limit * LIMIT_SLACK, "status": plan.solver_status,
        "step_time_s": step, "lower_bound_s": bound, "relaxed_bound_s": plan.relaxed_bound_step_time_s,
        "barrier_free_bound_s": free, "ratio_to_bound": step / bound,
        "ratio_to_relaxed_bound": step / plan.relaxed_bound_step_time_s, "ratio_to_barrier_free_bound": step / free,
        "idle_share": idle, "path_share": path,
    }


__all__ = ["bench_scale", "parse_gpu_counts", "scaled_cost", "step_shares"]
