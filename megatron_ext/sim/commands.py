"""CLI glue for pipeline planning and simulation, kept out of cli.py so it wires in with one line
per hook (see the functions' docstrings):

- ``add_simulate_command(sub, add_cost_args, cost_from_args, parse_tokens)``: the
  ``megatron-ext simulate`` subcommand (many steps, every planner, one table; ``--json``).
- ``add_pipeline_args(parser)``: ``--pp``, ``--sp``, ``--b1-scale``, ``--memory-mb``, ``--plot`` for
  ``plan`` (and ``simulate``).
- ``run_pp_plan(args, cost, lengths)``: ``plan --planner elastic_pp|seq1f1b|batch_1f1b|auto``:
  plans, times the baselines, prints the summary (or the StepPlan JSON with ``--json``), and
  draws the plan with ``--plot FILE.png``; ``describe_plan`` is its summary.
- ``plot_if_asked(args, plan, lengths, cost)``: the ``--plot`` hook for FlexSP-kind planners in
  cli.cmd_plan.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

import numpy as np

from megatron_ext.data.lengths import DISTRIBUTIONS, read_lengths
from megatron_ext.errors import ConfigError, LengthsError
from megatron_ext.plan.pipelines import replica_groups
from megatron_ext.text import plural


PLOT_FORMATS = (".png", ".pdf", ".svg")
PIPELINE_ONLY = {"pp": "--pp", "sp": "--sp", "b1_scale": "--b1-scale", "recompute": "--recompute",
                 "recompute_ties": "--recompute-ties"}  # options that only pipeline planners use


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_batch_source_args(p, default_dist: str) -> None:
    """Where a command's lengths come from: ``--lengths FILE``, ``--dist NAME`` or ``--data PREFIX``
    (with ``--batch N --seed S``)."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--lengths", metavar="FILE", help="text file, one sequence length per line (one batch)")
    src.add_argument("--dist", default=default_dist, choices=sorted(DISTRIBUTIONS),
                     help=f"synthetic length distribution (default: {default_dist})")
    src.add_argument("--data", nargs="+", metavar="PREFIX",
                     help="Megatron indexed dataset (PREFIX.bin/.idx), or a blend as Megatron-LM's --data-path takes "
                          "it (W1 PREFIX1 W2 PREFIX2 ...): the batches a training run with this --seed, --batch and "
                          "--max-seq-len (needed) draws, longer documents cut into pieces")
    p.add_argument("--batch", type=int, default=512,
                   help="sequences per step with --dist or --data (default 512; ignored with --lengths)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed with --dist, shuffling seed with --data (train's --seed) (default 0)")


def add_pipeline_args(p) -> None:
    """``--memory-mb`` and ``--plot`` (every planner), and the pipeline planners' options."""
    g = p.add_argument_group("memory and pictures (every planner)")
    g.add_argument("--memory-mb", type=float, metavar="MB",
                   help="usable memory per GPU, for every planner and the simulator (default: the cluster's)")
    g.add_argument("--plot", metavar="FILE.png",
                   help="draw the plan: timeline (stages or GPUs x seconds) and memory per GPU over time "
                        f"({', '.join(PLOT_FORMATS)})")
    g.add_argument("--trace", metavar="FILE.json",
                   help="the simulated timeline as a Chrome trace (open it in ui.perfetto.dev): a track per GPU or "
                        "stage, a slice per SP group, chunk, recompute and p2p transfer, memory counters")
    g = p.add_argument_group("elastic pipelines (elastic_pp, seq1f1b, batch_1f1b, auto)")
    g.add_argument("--pp", type=positive_int,
                   help="pipeline stages (default: one per node; on one node, the fewest that fit)")
    g.add_argument("--sp", type=positive_int,
                   help="Ulysses degree inside a stage (default: GPUs / pp, up to the head limit); with pp x sp "
                        "below the GPU count, GPUs / (pp x sp) replicas of the pipeline run side by side, each "
                        "its share of the sequences")
    g.add_argument("--b1-scale", type=float, metavar="X",
                   help="what-if multiplier of the per-chunk fixed cost of a stage, which is derived from the "
                        "launch constant and, at ZeRO-3, the gathers of the stage's own parameters over its group "
                        "(default 1: as derived; see docs/cost_model.md)")
    g.add_argument("--recompute", choices=("ilp", "greedy", "none", "full"),
                   help="elastic_pp's activation recompute: per (stage, chunk) by the HiGHS ILP (default), by the "
                        "greedy, none (chunks small enough to fit) or every layer")
    g.add_argument("--recompute-ties", choices=("best", "tied", "untied"),
                   help="the ILP's variables: tied along the schedule's diagonals (InfiniPipe), one per stage and "
                        "chunk, or both and the faster simulated plan (default: best)")


