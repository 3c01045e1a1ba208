"""Discrete-event simulation of a StepPlan: timeline, step time, bubble ratio, peak memory.

- ``elastic_pp`` plans (one layout, ``validate.replica_groups``): each data-parallel replica
  (``Pipeline.replica``, on its own GPUs) runs its pipelines one after another (a pipeline starts
  on each stage as soon as that stage is done with the previous one); the step ends with the
  slowest replica. Every stage runs its operations in
  the plan's order; each operation starts when its stage is free and its dependencies (previous
  stage + p2p, earlier/later slices of the same sequence) are done. Recompute runs at the start
  of a backward. Memory is tracked per stage along its order (sim/engine.py).
- ``flexsp`` plans: micro-batches one after another; in each, every SP group runs its sequences
  (CostModel.group_time_ms); the micro-batch ends with its slowest group. Barrier-free plans
  (``StepPlan.barrier_free``): a group starts when the last of its own ranks is free, so each
  rank's events lie where they really run and ``bubble_ratio`` is the idle share of that timeline
  (plan/validate.py's ``group_starts_ms`` times both kinds, as ``fill_estimates`` does).
- Both: under ZeRO 0/1/2 the step ends with what its gradient sync leaves exposed
  (CostModel.step_sync_ms, PipelineCost.step_sync_ms; cost/fixed.py).

The simulator refuses (InvalidPlanError) a plan whose order deadlocks or whose memory exceeds the
budget, naming the pipeline, stage and operation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.cost.pipeline import PipelineCost
from megatron_ext.errors import InvalidPlanError, MegatronExtError
from megatron_ext.plan.program import (BWD, FWD, check_one_pipeline_per_sequence, chunk_layouts, list_schedule, op_name,
                                       parse_order)
from megatron_ext.plan.schema import StepPlan
from megatron_ext.plan.validate import group_starts_ms, replica_groups
from megatron_ext.sim.engine import analyze_chunks, memory_levels, op_times, warmup_counts


@dataclass
class Event:
    """One interval of a timeline: ``where`` is a stage (elastic_pp: replica x stages + stage) or a
    rank (flexsp)."""

    where: int
    kind: str  # "F", "B", "R" (recompute), "P2P" (send to where+1 / where-1), "MB" (a group's pass)
    label: str  # e.g. "p0:F12", "mb1:g[0..8)"
    start_s: float
    end_s: float


@dataclass
class SimResult:
    kind: str
    planner: str
    step_time_s: float
    bubble_ratio: float  # idle share of GPU-time (recompute counts as busy)
    recompute_ratio: float  # recompute share of GPU-time
    # per stage (elastic_pp; with replicas, replica-major: replica r's stage p at r x stages + p,
    # the row of its events) or rank (flexsp); memory with model states
    peak_memory_mb: list[float]
    busy_s: list[float]
    tokens: int
    num_gpus: int
    budget_mb: float
    warmup: list[list[int]] = field(default_factory=list)  # per pipeline, forwards before the first backward
    events: list[Event] = field(default_factory=list)
    # with events: per stage (elastic_pp) or rank (flexsp), the memory per GPU over time as the
    # corners of a piecewise-linear curve, [(time_s, MB with model states), ...]
    memory: list[list[tuple[float, float]]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def max_peak_memory_mb(self) -> float:
        return max(self.peak_memory_mb, default=0.0)

    def timeline(self, where: int) -> list[Event]:
        return sorted((e for e in self.events if e.where == where), key=lambda e: e.start_s)


def simulate(plan: StepPlan, lengths, cost: CostModel, *, b1_scale: float = 1.0, memory_mb: float | None = None,
             events: bool = True) -> SimResult:
    """Simulate one step of ``plan``; ``memory_mb`` is the per-GPU budget (default the cluster's)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if plan.kind == "flexsp":
        return _simulate_flexsp(plan, lengths, cost, memory_mb, events)
    if plan.kind != "elastic_pp":
        raise InvalidPlanError(f"cannot simulate a plan of kind {plan.kind!r}")
    return _simulate_pipelines(plan, lengths, cost, b1_scale, memory_mb, events)


def _simulate_flexsp(plan, lengths, cost, memory_mb, want_events) -> SimResult:
    n = cost.num_gpus
    budget = float(memory_mb) if memory_mb is not None else cost.cluster.memory_mb
    busy = np.zeros(n)
    peak = np.zeros(n)
    evs = []
    mem_pts: list[list[tuple[float, float]]] = [[(0.0, cost.model_states_mb)] for _ in range(n)] if want_events else []
    tokens = 0
    starts, times, end = group_starts_ms(plan, lengths, cost)
    for m, (mb, t0s, mss) in enumerate(zip(plan.micro_batches, starts, times)):
        for g, t, ms in zip(mb.groups, t0s, mss):
            d = len(g.ranks)
            mem = cost.group_memory_mb(float(lengths[g.seq_ids].sum()), d)
            if mem > budget * (1 + 1e-9):
                raise InvalidPlanError(f"micro-batch {m}, group of ranks {g.ranks[0]}..{g.ranks[-1]}: needs {mem:.0f} MB "
                                       f"per GPU, over the {budget:.0f} MB budget")
            busy[g.ranks] += ms / 1e3
            peak[g.ranks] = np.maximum(peak[g.ranks], mem)
            tokens += int(lengths[g.seq_ids].sum())
            if want_events:
                for r in g.ranks:
                    evs.append(Event(r, "MB", f"mb{m}:{len(g.seq_ids)}seq@d{d}", t / 1e3, (t + ms) / 1e3))
                    mem_pts[r] += [(t / 1e3, cost.model_states_mb), (t / 1e3, mem), ((t + ms) / 1e3, mem),
                                   ((t + ms) / 1e3, cost.model_states_mb)]
    t = end + (cost.step_sync_ms if plan.micro_batches else 0.0)  # ZeRO 0/1/2: the exposed gradient sync
    step = t / 1e3
    for pts in mem_pts:
        pts.append((step, cost.model_states_mb))
    return SimResult("flexsp", plan.planner, step, max(0.0, 1 - busy.sum() / (n * step)) if step > 0 else 0.0, 0.0,
                     peak.tolist(), busy.tolist(), tokens, n, budget, [], evs, mem_pts)


def simulated_op_times(cost: CostModel):
    """``plan.program.build_schedules``' ``op_time_of`` for a run on ``cost``: each pipeline's
    operations timed as the simulator times them (``op_times``, its recompute included), so the
    runtime posts its messages in the order the simulated step runs them. (``default_op_time``'s
    relative times, without fixed costs and with attention weighed ~16x the cost model's, put
    receives a stage's next operation did not need before it: steps of 4-8 stages ran 26-34% past
    the simulated one, replayed.)"""
    def op_time_of(pipe):
        pc = PipelineCost(cost, pipe.stages, pipe.sp_degree)
        table = analyze_chunks(pipe.chunks, pc)
        fwd, bwd, _, _ = op_times(table, pc, _recompute_matrix(pipe.chunks, pc.pp, pc.layers_per_stage, "pipeline"))
        index = table.index()
        return lambda chunk, kind, stage: float((fwd if kind == FWD else bwd)[stage, index[chunk.id]])
    return op_time_of


def _recompute_matrix(chunks, P: int, layers: int, where: str) -> np.ndarray:
    r = np.zeros((P, len(chunks)), dtype=np.int64)
    for i, c in enumerate(chunks):
        v = c.recompute_layers_per_stage
        if not v:
            continue
        if len(v) != P:
            raise InvalidPlanError(f"{where}, chunk {c.id}: recompute_layers_per_stage has {len(v)} entries for "
                                   f"{P} stages")
        for p, x in enumerate(v):
            if not isinstance(x, (int, np.integer)) or isinstance(x, bool) or not 0 <= x <= layers:
                raise InvalidPlanError(f"{where}, chunk {c.id}, stage {p}: recompute of {x!r} layers is outside "
                                       f"0..{layers} (the stage's layers)")
        r[:, i] = v
    return r


@dataclass
class _ReplicaRun:
    end_ms: float
    busy_gpu_ms: float
    rec_gpu_ms: float
    stage_busy: list[float]
    stage_peak: list[float]
    warm: list[list[int]]
    events: list[Event]
    memory: list[list[tuple[float, float]]]
    tokens: int


def _simulate_pipelines(plan, lengths, cost, b1_scale, memory_mb, want_events) -> SimResult:
    if not plan.pipelines:
        raise InvalidPlanError("an elastic_pp plan needs at least one pipeline")
    check_one_pipeline_per_sequence(plan.pipelines)
    n_gpus = cost.num_gpus
    replicas = replica_groups(plan, n_gpus)
    first = plan.pipelines[0]  # (the plan's one layout)
    try:
        pc = PipelineCost(cost, first.stages, first.sp_degree, b1_scale, memory_mb)
    except MegatronExtError as e:  # ConfigError / InfeasibleError: a plan the cluster cannot run
        raise InvalidPlanError(f"pipeline 0: {e}") from None
    for i, pipe in enumerate(plan.pipelines):  # (pieces that leave a gap or overlap are refused, not timed)
        chunk_layouts(pipe, lengths, pc.layers_per_stage, f"pipeline {i}")
    runs = [_simulate_replica(plan, idx, pc, want_events, r * pc.pp) for r, idx in enumerate(replicas)]
    # once per step, what the gradient sync leaves exposed
    t_end = max(run.end_ms for run in runs) + pc.step_sync_ms
    step = t_end / 1e3
    mem_pts = [[(float(t), float(v)) for t, v in pts + [(step, pts[-1][1])]] for run in runs for pts in run.memory]
    denom = n_gpus * t_end
    busy_gpu = sum(run.busy_gpu_ms for run in runs)
    rec_gpu = sum(run.rec_gpu_ms for run in runs)
    return SimResult("elastic_pp", plan.planner, step, max(0.0, 1 - busy_gpu / denom) if denom > 0 else 0.0,
                     rec_gpu / denom if denom > 0 else 0.0, [x for run in runs for x in run.stage_peak],
                     [x for run in runs for x in run.stage_busy], sum(run.tokens for run in runs), n_gpus,
                     pc.budget_mb, [w for run in runs for w in run.warm],
                     [e for run in runs for e in run.events], mem_pts)


def _simulate_replica(plan, pipes: list[int], pc: PipelineCost, want_events, row0: int) -> _ReplicaRun:
    """One replica's pipelines (of the plan's one layout, ``pc``: validate.replica_groups), one
    after another on its GPUs without a barrier; events on rows ``row0 + stage``. A replica with
    no pipeline idles: its stages hold their model states."""
    P, sp = pc.pp, pc.sp
    if not pipes:
        return _ReplicaRun(0.0, 0.0, 0.0, [0.0] * P, [pc.model_states_mb] * P, [], [],
                           [[(0.0, pc.model_states_mb)] for _ in range(P)] if want_events else [], 0)
    evs: list[Event] = []
    warm: list[list[int]] = []
    tokens = 0
    room = pc.activation_room_mb
    L_s = pc.layers_per_stage
    ops_all: list[list[tuple[int, int]]] = [[] for _ in range(P)]
    fwd_l, bwd_l, rec_l, p2p_l, fp, bp, labels = [], [], [], [], [], [], []
    peak = np.zeros(P)
    levels: list[list[np.ndarray]] = [[] for _ in range(P)]  # before, during, after per op (with events)
    off = 0
    for i in pipes:
        pipe = plan.pipelines[i]
        where = f"pipeline {i}"
        table = analyze_chunks(pipe.chunks, pc, where)
        ops = parse_order(pipe.order_per_stage, table, P, where)
        rec = _recompute_matrix(pipe.chunks, P, L_s, where)
        _, save = pc.chunk_memory(table.tokens, table.cached_tokens, False)
        for p in range(P):
            full, _ = pc.chunk_memory(table.tokens, table.cached_tokens, p == P - 1)
            # (one linear pass: a stage peaks during an operation, after a forward or while a
            # backward runs, as the recompute ILP's checkpoints have it)
            lv = memory_levels(ops[p], table, full, save, rec[p], pc)
            mem = lv[1]
            j = int(np.argmax(mem)) if len(mem) else 0
            if len(mem) and mem[j] > room * (1 + 1e-9) + 1e-6:
                kind, k = ops[p][j]
                raise InvalidPlanError(
                    f"{where}, stage {p}: {'after' if kind == FWD else 'during'} {op_name(kind, table.ids[k])} "
                    f"needs {mem[j] + pc.model_states_mb:.0f} MB per GPU ({pc.model_states_mb:.0f} MB model "
                    f"states + {mem[j]:.0f} MB activations), over the {pc.budget_mb:.0f} MB budget")
            peak[p] = max(peak[p], (mem.max() if len(mem) else 0.0) + pc.model_states_mb)
            if want_events:
                levels[p].append(np.stack(lv, axis=1))
        fwd, bwd, rc, p2p = op_times(table, pc, rec)
        fwd_l.append(np.broadcast_to(fwd, (P, table.n)))
        bwd_l.append(bwd)
        rec_l.append(rc)
        p2p_l.append(p2p)
        fp += [[j + off for j in x] for x in table.fwd_pred]
        bp += [[j + off for j in x] for x in table.bwd_pred]
        labels += [f"p{i}:{cid}" for cid in table.ids]
        for p in range(P):
            ops_all[p] += [(kind, k + off) for kind, k in ops[p]]
        warm.append(warmup_counts(ops))
        tokens += int(table.tokens.sum())
        off += table.n
    fwd = np.concatenate(fwd_l, axis=1)
    bwd = np.concatenate(bwd_l, axis=1)
    rc = np.concatenate(rec_l, axis=1)
    p2p = np.concatenate(p2p_l)

    def name(kind, k, labels=labels, single=len(pipes) == 1):
        pi, cid = labels[k].split(":")
        return op_name(kind, cid) + ("" if single else f" of pipeline {pi[1:]}")

    where = f"pipeline {pipes[0]}" if len(pipes) == 1 else f"pipelines {pipes[0]}..{pipes[-1]}"
    begin, end = list_schedule(ops_all, fwd, bwd, p2p, fp, bp, np.zeros(P), name, where)
    b = fwd.sum(axis=1) + bwd.sum(axis=1)
    mem_pts: list[list[tuple[float, float]]] = [[(0.0, pc.model_states_mb)] for _ in range(P)] if want_events else []
    if want_events:
        for p in range(P):
            for kind, k in ops_all[p]:
                s, e = begin[kind, p, k], end[kind, p, k]
                if kind == BWD and rc[p, k] > 0:
                    evs.append(Event(row0 + p, "R", labels[k], s / 1e3, (s + rc[p, k]) / 1e3))
                    s += rc[p, k]
                evs.append(Event(row0 + p, "FB"[kind], labels[k], s / 1e3, e / 1e3))
                if kind == FWD and p < P - 1:
                    evs.append(Event(row0 + p, "P2P", labels[k], e / 1e3, (e + p2p[k]) / 1e3))
                if kind == BWD and p > 0:
                    evs.append(Event(row0 + p, "P2P", labels[k], e / 1e3, (e + p2p[k]) / 1e3))
            lv = np.concatenate(levels[p]) + pc.model_states_mb
            pts = mem_pts[p]
            for j, (kind, k) in enumerate(ops_all[p]):
                s, e = begin[kind, p, k] / 1e3, end[kind, p, k] / 1e3
                if kind == FWD:  # activations build up over the forward
                    pts += [(s, lv[j, 0]), (e, lv[j, 2])]
                else:  # re-materialized for the backward, freed at its end
                    pts += [(s, lv[j, 0]), (s, lv[j, 1]), (e, lv[j, 1]), (e, lv[j, 2])]
    return _ReplicaRun(float(np.nanmax(end)), float(b.sum()) * sp, float(rc.sum()) * sp, (b / 1e3).tolist(),
                       peak.tolist(), warm, evs, mem_pts, tokens)
