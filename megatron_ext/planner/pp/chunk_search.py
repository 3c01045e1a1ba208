"""One elastic pipeline's chunking and order, searched (``plan_group``; steps 2-3 of the
elastic_pp planner, planner/pp/elastic_pp.py): candidate chunkings (chunking.py) are built and
simulated (pipeline.build_pipeline) with the greedy's recompute, and the fastest wins."""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from megatron_ext.cost.pipeline import PipelineCost
from megatron_ext.errors import InfeasibleError, OutOfTimeError
from megatron_ext.planner.packing import best_fit_bins
from megatron_ext.planner.pp.chunking import balanced_chunks, ramp_chunks, split_pack
from megatron_ext.planner.pp.grouping import pipeline_estimate
from megatron_ext.planner.pp.pipeline import BuiltPipeline, PipelineOptions, build_pipeline, pack_capacity
from megatron_ext.planner.pp.sequence_limits import even_bounds, fewest_slices, finest_slice, fit_cap, what_to_change


PROBE_TARGETS = 3  # chunk-time targets a probe tries (the likeliest; K is the choice that matters most)
MAX_CHUNKS = 4096  # chunk candidates with more chunks are not built (their recompute tables grow as n^2)
# builds of fewer chunks do not price larger ones: their fixed cost dominates (whole packs, 2 chunks
# of 8 stages: 0.5 ms a chunk; 148 chunks: 0.2 ms), and a probe priced from them skipped the
# targets' chunking it is for (a replica of 45 sequences up to 192K: 23.8 s, 17.3 s built)
PRICED_CHUNKS = 16
# Seconds one chunk on one stage costs to build, check and simulate once, where memory binds (on a
# 2-core machine: a 2-stage pipeline of 2,800 chunks, hundreds in flight, 0.4-0.9 s to build;
# with few in flight far less: 32 stages of ~1,000 chunks, 0.56 s): what a build is priced at
# before any is known. Auto starts no layout whose chunks x stages need more than the time left
# (3e-5 started more layouts than could finish: 9 map cells over 2% behind against 6)
CHUNK_STAGE_S = 8e-5
# ... in a pipeline of FEW_CHUNKS chunks or more. With fewer, fewer are in flight (the memory
# checkpoints list them): down to half the rate at FEW_CHUNKS / 2 (128 replicas of 4 x SP 8, ~43
# chunks each: 19 us to build a chunk-stage, 16 us to check and simulate it; one replica of 2 x SP
# 4 holding 1,005 slices of a 128K sequence in flight: over 100 us)
FEW_CHUNKS = 128

KEPT_CHUNK_STAGES = 500_000  # candidates a BuildCache keeps, in chunks x stages (~260 bytes each: ~130 MB)
# ... and chunkings, in pieces (~100 bytes each: ~100 MB; 8,192 sequences on 8 stages made 57
# chunkings of 477,000 pieces in 2.4 s)
KEPT_PIECES = 1_000_000


def chunk_stage_s(chunks: float) -> float:
    """What one chunk on one stage costs to build, check and simulate in a pipeline of ``chunks``."""
    return CHUNK_STAGE_S * min(1.0, max(0.5, chunks / FEW_CHUNKS))