def check_args(args, pipelines: bool) -> None:
    """Before any work: ``--data`` with the length that cuts its documents, the plot file's format,
    and no pipeline option without a pipeline planner (``pipelines``: the command runs one)."""
    if getattr(args, "data", None) and not args.max_seq_len:
        raise ConfigError("--data needs --max-seq-len: the length a training run cuts its documents at "
                          "(train's --max-seq-len, Megatron-LM's --seq-length), so the batches are the run's")
    plot = getattr(args, "plot", None)
    if plot and not plot.lower().endswith(PLOT_FORMATS):
        raise ConfigError(f"--plot {plot}: the file name must end in {', '.join(PLOT_FORMATS)}")
    trace = getattr(args, "trace", None)
    if trace and not trace.lower().endswith(".json"):
        raise ConfigError(f"--trace {trace}: the file name must end in .json (Chrome trace-event JSON)")
    given = [flag for name, flag in PIPELINE_ONLY.items() if getattr(args, name, None) is not None]
    if given and not pipelines:
        raise ConfigError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to pipeline planners "
                          f"(elastic_pp, seq1f1b, batch_1f1b, auto), not to {getattr(args, 'planner', None) or getattr(args, 'planners', '')}")


def pipeline_options_from_args(args):
    from megatron_ext.planner.pipeline import PipelineOptions

    t = getattr(args, "time_limit", 1.0)
    if not (math.isfinite(t) and t > 0):
        raise ConfigError(f"--time-limit must be positive (seconds), got {t}")
    return PipelineOptions(pp=args.pp, sp=args.sp, b1_scale=1.0 if args.b1_scale is None else args.b1_scale,
                           recompute=args.recompute or "ilp", ties=args.recompute_ties or "best", time_limit=t,
                           pack_tokens=getattr(args, "max_seq_len", None))


def run_pp_plan(args, cost, lengths) -> int:
    """Hook for cli.cmd_plan: ``if args.planner in PP_PLANNERS: return run_pp_plan(args, cost, lengths)``."""
    from megatron_ext.planner.api import PlannerOptions
    from megatron_ext.planner.pipeline import PP_BASELINES
    from megatron_ext.planner.pipeline_api import make_pp_plan
    from megatron_ext.sim import simulate

    opts = pipeline_options_from_args(args)
    drop = PlannerOptions(time_limit=opts.time_limit, static_degree=getattr(args, "static_degree", None),
                          drop_over_max=getattr(args, "drop_over_max", False),
                          max_seq_len=getattr(args, "max_seq_len", None))
    overrides = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}
    plan = make_pp_plan(args.planner, lengths, cost, drop,
                        baselines=() if getattr(args, "no_baselines", False) else PP_BASELINES, **overrides)
    if getattr(args, "json", False):
        print(plan.to_json(indent=1))
    else:
        res = simulate(plan, lengths, cost, b1_scale=opts.b1_scale, events=False)
        print(f"{plan.planner} plan for {plural(len(lengths), 'sequence')} ({int(lengths.sum()):,} tokens) of "
              f"{cost.model.name} on {cost.cluster.name} ({cost.num_gpus} GPUs)\n")
        print(describe_plan(plan, lengths, res))
        if plan.pipelines:
            print("\n" + pipeline_tables(plan, lengths, cost, opts.b1_scale))
    plot_if_asked(args, plan, lengths, cost)
    trace_if_asked(args, plan, lengths, cost)
    return 0


def _chunk_kind(chunk, lengths) -> str:
    """InfiniPipe's chunk kinds: one slice of a long sequence (split), a slice packed with whole
    sequences (hybrid), or whole sequences only (batched)."""
    cut = any(x.start > 0 or x.end < lengths[x.seq_id] for x in chunk.pieces)
    return ("split" if len(chunk.pieces) == 1 else "hybrid") if cut else "batched"


