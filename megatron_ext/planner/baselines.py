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

import math
import warnings

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.errors import InfeasibleError, InvalidPlanError
from megatron_ext.planner.api import Groups, PlannerOptions, register


def step_time_ms(micro_batches: list[Groups], lengths: np.ndarray, cost: CostModel) -> float:
    """Estimated step time: sum over micro-batches of the slowest group's time."""
    return sum(max(cost.group_time_ms(lengths[ids], d) for d, ids in groups) for groups in micro_batches)


def best_fit_bins(ids, lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit decreasing by tokens: the fewest-bins heuristic; bins in opening order."""
    ids = np.asarray(ids, dtype=np.int64)
    order = ids[np.lexsort((ids, -lengths[ids]))]  # longest first, ties by id
    bins: list[list[int]] = []
    room = np.empty(len(order), dtype=np.int64)  # room left in each open bin
    for i in order:
        s = int(lengths[i])
        if s > capacity:
            raise InfeasibleError(f"a sequence of {s} tokens exceeds the group capacity of {capacity} tokens")
        fits = np.flatnonzero(room[:len(bins)] >= s)
        if fits.size:
            b = int(fits[np.argmin(room[fits])])  # tightest fit, lowest index on ties
            bins[b].append(int(i))
            room[b] -= s
        else:
            room[len(bins)] = capacity - s
            bins.append([int(i)])
    return bins


def _chunk_by_time(slots: list[list[int]], degree: int, per_mb: int, lengths: np.ndarray,
                   cost: CostModel) -> list[Groups]:
    """Fill micro-batches of ``per_mb`` groups with the slots, slowest first: given the slots,
    this minimises the sum over micro-batches of the slowest group."""
    slots = [s for s in slots if s]
    times = [cost.group_time_ms(lengths[s], degree) for s in slots]
    order = sorted(range(len(slots)), key=lambda j: (-times[j], j))
    return [[(degree, sorted(slots[j])) for j in order[k:k + per_mb]] for k in range(0, len(order), per_mb)]


def _time_balanced_slots(lengths: np.ndarray, capacity: int, num_slots: int, cost: CostModel,
                         degree: int) -> list[list[int]] | None:
    """LPT with a token cap: longest (slowest) sequence first, into the least-loaded slot it fits;
    None if some sequence fits nowhere."""
    order = np.lexsort((np.arange(len(lengths)), -lengths))
    times = cost.seq_time_ms(lengths, degree)
    load = np.zeros(num_slots)
    tokens = np.zeros(num_slots, dtype=np.int64)
    slots: list[list[int]] = [[] for _ in range(num_slots)]
    for i in order:
        fits = tokens + lengths[i] <= capacity
        if not fits.any():
            return None
        j = int(np.argmin(np.where(fits, load, np.inf)))
        slots[j].append(int(i))
        load[j] += times[i]
        tokens[j] += lengths[i]
    return slots


def static_packing(lengths: np.ndarray, cost: CostModel, degree: int) -> list[Groups]:
    """Every group of degree ``degree``, N/degree groups per micro-batch, the fewest micro-batches
    best-fit packing by tokens allows. Within that count, the better (by estimated time) of the
    best-fit bins and a time-balanced (LPT) spread over all the micro-batches' group slots."""
    cost.check_degree(degree)
    capacity = cost.token_capacity(degree)
    longest = int(lengths.max())
    if longest > capacity:
        raise InfeasibleError(
            f"at SP degree {degree} a group holds at most {capacity} tokens, but the batch has a "
            f"sequence of {longest} tokens (it needs degree {cost.min_degree(longest)} or more); "
            f"choose a larger static degree or another planner")
    per_mb = cost.num_gpus // degree
    bins = best_fit_bins(np.arange(len(lengths)), lengths, capacity)
    num_mb = math.ceil(len(bins) / per_mb)
    plans = [_chunk_by_time(bins, degree, per_mb, lengths, cost)]
    spread = _time_balanced_slots(lengths, capacity, num_mb * per_mb, cost, degree)
    if spread is not None:
        plans.append(_chunk_by_time(spread, degree, per_mb, lengths, cost))
    times = [step_time_ms(p, lengths, cost) for p in plans]
    return plans[int(np.argmin(times))]  # first on ties: deterministic


@register("static_ulysses")
def static_ulysses(lengths: np.ndarray, cost: CostModel, options: PlannerOptions) -> tuple[list[Groups], str]:
    degree = options.static_degree if options.static_degree is not None else cost.degrees[-1]
    return static_packing(lengths, cost, degree), f"degree {degree}"


@register("batchada")
def batchada(lengths: np.ndarray, cost: CostModel, options: PlannerOptions) -> tuple[list[Groups], str]:
    lowest = cost.min_degree(int(lengths.max()))
    best, best_time, best_degree = None, math.inf, 0
    for d in cost.degrees:
        if d < lowest:
            continue
        mbs = static_packing(lengths, cost, d)
        t = step_time_ms(mbs, lengths, cost)
        if t < best_time:  # strict: the smallest degree wins ties
            best, best_time, best_degree = mbs, t, d
    return best, f"degree {best_degree} (best of {lowest}..{cost.degrees[-1]})"


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


@register("megatron_balanced_cp")
def megatron_balanced_cp(lengths: np.ndarray, cost: CostModel,
                         options: PlannerOptions) -> tuple[list[Groups], str]:
    # Imported here only: the planner package must stay importable without megatron / torch.distributed.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core warns at import that TE / Apex are absent
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

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
