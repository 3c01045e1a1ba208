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
from typing import NamedTuple

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


def _infeasible(p: int, m: Moments, i: int, need: float, where: str, name) -> InfeasibleError:
    kind, k = int(m.kind[i]), int(m.chunk[i])
    op = name(kind, k) if name else f"{'FB'[kind]}{k}"
    return InfeasibleError(f"{where}: stage {p} is {need:.0f} MB per GPU over its activation room at {op} "
                           f"even with every layer of every in-flight chunk recomputed")


class _Over(NamedTuple):
    """The moments over their room, numbered stage after stage (``_over_room``)."""

    moments: list[np.ndarray]  # per stage, its moments over the room (indices into its ``Moments``)
    lo: np.ndarray  # [P, n] each chunk's run of them on each stage (empty where its recompute saves nothing)
    hi: np.ndarray
    need: np.ndarray  # MB each must save


def _over_room(moments: list[Moments], save: np.ndarray, room: np.ndarray, layers: int, where: str,
               name) -> _Over:
    """The constraints of the greedy and the ILP: per stage, its moments over the room (numbered
    stage after stage); each chunk's run of them on each stage (lo, hi: [P, n], empty for a chunk
    whose recompute saves nothing); what each must save. Raises InfeasibleError at the first that
    every layer of its chunks in flight recomputed cannot bring within the room (each run's MB
    summed over it), before the greedy or the ILP spends anything on it."""
    P, n = len(moments), len(save)
    overs = [np.flatnonzero(m.const - room[p] > 1e-9) for p, m in enumerate(moments)]
    starts = np.cumsum([0] + [len(o) for o in overs])
    lo, hi = np.zeros((P, n), dtype=np.int64), np.zeros((P, n), dtype=np.int64)
    for p, (m, over) in enumerate(zip(moments, overs)):
        a, b = m.runs(over)
        lo[p], hi[p] = starts[p] + a, starts[p] + np.where(save > 0, b, a)
    need = np.concatenate([m.const[over] - room[p] for p, (m, over) in enumerate(zip(moments, overs))])
    mb = np.tile(save, P) * (hi > lo).ravel()
    edges = np.zeros(starts[-1] + 1)
    np.add.at(edges, lo.ravel(), mb)
    np.add.at(edges, hi.ravel(), -mb)
    short = np.flatnonzero(np.cumsum(edges)[:-1] * layers < need - 1e-6)
    if len(short):
        p = int(np.searchsorted(starts, short[0], side="right")) - 1
        r = int(overs[p][short[0] - starts[p]])
        most = float(save[moments[p].in_flight(r)].sum()) * layers
        raise _infeasible(p, moments[p], r, need[short[0]] - most, where, name)
    return _Over(overs, lo, hi, need)


