"""Baseline planners, timed with the same cost model as FlexSP (PAPERS.md sections 1 and 4).

- ``static_ulysses``: DeepSpeed-Ulysses, one fixed SP degree d for every group, N/d groups per
  micro-batch, sequences packed by tokens into as few micro-batches as memory allows.
- ``batchada``: BatchAda, the best single homogeneous degree for this batch (the static packing
  at every feasible degree, keep the fastest).
- ``megatron_balanced_cp``: megatron-core's own ``BalancedCPScheduler`` (hybrid / dynamic context
  parallelism), its per-GPU sample lists turned into our (degree, seq_ids) groups.

Each is meant to be a strong baseline: the static packing balances time across the groups of a
micro-batch, and Megatron's schedule is changed only where it breaks our memory model.

What Megatron's scheduler does with real batches: its workload estimate is len^2 / cp, blind to
the linear (MLP), all-to-all and per-pass costs, and it runs each sample as its own forward and
backward, so it does not bound tokens per GPU. To balance len^2 it piles dozens of short samples
on each degree-1 GPU (1.5-3.5x what one pass of ours can hold on 512-sequence Wikipedia batches
for GPT-7B on 64 A100s) and puts the whole batch in one micro-batch. We split those groups into
capacity-sized parts over extra micro-batches; on those batches that costs 7-16% over running the
parts of each GPU set back to back with no barrier, and is 3-4x kinder than Megatron's own
one-pass-per-sample execution priced by our cost model.
"""
from __future__ import annotations

import functools
import heapq
import math
import time
import warnings

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.errors import InfeasibleError, InvalidPlanError
from megatron_ext.planner.options import PlannerOptions
from megatron_ext.planner.packing import best_fit_bins
from megatron_ext.planner.sp.step import Groups


def step_time_ms(micro_batches: list[Groups], lengths: np.ndarray, cost: CostModel) -> float:
    """Estimated step time: sum over micro-batches of the slowest group's time."""
    return sum(max(cost.group_time_ms(lengths[ids], d) for d, ids in groups) for groups in micro_batches)


def _chunk_by_time(slots: list[list[int]], degree: int, per_mb: int, seq_ms: np.ndarray,
                   cost: CostModel) -> tuple[list[Groups], float]:
    """Fill micro-batches of ``per_mb`` groups with the slots, slowest first: given the slots,
    this minimises the sum over micro-batches of the slowest group, which is returned too (ms;
    ``seq_ms``: each sequence's time at ``degree``)."""
    slots = [s for s in slots if s]
    fixed = cost.group_fixed_ms(degree)

    def group_ms(ids) -> float:  # cost.group_time_ms, from the sequence times computed once
        return fixed + float(np.sum(seq_ms[ids]))

    times = [group_ms(s) for s in slots]
    order = sorted(range(len(slots)), key=lambda j: (-times[j], j))
    mbs = [[(degree, sorted(slots[j])) for j in order[k:k + per_mb]] for k in range(0, len(order), per_mb)]
    return mbs, sum(max(group_ms(ids) for _, ids in mb) for mb in mbs)


def _time_balanced_slots(lengths: np.ndarray, capacity: int, num_slots: int,
                         seq_ms: np.ndarray) -> list[list[int]] | None:
    """LPT with a token cap: longest (slowest) sequence first, into the least-loaded slot it fits
    (the lowest slot on ties); None if some sequence fits nowhere."""
    order = np.lexsort((np.arange(len(lengths)), -lengths))
    slots: list[list[int]] = [[] for _ in range(num_slots)]
    # Heaps instead of a scan of every slot per sequence: ``ready`` (load, slot, tokens free) holds
    # the slots the current sequence fits; the others wait in ``parked`` (-free, load, slot) until
    # the sequences, longest first, are short enough for them again.
    ready = [(0.0, j, capacity) for j in range(num_slots)]
    parked: list[tuple[int, float, int]] = []
    for i, s, t in zip(order.tolist(), lengths[order].tolist(), seq_ms[order].tolist()):
        while parked and -parked[0][0] >= s:
            free, load, j = heapq.heappop(parked)
            heapq.heappush(ready, (load, j, -free))
        while ready and ready[0][2] < s:
            load, j, free = heapq.heappop(ready)
            heapq.heappush(parked, (-free, load, j))
        if not ready:
            return None
        load, j, free = heapq.heappop(ready)
        slots[j].append(i)
        heapq.heappush(ready, (load + t, j, free - s))
    return slots


