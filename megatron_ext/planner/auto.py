"""The ``auto`` planner: per step, FlexSP (pp = 1) or elastic pipelines on the layout that runs the
batch fastest, every candidate timed by the same simulator (DESIGN.md "Unify").

``plan_auto`` goes in steps, each a function below, all in one time limit:

1. the layouts that hold the batch's longest sequence (``_runnable``);
2. FlexSP's side, cheap: BatchAda's plan (an upper bound of FlexSP's step), FlexSP's lower bound,
   and under ZeRO 0/1/2 FlexSP without barriers (``timelines``, milliseconds: a known step);
3. the layouts worth planning, likeliest first (``_layouts_to_try``: pruned by their lower bounds,
   estimated, the unbuildable set aside);
4. the layouts planned in their share of the limit (``_plan_layouts``);
5. FlexSP in the time left (``_plan_flexsp``), unless its lower bound loses to a layout's plan;
6. in any time still left, the fastest layout planned again from the candidates it built
   (``_plan_fastest_again``);
7. the fastest plan, with every alternative among its baselines (``_Run.chosen``).
"""
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
from megatron_ext.planner.pp.chunk_search import BuildCache
from megatron_ext.planner.pp.elastic_pp import plan_elastic_pp
from megatron_ext.planner.pp.layouts import Layout, estimated_layout, layout_name, pipeline_layouts
from megatron_ext.planner.pp.pipeline import PipelineOptions, kept_sequences, pipeline_cost, pipeline_options
from megatron_ext.planner.pp.sequence_limits import longest_sequence
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
AUTO_FLEXSP_MIN_X = 2.0  # FlexSP's time is at least this x what BatchAda's plan took (``_plan_layouts``)
AUTO_TIMELINES_SHARE = 0.2  # of the time limit, at most, for timelines (ZeRO 0/1/2; it takes far less)
AUTO_TIE = 0.05  # a layout followed by one whose order key is this close shares the time left with it
# A layout whose lower bound is over this x the least order key is not estimated: layouts planned at
# up to 1.41x their estimate, and auto's choice over the map's cells had its bound within 1.0x that key
# (gpt-7b on 4,096 A100-40GB, ZeRO-1: 18 of 32 layouts' estimates not made, 0.2 s)
AUTO_BOUND_CUT = 1.5
BATCHADA = "BatchAda (FlexSP's upper bound)"


def plan_units(plan: StepPlan) -> dict[str, int]:
    """How much a plan runs, for its entry among another plan's baselines: ``num_micro_batches``
    (FlexSP kind) or ``num_chunks`` (pipelines; a Seq1F1B slice is a chunk)."""
    if plan.kind == "flexsp":
        return {"num_micro_batches": len(plan.micro_batches)}
    return {"num_chunks": sum(len(p.chunks) for p in plan.pipelines)}


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


class _Run:
    """One ``plan_auto`` call: its batch, options and limit, the plans made and the alternatives
    its plan reports (each planned one's step, or why it was skipped)."""

    def __init__(self, lengths: np.ndarray, ids: np.ndarray, cost: CostModel, opts: PipelineOptions, start: float):
        self.lengths, self.ids, self.cost, self.opts, self.start = lengths, ids, cost, opts, start
        self.kept = lengths[ids]  # (the sequences planned: every bound and estimate is of these)
        self.budget = opts.time_limit
        self.flex_cost = cost if opts.memory_mb is None else cost.with_memory(opts.memory_mb)  # one budget for all
        self.alts: dict[str, dict] = {}
        self.plans: list[tuple[float, str, StepPlan]] = []

    def record(self, name: str, plan: StepPlan, t0: float) -> None:
        self.alts[name] = {"estimated_step_time_s": plan.estimated_step_time_s,
                           "solve_time_s": time.perf_counter() - t0, **plan_units(plan), "status": plan.solver_status}
        self.plans.append((plan.estimated_step_time_s, name, plan))

    def known(self, ub: float) -> tuple[float, str]:
        """The fastest step known (BatchAda's, ``ub``, or a plan's) and whose it is."""
        return min([(ub, BATCHADA)] + [(t, n) for t, n, _ in self.plans])

    def best(self) -> float:
        return min((t for t, _, _ in self.plans), default=math.inf)

    def plan_layout(self, layout: Layout, limit: float, builds: BuildCache) -> StepPlan:
        return plan_elastic_pp(self.lengths, self.cost, layout.pp, layout.sp,
                               dataclasses.replace(self.opts, time_limit=limit), seq_ids=self.ids,
                               keep_to_limit=bool(self.plans), builds=builds)

    def chosen(self, bounds: list[float]) -> StepPlan:
        """The fastest plan, its status naming the choice and the others' steps, every alternative
        among its baselines, its lower bound the least of the candidates' ``bounds``."""
        if not self.plans:
            raise InfeasibleError("auto: no layout can run this batch: " + "; ".join(
                f"{k}: {v.get('error', v.get('skipped'))}" for k, v in self.alts.items()))
        self.plans.sort(key=lambda x: (x[0], x[1]))
        step, chosen, plan = self.plans[0]
        for alt in self.alts.values():
            if "estimated_step_time_s" in alt:
                alt["speedup"] = alt["estimated_step_time_s"] / step
        others = ", ".join(f"{k} {v['estimated_step_time_s']:.2f} s" for k, v in self.alts.items()
                           if k != chosen and "estimated_step_time_s" in v)
        plan.solver_status = f"auto chose {chosen} ({step:.2f} s" + (f"; vs {others}" if others else "") + \
                             f"); {plan.solver_status}"
        plan.baselines = {k: v for k, v in self.alts.items() if k != chosen}
        plan.lower_bound_step_time_s = min(bounds, default=plan.lower_bound_step_time_s)
        plan.planner = "auto"
        plan.solve_time_s = time.perf_counter() - self.start
        return plan


