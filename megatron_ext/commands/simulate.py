"""``megatron-ext simulate``: many steps, every planner, one table (``--json``: its rows, summary,
compute floor and config); ``table.simulate_table`` computes it."""
from __future__ import annotations

import json
import sys

import numpy as np

from megatron_ext.commands.args import (MAX_BATCHES, add_batch_source_args, add_cost_args, add_pipeline_args, check_args,
                                        cost_from_args, parse_tokens, pipeline_options_from_args)
from megatron_ext.commands.plan import print_notes, trace_if_asked
from megatron_ext.commands.table import DEFAULT_PLANNERS, simulate_table
from megatron_ext.data.lengths import read_lengths
from megatron_ext.errors import ConfigError, InfeasibleError, LengthsError
from megatron_ext.text import plural


def add_simulate_command(sub) -> None:
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
                   help=f"comma-separated planners to compare (default: all, i.e. {', '.join(DEFAULT_PLANNERS)}, "
                        f"and timelines under ZeRO 0/1/2)")
    p.add_argument("--main", help="the planner the speedups are relative to (default: the first of --planners)")
    p.add_argument("--time-limit", type=float, default=1.0, metavar="SEC", help="planning time limit per step (default 1)")
    p.add_argument("--json", action="store_true", help="rows, summary, compute floor and config as JSON")
    add_cost_args(p)
    add_pipeline_args(p)
    p.set_defaults(func=cmd_simulate)


def cmd_simulate(args) -> int:
    if args.batch < 1 or not 1 <= args.steps <= MAX_BATCHES:
        raise ConfigError(f"--batch must be at least 1 and --steps from 1 to {MAX_BATCHES:,}, got {args.batch} "
                          f"and {args.steps}")
    if args.drop_over_max and not args.lengths:
        raise ConfigError("--drop-over-max applies to --lengths: --dist samples and --data cuts its documents "
                          "within --max-seq-len")
    planners = DEFAULT_PLANNERS if args.planners == "all" else tuple(x.strip() for x in args.planners.split(","))
    check_args(args, planners)
    cost = cost_from_args(args)
    if args.planners == "all" and cost.zero_stage < 3:  # FlexSP without barriers runs here too
        planners += ("timelines",)
    opts = pipeline_options_from_args(args)
    lengths = None
    if args.lengths:
        lengths = _limited(read_lengths(args.lengths), args, cost, planners, opts)
    out = simulate_table(cost, lengths=lengths, dist=args.dist, data=args.data, batch=args.batch, steps=args.steps,
                         seed=args.seed,
                         max_seq_len=args.max_seq_len, planners=planners, main=args.main, options=opts,
                         time_limit=opts.time_limit, keep_plans=bool(args.plot or args.trace))
    text = json.dumps({k: out[k] for k in ("config", "summary", "floor", "rows")}, indent=1) if args.json else out["table"]
    if all("error" in s for s in out["summary"]):  # (the table says why, planner by planner)
        print(text)
        raise InfeasibleError(f"no planner could plan any step: {', '.join(s['planner'] for s in out['summary'])} "
                              f"infeasible")
    notes = []  # (the files first: a reader that closes stdout early, `| head`, must not lose them)
    if args.plot or args.trace:
        main = out["config"]["main"]
        first = out["plans"].get(main)
        if first is None:
            print(text)
            raise ConfigError(f"{'--plot' if args.plot else '--trace'}: {main} could not plan the first step, "
                              f"nothing to draw")
        plan, lens = first
        notes.append(trace_if_asked(args, plan, lens, cost))
    if args.plot:
        from megatron_ext.commands.plot import plot_comparison

        try:
            plot_comparison(plan, lens, cost, out["summary"], main, args.plot, out["config"]["source"],
                            b1_scale=opts.b1_scale)
        except OSError as e:
            raise ConfigError(f"cannot write the plot to {args.plot}: {e.strerror or e}") from None
        notes.append(f"plot of {main}'s first step written to {args.plot}")
    unplanned = out["config"]["unplanned_steps"]
    if unplanned:  # (the exit status says the rest ran; the rows of --json, each step's error)
        notes.append(f"warning: no planner could plan {len(unplanned)} of {plural(out['config']['steps'], 'step')} "
                     f"({'step' if len(unplanned) == 1 else 'steps'} {', '.join(map(str, unplanned))}): every figure "
                     f"leaves them out")
    print(text)
    print_notes(notes)
    return 0


def _limited(lengths: np.ndarray, args, cost, planners, opts) -> np.ndarray:
    """A lengths file's batch within ``--max-seq-len`` (default: what every planner can run), its
    longer sequences dropped with ``--drop-over-max`` (a note on stderr says how many)."""
    from megatron_ext.planner.api import max_seq_len

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
