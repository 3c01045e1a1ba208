"""A step as Chrome trace-event JSON (``--trace FILE.json``): Perfetto (ui.perfetto.dev) and
chrome://tracing open it.

A timeline is one trace process (``planned``: the simulator's timeline of a plan); its tracks
(threads) are the rows of ``--plot``'s timeline: one per GPU for FlexSP plans, one per stage (per
replica and stage when replicas run side by side) for pipelines. Each interval of the timeline is
a complete ("X") slice: an SP group's pass on each of its GPUs, a chunk's forward, backward or
recompute on a stage, a p2p transfer after it; its ``args`` name what it runs (sequence ids, a
chunk's pieces, the group's ranks). Memory per GPU is a counter track per row, in GB, with the
budget beside it. Times are microseconds from the step's start. ``trace_document`` puts several
timelines in one file (``train --trace``: planned and measured side by side).
"""
from __future__ import annotations

import json

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.files import replacing
from megatron_ext.plan.schema import StepPlan
from megatron_ext.sim.simulator import simulate

_KIND_NAMES = {"F": "forward", "B": "backward", "R": "recompute", "P2P": "p2p", "MB": "SP group"}


def _us(seconds: float) -> float:
    return round(float(seconds) * 1e6, 3)


def process_events(pid: int, name: str, rows: list[str]) -> list[dict]:
    """The metadata events naming a trace process and its tracks (sorted as given)."""
    events = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
              {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
    for tid, row in enumerate(rows):
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": row}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return events


def slice_event(pid: int, tid: int, name: str, kind: str, start_s: float, end_s: float, args: dict) -> dict:
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": _KIND_NAMES.get(kind, kind),
            "ts": _us(start_s), "dur": _us(max(0.0, end_s - start_s)), "args": args}


def row_names(plan: StepPlan, cost: CostModel) -> list[str]:
    if plan.kind == "flexsp":
        return [f"GPU {r}" for r in range(cost.num_gpus)]
    stages = plan.pipelines[0].stages
    replicas = cost.num_gpus // (stages * plan.pipelines[0].sp_degree)
    return [f"replica {r} stage {p}" if replicas > 1 else f"stage {p}" for r in range(replicas) for p in range(stages)]


def _what_runs(plan: StepPlan, lengths: np.ndarray):
    """label of a simulator event -> (slice name without its kind, args)."""
    if plan.kind == "flexsp":
        groups = {(m, r): g for m, mb in enumerate(plan.micro_batches) for g in mb.groups for r in g.ranks}

        def flexsp(label: str, where: int):
            m = int(label[2:label.index(":")])
            g = groups[(m, where)]
            ids = [int(s) for s in g.seq_ids]
            return (f"d{len(g.ranks)}: {len(ids)} seq",
                    {"micro_batch": m, "ranks": list(g.ranks), "seq_ids": ids,
                     "tokens": int(lengths[ids].sum()) if ids else 0})
        return flexsp
    several = len(plan.pipelines) > 1

    def pipeline(label: str, where: int):
        pi, cid = label.split(":")
        pi, cid = int(pi[1:]), int(cid)
        chunk = next(c for c in plan.pipelines[pi].chunks if c.id == cid)
        pieces = [{"seq_id": p.seq_id, "start": p.start, "end": p.end} for p in chunk.pieces]
        return (f"{pi}.{cid}" if several else f"{cid}",
                {"pipeline": pi, "chunk": cid, "pieces": pieces, "tokens": sum(p.end - p.start for p in chunk.pieces)})
    return pipeline


def plan_trace_events(plan: StepPlan, lengths, cost: CostModel, *, pid: int = 1, process: str = "planned",
                      offset_s: float = 0.0, b1_scale: float = 1.0) -> list[dict]:
    """The simulated timeline of ``plan`` as trace events of process ``pid``, starting at
    ``offset_s`` (a run's steps one after another)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    res = simulate(plan, lengths, cost, b1_scale=b1_scale, events=True)
    rows = row_names(plan, cost)
    events = process_events(pid, f"{process}: {plan.planner} ({plan.kind})", rows)
    what = _what_runs(plan, lengths)
    for e in res.events:
        name, args = what(e.label, e.where)
        prefix = {"MB": "", "P2P": "p2p "}.get(e.kind, e.kind)  # F12, B12, R12, p2p 12, d4: 3 seq
        events.append(slice_event(pid, e.where, prefix + name, e.kind, offset_s + e.start_s, offset_s + e.end_s,
                                  args))
    budget_gb = res.budget_mb / 1024
    for row, points in enumerate(res.memory):
        for t, mb in points:
            events.append({"ph": "C", "pid": pid, "tid": row, "name": f"memory {rows[row]} (GB)",
                           "ts": _us(offset_s + t), "args": {"used": round(mb / 1024, 4), "budget": round(budget_gb, 4)}})
    return events


def group_spans(plan: StepPlan, rank_micro_batch_s) -> list[list[tuple[float, dict[int, float]]]]:
    """Each FlexSP micro-batch's groups as they ran, from every rank's micro-batch times
    (``rank_micro_batch_s[r][m]``: rank r's seconds in micro-batch m, each starting where the last
    ended, from the step's start): per micro-batch, per group, (its start, each of its ranks' end).
    Nothing synchronises ranks between micro-batches, so a rank idle or done early in one starts the
    next early and waits in its group's first all-to-all: the group works from the latest of its
    ranks' starts."""
    took = np.asarray(rank_micro_batch_s, dtype=np.float64)
    ends = np.cumsum(took, axis=1)  # (each rank's micro-batches one after another)
    spans = []
    for m, mb in enumerate(plan.micro_batches):
        row = []
        for g in mb.groups:
            row.append((max(float(ends[r, m] - took[r, m]) for r in g.ranks), {r: float(ends[r, m]) for r in g.ranks}))
        spans.append(row)
    return spans