def static_packing(lengths: np.ndarray, cost: CostModel, degree: int) -> tuple[list[Groups], float]:
    """Every group of degree ``degree``, N/degree groups per micro-batch, the fewest micro-batches
    best-fit packing by tokens allows. Within that count, the better (by estimated time) of the
    best-fit bins and a time-balanced (LPT) spread over all the micro-batches' group slots; with
    its estimated step time (ms)."""
    cost.check_degree(degree)
    capacity = cost.token_capacity(degree)
    longest = int(lengths.max())
    if longest > capacity:
        raise InfeasibleError(
            f"at SP degree {degree} a group holds at most {capacity} tokens, but the batch has a "
            f"sequence of {longest} tokens (it needs degree {cost.min_degree(longest)} or more); "
            f"choose a larger static degree or another planner")
    per_mb = cost.num_gpus // degree
    seq_ms = cost.seq_time_ms(lengths, degree)
    bins = best_fit_bins(np.arange(len(lengths)), lengths, capacity)
    num_mb = math.ceil(len(bins) / per_mb)
    plans = [_chunk_by_time(bins, degree, per_mb, seq_ms, cost)]
    spread = _time_balanced_slots(lengths, capacity, num_mb * per_mb, seq_ms)
    if spread is not None:
        plans.append(_chunk_by_time(spread, degree, per_mb, seq_ms, cost))
    return min(plans, key=lambda p: p[1])  # first on ties: deterministic


def static_ulysses(lengths: np.ndarray, cost: CostModel, options: PlannerOptions) -> tuple[list[Groups], str]:
    degree = options.static_degree if options.static_degree is not None else cost.degrees[-1]
    return static_packing(lengths, cost, degree)[0], f"degree {degree}"


def homogeneous_packings(lengths: np.ndarray, cost: CostModel, keep: int = 1,
                         deadline: float = math.inf) -> list[tuple[int, list[Groups], float]]:
    """``static_packing`` at feasible degrees as (degree, micro-batches, step ms), fastest first
    (the smaller degree on ties): at least the ``keep`` fastest of all. Degrees are packed in the
    order of a lower bound on their step time, and those whose bound is above the ``keep``-th
    fastest packed are skipped (they cannot be among them); past ``deadline`` (a
    ``time.perf_counter()`` time), no more after the first."""
    tokens = float(lengths.sum())
    bounds = {}
    for d in cost.degrees[cost.degrees.index(cost.min_degree(int(lengths.max()))):]:
        # Each micro-batch waits for its slowest group: at least the mean of its N/d groups, and
        # memory allows no fewer micro-batches than the tokens over N/d groups' capacity.
        per_mb = cost.num_gpus // d
        seq_ms = cost.seq_time_ms(lengths, d)
        fixed = cost.group_fixed_ms(d)
        fewest = math.ceil(tokens / (per_mb * cost.token_capacity(d)))
        bounds[d] = max(fewest * fixed + float(seq_ms.sum()) / per_mb, fixed + float(seq_ms.max()))
    out: list[tuple[int, list[Groups], float]] = []
    for d in sorted(bounds, key=bounds.get):
        if out and time.perf_counter() > deadline:
            break
        if len(out) >= keep and bounds[d] > out[keep - 1][2] * (1 + 1e-9):
            break  # (the margin: the bound and the step time sum the same times in other orders)
        out.append((d, *static_packing(lengths, cost, d)))
        out.sort(key=lambda c: (c[2], c[0]))
    return out


def batchada(lengths: np.ndarray, cost: CostModel, options: PlannerOptions) -> tuple[list[Groups], str]:
    degree, mbs, _ = homogeneous_packings(lengths, cost)[0]
    lowest = cost.min_degree(int(lengths.max()))
    return mbs, f"degree {degree} (best of {lowest}..{cost.degrees[-1]})"


# ---- Megatron-core's BalancedCPScheduler -------------------------------------------------------

