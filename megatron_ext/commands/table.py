"""``simulate_table``: many steps, every planner, one table (for ``megatron-ext simulate``).

For each step (a batch sampled from a length distribution, a dataset's batch, or the given lengths), every planner
plans it and the simulator times the plan: step time, tokens/s, bubble ratio, recompute share,
peak memory, planning time. The summary row of each planner aggregates the steps (times summed,
so tokens/s is total tokens over total time), and the main planner's speedup over each other
planner is total time of that planner / total time of the main one.
"""
from __future__ import annotations

import dataclasses
import statistics

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.data.batches import dataset_batches
from megatron_ext.data.lengths import MAX_SEED, sample_lengths
from megatron_ext.errors import ConfigError, MegatronExtError
from megatron_ext.sim.simulator import simulate
from megatron_ext.text import plural

DEFAULT_PLANNERS = ("elastic_pp", "flexsp", "seq1f1b", "batch_1f1b", "static_ulysses", "auto")


def _plan(name: str, lengths: np.ndarray, cost: CostModel, pp, sp, options, time_limit: float):
    from megatron_ext.planner.api import get_planner
    from megatron_ext.planner.options import PlannerOptions

    planner = get_planner(name)
    if planner.kind == "auto":  # every layout, unless the options pin one
        return planner.plan(lengths, cost, options)
    if planner.kind == "pp":
        return planner.plan(lengths, cost, options, pp=pp, sp=sp)
    return planner.plan(lengths, cost, PlannerOptions(time_limit=time_limit))


def simulate_table(cost: CostModel | None = None, *, model: str = "llama-13b", cluster: str = "a800-80g-8x4",
                   lengths=None, dist: str = "commoncrawl", data=None, batch: int = 512,
                   steps: int = 5, seed: int = 0,
                   max_seq_len: int | None = None, pp: int | None = None, sp: int | None = None,
                   planners: tuple[str, ...] = DEFAULT_PLANNERS, main: str | None = None, options=None,
                   b1_scale: float | None = None, time_limit: float = 1.0, keep_plans: bool = False) -> dict:
    """Returns {"rows": per step and planner, "summary": per planner, "table": printable text,
    "config": what was run, "plans": {planner: (plan, lengths)} of the first step if ``keep_plans``}.
    ``lengths`` (one batch) overrides ``dist``/``batch``/``steps``; ``data`` (Megatron indexed
    datasets: the values of ``--data-path``, a prefix or a blend) replaces ``dist`` with the batches
    of a training run on them: documents over ``max_seq_len`` cut into pieces, shuffled by
    ``seed``. ``main`` (default: the first planner) is the one the speedups are relative to.
    ``options`` is a PipelineOptions for the pipeline planners (b1_scale, memory_mb, ...);
    ``max_seq_len`` (default: the longest every planner can run) caps the sampled lengths and sets
    the baselines' pack size (Megatron packs to the context length). A bad setup (an unknown
    planner, no planner able to run) raises before any planning; a planner that cannot run on it
    (its layout, FlexSP's model states) and a step a planner cannot run are rows with their error."""
    from megatron_ext.planner.pp.pipeline import PipelineOptions, resolve_layout

    cost = cost or CostModel.from_presets(model, cluster)
    opts = options or PipelineOptions()
    if b1_scale is not None:
        opts = dataclasses.replace(opts, b1_scale=b1_scale)
    opts = dataclasses.replace(opts, time_limit=time_limit)
    if max_seq_len is not None and opts.pack_tokens is None:
        opts = dataclasses.replace(opts, pack_tokens=int(max_seq_len))
    planners, main = _checked_planners(planners, main)
    pp, sp = pp if pp is not None else opts.pp, sp if sp is not None else opts.sp
    opts = dataclasses.replace(opts, pp=pp, sp=sp)
    unable = _unable(cost, planners, pp, sp, opts)
    pp, sp = resolve_layout(cost, pp, sp)
    batches, source = _batches(cost, opts, planners, unable, lengths, data, dist, batch, steps, seed, max_seq_len)
    rows, plans = _rows(batches, planners, unable, cost, pp, sp, opts, time_limit, keep_plans)
    floors = [cost.compute_floor_ms(lens) / 1e3 for lens in batches]
    summary, floor, unplanned = _summaries(rows, planners, main, batches, floors)
    config = {"model": cost.model.name, "cluster": cost.cluster.name, "model_on_cluster": cost.model_on_cluster,
              "num_gpus": cost.num_gpus,
              "zero_stage": cost.zero_stage, "pp": pp, "sp": sp,
              "source": source, "b1_scale": opts.b1_scale, "memory_mb": opts.memory_mb or cost.cluster.memory_mb,
              "time_limit": time_limit, "main": main, "steps": len(batches),
              # steps no planner could plan: left out of every figure
              "unplanned_steps": unplanned}
    choices: dict[str, int] = {}
    for r in rows:
        if r["planner"] == "auto" and "error" not in r and r["status"].startswith("auto chose "):
            pick = r["status"][len("auto chose "):].split(" (", 1)[0]
            choices[pick] = choices.get(pick, 0) + 1
    if choices:
        config["auto_choices"] = choices
    return {"rows": rows, "summary": summary, "floor": floor, "table": format_table(summary, floor, config, main),
            "config": config, "plans": plans}


