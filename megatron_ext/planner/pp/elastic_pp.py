"""Elastic pipeline parallelism (InfiniPipe, PAPERS.md section 2): the elastic_pp planner.

``plan_elastic_pp(lengths, cost, pp, sp)``; with pp x sp below the GPU count, the sequences are
first shared out over GPUs / (pp x sp) replicas side by side (grouping.split_replicas), each
planned as below in an equal share of half the time limit's first ``REBALANCE_AFTER`` (or, given
less than ``REPLAY_BELOW`` of what a search took, built as the first searched replica's chunking,
``chunk_search.replay``); the slowest replica, which sets the step, is then planned again in the
rest of it (resuming its searches from the candidates and chunkings built; one that gains nothing
in the share it had beside replicas ending close to it, once more in all the time left) while that
makes it faster, and the replicas' ends are evened out in the time left (``_rebalance``). One
replica alone is planned again too, in the time its search kept for the ILP and the check and left:
0. Feasibility (planner/pp/sequence_limits.py): each of the longest sequences must fit alone at
   the finest slicing (every layer recomputed); otherwise the error says how long a sequence may
   be and what else to change.
1. Grouping (planner/pp/grouping.py): the sequences, longest first, are cut into one or more
   consecutive groups, each run as its own 1F1B pipeline, one after another, by a DP over an
   analytic estimate. When memory binds, "the longest sequence in a pipeline of its own" is
   tried too. Every grouping (one pipeline always among them) is probed first (step 2 at its
   likeliest targets only), then searched in full in the order of the probes: the best until
   0.55 of the time, the runner-up (if within 10%) until 0.7; the fastest wins. Where none holds
   the batch, its sliced sequences spread over as many pipelines as they need (``_spread_slices``).
2. Chunking per pipeline (planner/pp/chunking.py): the target chunk time (and so K) and the chunk
   token cap are searched, likeliest first (at most ``search_targets`` per cap); each candidate
   is chunked, given a warm-up/cool-down ramp (a few small chunks of whole short sequences first
   and last, ``chunking.ramp_chunks``), ordered, given greedy recompute and simulated; the
   fastest wins. At the winning target the other ramps (and none: after the first token cap's
   targets, before the finer caps) and the other order are tried.
   Packed-slice chunkings (packs of the context length or 1-2x the longest sequence, cut into k
   equal-compute slices) go first in a full search (in a probe of one pipeline, the estimate's
   cut, then whole packs), so elastic_pp can pick the Seq1F1B or batch 1F1B chunking. When no
   equal-time slicing into slices of at least ``min_slice_tokens`` lets the longest sequence fit
   (or none of those candidates fits), each long sequence's slices are token-capped as much as
   it needs to fit alone (``sequence_limits.fit_cap``, ``chunking.capped_mesh``); if still nothing fits, ever
   finer slices and smaller chunks are tried, down to the finest slicing. No candidate holds
   more than ``MAX_CHUNKS`` chunks.
3. Order (``order``): forward order = the ramp's small chunks, each long sequence's slices then
   its hybrid tail chunk (longest first), batched chunks slowest first, the cool-down ramp;
   backward order = the forward order with each split sequence's chunks reversed. Per stage,
   either list scheduling (sim/engine.greedy_orders: a free stage runs whichever of its next
   backward and next forward can start first, on a tie the forward but on the last stage, forwards
   held back when the stage's activations would pass its room; where one was, backwards first on
   a tie is built too, and the faster kept) or elastic 1F1B (sim/engine.one_f_one_b: warm-up
   P - 1 - p + slices of the first split sequence - 1); "best" tries both, and 1F1B is always
   tried where memory binds (its recompute ties along the schedule's diagonals).
4. Recompute: the ILP of planner/pp/checkpointing.py on the winner (greedy if HiGHS has nothing), tied
   along the schedule's diagonals (the paper's), untied (one variable per stage and chunk) or, by
   default, both: the faster simulated plan wins (``ties``).
5. The plan is validated and simulated; the simulator's step time is the estimate.

Time limit (``time_limit``, the whole step's planning; with replicas, each replica's share): the
groupings' probes come first, then their full searches until 0.7 of it, then the ILP in what is
left (if none, the search's greedy recompute stands, noted in the status). Past its deadline a
search keeps its best candidate and starts no chunking whose build would end past it; a pipeline
with nothing feasible yet at its deadline goes straight to the safest chunkings (whole sequences
where the longest fits whole; the capped slices, then finer; past MAX_CHUNKS, the longest
sequence's fewest fitting slices, then each sequence cut only as its memory needs) and keeps
trying until something fits, unless another grouping already has a plan: then it drops its
grouping rather than start a build that would end past the budget less what checking that plan
takes (a build's time, feasible or not, priced from the largest built so far of
``PRICED_CHUNKS`` chunks or more).

Steps 2-3 (one pipeline's search) are in planner/pp/chunk_search.py; building and scoring a pipeline
and what the other pipeline planners share, in planner/pp/pipeline.py.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import time

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.cost.pipeline import PipelineCost
from megatron_ext.errors import InfeasibleError, OutOfTimeError
from megatron_ext.plan.schema import StepPlan
from megatron_ext.planner.pp.chunk_search import MAX_CHUNKS, BuildCache, plan_group, replay
from megatron_ext.planner.pp.grouping import group_sequences, split_replicas
from megatron_ext.planner.pp.pipeline import (BuiltPipeline, PipelineOptions, finish_plan, kept_sequences,
                                           pipeline_cost, pipeline_options, with_recompute)
from megatron_ext.planner.pp.sequence_limits import check_sequences, memory_slices
from megatron_ext.text import numbered, plural


def _chunking_note(b: BuiltPipeline) -> str:
    note = f"K={b.slices}" if b.slices > 0 else f"packs cut in {-b.slices}"
    return note + (f", {b.ramp}" if b.ramp else "") + f", {b.order} order"


def _makespan(built: list[BuiltPipeline]) -> float:
    """ms a replica's pipelines run, one after another."""
    return sum(b.makespan_ms for b in built)