def plan_auto(lengths, cost: CostModel, pp: int | None = None, sp: int | None = None,
              options: PipelineOptions | None = None, *, seq_ids=None, **overrides) -> StepPlan:
    """Unify FlexSP and elastic pipelines (DESIGN.md "Unify"): plan the step with FlexSP (adaptive
    SP on all GPUs, one stage; under ZeRO 0/1/2 also without barriers, ``timelines``, planned
    first) and with elastic_pp on every feasible (pp, sp) layout (one-stage replicas of a fixed
    degree included), simulate each with the same simulator and return the fastest plan (kind
    ``flexsp`` or ``elastic_pp``), in the steps the module doc lists. ``pp`` / ``sp`` (or the
    options') pin the pipeline layouts (a pinned pp: its layouts of every SP degree; a pinned sp:
    the layouts of that degree); FlexSP, which chooses its own degrees on one stage, stays a
    candidate unless the options' ``flexsp`` is False (a run whose model is cut into stages cannot
    run it).

    ``solver_status`` names the choice; ``baselines`` holds every alternative's simulated time
    (``"flexsp"``, ``"elastic_pp pp4 x sp8"``, ``"elastic_pp pp2 x sp8 x dp2"`` with replicas,
    ...) or why it was skipped; ``lower_bound_step_time_s`` is the least of the candidates' lower
    bounds (FlexSP's, ``flexsp_bound_s``, and every layout's that holds the longest sequence): no
    plan auto could choose is faster."""
    start = time.perf_counter()
    opts = pipeline_options(options, overrides)
    lengths, ids = kept_sequences(lengths, seq_ids)
    run = _Run(lengths, ids, cost, opts, start)
    pin_pp = pp if pp is not None else opts.pp
    pin_sp = sp if sp is not None else opts.sp
    runnable = _runnable(run, pin_pp, pin_sp)
    ub, ub_s, flex_lb_ms = _flexsp_first(run) if opts.flexsp else (math.inf, 0.0, None)
    flex_lb = 0.0 if flex_lb_ms is None else flex_lb_ms / 1e3
    layouts, lows = _layouts_to_try(run, runnable, ub)
    fastest = _plan_layouts(run, layouts, lows, ub, ub_s, flex_lb)
    if opts.flexsp:
        _plan_flexsp(run, flex_lb)
    if fastest is not None:
        _plan_fastest_again(run, *fastest)
    return run.chosen(lows + ([flexsp_bound_s(run.kept, run.flex_cost, flex_lb_ms)] if opts.flexsp else []))


