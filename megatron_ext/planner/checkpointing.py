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
(most memory saved per recompute ms first, respecting the tying) answers instead.
"""
from __future__ import annotations

import highspy
import numpy as np

from megatron_ext.errors import InfeasibleError
from megatron_ext.sim.engine import Checkpoint


def _var_map(P: int, n: int, bpos: np.ndarray, tied: bool) -> np.ndarray:
    """Column of r[p, k]: [P, n] ints."""
    if tied:
        return bpos[None, :] + (P - 1 - np.arange(P))[:, None]
    return np.arange(P * n).reshape(P, n)


def _rows(cps: list[list[Checkpoint]], save: np.ndarray, room: np.ndarray, var: np.ndarray, where: str):
    """Constraint rows sum_j coef_j x_j >= need, one per checkpoint that is over its room."""
    rows = []
    for p, stage in enumerate(cps):
        for cp in stage:
            need = cp.const - room[p]
            if need <= 1e-9:
                continue
            coef: dict[int, float] = {}
            for k in cp.reducible:
                if save[k] > 0:
                    j = int(var[p, k])
                    coef[j] = coef.get(j, 0.0) + float(save[k])
            rows.append((p, cp, need, coef))
    return rows


def _infeasible(p: int, cp: Checkpoint, need: float, where: str, name) -> InfeasibleError:
    op = name(cp.kind, cp.chunk) if name else f"{'FB'[cp.kind]}{cp.chunk}"
    return InfeasibleError(f"{where}: stage {p} is {need:.0f} MB per GPU over its activation room at {op} "
                           f"even with every layer of every in-flight chunk recomputed")


def greedy_recompute(cps: list[list[Checkpoint]], save: np.ndarray, rc: np.ndarray, layers: int,
                     room: np.ndarray, bpos: np.ndarray, tied: bool = True, where: str = "pipeline",
                     name=None) -> np.ndarray:
    """Raise recompute where memory is over, moment by moment, most MB saved per ms first. [P, n] ints."""
    P, n = len(cps), len(save)
    var = _var_map(P, n, bpos, tied)
    nvar = int(var.max()) + 1 if var.size else 0
    x = np.zeros(nvar, dtype=np.int64)
    over = [(p, cp) for p, stage in enumerate(cps) for cp in stage if cp.const - room[p] > 1e-9]
    if not over:
        return x[var]
    # A[row, j]: MB that one more layer of variable j saves at checkpoint row
    A = np.zeros((len(over), nvar))
    for r, (p, cp) in enumerate(over):
        if cp.reducible:
            ks = np.asarray(cp.reducible, dtype=np.int64)
            np.add.at(A[r], var[p, ks], save[ks])
    need0 = np.array([cp.const - room[p] for p, cp in over])
    reduced = np.zeros(len(over))
    value = save / np.maximum(rc, 1e-12)
    for r, (p, cp) in enumerate(over):
        need = need0[r] - reduced[r]
        if need <= 1e-9:
            continue
        cand = sorted((k for k in cp.reducible if save[k] > 0), key=lambda k: (-value[k], k))
        for k in cand:
            j = var[p, k]
            free = layers - x[j]
            if free <= 0:
                continue
            add = int(min(free, np.ceil(need / A[r, j] - 1e-9)))
            x[j] += add
            reduced += A[:, j] * add
            need = need0[r] - reduced[r]
            if need <= 1e-9:
                break
        if need > 1e-6:
            raise _infeasible(p, cp, need, where, name)
    return x[var]


def solve_recompute(cps: list[list[Checkpoint]], save: np.ndarray, rc: np.ndarray, layers: int,
                    room: np.ndarray, bpos: np.ndarray, tied: bool = True, time_limit: float = 0.5,
                    gap: float = 0.02, where: str = "pipeline", name=None) -> tuple[np.ndarray, str]:
    """The ILP; returns (r [P, n] ints, status). Raises InfeasibleError if even recomputing every
    layer of every in-flight chunk leaves a stage over its room."""
    P, n = len(cps), len(save)
    var = _var_map(P, n, bpos, tied)
    rows = _rows(cps, save, room, var, where)
    if not rows:
        return np.zeros((P, n), dtype=np.int64), "no recompute needed"
    for p, cp, need, coef in rows:
        if sum(coef.values()) * layers < need - 1e-6:
            raise _infeasible(p, cp, need - sum(coef.values()) * layers, where, name)
    nvar = int(var.max()) + 1
    cost = np.zeros(nvar)
    np.add.at(cost, var.ravel(), np.broadcast_to(rc, (P, n)).ravel())
    greedy = greedy_recompute(cps, save, rc, layers, room, bpos, tied, where, name)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", float(gap))
    h.addVars(nvar, np.zeros(nvar), np.full(nvar, float(layers)))
    h.changeColsCost(nvar, np.arange(nvar, dtype=np.int32), cost)
    h.changeColsIntegrality(nvar, np.arange(nvar, dtype=np.int32),
                            np.full(nvar, highspy.HighsVarType.kInteger, dtype=np.uint8))
    lo, starts, idx, val = [], [], [], []
    for p, cp, need, coef in rows:
        lo.append(need)
        starts.append(len(idx))
        idx.extend(coef)
        val.extend(coef.values())
    h.addRows(len(lo), np.array(lo), np.full(len(lo), highspy.kHighsInf), len(idx),
              np.array(starts, dtype=np.int32), np.array(idx, dtype=np.int32), np.array(val, dtype=np.float64))
    # warm start from the greedy answer (the diagonal/column values it chose)
    x0 = np.zeros(nvar)
    for p in range(P):
        for k in range(n):
            x0[var[p, k]] = max(x0[var[p, k]], greedy[p, k])
    h.setSolution(nvar, np.arange(nvar, dtype=np.int32), x0)
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
