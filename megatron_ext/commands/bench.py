"""`megatron-ext bench planner`: planner latency and plan quality, as a table.

For each distribution and seed: the plan's solve time, its estimated step time, the ratio to the
lower bound and its speedup over every baseline, all timed with the same cost model. A scale row
plans 8,192 sequences on 1,024 GPUs of the same kind. With ``--gpus``, a table across cluster
sizes instead: per GPU count and distribution, plan time against the limit, the step against three
bounds (cost/bounds.py), and where the rest of the step goes (commands/scale.py), for the planner
and the barrier-free ``timelines`` next to it (at ZeRO 0/1/2; at ZeRO-3 the table says why not).
"""
from __future__ import annotations

import dataclasses
import json
import statistics

import numpy as np

from megatron_ext.commands.args import (MAX_BATCHES, add_cost_args, add_planner_args, cost_from_args, options_from_args,
                                        parse_tokens)
from megatron_ext.commands.scale import bench_scale, parse_gpu_counts, scaled_cost
from megatron_ext.cost import CostModel
from megatron_ext.data.lengths import DISTRIBUTIONS, sample_lengths
from megatron_ext.errors import ConfigError, InfeasibleError
from megatron_ext.planner import PlannerOptions, make_plan
from megatron_ext.planner.api import BASELINES, planner_names

SCALE_GPUS, SCALE_SEQS = 1024, 8192