def _checked_planners(planners: tuple[str, ...], main: str | None) -> tuple[tuple[str, ...], str]:
    """The planners named (once each, in order) and the main one (default the first); unknown ones refused."""
    from megatron_ext.planner.api import PLANNERS

    planners = tuple(dict.fromkeys(x for x in planners if x))
    unknown = [x for x in planners if x not in PLANNERS]
    if not planners or unknown:
        raise ConfigError(f"unknown planner(s) {', '.join(map(repr, unknown)) or '(none given)'}; choose from "
                          f"{', '.join(PLANNERS)}")
    main = main or planners[0]
    if main not in planners:
        raise ConfigError(f"the main planner {main!r} is not among the planners ({', '.join(planners)})")
    return planners, main


def _unable(cost: CostModel, planners: tuple[str, ...], pp, sp, opts) -> dict[str, str]:
    """The planners that cannot run on this setup (their layout, or FlexSP's groups with no room
    beside the model states), and why: rows saying so beside the others; with none left the setup
    is refused."""
    from megatron_ext.planner.api import PIPELINE_KINDS, planner_names
    from megatron_ext.planner.pp.pipeline import pipeline_cost

    unable: dict[str, str] = {}
    for x in planners:
        try:
            if x in planner_names(*PIPELINE_KINDS) and (x != "auto" or pp is not None or sp is not None):
                pipeline_cost(cost, pp, sp, opts)
            if x in planner_names("sp"):
                cost.tokens_per_gpu
        except MegatronExtError as e:
            unable[x] = str(e)
    if len(unable) == len(planners):
        raise ConfigError(unable[planners[0]])
    return unable


def _batches(cost: CostModel, opts, planners, unable, lengths, data, dist: str, batch: int, steps: int, seed: int,
             max_seq_len: int | None) -> tuple[list[np.ndarray], str]:
    """Each step's lengths, and where they came from: the given ones, a dataset's batches, or
    batches drawn from ``dist`` (step s from seed + s), cut at ``max_seq_len`` (default: the
    longest every planner able to run can run)."""
    from megatron_ext.planner.api import max_seq_len as planner_max_seq_len

    if lengths is not None:
        return [np.asarray(lengths, dtype=np.int64)], f"{len(lengths)} given lengths"
    cap = max_seq_len or min(planner_max_seq_len(x, cost, opts) for x in planners if x not in unable)
    if data is not None:
        return dataset_batches(data, batch, cap, seed, range(steps))
    if seed + steps - 1 > MAX_SEED:  # (step s draws from seed + s)
        raise ConfigError(f"--seed {seed} + {steps} steps passes the largest seed, 2^63 - 1: use a smaller seed")
    return ([sample_lengths(dist, batch, seed + s, cap) for s in range(steps)],
            f"{dist}, batch {batch}, max length {cap:,}, {steps} step(s) from seed {seed}")


