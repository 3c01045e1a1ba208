"""Barrier-free timelines: FlexSP without a barrier between micro-batches (``StepPlan.barrier_free``).

The GPUs are split into aligned power-of-two sets, each running its own passes back to back: a
pass of degree d is a Ulysses group of d GPUs, its sequences within the group's memory
(``CostModel.token_capacity``), paying its fixed cost (``group_fixed_ms``). No set waits for
another, so the step is the last GPU's finish plus the exposed gradient sync, and the one longest
sequence no longer holds every other GPU idle for its whole pass. A set done with its wide passes
splits into halves that go on with narrower ones (buddy blocks: a rank's passes stay in order, a
block stays aligned). Only under ZeRO 0/1/2: under ZeRO-3 every pass gathers parameters over
every GPU.

The plan (``plan_timelines``), for a makespan target T found by bisection (``_Batch.layout``):
1. each sequence takes the smallest allowed degree whose pass of it alone fits T (the cheapest in
   GPU-ms as a rule: all-to-all grows with the degree; long sequences get wide GPUs);
2. degrees widest first: the sequences of a degree, slowest first, each go to the slot of that
   degree that ends first, into its last pass if the tokens fit, else into a new pass (passes
   filled to capacity: each pays the fixed cost); a new GPU set opens where that would pass T;
   then every slot splits into two halves of the next degree, free from its end on;
3. T is feasible when the sets' GPUs add up to at most N (placed widest first: aligned);
4. with few sequences a GPU, the narrowest degree is raised (2, 4, ...) while the layout at its
   own smallest T ends sooner: wider groups pack several short sequences into one pass, where the
   narrowest would give each its own pass and fixed cost.
At the smallest feasible T found, GPUs left over open sets from the start and the same target is
laid out again, the work spread over them, where that ends sooner. Bounded work (a bisection to
0.2%), linear-logarithmic in the sequences; the time limit cuts the bisection short (the best
feasible T so far is kept).
"""
from __future__ import annotations

import heapq
import math
import time

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.errors import ConfigError
from megatron_ext.planner.options import PlannerOptions

# the GPU sets' degrees, and every pass: (micro-batch, set, offset of its GPUs in the set, degree, seq ids)
Sets = tuple[list[int], list[tuple[int, int, int, int, list[int]]]]
REL_TOL = 2e-3  # the bisection stops when the feasible T is within this of an infeasible one
# The first feasible T is sought up from the lower bound at bound x (1 + GALLOP_STEP x 4^i): the
# smallest is mostly within a few % of it (32,768 sequences on 4,096 GPUs: 3.9%), where doubling
# the bound then bisecting took 6 layouts to come within 1% of it, and a short limit kept 20% over
GALLOP_STEP = 0.01
FLOOR_SHARE = 0.3  # of the time limit: no narrowest degree is raised after it (step 4 of the docstring)


class _Batch:
    """Per-sequence times at every allowed degree, computed once per step."""

    def __init__(self, lengths: np.ndarray, cost: CostModel):
        self.lengths = lengths
        self.n = cost.num_gpus
        self.degrees = np.array(cost.degrees, dtype=np.int64)
        self.cap = np.array([cost.token_capacity(int(d)) for d in self.degrees], dtype=np.int64)
        self.fixed = np.array([cost.group_fixed_ms(int(d)) for d in self.degrees])
        self.time = np.stack([cost.seq_time_ms(lengths, int(d)) for d in self.degrees], axis=1)  # [K, D]
        self.allowed = lengths[:, None] <= self.cap[None, :]
        self.alone = np.where(self.allowed, self.time + self.fixed[None, :], np.inf)  # a pass of it alone
        self.order = np.argsort(-lengths, kind="stable")  # longest (slowest at any degree) first

    def degree_at(self, T: float, floor: int = 0) -> np.ndarray | None:
        """Per sequence, the index of the smallest allowed degree, ``floor`` or more, whose pass of
        it alone fits T; None if one fits at none."""
        ok = self.alone <= T
        ok[:, :floor] = False
        if not ok.any(axis=1).all():
            return None
        return np.argmax(ok, axis=1)

    def layout(self, T: float, spare: int = 0, floor: int = 0) -> _Layout | None:
        """Every sequence placed at target T (module docstring), widest degree first; None if the
        GPU sets need more than N GPUs. ``spare``: GPUs to open sets on before any is needed (the
        widest powers of two that fit), so the work spreads over them too. ``floor``: the index of
        the narrowest degree any sequence takes."""
        at = self.degree_at(T, floor)
        if at is None:
            return None
        out = _Layout(self)
        spare_sets, top = [], int(at.max())
        while spare and top >= 0:
            if self.degrees[top] <= spare:
                spare_sets.append(top)
                spare -= int(self.degrees[top])
            else:
                top -= 1
        for d in range(len(self.degrees) - 1, -1, -1):
            for _ in range(spare_sets.count(d)):
                out.open_set(d)
            if not out.place(self.order[at[self.order] == d], d, T):
                return None
            out.split(d)
        return out


