"""Stage-aware chunk-level activation checkpointing (InfiniPipe Eq. 15-20, PAPERS.md section 2).

``r[p, k]`` = layers of chunk k recomputed on stage p (0 <= r <= L_s). At every moment a stage
can peak (after each forward, during each backward; ``sim.engine.Moments``) its memory is
``const - sum_{k in flight} save[k] * r[p, k]`` and must stay within the stage's activation room
(budget minus model states). Minimize the recompute time ``sum rc[k] * r[p, k]``.

Tied form (the paper's): ``r[p, k] = C[b(k) + P - 1 - p]`` with b(k) the chunk's position in the
backward order: the chunks on one diagonal of the 1F1B schedule (the same backward step shifted
by one per stage) recompute the same number of layers, so a recomputation delays every stage
alike and adds no bubble. ``n + P - 1`` integer variables. Untied form: one variable per (stage,
chunk). Solved with HiGHS (time-limited, 2% gap); if HiGHS has no incumbent in time, a greedy
(most memory saved per recompute ms first over every moment a variable is in, respecting the
tying, then trimmed) answers instead; the pipeline search ranks its candidates by the greedy's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import highspy
import numpy as np

from megatron_ext.errors import InfeasibleError
from megatron_ext.planner.highs import new_highs
from megatron_ext.sim.engine import Moments


def _var_map(P: int, n: int, bpos: np.ndarray, tied: bool) -> np.ndarray:
    """Column of r[p, k]: [P, n] ints."""
    if tied:
        return bpos[None, :] + (P - 1 - np.arange(P))[:, None]
    return np.arange(P * n).reshape(P, n)


@dataclass
class _Rows:
    """The moments over their room as constraints ``sum_j val x[col] >= need`` (CSR: row r's
    entries are ``indptr[r]:indptr[r + 1]``). A row belongs to one stage, whose chunks have
    distinct variables (tied: distinct diagonals), so a row never repeats a column."""

    stage: np.ndarray  # [rows]
    moment: np.ndarray  # [rows] the row's moment in its stage's ``Moments``
    need: np.ndarray  # [rows] MB to save
    indptr: np.ndarray  # [rows + 1]
    chunk: np.ndarray  # [nnz] the chunk of each entry
    col: np.ndarray  # [nnz] its variable
    val: np.ndarray  # [nnz] MB one recomputed layer of it saves
    runs: np.ndarray  # [P, n, 2] the rows (lo, hi) each chunk is in on each stage: a run
    save: np.ndarray  # [n] MB one recomputed layer of each chunk saves

    @property
    def row_of(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.need)), np.diff(self.indptr))


def _rows(moments: list[Moments], save: np.ndarray, room: np.ndarray, var: np.ndarray, layers: int,
          where: str, name) -> _Rows:
    """The moments over their room; raises InfeasibleError at the first that stays over with
    every layer of its chunks recomputed (before the greedy or the ILP spends anything on it).
    A chunk is in flight over a run of moments (``Moments.runs``): its entries are laid out
    chunk by chunk (in forward order, those whose recompute saves anything), then put in row order,
    keeping the forward order within a row; hundreds of one sequence's slices in flight over
    thousands of moments are millions of entries, so all at once."""
    stage, moment, need, chunk, sizes = [], [], [], [], []
    runs = np.zeros((len(moments), len(save), 2), dtype=np.int64)
    first_row = 0
    for p, m in enumerate(moments):
        over = np.flatnonzero(m.const - room[p] > 1e-9)
        if not len(over):
            continue
        order = m.by_fwd[save[m.by_fwd] > 0]
        lo, hi = m.runs(order, over)
        counts = hi - lo
        runs[p, order, 0] = first_row + lo
        runs[p, order, 1] = first_row + lo + counts
        first_row += len(over)
        row = np.repeat(lo - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))  # chunk by chunk
        # (into row order, stably: a stage has at most 2 x MAX_CHUNKS moments, 16-bit keys, a radix sort)
        by_row = np.argsort(row.astype(np.int16) if len(over) < 2 ** 15 else row, kind="stable")
        stage.append(np.full(len(over), p, dtype=np.int64))
        moment.append(over)
        need.append(m.const[over] - room[p])
        chunk.append(np.repeat(order, counts)[by_row])
        sizes.append(np.bincount(row, minlength=len(over)))
    stage_a, moment_a, need_a, chunk_a, sizes_a = (np.concatenate(x) if x else np.zeros(0, dtype=dt) for x, dt in (
        (stage, np.int64), (moment, np.int64), (need, np.float64), (chunk, np.int64), (sizes, np.int64)))
    rows = _Rows(stage_a, moment_a, need_a,
                 np.concatenate([[0], np.cumsum(sizes_a, dtype=np.int64)]), chunk_a,
                 var[np.repeat(stage_a, sizes_a), chunk_a], save[chunk_a], runs, save)
    most = np.bincount(rows.row_of, weights=rows.val, minlength=len(rows.need)) * layers
    short = np.flatnonzero(most < rows.need - 1e-6)
    if len(short):
        r = int(short[0])
        raise _infeasible(int(rows.stage[r]), moments[int(rows.stage[r])], int(rows.moment[r]),
                          rows.need[r] - most[r], where, name)
    return rows


def _infeasible(p: int, m: Moments, i: int, need: float, where: str, name) -> InfeasibleError:
    kind, k = int(m.kind[i]), int(m.chunk[i])
    op = name(kind, k) if name else f"{'FB'[kind]}{k}"
    return InfeasibleError(f"{where}: stage {p} is {need:.0f} MB per GPU over its activation room at {op} "
                           f"even with every layer of every in-flight chunk recomputed")


def _greedy(rows: _Rows, var: np.ndarray, cost: np.ndarray, layers: int) -> np.ndarray:
    """Row by row, raise the variables that save the most MB per recompute ms, over every moment
    they are in (one layer of variable j saves its chunks' MB at each of its rows, and costs
    ``cost[j]``), until the row holds (every row can: ``_rows`` refused any that every layer
    recomputed cannot); then lower each, the least saving per ms first, as far as every row it is
    in still holds: rows raised early hold more than they need once later rows raised the chunks
    they share. A variable's chunk is in a run of rows on each stage (``_Rows.runs``), so a raise
    or a lowering updates runs. Returns x [len(cost)]. (gpt-13b on 8 stages x SP 16 at 192K, packs
    cut in 8: 36 s of recompute over the stages, the ILP's 31 s; 51 s ranking chunks by their own MB
    per ms, untrimmed, which put a chunking whose ILP plan is 3% slower ahead of it.)"""
    nvar, n = len(cost), var.shape[1]
    x = np.zeros(nvar, dtype=np.int64)
    per_ms = np.bincount(rows.col, weights=rows.val, minlength=nvar) / np.maximum(cost, 1e-12)
    by_var = np.argsort(var, axis=None, kind="stable")  # each variable's (stage, chunk)s
    starts = np.searchsorted(var.ravel()[by_var], np.arange(nvar + 1))
    lo, hi = rows.runs[..., 0].ravel(), rows.runs[..., 1].ravel()

    def runs(j: int) -> list[tuple[int, int, float]]:  # (first row, past the last, MB a layer saves there)
        return [(int(lo[f]), int(hi[f]), float(rows.save[f % n])) for f in by_var[starts[j]:starts[j + 1]].tolist()
                if hi[f] > lo[f]]

    reduced = np.zeros(len(rows.need))
    for r in range(len(rows.need)):
        need = rows.need[r] - reduced[r]
        if need <= 1e-9:
            continue
        a, b = rows.indptr[r], rows.indptr[r + 1]
        for e in a + np.argsort(-per_ms[rows.col[a:b]], kind="stable"):
            j = rows.col[e]
            free = layers - x[j]
            if free <= 0:
                continue
            add = int(min(free, np.ceil(need / rows.val[e] - 1e-9)))
            x[j] += add
            for first, past, v in runs(j):
                reduced[first:past] += v * add
            need = rows.need[r] - reduced[r]
            if need <= 1e-9:
                break
    slack = reduced - rows.need
    raised = np.flatnonzero(x)
    for j in raised[np.argsort(per_ms[raised], kind="stable")].tolist():
        spans = runs(j)
        down = min([int(x[j])] + [int(np.floor((slack[first:past].min() + 1e-9) / v)) for first, past, v in spans])
        if down > 0:
            x[j] -= down
            for first, past, v in spans:
                slack[first:past] -= v * down
    return x


def _costs(var: np.ndarray, rc: np.ndarray) -> np.ndarray:
    """Recompute ms of one layer of each variable: its chunks' (tied: a diagonal's) summed."""
    cost = np.zeros(int(var.max()) + 1 if var.size else 0)
    np.add.at(cost, var.ravel(), np.broadcast_to(rc, var.shape).ravel())
    return cost


def greedy_recompute(moments: list[Moments], save: np.ndarray, rc: np.ndarray, layers: int,
                     room: np.ndarray, bpos: np.ndarray, tied: bool = True, where: str = "pipeline",
                     name=None) -> np.ndarray:
    """Raise recompute where memory is over, moment by moment, most MB saved per ms first, then
    lower what the later moments made unneeded (``_greedy``). [P, n] ints."""
    var = _var_map(len(moments), len(save), bpos, tied)
    return _greedy(_rows(moments, save, room, var, layers, where, name), var, _costs(var, rc), layers)[var]


def solve_recompute(moments: list[Moments], save: np.ndarray, rc: np.ndarray, layers: int,
                    room: np.ndarray, bpos: np.ndarray, tied: bool = True, time_limit: float = 0.5,
                    gap: float = 0.02, where: str = "pipeline", name=None) -> tuple[np.ndarray, str]:
    """The ILP; returns (r [P, n] ints, status). Raises InfeasibleError if even recomputing every
    layer of every in-flight chunk leaves a stage over its room."""
    started = time.perf_counter()
    P, n = len(moments), len(save)
    var = _var_map(P, n, bpos, tied)
    rows = _rows(moments, save, room, var, layers, where, name)
    if not len(rows.need):
        return np.zeros((P, n), dtype=np.int64), "no recompute needed"
    cost = _costs(var, rc)
    nvar = len(cost)
    x0 = _greedy(rows, var, cost, layers)
    greedy = x0[var]
    left = time_limit - (time.perf_counter() - started)  # the limit covers building the model too
    if left <= 0.01:
        return greedy, "greedy (no time left for the ILP)"
    h = new_highs(left)
    h.setOptionValue("mip_rel_gap", float(gap))
    h.addVars(nvar, np.zeros(nvar), np.full(nvar, float(layers)))
    h.changeColsCost(nvar, np.arange(nvar, dtype=np.int32), cost)
    h.changeColsIntegrality(nvar, np.arange(nvar, dtype=np.int32),
                            np.full(nvar, highspy.HighsVarType.kInteger, dtype=np.uint8))
    m = len(rows.need)
    h.addRows(m, rows.need, np.full(m, highspy.kHighsInf), len(rows.col), rows.indptr[:-1].astype(np.int32),
              rows.col.astype(np.int32), rows.val.astype(np.float64))
    h.setSolution(nvar, np.arange(nvar, dtype=np.int32), x0.astype(np.float64))  # warm start: the greedy
    h.run()
    if h.getInfo().primal_solution_status != 2:
        return greedy, "greedy (HiGHS found no solution in time)"
    x = np.rint(np.asarray(h.getSolution().col_value)).astype(np.int64)
    r = x[var]
    ms = h.getModelStatus()
    if float((rc[None, :] * r).sum()) > float((rc[None, :] * greedy).sum()) + 1e-9:
        return greedy, "greedy (better than the ILP incumbent)"
    status = "ilp optimal" if ms == highspy.HighsModelStatus.kOptimal else f"ilp {h.modelStatusToString(ms)}"
    return r, status + (" (tied)" if tied else " (untied)")