def _wrap(head: str, items: list[str], width: int = 100) -> list[str]:
    """``head`` then the items, continued on indented lines of at most ``width`` characters."""
    lines, line = [], head
    for it in items:
        if len(line) + 1 + len(it) > width and line.strip() != head.strip():
            lines.append(line)
            line = " " * len(head)
        line += " " + it
    return lines + [line]


def pipeline_tables(plan, lengths, cost, b1_scale: float = 1.0, max_pieces: int = 4) -> str:
    """What each pipeline of a plan runs: its chunks (kind, tokens, average-stage time, pieces as
    ``seq[start:end)``), every stage's operation order and the recompute table (layers each stage
    recomputes per chunk)."""
    from megatron_ext.cost.pipeline import PipelineCost
    from megatron_ext.sim.engine import analyze_chunks

    lengths = np.asarray(lengths)
    groups = replica_groups(plan, plan.num_gpus)
    out = []
    for i, p in enumerate(plan.pipelines):
        pc = PipelineCost(cost, p.stages, p.sp_degree, b1_scale)
        table = analyze_chunks(p.chunks, pc, f"pipeline {i}")
        ms = pc.stage_ms(table.work, table.tokens)
        rep = f" (replica {p.replica})" if len(groups) > 1 else ""
        out += [f"pipeline {i}{rep} chunks (forward order; ms: forward+backward on an average stage):",
                f"  {'chunk':>5}  {'kind':<7} {'tokens':>9} {'ms':>8}  pieces (sequence[start:end))"]
        for c, tok, t in zip(p.chunks, table.tokens, ms):
            pieces = [f"{x.seq_id}[{x.start}:{x.end})" for x in c.pieces[:max_pieces]]
            more = len(c.pieces) - max_pieces
            if more > 0:
                pieces.append(f"+{plural(more, 'whole sequence')}"
                              if all(x.start == 0 and x.end == lengths[x.seq_id] for x in c.pieces[max_pieces:])
                              else f"+{more} more")
            out.append(f"  {c.id:>5}  {_chunk_kind(c, lengths):<7} {int(tok):>9,} {t:>8.1f}  {', '.join(pieces)}")
        out.append(f"pipeline {i} order per stage (F3 / B3: forward / backward of chunk 3):")
        for st, order in enumerate(p.order_per_stage):
            out += _wrap(f"  stage {st}:", order)
        layers = cost.model.num_layers // p.stages
        rec = [c.recompute_layers_per_stage or [0] * p.stages for c in p.chunks]
        if not any(any(r) for r in rec):
            out.append(f"pipeline {i} recompute: none (every stage holds its chunks' activations)")
            continue
        out.append(f"pipeline {i} recompute (layers of {layers} per stage recomputed, by chunk; . = none):")
        w = max(3, len(str(max(c.id for c in p.chunks))) + 1)
        out += _wrap("  chunk   ", [f"{c.id:>{w}}" for c in p.chunks], 10_000)
        for st in range(p.stages):
            out += _wrap(f"  stage {st:<2}", [f"{(r[st] or '.'):>{w}}" for r in rec], 10_000)
    return "\n".join(out)


def _status_lines(head: str, status: str) -> list[str]:
    # a status names every pipeline and every alternative auto timed: wrapped at its clauses
    clauses = status.split("; ")
    return _wrap(head, [c + ";" for c in clauses[:-1]] + clauses[-1:], width=110)


