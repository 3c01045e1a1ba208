"""The ``auto`` planner: per step, FlexSP (pp = 1) or elastic pipelines on the layout that runs the
batch fastest, every candidate timed by the same simulator (DESIGN.md "Unify")."""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.cost.pipeline import PipelineCost
from megatron_ext.errors import ConfigError, InfeasibleError, MegatronExtError, OutOfTimeError
from megatron_ext.plan.schema import StepPlan
from megatron_ext.planner.options import PlannerOptions
from megatron_ext.planner.pp.chunk_search import BuildCache, chunk_stage_s
from megatron_ext.planner.pp.elastic_pp import plan_elastic_pp
from megatron_ext.planner.pp.grouping import pipeline_estimates, split_replicas
from megatron_ext.planner.pp.pipeline import PipelineOptions, kept_sequences, pipeline_cost, pipeline_options
from megatron_ext.planner.pp.sequence_limits import fit_cap, longest_sequence
from megatron_ext.planner.sp.baselines import batchada
from megatron_ext.planner.sp.flexsp import plan_flexsp
from megatron_ext.planner.sp.step import plan_sp
from megatron_ext.planner.sp.timelines import plan_timelines

AUTO_FLEXSP_SHARE = 0.45  # of the time limit, kept for FlexSP (planned after the layouts, in all the time left)
# A layout is skipped if this x its estimate is no faster than a known step: planned layouts came
# out at 0.97-1.41x their estimate (llama-13b on 32 A800s, ZeRO 1 and 3, 512 sequences of up to 48K / 96K)
AUTO_PRUNE_MARGIN = 0.95
AUTO_FLEXSP_FLOOR = 0.15  # FlexSP's share instead where its likely step loses to the likeliest layout's order key
# FlexSP's likely step, for its share: its lower bound plus this share of the way to BatchAda's plan
# (FlexSP's plans over the map's 180 cells came 0.04-1.00 of the way, 0.13 or more in the 42 it won;
# with 0.1 none of those lost its share, and 10 cells more that a layout won gave their layouts the time)
AUTO_FLEXSP_GAP = 0.1
AUTO_RESERVE = 0.03  # of the time limit, left for the last planner's plan check and the choice
AUTO_FLEXSP_MIN_X = 2.0  # FlexSP's time is at least this x what BatchAda's plan took (``plan_auto``)
AUTO_TIMELINES_SHARE = 0.2  # of the time limit, at most, for timelines (ZeRO 0/1/2; it takes far less)
AUTO_TIE = 0.05  # a layout followed by one whose order key is this close shares the time left with it
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


def plan_units(plan: StepPlan) -> dict[str, int]:
    """How much a plan runs, for its entry among another plan's baselines: ``num_micro_batches``
    (FlexSP kind) or ``num_chunks`` (pipelines; a Seq1F1B slice is a chunk)."""
    if plan.kind == "flexsp":
        return {"num_micro_batches": len(plan.micro_batches)}
    return {"num_chunks": sum(len(p.chunks) for p in plan.pipelines)}


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


