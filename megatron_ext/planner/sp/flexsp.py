"""FlexSP planning: Ulysses groups of mixed power-of-two degrees per micro-batch, via HiGHS.

One micro-batch (``_solve_part``):
1. LP relaxation, aggregated by degree: fractions f[q, d] of DP bucket q run at degree d and group
   counts n[d], minimizing GPUs used for a makespan target C (time and memory of each degree's
   groups within n[d] * C and n[d] * capacity). A bisection on C, warm re-solving one model,
   finds the smallest C that fits the cluster: the degree mix to aim for.
2. Rounding + repair: integer group counts that fit the GPUs, sequences placed longest first on
   the least-loaded group of their LP degree (or any group that holds them), local moves off the
   slowest group; where that is over 1% above the LP, first-fit packing bisected on the makespan.
The step (``plan_flexsp``) compares starting partitions into micro-batches -- token-balanced
contiguous cuts of the length-sorted batch (the paper's blaster) for each micro-batch count, the
best homogeneous packings, every sequence at its cheapest degree, long sequences with short ones
as filler -- refines the cuts by local search, and lets a node-limited MILP (warm-started) improve
micro-batches while the plan is over 3% above the lower bound (before the last starting points
where little of the limit is left). Work is bounded by counts, not the clock, so the same input
gives the same plan; the time limit is a guard and is reported if it cut or reordered the work.
What the limit cannot cut is the first plan, the best homogeneous packing (by a step-time bound),
and the part solve under way when it passes; a cut search the limit stops keeps the parts it
solved (the longest sequences) and packs the rest at one degree.
"""
from __future__ import annotations

import bisect
import heapq
import math
import time
from functools import partial

import highspy
import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.planner.highs import new_highs
from megatron_ext.planner.options import PlannerOptions
from megatron_ext.planner.packing import best_fit_bins
from megatron_ext.planner.sp.baselines import homogeneous_packings
from megatron_ext.planner.sp.blaster import balanced_split, dp_buckets
from megatron_ext.planner.sp.step import Groups


class _Batch:
    """Per-sequence times at every degree, computed once per step."""

    def __init__(self, lengths: np.ndarray, cost: CostModel):
        self.lengths = lengths
        self.cost = cost
        self.degrees = np.array(cost.degrees)
        self.cap = np.array([cost.token_capacity(d) for d in cost.degrees], dtype=np.int64)
        self.time = np.stack([cost.seq_time_ms(lengths, int(d)) for d in self.degrees], axis=1)  # [K, D]
        self.fits = lengths[:, None] <= self.cap[None, :]
        self.min_deg_idx = np.argmax(self.fits, axis=1)
        gpu_ms = np.where(self.fits, self.time * self.degrees[None, :], np.inf)
        self.best_gpu_ms = gpu_ms.min(axis=1)
        self.fastest = np.where(self.fits, self.time, np.inf).min(axis=1)
        self.b1 = cost.micro_batch_fixed_ms
        # per degree, what a group pays beyond b1 whatever it runs (its all-to-all latency)
        self.lat = np.array([cost.group_fixed_ms(int(d)) - self.b1 for d in self.degrees])
        self.n = cost.num_gpus

    def group_load(self, d: int, ids) -> float:
        """ms of a group of degree index ``d`` running ``ids``, without b1."""
        return float(self.lat[d] + self.time[ids, d].sum())