def _rows(moments: list[Moments], over: _Over, save: np.ndarray,
          var: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The moments over their room as the ILP's constraints ``sum_j val x[col] >= over.need``, in
    CSR (indptr, col, val: row r's entries are ``indptr[r]:indptr[r + 1]``). A row belongs to one
    stage, whose chunks have distinct variables (tied: distinct diagonals), so a row never repeats
    a column. Each chunk's run of rows laid out (in forward order on each stage), then put in row
    order, all at once."""
    n = len(save)
    by_fwd = np.concatenate([p * n + m.by_fwd for p, m in enumerate(moments)])
    lo, span = over.lo.ravel()[by_fwd], (over.hi - over.lo).ravel()[by_fwd]
    row = np.repeat(lo - (np.cumsum(span) - span), span) + np.arange(int(span.sum()))
    by_row = np.argsort(row, kind="stable")
    return (np.concatenate([[0], np.cumsum(np.bincount(row, minlength=len(over.need)), dtype=np.int64)]),
            np.repeat(var.ravel()[by_fwd], span)[by_row], np.repeat(save[by_fwd % n], span)[by_row])


def _greedy(moments: list[Moments], over: _Over, save: np.ndarray, var: np.ndarray, cost: np.ndarray,
            layers: int) -> np.ndarray:
    """Moment by moment over the room (each stage's in turn), raise the variables that save the
    most MB per recompute ms, over every moment they are in (one layer of variable j saves its
    chunks' MB at each moment over the room they are in flight at, and costs ``cost[j]``), until
    the moment holds (``_over_room`` refused any that cannot); then lower each, the least
    saving per ms first, as far as every moment it is in still holds: moments raised early hold
    more than they need once later ones raised the chunks they share. A chunk is in flight over a
    run of moments (``Moments.runs``): a raise or a lowering updates runs, and only a moment still
    over its room looks up its chunks (hundreds of one sequence's slices in flight over thousands
    of moments made millions of entries). Returns x [len(cost)]. (gpt-13b on 8 stages x SP 16 at
    192K, packs cut in 8: 36 s of recompute over the stages, the ILP's 31 s; 51 s ranking chunks
    by their own MB per ms, untrimmed, which put a chunking whose ILP plan is 3% slower ahead.)"""
    nvar, (P, n) = len(cost), var.shape
    overs, lo, hi, need = over
    span = (hi - lo).ravel()
    per_ms = np.bincount(var.ravel(), weights=np.tile(save, P) * span, minlength=nvar) / np.maximum(cost, 1e-12)
    by_var = np.argsort(var, axis=None, kind="stable")  # each variable's (stage, chunk)s
    starts = np.searchsorted(var.ravel()[by_var], np.arange(nvar + 1))
    lo_f, hi_f = lo.ravel(), hi.ravel()

    def runs(j: int) -> list[tuple[int, int, float]]:  # (first moment, past the last, MB a layer saves there)
        return [(int(lo_f[f]), int(hi_f[f]), float(save[f % n])) for f in by_var[starts[j]:starts[j + 1]].tolist()
                if hi_f[f] > lo_f[f]]

    x = np.zeros(nvar, dtype=np.int64)
    reduced = np.zeros(len(need))
    row = 0
    for p, (m, over) in enumerate(zip(moments, overs)):
        for r in over.tolist():
            left = need[row] - reduced[row]
            if left > 1e-9:
                k = m.in_flight(r)
                k = k[save[k] > 0]
                cols, vals = var[p, k], save[k]
                for e in np.argsort(-per_ms[cols], kind="stable").tolist():
                    j = cols[e]
                    free = layers - x[j]
                    if free <= 0:
                        continue
                    add = int(min(free, np.ceil(left / vals[e] - 1e-9)))
                    x[j] += add
                    for a, b, v in runs(j):
                        reduced[a:b] += v * add
                    left = need[row] - reduced[row]
                    if left <= 1e-9:
                        break
            row += 1
    slack = reduced - need
    raised = np.flatnonzero(x)
    for j in raised[np.argsort(per_ms[raised], kind="stable")].tolist():
        spans = runs(j)
        down = min([int(x[j])] + [int(np.floor((slack[a:b].min() + 1e-9) / v)) for a, b, v in spans])
        if down > 0:
            x[j] -= down
            for a, b, v in spans:
                slack[a:b] -= v * down
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
    over = _over_room(moments, save, room, layers, where, name)
    return _greedy(moments, over, save, var, _costs(var, rc), layers)[var]


def solve_recompute(moments: list[Moments], save: np.ndarray, rc: np.ndarray, layers: int,
                    room: np.ndarray, bpos: np.ndarray, tied: bool = True, time_limit: float = 0.5,
                    gap: float = 0.02, where: str = "pipeline", name=None) -> tuple[np.ndarray, str]:
    """The ILP; returns (r [P, n] ints, status). Raises InfeasibleError if even recomputing every
    layer of every in-flight chunk leaves a stage over its room."""
    started = time.perf_counter()
    P, n = len(moments), len(save)
    var = _var_map(P, n, bpos, tied)
    over = _over_room(moments, save, room, layers, where, name)
    if not len(over.need):
        return np.zeros((P, n), dtype=np.int64), "no recompute needed"
    cost = _costs(var, rc)
    nvar = len(cost)
    x0 = _greedy(moments, over, save, var, cost, layers)
    indptr, col, val = _rows(moments, over, save, var)
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
    m = len(over.need)
    h.addRows(m, over.need, np.full(m, highspy.kHighsInf), len(col), indptr[:-1].astype(np.int32),
              col.astype(np.int32), val.astype(np.float64))
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