class _GroupSize:
    """Stands in for the DPxCP process group: the scheduler only asks for its size."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def adapt_megatron_schedule(sample_id_groups, lengths: np.ndarray, cost: CostModel) -> tuple[list[Groups], dict]:
    """Turn BalancedCPScheduler's output (per micro-batch, per GPU, the sample ids it runs) into our
    micro-batches: the GPUs a sample appears on form its group, of degree = their number; samples
    on exactly the same GPU set share a group. Megatron runs each sample as its own forward and
    backward, so its groups ignore our memory model (a group packs its samples in one pass);
    where a group is over memory, its samples are split best-fit into capacity-sized parts and
    part r runs in the r-th micro-batch made from that Megatron micro-batch (each set's parts
    slowest first: that alignment minimises the sum of those micro-batches' slowest parts). Also repaired, and counted: degrees over
    the allowed maximum (clamped), degree sums over N (spilled into extra micro-batches), samples
    listed twice (kept once). Samples the output misses are returned in ``repairs['missing']``."""
    n = cost.num_gpus
    repairs = {"extra_micro_batches": 0, "split_groups": 0, "clamped_degrees": 0, "spilled_groups": 0,
               "duplicates": 0, "missing": []}
    placed: set[int] = set()
    out: list[Groups] = []
    for per_gpu in sample_id_groups:
        gpus_of: dict[int, list[int]] = {}
        for g, ids in enumerate(per_gpu):
            for i in ids:
                if i not in placed and g not in gpus_of.setdefault(i, []):
                    gpus_of[i].append(g)
        repairs["duplicates"] += sum(1 for per in per_gpu for i in per if i in placed)
        by_set: dict[tuple[int, ...], list[int]] = {}  # in order of first appearance
        for i, gpus in gpus_of.items():
            by_set.setdefault(tuple(sorted(gpus)), []).append(i)
        placed.update(gpus_of)
        parts_per_set: list[tuple[int, list[list[int]]]] = []
        for gpus, ids in by_set.items():
            degree = max((d for d in cost.degrees if d <= len(gpus)), default=cost.degrees[0])
            degree = max(degree, max(cost.min_degree(int(lengths[i])) for i in ids))
            if degree != len(gpus):
                repairs["clamped_degrees"] += 1
            capacity = cost.token_capacity(degree)
            if lengths[ids].sum() <= capacity:
                parts = [ids]
            else:
                repairs["split_groups"] += 1
                parts = best_fit_bins(ids, lengths, capacity)
                parts.sort(key=lambda p: -cost.group_time_ms(lengths[p], degree))  # stable: ties keep order
            parts_per_set.append((degree, parts))
        for r in range(max((len(parts) for _, parts in parts_per_set), default=0)):
            rounds: list[Groups] = []
            for degree, parts in parts_per_set:
                if r >= len(parts):
                    continue
                room = [k for k, mb in enumerate(rounds) if sum(d for d, _ in mb) + degree <= n]
                if room:
                    rounds[room[0]].append((degree, parts[r]))
                else:
                    rounds.append([(degree, parts[r])])
            repairs["spilled_groups"] += sum(len(mb) for mb in rounds[1:])
            out.extend(rounds)
    repairs["extra_micro_batches"] = len(out) - len(sample_id_groups)
    repairs["missing"] = sorted(set(range(len(lengths))) - placed)
    return out, repairs


@functools.cache
def balanced_cp_scheduler() -> type:
    """megatron-core's BalancedCPScheduler, imported on first use (the planner package stays
    importable without megatron / torch.distributed; the import, ~2 s, is not a plan's time)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core warns at import that TE / Apex are absent
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    return BalancedCPScheduler


def megatron_balanced_cp(lengths: np.ndarray, cost: CostModel,
                         options: PlannerOptions) -> tuple[list[Groups], str]:
    BalancedCPScheduler = balanced_cp_scheduler()
    per_rank = cost.token_capacity(1)
    top = cost.degrees[-1]
    # Megatron's CP size is the next power of two of len / max_seq_len_per_rank; a sequence just
    # under our largest group's capacity can map past it (past N, the scheduler fails an assert).
    # Such a sequence is shown to Megatron at the length that maps to the largest allowed degree.
    shown = np.minimum(lengths, per_rank * top)
    micro_batches: list[Groups] = []
    pending = list(range(len(lengths)))
    megatron_mbs, passes = 0, 0
    totals = {"extra_micro_batches": 0, "split_groups": 0, "clamped_degrees": 0, "spilled_groups": 0,
              "duplicates": 0}
    while pending:
        scheduler = BalancedCPScheduler(max_seq_len_per_rank=per_rank, dp_cp_group=_GroupSize(cost.num_gpus))
        # config is unused by get_groups_and_subsamples in megatron-core 0.16.1
        _, sample_id_groups = scheduler.get_groups_and_subsamples(
            [(j, int(shown[i])) for j, i in enumerate(pending)], None)
        sub = lengths[pending]
        mbs, repairs = adapt_megatron_schedule(sample_id_groups, sub, cost)
        if len(repairs["missing"]) == len(pending):
            raise InvalidPlanError("Megatron's BalancedCPScheduler scheduled none of the remaining "
                                   f"{len(pending)} sequences")
        micro_batches.extend([(d, [pending[j] for j in ids]) for d, ids in g] for g in mbs)
        for k in totals:
            totals[k] += repairs[k]
        megatron_mbs += len(sample_id_groups)
        passes += 1
        pending = [pending[j] for j in repairs["missing"]]

    notes = []
    if totals["split_groups"]:
        notes.append(f"{totals['split_groups']} groups over memory split")
    if totals["clamped_degrees"]:
        notes.append(f"{totals['clamped_degrees']} group degrees clamped")
    if totals["spilled_groups"]:
        notes.append(f"{totals['spilled_groups']} groups spilled over {cost.num_gpus} GPUs")
    if totals["duplicates"]:
        notes.append(f"{totals['duplicates']} duplicate listings dropped")
    if passes > 1:
        notes.append(f"{passes - 1} extra passes for samples Megatron missed")
    clamped = int((lengths > shown).sum())
    if clamped:
        notes.append(f"{clamped} sequences shown at degree {top}")
    status = f"balanced_cp: {megatron_mbs} Megatron micro-batch{'es' if megatron_mbs != 1 else ''}"
    if totals["extra_micro_batches"]:
        status += f" + {totals['extra_micro_batches']} extra"
    return micro_batches, status + ("; repaired: " + ", ".join(notes) if notes else "")
