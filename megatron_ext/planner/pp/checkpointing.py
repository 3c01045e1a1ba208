"""Stage-aware chunk-level activation checkpointing (InfiniPipe Eq. 15-20, PAPERS.md section 2).

``r[p, k]`` = layers of chunk k recomputed on stage p (0 <= r <= L_s). At every moment a stage
can peak (after each forward, during each backward; see sim/engine.py) its memory is
``const - sum_{k in reducible} save[k] * r[p, k]`` and must stay within the stage's activation
room (budget minus model states). Minimize the recompute time ``sum rc[k] * r[p, k]``.

Tied form (the paper's): ``r[p, k] = C[b(k) + P - 1 - p]`` with b(k) the chunk's position in the
backward order: the chunks on one diagonal of the 1F1B schedule (the same backward step shifted
by one per stage) recompute the same number of layers, so a recomputation delays every stage
alike and adds no bubble. ``n + P - 1`` integer variables. Untied form: one variable per (stage,
chunk). Solved with HiGHS (time-limited, 2% gap); if HiGHS has no incumbent in time, a greedy
(most memory saved per recompute ms first over every moment a variable is in, respecting the
tying, then trimmed) answers instead; the pipeline search ranks its candidates by the greedy's.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import highspy
import numpy as np

from megatron_ext.errors import InfeasibleError
from megatron_ext.planner.highs import new_highs
from megatron_ext.sim.engine import Checkpoint


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
    cps: list  # [rows] Checkpoint
    need: np.ndarray  # [rows] MB to save
    indptr: np.ndarray  # [rows + 1]
    chunk: np.ndarray  # [nnz] the chunk of each entry
    col: np.ndarray  # [nnz] its variable
    val: np.ndarray  # [nnz] MB one recomputed layer of it saves

    @property
    def row_of(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.need)), np.diff(self.indptr))


def _rows(cps: list[list[Checkpoint]], save: np.ndarray, room: np.ndarray, var: np.ndarray, layers: int,
          where: str, name) -> _Rows:
    """The moments over their room; raises InfeasibleError at the first that stays over with
    every layer of its chunks recomputed (before the greedy or the ILP spends anything on it)."""
    stage, over, need, parts = [], [], [], []
    for p, st in enumerate(cps):
        for cp in st:
            nd = cp.const - room[p]
            if nd > 1e-9:
                parts.append(cp.reducible)
                stage.append(p)
                over.append(cp)
                need.append(nd)
    # every row's chunks in one array (a chunk that saves nothing by recompute is no entry)
    sizes = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
    every = np.fromiter(itertools.chain.from_iterable(parts), dtype=np.int64, count=int(sizes.sum()))
    keep = save[every] > 0
    chunk = every[keep]
    counts = np.bincount(np.repeat(np.arange(len(parts)), sizes)[keep], minlength=len(parts))
    indptr = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    stage_a = np.asarray(stage, dtype=np.int64)
    col = var[np.repeat(stage_a, counts), chunk] if len(chunk) else chunk
    rows = _Rows(stage_a, over, np.asarray(need, dtype=np.float64), indptr, chunk, col, save[chunk])
    most = np.bincount(rows.row_of, weights=rows.val, minlength=len(rows.need)) * layers
    short = np.flatnonzero(most < rows.need - 1e-6)
    if len(short):
        r = int(short[0])
        raise _infeasible(int(rows.stage[r]), rows.cps[r], rows.need[r] - most[r], where, name)
    return rows


def _infeasible(p: int, cp: Checkpoint, need: float, where: str, name) -> InfeasibleError:
    op = name(cp.kind, cp.chunk) if name else f"{'FB'[cp.kind]}{cp.chunk}"
    return InfeasibleError(f"{where}: stage {p} is {need:.0f} MB per GPU over its activation room at {op} "
                           f"even with every layer of every in-flight chunk recomputed")


def _greedy(rows: _Rows, cost: np.ndarray, layers: int) -> np.ndarray:
    """Row by row, raise the variables that save the most MB per recompute ms, over every moment
    they are in (one layer of variable j saves its chunks' MB at each of its rows, and costs
    ``cost[j]``), until the row holds (every row can: ``_rows`` refused any that every layer
    recomputed cannot); then lower each, the least saving per ms first, as far as every row it is
    in still holds: rows raised early hold more than they need once later rows raised the chunks
    they share. Returns x [len(cost)]. (gpt-13b on 8 stages x SP 16 at 192K, packs cut in 8:
    36 s of recompute over the stages, the ILP's 31 s; 51 s ranking chunks by their own MB per
    ms, untrimmed, which put a chunking whose ILP plan is 3% slower ahead of it.)"""
    nvar = len(cost)
    x = np.zeros(nvar, dtype=np.int64)
    per_ms = np.bincount(rows.col, weights=rows.val, minlength=nvar) / np.maximum(cost, 1e-12)
    by_col = np.argsort(rows.col, kind="stable")  # CSC view: a variable's entries over the rows
    col_ptr = np.searchsorted(rows.col[by_col], np.arange(nvar + 1))
    row_of = rows.row_of
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
            es = by_col[col_ptr[j]:col_ptr[j + 1]]
            reduced[row_of[es]] += rows.val[es] * add
            need = rows.need[r] - reduced[r]
            if need <= 1e-9:
                break
    slack = reduced - rows.need
    raised = np.flatnonzero(x)
    for j in raised[np.argsort(per_ms[raised], kind="stable")]:
        es = by_col[col_ptr[j]:col_ptr[j + 1]]
        down = min(int(x[j]), int(np.floor(np.min((slack[row_of[es]] + 1e-9) / rows.val[es]))))
        if down > 0:
            x[j] -= down
            slack[row_of[es]] -= rows.val[es] * down
    return x


def _costs(var: np.ndarray, rc: np.ndarray) -> np.ndarray:
    """Recompute ms of one layer of each variable: its chunks' (tied: a diagonal's) summed."""
    cost = np.zeros(int(var.max()) + 1 if var.size else 0)
    np.add.at(cost, var.ravel(), np.broadcast_to(rc, var.shape).ravel())
    return cost


def greedy_recompute(cps: list[list[Checkpoint]], save: np.ndarray, rc: np.ndarray, layers: int,
                     room: np.ndarray, bpos: np.ndarray, tied: bool = True, where: str = "pipeline",
                     name=None) -> np.ndarray:
    """Raise recompute where memory is over, moment by moment, most MB saved per ms first, then
    lower what the later moments made unneeded (``_greedy``). [P, n] ints."""
    var = _var_map(len(cps), len(save), bpos, tied)
    return _greedy(_rows(cps, save, room, var, layers, where, name), _costs(var, rc), layers)[var]


def solve_recompute(cps: list[list[Checkpoint]], save: np.ndarray, rc: np.ndarray, layers: int,
                    room: np.ndarray, bpos: np.ndarray, tied: bool = True, time_limit: float = 0.5,
                    gap: float = 0.02, where: str = "pipeline", name=None) -> tuple[np.ndarray, str]:
    """The ILP; returns (r [P, n] ints, status). Raises InfeasibleError if even recomputing every
    layer of every in-flight chunk leaves a stage over its room."""
    started = time.perf_counter()
    P, n = len(cps), len(save)
    var = _var_map(P, n, bpos, tied)
    rows = _rows(cps, save, room, var, layers, where, name)
    if not len(rows.need):
        return np.zeros((P, n), dtype=np.int64), "no recompute needed"
    cost = _costs(var, rc)
    nvar = len(cost)
    x0 = _greedy(rows, cost, layers)
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
