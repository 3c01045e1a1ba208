"""CLI glue for pipeline planning and simulation, kept out of cli.py so it wires in with one line
per hook (see the functions' docstrings):

- ``add_simulate_command(sub, add_cost_args, cost_from_args, parse_tokens)``: the
  ``megatron-ext simulate`` subcommand (many steps, every planner, one table; ``--json``).
- ``add_pipeline_args(parser)``: ``--pp``, ``--sp``, ``--b1-scale``, ``--memory-mb``, ``--plot`` for
  ``plan`` (and ``simulate``).
- ``run_pp_plan(args, cost, lengths)``: ``plan --planner elastic_pp|seq1f1b|batch_1f1b|auto``:
  plans, times the baselines, prints the summary (or the StepPlan JSON with ``--json``), and
  draws the plan with ``--plot FILE.png``.
- ``plot_if_asked(args, plan, lengths, cost)``: the ``--plot`` hook for FlexSP-kind planners in
  cli.cmd_plan.
"""
from __future__ import annotations

import json

from megatron_ext.data.lengths import DISTRIBUTIONS, read_lengths
from megatron_ext.errors import ConfigError


def add_batch_source_args(p, default_dist: str) -> None:
    """Where a command's lengths come from: ``--lengths FILE`` or ``--dist NAME --batch N``."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--lengths", metavar="FILE", help="text file, one sequence length per line (one batch)")
    src.add_argument("--dist", default=default_dist, choices=sorted(DISTRIBUTIONS),
                     help=f"synthetic length distribution (default: {default_dist})")
    p.add_argument("--batch", type=int, default=512, help="sequences per step with --dist (default 512)")


def add_pipeline_args(p) -> None:
    g = p.add_argument_group("elastic pipelines (elastic_pp, seq1f1b, batch_1f1b)")
    g.add_argument("--pp", type=int, help="pipeline stages (default: one per node)")
    g.add_argument("--sp", type=int, help="Ulysses degree inside a stage (default: the node size, up to the head limit)")
    g.add_argument("--b1-scale", type=float, default=1.0, metavar="X",
                   help="per-chunk fixed cost of a stage = X * b1 / pp, b1 the model's per-micro-batch fixed cost "
                        "(default 1: a chunk pays per layer what a FlexSP micro-batch pays, the InfiniPipe formula; "
                        "see docs/elastic_pp.md)")
    g.add_argument("--memory-mb", type=float, metavar="MB", help="per-GPU budget (default: the cluster's)")
    g.add_argument("--plot", metavar="FILE.png",
                   help="draw the plan: timeline (stages or GPUs x seconds) and memory per GPU over time")


def _pipeline_options(args):
    from megatron_ext.planner.pipeline import PipelineOptions

    if getattr(args, "time_limit", 1.0) <= 0:
        raise ConfigError(f"--time-limit must be positive, got {args.time_limit}")
    return PipelineOptions(pp=args.pp, sp=args.sp, b1_scale=args.b1_scale, memory_mb=args.memory_mb,
                           time_limit=getattr(args, "time_limit", 1.0),
                           pack_tokens=getattr(args, "max_seq_len", None))


def run_pp_plan(args, cost, lengths) -> int:
    """Hook for cli.cmd_plan: ``if args.planner in PP_PLANNERS: return run_pp_plan(args, cost, lengths)``."""
    from megatron_ext.planner.api import PlannerOptions
    from megatron_ext.planner.pipeline import PP_BASELINES, describe, make_pp_plan
    from megatron_ext.sim import simulate

    opts = _pipeline_options(args)
    drop = PlannerOptions(time_limit=opts.time_limit, drop_over_max=getattr(args, "drop_over_max", False),
                          max_seq_len=getattr(args, "max_seq_len", None))
    import dataclasses

    overrides = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}
    plan = make_pp_plan(args.planner, lengths, cost, drop,
                        baselines=() if getattr(args, "no_baselines", False) else PP_BASELINES, **overrides)
    if getattr(args, "json", False):
        print(plan.to_json(indent=1))
    else:
        res = simulate(plan, lengths, cost, b1_scale=opts.b1_scale, memory_mb=opts.memory_mb, events=False)
        print(f"{plan.planner} plan for {len(lengths)} sequences ({int(lengths.sum()):,} tokens) of {cost.model.name} "
              f"on {cost.cluster.name} ({cost.num_gpus} GPUs)\n")
        print(describe(plan, lengths, res))
    plot_if_asked(args, plan, lengths, cost)
    return 0


def plot_if_asked(args, plan, lengths, cost) -> None:
    """``--plot FILE``: draw ``plan`` (any kind) to FILE; a note on stderr says where."""
    path = getattr(args, "plot", None)
    if not path:
        return
    import sys

    from megatron_ext.sim.plot import plot_plan

    opts = _pipeline_options(args)
    try:
        plot_plan(plan, lengths, cost, path, b1_scale=opts.b1_scale, memory_mb=opts.memory_mb)
    except OSError as e:
        raise ConfigError(f"cannot write the plot to {path}: {e.strerror or e}") from None
    print(f"plot written to {path}", file=sys.stderr)


def add_simulate_command(sub, add_cost_args, cost_from_args, parse_tokens) -> None:
    """Hook for cli.build_parser: ``add_simulate_command(sub, add_cost_args, cost_from_args, parse_tokens)``."""
    from megatron_ext.sim.table import DEFAULT_PLANNERS

    p = sub.add_parser("simulate", help="simulate many steps with every planner and compare them in one table")
    add_batch_source_args(p, default_dist="commoncrawl")
    p.add_argument("--steps", type=int, default=5, help="steps with --dist (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seq-len", type=parse_tokens, metavar="L",
                   help="max context, e.g. 48K (also the baselines' pack size)")
    p.add_argument("--planners", default=",".join(DEFAULT_PLANNERS),
                   help=f"comma-separated (default: {','.join(DEFAULT_PLANNERS)})")
    p.add_argument("--main", default="elastic_pp", help="the planner whose speedups are reported")
    p.add_argument("--time-limit", type=float, default=1.0, metavar="SEC", help="planning time limit per step")
    p.add_argument("--json", action="store_true", help="rows, summary, compute floor and config as JSON")
    add_cost_args(p)
    add_pipeline_args(p)

    def cmd_simulate(args) -> int:
        from megatron_ext.sim.table import simulate_table

        if args.batch < 1 or args.steps < 1:
            raise ConfigError(f"--batch and --steps must be at least 1, got {args.batch} and {args.steps}")
        cost = cost_from_args(args)
        out = simulate_table(cost, lengths=read_lengths(args.lengths) if args.lengths else None, dist=args.dist,
                             batch=args.batch, steps=args.steps, seed=args.seed, max_seq_len=args.max_seq_len,
                             pp=args.pp, sp=args.sp, planners=tuple(x for x in args.planners.split(",") if x),
                             main=args.main, options=_pipeline_options(args), time_limit=args.time_limit,
                             keep_plans=bool(args.plot))
        print(json.dumps({k: out[k] for k in ("config", "summary", "floor", "rows")}, indent=1) if args.json else out["table"])
        if args.plot:
            import sys

            from megatron_ext.sim.plot import plot_comparison

            first = out["plans"].get(args.main)
            if first is None:
                raise ConfigError(f"--plot: {args.main} could not plan the first step, nothing to draw")
            plan, lens = first
            opts = _pipeline_options(args)
            try:
                plot_comparison(plan, lens, cost, out["summary"], args.main, args.plot, out["config"]["source"],
                                b1_scale=opts.b1_scale, memory_mb=opts.memory_mb)
            except OSError as e:
                raise ConfigError(f"cannot write the plot to {args.plot}: {e.strerror or e}") from None
            print(f"plot of {args.main}'s first step written to {args.plot}", file=sys.stderr)
        return 0

    p.set_defaults(func=cmd_simulate)