def describe_plan(plan, lengths, result=None) -> str:
    """A readable summary of a pipeline plan, or of an ``auto`` plan of either kind, with the
    simulated bubble, recompute and memory of ``result`` (a SimResult) if given."""
    lengths = np.asarray(lengths)
    groups = replica_groups(plan, plan.num_gpus)  # (a FlexSP plan: one replica, without pipelines)
    if plan.kind == "flexsp":
        lines = _status_lines(f"{plan.planner} plan:", f"FlexSP, {plural(len(plan.micro_batches), 'micro-batch', 'micro-batches')}; "
                                                     f"{plan.solver_status}")
        for m, mb in enumerate(plan.micro_batches):
            degs: dict[int, list[int]] = {}
            for g in mb.groups:
                degs.setdefault(g.degree, []).append(len(g.seq_ids))
            lines.append(f"  micro-batch {m}: {mb.estimated_time_s:.3f} s; groups "
                         + ", ".join(f"{len(v)} x degree {d} ({sum(v)} seq)" for d, v in sorted(degs.items(), reverse=True)))
    else:
        lines = _status_lines(f"{plan.planner} plan:", plan.solver_status)
    for i, p in enumerate(plan.pipelines):
        n = len(p.chunks)
        tok = [sum(x.end - x.start for x in c.pieces) for c in p.chunks]
        kinds = {"split": 0, "hybrid": 0, "batched": 0}
        for c in p.chunks:
            kinds[_chunk_kind(c, lengths)] += 1
        warm = []
        for o in p.order_per_stage:
            first_b = next((j for j, op in enumerate(o) if op.startswith("B")), len(o))
            warm.append(first_b)
        rec = sum(sum(c.recompute_layers_per_stage) for c in p.chunks if c.recompute_layers_per_stage)
        rep = f" (replica {p.replica})" if len(groups) > 1 else ""
        lines.append(f"  pipeline {i}{rep}: {plural(p.stages, 'stage')} x SP {p.sp_degree}, {plural(n, 'chunk')} "
                     f"({kinds['split']} split, "
                     f"{kinds['hybrid']} hybrid, {kinds['batched']} batched), tokens per chunk {min(tok)}..{max(tok)}, "
                     f"warm-up per stage {warm}, recomputed layer-chunks {rec}")
    idle = [r for r, pipes in enumerate(groups) if not pipes] if len(groups) > 1 else []
    if idle:
        lines.append(f"  replica{'s' if len(idle) > 1 else ''} {', '.join(map(str, idle))}: idle (fewer sequences "
                     f"than replicas)")
    if plan.dropped_seq_ids:
        ids = plan.dropped_seq_ids
        lines.append(f"dropped {plural(len(ids), 'sequence')} over the length limit "
                     f"({int(lengths[ids].max()):,} tokens the longest): ids {ids[:10]}{' ...' if len(ids) > 10 else ''}")
    bound = "work bound" if plan.kind == "elastic_pp" else "lower bound"
    lines.append(f"estimated step time {plan.estimated_step_time_s:.3f} s ({bound} {plan.lower_bound_step_time_s:.3f} s), "
                 f"planned in {plan.solve_time_s * 1e3:.0f} ms")
    if result is not None:
        where = "stage" if result.kind == "elastic_pp" else "GPU (max)"
        peak = result.peak_memory_mb if result.kind == "elastic_pp" else [result.max_peak_memory_mb]
        if result.kind == "elastic_pp" and len(peak) > plan.pipelines[0].stages:  # replicas, side by side
            P = plan.pipelines[0].stages
            where = f"stage (max over {len(peak) // P} replicas)"
            peak = [max(peak[p::P]) for p in range(P)]
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


def plot_if_asked(args, plan, lengths, cost) -> None:
    """``--plot FILE``: draw ``plan`` (any kind) to FILE; a note on stderr says where."""
    path = getattr(args, "plot", None)
    if not path:
        return
    import sys

    from megatron_ext.sim.plot import plot_plan

    opts = pipeline_options_from_args(args)
    try:
        plot_plan(plan, lengths, cost, path, b1_scale=opts.b1_scale)
    except OSError as e:
        raise ConfigError(f"cannot write the plot to {path}: {e.strerror or e}") from None
    print(f"plot written to {path}", file=sys.stderr)


def trace_if_asked(args, plan, lengths, cost) -> None:
    """``--trace FILE``: ``plan``'s simulated timeline as a Chrome trace in FILE; a note on stderr
    says where."""
    path = getattr(args, "trace", None)
    if not path:
        return
    import sys

    from megatron_ext.sim.trace import plan_trace_events, trace_document, write_trace

    events = plan_trace_events(plan, lengths, cost, b1_scale=pipeline_options_from_args(args).b1_scale)
    try:
        write_trace(path, trace_document(events, model=cost.model.name, cluster=cost.cluster.name))
    except OSError as e:
        raise ConfigError(f"cannot write the trace to {path}: {e.strerror or e}") from None
    print(f"trace of {plan.planner}'s plan written to {path} (open it in ui.perfetto.dev)", file=sys.stderr)