class BuildCache:
    """The candidates one replica's searches built (or why they cannot run), by pipeline, order
    and chunking: a grouping's full search starts with its probe's candidates (20-40% of the
    builds), which it takes from here. The first ``KEPT_CHUNK_STAGES`` are kept (the probes', those
    asked again), so a long time limit cannot fill memory with them. Also the first
    ``KEPT_PIECES`` pieces of the chunkings the searches made, by sequences, target, token cap
    and ramp: a search walked again (a replica planned again) takes them from here rather than
    chunk anew (a third of its time). And what builds cost: per order, the chunks and seconds of its
    largest candidate built of PRICED_CHUNKS or more, which prices (at its slowest order's rate)
    what a search would build past its ``give_up`` time, where another plan stands (a grouping's
    second pipeline, priced by nothing, built 1,402 chunks in 0.18 s past the time its grouping had
    to give up by: gpt-7b on 8 x 8, 64 A100-40GB, 8,192 GitHub sequences). Not what it builds before
    its own deadline: a replica searched again then skipped the candidates its first search priced
    high (15 of the map's cells slower by over 0.5%, up to 3.8%)."""

    def __init__(self) -> None:
        self.built: dict[tuple, BuiltPipeline | str] = {}
        self.size = 0  # chunks x stages kept
        self.chunked: dict[tuple, object] = {}
        self.pieces = 0  # pieces kept in ``chunked``
        self.priced: dict[str, tuple[int, float]] = {}

    def chunking(self, key: tuple, make):
        """``make()``'s chunking (a ``Chunking``, or chunks: lists of pieces), made once per key."""
        got = self.chunked.get(key)
        if got is None:
            got = make()
            pieces = sum(len(c) for c in getattr(got, "chunks", got))
            if self.pieces + pieces <= KEPT_PIECES:
                self.chunked[key], self.pieces = got, self.pieces + pieces
        return got

    def get(self, key: tuple) -> BuiltPipeline | str | None:
        return self.built.get(key)

    def keep(self, key: tuple, built: BuiltPipeline | str, stages: int) -> None:
        size = 0 if isinstance(built, str) else built.table.n * stages
        if self.size + size <= KEPT_CHUNK_STAGES:
            self.built[key], self.size = built, self.size + size


def _chunked(seq_ids: np.ndarray, lengths, pc: PipelineCost, opts: PipelineOptions, builds: BuildCache,
             target: float, cap: float, mesh_cap, ramp):
    """Algorithm 1 at (target, token cap; ``mesh_cap``: each sequence's slice cap, or None), and
    its chunks with the ramp (from ``builds`` if made before)."""
    key = (seq_ids.tobytes(), target, cap, mesh_cap is not None)
    ch = builds.chunking(key, lambda: balanced_chunks(seq_ids, lengths, pc, target, cap, opts.granularity, opts.fit,
                                                      min_tail=opts.granularity, max_slice_tokens=mesh_cap))
    return ch, builds.chunking(key + (ramp,), lambda: ramp_chunks(ch.chunks, lengths, pc, ch.slice_ms, *ramp,
                                                                   token_cap=cap))


def _packed(seq_ids: np.ndarray, lengths, pc: PipelineCost, builds: BuildCache, cap: int, k: int | None = None):
    """The sequences best-fit into packs of ``cap`` tokens; with ``k``, each cut into k equal-compute
    slices (``split_pack``: Seq1F1B's chunking). From ``builds`` if made before."""
    key = (seq_ids.tobytes(), "packs", cap)
    packs = builds.chunking(key, lambda: best_fit_bins(seq_ids, lengths, cap))
    if k is None:
        return packs
    return builds.chunking(key + (k,), lambda: [c for p in packs for c in split_pack(p, lengths, pc, k)])


def replay(seq_ids, lengths, pc: PipelineCost, opts: PipelineOptions, like: BuiltPipeline,
           where: str = "pipeline") -> BuiltPipeline:
    """``like``'s chunking (its ``recipe``: the chunk-time target and token cap, or the pack size
    and slices, which mean the same on any sequences) and order (a greedy one's tie-break too),
    built on ``seq_ids``: one build where a search makes dozens (another replica's pipeline, alike
    in its lengths). Raises InfeasibleError where it cannot run there (or ``like`` came of no recipe)."""
    if like.recipe is None:
        raise InfeasibleError(f"{where}: its chunking has no recipe to replay")
    seq_ids = np.asarray(seq_ids, dtype=np.int64)
    builds = BuildCache()
    if like.recipe[0] == "packs":
        _, cap, k = like.recipe
        pieces, slices = _packed(seq_ids, lengths, pc, builds, max(cap, pack_capacity(seq_ids, lengths, opts)), k), -k
    else:
        _, target, cap, capped, ramp = like.recipe
        mesh_cap = (lambda s: fit_cap(s, pc, opts.granularity)) if capped else None
        ch, pieces = _chunked(seq_ids, lengths, pc, opts, builds, target, cap, mesh_cap, ramp)
        slices = ch.slices
    b = build_pipeline(pieces, pc, _search_recompute(opts), opts.ties != "untied", where=where, order=like.order,
                       forwards_first=like.forwards_first)
    b.slices, b.ramp, b.recipe = slices, like.ramp, like.recipe
    return b