def _rows(batches, planners, unable, cost: CostModel, pp, sp, opts, time_limit: float,
          keep_plans: bool) -> tuple[list[dict], dict]:
    """Every step planned by every planner able to, and simulated: a row each (or its error); and
    the first step's plans where ``keep_plans``."""
    rows, plans = [], {}
    for step, lens in enumerate(batches):
        for name in planners:
            row = {"step": step, "planner": name, "tokens": int(lens.sum())}
            if name in unable:
                rows.append({**row, "error": unable[name]})
                continue
            try:
                plan = _plan(name, lens, cost, pp, sp, opts, time_limit)
                res = simulate(plan, lens, cost, b1_scale=opts.b1_scale, memory_mb=opts.memory_mb, events=False)
                if keep_plans and step == 0:
                    plans[name] = (plan, lens)
                row.update(step_time_s=res.step_time_s, tokens_per_s=res.tokens_per_s, bubble_ratio=res.bubble_ratio,
                           recompute_ratio=res.recompute_ratio, peak_memory_gb=res.max_peak_memory_mb / 1024,
                           solve_time_s=plan.solve_time_s, lower_bound_s=plan.lower_bound_step_time_s,
                           status=plan.solver_status)
            except MegatronExtError as e:
                row.update(error=str(e))
            rows.append(row)
    return rows, plans


def _summaries(rows: list[dict], planners, main: str, batches, floors: list[float]) -> tuple[list[dict], dict, list]:
    """Each planner's summary over the steps it ran, the compute floor's, and the steps no planner
    planned (left out of every figure)."""
    times = {(r["planner"], r["step"]): r["step_time_s"] for r in rows if "error" not in r}

    def total(name: str, steps) -> float:
        return sum(times[(name, st)] for st in steps)

    def ran(name: str, *others: str) -> list[int]:
        return [st for st in range(len(batches)) if all((x, st) in times for x in (name, *others))]

    # the compute floor and each planner's distance to it: over the steps every planner ran (of those
    # that ran any), so that a step some planner could not run weighs on neither side
    feasible = [x for x in planners if ran(x)]
    shared = ran(*feasible) if feasible else []
    summary = []
    for name in planners:
        mine = [r for r in rows if r["planner"] == name]
        good = [r for r in mine if "error" not in r]
        if not good:
            summary.append({"planner": name, "error": mine[0].get("error", "no steps") if mine else "no steps"})
            continue
        both = ran(name, main)  # speedups over the steps both planners ran
        main_total = total(main, both)
        own = ran(name)
        summary.append({
            "planner": name,
            "steps": len(good),
            "failed_steps": len(mine) - len(good),
            "step_time_s": statistics.mean(r["step_time_s"] for r in good),
            "tokens_per_s": sum(r["tokens"] for r in good) / sum(r["step_time_s"] for r in good),
            "bubble_ratio": statistics.mean(r["bubble_ratio"] for r in good),
            "recompute_ratio": statistics.mean(r["recompute_ratio"] for r in good),
            "peak_memory_gb": max(r["peak_memory_gb"] for r in good),
            "solve_time_s": statistics.mean(r["solve_time_s"] for r in good),
            "max_solve_time_s": max(r["solve_time_s"] for r in good),
            f"speedup_of_{main}": total(name, both) / main_total if both and main_total > 0 else None,
            "total_time_s": total(name, own),
            # the most any plan could gain over this planner (on the shared steps)
            "ceiling": total(name, shared) / max(1e-12, sum(floors[st] for st in shared)) if shared else None,
        })
    main_steps = ran(main)
    floor_steps = shared or range(len(batches))
    floor = {"step_time_s": statistics.mean(floors[st] for st in floor_steps),
             "tokens_per_s": sum(int(batches[st].sum()) for st in floor_steps) / sum(floors[st] for st in floor_steps),
             "steps": list(floor_steps),
             f"speedup_of_{main}": (sum(floors[st] for st in main_steps) / total(main, main_steps)
                                    if main_steps else None),
             "ceiling": {x["planner"]: x["ceiling"] for x in summary if x.get("ceiling") is not None}}
    unplanned = [st for st in range(len(batches)) if not any((x, st) in times for x in planners)]
    return summary, floor, unplanned


