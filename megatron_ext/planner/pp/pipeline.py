"""Elastic pipelines (InfiniPipe, PAPERS.md section 2): what every pipeline planner shares.

``PipelineOptions``; building and scoring one pipeline from its chunks (``build_pipeline``: the
per-stage order, the recompute, the simulated makespan); the (pp, sp) layout from what was given
(``resolve_layout``); turning pipelines into a validated, simulated StepPlan (``finish_plan``).

The planners on top: elastic_pp in pp/elastic_pp.py (its chunk search for one pipeline in
pp/chunk_search.py), the pipeline baselines (batch 1F1B, Seq1F1B) in pp/pipeline_baselines.py,
``auto`` in planner/auto.py; the entry point of every planner is ``planner.api.make_plan``.
"""
from __future__ import annotations

import dataclasses
import numbers
import time
from dataclasses import dataclass

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.cost.pipeline import PipelineCost, default_layout
from megatron_ext.errors import ConfigError, InfeasibleError, LengthsError
from megatron_ext.plan.program import list_schedule
from megatron_ext.plan.schema import Chunk, Piece, Pipeline, StepPlan
from megatron_ext.plan.validate import checked_batch_lengths, validate
from megatron_ext.planner.options import check_whole_numbers, options_as
from megatron_ext.planner.pp.checkpointing import greedy_recompute, solve_recompute
from megatron_ext.planner.pp.chunking import Pieces, pack_round
from megatron_ext.sim.engine import (ChunkTable, analyze_pieces, backward_order, greedy_orders,
                                     memory_checkpoints, memory_levels, one_f_one_b, op_times, order_names)
from megatron_ext.sim.simulator import simulate