def flexsp_bound_s(lengths: np.ndarray, cost: CostModel, lower_ms: float | None = None) -> float:
    """Seconds no FlexSP-kind plan (FlexSP; under ZeRO 0/1/2 also timelines, without barriers)
    beats: the lesser of their bounds, with the exposed sync (``validate.fill_estimates``); inf
    where no group holds the longest sequence or the model states leave no room. ``lower_ms``:
    ``cost.lower_bound_ms(lengths)`` where already known (25 ms at 32,768 sequences)."""
    try:
        ms = (cost.lower_bound_ms(lengths) if lower_ms is None else lower_ms) + cost.step_sync_ms
        if cost.zero_stage < 3:
            ms = min(ms, cost.barrier_free_bound_ms(lengths))
    except MegatronExtError:
        return math.inf
    return ms / 1e3


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
    slices = sum(-(-int(s) // fit_cap(int(s), pc, granularity)) * int(c) for s, c in zip(over, count))
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


def plan_auto(lengths, cost: CostModel, pp: int | None = None, sp: int | None = None,
              options: PipelineOptions | None = None, *, seq_ids=None, **overrides) -> StepPlan:
    """Unify FlexSP and elastic pipelines (DESIGN.md "Unify"): plan the step with FlexSP (adaptive
    SP on all GPUs, one stage; under ZeRO 0/1/2 also without barriers, ``timelines``, planned
    first) and with elastic_pp on every feasible (pp, sp) layout (one-stage
    replicas of a fixed degree included), simulate each with the same simulator and return the
    fastest plan (kind ``flexsp`` or ``elastic_pp``). ``pp`` / ``sp`` (or the options') pin the
    pipeline layouts (a pinned pp: its layouts of every SP degree; a pinned sp: the layouts of
    that degree); FlexSP, which chooses its own degrees on one stage, stays a candidate unless the
    options' ``flexsp`` is False (a run whose model is cut into stages cannot run it).

    ``solver_status`` names the choice; ``baselines`` holds every alternative's simulated time
    (``"flexsp"``, ``"elastic_pp pp4 x sp8"``, ``"elastic_pp pp2 x sp8 x dp2"`` with replicas,
    ...); ``lower_bound_step_time_s`` is the least of the candidates' lower bounds (FlexSP's,
    ``flexsp_bound_s``, and every layout's that holds the longest sequence): no plan auto could
    choose is faster. Time: the layouts go first, most promising first (``layout_order_key``: the estimate,
    plus the last stage's output layer, raised where the longest sequence presses on memory and
    for deep pipelines), in at most 1 - ``AUTO_FLEXSP_SHARE`` of the limit (each may use all of
    it that is left, half when the next is tied with it). A layout whose estimate
    (``layout_estimate``), less 5%, is no faster than BatchAda's step (an upper bound of FlexSP's)
    or the best step so far is skipped (reported
    with its estimate; before estimating, with its lower bound, ``PipelineCost.lower_bound_ms``, if
    that is no faster), and so is
    one left when their time has run out (less of it than 0.05 s, the least a layout planned ran
    past its limit, a quarter of the least one took, or its chunks x stages' build time,
    ``chunk_stage_s``), or, once a plan stands, whose replicas cannot all be planned in its
    limit (``plan_elastic_pp``'s ``keep_to_limit``); one that cannot build a candidate in the whole
    limit is not started while FlexSP or another layout can run. FlexSP goes last, in all the time
    left but ``AUTO_RESERVE`` of the limit (for its plan's check; without FlexSP the layouts leave
    it, for the last one's), unless its lower bound (``CostModel.lower_bound_ms``) is no faster
    than a layout's plan (in time FlexSP leaves, or with no FlexSP to plan, the fastest layout is
    planned again, from the candidates it built: ``plan_elastic_pp``'s ``builds``); where its likely step
    (that bound plus ``AUTO_FLEXSP_GAP`` of the way to BatchAda's) is no faster than the likeliest
    layout's order key, FlexSP's share is ``AUTO_FLEXSP_FLOOR`` (the layouts get the rest), until
    that bound beats every plan so far by ``AUTO_PRUNE_MARGIN``; where no layout's lower bound
    beats that likely step, the layouts' share is ``AUTO_FLEXSP_FLOOR``. A layout's chunks are at
    least the slices memory forces on its sequences (``forced_slices``)."""
    start = time.perf_counter()
    opts = pipeline_options(options, overrides)
    lengths, ids = kept_sequences(lengths, seq_ids)
    kept = lengths[ids]  # (the sequences planned: every bound and estimate is of these)
    budget = opts.time_limit
    alts: dict[str, dict] = {}
    plans: list[tuple[float, str, StepPlan]] = []

    def record(name: str, plan: StepPlan, t0: float) -> None:
        alts[name] = {"estimated_step_time_s": plan.estimated_step_time_s, "solve_time_s": time.perf_counter() - t0,
                      **plan_units(plan), "status": plan.solver_status}
        plans.append((plan.estimated_step_time_s, name, plan))

    pin_pp = pp if pp is not None else opts.pp
    pin_sp = sp if sp is not None else opts.sp
    if pin_sp is not None:  # (FlexSP alone would otherwise run and say nothing of it)
        cost.check_degree(pin_sp)
    with_flexsp = opts.flexsp  # (FlexSP chooses its own degrees on one stage: pp / sp pin the pipelines)
    runnable: list[PipelineCost] = []
    longest = int(kept.max())
    for P, d in pipeline_layouts(cost, pin_pp, pin_sp, opts.memory_mb):
        pc = PipelineCost(cost, P, d, opts.b1_scale, opts.memory_mb)
        limit = longest_sequence(pc, opts.granularity, opts.recompute)
        if longest > limit:  # (cheap to know; planning it would only fail)
            alts[layout_name(pc)] = {"skipped": f"a stage holds sequences of up to {limit:,} tokens, this batch's "
                                                f"longest has {longest:,}"}
            continue
        runnable.append(pc)
    if not runnable and not alts and (pin_pp is not None or pin_sp is not None):
        pipeline_cost(cost, pin_pp, pin_sp, opts)  # raises why the pinned layout cannot run
        raise ConfigError(f"auto: no pipeline layout of {cost.model.name} on {cost.cluster.name} matches "
                          f"pp {pin_pp}" + (f" x sp {pin_sp}" if pin_sp is not None else ""))
    if not runnable and not with_flexsp:  # the pinned layouts cannot hold the batch
        raise InfeasibleError("auto: " + "; ".join(f"{k}: {v['skipped']}" for k, v in alts.items()))
    # BatchAda (one homogeneous degree, milliseconds to plan) bounds FlexSP's step from above: FlexSP
    # keeps the best homogeneous packing among its candidates. The layouts go first, pruned against
    # that bound and the best layout planned so far, in at most 1 - AUTO_FLEXSP_SHARE of the limit;
    # FlexSP then gets all the time left, so its MILP never has less than its share (most steps, far
    # more: the layouts are usually pruned).
    ub, ub_s = math.inf, 0.0
    flex_cost = cost if opts.memory_mb is None else cost.with_memory(opts.memory_mb)  # one budget for all
    if with_flexsp:
        try:
            t0 = time.perf_counter()
            ub = plan_sp("batchada", batchada, lengths, flex_cost, PlannerOptions(), seq_ids=ids).estimated_step_time_s
            ub_s = time.perf_counter() - t0
        except MegatronExtError:
            pass
    # (no BatchAda plan: no FlexSP plan either, so its share goes to the layouts)
    # FlexSP's lower bound (the micro-batches memory forces, each paying its fixed cost, and the
    # longest sequence at its fastest degree): FlexSP is not planned at all once a layout's plan
    # beats it. Where its likely step (the bound plus AUTO_FLEXSP_GAP of the way to BatchAda's) is
    # no faster than the likeliest layout's order key, FlexSP keeps only AUTO_FLEXSP_FLOOR of the
    # limit (all that is left if no layout beats its bound). (The key, not the estimate, as
    # layouts plan above their estimates; the likely step, not the bound: gpt-13b on 128
    # A100-40GB, ZeRO-3, 192K: bound 40.8 s, key of 8 x 8 x 2 41.3 s, which planned 41.2 s in
    # what FlexSP's share left it, 39.7 s in the whole second; FlexSP 44.0 s)
    flex_lb_ms = None  # (no BatchAda plan: FlexSP runs, to say why it cannot)
    if with_flexsp and math.isfinite(ub):
        flex_lb_ms = flex_cost.lower_bound_ms(kept)
    flex_lb = 0.0 if flex_lb_ms is None else flex_lb_ms / 1e3
    if with_flexsp and flex_cost.zero_stage < 3:
        # FlexSP without barriers: milliseconds to plan, and as a known step it prunes the layouts
        # (and FlexSP, whose barrier-bound lower bound it often beats)
        t0 = time.perf_counter()
        try:
            record("timelines", plan_sp("timelines", plan_timelines, lengths, flex_cost,
                                        PlannerOptions(time_limit=budget * AUTO_TIMELINES_SHARE), seq_ids=ids,
                                        barrier_free=True), t0)
        except MegatronExtError as e:
            alts["timelines"] = {"error": str(e)}
    # the layouts' estimates, but for those whose lower bound (far cheaper to know) is no faster
    # than a known step: no plan of theirs could be
    layouts = []
    layout_lows = []  # (every runnable layout's lower bound)
    for pc in runnable:
        known, against = min([(ub, "BatchAda (FlexSP's upper bound)")] + [(t, n) for t, n, _ in plans])
        lower_ms = pc.lower_bound_ms(kept)
        lower = lower_ms / 1e3
        layout_lows.append(lower)
        if lower >= known:
            alts[layout_name(pc)] = {"skipped": f"its lower bound {lower:.2f} s is no faster than {against} "
                                                f"({known:.2f} s)", "estimated_lower_s": lower}
            continue
        est, chunks = layout_estimate(kept, pc, opts.min_slice_tokens, lower_ms)
        chunks = max(chunks * pc.replicas, forced_slices(kept, pc, opts.granularity))
        layouts.append((layout_order_key(kept, pc, est), est, layout_name(pc), pc.pp, pc.sp, chunks * pc.pp,
                        chunks * pc.pp * chunk_stage_s(chunks / pc.replicas)))
    # a layout whose one candidate takes longer to build than the whole limit is not started while
    # anything else can run (FlexSP or a quicker layout): it would overrun the limit, and its
    # estimate, which such deep layouts undercut, would lead the order. (Priced per replica's
    # pipeline, chunk_stage_s: at CHUNK_STAGE_S a winner was never started, gpt-7b on 4,096
    # A100-40GB, ZeRO-1, 32,768 CommonCrawl sequences: 4 x 8 x 128, 1.8 s so priced, plans 5.21 s
    # in 0.88 s, against 6.55 s by 2 x 8 x 256)
    quick = [x for x in layouts if x[6] <= budget]
    # (else a slow layout is all that can run; FlexSP can where BatchAda could: asking the cost model
    # how long a sequence FlexSP holds raised where its model states do not fit, ZeRO-1 on 40 GB)
    if quick or math.isfinite(ub):
        for x in layouts:
            if x[6] > budget:
                alts[x[2]] = {"skipped": f"about {x[6]:.1f} s to build one candidate "
                                         f"({x[5]:,} chunks x stages), over the {budget:g} s limit"}
        layouts = quick
    layouts.sort(key=lambda x: (x[0], x[2]))  # (order key, name)
    flex_likely = flex_lb + AUTO_FLEXSP_GAP * (ub - flex_lb) if math.isfinite(ub) else flex_lb
    share = AUTO_FLEXSP_SHARE if not layouts or flex_likely < layouts[0][0] else AUTO_FLEXSP_FLOOR
    if layouts and math.isfinite(ub) and flex_likely <= min(layout_lows):
        # no layout's lower bound beats FlexSP's likely step: the layouts keep AUTO_FLEXSP_FLOOR
        # of the limit, FlexSP the rest (gpt-30b on 128 A100-40GB, 96K GitHub, ZeRO-3: likely
        # 52.2 s, the layouts' bounds 53.7 s and over; FlexSP 55.4 s in its share, 54.0 s in the
        # rest; by their estimates instead, six cells that layouts won lost up to 8%)
        share = 1 - AUTO_FLEXSP_FLOOR

    def layouts_end_at(share: float) -> float:
        # FlexSP's share, or at least AUTO_FLEXSP_MIN_X x what BatchAda took: FlexSP packs, times and
        # checks its plan as BatchAda does, then solves (32,768 sequences on 4,096 GPUs: BatchAda
        # 0.11 s, FlexSP 0.2 s at a 0.13 s limit); without FlexSP, all of it
        if not math.isfinite(ub):
            return start + budget
        return start + min(budget * (1 - share), budget * (1 - AUTO_RESERVE) - AUTO_FLEXSP_MIN_X * ub_s)

    layouts_end = layouts_end_at(share)
    # without FlexSP after them, the last layout's check and the choice take the reserve: kept from
    # what a layout may plan in, not from the time the ties and skips weigh
    tail = 0.0 if math.isfinite(ub) else budget * AUTO_RESERVE
    took: list[float] = []  # seconds each layout planned took
    overran: list[float] = []  # ... and ran past its limit
    fastest = None  # (name, pp, sp, candidates built, seconds taken) of the fastest layout planned
    for i, (_, est, name, P, d, _, build_s) in enumerate(layouts):
        bound, against = min([(ub, "BatchAda (FlexSP's upper bound)")] + [(t, n) for t, n, _ in plans])
        if share < AUTO_FLEXSP_SHARE and math.isfinite(ub) and i and flex_lb < AUTO_PRUNE_MARGIN * bound:
            # the layouts' estimates promised more than their plans keep: FlexSP, whose lower
            # bound beats every plan now (by the margin a layout's estimate must), gets its whole
            # share back
            share = AUTO_FLEXSP_SHARE
            layouts_end = layouts_end_at(share)
        left = layouts_end - time.perf_counter()
        if AUTO_PRUNE_MARGIN * est >= bound:
            alts[name] = {"skipped": f"estimated {est:.2f} s (one 1F1B pipeline of equal chunks), "
                                     f"{AUTO_PRUNE_MARGIN:.0%} of it no faster than {against} ({bound:.2f} s)",
                          "estimated_lower_s": AUTO_PRUNE_MARGIN * est}
            continue
        # a layout's search stops at its limit, but checking and simulating what it found does not
        # (about as long as the least any layout planned ran past its limit), and its first
        # candidate, however long, is always built: at least its chunks x stages x
        # chunk_stage_s, and often far more (the search's finest slicings may have 10x the
        # estimate's chunks): a quarter of what the quickest layout took is the floor (half of it
        # skipped, by a few ms, layouts that won: 9 map cells over 2% behind against 7), and so is
        # 0.05 s, the least time a layout is given
        if plans and left - tail <= max(0.05, min(overran, default=0.0), min(took, default=0.0) / 4,
                                build_s):
            alts[name] = {"skipped": f"time limit reached (estimated {est:.2f} s)"}
            continue
        # all the layouts' time left (the likeliest go first, and a search that ends early leaves the
        # rest), or half of it when the next contender is tied with this one: the estimate cannot
        # tell them apart, so neither may take all the time (unless that one could not build a
        # candidate in the other half)
        rival = next((x for x in layouts[i + 1:] if AUTO_PRUNE_MARGIN * x[1] < bound
                      and x[6] < left / 2), None)
        tied = rival is not None and max(rival[0], layouts[i][0]) <= (1 + AUTO_TIE) * min(rival[0], layouts[i][0])
        limit = max(0.05, min(left / 2 if tied else left, left - tail))
        t0 = time.perf_counter()
        builds = BuildCache()
        try:
            sub = plan_elastic_pp(lengths, cost, P, d, dataclasses.replace(opts, time_limit=limit), seq_ids=ids,
                                  keep_to_limit=bool(plans), builds=builds)
            record(name, sub, t0)
            if sub.estimated_step_time_s <= min(t for t, _, _ in plans):
                fastest = (name, P, d, builds, time.perf_counter() - t0)
        except OutOfTimeError as e:
            alts[name] = {"skipped": f"time limit reached ({e})"}
        except MegatronExtError as e:
            alts[name] = {"error": str(e)}
        took.append(time.perf_counter() - t0)
        overran.append(max(0.0, took[-1] - limit))
    best = min((t for t, _, _ in plans), default=math.inf)
    if with_flexsp and flex_lb >= best:
        alts["flexsp"] = {"skipped": f"its lower bound {flex_lb:.2f} s is no faster than the best layout "
                                     f"({best:.2f} s)",
                          "estimated_lower_s": flex_lb}
    elif with_flexsp:
        t0 = time.perf_counter()
        try:
            left = budget * (1 - AUTO_RESERVE) - (t0 - start)
            flexsp = plan_sp("flexsp", plan_flexsp, lengths, flex_cost, PlannerOptions(time_limit=max(0.05, left)),
                             seq_ids=ids)
            record("flexsp", flexsp, t0)
        except MegatronExtError as e:
            alts["flexsp"] = {"error": str(e)}
    # time left (no FlexSP to plan, or FlexSP solved before its limit): the fastest layout is planned
    # again, resuming from the candidates it built, where that time is at least half what it took
    # (its searches pass the candidates built again first). It had planned in less than the whole
    # second: beside a tied layout its plan then pruned (gpt-13b on 128 A100-40GB, 192K, ZeRO-1:
    # 8 x 8 x 2 36.59 s in 0.5 s, 36.35 s resumed, as in the whole second alone), or in the layouts'
    # floor share (gpt-30b on 256 A800s, 192K CommonCrawl, ZeRO-3: FlexSP solved in 0.16 s, 44.87 s;
    # 4 x 8 x 8 44.88 s in that share, 41.14 s resumed)
    left = start + budget * (1 - AUTO_RESERVE) - time.perf_counter()
    if fastest is not None and left >= max(0.05, fastest[4] / 2):
        name, P, d, builds, _ = fastest
        t0 = time.perf_counter()
        try:
            sub = plan_elastic_pp(lengths, cost, P, d, dataclasses.replace(opts, time_limit=left), seq_ids=ids,
                                  keep_to_limit=True, builds=builds)
            if sub.estimated_step_time_s < alts[name]["estimated_step_time_s"]:
                first = alts[name]["solve_time_s"]
                plans[:] = [x for x in plans if x[1] != name]
                record(name, sub, t0)
                alts[name]["solve_time_s"] += first
        except MegatronExtError:
            pass  # (the plan made stands)
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
    plan.lower_bound_step_time_s = min(layout_lows + ([flexsp_bound_s(kept, flex_cost, flex_lb_ms)]
                                                      if with_flexsp else []), default=plan.lower_bound_step_time_s)
    plan.planner = "auto"
    plan.solve_time_s = time.perf_counter() - start
    return plan


__all__ = ["AUTO_DEPTH_PENALTY", "AUTO_FLEXSP_FLOOR", "AUTO_FLEXSP_GAP", "AUTO_FLEXSP_MIN_X",
           "AUTO_FLEXSP_SHARE", "AUTO_PRESSURE_FROM", "AUTO_PRESSURE_PENALTY", "AUTO_PRESSURE_SPAN",
           "AUTO_PRUNE_MARGIN", "AUTO_RESERVE", "AUTO_TIE", "AUTO_TIMELINES_SHARE", "flexsp_bound_s", "forced_slices",
           "head_excess_s",
           "layout_estimate", "layout_name", "layout_order_key", "layout_pressure",
           "pipeline_layouts", "plan_auto", "plan_units"]