class _DegreeLP:
    """The aggregated LP of one micro-batch; re-solved warm for each makespan target C."""

    def __init__(self, batch: _Batch, ids: np.ndarray, num_buckets: int):
        self.batch = batch
        srt = ids[np.argsort(batch.lengths[ids], kind="stable")]
        ends = dp_buckets(batch.lengths[srt], num_buckets)
        starts = np.concatenate([[0], ends[:-1]])
        self.buckets = [srt[a:b] for a, b in zip(starts, ends)]
        D = len(batch.degrees)
        tok = np.array([batch.lengths[b].sum() for b in self.buckets], dtype=np.float64)
        tsum = np.stack([batch.time[b].sum(axis=0) for b in self.buckets])  # [Q, D]
        self.tmax = np.stack([batch.time[b[-1]] for b in self.buckets])  # longest of the bucket
        ok = np.stack([batch.fits[b[-1]] for b in self.buckets])
        self.cols = [(q, d) for q in range(len(self.buckets)) for d in range(D) if ok[q, d]]
        nf = len(self.cols)
        h = new_highs()
        # Columns: f[q, d] in [0, 1], then n[d] in [0, N/d]; minimize GPUs = sum d n[d].
        cost = np.concatenate([np.zeros(nf), batch.degrees.astype(np.float64)])
        lower = np.zeros(nf + D)
        upper = np.concatenate([np.ones(nf), batch.n / batch.degrees])
        h.addVars(nf + D, lower, upper)
        h.changeColsCost(nf + D, np.arange(nf + D, dtype=np.int32), cost)
        rows_lo, rows_hi, starts_, idx, val = [], [], [], [], []

        def row(lo, hi, cols, vals):
            rows_lo.append(lo), rows_hi.append(hi), starts_.append(len(idx))
            idx.extend(cols), val.extend(vals)

        Q = len(self.buckets)
        for q in range(Q):  # each bucket fully placed
            cs = [j for j, (qq, _) in enumerate(self.cols) if qq == q]
            row(1.0, 1.0, cs, [1.0] * len(cs))
        self.time_row0 = Q
        for d in range(D):  # time of degree d's work <= n[d] * C   (C set per solve)
            cs = [j for j, (_, dd) in enumerate(self.cols) if dd == d]
            row(-highspy.kHighsInf, 0.0, cs + [nf + d], [tsum[self.cols[j]] for j in cs] + [-1.0])
        for d in range(D):  # tokens of degree d <= n[d] * capacity(d)
            cs = [j for j, (_, dd) in enumerate(self.cols) if dd == d]
            row(-highspy.kHighsInf, 0.0, cs + [nf + d], [tok[self.cols[j][0]] for j in cs] + [-float(batch.cap[d])])
        h.addRows(len(rows_lo), np.array(rows_lo), np.array(rows_hi), len(idx), np.array(starts_, dtype=np.int32),
                  np.array(idx, dtype=np.int32), np.array(val, dtype=np.float64))
        self.h, self.nf, self.D = h, nf, D
        self.col_tmax = np.array([self.tmax[q, d] for q, d in self.cols])
        self.col_lat = np.array([batch.lat[d] for _, d in self.cols])

    def gpus_needed(self, C: float) -> float:
        """LP optimum (fractional GPUs) for makespan target C (ms, excluding b1); inf if infeasible."""
        h, nf = self.h, self.nf
        for d in range(self.D):
            h.changeCoeff(self.time_row0 + d, nf + d, -max(C - self.batch.lat[d], 0.0))
        ub = (self.col_tmax + self.col_lat <= C).astype(np.float64)
        h.changeColsBounds(nf, np.arange(nf, dtype=np.int32), np.zeros(nf), ub)
        h.run()
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return math.inf
        return h.getInfo().objective_function_value

    def solution(self) -> tuple[np.ndarray, np.ndarray]:
        x = np.asarray(self.h.getSolution().col_value)
        f = np.zeros((len(self.buckets), self.D))
        for j, (q, d) in enumerate(self.cols):
            f[q, d] = x[j]
        return f, x[self.nf:]


def _bisect_makespan(lp: _DegreeLP, lo: float, rel_tol: float = 2e-3) -> float | None:
    """Smallest C (to rel_tol) whose LP fits on the cluster; None if memory never fits."""
    n = lp.batch.n + 1e-6
    hi = lo
    for _ in range(60):
        if lp.gpus_needed(hi) <= n:
            break
        lo, hi = hi, hi * 2
    else:
        return None
    if hi == lo:
        return hi
    while hi > lo * (1 + rel_tol):
        mid = (lo + hi) / 2
        if lp.gpus_needed(mid) <= n:
            hi = mid
        else:
            lo = mid
    lp.gpus_needed(hi)  # leave the solution of the chosen target in the solver
    return hi


def _round_groups(batch: _Batch, lp: _DegreeLP, C: float) -> tuple[list[int], np.ndarray]:
    """Integer group degrees and a preferred degree index per sequence, from the LP solution."""
    f, nfrac = lp.solution()
    pref = {}
    for q, ids in enumerate(lp.buckets):
        desc = ids[::-1]  # longest first -> largest degree first
        shares = f[q] * len(ids)
        counts = np.floor(shares + 1e-9).astype(int)
        rest = len(ids) - counts.sum()
        for d in np.argsort(-(shares - counts), kind="stable")[:rest]:
            counts[d] += 1
        pos = 0
        for d in range(lp.D - 1, -1, -1):
            for i in desc[pos:pos + counts[d]]:
                pref[int(i)] = d
            pos += counts[d]
    # Concrete load per degree, then the groups each degree needs (time and memory).
    need = np.zeros(lp.D)
    for d in range(lp.D):
        mine = [i for i, dd in pref.items() if dd == d]
        if mine:
            need[d] = max(batch.time[mine, d].sum() / max(C - batch.lat[d], 1e-9), batch.lengths[mine].sum() / batch.cap[d],
                          1.0)
    count = np.minimum(np.floor(need + 1e-6), np.floor(nfrac + 1e-6)).astype(int)
    count = np.where(need > 0, np.maximum(count, 1), 0)
    while (count * batch.degrees).sum() > batch.n:  # too many groups: drop from the smallest needs
        d = int(np.argmin(np.where(count > 0, need - count + 1e6 * (count == 1), np.inf)))
        count[d] -= 1
    free = batch.n - int((count * batch.degrees).sum())
    while free > 0:  # spend the rest where the most work per group waits
        load = np.where(batch.degrees <= free, need / np.maximum(count, 1e-9) * (need > 0), -1)
        if load.max() <= 0:
            d = int(np.flatnonzero(batch.degrees <= free).max())  # extra capacity for repair
        else:
            d = int(np.argmax(load))
        count[d] += 1
        free -= int(batch.degrees[d])
    degrees = [int(batch.degrees[d]) for d in range(lp.D - 1, -1, -1) for _ in range(count[d])]
    return degrees, pref