def _search_recompute(opts: PipelineOptions) -> str:
    """Candidates are scored with the greedy's recompute (the ILP runs on the winner); with a
    fixed rule (none, every layer, or "auto": none if it fits, else every layer), under that rule."""
    return "greedy" if opts.recompute in ("ilp", "greedy") else opts.recompute


def _targets(seq_ids, lengths, pc: PipelineCost, opts: PipelineOptions, chunks: int,
             capped: bool = False) -> list[float]:
    """Candidate chunk-time targets: the longest sequence's time over K slices, and multiples of
    it when nothing needs splitting; the likeliest first (closest to W / n, work W over ``chunks``,
    the count the 1F1B estimate finds best, ``grouping.pipeline_estimate``: sqrt(b W / (P - 1)) of
    per-chunk fixed cost b and P stages where memory allows, more chunks where it binds -- gpt-7b
    on 4 x 8 at 192K tried K = 28 first without it, 65.1 s at 0.4 s, and K = 48 with it, 60.9 s;
    with one stage, the largest first)."""
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
    if pc.pp == 1:  # no warm-up or drain to trade against the per-chunk fixed cost: fewest chunks first
        return sorted(out, reverse=True)
    guess = total / chunks
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


def _recipe(target: float, cap: float, mesh_cap, ramp) -> tuple:
    return ("chunks", target, cap, mesh_cap is not None, ramp)


def _ramp_note(front, back) -> str:
    if not front and not back:
        return ""
    return f"ramp {len(front)}+{len(back)}"


def plan_group(seq_ids, lengths, pc: PipelineCost, opts: PipelineOptions, deadline: float | None = None,
               where: str = "pipeline", probe: bool = False, whole_packs: bool = False,
               builds: BuildCache | None = None, give_up: float | None = None) -> BuiltPipeline:
    """Search one pipeline's chunking and order; the fastest simulated candidate (greedy recompute)
    wins. Past ``deadline`` the search keeps the best candidate found so far (with none yet, it
    goes straight to step 3). ``probe``: step 1 at the ``PROBE_TARGETS`` likeliest targets only
    (and the finer token caps if memory needs them), a quick measure of what the full search finds.

    0. Packed-slice chunkings (Seq1F1B's: packs cut into k equal-compute slices), so elastic_pp
       can pick what Seq1F1B or batch 1F1B would run: a few chunks each, so quick to build, and
       where memory binds whole packs in 1F1B order with recompute may beat every finer chunking
       (gpt-30b on 32 A100-40GB, 48K: 175 s against the targets' 202 s). Not in a probe, unless
       ``whole_packs``: then the context-length packs cut into the estimate's chunks, then whole,
       first (the first is built whatever the deadline: a replica given too little time for more
       keeps the likelier).
    1. The chunk-time target (and so K) and the chunk token cap: Algorithm 1 (chunking.py) at
       each, with the default warm-up/cool-down ramp, ordered by list scheduling (``greedy``);
       with token-capped slices when memory needs them (``sequence_limits.fit_cap``; first, if no equal-time
       slicing of the longest sequence can fit, else if nothing else fitted). One stage also builds
       every sequence at its slice cap, at the first target (fewest chunks), whatever the deadline.
    2. At the best target: the other ramps (and none), after the first token cap's targets (and
       again for a best target found at a finer cap), and the elastic 1F1B order.
    3. Nothing fits yet: every sequence at its slice cap, then every slice and chunk at half the
       longest sequence's cap, a quarter, ... down to its finest slicing; where that makes more
       than ``MAX_CHUNKS``, the fewest equal-time slices that let the longest sequence fit, then
       each sequence cut only as its memory needs (``fewest_chunks``).

    ``builds``: the candidates built so far, shared by the searches of one replica's pipelines.
    ``give_up``: where another plan stands, the time past which a search that has found nothing
    feasible raises OutOfTimeError rather than build on (its candidate would end past it)."""
    s = _GroupSearch(np.asarray(seq_ids, dtype=np.int64), lengths, pc, opts, deadline, where, probe,
                     BuildCache() if builds is None else builds, give_up)
    if whole_packs or not probe:  # (a probe measures the targets' chunkings: the grouping hangs on them)
        s.packed_slices()
    targets, finite = s.search(s.cap_of if s.capped else None)
    if pc.pp == 1 and s.slice_cap is not None and not s.capped and not s.hurry():
        # one stage: the fewest chunks win, so each long sequence cut only where memory needs it
        # (llama-13b, SP 8, 96K: a 98K sequence in 2 slices at its cap, 71.5 s; equal-time
        # slices fitted at 4, 73.7 s), built whatever the deadline (a few chunks)
        ch = s.capped_slices(targets[0], s.slice_cap)
        s.consider(ch.chunks, ch.slices, s.orders[0], always=True)
    s.probed = probe
    if s.best is None and s.slice_cap is not None and not s.capped and not s.hurry():
        targets, finite = s.search(s.cap_of)  # no equal-time mesh worked: cap the slices
    if s.best_ch is not None:
        s.other_ramps()
        s.other_orders()
    if s.best is None:
        s.last_resort(targets[0], finite)
    if s.best is None:
        raise InfeasibleError((s.errors[-1] if s.errors else f"{where}: no feasible chunking") + "; "
                              + what_to_change(pc, opts.granularity, opts.recompute))
    return s.best


