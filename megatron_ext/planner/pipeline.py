"""Elastic pipeline parallelism (InfiniPipe, PAPERS.md section 2) and pipeline baselines.

``plan_elastic_pp(lengths, cost, pp, sp)``:
1. Grouping: the sequences, longest first, are cut into one or more consecutive groups, each run
   as its own 1F1B pipeline, one after another, by the DP
   ``dp[j] = min_i dp[i] + T(i..j)`` with T an analytic estimate (work, per-chunk fixed cost,
   warm-up/cool-down of P - 1 chunks, recompute forced by the stage-0 memory). When memory binds,
   "the longest sequence in a pipeline of its own" is tried too. The one-pipeline plan is always
   built; the fastest grouping (simulated) wins.
2. Chunking per pipeline (planner/chunking.py): the target chunk time (and so K) and the chunk
   token cap are searched, likeliest first, within the time limit; each candidate is chunked,
   ordered, given greedy recompute and simulated; the fastest wins. Packed-slice chunkings
   (packs of the context length or 1-2x the longest sequence, cut into k equal-compute slices)
   are candidates too, so elastic_pp is never worse than the Seq1F1B chunking it could pick.
3. Order: elastic 1F1B (sim/engine.one_f_one_b). Forward order: each long sequence's slices then
   its hybrid tail chunk, longest sequences first, then batched chunks slowest first. Backward
   order: the forward order with each split sequence's chunks reversed. Warm-up on stage p:
   P - 1 - p + (slices of the first split sequence - 1).
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
from megatron_ext.planner.chunking import Pieces, balanced_chunks
from megatron_ext.sim.engine import (ChunkTable, analyze_chunks, backward_order, checkpoint_memory,
                                     list_schedule, memory_checkpoints, one_f_one_b, op_times, order_names)
from megatron_ext.sim.simulator import SimResult, simulate


@dataclass(frozen=True)
class PipelineOptions:
    pp: int | None = None  # stages (default: one per node)
    sp: int | None = None  # Ulysses degree inside a stage (default: the node size, up to the head limit)
    b1_scale: float = 1.0  # per-chunk fixed cost = b1 * b1_scale / pp (see cost/pipeline.py)
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

    def to_pipeline(self, pc: PipelineCost) -> Pipeline:
        chunks = [Chunk(c.id, c.pieces, [int(v) for v in self.recompute[:, i]] if self.recompute.any() else [])
                  for i, c in enumerate(self.chunks)]
        return Pipeline(pc.pp, pc.sp, chunks, order_names(self.ops, self.table.ids))


def _checkpoints(table: ChunkTable, ops, pc: PipelineCost):
    P = pc.pp
    full_mid, save = pc.chunk_memory(table.tokens, table.split_tokens, False)
    full_last, _ = pc.chunk_memory(table.tokens, table.split_tokens, True)
    cps = [memory_checkpoints(ops[p], table, full_last if p == P - 1 else full_mid, pc) for p in range(P)]
    return cps, save


def _fits(cps, save, rec, room) -> bool:
    return all((checkpoint_memory(c, save, rec[p]) <= room[p] * (1 + 1e-9) + 1e-6).all() for p, c in enumerate(cps))


def build_pipeline(pieces: list[Pieces], pc: PipelineCost, recompute: str = "greedy", tied: bool = True,
                   time_limit: float = 0.5, where: str = "pipeline") -> BuiltPipeline:
    """Chunks (in forward order) -> elastic 1F1B order, recompute, simulated makespan."""
    chunks = [Chunk(i, [Piece(int(s), int(a), int(b)) for s, a, b in c]) for i, c in enumerate(pieces)]
    table = analyze_chunks(chunks, pc, where)
    forward = list(range(table.n))
    backward = backward_order(forward, table)
    ops = one_f_one_b(forward, backward, pc.pp)
    P, L_s, n = pc.pp, pc.layers_per_stage, table.n
    cps, save = _checkpoints(table, ops, pc)
    room = np.full(P, pc.activation_room_mb)
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
    fwd, bwd, _, p2p = op_times(table, pc, rec)
    _, end = list_schedule(ops, fwd, bwd, p2p, table.fwd_pred, table.bwd_pred, name=name)
    return BuiltPipeline(pieces, chunks, table, ops, rec, float(np.nanmax(end)) if n else 0.0, status)


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
    ks = sorted({k for k in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64, 96, 128)
                 if k <= k_max})
    out = [t_max / k for k in ks]
    for m in (1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32):
        if t_max * m <= total / max(1, pc.pp) * 1.5:
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


def plan_group(seq_ids, lengths, pc: PipelineCost, opts: PipelineOptions, deadline: float | None = None,
               where: str = "pipeline") -> BuiltPipeline:
    """Search the chunk-time target (and so K) and the chunk token cap for one pipeline, with
    greedy recompute; the fastest simulated candidate wins. Past ``deadline`` the search stops
    at the first feasible candidate found."""
    seq_ids = np.asarray(seq_ids, dtype=np.int64)
    best: BuiltPipeline | None = None
    errors = []
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
        for target in targets:
            if deadline is not None and best is not None and time.perf_counter() > deadline:
                break
            ch = balanced_chunks(seq_ids, lengths, pc, target, cap, opts.granularity, opts.fit,
                                 min_tail=opts.granularity)
            try:
                b = build_pipeline(ch.chunks, pc, "greedy", opts.tied, where=where)
            except InfeasibleError as e:
                errors.append(str(e))
                continue
            b.slices = ch.slices
            if best is None or b.makespan_ms < best.makespan_ms - 1e-9:
                best = b
    # packed-slice candidates (Seq1F1B's chunkings: packs of the context length cut into k
    # equal-compute slices; each slice holds at most one continued piece, so the tail rule holds)
    longest = int(lengths[seq_ids].max())
    caps = {_pack_tokens(seq_ids, lengths, opts)} | {-(-int(longest * f) // 1024) * 1024 for f in (1, 1.5, 2)}
    for cap, k in [(c, k) for c in sorted(caps) for k in opts.pack_slices]:
        packs = _pack(seq_ids, lengths, cap)
        pieces = [c for p in packs for c in split_pack(p, lengths, pc, k)]
        try:
            b = build_pipeline(pieces, pc, "greedy", opts.tied, where=where)
        except InfeasibleError as e:
            errors.append(str(e))
            continue
        b.slices = -k  # marks a packed-slice chunking in the status
        if best is None or b.makespan_ms < best.makespan_ms - 1e-9:
            best = b
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
    return f"K={b.slices}" if b.slices > 0 else f"packs cut in {-b.slices}"


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
        nb = build_pipeline(b.pieces, pc, opts.recompute, opts.tied, left, f"pipeline {i}")
        nb.slices = b.slices
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


def plan_batch_1f1b(lengths, cost: CostModel, pp: int | None = None, sp: int | None = None,
                    options: PipelineOptions | None = None, *, seq_ids=None, **overrides) -> StepPlan:
    """Megatron-style 1F1B over packed micro-batches; static recompute (none if it fits, else full)."""
    start = time.perf_counter()
    opts = _opts(options, overrides)
    lengths, ids = _kept(lengths, seq_ids)
    pc = _pipeline_cost(cost, pp if pp is not None else opts.pp, sp if sp is not None else opts.sp, opts)
    cap = _pack_tokens(ids, lengths, opts)
    packs = _pack(ids, lengths, cap)
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
    opts = _opts(options, overrides)
    lengths, ids = _kept(lengths, seq_ids)
    pc = _pipeline_cost(cost, pp if pp is not None else opts.pp, sp if sp is not None else opts.sp, opts)
    cap = _pack_tokens(ids, lengths, opts)
    packs = _pack(ids, lengths, cap)
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


PP_PLANNERS = {"elastic_pp": plan_elastic_pp, "batch_1f1b": plan_batch_1f1b, "seq1f1b": plan_seq1f1b}


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
        if b == name:
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
    """A readable summary of a pipeline plan (for the CLI)."""
    lengths = np.asarray(lengths)
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
    lines.append(f"estimated step time {plan.estimated_step_time_s:.3f} s (work bound {plan.lower_bound_step_time_s:.3f} s), "
                 f"planned in {plan.solve_time_s * 1e3:.0f} ms")
    if result is not None:
        lines.append(f"bubble ratio {result.bubble_ratio:.1%}, recompute {result.recompute_ratio:.1%}, peak memory per "
                     f"stage {', '.join(f'{m / 1024:.1f}' for m in result.peak_memory_mb)} GB "
                     f"(budget {result.budget_mb / 1024:.1f} GB)")
    for name, b in plan.baselines.items():
        if "error" in b:
            lines.append(f"  vs {name:<16} infeasible: {b['error']}")
        else:
            lines.append(f"  vs {name:<16} {b['estimated_step_time_s']:8.3f} s   speedup {b['speedup']:.2f}x")
    return "\n".join(lines)


__all__ = ["BuiltPipeline", "PP_BASELINES", "PP_PLANNERS", "PipelineOptions", "build_pipeline", "describe",
           "group_sequences", "make_pp_plan", "plan_batch_1f1b", "plan_elastic_pp", "plan_group", "plan_seq1f1b",
           "split_pack"]