def _assign(batch: _Batch, ids: np.ndarray, group_deg_idx: np.ndarray, pref: dict,
            deadline: float = math.inf) -> list[list[int]] | None:
    """Longest first: least-loaded group of the preferred degree with room (the lowest index among
    equals), else the group (any degree that holds it) where it finishes earliest, then improved
    until the deadline. None if some sequence fits nowhere.

    The groups of each degree sit in a heap by (load, index), so a sequence placed at its
    preferred degree costs a few heap operations, not a scan of every group: tens of thousands
    of sequences on thousands of GPUs would spend seconds scanning. Raises ``_OutOfTime`` once
    the deadline passes (checked every 256 sequences)."""
    load = batch.lat[group_deg_idx].astype(np.float64)
    room = batch.cap[group_deg_idx].astype(np.float64)
    G = len(group_deg_idx)
    members: list[list[int]] = [[] for _ in range(G)]
    heaps = {int(d): ([(float(load[g]), int(g)) for g in np.flatnonzero(group_deg_idx == d)], [])
             for d in np.unique(group_deg_idx)}
    shortest = float(batch.lengths[ids].min()) if len(ids) else 0.0
    for k, i in enumerate(ids[np.argsort(-batch.lengths[ids], kind="stable")]):
        if not k % 256 and time.perf_counter() > deadline:
            raise _OutOfTime
        s = batch.lengths[i]
        g = _least_loaded_with_room(*heaps.get(pref.get(int(i), -1), ([], [])), load, room, s, shortest)
        if g is None:
            t = batch.time[i, group_deg_idx]
            ok = room >= s
            if not ok.any():
                return None
            g = int(np.argmin(np.where(ok, load + t, np.inf)))
        load[g] += batch.time[i, group_deg_idx[g]]
        room[g] -= s
        members[g].append(int(i))
        heapq.heappush(heaps[int(group_deg_idx[g])][0], (float(load[g]), g))
    return _improve(batch, group_deg_idx, members, load, room, deadline)


def _least_loaded_with_room(heap: list, parked: list, load: np.ndarray, room: np.ndarray, s: float,
                            shortest: float) -> int | None:
    """The group of least (load, index) in ``heap`` with ``s`` tokens of room, or None. Entries
    whose load is no longer the group's are stale (the group was pushed again when it changed) and
    dropped, so are groups with no room for the batch's shortest sequence. Groups too full for this
    one wait in ``parked`` (a heap by room, most first) until a sequence short enough comes: the
    sequences come longest first, so each waits once (put back on ``heap`` each time, they were
    popped again by every later sequence: 1.5 million heap operations for 11,686 sequences)."""
    while parked and -parked[0][0] >= s:
        _, g_load, g = heapq.heappop(parked)
        heapq.heappush(heap, (g_load, g))
    while heap:
        entry = heapq.heappop(heap)
        g = entry[1]
        if entry[0] != load[g] or room[g] < shortest:
            continue
        if room[g] >= s:
            return g
        heapq.heappush(parked, (-float(room[g]), entry[0], g))
    return None


def _improve(batch, gdi, members, load, room, deadline: float, max_moves: int = 200):
    """Move sequences off the slowest group while that lowers the makespan (and the deadline has
    not passed: a move scans the slowest group's sequences against every group, which on
    thousands of GPUs takes long enough to matter)."""
    for _ in range(max_moves):
        if time.perf_counter() > deadline:
            break
        g = int(np.argmax(load))
        best = None
        for i in members[g]:
            s = batch.lengths[i]
            t = batch.time[i, gdi]
            new = load + t
            new[g] = np.inf
            new = np.where(room >= s, new, np.inf)
            h = int(np.argmin(new))
            after = max(new[h], load[g] - t[g])
            if after < load[g] - 1e-9 and (best is None or after < best[0]):
                best = (after, i, h)
        if best is None:
            break
        _, i, h = best
        members[g].remove(i)
        members[h].append(i)
        load[g] -= batch.time[i, gdi[g]]
        load[h] += batch.time[i, gdi[h]]
        room[g] += batch.lengths[i]
        room[h] -= batch.lengths[i]
    return members


class _OutOfTime(Exception):
    """A part solve's deadline passed before it had a plan for its sequences (its callers keep
    what they had: a packing of thousands of sequences on thousands of GPUs takes most of a second)."""


