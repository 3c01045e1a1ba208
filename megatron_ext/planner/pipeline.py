"""Elastic pipeline parallelism (InfiniPipe, PAPERS.md section 2): the elastic_pp planner.

``plan_elastic_pp(lengths, cost, pp, sp)``; with pp x sp below the GPU count, the sequences are
first shared out over GPUs / (pp x sp) replicas side by side (grouping.split_replicas), each
planned as below in a share of the time limit, and the replicas' ends are evened out in the time
left (``_rebalance``):
0. Feasibility (planner/sequence_limits.py): each of the longest sequences must fit alone at
   the finest slicing (every layer recomputed); otherwise the error says how long a sequence may
   be and what else to change.
1. Grouping (planner/grouping.py): the sequences, longest first, are cut into one or more
   consecutive groups, each run as its own 1F1B pipeline, one after another, by a DP over an
   analytic estimate. When memory binds, "the longest sequence in a pipeline of its own" is
   tried too. The one-pipeline plan is always built; the fastest grouping (simulated) wins.
2. Chunking per pipeline (planner/chunking.py): the target chunk time (and so K) and the chunk
   token cap are searched, likeliest first (at most ``search_targets`` per cap); each candidate
   is chunked, given a warm-up/cool-down ramp (a few small chunks of whole short sequences first
   and last, ``chunking.ramp_chunks``), ordered, given greedy recompute and simulated; the
   fastest wins. At the winning target the other ramps (and none) and the other order are tried.
   Packed-slice chunkings (packs of the context length or 1-2x the longest sequence, cut into k
   equal-compute slices) are candidates too, so elastic_pp can pick the Seq1F1B chunking. When no
   equal-time slicing into slices of at least ``min_slice_tokens`` lets the longest sequence fit
   (or none of those candidates fits), each long sequence's slices are token-capped as much as
   it needs to fit alone (``sequence_limits.fit_cap``, ``chunking.capped_mesh``); if still nothing fits, ever
   finer slices and smaller chunks are tried, down to the finest slicing. No candidate holds
   more than ``MAX_CHUNKS`` chunks.
3. Order (``order``): forward order = the ramp's small chunks, each long sequence's slices then
   its hybrid tail chunk (longest first), batched chunks slowest first, the cool-down ramp;
   backward order = the forward order with each split sequence's chunks reversed. Per stage,
   either list scheduling (sim/engine.greedy_orders: a free stage runs whichever of its next
   backward and next forward can start first, forwards held back when the stage's activations
   would pass its room) or elastic 1F1B (sim/engine.one_f_one_b: warm-up P - 1 - p + slices of
   the first split sequence - 1); "best" tries both, and 1F1B is always tried where memory binds
   (its recompute ties along the schedule's diagonals).
4. Recompute: the ILP of planner/checkpointing.py on the winner (greedy if HiGHS has nothing), tied
   along the schedule's diagonals (the paper's), untied (one variable per stage and chunk) or, by
   default, both: the faster simulated plan wins (``ties``).
5. The plan is validated and simulated; the simulator's step time is the estimate.

Time limit (``time_limit``, the whole step's planning; with replicas, each replica's share of its
first ``REBALANCE_AFTER``): every stage past the first feasible candidate yields to it -- the
chunk search at 0.4 of it, the groupings at 0.7 (not started later), the ILP when none is left
(the search's greedy recompute stands, noted in the status). A pipeline with nothing feasible yet
at its deadline goes straight to the safest chunkings (the capped slices, then finer) and keeps
trying until something fits.

The pipeline baselines (batch 1F1B, Seq1F1B) are in planner/pipeline_baselines.py, the ``auto``
planner in planner/auto.py and the entry point of every pipeline planner in
planner/pipeline_api.py; this module owns what they share: ``PipelineOptions``, building and
scoring one pipeline (``build_pipeline``) and turning pipelines into a validated StepPlan.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.cost.pipeline import PipelineCost, default_layout
from megatron_ext.errors import ConfigError, InfeasibleError, LengthsError
from megatron_ext.plan.pipelines import validate_pipelines
from megatron_ext.plan.schema import Chunk, Piece, Pipeline, StepPlan, validate
from megatron_ext.planner.checkpointing import greedy_recompute, solve_recompute
from megatron_ext.planner.chunking import Pieces, balanced_chunks, pack_by_tokens, ramp_chunks, split_pack
from megatron_ext.planner.grouping import group_sequences, split_replicas
from megatron_ext.planner.sequence_limits import check_sequences, fewest_slices, finest_slice, fit_cap, what_to_change
from megatron_ext.sim.engine import (ChunkTable, analyze_chunks, backward_order, checkpoint_memory, greedy_orders,
                                     list_schedule, memory_checkpoints, memory_levels, one_f_one_b, op_times,
                                     order_names)
from megatron_ext.sim.simulator import simulate


@dataclass(frozen=True)
class PipelineOptions:
    pp: int | None = None  # stages (default: one per node)
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

    def __post_init__(self):
        for name, allowed in (("recompute", ("ilp", "greedy", "none", "full", "auto")), ("ties", ("best", "tied", "untied")),
                              ("order", ("best", "greedy", "1f1b")), ("baseline_recompute", ("auto", "none", "full"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"unknown {name.replace('_', ' ')} {getattr(self, name)!r}; use {', '.join(allowed)}")


PP_BASELINES = ("flexsp", "static_ulysses", "seq1f1b", "batch_1f1b")


# ---- building and scoring one pipeline --------------------------------------------------------

@dataclass
class BuiltPipeline:
    pieces: list[Pieces]
    chunks: list[Chunk]
    table: ChunkTable
    ops: list[list[tuple[int, int]]]
    recompute: np.ndarray  # [P, n]
    makespan_ms: float
    status: str = ""
    slices: int = 1
    order: str = "1f1b"
    ramp: str = ""
    held: int = 0  # greedy order: forwards held back by memory while a stage idled
    build_s: float = 0.0  # seconds building it took (what rebuilding or simulating it will take, about)

    def to_pipeline(self, pc: PipelineCost, replica: int = 0) -> Pipeline:
        # one entry per stage for every chunk, zeros when nothing is recomputed (the StepPlan contract)
        chunks = [Chunk(c.id, c.pieces, [int(v) for v in self.recompute[:, i]]) for i, c in enumerate(self.chunks)]
        return Pipeline(pc.pp, pc.sp, chunks, order_names(self.ops, self.table.ids), replica)


def _checkpoints(table: ChunkTable, ops, pc: PipelineCost):
    P = pc.pp
    full_mid, save = pc.chunk_memory(table.tokens, table.cached_tokens, table.prefix_tokens, False)
    full_last, _ = pc.chunk_memory(table.tokens, table.cached_tokens, table.prefix_tokens, True)
    cps = [memory_checkpoints(ops[p], table, full_last if p == P - 1 else full_mid, pc) for p in range(P)]
    return cps, save


def _fits(cps, save, rec, room) -> bool:
    return all((checkpoint_memory(c, save, rec[p]) <= room[p] * (1 + 1e-9) + 1e-6).all() for p, c in enumerate(cps))


def build_pipeline(pieces: list[Pieces], pc: PipelineCost, recompute: str = "greedy", tied: bool = True,
                   time_limit: float = 0.5, where: str = "pipeline", order: str = "1f1b") -> BuiltPipeline:
    """Chunks (in forward order) -> per-stage order, recompute, simulated makespan.

    ``order``: "1f1b" (elastic 1F1B, sim/engine.one_f_one_b), "greedy" (list scheduling,
    sim/engine.greedy_orders) or "best" (both; the faster wins)."""
    if order == "best":
        a = build_pipeline(pieces, pc, recompute, tied, time_limit, where, "greedy")
        b = build_pipeline(pieces, pc, recompute, tied, time_limit, where, "1f1b")
        return a if a.makespan_ms <= b.makespan_ms + 1e-9 else b
    if order not in ("1f1b", "greedy"):
        raise ConfigError(f"unknown pipeline order {order!r}; use 1f1b, greedy or best")
    started = time.perf_counter()
    chunks = [Chunk(i, [Piece(int(s), int(a), int(b)) for s, a, b in c]) for i, c in enumerate(pieces)]
    table = analyze_chunks(chunks, pc, where)
    forward = list(range(table.n))
    backward = backward_order(forward, table)
    P, L_s, n = pc.pp, pc.layers_per_stage, table.n
    if order == "greedy":
        fwd0, bwd0, _, p2p0 = op_times(table, pc, np.zeros((P, n), dtype=np.int64))
        full = [pc.chunk_memory(table.tokens, table.cached_tokens, table.prefix_tokens, p == P - 1)[0] for p in range(P)]
        ops, greedy_ms, held = greedy_orders(forward, backward, table, fwd0, bwd0, p2p0, P, full,
                                             pc.activation_room_mb)
    else:
        ops, held = one_f_one_b(forward, backward, P), 0
    room = np.full(P, pc.activation_room_mb)
    if recompute != "full" and _fits_without_recompute(table, ops, pc):  # the common case, cheaply
        rec = np.zeros((P, n), dtype=np.int64)
        status = {"greedy": "greedy recompute", "ilp": "no recompute needed"}.get(recompute, "no recompute")
        if recompute not in ("none", "auto", "greedy", "ilp"):
            raise ConfigError(f"unknown recompute mode {recompute!r}; use ilp, greedy, none, full or auto")
        return _finish_build(pieces, chunks, table, ops, rec, status, order, held,
                             greedy_ms if order == "greedy" else None, pc, started)
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
            p = next(p for p, c in enumerate(cps) if not (checkpoint_memory(c, save, rec[p]) <= room[p] + 1e-6).all())
            mem = checkpoint_memory(cps[p], save, rec[p])
            cp = cps[p][int(np.argmax(mem))]
            raise InfeasibleError(f"{where}: stage {p} needs {mem.max() + pc.model_states_mb:.1f} MB per GPU at "
                                  f"{name(cp.kind, cp.chunk)} with {status}, over the {pc.budget_mb:.1f} MB budget")
    elif recompute == "greedy":
        rec = greedy_recompute(cps, save, rc, L_s, room, bpos, tied, where, name)
        status = "greedy recompute"
    elif recompute == "ilp":
        rec, status = solve_recompute(cps, save, rc, L_s, room, bpos, tied, time_limit, 0.02, where, name)
    else:
        raise ConfigError(f"unknown recompute mode {recompute!r}; use ilp, greedy, none, full or auto")
    return _finish_build(pieces, chunks, table, ops, rec, status, order, held,
                         greedy_ms if order == "greedy" else None, pc, started)


def _fits_without_recompute(table: ChunkTable, ops, pc: PipelineCost) -> bool:
    """Every stage within its activation room at every moment with no recompute."""
    P, room = pc.pp, pc.activation_room_mb * (1 + 1e-9) + 1e-6
    zero = np.zeros(table.n)
    for p in range(P):
        full, _ = pc.chunk_memory(table.tokens, table.cached_tokens, table.prefix_tokens, p == P - 1)
        _, during, _ = memory_levels(ops[p], table, full, zero, zero, pc)
        if len(during) and during.max() > room:
            return False
    return True


def _finish_build(pieces, chunks, table, ops, rec, status, order, held, greedy_ms, pc, started) -> BuiltPipeline:
    n = table.n
    if greedy_ms is not None and not rec.any():  # the list scheduler's times are the greedy's own
        makespan = greedy_ms
    else:
        fwd, bwd, _, p2p = op_times(table, pc, rec)
        _, end = list_schedule(ops, fwd, bwd, p2p, table.fwd_pred, table.bwd_pred,
                               name=lambda kind, k: f"{'FB'[kind]}{table.ids[k]}")
        makespan = float(np.nanmax(end)) if n else 0.0
    return BuiltPipeline(pieces, chunks, table, ops, rec, makespan, status, order=order, held=held,
                         build_s=time.perf_counter() - started)


# ---- elastic pipeline planner ---------------------------------------------------------------

MAX_CHUNKS = 4096  # chunk candidates with more chunks are not built (their recompute tables grow as n^2)


def _targets(seq_ids, lengths, pc: PipelineCost, opts: PipelineOptions, capped: bool = False) -> list[float]:
    """Candidate chunk-time targets: the longest sequence's time over K slices, and multiples of
    it when nothing needs splitting; the likeliest first (closest to the analytic optimum
    sqrt(b W / (P - 1)) of work W, per-chunk fixed cost b and P stages)."""
    lens = lengths[seq_ids]
    s_max = int(lens.max())
    t_max = float(pc.prefix_ms(s_max))
    total = float(pc.prefix_ms(lens).sum())
    k_max = max(1, s_max // max(1, opts.min_slice_tokens))
    # Slicing finer than memory needs may still be faster; coarser cannot run: the longest
    # sequence must fit alone (with a token-capped mesh, ``capped``, memory is the cap's
    # business: every K is a candidate).
    k_min = 1 if capped else (fewest_slices(s_max, pc, opts.granularity, opts.min_slice_tokens) or k_max)
    ks = sorted({k for k in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64, 96, 128)
                 if k_min < k <= k_max} | {k_min})
    out = [t_max / k for k in ks]
    for m in (1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32):
        if k_min == 1 and t_max * m <= total / max(1, pc.pp) * 1.5:
            out.append(t_max * m)
    guess = math.sqrt(max(pc.fixed_ms, 1e-3 * total / max(1, len(lens))) * total / max(1, pc.pp - 1))
    out.sort(key=lambda t: abs(math.log(t / guess)))
    return out


def _token_caps(seq_ids, lengths, pc: PipelineCost) -> list[float]:
    """Token caps of a batched/hybrid chunk to try: none; the cap that lets stage 0 hold the
    longest sequence plus P - 1 full chunks without recompute; the same with every layer
    recomputed (input and K/V kept, one chunk re-materialized); their geometric mean."""
    P, L_s = pc.pp, pc.layers_per_stage
    act_tok = pc.act_layer_mb * L_s
    kept_tok = (pc.input_layer_mb + pc.kv_layer_mb) * L_s
    s_max = float(lengths[seq_ids].max())
    total = float(lengths[seq_ids].sum())
    room = pc.activation_room_mb
    caps = [math.inf]
    if P > 1:
        no_rec = (room / act_tok - s_max) / (P - 1)
        full = (room - s_max * kept_tok - float(pc.dkv_mb(s_max))) / ((P - 1) * kept_tok + act_tok)
        good = [c for c in (no_rec, full) if 0 < c < total]
        caps += sorted(set(good), reverse=True)
        if len(good) == 2 and min(good) > 0:
            caps.insert(2, math.sqrt(good[0] * good[1]))
    return caps


def _ramps(P: int, opts: PipelineOptions) -> list[tuple[tuple[float, ...], tuple[float, ...]]]:
    """Warm-up / cool-down ramps to try (fractions of the chunk time cap; see chunking.ramp_chunks),
    the default first: two small chunks up front, P + 1 shrinking chunks at the end."""
    if not opts.ramp:
        return [((), ())]

    def down(m: int, lo: float) -> tuple[float, ...]:
        return tuple(round(1 - (1 - lo) * (i + 1) / m, 3) for i in range(m))

    def up(m: int) -> tuple[float, ...]:
        return tuple(round((i + 1) / (m + 1), 3) for i in range(m))

    out = [(up(2), down(P + 1, 0.35)), ((), ()), (up(1), down(P - 1, 0.45)), (up(3), down(P + 1, 0.35)),
           (up(2), down(2 * P, 0.3)), ((), down(P + 1, 0.35)), (up(2), ())]
    seen, uniq = set(), []
    for r in out:
        if r not in seen:
            seen.add(r)
            uniq.append(r)
    return uniq


def _ramp_note(front, back) -> str:
    if not front and not back:
        return ""
    return f"ramp {len(front)}+{len(back)}"


def plan_group(seq_ids, lengths, pc: PipelineCost, opts: PipelineOptions, deadline: float | None = None,
               where: str = "pipeline") -> BuiltPipeline:
    """Search one pipeline's chunking and order; the fastest simulated candidate (greedy recompute)
    wins. Past ``deadline`` the search keeps the best candidate found so far (with none yet, it
    goes straight to step 4).

    1. The chunk-time target (and so K) and the chunk token cap: Algorithm 1 (chunking.py) at
       each, with the default warm-up/cool-down ramp, ordered by list scheduling (``greedy``);
       with token-capped slices when memory needs them (``sequence_limits.fit_cap``; first, if no equal-time
       slicing of the longest sequence can fit, else if nothing else fitted).
    2. At the best target: the other ramps (and none), and the elastic 1F1B order.
    3. Packed-slice chunkings (Seq1F1B's: packs cut into k equal-compute slices), so elastic_pp
       can pick what Seq1F1B would run (time permitting).
    4. Nothing fits yet: every sequence at its slice cap, then every slice and chunk at half the
       longest sequence's cap, a quarter, ... down to its finest slicing."""
    seq_ids = np.asarray(seq_ids, dtype=np.int64)
    best: BuiltPipeline | None = None
    best_ch = None
    errors = []
    ramps = _ramps(pc.pp, opts)
    orders = ("greedy", "1f1b") if opts.order == "best" else (opts.order,)
    # candidates are scored with the greedy's recompute (the ILP runs on the winner); with a fixed
    # rule (none, every layer, or "auto": none if it fits, else every layer) the search scores
    # each candidate under that rule
    search_recompute = "greedy" if opts.recompute in ("ilp", "greedy") else opts.recompute

    def late() -> bool:
        return deadline is not None and best is not None and time.perf_counter() > deadline

    def hurry() -> bool:  # out of time with nothing feasible yet: straight to the safest chunkings
        return deadline is not None and best is None and time.perf_counter() > deadline

    def consider(pieces, slices, order, ramp=((), ())) -> BuiltPipeline | None:
        nonlocal best
        if len(pieces) > MAX_CHUNKS:
            errors.append(f"{where}: {len(pieces)} chunks, more than the {MAX_CHUNKS} a pipeline may have")
            return None
        try:
            b = build_pipeline(pieces, pc, search_recompute, opts.ties != "untied", where=where, order=order)
        except InfeasibleError as e:
            errors.append(str(e))
            return None
        b.slices = slices
        b.ramp = _ramp_note(*ramp)
        if best is None or b.makespan_ms < best.makespan_ms - 1e-9:
            best = b
        return b

    longest = int(lengths[seq_ids].max())
    g = max(1, int(opts.granularity))
    # memory: each sequence's slice cap, the most tokens per slice that let it fit alone (None:
    # it fits unsliced); ``capped`` when no equal-time slicing of the search's lets the longest
    # fit, so every long sequence is cut on its own token-capped mesh
    fit_caps: dict[int, int | None] = {}

    def cap_of(s: int) -> int | None:
        if s not in fit_caps:
            fit_caps[s] = fit_cap(s, pc, opts.granularity)
        return fit_caps[s]

    slice_cap = cap_of(longest)
    capped = slice_cap is not None and fewest_slices(longest, pc, opts.granularity, opts.min_slice_tokens) is None

    def search(mesh_cap) -> tuple[list[float], list[float]]:
        """The chunk-time targets x token caps; returns (targets, finite caps)."""
        nonlocal best_ch
        targets = _targets(seq_ids, lengths, pc, opts, capped=mesh_cap is not None)
        caps = _token_caps(seq_ids, lengths, pc)
        if mesh_cap is not None:
            caps = [c for c in caps if c > slice_cap] + [float(slice_cap)]
        finite = [c for c in caps if math.isfinite(c)]
        # near the memory limit, finer caps as a last resort
        fallback = [min(finite, default=float(longest)) / 2 ** i for i in (1, 2)]
        for ci, cap in enumerate(caps + fallback):
            if ci >= len(caps) and best is not None:
                break
            if ci and best is not None and not best.recompute.any():
                break  # a smaller cap only adds chunks when memory does not bind
            for target in targets[:max(1, opts.search_targets)]:
                if late() or hurry():
                    break
                ch = balanced_chunks(seq_ids, lengths, pc, target, cap, opts.granularity, opts.fit,
                                     min_tail=opts.granularity, max_slice_tokens=mesh_cap)
                pieces = ramp_chunks(ch.chunks, lengths, pc, ch.slice_ms, *ramps[0], token_cap=cap)
                before = best
                got = consider(pieces, ch.slices, orders[0], ramps[0])
                if (got is None or got.recompute.any() or got.held) and len(orders) > 1 and not late():
                    # memory binds: the plain chunking in elastic 1F1B order, whose recompute ties
                    # along its diagonals, may beat list scheduling held back by memory
                    consider(ch.chunks, ch.slices, orders[1])
                if best is not before:
                    best_ch = ch
        return targets, finite

    targets, finite = search(cap_of if capped else None)
    if best is None and slice_cap is not None and not capped and not hurry():
        targets, finite = search(cap_of)  # no equal-time mesh worked: cap the slices
    if best_ch is not None:
        for ramp in ramps[1:]:
            if late():
                break
            pieces = ramp_chunks(best_ch.chunks, lengths, pc, best_ch.slice_ms, *ramp, token_cap=best_ch.token_cap)
            consider(pieces, best_ch.slices, orders[0], ramp)
        for order in orders[1:]:
            if late():
                break
            top = best
            consider(top.pieces, top.slices, order, ((), ()))
            if best is not top:
                best.ramp = top.ramp
    # packed-slice candidates (Seq1F1B's chunkings: packs of the context length cut into k
    # equal-compute slices; each slice holds at most one continued piece, so the tail rule holds)
    base_cap = pack_capacity(seq_ids, lengths, opts)
    caps = {base_cap} | {-(-int(longest * f) // 1024) * 1024 for f in (1, 1.5, 2)}
    packed: dict[int, list[list[int]]] = {}
    for cap, k in [(c, k) for c in sorted(caps)
                   for k in sorted(set(opts.pack_slices) | (set(opts.seq1f1b_slices) if c == base_cap else set()))]:
        if late() or hurry():
            break
        if capped and longest / k > slice_cap:
            continue  # the longest sequence's slices cannot fit
        if cap not in packed:
            packed[cap] = pack_by_tokens(seq_ids, lengths, cap)
        pieces = [c for p in packed[cap] for c in split_pack(p, lengths, pc, k)]
        for order in (orders if cap == base_cap else orders[:1]):
            if not late():
                consider(pieces, -k, order)  # slices < 0 marks a packed-slice chunking in the status
    # last resort, until something fits: every slice and chunk within the longest sequence's
    # slice cap, then finer, down to the finest slicing
    t = slice_cap or int(min(finite, default=longest)) // 2
    finest = finest_slice(longest, g)
    while best is None and t >= finest:
        ch = balanced_chunks(seq_ids, lengths, pc, targets[0], float(t), opts.granularity, opts.fit,
                             min_tail=opts.granularity,  # first each sequence at its own cap
                             max_slice_tokens=cap_of if t == slice_cap else lambda s, t=t: min(t, cap_of(s) or s))
        for order in orders:
            if best is None:
                consider(ch.chunks, ch.slices, order)
        t = max(t // 2, finest) if t > finest else 0
    if best is None:
        raise InfeasibleError((errors[-1] if errors else f"{where}: no feasible chunking") + "; "
                              + what_to_change(pc, opts.granularity))
    return best


def resolve_layout(cost: CostModel, pp, sp) -> tuple[int, int]:
    """(pp, sp) from what was given: both, the default layout, or one of them with the other the
    most the GPUs allow (the rest of the GPUs run replicas)."""
    n, L = cost.num_gpus, cost.model.num_layers
    if pp is None and sp is None:
        return default_layout(cost)
    if pp is None:  # the stages follow from sp: refuse an sp that leaves none, naming sp
        if not (isinstance(sp, int) and sp in cost.degrees and n % sp == 0):
            raise ConfigError(f"SP degree {sp!r} is not allowed for {cost.model.name} on {cost.cluster.name}; allowed: "
                              f"{', '.join(map(str, cost.degrees))} (powers of two that divide the heads)")
        # the most stages that divide both the layers and the GPUs left
        return max(p for p in range(1, n // sp + 1) if (n // sp) % p == 0 and L % p == 0), sp
    if sp is None and isinstance(pp, int) and pp > 0:  # (PipelineCost names what else is wrong with pp)
        if n % pp:
            fits = [p for p in range(1, n + 1) if n % p == 0 and L % p == 0]
            raise ConfigError(f"pipeline degree {pp} does not divide the {n} GPUs of {cost.cluster.name}; choose one "
                              f"of {', '.join(map(str, fits))}")
        sp = n // pp
        if sp not in cost.degrees:  # more GPUs per stage than Ulysses can use: the largest degree, and replicas
            sp = max(d for d in cost.degrees if sp % d == 0)
    return pp, sp


def pipeline_cost(cost: CostModel, pp, sp, opts: PipelineOptions) -> PipelineCost:
    pp, sp = resolve_layout(cost, pp, sp)
    return PipelineCost(cost, pp, sp, opts.b1_scale, opts.memory_mb)


def finish_plan(name: str, pipes: list[Pipeline], lengths: np.ndarray, cost: CostModel, pc: PipelineCost,
            opts: PipelineOptions, start: float, status: str, dropped=()) -> StepPlan:
    plan = StepPlan(kind="elastic_pp", num_gpus=cost.num_gpus, planner=name, pipelines=pipes,
                    solver_status=status, dropped_seq_ids=[int(i) for i in dropped])
    validate(plan, lengths, cost)
    validate_pipelines(plan, lengths, cost)
    res = simulate(plan, lengths, cost, b1_scale=opts.b1_scale, memory_mb=opts.memory_mb, events=False)
    plan.solve_time_s = time.perf_counter() - start
    plan.estimated_step_time_s = res.step_time_s
    kept = np.delete(lengths, list(dropped)) if len(dropped) else lengths
    plan.lower_bound_step_time_s = (float(pc.prefix_ms(kept).sum()) / pc.replicas + pc.fixed_ms) / 1e3
    return plan


def pipeline_options(options, overrides) -> PipelineOptions:
    if options is None:
        options = PipelineOptions()
    elif not isinstance(options, PipelineOptions):  # a PlannerOptions (or anything with the fields)
        fields = {f.name for f in dataclasses.fields(PipelineOptions)}
        options = PipelineOptions(**{k: getattr(options, k) for k in fields if hasattr(options, k)})
    return dataclasses.replace(options, **overrides) if overrides else options


def kept_sequences(lengths, seq_ids) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or lengths.size == 0:
        raise LengthsError("the batch is empty: nothing to plan")
    if (lengths < 1).any():
        raise LengthsError(f"sequence {int(np.flatnonzero(lengths < 1)[0])} has a non-positive length")
    ids = np.arange(len(lengths)) if seq_ids is None else np.asarray(seq_ids, dtype=np.int64)
    if ids.size == 0:
        raise LengthsError("no sequence left to plan")
    return lengths, ids


def _chunking_note(b: BuiltPipeline) -> str:
    note = f"K={b.slices}" if b.slices > 0 else f"packs cut in {-b.slices}"
    return note + (f", {b.ramp}" if b.ramp else "") + f", {b.order} order"


def _plan_replica(ids: np.ndarray, lengths, pc: PipelineCost, opts: PipelineOptions, start: float,
                  budget: float) -> list[BuiltPipeline]:
    """One replica's pipelines (run one after another), planned in ``budget`` seconds from
    ``start``: one pipeline, or the sequences grouped into up to ``max_pipelines``; then the ILP's
    recompute on the winner."""
    candidates: list[tuple[float, list[BuiltPipeline], list[np.ndarray]]] = []
    err = None
    try:
        one = plan_group(ids, lengths, pc, opts, start + 0.4 * budget, "pipeline 0")
        candidates.append((one.makespan_ms, [one], [ids]))
    except InfeasibleError as e:
        err = e
    if opts.max_pipelines > 1 and len(ids) > 1:
        groupings = []
        groups = group_sequences(ids, lengths, pc, opts.max_pipelines)
        if len(groups) == 1 and err is not None:  # the estimate missed: halve by tokens
            order = groups[0]
            cut = int(np.searchsorted(np.cumsum(lengths[order]), lengths[order].sum() / 2)) + 1
            groups = [order[:cut], order[cut:]] if 0 < cut < len(order) else groups
        if len(groups) > 1:
            groupings.append(groups)
        if err is not None or candidates[0][1][0].recompute.any():
            # memory binds: the longest sequence in a pipeline of its own relieves the others
            order = ids[np.lexsort((ids, -lengths[ids]))]
            groupings.append([order[:1], order[1:]])
        for gi, groups in enumerate(groupings):
            if candidates and time.perf_counter() > start + 0.7 * budget:
                break  # out of time: keep what was found (only a batch nothing fit yet goes on)
            try:
                built = []
                for i, g in enumerate(groups):
                    frac = (gi + (i + 1) / len(groups)) / len(groupings)
                    built.append(plan_group(g, lengths, pc, opts, start + budget * (0.4 + 0.3 * frac),
                                            f"pipeline {i}"))
                candidates.append((sum(b.makespan_ms for b in built), built, groups))
            except InfeasibleError as e:
                err = err or e
    if not candidates:
        raise err
    candidates.sort(key=lambda c: c[0])
    built = candidates[0][1]

    # final recompute with the ILP, in the time left after what checking and simulating the plan
    # will take (about what building its pipelines took); the fixed rules none / full / auto were
    # the search's own: their candidates are final
    end = start + budget - sum(b.build_s for b in built)
    final = []
    for i, b in enumerate(built):
        if opts.recompute != "ilp" or not b.recompute.any():
            final.append(b)
            continue
        ties = (True, False) if opts.ties == "best" else (opts.ties != "untied",)
        for j, tied in enumerate(ties):
            left = (end - time.perf_counter()) / (len(built) - i) / (len(ties) - j)
            if left < 2 * b.build_s:  # too little to build it again and solve: the greedy stands
                if j == 0:
                    b.status += " (no time left for the ILP)"
                break
            nb = build_pipeline(b.pieces, pc, opts.recompute, tied, left - b.build_s, f"pipeline {i}",
                                order=b.order)
            nb.slices, nb.ramp = b.slices, b.ramp
            if nb.makespan_ms <= b.makespan_ms + 1e-9:
                b = nb
        final.append(b)
    return final


REBALANCE_AFTER = 0.8  # of the time limit: replicas are planned by then, the rest evens out their ends


def _rebalance(parts: list[np.ndarray], plans: dict, lengths, pc: PipelineCost, opts: PipelineOptions,
               deadline: float, rounds: int = 3) -> None:
    """Even out the replicas' ends (in place): the replica holding the longest sequence tends to
    finish last, as its slices run one after another. Move sequences (never the slowest replica's
    longest) worth about half the gap from the slowest replica to the fastest, replan both, and
    keep the move if the slower of the two now ends earlier; a few rounds, in the time left."""
    def end(r: int) -> float:
        return sum(b.makespan_ms for b in plans[r]) if r in plans else 0.0

    for _ in range(rounds):
        ends = {r: end(r) for r in range(len(parts))}
        slow, fast = max(ends, key=ends.get), min(ends, key=ends.get)
        took = sum(b.build_s for r in (slow, fast) if r in plans for b in plans[r])
        if ends[slow] <= ends[fast] * 1.02 or deadline - time.perf_counter() < 4 * took:
            return
        cand = parts[slow][np.argsort(-pc.prefix_ms(lengths[parts[slow]]), kind="stable")][1:]
        room, moved = (ends[slow] - ends[fast]) / 2, []
        for i in cand:
            w = float(pc.prefix_ms(lengths[i]))
            if w <= room:
                moved.append(int(i))
                room -= w
        if not moved:
            return
        new_slow = np.setdiff1d(parts[slow], moved)
        new_fast = np.union1d(parts[fast], moved)
        now = time.perf_counter()
        window = (deadline - now) / 2
        try:
            a = _plan_replica(new_slow, lengths, pc, opts, now, window)
            b = _plan_replica(new_fast, lengths, pc, opts, time.perf_counter(), window)
        except InfeasibleError:
            return
        if max(sum(x.makespan_ms for x in a), sum(x.makespan_ms for x in b)) >= ends[slow] - 1e-9:
            return
        parts[slow], parts[fast], plans[slow], plans[fast] = new_slow, new_fast, a, b


def plan_elastic_pp(lengths, cost: CostModel, pp: int | None = None, sp: int | None = None,
                    options: PipelineOptions | None = None, *, seq_ids=None, **overrides) -> StepPlan:
    """Plan one step with elastic pipelines of ``pp`` stages of SP degree ``sp``; with pp x sp
    below the GPU count, GPUs / (pp x sp) replicas run side by side, each its share of the
    sequences (``grouping.split_replicas``). ``seq_ids``: the sequences to plan (default all);
    the others are reported as dropped."""
    start = time.perf_counter()
    opts = pipeline_options(options, overrides)
    lengths, ids = kept_sequences(lengths, seq_ids)
    pc = pipeline_cost(cost, pp if pp is not None else opts.pp, sp if sp is not None else opts.sp, opts)
    check_sequences(ids, lengths, pc, opts.granularity)
    parts = split_replicas(ids, lengths, pc, pc.replicas)
    # with replicas, part of the time is kept to even out their ends (_rebalance)
    first_end = start + opts.time_limit * (REBALANCE_AFTER if pc.replicas > 1 else 1.0)
    plans: dict[int, list[BuiltPipeline]] = {}
    for r, part in enumerate(parts):
        if part.size:
            now = time.perf_counter()  # what is left, shared by the replicas still to plan
            window = max(0.0, first_end - now) / sum(1 for q in parts[r:] if q.size)
            plans[r] = _plan_replica(part, lengths, pc, opts, now, window)
    if pc.replicas > 1:
        _rebalance(parts, plans, lengths, pc, opts, start + opts.time_limit)
    pipes, final = [], []
    for r in sorted(plans):
        pipes += [b.to_pipeline(pc, r) for b in plans[r]]
        final += plans[r]
    rec_note = "; ".join(sorted({b.status for b in final}))
    n = sum(b.table.n for b in final)
    reps = f" over {pc.replicas} replicas" if pc.replicas > 1 else ""
    chunkings = "; ".join(_chunking_note(b) if len(final) == 1 else f"pipeline {i}: {_chunking_note(b)}"
                          for i, b in enumerate(final))
    status = (f"{len(final)} pipeline{'s' if len(final) > 1 else ''} x {pc.pp} stage{'s' if pc.pp > 1 else ''} "
              f"x SP {pc.sp}{reps}; {chunkings}; {n} chunk{'s' if n > 1 else ''}; "
              f"{rec_note}")
    dropped = np.setdiff1d(np.arange(len(lengths)), ids)
    return finish_plan("elastic_pp", pipes, lengths, cost, pc, opts, start, status, dropped)


def pack_capacity(seq_ids, lengths, opts: PipelineOptions) -> int:
    """Tokens per packed micro-batch: ``pack_tokens``, or the longest sequence rounded up to 1K."""
    longest = int(lengths[seq_ids].max())
    if opts.pack_tokens is None:
        return -(-longest // 1024) * 1024
    if opts.pack_tokens < longest:
        raise ConfigError(f"pack_tokens {opts.pack_tokens} is below the longest sequence ({longest} tokens)")
    return int(opts.pack_tokens)


__all__ = ["BuiltPipeline", "MAX_CHUNKS", "PP_BASELINES", "PipelineOptions", "build_pipeline", "finish_plan",
           "kept_sequences", "pack_capacity", "pipeline_cost", "pipeline_options", "plan_elastic_pp", "plan_group",
           "resolve_layout"]