def format_table(summary: list[dict], floor: dict, config: dict, main: str) -> str:
    # memory in GB, or in MB on small (CPU-rank) budgets where GB would read 0
    unit, div, prec = ("GB", 1024.0, 0) if config["memory_mb"] >= 2048 else ("MB", 1.0, 1)
    reps = config["num_gpus"] // (config["pp"] * config["sp"])
    head = (f"{config['model_on_cluster']} ({config['num_gpus']} GPUs; pipelines: pp {config['pp']} x "
            f"sp {config['sp']}{f' x {reps} replicas' if reps > 1 else ''}); {config['source']}; b1_scale {config['b1_scale']:g}; "
            f"memory {config['memory_mb'] / div:.{prec}f} {unit} per GPU, ZeRO-{config['zero_stage']}")
    w = max(16, 2 + max(len(s["planner"]) for s in summary))  # (megatron_balanced_cp: 20)
    v = max(22, 2 + len(main + " speedup"))
    cols = (f"{'planner':<{w}}{'step s':>9}{'tokens/s':>11}{'bubble':>8}{'recomp':>8}{'peak ' + unit:>9}"
            f"{'plan ms':>9}{'max ms':>8}{main + ' speedup':>{v}}")
    lines = [head, "", cols]
    for s in summary:
        if "error" in s:
            lines.append(f"{s['planner']:<{w}}  infeasible: {s['error']}")
            continue
        sp = s.get(f"speedup_of_{main}")
        sp_txt = "-" if s["planner"] == main else ("n/a" if sp is None else f"{sp:.2f}x")
        fail = f"  ({s['failed_steps']} step(s) infeasible)" if s["failed_steps"] else ""
        lines.append(f"{s['planner']:<{w}}{s['step_time_s']:>9.2f}{s['tokens_per_s']:>11,.0f}{s['bubble_ratio']:>8.1%}"
                     f"{s['recompute_ratio']:>8.1%}{s['peak_memory_gb'] * 1024 / div:>9.1f}{s['solve_time_s'] * 1e3:>9.0f}"
                     f"{s['max_solve_time_s'] * 1e3:>8.0f}{sp_txt:>{v}}{fail}")
    lines.append(f"{'(compute floor)':<{w}}{floor['step_time_s']:>9.2f}{floor['tokens_per_s']:>11,.0f}{'-':>8}{'-':>8}"
                 f"{'-':>9}{'-':>9}{'-':>8}{'-':>{v}}")
    if floor["ceiling"]:
        lines += ["", "no plan is faster than the compute floor; the most any plan could gain: "
                  + ", ".join(f"{v:.2f}x over {k}" for k, v in floor["ceiling"].items())]
    shared, steps = len(floor["steps"]), config["steps"]
    if not floor["ceiling"] and any("error" not in s for s in summary):
        lines += ["", f"no step ran under every planner: the compute floor's step is the mean over all "
                      f"{plural(steps, 'step')}; a planner's, over the steps it ran"]
    elif shared < steps:  # (then a planner's mean is over other steps than the floor's)
        lines += ["", f"the compute floor and the most any plan could gain: over the {shared} of {steps} steps every "
                      f"planner with figures ran; a planner's step s and tokens/s: over the steps it ran"]
    if "auto_choices" in config:
        lines += ["", "auto chose: " + ", ".join(f"{k} x{v}" for k, v in config["auto_choices"].items())]
    lines += ["", "step s: mean simulated step time; bubble: idle share of GPU-time; recomp: recompute share; "
              f"speedup: total time of that planner / total time of {main} over the steps both ran; "
              "compute floor: the batch's compute spread over every GPU, nothing else (no all-to-all, "
              "fixed cost or idle time)."]
    return "\n".join(lines)