def _pack_at(batch: _Batch, ids: np.ndarray, C: float,
             deadline: float = math.inf) -> tuple[list[int], list[list[int]]] | None:
    """First-fit decreasing into groups of mixed degrees under makespan target C: each sequence
    joins the open group where it costs the fewest GPU-ms and still fits C and memory (of its
    cheapest degree with such a group, the most loaded, the first opened among equals), else opens
    a group of the smallest degree that runs it within C. None if the GPUs run out.

    The groups of each degree sit in a list sorted by load, so a sequence looks only at the
    groups under C less its time, from the most loaded down, at its cheapest degrees first: on
    plain lists, 4x faster than comparing every group with numpy for each sequence (the packing
    is about half of a part solve). Raises ``_OutOfTime`` once the deadline passes (checked every
    256 sequences)."""
    order = ids[np.argsort(-batch.lengths[ids], kind="stable")]
    times = batch.time[order]
    ranks = np.argsort(times * batch.degrees[None, :], axis=1, kind="stable").tolist()  # cheapest GPU-ms first
    opens = batch.fits[order] & (times + batch.lat[None, :] <= C)
    first = np.where(opens.any(axis=1), np.argmax(opens, axis=1), -1).tolist()  # the degree a new group gets
    times, sizes = times.tolist(), batch.lengths[order].tolist()
    degrees, lat, cap = batch.degrees.tolist(), batch.lat.tolist(), batch.cap.tolist()
    by_degree: list[list[tuple[float, int]]] = [[] for _ in degrees]  # (load, -group), ascending
    load: list[float] = []
    room: list[float] = []
    gdi: list[int] = []
    members: list[list[int]] = []
    used = 0
    for k, i in enumerate(order.tolist()):
        if not k % 256 and time.perf_counter() > deadline:
            raise _OutOfTime
        s, t = sizes[k], times[k]
        for d in ranks[k]:
            groups, td = by_degree[d], t[d]
            j = bisect.bisect_right(groups, (C - td, math.inf)) - 1
            # (load + time <= C again: C - time rounds, and the rule is the sum's)
            while j >= 0 and (room[-groups[j][1]] < s or load[-groups[j][1]] + td > C):
                j -= 1
            if j >= 0:
                g = -groups.pop(j)[1]
                load[g] += td
                room[g] -= s
                members[g].append(i)
                bisect.insort(groups, (load[g], -g))
                break
        else:
            d = first[k]
            if d < 0 or used + degrees[d] > batch.n:
                return None
            used += degrees[d]
            gdi.append(d), load.append(lat[d] + t[d]), room.append(cap[d] - s), members.append([i])
            bisect.insort(by_degree[d], (load[-1], -(len(gdi) - 1)))
    return gdi, members


def _span(batch: _Batch, gdi, members) -> float:
    return batch.b1 + max(batch.group_load(d, m) for d, m in zip(gdi, members))


def _solve_part(batch: _Batch, ids: np.ndarray, options: PlannerOptions,
                deadline: float = math.inf) -> list[tuple[Groups, float]]:
    """Groups for one micro-batch's sequences; split in two if memory cannot hold them at once.

    The LP-rounded plan comes first; where it is more than 1% above the LP's makespan (chunky
    long sequences the LP spread evenly), a bisection with first-fit packing between the two
    looks for a tighter plan (until the deadline), and the better one is kept. Raises
    ``_OutOfTime`` where the deadline passes with no plan yet.
    """
    lo = max(batch.best_gpu_ms[ids].sum() / batch.n, batch.fastest[ids].max())
    lp = _DegreeLP(batch, ids, options.num_buckets)
    C = _bisect_makespan(lp, lo)
    best = None
    if C is not None:
        degrees, pref = _round_groups(batch, lp, C)
        gdi = np.searchsorted(batch.degrees, degrees)
        members = _assign(batch, ids, gdi, pref, deadline)
        if members is not None:
            keep = [g for g, m in enumerate(members) if m]
            best = ([int(gdi[g]) for g in keep], [members[g] for g in keep])
        hi = _span(batch, *best) - batch.b1 if best else 2 * C
        lo_c = C
        if hi > C * 1.01:
            # Bisection on the packing target; fewer steps for big micro-batches (each packing
            # costs sequences x groups, and is about as long as the last: none begins that would
            # end past the deadline).
            last = 0.0
            for _ in range(10 if len(ids) <= 1024 else 4):
                if hi <= lo_c * 1.005 or (best is not None and time.perf_counter() + last > deadline):
                    break
                mid = (lo_c + hi) / 2
                began = time.perf_counter()
                try:
                    packed = _pack_at(batch, ids, mid, deadline)
                except _OutOfTime:
                    if best is None:
                        raise
                    break
                last = time.perf_counter() - began
                if packed is None:
                    lo_c = mid
                else:
                    hi = _span(batch, *packed) - batch.b1
                    if best is None or hi < _span(batch, *best) - batch.b1:
                        best = packed
    if best is None:
        if len(ids) == 1:  # cannot happen for a sequence within cost.max_seq_len
            raise AssertionError("a single feasible sequence did not fit a micro-batch")
        if time.perf_counter() > deadline:
            raise _OutOfTime
        halves = balanced_split(ids[np.argsort(-batch.lengths[ids], kind="stable")], batch.lengths, 2)
        return [mb for h in halves for mb in _solve_part(batch, h, options, deadline)]
    gdi, members = best
    return [([(int(batch.degrees[d]), m) for d, m in zip(gdi, members)], _span(batch, gdi, members))]


# HiGHS stops a MIP some time after its time limit (it checks the clock between nodes and LP
# iterations): 23-33 ms on this 2-core machine with 130-180 ms left. The limit it gets is shorter
# by this much, so the planner ends by its deadline.
MILP_OVERSHOOT_S = 0.04
# Of the time limit: with less left after the cut search, the MILP polish goes before the last starts
POLISH_FIRST = 0.3
# The early starts go after the cut search where this many homogeneous packings' time (about what
# one of them takes) is over this share of the time limit
EARLY_START_PACKINGS = 10
EARLY_START_SHARE = 0.15