def _runnable(run: _Run, pin_pp: int | None, pin_sp: int | None) -> list[PipelineCost]:
    """The layouts (of ``pin_pp`` stages, of SP degree ``pin_sp``, where given) whose stages hold the
    batch's longest sequence; the others are skipped, cheaply (planning them would only fail).
    Raises where a pinned layout cannot exist, or none holds the batch and FlexSP is not a candidate."""
    cost, opts = run.cost, run.opts
    if pin_sp is not None:  # (FlexSP alone would otherwise run and say nothing of it)
        cost.check_degree(pin_sp)
    runnable: list[PipelineCost] = []
    longest = int(run.kept.max())
    for P, d in pipeline_layouts(cost, pin_pp, pin_sp, opts.memory_mb):
        pc = PipelineCost(cost, P, d, opts.b1_scale, opts.memory_mb)
        limit = longest_sequence(pc, opts.granularity, opts.recompute)
        if longest > limit:
            run.alts[layout_name(pc)] = {"skipped": f"a stage holds sequences of up to {limit:,} tokens, this "
                                                    f"batch's longest has {longest:,}"}
            continue
        runnable.append(pc)
    if not runnable and not run.alts and (pin_pp is not None or pin_sp is not None):
        pipeline_cost(cost, pin_pp, pin_sp, opts)  # raises why the pinned layout cannot run
        raise ConfigError(f"auto: no pipeline layout of {cost.model.name} on {cost.cluster.name} matches "
                          f"pp {pin_pp}" + (f" x sp {pin_sp}" if pin_sp is not None else ""))
    if not runnable and not opts.flexsp:  # the pinned layouts cannot hold the batch
        raise InfeasibleError("auto: " + "; ".join(f"{k}: {v['skipped']}" for k, v in run.alts.items()))
    return runnable


def _flexsp_first(run: _Run) -> tuple[float, float, float | None]:
    """What FlexSP's side costs little to know: BatchAda's step (one homogeneous degree,
    milliseconds to plan: FlexSP keeps the best homogeneous packing among its candidates, so its
    step is no slower) and the seconds it took, FlexSP's lower bound (ms; None without a BatchAda
    plan, as then no FlexSP plan exists either: FlexSP runs last, to say why), and under ZeRO
    0/1/2 timelines' plan (FlexSP without barriers: milliseconds to plan, and as a known step it
    prunes the layouts, and FlexSP, whose barrier-bound lower bound it often beats)."""
    ub, ub_s, lower_ms = math.inf, 0.0, None
    try:
        t0 = time.perf_counter()
        ub = plan_sp("batchada", batchada, run.lengths, run.flex_cost, PlannerOptions(),
                     seq_ids=run.ids).estimated_step_time_s
        ub_s = time.perf_counter() - t0
    except MegatronExtError:
        pass
    if math.isfinite(ub):
        lower_ms = run.flex_cost.lower_bound_ms(run.kept)
    if run.flex_cost.zero_stage < 3:
        t0 = time.perf_counter()
        try:
            run.record("timelines", plan_sp("timelines", plan_timelines, run.lengths, run.flex_cost,
                                            PlannerOptions(time_limit=run.budget * AUTO_TIMELINES_SHARE),
                                            seq_ids=run.ids, barrier_free=True), t0)
        except MegatronExtError as e:
            run.alts["timelines"] = {"error": str(e)}
    return ub, ub_s, lower_ms


def _layouts_to_try(run: _Run, runnable: list[PipelineCost], ub: float) -> tuple[list[Layout], list[float]]:
    """The layouts worth planning, in the order they are tried (``Layout.key``, then name), and
    every runnable layout's lower bound (s). A layout whose lower bound (far cheaper to know than
    its estimate) is no faster than a known step is skipped: no plan of its could be; so is one
    whose bound is over ``AUTO_BOUND_CUT`` x the least order key, unestimated. One whose
    candidate takes longer to build than the whole limit (``Layout.build_s``) is set aside while
    anything else can run (FlexSP, where BatchAda planned, or a quicker layout): it would overrun
    the limit, and its estimate, which such deep layouts undercut, would lead the order. (Priced as
    one pipeline of all its chunks, not per replica's, a winner was never started: gpt-7b on
    4,096 A100-40GB, ZeRO-1, 32,768 CommonCrawl sequences: 4 x 8 x 128 priced at 1.8 s plans
    5.21 s in 0.88 s, against 6.55 s by 2 x 8 x 256.)"""
    layouts: list[Layout] = []
    lows = [pc.lower_bound_ms(run.kept) / 1e3 for pc in runnable]
    known, against = run.known(ub)
    # by their bounds: no layout's order key is below its bound, so once one is cut, the rest could
    # not have lowered the least key (``likeliest``) either
    likeliest = math.inf
    for low, pc in sorted(zip(lows, runnable), key=lambda x: x[0]):
        if low >= known:
            run.alts[layout_name(pc)] = {"skipped": f"its lower bound {low:.2f} s is no faster than {against} "
                                                    f"({known:.2f} s)", "estimated_lower_s": low}
        elif low > AUTO_BOUND_CUT * likeliest:
            run.alts[layout_name(pc)] = {"skipped": f"its lower bound {low:.2f} s is over {AUTO_BOUND_CUT:g}x the "
                                                    f"likeliest layout's order key ({likeliest:.2f} s)"}
        else:
            layouts.append(estimated_layout(run.kept, pc, run.opts, low * 1e3))
            likeliest = min(likeliest, layouts[-1].key)
    quick = [x for x in layouts if x.build_s <= run.budget]
    # (else a slow layout is all that can run; FlexSP can where BatchAda could: asking the cost model
    # how long a sequence FlexSP holds raised where its model states do not fit, ZeRO-1 on 40 GB)
    if quick or math.isfinite(ub):
        for x in layouts:
            if x.build_s > run.budget:
                run.alts[x.name] = {"skipped": f"about {x.build_s:.1f} s to build one candidate ({x.chunk_stages:,} "
                                               f"chunks x stages), over the {run.budget:g} s limit"}
        layouts = quick
    return sorted(layouts, key=lambda x: (x.key, x.name)), lows