def _plan_structure(groups: list[np.ndarray], lengths, pc: PipelineCost, opts: PipelineOptions, start: float,
                    end: float, probe: bool, builds: BuildCache, give_up: float | None = None) -> list[BuiltPipeline]:
    """The pipelines of one grouping, searched one after another, each until its share of
    ``start``..``end`` by its place (``probe``: each its first candidates only; ``builds``: the
    candidates built so far; ``give_up``: where another grouping's plan stands, past it a pipeline
    with nothing feasible yet drops the grouping, ``plan_group``)."""
    # (one pipeline's probe tries packs too, whole: batch 1F1B's chunking, which wins where memory
    # binds, and which a short search of the groupings would otherwise never weigh)
    return [plan_group(g, lengths, pc, opts, start + (end - start) * (i + 1) / len(groups), f"pipeline {i}",
                       probe, whole_packs=len(groups) == 1, builds=builds, give_up=give_up)
            for i, g in enumerate(groups)]


def _spread_slices(ids: np.ndarray, lengths, pc: PipelineCost, opts: PipelineOptions) -> list[np.ndarray]:
    """The grouping of last resort: the sequences memory cuts (at their ``fit_cap``, into the
    slices of ``chunk_search``'s fewest chunks) over as many pipelines as leave none with over
    half ``MAX_CHUNKS`` of those slices (the most first, each to the pipeline with the fewest so
    far), then those that run whole, in pipelines of up to that many. The other groupings keep
    the long sequences together: gpt-7b on 8 A100-40GB at ZeRO-1, 4 x 2, 2,048 GitHub sequences
    of up to 26,741 tokens (the longest the layout holds; 11,628 such chunks) were refused. (Whole
    sequences beside one that fits only alone can leave no room for it: gpt-7b on 16 A100-40GB,
    ZeRO-3, 1 x 16, a 226,034-token sequence and 247 short ones, 3 MB over.)"""
    uniq, at = np.unique(lengths[ids], return_inverse=True)
    forced = np.array([memory_slices(int(s), pc, opts.granularity) for s in uniq.tolist()])[at]
    sliced = forced > 1
    cut, whole, slices = ids[sliced], ids[~sliced], forced[sliced]
    half = MAX_CHUNKS // 2
    loads = [(0, g) for g in range(-(-int(slices.sum()) // half))]  # (slices, pipeline): ties to the first
    owner = np.empty(len(cut), dtype=np.int64)
    for i in np.lexsort((cut, -slices)).tolist():
        load, g = heapq.heappop(loads)
        owner[i] = g
        heapq.heappush(loads, (load + int(slices[i]), g))
    groups = [np.sort(cut[owner == g]) for g in range(len(loads))]
    return [g for g in groups if g.size] + [whole[i:i + half] for i in range(0, len(whole), half)]


def _plan_replica(ids: np.ndarray, lengths, pc: PipelineCost, opts: PipelineOptions, start: float,
                  budget: float, builds: BuildCache | None = None, stands: float | None = None) -> list[BuiltPipeline]:
    """One replica's pipelines (run one after another), planned in ``budget`` seconds from
    ``start``: one pipeline, or the sequences grouped into up to ``max_pipelines`` (where none of
    those holds them, into as many as ``_spread_slices`` needs); then the ILP's recompute on the
    winner. Every grouping is probed first (its first candidates), then the
    searches go to the groupings in the order of their probes, the likeliest getting most of the
    time: a short budget still weighs every grouping, rather than spending it all on the first.
    ``stands``: where the caller has another plan, the time past which the probes give up hunting
    for a feasible chunking while none has one (OutOfTimeError)."""
    err = None
    builds = BuildCache() if builds is None else builds  # the candidates built: the probes', the searches'
    structures = [[ids]]
    probes: list[tuple[float, list[BuiltPipeline], int]] = []  # (makespan, pipelines, index in structures)

    def check_end() -> float:
        # the end of the budget less twice what building a probed grouping's pipelines took: its
        # check and simulation, and room for the searches and the ILP (at ``_check_s`` alone the
        # probes ran on, and auto had no time left to plan the layout again: gpt-13b on 32
        # A100-40GB, 96K GitHub, ZeRO-1, 8 x 4: 96.89 s, against 86.19 s)
        return start + budget - 2 * max(sum(b.build_s for b in built) for _, built, _ in probes)

    def give_up() -> float | None:
        # once a grouping has a plan, the others' searches may not hunt for a feasible chunking past
        # ``check_end``: a late probe's hunt ran elastic_pp 0.2 s past a 1 s limit, and with once
        # what building took kept, 0.04 s past 0.59 s (gpt-13b on 32 A800s, 192K, 8 x 4)
        return check_end() if probes else stands

    took: list[float] = []  # seconds each probe took

    def probe_structure(i: int) -> None:
        nonlocal err
        t0 = time.perf_counter()
        try:
            built = _plan_structure(structures[i], lengths, pc, opts, start, start + 0.3 * budget, True, builds,
                                    give_up())
            probes.append((_makespan(built), built, i))
        except OutOfTimeError as e:
            if not probes:  # (the time is out: the other groupings would hunt past it too)
                raise
            err = err or e
        except InfeasibleError as e:  # (this grouping is out)
            err = err or e
        took.append(time.perf_counter() - t0)

    probe_structure(0)
    if opts.max_pipelines > 1 and len(ids) > 1:
        groups = group_sequences(ids, lengths, pc, opts.max_pipelines)
        if len(groups) == 1 and not probes:  # the estimate missed: halve by tokens
            order = groups[0]
            cut = int(np.searchsorted(np.cumsum(lengths[order]), lengths[order].sum() / 2)) + 1
            groups = [order[:cut], order[cut:]] if 0 < cut < len(order) else groups
        if len(groups) > 1:
            structures.append(groups)
        if not probes or probes[0][1][0].recompute.any():
            # memory binds: the longest sequence in a pipeline of its own relieves the others
            order = ids[np.lexsort((ids, -lengths[ids]))]
            structures.append([order[:1], order[1:]])
        for i in range(1, len(structures)):
            # a probe builds its first candidates whatever its deadline: one that would end past the
            # time left for checking the plan (``check_end``) is not started, and
            # what was probed stands (only a batch nothing fit yet goes on; gpt-7b on 32 A100-40GB,
            # 96K GitHub, 8 x 4: a third probe of 0.15 s ran elastic_pp 0.08 s past a 0.55 s limit)
            if probes and time.perf_counter() + max(took) > check_end():
                break
            probe_structure(i)
        if not probes:
            structures.append(_spread_slices(ids, lengths, pc, opts))
            probe_structure(len(structures) - 1)
    if not probes:
        raise err
    # the full searches: the best probe's grouping until 0.55 of the budget (0.7 alone), the
    # runner-up's (if within 10% of it) until 0.7; a probe stands where its search finds nothing faster
    probes.sort(key=lambda c: c[0])
    candidates = [(t, built) for t, built, _ in probes]
    ranked = [probes[0]] + [c for c in probes[1:2] if c[0] <= 1.1 * probes[0][0]]
    for (_, _, i), until in zip(ranked, (0.55, 0.7) if len(ranked) > 1 else (0.7,)):
        now = time.perf_counter()
        if now > start + until * budget:
            break
        try:
            built = _plan_structure(structures[i], lengths, pc, opts, now, start + until * budget, False, builds,
                                    give_up())
            candidates.append((_makespan(built), built))
        except (InfeasibleError, OutOfTimeError):
            pass
    candidates.sort(key=lambda c: c[0])
    built = candidates[0][1]
    return _final_recompute(built, pc, opts, start + budget - _check_s(built, pc))


def _final_recompute(built: list[BuiltPipeline], pc: PipelineCost, opts: PipelineOptions,
                     end: float) -> list[BuiltPipeline]:
    """The pipelines' recompute chosen again by the ILP (``recompute="ilp"``), where they
    recompute anything, until ``end`` (the time left after what checking and simulating the plan
    will take); a plan the ILP does not make faster keeps the greedy's, and says so. The fixed
    rules none / full / auto were the search's own: their candidates are final. Each ILP build
    after the first leaves what those before ran past their limits (the solve stops at its limit,
    its plan's simulation comes after: ~10 ms on 8 stages of 108 chunks)."""
    final, over = [], 0.0
    for i, b in enumerate(built):
        if opts.recompute != "ilp" or not b.recompute.any():
            final.append(b)
            continue
        ties = (True, False) if opts.ties == "best" else (opts.ties != "untied",)
        for j, tied in enumerate(ties):
            left = (end - time.perf_counter() - over) / (len(built) - i) / (len(ties) - j)
            if left < 2 * b.build_s:  # too little to build it again and solve: the greedy stands
                if j == 0:
                    b.status += " (no time left for the ILP)"
                break
            t0 = time.perf_counter()
            nb = with_recompute(b, pc, opts.recompute, tied, left - b.build_s, f"pipeline {i}")
            over = max(over, time.perf_counter() - t0 - (left - b.build_s))
            nb.slices, nb.ramp, nb.recipe = b.slices, b.ramp, b.recipe
            if nb.makespan_ms <= b.makespan_ms + 1e-9:
                b = nb
            else:  # (say so: asked for the ILP, the plan shows the greedy's)
                b = dataclasses.replace(b, status=f"{b.status} (the {nb.status} plan, {nb.makespan_ms / 1e3:.3f} s, "
                                                  f"no faster)")
        final.append(b)
    return final


REBALANCE_AFTER = 0.8  # of the time limit: replicas are planned by then, the rest evens out their ends
REPLICA_FIRST_PASS = 0.5  # of the time before that: every replica planned in an equal share, the rest to the slowest
REPLICA_TIE = 0.05  # replicas ending this close to the slowest share the time left with it
REPLAY_BELOW = 0.5  # of what a replica's search took: a replica given less time replays a searched one's chunking
# what checking and simulating a plan takes (``validate`` walks every piece, the simulator every
# chunk on every stage, each pipeline a fixed setup): fitted over 1-128 pipelines of 1-16 stages x
# SP 1-8 (7.6 us a chunk-stage, 2.9 us a piece, 0.53 ms a pipeline; within 0.87-1.44x of each
# check), raised by half for the plan's assembly and that spread (at the fit, one pipeline's
# replanning ended 1-2 ms past a 1 s limit); what building the pipelines took is no measure (0.4x
# to 2x of it)
CHECK_CHUNK_STAGE_S = 1.2e-5
CHECK_PIECE_S = 4.5e-6
CHECK_PIPELINE_S = 8e-4


def _check_s(built, pc: PipelineCost) -> float:
    """What checking and simulating pipelines ``built`` will take: the final ILP, replanning the
    slowest replica and evening out their ends stop short of it, and a layout kept to its limit
    counts it in."""
    return sum(CHECK_CHUNK_STAGE_S * pc.pp * b.table.n + CHECK_PIECE_S * sum(map(len, b.pieces)) + CHECK_PIPELINE_S
               for b in built)


def _rebalance(parts: list[np.ndarray], plans: dict, lengths, pc: PipelineCost, opts: PipelineOptions,
               deadline: float, rounds: int = 3) -> None:
    """Even out the replicas' ends (in place): the replica holding the longest sequence tends to
    finish last, as its slices run one after another. Move sequences (never the slowest replica's
    longest) worth about half the gap from the slowest replica to the fastest, replan both, and
    keep the move if the slower of the two now ends earlier; a few rounds, in the time left."""
    def end(r: int) -> float:
        return _makespan(plans[r]) if r in plans else 0.0

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
        except (InfeasibleError, OutOfTimeError):
            return
        if max(_makespan(a), _makespan(b)) >= ends[slow] - 1e-9:
            return
        parts[slow], parts[fast], plans[slow], plans[fast] = new_slow, new_fast, a, b


def plan_elastic_pp(lengths, cost: CostModel, pp: int | None = None, sp: int | None = None,
                    options: PipelineOptions | None = None, *, seq_ids=None, keep_to_limit: bool = False,
                    builds: BuildCache | None = None, **overrides) -> StepPlan:
    """Plan one step with elastic pipelines of ``pp`` stages of SP degree ``sp``; with pp x sp
    below the GPU count, GPUs / (pp x sp) replicas run side by side, each its share of the
    sequences (``grouping.split_replicas``). ``seq_ids``: the sequences to plan (default all);
    the others are reported as dropped. ``keep_to_limit`` (where another plan stands): raise
    OutOfTimeError once the replicas left, each taking at least what the quickest so far took,
    and the plan's check after them (``_check_s``) would end past the time limit (every replica
    needs a plan, and a memory-bound one builds several candidates, whatever its share of the
    time: 16 one-stage replicas at 0.02 s each ran 0.47 s on a 0.09 s limit), rather than run
    on, and where a replica would hunt for a feasible chunking past the limit
    (``chunk_search.plan_group``'s ``give_up``).
    ``builds``: the candidates built by an earlier plan of the same batch on the same layout, to
    resume from (filled in)."""
    start = time.perf_counter()
    opts = pipeline_options(options, overrides)
    lengths, ids = kept_sequences(lengths, seq_ids)
    pc = pipeline_cost(cost, pp if pp is not None else opts.pp, sp if sp is not None else opts.sp, opts)
    check_sequences(ids, lengths, pc, opts.granularity, opts.recompute)
    parts = split_replicas(ids, lengths, pc, pc.replicas)
    # with replicas, part of the time is kept to even out their ends (_rebalance)
    first_end = start + opts.time_limit * (REBALANCE_AFTER if pc.replicas > 1 else 1.0)
    plans: dict[int, list[BuiltPipeline]] = {}
    # (one for every replica: a replica planned again resumes from its candidates)
    builds = BuildCache() if builds is None else builds
    pass_end = start + (first_end - start) * (REPLICA_FIRST_PASS if pc.replicas > 1 else 1.0)
    took: list[float] = []  # seconds each replica's first search took
    # a replica whose share of the time is less than REPLAY_BELOW of what a search took (a search
    # takes about its share, and a little more) replays the first searched replica's chunking
    # instead (``chunk_search.replay``: one build; split longest first, the replicas are alike);
    # the step waits only for the slowest, searched again below (4,096 GPUs, 128 replicas of 4 x
    # SP 8, 32,768 sequences: 10 ms a search, 2 ms a replay). (Replaying wherever the replay ends
    # no later than the slowest plan lost 5% on 8 replicas of gpt-13b on 256 A100-40GB, 48K
    # GitHub: the first search, in an eighth of the time, was the weakest)
    model: BuiltPipeline | None = None
    replayed: list[float] = []  # seconds each replay took
    failed = False  # a replay could not run its replica's sequences (which was searched)
    checked = 0.0  # what checking the replicas planned so far will take (``_check_s``)
    for r, part in enumerate(parts):
        if not part.size:
            continue
        now = time.perf_counter()  # what is left, shared by the replicas still to plan
        todo = sum(1 for q in parts[r:] if q.size)
        share = max(0.0, pass_end - now) / todo
        replaying = model is not None and share < REPLAY_BELOW * min(took)
        # the least each replica left takes: a search's, or where it may replay, a replay's once
        # one ran (before: unknown, unless a replay failed and its replica was searched)
        if replaying:
            each = min(replayed) if replayed else min(took) if failed else None
        else:
            each = min(took, default=None)
        # (and the plan's check after them, priced as the replicas planned so far: 16 replicas of
        # 16 stages took 0.1 s to check, past the 0.15 s limit that their plans had kept to)
        check = checked * (len(plans) + todo) / len(plans) if plans else 0.0
        if keep_to_limit and each is not None and now + todo * each + check > start + opts.time_limit:
            raise OutOfTimeError(f"{plural(todo, 'replica')} left to plan at {each:.3f} s or more each, and the "
                                 f"plan's check, past the {opts.time_limit:.3g} s limit")
        if replaying:
            try:
                plans[r] = [replay(part, lengths, pc, opts, model, "pipeline 0")]
                replayed.append(time.perf_counter() - now)
                checked += _check_s(plans[r], pc)
                continue
            except InfeasibleError:
                failed = True  # (searched, as the first was)
        # (where another plan stands, a replica hunting for a feasible chunking gives up at the limit:
        # llama-7b on 2 x 2 x 2, 8 A800s, 4,096 GitHub sequences, 128K, ZeRO-3: the first replica's
        # probes built infeasible candidates of up to 3,777 chunks for 1.0 s on a 0.07 s limit)
        plans[r] = _plan_replica(part, lengths, pc, opts, now, share, builds,
                                 start + opts.time_limit if keep_to_limit else None)
        took.append(time.perf_counter() - now)
        checked += _check_s(plans[r], pc)
        if model is None and len(plans[r]) == 1 and plans[r][0].recipe is not None:
            model = plans[r][0]

    # the step ends with its slowest replica: it is planned again (its searches resume where they
    # stopped, from the candidates built) while that makes it faster, in the time left but the
    # check's (``_check_s``), shared with the replicas that end within REPLICA_TIE of it (the next
    # slowest once it is faster); one that gains nothing in its share gets all of the time left once
    # more (llama-13b on 2 x 8 x 2, 96K GitHub ZeRO-3, at 0.3 s: 71.12 s, its replica stopped with
    # half the time unused). One replica too: its search keeps time for the ILP and the check that
    # these often leave (gpt-13b on 32 A100-40GB, 96K GitHub, ZeRO-1, 8 x 4, at 1 s: 96.89 s in
    # 0.64 s, 86.19 s planned again). Not started in less time than its pipelines took to build;
    # as a plan stands, nothing is built past its share (``stands``: a probe builds its first
    # candidate whatever its deadline, 0.23 s on a 0.22 s share)
    shared = True
    while plans:
        slow = max(plans, key=lambda r: _makespan(plans[r]))
        now = time.perf_counter()
        until = min(first_end, start + opts.time_limit - _check_s(itertools.chain(*plans.values()), pc))
        if until - now <= sum(b.build_s for b in plans[slow]):
            break
        close = sum(1 for r in plans if _makespan(plans[r]) >= (1 - REPLICA_TIE) * _makespan(plans[slow])) \
            if shared else 1
        share = (until - now) / close
        try:
            again = _plan_replica(parts[slow], lengths, pc, opts, now, share, builds, stands=now + share)
        except OutOfTimeError:
            break  # (nothing fitted in its share: the plan made stands)
        if _makespan(again) >= _makespan(plans[slow]) - 1e-9:
            if close == 1:
                break
            shared = False
            continue
        plans[slow], shared = again, True
    if pc.replicas > 1:
        check_s = _check_s(itertools.chain(*plans.values()), pc)
        _rebalance(parts, plans, lengths, pc, opts, start + opts.time_limit - check_s)
    pipes, final = [], []
    for r in sorted(plans):
        pipes += [b.to_pipeline(pc, r) for b in plans[r]]
        final += plans[r]
    rec_note = "; ".join(sorted({b.status for b in final}))
    n = sum(b.table.n for b in final)
    reps = f" over {pc.replicas} replicas" if pc.replicas > 1 else ""
    notes: dict[str, list[int]] = {}  # (pipelines chunked alike named once: 128 replicas made 3,700 lines of `plan`)
    for i, b in enumerate(final):
        notes.setdefault(_chunking_note(b), []).append(i)
    chunkings = next(iter(notes)) if len(notes) == 1 else "; ".join(f"{numbered('pipeline', idx)}: {note}"
                                                                    for note, idx in notes.items())
    status = (f"{plural(len(final), 'pipeline')} x {plural(pc.pp, 'stage')} "
              f"x SP {pc.sp}{reps}; {chunkings}; {plural(n, 'chunk')}; "
              f"{rec_note}")
    dropped = np.setdiff1d(np.arange(len(lengths)), ids)
    return finish_plan("elastic_pp", pipes, lengths, cost, pc, opts, start, status, dropped)


__all__ = ["CHECK_CHUNK_STAGE_S", "CHECK_PIECE_S", "CHECK_PIPELINE_S", "REBALANCE_AFTER", "REPLAY_BELOW",
           "REPLICA_FIRST_PASS", "REPLICA_TIE", "plan_elastic_pp"]
