"""Pipeline baselines through the same StepPlan and simulator as elastic_pp.

- ``batch_1f1b``: Megatron-style 1F1B over micro-batches packed (best-fit decreasing) up to
  ``pack_tokens`` (default: the longest sequence, rounded up to 1K); static recompute: none if it
  fits, else every layer.
- ``seq1f1b``: the same packs, each cut into k slices of equal compute (Seq1F1B, PAPERS.md
  section 3), k in ``seq1f1b_slices`` (the best per step); static recompute as above.

FlexSP (one stage, adaptive SP) and static Ulysses are FlexSP-kind plans
(``api.plan_flexsp_kind``), simulated as micro-batches on SP groups.
"""
from __future__ import annotations

import time

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.errors import InfeasibleError
from megatron_ext.plan.schema import StepPlan
from megatron_ext.planner.chunking import pack_by_tokens, split_pack
from megatron_ext.planner.pipeline import (PipelineOptions, build_pipeline, finish_plan, kept_sequences, pack_capacity,
                                           pipeline_cost, pipeline_options)


def _packed_baseline(lengths, cost: CostModel, pp, sp, options, seq_ids, overrides):
    """What the packed baselines share: options, kept sequences, the stage cost model, the pack
    size and the packs (best-fit by tokens)."""
    opts = pipeline_options(options, overrides)
    lengths, ids = kept_sequences(lengths, seq_ids)
    pc = pipeline_cost(cost, pp if pp is not None else opts.pp, sp if sp is not None else opts.sp, opts)
    cap = pack_capacity(ids, lengths, opts)
    return opts, lengths, ids, pc, cap, pack_by_tokens(ids, lengths, cap)


def plan_batch_1f1b(lengths, cost: CostModel, pp: int | None = None, sp: int | None = None,
                    options: PipelineOptions | None = None, *, seq_ids=None, **overrides) -> StepPlan:
    """Megatron-style 1F1B over packed micro-batches; static recompute (none if it fits, else full)."""
    start = time.perf_counter()
    opts, lengths, ids, pc, cap, packs = _packed_baseline(lengths, cost, pp, sp, options, seq_ids, overrides)
    pieces = [[(i, 0, int(lengths[i])) for i in p] for p in packs]
    b = build_pipeline(pieces, pc, opts.baseline_recompute, where="batch 1F1B pipeline")
    status = f"{len(packs)} micro-batches of <= {cap} tokens x {pc.pp} stages x SP {pc.sp}; {b.status}"
    return finish_plan("batch_1f1b", [b.to_pipeline(pc)], lengths, cost, pc, opts, start, status,
                   np.setdiff1d(np.arange(len(lengths)), ids))


def plan_seq1f1b(lengths, cost: CostModel, pp: int | None = None, sp: int | None = None,
                 options: PipelineOptions | None = None, *, seq_ids=None, **overrides) -> StepPlan:
    """Seq1F1B: packed micro-batches, each cut into k equal-compute slices (k searched over
    ``seq1f1b_slices``); static recompute (none if it fits, else full)."""
    start = time.perf_counter()
    opts, lengths, ids, pc, cap, packs = _packed_baseline(lengths, cost, pp, sp, options, seq_ids, overrides)
    best, best_k, err = None, 0, None
    for k in opts.seq1f1b_slices:
        pieces = [c for p in packs for c in split_pack(p, lengths, pc, k)]
        try:
            b = build_pipeline(pieces, pc, opts.baseline_recompute, where="Seq1F1B pipeline")
        except InfeasibleError as e:
            err = e
            continue
        if best is None or b.makespan_ms < best.makespan_ms:
            best, best_k = b, k
    if best is None:
        raise err
    status = f"{len(packs)} micro-batches of <= {cap} tokens, {best_k} slices each x {pc.pp} stages x SP {pc.sp}; " \
             f"{best.status}"
    return finish_plan("seq1f1b", [best.to_pipeline(pc)], lengths, cost, pc, opts, start, status,
                   np.setdiff1d(np.arange(len(lengths)), ids))



__all__ = ["plan_batch_1f1b", "plan_seq1f1b"]