def _plan_layouts(run: _Run, layouts: list[Layout], lows: list[float], ub: float, ub_s: float,
                  flex_lb: float) -> tuple[Layout, BuildCache, float] | None:
    """Plan the layouts, likeliest first, in at most 1 - ``AUTO_FLEXSP_SHARE`` of the limit (all
    of it without FlexSP to plan), each in all of that time left, half when the next is tied with
    it (``AUTO_TIE``). Where FlexSP's likely step (its lower bound plus ``AUTO_FLEXSP_GAP`` of the
    way to BatchAda's) is no faster than the likeliest layout's order key, FlexSP's share is
    ``AUTO_FLEXSP_FLOOR`` (the layouts get the rest), until that bound beats every plan so far by
    ``AUTO_PRUNE_MARGIN``; where no layout's lower bound beats that likely step, the layouts' share
    is ``AUTO_FLEXSP_FLOOR``. A layout whose estimate, less 5%, is no faster than a known step is
    skipped (reported with its estimate), and so is one left when their time has run out, or, once
    a plan stands, whose replicas cannot all be planned in its limit (``plan_elastic_pp``'s
    ``keep_to_limit``). Returns the fastest layout planned, the candidates it built and the
    seconds it took (None: none was)."""
    budget, start = run.budget, run.start
    flex_likely = flex_lb + AUTO_FLEXSP_GAP * (ub - flex_lb) if math.isfinite(ub) else flex_lb
    share = AUTO_FLEXSP_SHARE if not layouts or flex_likely < layouts[0].key else AUTO_FLEXSP_FLOOR
    if layouts and math.isfinite(ub) and flex_likely <= min(lows):
        # no layout's lower bound beats FlexSP's likely step: the layouts keep AUTO_FLEXSP_FLOOR
        # of the limit, FlexSP the rest (gpt-30b on 128 A100-40GB, 96K GitHub, ZeRO-3: likely
        # 52.2 s, the layouts' bounds 53.7 s and over; FlexSP 55.4 s in its share, 54.0 s in the
        # rest; by their estimates instead, six cells that layouts won lost up to 8%). (The key,
        # not the estimate, as layouts plan above their estimates; the likely step, not the bound:
        # gpt-13b on 128 A100-40GB, ZeRO-3, 192K: bound 40.8 s, key of 8 x 8 x 2 41.3 s, which
        # planned 41.2 s in what FlexSP's share left it, 39.7 s in the whole second; FlexSP 44.0 s)
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
    fastest = None
    for i, layout in enumerate(layouts):
        bound, against = run.known(ub)
        if share < AUTO_FLEXSP_SHARE and math.isfinite(ub) and i and flex_lb < AUTO_PRUNE_MARGIN * bound:
            # the layouts' estimates promised more than their plans keep: FlexSP, whose lower
            # bound beats every plan now (by the margin a layout's estimate must), gets its whole
            # share back
            share = AUTO_FLEXSP_SHARE
            layouts_end = layouts_end_at(share)
        left = layouts_end - time.perf_counter()
        if AUTO_PRUNE_MARGIN * layout.estimate_s >= bound:
            run.alts[layout.name] = {"skipped": f"estimated {layout.estimate_s:.2f} s (one 1F1B pipeline of equal "
                                                f"chunks), {AUTO_PRUNE_MARGIN:.0%} of it no faster than {against} "
                                                f"({bound:.2f} s)",
                                     "estimated_lower_s": AUTO_PRUNE_MARGIN * layout.estimate_s}
            continue
        # a layout's search stops at its limit, but checking and simulating what it found does not
        # (about as long as the least any layout planned ran past its limit), and its first
        # candidate, however long, is always built: at least its ``build_s``, and often far more
        # (the search's finest slicings may have 10x the estimate's chunks): a quarter of what the
        # quickest layout took is the floor (half of it skipped, by a few ms, layouts that won: 9
        # map cells over 2% behind against 7), and so is 0.05 s, the least time a layout is given
        if run.plans and left - tail <= max(0.05, min(overran, default=0.0), min(took, default=0.0) / 4,
                                            layout.build_s):
            run.alts[layout.name] = {"skipped": f"time limit reached (estimated {layout.estimate_s:.2f} s)"}
            continue
        # all the layouts' time left (the likeliest go first, and a search that ends early leaves the
        # rest), or half of it when the next contender is tied with this one: the estimate cannot
        # tell them apart, so neither may take all the time (unless that one could not build a
        # candidate in the other half)
        rival = next((x for x in layouts[i + 1:] if AUTO_PRUNE_MARGIN * x.estimate_s < bound
                      and x.build_s < left / 2), None)
        tied = rival is not None and max(rival.key, layout.key) <= (1 + AUTO_TIE) * min(rival.key, layout.key)
        limit = max(0.05, min(left / 2 if tied else left, left - tail))
        t0 = time.perf_counter()
        builds = BuildCache()
        try:
            sub = run.plan_layout(layout, limit, builds)
            run.record(layout.name, sub, t0)
            if sub.estimated_step_time_s <= run.best():
                fastest = (layout, builds, time.perf_counter() - t0)
        except OutOfTimeError as e:
            run.alts[layout.name] = {"skipped": f"time limit reached ({e})"}
        except MegatronExtError as e:
            run.alts[layout.name] = {"error": str(e)}
        took.append(time.perf_counter() - t0)
        overran.append(max(0.0, took[-1] - limit))
    return fastest