def measured_micro_batch_s(plan: StepPlan, rank_micro_batch_s) -> list[float]:
    """Each FlexSP micro-batch's time as measured, comparable with its estimate: its slowest
    group's, from the group's start to its last rank's end (``group_spans``)."""
    return [max((max(ends.values()) - start for start, ends in row), default=0.0)
            for row in group_spans(plan, rank_micro_batch_s)]


def measured_flexsp_events(plan: StepPlan, lengths, cost: CostModel, rank_micro_batch_s, *, pid: int,
                           offset_s: float = 0.0) -> list[dict]:
    """A FlexSP step as it ran (``rank_micro_batch_s``: see ``group_spans``): a slice for each
    group on each of its GPUs, from the group's start to that GPU's end."""
    lengths = np.asarray(lengths, dtype=np.int64)
    events = process_events(pid, f"measured: {plan.planner} ({plan.kind})", row_names(plan, cost))
    what = _what_runs(plan, lengths)
    for m, row in enumerate(group_spans(plan, rank_micro_batch_s)):
        for start, ends in row:
            for r, end in ends.items():
                name, args = what(f"mb{m}:", r)
                events.append(slice_event(pid, r, name, "MB", offset_s + start, offset_s + end, args))
    return events


def measured_pipeline_events(plan: StepPlan, lengths, cost: CostModel, ops_per_row: list[list[tuple]], *, pid: int,
                             offset_s: float = 0.0) -> list[dict]:
    """A pipeline step as it ran: per row (stage, or replica and stage) its ops as (name like "F3"
    or "B3 of pipeline 1", start s from the step's start, seconds)."""
    events = process_events(pid, f"measured: {plan.planner} ({plan.kind})", row_names(plan, cost))
    what = _what_runs(plan, np.asarray(lengths, dtype=np.int64))
    for row, ops in enumerate(ops_per_row):
        for name, start, took in ops:
            chunk, _, pipeline = name[1:].partition(" of pipeline ")
            _, args = what(f"p{pipeline or 0}:{chunk}", row)
            events.append(slice_event(pid, row, name, name[0], offset_s + start, offset_s + start + took, args))
    return events


def trace_document(events: list[dict], **metadata) -> dict:
    return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": metadata}


def write_trace(path: str, document: dict) -> None:
    with replacing(path) as tmp, open(tmp, "w") as f:
        json.dump(document, f)


def ops_per_row(stage_stats: list) -> list[list[tuple[str, float, float]]]:
    """``ops_per_row`` for ``measured_pipeline_events`` from every rank's (row, stats) (the
    runtime's PipelineStepStats: ``ops`` (name, seconds) and ``op_starts_s``), the first rank of
    each row standing for it."""
    rows: dict[int, list] = {}
    for row, st in stage_stats:
        rows.setdefault(row, [(name, start, took) for (name, took), start in zip(st.ops, st.op_starts_s)])
    return [rows.get(r, []) for r in range(max(rows) + 1)]


class RunTrace:
    """A run's steps one after another (``train --trace``): process 1 the planned timeline of each
    step, process 2 the measured one, each step starting at the same time in both (the later of
    the two ends starts the next), with an instant event naming it."""

    def __init__(self, cost: CostModel):
        self.cost = cost
        self.events: list[dict] = []
        self.now_s = 0.0

    def add_step(self, step: int, plan: StepPlan, lengths, measured_s: float, *, rank_micro_batch_s=None,
                 ops_per_row=None) -> None:
        """``rank_micro_batch_s`` (FlexSP: ``group_spans``) or ``ops_per_row`` (pipelines): what
        the step measured."""
        events = [{"ph": "i", "s": "g", "pid": 1, "tid": 0, "name": f"step {step}", "ts": _us(self.now_s)}]
        events += plan_trace_events(plan, lengths, self.cost, pid=1, offset_s=self.now_s)
        if plan.kind == "elastic_pp":
            events += measured_pipeline_events(plan, lengths, self.cost, ops_per_row, pid=2, offset_s=self.now_s)
        else:
            events += measured_flexsp_events(plan, lengths, self.cost, rank_micro_batch_s, pid=2, offset_s=self.now_s)
        drawn_s = max((e["ts"] + e["dur"] for e in events if e["ph"] == "X"), default=0.0) / 1e6 - self.now_s
        self.events += events
        self.now_s += max(measured_s, drawn_s)