def _milp_improve(batch: _Batch, ids: np.ndarray, incumbent: tuple[list[int], list[list[int]]],
                  deadline: float, max_seqs: int = 48):
    """Exact per-sequence MILP (FlexSP Eq. 5-10) over virtual groups, warm-started from the
    incumbent and bounded by its makespan. A node limit keeps it deterministic; the deadline
    (``time.perf_counter()`` seconds) is a guard, what is left of it once the model is built the
    solver's time limit. Returns (a better (gdi, members) or None, whether the deadline cut it
    short).

    Only for micro-batches of few sequences (the long ones, where granularity decides)."""
    if len(ids) > max_seqs:
        return None, False
    gdi0, members0 = incumbent
    T = _span(batch, gdi0, members0) - batch.b1
    groups = []  # virtual groups: degree index per copy
    for d in range(len(batch.degrees)):
        runnable = int((batch.fits[ids, d] & (batch.time[ids, d] + batch.lat[d] <= T)).sum())
        copies = max(min(batch.n // int(batch.degrees[d]), runnable), gdi0.count(d))
        groups += [d] * copies
    P, K = len(groups), len(ids)
    pairs = [(k, p) for k in range(K) for p in range(P)
             if batch.fits[ids[k], groups[p]] and batch.time[ids[k], groups[p]] + batch.lat[groups[p]] <= T * (1 + 1e-9)]
    nx = len(pairs)
    h = new_highs()
    h.setOptionValue("mip_max_nodes", 30)
    h.setOptionValue("mip_rel_gap", 0.005)
    ncol = nx + P + 1  # x[k,p], m[p], C
    h.addVars(ncol, np.zeros(ncol), np.concatenate([np.ones(nx + P), [T]]))
    h.changeColsCost(1, np.array([ncol - 1], dtype=np.int32), np.array([1.0]))
    h.changeColsIntegrality(nx + P, np.arange(nx + P, dtype=np.int32),
                            np.full(nx + P, highspy.HighsVarType.kInteger, dtype=np.uint8))
    lo, hi, starts, idx, val = [], [], [], [], []

    def row(a, b, cols, vals):
        lo.append(a), hi.append(b), starts.append(len(idx)), idx.extend(cols), val.extend(vals)

    by_k = [[] for _ in range(K)]
    by_p = [[] for _ in range(P)]
    for j, (k, p) in enumerate(pairs):
        by_k[k].append(j), by_p[p].append(j)
    for k in range(K):
        row(1, 1, by_k[k], [1.0] * len(by_k[k]))
    inf = highspy.kHighsInf
    for p in range(P):
        row(-inf, 0, by_p[p] + [nx + p, ncol - 1], [batch.time[ids[pairs[j][0]], groups[p]] for j in by_p[p]]
            + [float(batch.lat[groups[p]]), -1.0])
        row(-inf, 0, by_p[p] + [nx + p], [float(batch.lengths[ids[pairs[j][0]]]) for j in by_p[p]]
            + [-float(batch.cap[groups[p]])])
        if p + 1 < P and groups[p + 1] == groups[p]:  # symmetry: use copies in order
            row(0, inf, [nx + p, nx + p + 1], [1.0, -1.0])
    row(-inf, batch.n, list(range(nx, nx + P)), [float(batch.degrees[g]) for g in groups])
    h.addRows(len(lo), np.array(lo, dtype=np.float64), np.array(hi, dtype=np.float64), len(idx),
              np.array(starts, dtype=np.int32), np.array(idx, dtype=np.int32), np.array(val, dtype=np.float64))
    # Warm start: the incumbent's groups, mapped onto copies of their degree.
    pos = {k: i for i, k in enumerate(ids.tolist())}
    first = {d: groups.index(d) for d in set(groups)}
    used: dict[int, int] = {}
    x0 = np.zeros(ncol)
    pair_index = {kp: j for j, kp in enumerate(pairs)}
    for d, m in zip(gdi0, members0):
        p = first[d] + used.get(d, 0)
        used[d] = used.get(d, 0) + 1
        x0[nx + p] = 1
        for i in m:
            x0[pair_index[(pos[i], p)]] = 1
    x0[-1] = T
    h.setSolution(ncol, np.arange(ncol, dtype=np.int32), x0)
    # (what is left once the model is built: that takes a while on big micro-batches)
    left = deadline - time.perf_counter() - MILP_OVERSHOOT_S
    if left <= 0:
        return None, True
    h.setOptionValue("time_limit", left)
    h.run()
    timed_out = h.getModelStatus() == highspy.HighsModelStatus.kTimeLimit
    if h.getInfo().primal_solution_status != 2:  # no feasible point
        return None, timed_out
    x = np.asarray(h.getSolution().col_value)
    members = [[] for _ in range(P)]
    for j, (k, p) in enumerate(pairs):
        if x[j] > 0.5:
            members[p].append(int(ids[k]))
    keep = [p for p in range(P) if members[p]]
    result = ([groups[p] for p in keep], [members[p] for p in keep])
    return (result if _span(batch, *result) < _span(batch, gdi0, members0) - 1e-6 else None), timed_out


def _polish(batch: _Batch, plan: tuple[list[tuple[Groups, float]], float], lower: float,
            deadline: float) -> tuple[list[tuple[Groups, float]], float, bool, bool]:
    """``plan`` (micro-batches with their makespans, and their sum), each micro-batch improved by
    the MILP (``_milp_improve``) where the plan is over 3% above ``lower``, until the deadline.
    Returns (the micro-batches with their makespans, their sum, whether the MILP improved one,
    whether the deadline cut it short)."""
    parts, total = plan
    if total <= lower * 1.03:
        return parts, total, False, False
    out, improved, timed_out = [], False, False
    for groups, span in parts:
        if time.perf_counter() >= deadline:
            out.append((groups, span))
            timed_out = True
            continue
        gdi = [int(np.searchsorted(batch.degrees, d)) for d, _ in groups]
        members = [m for _, m in groups]
        better, cut = _milp_improve(batch, np.array(sorted(i for m in members for i in m)), (gdi, members), deadline)
        timed_out |= cut
        if better is not None:
            groups, span, improved = [(int(batch.degrees[d]), m) for d, m in zip(*better)], _span(batch, *better), True
        out.append((groups, span))
    return out, sum(t for _, t in out), improved, timed_out


class _SplitSearch:
    """Sum of micro-batch makespans for contiguous cuts of the length-sorted batch, with each
    part's solution cached, and a coordinate descent on the cut positions: token-balanced cuts
    are a good start, but moving a few long sequences between neighbours often frees a group."""

    def __init__(self, batch: _Batch, order: np.ndarray, options: PlannerOptions, deadline: float):
        self.batch, self.order, self.options, self.deadline = batch, order, options, deadline
        self.budget = options.search_budget  # part solves the descent may still make
        self.timed_out = False
        self.slowest = 0.0  # seconds of the slowest part solve so far: what a start must leave room for
        self.cache: dict[tuple[int, int], list[tuple[Groups, float]]] = {}

    def exhausted(self) -> bool:
        """Out of budget (deterministic), or out of time (a guard that makes the plan depend on
        the machine's speed, so it is reported)."""
        if time.perf_counter() > self.deadline:
            self.timed_out = True
        return self.timed_out or self.budget <= 0

    def part(self, a: int, b: int) -> list[tuple[Groups, float]] | None:
        """The part's micro-batches (solved once); None if the deadline passed before its solve had any."""
        if (a, b) not in self.cache:
            self.budget -= 1
            began = time.perf_counter()
            try:
                self.cache[(a, b)] = _solve_part(self.batch, self.order[a:b], self.options, self.deadline)
            except _OutOfTime:
                self.timed_out = True
                return None
            self.slowest = max(self.slowest, time.perf_counter() - began)
        return self.cache[(a, b)]

    def total(self, cuts: list[int]) -> float:
        """The step time of the cuts; inf if time ran out before every part was solved (a part
        is not begun that would end past the deadline at the pace of the slowest so far)."""
        spans = 0.0
        for a, b in zip(cuts[:-1], cuts[1:]):
            if (a, b) not in self.cache and time.perf_counter() + self.slowest > self.deadline:
                self.timed_out = True
                return math.inf
            solved = self.part(a, b)
            if solved is None:
                return math.inf
            spans += sum(span for _, span in solved)
        return spans

    def hurried(self, cuts: list[int]) -> tuple[list[tuple[Groups, float]], float]:
        """The cuts' micro-batches when time ran out before every part was solved: the parts
        solved (the longest sequences), then the rest in the first homogeneous packing."""
        parts: list[tuple[Groups, float]] = []
        for a, b in zip(cuts[:-1], cuts[1:]):
            if (a, b) not in self.cache:
                rest = self.order[a:]
                _, packing, _ = homogeneous_packings(self.batch.lengths[rest], self.batch.cost, deadline=0.0)[0]
                parts += _with_spans(self.batch, [[(d, rest[ids].tolist()) for d, ids in groups] for groups in packing])
                break
            parts += self.cache[(a, b)]
        return parts, sum(t for _, t in parts)

    def descend(self, cuts: list[int]) -> tuple[list[int], float]:
        best = self.total(cuts)
        improved = True
        while improved and not self.exhausted():
            improved = False
            for k in range(1, len(cuts) - 1):
                # the big moves first: they free or fill a group sooner (FlexSP alone, map cells
                # faster / slower by over 2% than smallest first: 10 / 2 of 180 at 0.55 s, 6 / 1 at 1 s)
                for step in (16, -16, 4, -4, 1, -1):
                    c = cuts[k] + step
                    if not cuts[k - 1] < c < cuts[k + 1] or self.exhausted():
                        continue
                    trial = cuts[:k] + [c] + cuts[k + 1:]
                    t = self.total(trial)
                    if t < best - 1e-6:
                        cuts, best, improved = trial, t, True
                        break
        return cuts, best


def _homogeneous_packings(batch: _Batch, lengths: np.ndarray, cost: CostModel,
                          deadline: float) -> list[tuple[list, float]]:
    """The paper's warm start: the two fastest homogeneous packings (every group of one degree; the
    best is BatchAda's plan, so flexsp never does worse unless the deadline passes after the
    first), fastest first, as (micro-batches, step time)."""
    out = []
    for _, packing, _ in homogeneous_packings(lengths, cost, keep=2, deadline=deadline):
        mbs = _with_spans(batch, packing)
        out.append((mbs, sum(t for _, t in mbs)))
    return sorted(out, key=lambda c: c[1])


def _with_spans(batch: _Batch, micro_batches: list[Groups]) -> list[tuple[Groups, float]]:
    """Each micro-batch with its makespan (ms)."""
    return [(groups, batch.b1 + max(batch.group_load(np.searchsorted(batch.degrees, d), ids) for d, ids in groups))
            for groups in micro_batches]


def _cheapest_degree_start(batch: _Batch, options: PlannerOptions, deadline: float) -> tuple[list, float]:
    """Every sequence at its cheapest degree, best-fit packed into groups of that degree, groups
    stacked slowest first into micro-batches without raising any micro-batch's makespan (as many
    micro-batches as that takes); then each micro-batch re-planned. Wins where memory is so tight
    that packing tightly forces slow, wide groups: more, cheaper micro-batches beat fewer."""
    cheapest = np.argmin(np.where(batch.fits, batch.time * batch.degrees[None, :], np.inf), axis=1)
    groups = []
    for d in np.unique(cheapest):
        for ids in best_fit_bins(np.flatnonzero(cheapest == d), batch.lengths, int(batch.cap[d])):
            groups.append((batch.group_load(d, ids), int(batch.degrees[d]), ids))
    groups.sort(key=lambda g: (-g[0], -g[1], g[2][0]))
    mbs: list[list] = []
    free: list[int] = []
    for t, d, ids in groups:  # slowest first: joining a micro-batch never raises its makespan
        k = next((k for k, f in enumerate(free) if f >= d), None)
        if k is None:
            mbs.append([]), free.append(batch.n)
            k = len(mbs) - 1
        mbs[k].append((d, ids))
        free[k] -= d
    return _replan(batch, mbs, options, deadline)


def _replan(batch: _Batch, mbs: list[Groups], options: PlannerOptions, deadline: float) -> tuple[list, float]:
    """Each micro-batch of a plan re-solved with mixed degrees where that is faster (until the
    deadline: the rest stay as they are)."""
    out = []
    for groups in mbs:
        span = batch.b1 + max(batch.group_load(np.searchsorted(batch.degrees, d), ids) for d, ids in groups)
        if time.perf_counter() < deadline:
            try:
                mixed = _solve_part(batch, np.array(sorted(i for _, m in groups for i in m)), options, deadline)
            except _OutOfTime:
                mixed = []
            if mixed and sum(t for _, t in mixed) < span:
                out += mixed
                continue
        out.append((groups, span))
    return out, sum(t for _, t in out)


def _filled_start(batch: _Batch, order: np.ndarray, m: int, options: PlannerOptions,
                  deadline: float) -> tuple[list, float]:
    """Long sequences (those that need SP) split over m micro-batches; then short ones, longest
    first, fill the micro-batch with the most idle GPU time and memory left, so memory-tight
    batches need no extra micro-batch; each micro-batch is then planned whole (none if the
    deadline passes first)."""
    short = batch.min_deg_idx[order] == 0
    long_ids, short_ids = order[~short], order[short]
    if not len(long_ids):
        return [], math.inf
    mbs = [list(part) for part in balanced_split(long_ids, batch.lengths, m)]
    # Idle GPU time against each micro-batch's ideal makespan (its long sequences spread perfectly).
    spans = [max(batch.fastest[ids].max(), batch.best_gpu_ms[ids].sum() / batch.n) for ids in mbs]
    mbs += [[] for _ in range(m - len(mbs))]
    spans += [0.0] * (m - len(spans))
    idle = np.array([batch.n * sp - batch.best_gpu_ms[ids].sum() for sp, ids in zip(spans, mbs)])
    room = np.array([batch.n * batch.cost.tokens_per_gpu - batch.lengths[ids].sum() for ids in mbs])
    for i in short_ids:
        ok = room >= batch.lengths[i]
        k = int(np.argmax(np.where(ok, idle, -np.inf))) if ok.any() else int(np.argmax(room))
        mbs[k].append(int(i))
        idle[k] -= batch.best_gpu_ms[i]
        room[k] -= batch.lengths[i]
    parts = []
    for ids in filter(None, mbs):
        if time.perf_counter() > deadline:
            return [], math.inf
        try:
            parts += _solve_part(batch, np.array(sorted(ids)), options, deadline)
        except _OutOfTime:
            return [], math.inf
    return parts, sum(t for _, t in parts)


def first_plan_seconds(lengths: np.ndarray, cost: CostModel, sample: int = 20_000) -> float:
    """About how long ``plan_flexsp`` takes here before its time limit can cut it short (its set-up
    and first plan, the best homogeneous packing): timed on a random sample of ``sample`` lengths
    and scaled to them all (both grow about linearly)."""
    part = lengths if len(lengths) <= sample else np.random.default_rng(0).choice(lengths, sample, replace=False)
    start = time.perf_counter()
    _homogeneous_packings(_Batch(part, cost), part, cost, deadline=0.0)
    return (time.perf_counter() - start) * len(lengths) / len(part)


def plan_flexsp(lengths: np.ndarray, cost: CostModel, options: PlannerOptions) -> tuple[list[Groups], str]:
    start = time.perf_counter()
    deadline = start + options.time_limit
    batch = _Batch(lengths, cost)
    order = np.argsort(-lengths, kind="stable")
    # The cut search stops at its budget of part solves (or, as a guard, at 80% of the time limit:
    # on a slow machine good cuts gain more than the MILP's polish of the last micro-batches).
    search = _SplitSearch(batch, order, options, start + options.time_limit * 0.8)
    m_min = cost.min_microbatches(lengths)
    work = batch.best_gpu_ms.sum() / batch.n
    lower = cost.lower_bound_ms(lengths)  # (before the search: its time counts, at the end it would overrun)
    # Starting points: the best homogeneous packings (first: the plan to return whatever the
    # deadline cuts), the first re-planned with mixed degrees, every sequence at its cheapest
    # degree, token-balanced contiguous cuts for each micro-batch count, the second homogeneous
    # packing re-planned, and long sequences with short ones as filler.
    packing_start = time.perf_counter()
    homogeneous = _homogeneous_packings(batch, lengths, cost, deadline)
    # A search cut short packs the rest of the batch once more, which can take twice as long (the
    # short sequences left go to narrow groups, many more of them): it stops in time for that.
    search.deadline = min(search.deadline, deadline - 2 * (time.perf_counter() - packing_start))
    # The two starting points that win most often go before the cut search, which a short limit
    # would leave them no time after (at 0.55 s, 7 of 180 map cells 2-8% faster; at 1 s the same),
    # unless one would take much of the limit (its part solves ~10 packings' time, measured: 4,096
    # GPUs and 32,768 sequences packed in 0.08 s and the re-plan took 0.76 s of 1 s, leaving the cut
    # search, which wins there, no time): then they go after it, with the other starts
    def early_starts(until: float) -> list:
        return [partial(_replan, batch, [g for g, _ in homogeneous[0][0]], options, until),
                partial(_cheapest_degree_start, batch, options, until)]

    deferred = EARLY_START_PACKINGS * (time.perf_counter() - packing_start) > EARLY_START_SHARE * options.time_limit
    early = []
    for make in [] if deferred else early_starts(search.deadline):
        if time.perf_counter() < search.deadline:
            early.append(make())
        else:
            search.timed_out = True  # (a start skipped for time: the plan says so)
    contiguous, hurried = [], []
    for m in range(m_min, min(m_min + options.extra_microbatches, len(lengths)) + 1):
        best_so_far = min((t for _, t in contiguous), default=math.inf)
        if m * batch.b1 + work >= best_so_far or time.perf_counter() > search.deadline:
            break  # no split into m parts can beat it, or no time for another
        cuts = [0, *np.cumsum([len(p) for p in balanced_split(order, lengths, m)]).tolist()]
        total = search.total(cuts)
        if total == math.inf:  # (a batch too big for the time limit)
            if not contiguous and (cuts[0], cuts[1]) in search.cache:  # (only when no cut is whole)
                hurried.append(search.hurried(cuts))
            break
        contiguous.append((cuts, total))
    contiguous.sort(key=lambda c: c[1])
    others = [([mb for a, b in zip(c[:-1], c[1:]) for mb in search.part(a, b)], t) for c, t in contiguous[:1]]
    others += [homogeneous[0], *hurried, *early]
    others.sort(key=lambda c: c[1])
    # Refine the cuts by local search while contiguous splits are in the running, before the
    # starts that win less often, which a short limit would leave it no time after (FlexSP alone
    # at 0.42 s, about its share in auto: 5 of 180 map cells 2-5% faster, 1 slower; at 1 s the same)
    for cuts, total in contiguous[:2]:
        if total > others[0][1] * 1.10:
            break
        if search.exhausted():
            break
        cuts, total = search.descend(cuts)
        others.append(([mb for a, b in zip(cuts[:-1], cuts[1:]) for mb in search.part(a, b)], total))
    parts, best_time = min(others, key=lambda c: c[1])
    timed_out = search.timed_out
    # Where the plan is still over 3% above the lower bound, the MILP polishes its micro-batches:
    # with little of the limit left (as with auto's share of it, ~0.42 s) before the starts below,
    # which win less often and left it no time (FlexSP alone at 0.42 s: 6 of 180 map cells over
    # 1% faster, none slower), else after them (polishing first at 1 s: 3 cells 1-3.5% slower,
    # where one micro-batch's MILP took the time of a filled start that won)
    unpolished = True  # (the plan in hand)
    if deadline - time.perf_counter() < POLISH_FIRST * options.time_limit:
        # (the clock chose this course: the plan's status says the limit shaped it)
        parts, best_time, polished, _ = _polish(batch, (parts, best_time), lower, deadline)
        unpolished, timed_out = False, True
    # Mixed degrees inside the second homogeneous partition, then the filled starts; none begins a
    # part solve it has no time left to finish (at the pace of the slowest so far).
    last_start = deadline - search.slowest
    starts = early_starts(last_start) if deferred else []
    starts += [partial(_replan, batch, [g for g, _ in mbs], options, last_start) for mbs, _ in homogeneous[1:2]]
    starts += [partial(_filled_start, batch, order, m_min, options, last_start),
               partial(_filled_start, batch, order, m_min + 1, options, last_start)]
    for make in starts:  # each is bounded work, cut short at the deadline on a slow machine
        if time.perf_counter() > last_start:
            timed_out = True
            break
        candidate = make()
        if candidate[1] < best_time:
            (parts, best_time), unpolished = candidate, True
    if unpolished:
        parts, best_time, polished, cut = _polish(batch, (parts, best_time), lower, deadline)
        timed_out |= cut
    timed_out |= time.perf_counter() > deadline
    mbs = [groups for groups, _ in parts]
    return mbs, "time_limit" if timed_out else ("milp" if polished else "lp_rounded")