class _Layout:
    """GPU sets and the slots they split into. A slot is a block of GPUs free from ``ready`` ms
    on, its first pass micro-batch ``first``; once every sequence of its degree is placed, it
    splits into two halves, each going on from the slot's end (its micro-batch count too)."""

    def __init__(self, batch: _Batch):
        self.batch = batch
        self.sets: list[int] = []  # degree index of each GPU set, in opening order
        self.gpus = 0
        # per slot: set, offset in the set (GPUs), degree index, first micro-batch, passes, end (ms), room (tokens)
        self.slots: list[list] = []
        self.open: list[int] = []  # the slots of the degree being placed
        self.done: list[list] = []  # slots with their passes placed: (set, offset, degree, first, passes)

    def open_set(self, d: int) -> int:
        self.sets.append(d)
        self.gpus += int(self.batch.degrees[d])
        self.slots.append([len(self.sets) - 1, 0, d, 0, [], 0.0, 0])
        self.open.append(len(self.slots) - 1)
        return len(self.slots) - 1

    def place(self, ids: np.ndarray, d: int, T: float) -> bool:
        """Sequences ``ids`` (slowest first) at degree index ``d``, each to the open slot that ends
        first: into its last pass if the tokens fit, else a new pass; a new GPU set where that
        would pass T. False if the sets need more than N GPUs."""
        b = self.batch
        fixed, cap, width = float(b.fixed[d]), int(b.cap[d]), int(b.degrees[d])
        heap = [(self.slots[j][5], j) for j in self.open]
        heapq.heapify(heap)
        for i, t, s in zip(ids.tolist(), b.time[ids, d].tolist(), b.lengths[ids].tolist()):
            end, j = heap[0] if heap else (math.inf, -1)
            slot = self.slots[j] if heap else None
            if slot is not None and slot[4] and slot[6] >= s and end + t <= T:
                slot[4][-1].append(i)
                slot[6] -= s
                slot[5] = end + t
            elif slot is not None and end + fixed + t <= T:
                slot[4].append([i])
                slot[6] = cap - s
                slot[5] = end + fixed + t
            else:
                if self.gpus + width > b.n:
                    return False
                j = self.open_set(d)
                slot = self.slots[j]
                slot[4].append([i])
                slot[6] = cap - s
                slot[5] = fixed + t
                heapq.heappush(heap, (slot[5], j))
                continue
            heapq.heapreplace(heap, (slot[5], j))
        return True

    def split(self, d: int) -> None:
        """Close the slots of degree index ``d``; their halves are the slots of the next degree."""
        halves = []
        for j in self.open:
            k, off, _, first, passes, end, _ = self.slots[j]
            if passes:
                self.done.append((k, off, d, first, passes))
            if d > 0:
                half = int(self.batch.degrees[d - 1])
                for o in (off, off + half):
                    self.slots.append([k, o, d - 1, first + len(passes), [], end, 0])
                    halves.append(len(self.slots) - 1)
        self.open = halves

    def end_ms(self) -> float:
        return max((s[5] for s in self.slots), default=0.0)


def _bisect(batch: _Batch, deadline: float, floor: int = 0) -> tuple[float, _Layout, bool]:
    """The smallest feasible T (to REL_TOL) with no degree below index ``floor``, its layout, and
    whether the deadline cut it short."""
    at_least = batch.alone[:, floor:].min(axis=1)  # each sequence's fastest pass alone
    gpu_ms = np.where(batch.allowed, batch.time * batch.degrees[None, :], np.inf)[:, floor:]
    work = gpu_ms.min(axis=1).sum() / batch.n
    bound = lo = hi = max(float(at_least.max()), float(work))
    best = batch.layout(hi, floor=floor)
    step = GALLOP_STEP
    while best is None:  # (finite: at a T that holds every sequence, one set of the widest degree holds them all)
        lo, hi, step = hi, bound * (1 + step), step * 4
        best = batch.layout(hi, floor=floor)
    cut = False
    while hi > lo * (1 + REL_TOL):
        if time.perf_counter() > deadline:
            cut = True
            break
        mid = (lo + hi) / 2
        trial = batch.layout(mid, floor=floor)
        if trial is None:
            lo = mid
        else:
            hi, best = mid, trial
    return hi, best, cut


def plan_timelines(lengths: np.ndarray, cost: CostModel, options: PlannerOptions) -> tuple[Sets, str]:
    """The GPU sets of a barrier-free plan, each with its passes (module docstring), and a status:
    "timelines", or "time_limit" where the limit cut the bisection or the narrowest degree's search short."""
    if cost.zero_stage == 3:
        raise ConfigError("timelines runs each GPU set's passes without a barrier between micro-batches, which needs "
                          "ZeRO 0, 1 or 2 (under ZeRO-3 every pass gathers parameters over every GPU); "
                          "pass --zero-stage 2")
    start = time.perf_counter()
    deadline = start + options.time_limit
    batch = _Batch(np.asarray(lengths, dtype=np.int64), cost)
    T, best, cut = _bisect(batch, deadline)
    floor = 0
    # Few sequences a GPU: the narrowest degrees leave most GPUs with one short pass each, and each
    # pass pays the fixed cost; wider groups packing several sequences can end sooner. Raise the
    # narrowest degree while that helps (and the limit allows)
    while floor + 1 < len(batch.degrees):
        if time.perf_counter() >= start + FLOOR_SHARE * options.time_limit:
            cut = True  # (the clock, not the search, ended it: said in the status)
            break
        T_up, wider, cut_up = _bisect(batch, start + 2 * FLOOR_SHARE * options.time_limit, floor + 1)
        if wider.end_ms() >= best.end_ms():
            break
        floor, T, best, cut = floor + 1, T_up, wider, cut_up
    if best.gpus < batch.n:  # GPUs left over: the same target with them in use from the start
        spread = batch.layout(T, batch.n - best.gpus, floor)
        if spread is not None and spread.end_ms() < best.end_ms():
            best = spread
    groups = [(first + p, k, off, int(batch.degrees[d]), ids)
              for k, off, d, first, passes in best.done for p, ids in enumerate(passes)]
    return ([int(batch.degrees[d]) for d in best.sets], groups), "time_limit" if cut else "timelines"


__all__ = ["Sets", "plan_timelines"]