def add_simulate_command(sub, add_cost_args, cost_from_args, parse_tokens) -> None:
    """Hook for cli.build_parser: ``add_simulate_command(sub, add_cost_args, cost_from_args, parse_tokens)``."""
    from megatron_ext.sim.table import DEFAULT_PLANNERS

    p = sub.add_parser("simulate", help="simulate many steps with every planner and compare them in one table")
    add_batch_source_args(p, default_dist="commoncrawl")
    p.add_argument("--steps", type=int, default=5, help="steps with --dist or --data (default 5; ignored with --lengths)")
    p.add_argument("--max-seq-len", type=parse_tokens, metavar="L",
                   help="max context, e.g. 48K: the longest sampled sequence and the baselines' pack size "
                        "(default: the longest every planner can run; with --data, needed: the length training "
                        "cuts documents at)")
    p.add_argument("--drop-over-max", action="store_true",
                   help="with --lengths: drop sequences over --max-seq-len (default: over what every planner can run) "
                        "instead of failing")
    p.add_argument("--planners", default="all",
                   help=f"comma-separated planners to compare (default: all, i.e. {', '.join(DEFAULT_PLANNERS)})")
    p.add_argument("--main", help="the planner the speedups are relative to (default: the first of --planners)")
    p.add_argument("--time-limit", type=float, default=1.0, metavar="SEC", help="planning time limit per step (default 1)")
    p.add_argument("--json", action="store_true", help="rows, summary, compute floor and config as JSON")
    add_cost_args(p)
    add_pipeline_args(p)

    def cmd_simulate(args) -> int:
        from megatron_ext.planner.pipeline_api import PP_PLANNERS
        from megatron_ext.sim.table import simulate_table

        if args.batch < 1 or args.steps < 1:
            raise ConfigError(f"--batch and --steps must be at least 1, got {args.batch} and {args.steps}")
        if args.drop_over_max and not args.lengths:
            raise ConfigError("--drop-over-max applies to --lengths: --dist samples and --data cuts its documents "
                              "within --max-seq-len")
        planners = DEFAULT_PLANNERS if args.planners == "all" else tuple(x.strip() for x in args.planners.split(","))
        check_args(args, pipelines=any(x in PP_PLANNERS for x in planners))
        cost = cost_from_args(args)
        opts = pipeline_options_from_args(args)
        lengths = None
        if args.lengths:
            lengths = _limited(read_lengths(args.lengths), args, cost, planners, opts)
        out = simulate_table(cost, lengths=lengths, dist=args.dist, data=args.data, batch=args.batch, steps=args.steps,
                             seed=args.seed,
                             max_seq_len=args.max_seq_len, planners=planners, main=args.main, options=opts,
                             time_limit=opts.time_limit, keep_plans=bool(args.plot or args.trace))
        print(json.dumps({k: out[k] for k in ("config", "summary", "floor", "rows")}, indent=1) if args.json else out["table"])
        if args.plot or args.trace:
            main = out["config"]["main"]
            first = out["plans"].get(main)
            if first is None:
                raise ConfigError(f"{'--plot' if args.plot else '--trace'}: {main} could not plan the first step, "
                                  f"nothing to draw")
            plan, lens = first
            trace_if_asked(args, plan, lens, cost)
        if args.plot:
            import sys

            from megatron_ext.sim.plot import plot_comparison

            try:
                plot_comparison(plan, lens, cost, out["summary"], main, args.plot, out["config"]["source"],
                                b1_scale=opts.b1_scale)
            except OSError as e:
                raise ConfigError(f"cannot write the plot to {args.plot}: {e.strerror or e}") from None
            print(f"plot of {main}'s first step written to {args.plot}", file=sys.stderr)
        return 0

    p.set_defaults(func=cmd_simulate)


def _limited(lengths: np.ndarray, args, cost, planners, opts) -> np.ndarray:
    """A lengths file's batch within ``--max-seq-len`` (default: what every planner can run), its
    longer sequences dropped with ``--drop-over-max`` (a note on stderr says how many)."""
    import sys

    from megatron_ext.planner.pipeline_api import max_seq_len

    limit = args.max_seq_len or min(max_seq_len(name, cost, opts) for name in planners)
    over = lengths > limit
    if not over.any():
        return lengths
    what = "--max-seq-len" if args.max_seq_len else "the longest every planner can run,"
    if not args.drop_over_max:
        raise LengthsError(f"{int(over.sum())} sequence(s) of {args.lengths} exceed {what} {limit} tokens "
                           f"(longest {int(lengths.max())}); use --drop-over-max to drop them")
    if over.all():
        raise LengthsError(f"every sequence of {args.lengths} exceeds {what} {limit} tokens: nothing to simulate")
    print(f"dropped {int(over.sum())} sequence(s) over {limit} tokens", file=sys.stderr)
    return lengths[~over]