def _plan_flexsp(run: _Run, flex_lb: float) -> None:
    """FlexSP, last, in all the time left but ``AUTO_RESERVE`` of the limit (for its plan's check),
    unless its lower bound is no faster than a layout's plan."""
    best = run.best()
    if flex_lb >= best:
        run.alts["flexsp"] = {"skipped": f"its lower bound {flex_lb:.2f} s is no faster than the best layout "
                                         f"({best:.2f} s)", "estimated_lower_s": flex_lb}
        return
    t0 = time.perf_counter()
    try:
        left = run.budget * (1 - AUTO_RESERVE) - (t0 - run.start)
        run.record("flexsp", plan_sp("flexsp", plan_flexsp, run.lengths, run.flex_cost,
                                     PlannerOptions(time_limit=max(0.05, left)), seq_ids=run.ids), t0)
    except MegatronExtError as e:
        run.alts["flexsp"] = {"error": str(e)}


def _plan_fastest_again(run: _Run, layout: Layout, builds: BuildCache, took: float) -> None:
    """In the time left (no FlexSP to plan, or FlexSP solved before its limit), where that is at
    least half what it took, the fastest layout planned again, resuming from the candidates it
    built (its searches pass them again first); its plan replaces the first if faster. It had
    planned in less than the whole second: beside a tied layout its plan then pruned (gpt-13b on
    128 A100-40GB, 192K, ZeRO-1: 8 x 8 x 2 36.59 s in 0.5 s, 36.35 s resumed, as in the whole
    second alone), or in the layouts' floor share (gpt-30b on 256 A800s, 192K CommonCrawl,
    ZeRO-3: FlexSP solved in 0.16 s, 44.87 s; 4 x 8 x 8 44.88 s in that share, 41.14 s resumed)."""
    left = run.start + run.budget * (1 - AUTO_RESERVE) - time.perf_counter()
    if left < max(0.05, took / 2):
        return
    t0 = time.perf_counter()
    try:
        sub = run.plan_layout(layout, left, builds)
    except MegatronExtError:
        return  # (the plan made stands)
    first = run.alts[layout.name]
    if sub.estimated_step_time_s < first["estimated_step_time_s"]:
        run.plans[:] = [x for x in run.plans if x[1] != layout.name]
        run.record(layout.name, sub, t0)
        run.alts[layout.name]["solve_time_s"] += first["solve_time_s"]


__all__ = ["AUTO_BOUND_CUT", "AUTO_FLEXSP_FLOOR", "AUTO_FLEXSP_GAP", "AUTO_FLEXSP_MIN_X", "AUTO_FLEXSP_SHARE",
           "AUTO_PRUNE_MARGIN", "AUTO_RESERVE", "AUTO_TIE", "AUTO_TIMELINES_SHARE", "flexsp_bound_s", "plan_auto",
           "plan_units"]