@dataclass(frozen=True)
class PipelineOptions:
    pp: int | None = None  # stages (default: one per node that divides the layers, replicas for the rest)
    sp: int | None = None  # Ulysses degree inside a stage (default: the node size, up to the head limit)
    b1_scale: float = 1.0  # per-chunk fixed cost of a stage = b1_scale * b1 / pp (see cost/pipeline.py)
    memory_mb: float | None = None  # per-GPU budget (default: the cluster's usable memory)
    time_limit: float = 1.0  # seconds for the whole step's planning (the ILP gets what is left)
    granularity: int = 128  # slice boundaries are multiples of this many tokens
    min_slice_tokens: int = 1024  # the finest slicing of a sequence
    fit: str = "best"  # chunking: "best" (tightest by time) or "ratio" (lowest time/tokens, the paper's)
    ties: str = "best"  # recompute ILP: "tied" (the paper's diagonals), "untied" (one variable per (stage,
    # chunk)) or "best" (both; the faster simulated plan wins)
    recompute: str = "ilp"  # elastic_pp: "ilp" | "greedy" | "none" | "full"
    max_pipelines: int = 3
    pack_tokens: int | None = None  # baselines: micro-batch capacity (default: the longest sequence)
    seq1f1b_slices: tuple[int, ...] = (2, 4, 8)
    pack_slices: tuple[int, ...] = (1, 2, 4)  # elastic_pp also tries packs (of pack_tokens) cut in k slices
    order: str = "best"  # elastic_pp per-stage order: "greedy" (list scheduling) | "1f1b" | "best" (both)
    ramp: bool = True  # elastic_pp: try small warm-up / cool-down chunks (chunking.ramp_chunks)
    search_targets: int = 8  # elastic_pp: chunk-time targets tried per token cap, likeliest first
    baseline_recompute: str = "auto"  # baselines: "auto" (none if it fits, else full) | "none" | "full"
    flexsp: bool = True  # auto: FlexSP among the candidates whatever pp / sp pin (False: a run cut into stages)

    def __post_init__(self):
        for name, allowed in (("recompute", ("ilp", "greedy", "none", "full", "auto")), ("ties", ("best", "tied", "untied")),
                              ("order", ("best", "greedy", "1f1b")), ("baseline_recompute", ("auto", "none", "full"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"unknown {name.replace('_', ' ')} {getattr(self, name)!r}; use {', '.join(allowed)}")
        check_whole_numbers(self, ("granularity", "min_slice_tokens", "max_pipelines", "search_targets"))
        for name in ("seq1f1b_slices", "pack_slices"):
            ks = getattr(self, name)
            if not (ks and all(isinstance(k, numbers.Integral) and k >= 1 for k in ks)):
                raise ConfigError(f"{name.replace('_', ' ')} must be one or more positive whole numbers, got {ks!r}")



# ---- building and scoring one pipeline --------------------------------------------------------

@dataclass
class BuiltPipeline:
    pieces: list[Pieces]
    table: ChunkTable
    ops: list[list[tuple[int, int]]]
    recompute: np.ndarray  # [P, n]
    makespan_ms: float
    status: str = ""
    slices: int = 1
    order: str = "1f1b"
    ramp: str = ""
    held: int = 0  # greedy order: forwards held back by memory while a stage idled
    forwards_first: bool = True  # greedy order: ties go to the forward on the stages before the last
    build_s: float = 0.0  # seconds building it took (what rebuilding or simulating it will take, about)
    # how the search chunked it, in terms that mean the same on other sequences (chunk_search.replay):
    # ("chunks", target ms, token cap, slices capped to fit, ramp) or ("packs", tokens, slices); None: neither
    recipe: tuple | None = None

    def to_pipeline(self, pc: PipelineCost, replica: int = 0) -> Pipeline:
        # one entry per stage for every chunk, zeros when nothing is recomputed (the StepPlan contract)
        chunks = [Chunk(i, [Piece(int(s), int(a), int(b)) for s, a, b in c], [int(v) for v in self.recompute[:, i]])
                  for i, c in enumerate(self.pieces)]
        return Pipeline(pc.pp, pc.sp, chunks, order_names(self.ops, self.table.ids), replica)


def _checkpoints(table: ChunkTable, ops, pc: PipelineCost):
    P = pc.pp
    full_mid, save = pc.chunk_memory(table.tokens, table.cached_tokens, False)
    full_last, _ = pc.chunk_memory(table.tokens, table.cached_tokens, True)
    cps = [memory_checkpoints(ops[p], table, full_last if p == P - 1 else full_mid, pc, pc.activation_room_mb)
           for p in range(P)]
    return cps, save


def _fits(cps, save, rec, room) -> bool:
    return all((c.memory(save, rec[p]) <= room[p] * (1 + 1e-9) + 1e-6).all() for p, c in enumerate(cps))


def build_pipeline(pieces: list[Pieces], pc: PipelineCost, recompute: str = "greedy", tied: bool = True,
                   time_limit: float = 0.5, where: str = "pipeline", order: str = "1f1b",
                   forwards_first: bool | None = None) -> BuiltPipeline:
    """Chunks (in forward order) -> per-stage order, recompute, simulated makespan.

    ``order``: "1f1b" (elastic 1F1B, sim/engine.one_f_one_b), "greedy" (list scheduling,
    sim/engine.greedy_orders) or "best" (both; the faster wins). ``forwards_first``: the greedy
    order's tie-break (``greedy_orders``); None builds it both ways where memory held a forward
    back, and keeps the faster."""
    if order == "best":
        a = build_pipeline(pieces, pc, recompute, tied, time_limit, where, "greedy", forwards_first)
        b = build_pipeline(pieces, pc, recompute, tied, time_limit, where, "1f1b")
        return a if a.makespan_ms <= b.makespan_ms + 1e-9 else b
    if order not in ("1f1b", "greedy"):
        raise ConfigError(f"unknown pipeline order {order!r}; use 1f1b, greedy or best")
    if recompute not in ("none", "auto", "greedy", "ilp", "full"):
        raise ConfigError(f"unknown recompute mode {recompute!r}; use ilp, greedy, none, full or auto")
    started = time.perf_counter()
    table = analyze_pieces(pieces, pc, where)
    forward = list(range(table.n))
    backward = backward_order(forward, table)
    P, n = pc.pp, table.n

    def finish(ops, held: int, greedy_ms: float | None) -> BuiltPipeline:
        return _recompute_and_time(pieces, table, backward, ops, held, greedy_ms, pc, recompute, tied, time_limit,
                                   where, order, started)

    if order == "1f1b":
        return finish(one_f_one_b(forward, backward, P), 0, None)
    fwd0, bwd0, _, p2p0 = op_times(table, pc, np.zeros((P, n), dtype=np.int64))
    full = [pc.chunk_memory(table.tokens, table.cached_tokens, p == P - 1)[0] for p in range(P)]

    def greedy(first: bool) -> BuiltPipeline:
        ops, ms, held = greedy_orders(forward, backward, table, fwd0, bwd0, p2p0, P, full, pc.activation_room_mb,
                                      forwards_first=first)
        built = finish(ops, held, ms)
        built.forwards_first = first
        return built

    if forwards_first is not None:
        return greedy(forwards_first)

    # forwards first (on the stages before the last); where memory held one back while its stage
    # idled, the forwards sent ahead may cost recompute that backwards first (1F1B's window) does
    # not: both are built, the faster wins (gpt-30b on 128 A800s, 96K GitHub ZeRO-1, 4 x 8 x 4:
    # forwards first 40.8 s, 552-708 layers recomputed a pipeline, backwards first 39.3 s, 0-16)
    try:
        fed = greedy(True)
    except InfeasibleError:
        return greedy(False)
    if not fed.held:
        return fed
    try:
        other = greedy(False)
    except InfeasibleError:
        return fed
    return fed if fed.makespan_ms <= other.makespan_ms + 1e-9 else other


def with_recompute(built: BuiltPipeline, pc: PipelineCost, recompute: str, tied: bool = True, time_limit: float = 0.5,
                   where: str = "pipeline") -> BuiltPipeline:
    """``built``'s chunks in its order, their recompute chosen anew (``recompute``: the mode; the
    final ILP): the order is not worked out again, nor built both ways."""
    table = built.table
    return _recompute_and_time(built.pieces, table, backward_order(list(range(table.n)), table), built.ops, built.held,
                               None, pc, recompute, tied, time_limit, where, built.order, time.perf_counter())


def _recompute_and_time(pieces, table: ChunkTable, backward: list[int], ops, held: int, greedy_ms: float | None,
                        pc: PipelineCost, recompute: str, tied: bool, time_limit: float, where: str, order: str,
                        started: float) -> BuiltPipeline:
    """``build_pipeline`` past its order: the chunks' recompute (``recompute``, the mode) and makespan."""
    P, L_s, n = pc.pp, pc.layers_per_stage, table.n
    room = np.full(P, pc.activation_room_mb)
    if recompute != "full" and _fits_without_recompute(table, ops, pc):  # the common case, cheaply
        rec = np.zeros((P, n), dtype=np.int64)
        status = {"greedy": "greedy recompute", "ilp": "no recompute needed"}.get(recompute, "no recompute")
        return _finish_build(pieces, table, ops, rec, status, order, held, greedy_ms, pc, started)
    cps, save = _checkpoints(table, ops, pc)
    rc = pc.recompute_ms(table.work, table.tokens, 1)
    bpos = np.empty(n, dtype=np.int64)
    bpos[np.asarray(backward, dtype=np.int64)] = np.arange(n)

    def name(kind, k):
        return f"{'FB'[kind]}{table.ids[k]}"

    status = ""
    if recompute in ("none", "full", "auto"):
        rec = np.zeros((P, n), dtype=np.int64)
        if recompute == "full" or (recompute == "auto" and not _fits(cps, save, rec, room)):
            rec[:] = L_s
            status = "full recompute"
        else:
            status = "no recompute"
        if not _fits(cps, save, rec, room):
            p = next(p for p, c in enumerate(cps) if not (c.memory(save, rec[p]) <= room[p] + 1e-6).all())
            mem = cps[p].memory(save, rec[p])
            i = int(np.argmax(mem))
            raise InfeasibleError(f"{where}: stage {p} needs {mem.max() + pc.model_states_mb:.1f} MB per GPU at "
                                  f"{name(int(cps[p].kind[i]), int(cps[p].chunk[i]))} with {status}, over the "
                                  f"{pc.budget_mb:.1f} MB budget")
    elif recompute == "greedy":
        rec = greedy_recompute(cps, save, rc, L_s, room, bpos, tied, where, name)
        status = "greedy recompute"
    elif recompute == "ilp":
        rec, status = solve_recompute(cps, save, rc, L_s, room, bpos, tied, time_limit, 0.02, where, name)
    return _finish_build(pieces, table, ops, rec, status, order, held, greedy_ms, pc, started)


def _fits_without_recompute(table: ChunkTable, ops, pc: PipelineCost) -> bool:
    """Every stage within its activation room at every moment with no recompute."""
    P, room = pc.pp, pc.activation_room_mb * (1 + 1e-9) + 1e-6
    zero = np.zeros(table.n)
    for p in range(P):
        full, _ = pc.chunk_memory(table.tokens, table.cached_tokens, p == P - 1)
        _, during, _ = memory_levels(ops[p], table, full, zero, zero, pc)
        if len(during) and during.max() > room:
            return False
    return True


def _finish_build(pieces, table, ops, rec, status, order, held, greedy_ms, pc, started) -> BuiltPipeline:
    n = table.n
    if greedy_ms is not None and not rec.any():  # the list scheduler's times are the greedy's own
        makespan = greedy_ms
    else:
        fwd, bwd, _, p2p = op_times(table, pc, rec)
        _, end = list_schedule(ops, fwd, bwd, p2p, table.fwd_pred, table.bwd_pred,
                               name=lambda kind, k: f"{'FB'[kind]}{table.ids[k]}")
        makespan = float(np.nanmax(end)) if n else 0.0
    return BuiltPipeline(pieces, table, ops, rec, makespan, status, order=order, held=held,
                         build_s=time.perf_counter() - started)


def resolve_layout(cost: CostModel, pp, sp) -> tuple[int, int]:
    """(pp, sp) from what was given: both, the default layout, or one of them with the other the
    most the GPUs allow (the rest of the GPUs run replicas)."""
    n, L = cost.num_gpus, cost.model.num_layers
    if pp is None and sp is None:
        return default_layout(cost)
    if pp is None:  # the stages follow from sp: refuse an sp that leaves none, naming sp
        cost.check_degree(sp)  # (an allowed degree divides the GPUs)
        # the most stages that divide both the layers and the GPUs left
        return max(p for p in range(1, n // sp + 1) if (n // sp) % p == 0 and L % p == 0), sp
    if sp is None and isinstance(pp, int) and pp > 0:  # (PipelineCost names what else is wrong with pp)
        if n % pp:
            fits = [p for p in range(1, n + 1) if n % p == 0 and L % p == 0]
            raise ConfigError(f"pipeline degree {pp} does not divide the {n} GPUs of {cost.cluster.name}; choose one "
                              f"of {', '.join(map(str, fits))}")
        sp = n // pp
        if sp not in cost.stage_degrees:  # more GPUs per stage than Ulysses can use: the largest degree, and replicas
            sp = max(d for d in cost.stage_degrees if sp % d == 0)
    return pp, sp


def pipeline_cost(cost: CostModel, pp, sp, opts: PipelineOptions) -> PipelineCost:
    pp, sp = resolve_layout(cost, pp, sp)
    return PipelineCost(cost, pp, sp, opts.b1_scale, opts.memory_mb)


def finish_plan(name: str, pipes: list[Pipeline], lengths: np.ndarray, cost: CostModel, pc: PipelineCost,
            opts: PipelineOptions, start: float, status: str, dropped=()) -> StepPlan:
    plan = StepPlan(kind="elastic_pp", num_gpus=cost.num_gpus, planner=name, pipelines=pipes,
                    solver_status=status, dropped_seq_ids=[int(i) for i in dropped])
    validate(plan, lengths, cost)  # (its pipelines' programs too)
    res = simulate(plan, lengths, cost, b1_scale=opts.b1_scale, memory_mb=opts.memory_mb, events=False)
    plan.solve_time_s = time.perf_counter() - start
    plan.estimated_step_time_s = res.step_time_s
    kept = np.delete(lengths, list(dropped)) if len(dropped) else lengths
    plan.lower_bound_step_time_s = pc.lower_bound_ms(kept) / 1e3
    return plan


def pipeline_options(options, overrides) -> PipelineOptions:
    """``options`` (a PipelineOptions, a PlannerOptions or None) as PipelineOptions, with ``overrides``."""
    options = options_as(PipelineOptions, options)
    return dataclasses.replace(options, **overrides) if overrides else options


def kept_sequences(lengths, seq_ids) -> tuple[np.ndarray, np.ndarray]:
    lengths = checked_batch_lengths(lengths)
    ids = np.arange(len(lengths)) if seq_ids is None else np.asarray(seq_ids, dtype=np.int64)
    if ids.size == 0:
        raise LengthsError("no sequence left to plan")
    return lengths, ids


def pack_capacity(seq_ids, lengths, opts: PipelineOptions) -> int:
    """Tokens per packed micro-batch: ``pack_tokens``, or the longest sequence rounded up to 1K."""
    longest = int(lengths[seq_ids].max())
    if opts.pack_tokens is None:
        return pack_round(longest)
    if opts.pack_tokens < longest:
        raise ConfigError(f"pack_tokens {opts.pack_tokens} is below the longest sequence ({longest} tokens)")
    return int(opts.pack_tokens)


__all__ = ["BuiltPipeline", "PipelineOptions", "build_pipeline", "finish_plan", "kept_sequences",
           "pack_capacity", "pipeline_cost", "pipeline_options", "resolve_layout", "with_recompute"]