class _GroupSearch:
    """One ``plan_group`` call's search: the candidates considered so far and the best of them,
    what builds cost, the errors met; its steps are ``plan_group``'s."""

    def __init__(self, seq_ids: np.ndarray, lengths, pc: PipelineCost, opts: PipelineOptions, deadline: float | None,
                 where: str, probe: bool, builds: BuildCache, give_up: float | None):
        self.seq_ids, self.lengths, self.pc, self.opts = seq_ids, lengths, pc, opts
        self.deadline, self.where, self.probe, self.builds, self.give_up = deadline, where, probe, builds, give_up
        self.best: BuiltPipeline | None = None
        self.best_ch = None  # (target, token cap, mesh cap) of the best candidate's chunking
        self.errors: list[str] = []
        self.ramps = _ramps(pc.pp, opts)
        self.orders = ("greedy", "1f1b") if opts.order == "best" else (opts.order,)
        self.search_recompute = _search_recompute(opts)
        self.probed = False  # a probe's targets are done: it stops at what it has
        # per order, (chunks, seconds) of its largest candidate built of PRICED_CHUNKS or more: what
        # builds cost, scaled (a greedy order costs 4x a 1F1B one: priced from a 1F1B build of 96
        # chunks, a greedy one of 773 ran 0.18 s past its search's end; gpt-13b on 32 A800s, 192K, 8 x 4)
        self.priced: dict[str, tuple[int, float]] = {}
        self.longest = int(lengths[seq_ids].max())
        # (the search's first guesses)
        self.likeliest_chunks = pipeline_estimate(lengths[seq_ids], pc, opts.min_slice_tokens)[1]
        # memory: each sequence's slice cap, the most tokens per slice that let it fit alone (None:
        # it fits unsliced); ``capped`` when no equal-time slicing of the search's lets the longest
        # fit, so every long sequence is cut on its own token-capped mesh
        self.fit_caps: dict[int, int | None] = {}
        self.slice_cap = self.cap_of(self.longest)
        self.capped = self.slice_cap is not None and \
            fewest_slices(self.longest, pc, opts.granularity, opts.min_slice_tokens) is None
        self.ramped: list[tuple] = []  # the chunkings (best_ch) whose other ramps were tried

    def cap_of(self, s: int) -> int | None:
        if s not in self.fit_caps:
            self.fit_caps[s] = fit_cap(s, self.pc, self.opts.granularity)
        return self.fit_caps[s]

    def gave_up(self) -> OutOfTimeError:
        return OutOfTimeError(f"{self.where}: nothing fitted before the time ran out (another plan stands)")

    def late(self) -> bool:
        return self.best is not None and (self.probed or (self.deadline is not None
                                                          and time.perf_counter() > self.deadline))

    def hurry(self) -> bool:  # out of time with nothing feasible yet: straight to the safest chunkings
        return self.deadline is not None and self.best is None and time.perf_counter() > self.deadline

    def consider(self, pieces, slices, order, ramp=((), ()), always: bool = False, recipe=None) -> BuiltPipeline | None:
        """Build (or take from ``builds``) and score one candidate; unless ``always``, not one whose
        build would end past the deadline once something fits. ``recipe``: how it was chunked
        (``BuiltPipeline.recipe``)."""
        if len(pieces) > MAX_CHUNKS:
            self.errors.append(f"{self.where}: {len(pieces)} chunks, more than the {MAX_CHUNKS} a pipeline may have")
            return None
        key = (self.where, order, tuple(tuple(map(tuple, c)) for c in pieces))
        b = self.builds.get(key)
        if b is None:
            # would end past the deadline: building grows about linearly with the chunks (12 to
            # 2,300 chunks: 0.15-0.6 ms each), priced from the largest candidate of its order built so
            # far (PRICED_CHUNKS; else the slower order's). Past ``give_up``, where another plan
            # stands, nothing is built, priced at the slowest rate of the replica's searches
            # (``BuildCache.priced``), else at CHUNK_STAGE_S: a full search's first build, priced
            # by nothing, ran 0.09 s past its replica's 0.23 s, and a 1F1B one priced by an
            # infeasible 1F1B build (which stops early) 0.03 s (gpt-7b on 8 A100s, 4 x 2)
            def ends(record, any_order: bool = False) -> float:
                n, secs = (not any_order and record.get(order)) or \
                    max(record.values(), key=lambda x: x[1] / x[0], default=(1, 0.0))
                return time.perf_counter() + secs * max(1.0, len(pieces) / n)

            if self.best is not None and self.deadline is not None and ends(self.priced) > self.deadline \
                    and not always:
                return None
            if self.give_up is not None and \
                    ends(self.builds.priced or {order: (1, CHUNK_STAGE_S * self.pc.pp)}, True) > self.give_up:
                if self.best is None:
                    raise self.gave_up()
                return None
            t0 = time.perf_counter()
            try:
                b = build_pipeline(pieces, self.pc, self.search_recompute, self.opts.ties != "untied",
                                   where=self.where, order=order)
            except InfeasibleError as e:
                b = str(e)
            self.builds.keep(key, b, self.pc.pp)
            took = (len(pieces), time.perf_counter() - t0)
            for record in (self.priced, self.builds.priced):  # (an infeasible build took its time too)
                if len(pieces) >= max(record.get(order, (0,))[0], PRICED_CHUNKS):
                    record[order] = took
        if isinstance(b, str):
            self.errors.append(b)
            return None
        b = dataclasses.replace(b)  # (this search's own labels: slices, ramp)
        b.slices, b.recipe = slices, recipe
        b.ramp = _ramp_note(*ramp)
        if self.best is None or b.makespan_ms < self.best.makespan_ms - 1e-9:
            self.best = b
        return b

    def chunked(self, target: float, cap: float, mesh_cap, ramp):
        return _chunked(self.seq_ids, self.lengths, self.pc, self.opts, self.builds, target, cap, mesh_cap, ramp)

    def other_ramps(self) -> None:
        """Step 2's ramps at the best target so far, once per chunking."""
        if self.best_ch is None or self.best_ch in self.ramped:
            return
        self.ramped.append(self.best_ch)
        for ramp in self.ramps[1:]:
            if self.late():
                break
            ch, pieces = self.chunked(*self.best_ch, ramp)
            self.consider(pieces, ch.slices, self.orders[0], ramp, recipe=_recipe(*self.best_ch, ramp))

    def other_orders(self) -> None:
        """Step 2's other order, on the best candidate's chunks."""
        for order in self.orders[1:]:
            if self.late():
                break
            top = self.best
            self.consider(top.pieces, top.slices, order, ((), ()), recipe=top.recipe)
            if self.best is not top:
                self.best.ramp = top.ramp

    def search(self, mesh_cap) -> tuple[list[float], list[float]]:
        """Step 1, the chunk-time targets x token caps; returns (targets, finite caps). After the
        first cap's targets, the best one's other ramps (a few chunks' change, which finer caps, a
        last resort where memory binds, rarely beat: they came first in a full search)."""
        targets = _targets(self.seq_ids, self.lengths, self.pc, self.opts, self.likeliest_chunks,
                           capped=mesh_cap is not None)
        caps = _token_caps(self.seq_ids, self.lengths, self.pc)
        if mesh_cap is not None:
            caps = [c for c in caps if c > self.slice_cap] + [float(self.slice_cap)]
        finite = [c for c in caps if math.isfinite(c)]
        # near the memory limit, finer caps as a last resort
        fallback = [min(finite, default=float(self.longest)) / 2 ** i for i in (1, 2)]
        for ci, cap in enumerate(caps + fallback):
            if ci >= len(caps) and self.best is not None:
                break
            if ci and self.best is not None and not self.best.recompute.any():
                break  # a smaller cap only adds chunks when memory does not bind
            for target in targets[:PROBE_TARGETS if self.probe else max(1, self.opts.search_targets)]:
                if self.late() or self.hurry():
                    break
                ch, pieces = self.chunked(target, cap, mesh_cap, self.ramps[0])
                before = self.best
                got = self.consider(pieces, ch.slices, self.orders[0], self.ramps[0],
                                    recipe=_recipe(target, cap, mesh_cap, self.ramps[0]))
                if (got is None or got.recompute.any() or got.held) and len(self.orders) > 1 and not self.late():
                    # memory binds: the plain chunking in elastic 1F1B order, whose recompute ties
                    # along its diagonals, may beat list scheduling held back by memory
                    self.consider(ch.chunks, ch.slices, self.orders[1], recipe=_recipe(target, cap, mesh_cap, ((), ())))
                if self.best is not before:
                    self.best_ch = (target, cap, mesh_cap)
            if ci == 0 and not self.probe:
                self.other_ramps()
        return targets, finite

    def packed_slices(self) -> None:
        """Step 0: packs of the context length or 1-2x the longest sequence, cut into k
        equal-compute slices (each slice holds at most one continued piece, so the tail rule holds);
        a probe, the context-length packs cut as below, then whole. First, the context-length packs
        cut into the chunks the 1F1B estimate finds best (``grouping.pipeline_estimate``), over the packs: it
        was the best k of packs cut into 4-32 within 1-4% (gpt-7b on 4 x 8 at 96K: 12 estimated,
        38.9 s built, 39.5 s at 8; gpt-13b on 8 x 8 at 192K: 24.8, 39.0 s, 43.4 s at 8)."""
        opts, probe = self.opts, self.probe
        base_cap = pack_capacity(self.seq_ids, self.lengths, opts)
        caps = {base_cap} | {-(-int(self.longest * f) // 1024) * 1024 for f in (1, 1.5, 2)}
        packs = len(_packed(self.seq_ids, self.lengths, self.pc, self.builds, base_cap))
        likeliest = max(1, round(self.likeliest_chunks / packs))
        first = [(base_cap, likeliest)] if likeliest > 1 else []
        for cap, k in first + [(base_cap, min(opts.pack_slices))] if probe else first + [
                (c, k) for c in sorted(caps)
                for k in sorted(set(opts.pack_slices) | (set(opts.seq1f1b_slices) if c == base_cap else set()))
                if (c, k) not in first]:
            if not probe and (self.late() or self.hurry()):  # (a probe's packs are built even in a hurry: a few chunks)
                break
            if self.capped and self.longest / k > self.slice_cap:
                continue  # the longest sequence's slices cannot fit
            pieces = _packed(self.seq_ids, self.lengths, self.pc, self.builds, cap, k)
            got = None
            for order in (self.orders if cap == base_cap else self.orders[:1]):
                # (a probe, late, builds them all the same: in its first order, and in the other where
                # memory binds, as in the targets' search)
                if not self.late() or (probe and (got is None or got.recompute.any() or got.held)):
                    # (slices < 0: a packed-slice chunking)
                    got = self.consider(pieces, -k, order, always=probe, recipe=("packs", cap, k))

    def capped_slices(self, target: float, t: int):
        """Chunks of ``target``'s time and ``t`` tokens, each sequence's slices within its cap."""
        opts = self.opts
        return balanced_chunks(self.seq_ids, self.lengths, self.pc, target, float(t), opts.granularity, opts.fit,
                               min_tail=opts.granularity,
                               max_slice_tokens=self.cap_of if t == self.slice_cap
                               else lambda s, t=t: min(t, self.cap_of(s) or s))

    def last_resort(self, target: float, finite: list[float]) -> None:
        """Step 3, until something fits (in a hurry, the search built nothing): whole sequences
        where the longest fits whole (a group of short ones has no slicing to try), then every slice
        and chunk within the longest sequence's slice cap, then finer, down to the finest slicing;
        where that makes more than MAX_CHUNKS (each sequence at its own slice cap: 9,650 for 205
        lengths up to 105K), the fewest equal-time slices that let the longest sequence fit, chunks
        uncapped, then ``fewest_chunks``. ``target``: the search's likeliest chunk time;
        ``finite``: its token caps."""
        pc, opts, longest = self.pc, self.opts, self.longest

        def uncapped(chunk_ms: float) -> None:
            ch = balanced_chunks(self.seq_ids, self.lengths, pc, chunk_ms, math.inf, opts.granularity, opts.fit,
                                 min_tail=opts.granularity)
            self.consider_each_order(ch)

        if self.slice_cap is None:  # the longest fits whole: whole sequences first, chunks of its time
            uncapped(float(pc.prefix_ms(longest)))
        t = self.slice_cap or int(min(finite, default=longest)) // 2
        finest = finest_slice(longest, max(1, int(opts.granularity)))
        made = (0.0, t)  # (seconds, token cap) of the last chunking: one at cap t takes about cap / t times that
        while self.best is None and t >= finest:
            if self.give_up is not None and time.perf_counter() + made[0] * made[1] / t > self.give_up:
                raise self.gave_up()
            t0 = time.perf_counter()
            ch = self.capped_slices(target, t)  # (first each sequence at its own cap)
            made = (time.perf_counter() - t0, t)
            if len(ch.chunks) > MAX_CHUNKS:  # (refused, and finer slices only make more: ~0.4 s a try past the limit)
                self.errors.append(f"{self.where}: {len(ch.chunks)} chunks, more than the {MAX_CHUNKS} a pipeline "
                                   f"may have")
                if not self.capped:
                    k = fewest_slices(longest, pc, opts.granularity, opts.min_slice_tokens) or 1
                    uncapped(float(pc.prefix_ms(longest)) / k)
                if self.best is None:
                    self.fewest_chunks()
                break
            self.consider_each_order(ch)
            t = max(t // 2, finest) if t > finest else 0

    def fewest_chunks(self) -> None:
        """Each sequence whole where it fits alone, else in equal slices of its cap (``fit_cap``),
        a chunk each, longest first: the fewest chunks that let each sequence fit alone, where
        slicing every sequence on the longest one's time step makes more than a pipeline may have
        (gpt-7b on 4 x 2 A100-40GB, ZeRO-1: 18 sequences of 26,741 tokens, 209 slices of 128 each,
        and 60 of up to 4,000 tokens made over 4,096 chunks on that step, 3,822 so)."""
        order = self.seq_ids[np.lexsort((self.seq_ids, -self.lengths[self.seq_ids]))]
        chunks = []
        for sid in order.tolist():
            s = int(self.lengths[sid])
            cuts = even_bounds(s, self.cap_of(s) or s).tolist()
            chunks += [[(sid, a, b)] for a, b in zip(cuts, cuts[1:])]
        slices = sum(1 for c in chunks if c[0][0] == order[0])  # (the longest's)
        if len(chunks) > MAX_CHUNKS:
            self.errors.append(f"{self.where}: {len(chunks)} chunks, more than the {MAX_CHUNKS} a pipeline may have "
                               f"(each sequence sliced only as its memory needs)")
            return
        for order_name in self.orders:
            if self.best is None:
                self.consider(chunks, slices, order_name)

    def consider_each_order(self, ch) -> None:
        """``ch``'s chunks in each order, until one fits."""
        for order in self.orders:
            if self.best is None:
                self.consider(ch.chunks, ch.slices, order)


__all__ = ["CHUNK_STAGE_S", "FEW_CHUNKS", "KEPT_CHUNK_STAGES", "KEPT_PIECES", "MAX_CHUNKS", "PRICED_CHUNKS",
           "PROBE_TARGETS", "BuildCache", "chunk_stage_s", "plan_group", "replay"]
