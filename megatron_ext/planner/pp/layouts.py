"""What ``auto`` knows of a pipeline layout before planning it: the layouts a cluster allows
(``pipeline_layouts``); each one's estimate (``layout_estimate``: one 1F1B pipeline of equal chunks
a replica), the chunks memory forces on it (``forced_slices``) and the order the layouts are tried
in (``layout_order_key``), gathered with what building one candidate costs in a ``Layout``
(``estimated_layout``). Pure Python + numpy."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.cost.pipeline import PipelineCost
from megatron_ext.errors import MegatronExtError
from megatron_ext.planner.pp.chunk_search import chunk_stage_s
from megatron_ext.planner.pp.grouping import pipeline_estimates, split_replicas
from megatron_ext.planner.pp.pipeline import PipelineOptions
from megatron_ext.planner.pp.sequence_limits import memory_slices

# Order of the layouts: the estimate, raised by up to this share where memory presses (``layout_pressure``),
# from none at AUTO_PRESSURE_FROM to all of it at AUTO_PRESSURE_FROM + AUTO_PRESSURE_SPAN. (From 0.7 over 1.0
# while a slice kept a copy of its prefix's K/V, which pressed layouts paid; with that window anew, 9-23
# map cells over 2% behind in runs beside 4-22 with this one, the excess over 2% 0.83-1.56 against 0.44-1.25)
AUTO_PRESSURE_PENALTY = 0.3
AUTO_PRESSURE_FROM = 1.0
AUTO_PRESSURE_SPAN = 2.0
# ... and by this share per doubling of the stages past 8: 16- and 32-stage pipelines were planned at
# 1.3-1.9x their estimate (gpt-7b on 64 A100-40GB at 48K: 32 x SP 2 at 1.29x, 16 x SP 2 x 2 at 1.3x),
# where the long sequences' chains of slices cross many stages one slice at a time
AUTO_DEPTH_PENALTY = 0.15


def pipeline_layouts(cost: CostModel, pp: int | None = None, sp: int | None = None,
                     memory_mb: float | None = None) -> list[tuple[int, int]]:
    """(pp, sp) layouts an elastic pipeline can use: pp stages dividing the layers, sp an
    allowed Ulysses degree (power of two dividing the heads), pp x sp dividing the GPUs (the rest
    run side by side as replicas, one-stage ones too), the model states fitting (in ``memory_mb``
    per GPU, default the cluster's). ``pp`` / ``sp`` restrict the list to matching layouts."""
    n, L = cost.num_gpus, cost.model.num_layers
    out = []
    for P in range(1, n + 1):
        if n % P or L % P or (pp is not None and P != pp):
            continue
        for d in cost.degrees:
            if (n // P) % d or (sp is not None and d != sp):
                continue
            try:  # (refused: a ring degree, as a stage's SP group is Ulysses only; model states over the memory)
                PipelineCost(cost, P, d, memory_mb=memory_mb)
            except MegatronExtError:
                continue
            out.append((P, d))
    return out


def layout_name(pc: PipelineCost) -> str:
    return f"elastic_pp pp{pc.pp} x sp{pc.sp}" + (f" x dp{pc.replicas}" if pc.replicas > 1 else "")


def layout_estimate(lengths: np.ndarray, pc: PipelineCost, min_slice_tokens: int = 1024,
                    lower_ms: float | None = None) -> tuple[float, int]:
    """Step time of the layout's replicas, each one 1F1B pipeline of n equal chunks at its best n
    (``pipeline_estimate``) on the sequences elastic_pp gives it (``grouping.split_replicas``: a
    few long sequences over many replicas leave some with more than their share), the slowest
    replica's, plus the step's exposed gradient sync; never below the layout's lower bound
    (``PipelineCost.lower_bound_ms``, which deep pipelines' estimates undercut; ``lower_ms``: that
    bound where already known). Returns (seconds, chunks per replica: the slowest replica's at its
    best n)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    parts = [p for p in split_replicas(np.arange(len(lengths)), lengths, pc, pc.replicas) if p.size]
    ms, chunks = pipeline_estimates(lengths, parts, pc, min_slice_tokens)
    slowest = np.lexsort((chunks, ms))[-1]  # (the most chunks among equal times)
    bound = pc.lower_bound_ms(lengths) if lower_ms is None else lower_ms
    return max(float(ms[slowest]) + pc.step_sync_ms, bound) / 1e3, int(chunks[slowest])


def forced_slices(lengths: np.ndarray, pc: PipelineCost, granularity: int = 128) -> int:
    """Chunks memory forces on the batch: the slices of its sequences that cannot run whole on the
    layout (each cut into slices of at most its ``fit_cap`` tokens), and at least its tokens over
    what the last stage holds in one chunk (the pipeline bound's count): a floor of any plan's
    chunks, which the estimate's 1F1B chunk count misses where memory binds hard (gpt-13b, 2
    stages x SP 4 on 80 GB, 96K: nine 96K sequences of 768 slices each; the search's candidates had
    11,000 chunks and took 2.4 s to build, against the estimate's 380; llama-7b, 2 x 4 on 8
    A100-40GB at ZeRO-1: 512 Wikipedia sequences in 2,548 chunks of up to 200 tokens, a probe of
    0.19 s started with 0.065 s left)."""
    lengths = np.asarray(lengths)
    whole = pc.act_layer_mb * pc.layers_per_stage + float(pc.head_mb)  # (``sequence_peak_mb`` unsliced)
    over, count = np.unique(lengths[lengths * whole > pc.activation_room_mb], return_counts=True)
    slices = sum(memory_slices(int(s), pc, granularity) * int(c) for s, c in zip(over, count))
    return max(slices, math.ceil(float(lengths.sum()) * whole / pc.activation_room_mb - 1e-9))


def layout_pressure(lengths: np.ndarray, pc: PipelineCost) -> float:
    """How much of a stage's activation room the batch's longest sequence takes, whole (its
    activations and K/V, nothing recomputed), twice over when pipelined (a slice in flight beside
    its successor's). ``layout_estimate`` sees memory only as a chunk count; where it presses,
    the plan must also cut the longest sequence into a chain of slices, recompute it or run
    several pipelines one after another, which it does not see: past 0.7 such layouts were
    planned at up to 1.4x their estimate, below it mostly at 0.97-1.05x (llama-13b, 32 GPUs, ZeRO
    1 and 3, 48K / 96K)."""
    whole = (pc.act_layer_mb + pc.kv_layer_mb) * pc.layers_per_stage
    return float(np.max(lengths)) * whole * min(pc.pp, 2) / pc.activation_room_mb


def head_excess_s(lengths: np.ndarray, pc: PipelineCost) -> float:
    """Seconds the last stage works beyond the average stage's (the output layer and loss run
    there alone) on a replica's share of the batch: it paces the pipeline, which the estimate's
    average stage does not see (gpt-7b on 8 x 4: 31.7 s on the last stage, 28.5 s on the others)."""
    tokens = float(np.sum(lengths)) / pc.replicas
    return pc.cost.a2 * tokens * (pc.linear_share(pc.pp - 1) - pc.stage_share) / pc.sp / 1e3


def layout_order_key(lengths: np.ndarray, pc: PipelineCost, estimate_s: float) -> float:
    """What the layouts are tried in, likeliest first: the estimate plus the last stage's excess
    (``head_excess_s``), raised by up to ``AUTO_PRESSURE_PENALTY`` as the longest sequence's
    pressure goes from ``AUTO_PRESSURE_FROM`` (the whole room) to ``AUTO_PRESSURE_FROM +
    AUTO_PRESSURE_SPAN``, and by ``AUTO_DEPTH_PENALTY`` per doubling of the stages past 8. (The
    excess orders the layouts and prunes none: raised estimates lost layouts that won to
    FlexSP's and timelines' plans.)"""
    lift = min(1.0, max(0.0, (layout_pressure(lengths, pc) - AUTO_PRESSURE_FROM) / AUTO_PRESSURE_SPAN))
    return (estimate_s + head_excess_s(lengths, pc)) * (1 + AUTO_PRESSURE_PENALTY * lift) * \
        (1 + AUTO_DEPTH_PENALTY * max(0.0, math.log2(pc.pp / 8)))

class Layout(NamedTuple):
    """A layout ``auto`` may plan, with what it knows before planning it."""

    key: float  # ``layout_order_key``: the layouts are tried in its order (then by name)
    estimate_s: float  # ``layout_estimate``
    name: str  # ``layout_name``
    pp: int
    sp: int
    chunk_stages: int  # of one candidate: the estimate's chunks, at least those memory forces, x stages
    build_s: float  # what building, checking and simulating one candidate takes (``chunk_stage_s``)


def estimated_layout(lengths: np.ndarray, pc: PipelineCost, opts: PipelineOptions,
                     lower_ms: float | None = None) -> Layout:
    """``pc``'s ``Layout`` for the batch ``lengths`` (``lower_ms``: its lower bound, where known).
    One candidate is priced per replica's pipeline: a pipeline of few chunks has few in flight."""
    est, chunks = layout_estimate(lengths, pc, opts.min_slice_tokens, lower_ms)
    chunks = max(chunks * pc.replicas, forced_slices(lengths, pc, opts.granularity))
    return Layout(layout_order_key(lengths, pc, est), est, layout_name(pc), pc.pp, pc.sp, chunks * pc.pp,
                  chunks * pc.pp * chunk_stage_s(chunks / pc.replicas))


__all__ = ["AUTO_DEPTH_PENALTY", "AUTO_PRESSURE_FROM", "AUTO_PRESSURE_PENALTY", "AUTO_PRESSURE_SPAN", "Layout",
           "estimated_layout", "forced_slices", "head_excess_s", "layout_estimate", "layout_name", "layout_order_key",
           "layout_pressure", "pipeline_layouts"]