def add_bench_command(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks that print tables")
    bsub = b.add_subparsers(dest="what", required=True)
    bp = bsub.add_parser("planner", help="planner latency and quality against the lower bound and baselines")
    bp.add_argument("--dist", default="wikipedia,commoncrawl,github",
                    help="comma-separated distributions (default: wikipedia,commoncrawl,github)")
    bp.add_argument("--batches", type=int, default=5, help="batches per distribution (default: %(default)s)")
    bp.add_argument("--batch", type=int, help="sequences per batch (default 512; with --gpus, --per-gpu instead)")
    bp.add_argument("--max-seq-len", type=parse_tokens, default=parse_tokens("384K"), metavar="L",
                    help="longest sampled sequence (default: 384K); longer ones than the cluster holds are dropped")
    bp.add_argument("--no-scale", action="store_true", help="skip the 1,024-GPU / 8,192-sequence row")
    bp.add_argument("--gpus", metavar="N,N,...",
                    help="a table across cluster sizes instead: the cluster scaled to each GPU count, "
                         "--per-gpu sequences per GPU, --planner and timelines (barrier-free: at --zero-stage 0-2 "
                         "only), no baselines")
    bp.add_argument("--per-gpu", type=int, help="with --gpus: sequences per GPU in a batch (default: 8)")
    bp.add_argument("--json", action="store_true", help="the rows, summary and scale row as JSON")
    add_cost_args(bp)
    add_planner_args(bp, kinds=("sp",), drop_over_max=False)  # (its batches drop what no group holds)
    bp.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    if not 1 <= args.batches <= MAX_BATCHES:
        raise ConfigError(f"--batches must be from 1 to {MAX_BATCHES:,}, got {args.batches}")
    if args.planner not in planner_names("sp"):  # (the bounds, baselines and shares are of micro-batch plans)
        raise ConfigError(f"bench planner measures FlexSP-kind planners ({', '.join(planner_names('sp'))}), not "
                          f"{args.planner}; compare pipeline planners and auto with `megatron-ext simulate`")
    if args.per_gpu is not None and args.gpus is None:
        raise ConfigError("--per-gpu applies with --gpus (the table across cluster sizes); without it, --batch "
                          "sets the sequences per batch")
    unused = [flag for flag, given in (("--batch", args.batch is not None), ("--no-scale", args.no_scale),
                                       ("--static-degree", args.static_degree is not None)) if given]
    if args.gpus is not None and unused:
        raise ConfigError(f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not apply with --gpus (a table "
                          f"across cluster sizes: --per-gpu sequences per GPU, no baselines, no scale row)")
    gpus = parse_gpu_counts(args.gpus) if args.gpus is not None else None
    dists = list(dict.fromkeys(d.strip() for d in args.dist.split(",")))  # (each once, in order)
    unknown = [d for d in dists if d not in DISTRIBUTIONS]  # (found at its turn, after the others' batches)
    if unknown:
        raise ConfigError(f"--dist {args.dist!r}: unknown length distribution{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(map(repr, unknown))}; give comma-separated names of {', '.join(DISTRIBUTIONS)}")
    cost = cost_from_args(args, max(gpus) if gpus else None if args.no_scale else SCALE_GPUS)
    if args.static_degree is not None:  # (else refused as "a 16-sequence batch" cannot run it)
        cost.check_degree(args.static_degree)
    if args.gpus is not None:
        result = bench_scale(cost, gpus=gpus, dists=dists,
                             batches=args.batches, per_gpu=8 if args.per_gpu is None else args.per_gpu, max_seq_len=args.max_seq_len,
                             options=options_from_args(args),
                             planners=tuple(dict.fromkeys((args.planner, "timelines"))))
        print(json.dumps(result, indent=1) if args.json else result["table"])
        return 0
    result = bench_planner(cost, dists=dists, batches=args.batches,
                           batch=512 if args.batch is None else args.batch,
                           max_seq_len=args.max_seq_len, options=options_from_args(args), planner=args.planner,
                           scale=not args.no_scale)
    print(json.dumps(result, indent=1) if args.json else result["table"])
    return 0


def _row(planner: str, lengths: np.ndarray, cost: CostModel, options: PlannerOptions, baselines) -> dict:
    plan = make_plan(planner, lengths, cost, options, baselines=baselines)
    for b, v in plan.baselines.items():  # a table of speedups needs every baseline on every batch
        if "error" in v:
            raise InfeasibleError(f"baseline {b} cannot run a {len(lengths)}-sequence batch: {v['error']}")
    return {
        "seqs": len(lengths), "tokens": int(lengths.sum()), "dropped": len(plan.dropped_seq_ids),
        "micro_batches": len(plan.micro_batches), "solve_time_s": plan.solve_time_s,
        "step_time_s": plan.estimated_step_time_s, "lower_bound_s": plan.lower_bound_step_time_s,
        "ratio_to_bound": plan.estimated_step_time_s / plan.lower_bound_step_time_s,
        "status": plan.solver_status,
        "speedup": {b: v["speedup"] for b, v in plan.baselines.items()},
    }


def bench_planner(cost: CostModel, dists: list[str], batches: int, batch: int, max_seq_len: int,
                  options: PlannerOptions, planner: str = "flexsp", scale: bool = True) -> dict:
    options = dataclasses.replace(options, drop_over_max=True)
    baselines = tuple(b for b in BASELINES if b != planner)
    rows = []
    for dist in dists:
        for seed in range(batches):
            lengths = sample_lengths(dist, batch, seed, max_seq_len)
            rows.append({"dist": dist, "seed": seed, **_row(planner, lengths, cost, options, baselines)})
    scale_row = None
    if scale:
        big_cost = scaled_cost(cost, SCALE_GPUS)
        lengths = sample_lengths(dists[0], SCALE_SEQS, 0, max_seq_len)
        scale_row = {"dist": dists[0], "seed": 0, "num_gpus": big_cost.num_gpus,
                     **_row(planner, lengths, big_cost, options, ())}

    head = (f"{planner} on {cost.model.name} / {cost.cluster.name} ({cost.num_gpus} GPUs), batch {batch}, "
            f"max length {max_seq_len:,}, time limit {options.time_limit:g} s")
    cols = f"{'dist':<12}{'seed':>4}{'drop':>5}{'mbs':>4}{'plan ms':>9}{'step s':>9}{'bound s':>9}{'x bound':>8}" + \
        "".join(f"{'vs ' + b:>24}" for b in baselines)
    lines = [head, "", cols]
    for r in rows:
        lines.append(f"{r['dist']:<12}{r['seed']:>4}{r['dropped']:>5}{r['micro_batches']:>4}"
                     f"{r['solve_time_s'] * 1e3:>9.0f}{r['step_time_s']:>9.2f}{r['lower_bound_s']:>9.2f}"
                     f"{r['ratio_to_bound']:>8.3f}" + "".join(f"{r['speedup'][b]:>23.2f}x" for b in baselines))
    summary = {
        "median_solve_time_s": statistics.median(r["solve_time_s"] for r in rows),
        "max_solve_time_s": max(r["solve_time_s"] for r in rows),
        "median_ratio_to_bound": statistics.median(r["ratio_to_bound"] for r in rows),
        "max_ratio_to_bound": max(r["ratio_to_bound"] for r in rows),
        "min_speedup": {b: min(r["speedup"][b] for r in rows) for b in baselines},
        "median_speedup": {b: statistics.median(r["speedup"][b] for r in rows) for b in baselines},
    }
    lines += ["", f"plan time: median {summary['median_solve_time_s'] * 1e3:.0f} ms, "
                  f"max {summary['max_solve_time_s'] * 1e3:.0f} ms",
              f"step time / lower bound: median {summary['median_ratio_to_bound']:.3f}, "
              f"max {summary['max_ratio_to_bound']:.3f}"]
    for b in baselines:
        lines.append(f"speedup over {b}: median {summary['median_speedup'][b]:.2f}x, "
                     f"min {summary['min_speedup'][b]:.2f}x")
    if scale_row:
        lines.append(f"scale: {scale_row['seqs']:,} sequences on {scale_row['num_gpus']:,} GPUs planned in "
                     f"{scale_row['solve_time_s']:.2f} s ({scale_row['ratio_to_bound']:.3f}x bound, "
                     f"{scale_row['micro_batches']} micro-batches)")
    return {"rows": rows, "summary": summary, "scale": scale_row, "table": "\n".join(lines)}
