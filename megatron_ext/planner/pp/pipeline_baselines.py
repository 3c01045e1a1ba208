"""Pipeline baselines through the same StepPlan and simulator as elastic_pp.

- ``batch_1f1b``: Megatron-style 1F1B over micro-batches packed (best-fit decreasing) up to
  ``pack_tokens`` (default: the longest sequence, rounded up to 1K); static recompute: none if it
  fits, else every layer.
- ``seq1f1b``: the same packs, each cut into k slices of equal compute (Seq1F1B, PAPERS.md
  section 3), k in ``seq1f1b_slices`` (the best per step); static recompute as above.

With replicas (pp x sp below the GPU count) the sequences are shared out as elastic_pp shares
them (``grouping.split_replicas``), each replica packing its own.

FlexSP (one stage, adaptive SP) and static Ulysses are FlexSP-kind plans
(``sp.step.plan_sp``), simulated as micro-batches on SP groups.
"""
from __future__ import annotations

import time

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.cost.pipeline import PipelineCost
from megatron_ext.errors import InfeasibleError
from megatron_ext.plan.schema import StepPlan
from megatron_ext.planner.packing import best_fit_bins
from megatron_ext.planner.pp.chunking import split_pack
from megatron_ext.planner.pp.grouping import split_replicas
from megatron_ext.planner.pp.pipeline import (PipelineOptions, build_pipeline, finish_plan, kept_sequences, pack_capacity,
                                           pipeline_cost, pipeline_options)
from megatron_ext.planner.pp.sequence_limits import check_sequences, longest_sequence

BATCH_1F1B_SLICES = (1,)  # whole packs


def _packed_baseline(name, lengths, cost: CostModel, pp, sp, options, seq_ids, overrides, slice_counts, where):
    """What the packed baselines share: the sequences split over the replicas, each replica's
    packs (best-fit by tokens, up to the pack size) cut into k equal-compute slices (k = 1: whole
    packs) for each k of ``slice_counts``; static recompute; the k whose slowest replica is the
    fastest wins."""
    start = time.perf_counter()
    opts = pipeline_options(options, overrides)
    lengths, ids = kept_sequences(lengths, seq_ids)
    pc = pipeline_cost(cost, pp if pp is not None else opts.pp, sp if sp is not None else opts.sp, opts)
    check_sequences(ids, lengths, pc, opts.granularity, opts.baseline_recompute, max(slice_counts))
    cap = pack_capacity(ids, lengths, opts)
    packs = [best_fit_bins(part, lengths, cap) for part in split_replicas(ids, lengths, pc, pc.replicas)]
    best, best_k, err = None, 0, None
    for k in slice_counts:
        try:
            built = [(r, build_pipeline([c for p in rp for c in split_pack(p, lengths, pc, k)], pc,
                                        opts.baseline_recompute, where=where)) for r, rp in enumerate(packs) if rp]
        except InfeasibleError as e:
            err = e
            continue
        if best is None or max(b.makespan_ms for _, b in built) < max(b.makespan_ms for _, b in best):
            best, best_k = built, k
    if best is None:  # (a sequence alone fits: ``packed_limit``; the fixed order is what holds more)
        raise InfeasibleError(f"{err}: its 1F1B order keeps up to {pc.pp} micro-batches in flight on stage 0, "
                              f"where a batch of several long sequences may not fit though each alone does; use a "
                              f"shorter --max-seq-len or elastic_pp, which slices and orders by memory") from None
    n = sum(len(rp) for rp in packs)
    reps = f" over {pc.replicas} replicas" if pc.replicas > 1 else ""
    slices = f", {best_k} slices each" if best_k > 1 else ""
    status = (f"{n} micro-batches of <= {cap} tokens{slices}{reps} x {pc.pp} stages x SP {pc.sp}; "
              f"{'; '.join(sorted({b.status for _, b in best}))}")
    return finish_plan(name, [b.to_pipeline(pc, r) for r, b in best], lengths, cost, pc, opts, start, status,
                       np.setdiff1d(np.arange(len(lengths)), ids))


def plan_batch_1f1b(lengths, cost: CostModel, pp: int | None = None, sp: int | None = None,
                    options: PipelineOptions | None = None, *, seq_ids=None, **overrides) -> StepPlan:
    """Megatron-style 1F1B over packed micro-batches; static recompute (none if it fits, else full)."""
    return _packed_baseline("batch_1f1b", lengths, cost, pp, sp, options, seq_ids, overrides, BATCH_1F1B_SLICES,
                            "batch 1F1B pipeline")


def plan_seq1f1b(lengths, cost: CostModel, pp: int | None = None, sp: int | None = None,
                 options: PipelineOptions | None = None, *, seq_ids=None, **overrides) -> StepPlan:
    """Seq1F1B: packed micro-batches, each cut into k equal-compute slices (k searched over
    ``seq1f1b_slices``); static recompute (none if it fits, else full)."""
    opts = pipeline_options(options, overrides)
    return _packed_baseline("seq1f1b", lengths, cost, pp, sp, options, seq_ids, overrides, opts.seq1f1b_slices,
                            "Seq1F1B pipeline")


def packed_limit(pc: PipelineCost, opts: PipelineOptions, slice_counts: tuple[int, ...]) -> int:
    """The longest sequence a packed baseline runs on ``pc``'s layout: alone in its pack, cut into
    the most of its ``slice_counts`` equal-compute slices (``sequence_limits.longest_sequence``).
    A batch may need more: the fixed 1F1B order can hold other packs' slices in flight beside it."""
    return longest_sequence(pc, opts.granularity, opts.baseline_recompute, max(slice_counts))


__all__ = ["BATCH_1F1B_SLICES", "packed_limit", "plan_batch_1f1b", "plan_seq1f1b"]
