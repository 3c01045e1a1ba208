"""Elastic pipeline parallelism (InfiniPipe, PAPERS.md section 2) and pipeline baselines.

``plan_elastic_pp(lengths, cost, pp, sp)``:
1. Grouping: the sequences, longest first, are cut into one or more consecutive groups, each run
   as its own 1F1B pipeline, one after another, by the DP
   ``dp[j] = min_i dp[i] + T(i..j)`` with T an analytic estimate (work, per-chunk fixed cost,
   warm-up/cool-down of P - 1 chunks, recompute forced by the stage-0 memory). When memory binds,
   "the longest sequence in a pipeline of its own" is tried too. The one-pipeline plan is always
   built; the fastest grouping (simulated) wins.
2. Chunking per pipeline (planner/chunking.py): the target chunk time (and so K) and the chunk
   token cap are searched, likeliest first (at most ``search_targets`` per cap; the time limit
   is a guard); each candidate is chunked, given a warm-up/cool-down ramp (a few small chunks of
   whole short sequences first and last, ``chunking.ramp_chunks``), ordered, given greedy
   recompute and simulated; the fastest wins. At the winning target the other ramps (and none)
   and the other order are tried. Packed-slice chunkings (packs of the context length or 1-2x
   the longest sequence, cut into k equal-compute slices) are candidates too, so elastic_pp can
   always pick the Seq1F1B chunking.
3. Order (``order``): forward order = the ramp's small chunks, each long sequence's slices then
   its hybrid tail chunk (longest first), batched chunks slowest first, the cool-down ramp;
   backward order = the forward order with each split sequence's chunks reversed. Per stage,
   either list scheduling (sim/engine.greedy_orders: a free stage runs whichever of its next
   backward and next forward can start first, forwards held back when the stage's activations
   would pass its room) or elastic 1F1B (sim/engine.one_f_one_b: warm-up P - 1 - p + slices of
   the first split sequence - 1); "best" tries both, and 1F1B is always tried where memory binds
   (its recompute ties along the schedule's diagonals).
4. Recompute: the tied ILP of planner/checkpointing.py on the winner (greedy if HiGHS has nothing).
5. The plan is validated and simulated; the simulator's step time is the estimate.

Baselines through the same StepPlan / simulator:
- ``batch_1f1b``: Megatron-style 1F1B over micro-batches packed (best-fit decreasing) up to
  ``pack_tokens`` (default: the longest sequence, rounded up to 1K); static recompute: none if it
  fits, else every layer.
- ``seq1f1b``: the same packs, each cut into k slices of equal compute (Seq1F1B), k in
  ``seq1f1b_slices`` (the best per step); static recompute as above.
- FlexSP (one stage, adaptive SP) and static Ulysses: ``make_plan('flexsp' | 'static_ulysses')``,
  simulated as micro-batches on SP groups.

``plan_auto`` (planner ``auto``): per step, FlexSP and elastic_pp on every feasible (pp, sp)
layout through the same simulator; the fastest plan wins (see its docstring).
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.cost.pipeline import PipelineCost, check_layout, default_layout
from megatron_ext.errors import ConfigError, InfeasibleError, LengthsError, MegatronExtError
from megatron_ext.plan.pipelines import validate_pipelines
from megatron_ext.plan.schema import Chunk, Piece, Pipeline, StepPlan, validate
from megatron_ext.planner.checkpointing import greedy_recompute, solve_recompute
from megatron_ext.planner.chunking import Pieces, balanced_chunks, ramp_chunks
from megatron_ext.sim.engine import (ChunkTable, analyze_chunks, backward_order, checkpoint_memory, greedy_orders,
                                     list_schedule, memory_checkpoints, memory_levels, one_f_one_b, op_times,
                                     order_names)
from megatron_ext.sim.simulator import SimResult, simulate


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
    tied: bool = True  # recompute ILP: diagonal tying (the paper's) or one variable per (stage, chunk)
    recompute: str = "ilp"  # elastic_pp: "ilp" | "greedy" | "none" | "full"
    max_pipelines: int = 3
    pack_tokens: int | None = None  # baselines: micro-batch capacity (default: the longest sequence)
    seq1f1b_slices: tuple[int, ...] = (2, 4, 8)
    pack_slices: tuple[int, ...] = (1, 2, 4)  # elastic_pp also tries packs (of pack_tokens) cut in k slices
    order: str = "best"  # elastic_pp per-stage order: "greedy" (list scheduling) | "1f1b" | "best" (both)
    ramp: bool = True  # elastic_pp: try small warm-up / cool-down chunks (chunking.ramp_chunks)
    search_targets: int = 8  # elastic_pp: chunk-time targets tried per token cap, likeliest first
    baseline_recompute: str = "auto"  # baselines: "auto" (none if it fits, else full) | "none" | "full"


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

    def to_pipeline(self, pc: PipelineCost) -> Pipeline:
        chunks = [Chunk(c.id, c.pieces, [int(v) for v in self.recompute[:, i]] if self.recompute.any() else [])
                  for i, c in enumerate(self.chunks)]
        return Pipeline(pc.pp, pc.sp, chunks, order_names(self.ops, self.table.ids))


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
                             greedy_ms if order == "greedy" else None, pc)
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
            raise InfeasibleError(f"{where}: stage {p} needs {mem.max() + pc.model_states_mb:.0f} MB per GPU at "
                                  f"{name(cp.kind, cp.chunk)} with {status}, over the {pc.budget_mb:.0f} MB budget")
    elif recompute == "greedy":
        rec = greedy_recompute(cps, save, rc, L_s, room, bpos, tied, where, name)
        status = "greedy recompute"
    elif recompute == "ilp":
        rec, status = solve_recompute(cps, save, rc, L_s, room, bpos, tied, time_limit, 0.02, where, name)
    else:
        raise ConfigError(f"unknown recompute mode {recompute!r}; use ilp, greedy, none, full or auto")
    return _finish_build(pieces, chunks, table, ops, rec, status, order, held,
                         greedy_ms if order == "greedy" else None, pc)


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


def _finish_build(pieces, chunks, table, ops, rec, status, order, held, greedy_ms, pc) -> BuiltPipeline:
    n = table.n
    if greedy_ms is not None and not rec.any():  # the list scheduler's times are the greedy's own
        makespan = greedy_ms
    else:
        fwd, bwd, _, p2p = op_times(table, pc, rec)
        _, end = list_schedule(ops, fwd, bwd, p2p, table.fwd_pred, table.bwd_pred,
                               name=lambda kind, k: f"{'FB'[kind]}{table.ids[k]}")
        makespan = float(np.nanmax(end)) if n else 0.0
    return BuiltPipeline(pieces, chunks, table, ops, rec, makespan, status, order=order, held=held)


# ---- elastic pipeline planner ---------------------------------------------------------------

def _check_sequences(seq_ids: np.ndarray, lengths: np.ndarray, pc: PipelineCost, opts: PipelineOptions) -> None:
    room = pc.activation_room_mb
    for sid in seq_ids[np.argsort(-lengths[seq_ids], kind="stable")][:8].tolist():
        s = int(lengths[sid])
        need = pc.min_sequence_memory_mb(s, opts.min_slice_tokens)
        if need > room:
            raise InfeasibleError(
                f"sequence {sid} of {s} tokens does not fit a stage even cut into {opts.min_slice_tokens}-token slices "
                f"with every layer recomputed: it needs {need:.0f} MB per GPU, a stage has {room:.0f} MB of "
                f"activation room ({pc.budget_mb:.0f} MB budget - {pc.model_states_mb:.0f} MB model states); use more "
                f"stages, a larger SP degree or drop it")


def _targets(seq_ids, lengths, pc: PipelineCost, opts: PipelineOptions) -> list[float]:
    """Candidate chunk-time targets: the longest sequence's time over K slices, and multiples of
    it when nothing needs splitting; the likeliest first (closest to the analytic optimum
    sqrt(b W / (P - 1)) of work W, per-chunk fixed cost b and P stages)."""
    lens = lengths[seq_ids]
    s_max = int(lens.max())
    t_max = float(pc.prefix_ms(s_max))
    total = float(pc.prefix_ms(lens).sum())
    k_max = max(1, s_max // max(1, opts.min_slice_tokens))
    # Slicing finer than memory needs may still be faster; coarser cannot run: the first slice
    # (the longest in tokens) must fit on stage 0 with the sequence's other slices recomputed.
    k_min = next((k for k in range(1, k_max + 1)
                  if pc.min_sequence_memory_mb(s_max, int(pc.prefix_tokens(t_max / k))) <= pc.activation_room_mb),
                 k_max)
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
    wins. Past ``deadline`` the search keeps the best candidate found so far.

    1. The chunk-time target (and so K) and the chunk token cap: Algorithm 1 (chunking.py) at
       each, with the default warm-up/cool-down ramp, ordered by list scheduling (``greedy``).
    2. At the best target: the other ramps (and none), and the elastic 1F1B order.
    3. Packed-slice chunkings (Seq1F1B's: packs cut into k equal-compute slices), so elastic_pp
       can always pick what Seq1F1B would run."""
    seq_ids = np.asarray(seq_ids, dtype=np.int64)
    best: BuiltPipeline | None = None
    best_ch = None
    errors = []
    ramps = _ramps(pc.pp, opts)
    orders = ("greedy", "1f1b") if opts.order == "best" else (opts.order,)

    def late() -> bool:
        return deadline is not None and best is not None and time.perf_counter() > deadline

    def consider(pieces, slices, order, ramp=((), ())) -> BuiltPipeline | None:
        nonlocal best
        try:
            b = build_pipeline(pieces, pc, "greedy", opts.tied, where=where, order=order)
        except InfeasibleError as e:
            errors.append(str(e))
            return None
        b.slices = slices
        b.ramp = _ramp_note(*ramp)
        if best is None or b.makespan_ms < best.makespan_ms - 1e-9:
            best = b
        return b

    targets = _targets(seq_ids, lengths, pc, opts)
    caps = _token_caps(seq_ids, lengths, pc)
    finite = [c for c in caps if math.isfinite(c)]
    # near the memory limit, finer caps as a last resort
    fallback = [min(finite, default=float(lengths[seq_ids].max())) / 2 ** i for i in (1, 2)]
    for ci, cap in enumerate(caps + fallback):
        if ci >= len(caps) and best is not None:
            break
        if ci and best is not None and not best.recompute.any():
            break  # a smaller cap only adds chunks when memory does not bind
        for target in targets[:max(1, opts.search_targets)]:
            if late():
                break
            ch = balanced_chunks(seq_ids, lengths, pc, target, cap, opts.granularity, opts.fit,
                                 min_tail=opts.granularity)
            pieces = ramp_chunks(ch.chunks, lengths, pc, ch.slice_ms, *ramps[0], token_cap=cap)
            before = best
            got = consider(pieces, ch.slices, orders[0], ramps[0])
            if (got is None or got.recompute.any() or got.held) and len(orders) > 1:
                # memory binds: the plain chunking in elastic 1F1B order, whose recompute ties
                # along its diagonals, may beat list scheduling held back by memory
                consider(ch.chunks, ch.slices, orders[1])
            if best is not before:
                best_ch = ch
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
    longest = int(lengths[seq_ids].max())
    base_cap = _pack_tokens(seq_ids, lengths, opts)
    caps = {base_cap} | {-(-int(longest * f) // 1024) * 1024 for f in (1, 1.5, 2)}
    packed: dict[int, list[list[int]]] = {}
    for cap, k in [(c, k) for c in sorted(caps)
                   for k in sorted(set(opts.pack_slices) | (set(opts.seq1f1b_slices) if c == base_cap else set()))]:
        if late() and cap != base_cap:
            continue
        if cap not in packed:
            packed[cap] = _pack(seq_ids, lengths, cap)
        pieces = [c for p in packed[cap] for c in split_pack(p, lengths, pc, k)]
        for order in (orders if cap == base_cap else orders[:1]):
            consider(pieces, -k, order)  # slices < 0 marks a packed-slice chunking in the status
    if best is None:
        raise InfeasibleError(errors[-1] if errors else f"{where}: no feasible chunking")
    return best


def _group_estimates(order: np.ndarray, lengths: np.ndarray, pc: PipelineCost) -> np.ndarray:
    """est[i, j]: estimated ms of a pipeline of the sorted sequences order[i:j] (inf if i >= j)."""
    n = len(order)
    w = pc.prefix_ms(lengths[order])
    cw = np.concatenate([[0.0], np.cumsum(w)])
    ct = np.concatenate([[0.0], np.cumsum(lengths[order].astype(np.float64))])
    P = pc.pp
    b = pc.fixed_ms
    act_tok = pc.act_layer_mb * pc.layers_per_stage
    save_tok = max(1e-12, (pc.act_layer_mb - pc.input_layer_mb - pc.kv_layer_mb) * pc.layers_per_stage)
    room = pc.activation_room_mb
    est = np.full((n + 1, n + 1), np.inf)
    for i in range(n):
        W = cw[i + 1:] - cw[i]
        tok = ct[i + 1:] - ct[i]
        s_max = float(lengths[order[i]])
        tau = np.sqrt(b * W / max(1, P - 1)) if P > 1 else W
        tau = np.clip(tau, min(W[0], 1e-9 + float(pc.prefix_ms(min(s_max, 1024)))), W)
        nch = np.maximum(1.0, W / tau)
        T = W + nch * b + (P - 1) * (tau + b)
        inflight = act_tok * (s_max + (P - 1) * tok / nch)
        excess = np.maximum(0.0, inflight - room)
        frac = excess / np.maximum(1e-9, save_tok * (s_max + (P - 1) * tok / nch))
        T = np.where(frac > 1, np.inf, T + frac * W / 3)
        est[i, i + 1:] = T
    return est


def group_sequences(seq_ids, lengths, pc: PipelineCost, max_groups: int = 3) -> list[np.ndarray]:
    """The grouping DP over sequences sorted longest first (consecutive groups)."""
    seq_ids = np.asarray(seq_ids, dtype=np.int64)
    order = seq_ids[np.lexsort((seq_ids, -lengths[seq_ids]))]
    n = len(order)
    est = _group_estimates(order, lengths, pc)
    G = max(1, min(max_groups, n))
    dp = np.full((G + 1, n + 1), np.inf)
    arg = np.zeros((G + 1, n + 1), dtype=np.int64)
    dp[0, 0] = 0.0
    for g in range(1, G + 1):
        for j in range(1, n + 1):
            v = dp[g - 1, :j] + est[:j, j]
            i = int(np.argmin(v))
            dp[g, j], arg[g, j] = v[i], i
    g = int(np.argmin(dp[1:, n])) + 1
    if not np.isfinite(dp[g, n]):  # the estimate sees no feasible grouping: split by tokens
        bounds = np.searchsorted(np.cumsum(lengths[order]), lengths[order].sum() * np.arange(1, G) / G) + 1
        return [x for x in np.split(order, np.unique(np.clip(bounds, 1, n - 1))) if x.size]
    cuts = []
    j = n
    for gg in range(g, 0, -1):
        i = int(arg[gg, j])
        cuts.append((i, j))
        j = i
    return [order[i:j] for i, j in reversed(cuts) if j > i]


def _resolve_layout(cost: CostModel, pp, sp) -> tuple[int, int]:
    dpp, dsp = default_layout(cost)
    if pp is None and sp is None:
        pp, sp = dpp, dsp
    elif pp is None:
        pp = cost.num_gpus // sp if isinstance(sp, int) and sp > 0 else sp
    elif sp is None:
        sp = cost.num_gpus // pp if isinstance(pp, int) and pp > 0 else pp
    return pp, sp


def _pipeline_cost(cost: CostModel, pp, sp, opts: PipelineOptions) -> PipelineCost:
    pp, sp = _resolve_layout(cost, pp, sp)
    pc = PipelineCost(cost, pp, sp, opts.b1_scale, opts.memory_mb)
    check_layout(cost, pp, sp)
    return pc


def _finish(name: str, pipes: list[Pipeline], lengths: np.ndarray, cost: CostModel, pc: PipelineCost,
            opts: PipelineOptions, start: float, status: str, dropped=()) -> StepPlan:
    plan = StepPlan(kind="elastic_pp", num_gpus=cost.num_gpus, planner=name, pipelines=pipes,
                    solver_status=status, dropped_seq_ids=[int(i) for i in dropped])
    validate(plan, lengths, cost)
    validate_pipelines(plan, lengths, cost)
    res = simulate(plan, lengths, cost, b1_scale=opts.b1_scale, memory_mb=opts.memory_mb, events=False)
    plan.solve_time_s = time.perf_counter() - start
    plan.estimated_step_time_s = res.step_time_s
    kept = np.delete(lengths, list(dropped)) if len(dropped) else lengths
    plan.lower_bound_step_time_s = (float(pc.prefix_ms(kept).sum()) + pc.fixed_ms) / 1e3
    return plan


def _opts(options, overrides) -> PipelineOptions:
    if options is None:
        options = PipelineOptions()
    elif not isinstance(options, PipelineOptions):  # a PlannerOptions (or anything with the fields)
        fields = {f.name for f in dataclasses.fields(PipelineOptions)}
        options = PipelineOptions(**{k: getattr(options, k) for k in fields if hasattr(options, k)})
    return dataclasses.replace(options, **overrides) if overrides else options


def _kept(lengths, seq_ids) -> tuple[np.ndarray, np.ndarray]:
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


def plan_elastic_pp(lengths, cost: CostModel, pp: int | None = None, sp: int | None = None,
                    options: PipelineOptions | None = None, *, seq_ids=None, **overrides) -> StepPlan:
    """Plan one step with elastic pipelines of ``pp`` stages of SP degree ``sp`` (pp x sp = GPUs).
    ``seq_ids``: the sequences to plan (default all); the others are reported as dropped."""
    start = time.perf_counter()
    opts = _opts(options, overrides)
    lengths, ids = _kept(lengths, seq_ids)
    pc = _pipeline_cost(cost, pp if pp is not None else opts.pp, sp if sp is not None else opts.sp, opts)
    _check_sequences(ids, lengths, pc, opts)
    budget = opts.time_limit

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
            try:
                built = []
                for i, g in enumerate(groups):
                    frac = (gi + (i + 1) / len(groups)) / len(groupings)
                    built.append(plan_group(g, lengths, pc, opts, start + budget * (0.4 + 0.3 * frac), f"pipeline {i}"))
                candidates.append((sum(b.makespan_ms for b in built), built, groups))
            except InfeasibleError as e:
                err = err or e
    if not candidates:
        raise err
    candidates.sort(key=lambda c: c[0])
    _, built, groups = candidates[0]

    # final recompute with the ILP, in the time left
    final = []
    for i, b in enumerate(built):
        if opts.recompute == "greedy" or (opts.recompute == "ilp" and not b.recompute.any()):
            final.append(b)
            continue
        left = max(0.05, opts.time_limit - (time.perf_counter() - start)) / (len(built) - i)
        nb = build_pipeline(b.pieces, pc, opts.recompute, opts.tied, left, f"pipeline {i}", order=b.order)
        nb.slices, nb.ramp = b.slices, b.ramp
        final.append(nb if nb.makespan_ms <= b.makespan_ms + 1e-9 or opts.recompute != "ilp" else b)
    pipes = [b.to_pipeline(pc) for b in final]
    rec_note = "; ".join(sorted({b.status for b in final}))
    status = (f"{len(final)} pipeline{'s' if len(final) > 1 else ''} x {pc.pp} stages x SP {pc.sp}; "
              f"{', '.join(_chunking_note(b) for b in final)}; {sum(b.table.n for b in final)} chunks; {rec_note}")
    dropped = np.setdiff1d(np.arange(len(lengths)), ids)
    return _finish("elastic_pp", pipes, lengths, cost, pc, opts, start, status, dropped)


# ---- baselines ------------------------------------------------------------------------------

def _pack(seq_ids: np.ndarray, lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit decreasing by tokens into packs of ``capacity`` tokens (longest first)."""
    order = seq_ids[np.lexsort((seq_ids, -lengths[seq_ids]))]
    packs: list[list[int]] = []
    room = np.empty(len(order), dtype=np.int64)
    for i in order.tolist():
        s = int(lengths[i])
        fits = np.flatnonzero(room[:len(packs)] >= s)
        if fits.size:
            j = int(fits[np.argmin(room[fits])])
            packs[j].append(i)
            room[j] -= s
        else:
            room[len(packs)] = capacity - s
            packs.append([i])
    return packs


def _pack_tokens(seq_ids, lengths, opts: PipelineOptions) -> int:
    longest = int(lengths[seq_ids].max())
    if opts.pack_tokens is None:
        return -(-longest // 1024) * 1024
    if opts.pack_tokens < longest:
        raise ConfigError(f"pack_tokens {opts.pack_tokens} is below the longest sequence ({longest} tokens)")
    return int(opts.pack_tokens)


def _packed_baseline(lengths, cost: CostModel, pp, sp, options, seq_ids, overrides):
    """What the packed baselines share: options, kept sequences, the stage cost model, the pack
    size and the packs (best-fit by tokens)."""
    opts = _opts(options, overrides)
    lengths, ids = _kept(lengths, seq_ids)
    pc = _pipeline_cost(cost, pp if pp is not None else opts.pp, sp if sp is not None else opts.sp, opts)
    cap = _pack_tokens(ids, lengths, opts)
    return opts, lengths, ids, pc, cap, _pack(ids, lengths, cap)


def plan_batch_1f1b(lengths, cost: CostModel, pp: int | None = None, sp: int | None = None,
                    options: PipelineOptions | None = None, *, seq_ids=None, **overrides) -> StepPlan:
    """Megatron-style 1F1B over packed micro-batches; static recompute (none if it fits, else full)."""
    start = time.perf_counter()
    opts, lengths, ids, pc, cap, packs = _packed_baseline(lengths, cost, pp, sp, options, seq_ids, overrides)
    pieces = [[(i, 0, int(lengths[i])) for i in p] for p in packs]
    b = build_pipeline(pieces, pc, opts.baseline_recompute, where="batch 1F1B pipeline")
    status = f"{len(packs)} micro-batches of <= {cap} tokens x {pc.pp} stages x SP {pc.sp}; {b.status}"
    return _finish("batch_1f1b", [b.to_pipeline(pc)], lengths, cost, pc, opts, start, status,
                   np.setdiff1d(np.arange(len(lengths)), ids))


def split_pack(pack: list[int], lengths: np.ndarray, pc: PipelineCost, slices: int) -> list[Pieces]:
    """Seq1F1B: cut a packed micro-batch into ``slices`` parts of equal compute (each document
    attends causally to its own earlier tokens)."""
    lens = [int(lengths[i]) for i in pack]
    t_doc = [float(pc.prefix_ms(s)) for s in lens]
    total = sum(t_doc)
    cuts = []  # positions (doc index, token offset)
    acc, d = 0.0, 0
    for j in range(1, slices):
        target = total * j / slices
        while d < len(lens) - 1 and acc + t_doc[d] < target:
            acc += t_doc[d]
            d += 1
        x = int(round(float(pc.prefix_tokens(max(0.0, target - acc)))))
        x = min(max(x, 0), lens[d])
        cuts.append((d, x))
    bounds = [(0, 0)] + cuts + [(len(lens) - 1, lens[-1])]
    out: list[Pieces] = []
    for (d0, x0), (d1, x1) in zip(bounds, bounds[1:]):
        piece: Pieces = []
        for d in range(d0, d1 + 1):
            a = x0 if d == d0 else 0
            b = x1 if d == d1 else lens[d]
            if b > a:
                piece.append((pack[d], a, b))
        if piece:
            out.append(piece)
    return out


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
    return _finish("seq1f1b", [best.to_pipeline(pc)], lengths, cost, pc, opts, start, status,
                   np.setdiff1d(np.arange(len(lengths)), ids))


# ---- auto: FlexSP or elastic pipelines, per step ------------------------------------------------

AUTO_FLEXSP_SHARE = 0.45  # of the time limit, for the FlexSP candidate (its work is count-bounded anyway)
AUTO_PRUNE_MARGIN = 0.85  # a layout is skipped if this x its estimate is no faster than the best plan so far


def pipeline_layouts(cost: CostModel, pp: int | None = None, sp: int | None = None) -> list[tuple[int, int]]:
    """(pp, sp) layouts an elastic pipeline can use on the whole cluster: pp >= 2 stages dividing the
    layers, sp = GPUs / pp an allowed Ulysses degree (power of two dividing the heads), the model
    states fitting. ``pp`` / ``sp`` restrict the list to matching layouts."""
    n, L = cost.num_gpus, cost.model.num_layers
    out = []
    for P in range(2, n + 1):
        if n % P or L % P or (pp is not None and P != pp):
            continue
        d = n // P
        if d not in cost.degrees or (sp is not None and d != sp):
            continue
        try:
            PipelineCost(cost, P, d)
        except MegatronExtError:
            continue
        out.append((P, d))
    return out


def layout_estimate_s(lengths: np.ndarray, pc: PipelineCost) -> float:
    """Step time of one 1F1B pipeline of n equal chunks at the best n:
    ``W + n b + (P - 1)(W / n + b)`` (W: work per stage, b: fixed cost per chunk); no memory
    limit. Ramps and list scheduling beat it by up to ~7%; recompute makes it optimistic."""
    W = float(pc.prefix_ms(np.asarray(lengths, dtype=np.float64)).sum())
    P, b = pc.pp, pc.fixed_ms
    n = np.arange(1, max(2, len(lengths)) + 1, dtype=np.float64)
    return float((W + n * b + (P - 1) * (W / n + b)).min()) / 1e3


def plan_auto(lengths, cost: CostModel, pp: int | None = None, sp: int | None = None,
              options: PipelineOptions | None = None, *, seq_ids=None, **overrides) -> StepPlan:
    """Unify FlexSP and elastic pipelines (DESIGN.md "Unify"): plan the step with FlexSP (adaptive
    SP on all GPUs, i.e. pp = 1) and with elastic_pp on every feasible (pp, sp) layout, simulate each
    with the same simulator and return the fastest plan (kind ``flexsp`` or ``elastic_pp``).
    ``pp`` / ``sp`` (or the options') pin the layout: FlexSP is the pp = 1 layout, so a pinned
    pp > 1 leaves only that pipeline layout, and pp = 1 only FlexSP.

    ``solver_status`` names the choice; ``baselines`` holds every alternative's simulated time
    (``"flexsp"``, ``"elastic_pp pp4 x sp8"``, ...). Time: a layout whose estimate
    (``layout_estimate_s``), less 15%, is no faster than the best plan so far is skipped (reported
    with its estimate), and so is any layout left when the time limit has run out. If no layout
    can beat BatchAda's step (an upper bound of FlexSP's), FlexSP gets the whole time limit;
    otherwise ``AUTO_FLEXSP_SHARE`` of it, and the layouts share the rest, most promising first."""
    start = time.perf_counter()
    opts = _opts(options, overrides)
    lengths, ids = _kept(lengths, seq_ids)
    budget = opts.time_limit
    alts: dict[str, dict] = {}
    plans: list[tuple[float, str, StepPlan]] = []

    def record(name: str, plan: StepPlan, t0: float) -> None:
        units = len(plan.micro_batches) if plan.kind == "flexsp" else sum(len(p.chunks) for p in plan.pipelines)
        alts[name] = {"estimated_step_time_s": plan.estimated_step_time_s, "solve_time_s": time.perf_counter() - t0,
                      "num_micro_batches": units, "status": plan.solver_status}
        plans.append((plan.estimated_step_time_s, name, plan))

    from megatron_ext.planner.api import PlannerOptions

    pin_pp = pp if pp is not None else opts.pp
    pin_sp = sp if sp is not None else opts.sp
    with_flexsp = pin_pp is None or pin_pp == 1  # FlexSP is the pp = 1 layout (adaptive sp)
    layouts = []
    for P, d in pipeline_layouts(cost, pin_pp, pin_sp):
        pc = PipelineCost(cost, P, d, opts.b1_scale, opts.memory_mb)
        layouts.append((layout_estimate_s(lengths[ids], pc), P, d))
    layouts.sort()
    # BatchAda (one homogeneous degree, milliseconds to plan) bounds FlexSP's step from above: FlexSP
    # keeps the best homogeneous packing among its candidates. If no layout can beat that bound,
    # FlexSP gets the whole time limit.
    try:
        ub = _flexsp_kind("batchada", lengths, ids, cost, PlannerOptions()).estimated_step_time_s
    except MegatronExtError:
        ub = math.inf
    hopeful = any(AUTO_PRUNE_MARGIN * est < ub for est, _, _ in layouts)
    share = AUTO_FLEXSP_SHARE * budget if hopeful else budget - (time.perf_counter() - start)
    t0 = time.perf_counter()
    try:
        if with_flexsp:
            record("flexsp", _flexsp_kind("flexsp", lengths, ids, cost, PlannerOptions(time_limit=max(0.05, share))),
                   t0)
    except MegatronExtError as e:
        alts["flexsp"] = {"error": str(e)}
    for i, (est, P, d) in enumerate(layouts):
        name = f"elastic_pp pp{P} x sp{d}"
        best = min((t for t, _, _ in plans), default=math.inf)
        left = budget - (time.perf_counter() - start)
        if AUTO_PRUNE_MARGIN * est >= best:
            alts[name] = {"skipped": f"estimated {est:.2f} s (one 1F1B pipeline of equal chunks), "
                                     f"{AUTO_PRUNE_MARGIN:.0%} of it no faster than {best:.2f} s",
                          "estimated_lower_s": AUTO_PRUNE_MARGIN * est}
            continue
        if left <= 0.02 and plans:
            alts[name] = {"skipped": f"time limit reached (estimated {est:.2f} s)"}
            continue
        t0 = time.perf_counter()
        try:
            sub = plan_elastic_pp(lengths, cost, P, d, dataclasses.replace(opts, time_limit=max(0.05, left / (len(layouts) - i))),
                                  seq_ids=ids)
            record(name, sub, t0)
        except MegatronExtError as e:
            alts[name] = {"error": str(e)}
    if not plans:
        raise InfeasibleError("auto: no layout can run this batch: " +
                              "; ".join(f"{k}: {v.get('error', v.get('skipped'))}" for k, v in alts.items()))
    plans.sort(key=lambda x: (x[0], x[1]))
    step, chosen, plan = plans[0]
    for name, alt in alts.items():
        if "estimated_step_time_s" in alt:
            alt["speedup"] = alt["estimated_step_time_s"] / step
    others = ", ".join(f"{k} {v['estimated_step_time_s']:.2f} s" for k, v in alts.items()
                       if k != chosen and "estimated_step_time_s" in v)
    plan.solver_status = f"auto chose {chosen} ({step:.2f} s" + (f"; vs {others}" if others else "") + \
                         f"); {plan.solver_status}"
    plan.baselines = {k: v for k, v in alts.items() if k != chosen}
    plan.planner = "auto"
    plan.solve_time_s = time.perf_counter() - start
    return plan


PP_PLANNERS = {"elastic_pp": plan_elastic_pp, "batch_1f1b": plan_batch_1f1b, "seq1f1b": plan_seq1f1b,
               "auto": plan_auto}


def make_pp_plan(name: str, lengths, cost: CostModel, options=None, baselines: tuple[str, ...] = (),
                 **overrides) -> StepPlan:
    """The make_plan of pipeline planners: drop or refuse over-long sequences (``max_seq_len`` /
    ``drop_over_max`` of a PlannerOptions), plan, and time each baseline (pipeline planners and
    FlexSP-kind planners alike) on the same batch."""
    if name not in PP_PLANNERS:
        raise ConfigError(f"unknown pipeline planner {name!r}; choose one of {', '.join(PP_PLANNERS)}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        raise LengthsError("the batch is empty: nothing to plan")
    max_len = getattr(options, "max_seq_len", None)
    ids = np.arange(len(lengths))
    if max_len is not None:
        over = lengths > max_len
        if over.any():
            if not getattr(options, "drop_over_max", False):
                raise LengthsError(f"{int(over.sum())} sequence(s) exceed the maximum length {max_len} "
                                   f"(longest {int(lengths.max())}); use --drop-over-max to drop them")
            ids = np.flatnonzero(~over)
    plan = PP_PLANNERS[name](lengths, cost, options=options, seq_ids=ids, **overrides)
    opts = _opts(options, overrides)
    for b in baselines:
        if b == name or b in plan.baselines:  # (auto reports the alternatives it compared itself)
            continue
        try:
            if b in PP_PLANNERS:
                other = PP_PLANNERS[b](lengths, cost, options=options, seq_ids=ids, **overrides)
                units = sum(len(p.chunks) for p in other.pipelines)
            else:
                other = _flexsp_kind(b, lengths, ids, cost, options)
                units = len(other.micro_batches)
            step = simulate(other, lengths, cost, b1_scale=opts.b1_scale, events=False).step_time_s
            plan.baselines[b] = {"estimated_step_time_s": step, "solve_time_s": other.solve_time_s,
                                 "num_micro_batches": units, "speedup": step / plan.estimated_step_time_s,
                                 "status": other.solver_status}
        except (MegatronExtError, ImportError) as e:  # a baseline that cannot run this batch
            plan.baselines[b] = {"error": str(e)}
    return plan


def _flexsp_kind(name: str, lengths: np.ndarray, ids: np.ndarray, cost: CostModel, options) -> StepPlan:
    """A FlexSP-kind planner (flexsp, static_ulysses, ...) on the same kept sequences."""
    from megatron_ext.planner.api import PlannerOptions, make_plan  # lazy: api may import this module

    fields = {f.name for f in dataclasses.fields(PlannerOptions)}
    kw = {k: getattr(options, k) for k in fields if options is not None and hasattr(options, k)}
    kw["drop_over_max"] = False
    kw["max_seq_len"] = None
    sub = make_plan(name, lengths[ids], cost, PlannerOptions(**kw))
    # map back to the batch's ids
    for mb in sub.micro_batches:
        for g in mb.groups:
            g.seq_ids = [int(ids[i]) for i in g.seq_ids]
    sub.dropped_seq_ids = [int(i) for i in np.setdiff1d(np.arange(len(lengths)), ids)]
    return sub


def describe(plan: StepPlan, lengths, result: SimResult | None = None) -> str:
    """A readable summary of a pipeline plan, or of an ``auto`` plan of either kind (for the CLI)."""
    lengths = np.asarray(lengths)
    if plan.kind == "flexsp":
        lines = [f"{plan.planner} plan: FlexSP, {len(plan.micro_batches)} micro-batch(es); {plan.solver_status}"]
        for m, mb in enumerate(plan.micro_batches):
            degs: dict[int, list[int]] = {}
            for g in mb.groups:
                degs.setdefault(g.degree, []).append(len(g.seq_ids))
            lines.append(f"  micro-batch {m}: {mb.estimated_time_s:.3f} s; groups "
                         + ", ".join(f"{len(v)} x degree {d} ({sum(v)} seq)" for d, v in sorted(degs.items(), reverse=True)))
    else:
        lines = [f"{plan.planner} plan: {len(plan.pipelines)} pipeline(s); {plan.solver_status}"]
    for i, p in enumerate(plan.pipelines):
        n = len(p.chunks)
        tok = [sum(x.end - x.start for x in c.pieces) for c in p.chunks]
        kinds = {"split": 0, "hybrid": 0, "batched": 0}
        for c in p.chunks:
            split = [x for x in c.pieces if x.start > 0 or x.end < lengths[x.seq_id]]
            kinds["split" if len(c.pieces) == 1 and split else "hybrid" if split else "batched"] += 1
        warm = []
        for o in p.order_per_stage:
            first_b = next((j for j, op in enumerate(o) if op.startswith("B")), len(o))
            warm.append(first_b)
        rec = sum(sum(c.recompute_layers_per_stage) for c in p.chunks if c.recompute_layers_per_stage)
        lines.append(f"  pipeline {i}: {p.stages} stages x SP {p.sp_degree}, {n} chunks ({kinds['split']} split, "
                     f"{kinds['hybrid']} hybrid, {kinds['batched']} batched), tokens per chunk {min(tok)}..{max(tok)}, "
                     f"warm-up per stage {warm}, recomputed layer-chunks {rec}")
    bound = "work bound" if plan.kind == "elastic_pp" else "lower bound"
    lines.append(f"estimated step time {plan.estimated_step_time_s:.3f} s ({bound} {plan.lower_bound_step_time_s:.3f} s), "
                 f"planned in {plan.solve_time_s * 1e3:.0f} ms")
    if result is not None:
        where = "stage" if result.kind == "elastic_pp" else "GPU (max)"
        peak = result.peak_memory_mb if result.kind == "elastic_pp" else [result.max_peak_memory_mb]
        unit, div = ("GB", 1024.0) if result.budget_mb >= 2048 else ("MB", 1.0)
        lines.append(f"bubble ratio {result.bubble_ratio:.1%}, recompute {result.recompute_ratio:.1%}, peak memory per "
                     f"{where} {', '.join(f'{m / div:.1f}' for m in peak)} {unit} "
                     f"(budget {result.budget_mb / div:.1f} {unit})")
    width = max([16] + [len(n) for n in plan.baselines])
    for name, b in plan.baselines.items():
        if "error" in b:
            lines.append(f"  vs {name:<{width}} infeasible: {b['error']}")
        elif "skipped" in b:
            lines.append(f"  vs {name:<{width}} skipped: {b['skipped']}")
        else:
            lines.append(f"  vs {name:<{width}} {b['estimated_step_time_s']:8.3f} s   speedup {b['speedup']:.2f}x")
    return "\n".join(lines)


__all__ = ["BuiltPipeline", "PP_BASELINES", "PP_PLANNERS", "PipelineOptions", "build_pipeline", "describe",
           "group_sequences", "layout_estimate_s", "make_pp_plan", "pipeline_layouts", "plan_auto", "plan_batch_1f1b",
           "plan_elastic_pp", "plan_group", "plan_seq1f1b", "split_pack"]
