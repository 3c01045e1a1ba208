"""``megatron-ext plan``: plan one step from lengths and print the StepPlan.

A FlexSP-kind planner's plan prints as a table of micro-batches and SP groups,
a pipeline planner's (elastic_pp, seq1f1b, batch_1f1b, auto) as a summary with the simulated
bubble, recompute and memory (``describe_plan``) and what each pipeline runs
(``pipeline_tables``); ``--json`` prints the StepPlan JSON instead. ``--plot FILE.png`` draws the
plan (``plot.py``), ``--trace FILE.json`` writes its simulated timeline as a Chrome trace.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

from megatron_ext.commands.args import (add_batch_source_args, add_cost_args, add_pipeline_args, add_planner_args,
                                        check_args, cost_from_args, options_from_args, parse_tokens, positive_int,
                                        pipeline_options_from_args)
from megatron_ext.cost import CostModel
from megatron_ext.data.batches import MAX_STEP, dataset_batches
from megatron_ext.data.lengths import MAX_BATCH, MAX_SEED, read_lengths, sample_lengths
from megatron_ext.errors import ConfigError
from megatron_ext.plan.validate import replica_groups
from megatron_ext.planner import make_plan
from megatron_ext.planner.api import PIPELINE_KINDS, get_planner, group_limit, max_seq_len, planner_names
from megatron_ext.planner.api import BASELINES
from megatron_ext.text import plural

PAST_LIMIT = 1.5  # a pipeline plan this many times its time limit gets a note on stderr
SHOWN_CHUNKS = 40  # chunks `plan` lists per pipeline unless --chunks says otherwise (a plan may have thousands)
SHOWN_PIPELINES = 8  # pipelines `plan` describes unless --pipelines says otherwise (4,096 GPUs: 512 replicas)


def add_plan_command(sub) -> None:
    p = sub.add_parser("plan", help="plan one step from lengths and print the StepPlan")
    add_batch_source_args(p, default_dist="wikipedia")
    p.add_argument("--step", type=int, default=0, metavar="K",
                   help="with --dist: the batch of seed + K (simulate's step K with the same --dist, --seed and "
                        "--max-seq-len); with --data: step K of a training run on it (default 0)")
    p.add_argument("--max-seq-len", type=parse_tokens, metavar="L",
                   help="longest sequence, e.g. 384K (default: the longest the planner can run on the cluster; "
                        "with --data, needed: the length training cuts documents at)")
    p.add_argument("--json", action="store_true", help="print the StepPlan JSON")
    p.add_argument("--no-baselines", action="store_true", help="skip timing the baselines")
    p.add_argument("--chunks", type=_count_or_all("chunks"), metavar="N",
                   help=f"pipeline plans: chunks listed per pipeline, its first and last ones (default {SHOWN_CHUNKS}; "
                        f"all: every one; --json: the whole plan)")
    p.add_argument("--pipelines", type=_count_or_all("pipelines"), metavar="N",
                   help=f"pipeline plans: pipelines described, the first ones (default {SHOWN_PIPELINES}; all: every "
                        f"one; --json: the whole plan)")
    add_cost_args(p)
    add_planner_args(p)
    add_pipeline_args(p)
    p.set_defaults(func=cmd_plan)


def _count_or_all(what: str):
    def parse(text: str) -> int | str:
        if text.strip().lower() == "all":
            return "all"
        try:
            return positive_int(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected a positive number of {what} or 'all', got {text!r}") from None
    return parse


def _shown(given: int | str | None, default: int) -> int | None:
    """``--chunks`` / ``--pipelines``: how many are listed (None: all)."""
    return None if given == "all" else given or default


def cmd_plan(args) -> int:
    pipelines = get_planner(args.planner).kind in PIPELINE_KINDS
    check_args(args, (args.planner,))
    for flag, given in (("--chunks", args.chunks), ("--pipelines", args.pipelines)):
        if given is not None and not pipelines:
            raise ConfigError(f"{flag} applies only to pipeline plans ({', '.join(planner_names(*PIPELINE_KINDS))}), "
                              f"not to {args.planner}")
    cost = cost_from_args(args)
    if args.static_degree is not None:
        if args.planner != "static_ulysses" and args.no_baselines:  # (it was ignored)
            raise ConfigError(f"--static-degree is static_ulysses's degree: it applies to --planner static_ulysses "
                              f"or its baseline row, which --no-baselines leaves out of {args.planner}'s plan")
        cost.check_degree(args.static_degree)
    options = pipeline_options_from_args(args) if pipelines else options_from_args(args)  # (refused before drawing)
    limit = args.max_seq_len or max_seq_len(args.planner, cost, options if pipelines else None)
    lengths, drawn = lengths_from_args(args, limit)
    if pipelines:
        return run_pp_plan(args, cost, lengths, drawn)
    if args.planner == "flexsp":
        _note_if_too_big(lengths[lengths <= cost.max_seq_len], cost, options.time_limit)
    plan = make_plan(args.planner, lengths, cost, options, baselines=() if args.no_baselines else BASELINES)
    notes = [drawn, plot_if_asked(args, plan, lengths, cost), trace_if_asked(args, plan, lengths, cost)]
    held = group_limit(args.planner, cost, args.static_degree)  # (what it dropped past)
    print(plan.to_json(indent=1) if args.json else
          _plan_table(plan, lengths, cost, min(held, args.max_seq_len or held)))
    print_notes(notes)
    return 0


def lengths_from_args(args, limit: int) -> tuple[np.ndarray, str | None]:
    """The batch of ``--lengths FILE`` (refused if over ``--max-seq-len`` without ``--drop-over-max``;
    the planners drop or refuse what they cannot run), step ``--step`` of ``--data`` (documents
    cut into pieces of at most ``--max-seq-len``, as training cuts them), or sampled from
    ``--dist`` up to ``limit`` with the seed ``simulate`` gives that step; and a note of where a
    drawn batch came from (None for a file's)."""
    if not 0 <= args.step <= MAX_STEP:
        raise ConfigError(f"--step must be a step number, from 0 to {MAX_STEP:,}, got {args.step:,}")
    if args.data:
        if not 1 <= args.batch <= MAX_BATCH:
            raise ConfigError(f"--batch must be from 1 to {MAX_BATCH:,} sequences, got {args.batch:,}")
        batches, source = dataset_batches(args.data, args.batch, limit, args.seed, range(args.step, args.step + 1))
        return batches[0], f"batch: {source}"
    if args.lengths:
        lengths = read_lengths(args.lengths)
        if args.max_seq_len:
            over = lengths > args.max_seq_len
            if over.any() and not args.drop_over_max:
                raise ConfigError(f"{int(over.sum())} sequence(s) exceed --max-seq-len {args.max_seq_len} "
                                  f"(longest {int(lengths.max())}); use --drop-over-max to drop them")
        return lengths, None
    if 0 <= args.seed <= MAX_SEED < args.seed + args.step:  # (step K draws from seed + K)
        raise ConfigError(f"--seed {args.seed} + --step {args.step} passes the largest seed, 2^63 - 1: use a smaller "
                          f"seed")
    lengths = sample_lengths(args.dist, args.batch, args.seed + args.step, limit)
    return lengths, (f"batch: {plural(len(lengths), 'sequence')} of --dist {args.dist}, seed {args.seed + args.step}, "
                     f"documents cut at {limit:,} tokens")


def _note_if_too_big(lengths: np.ndarray, cost: CostModel, time_limit: float) -> None:
    """A note on stderr where flexsp's first plan alone, which its time limit cannot cut short,
    takes longer here than the limit (a batch of a million sequences)."""
    from megatron_ext.planner.sp.flexsp import first_plan_seconds

    need = first_plan_seconds(lengths, cost) if len(lengths) else 0.0
    if need > time_limit:
        print(f"note: planning {len(lengths):,} sequences takes about {need:.2g} s here (flexsp's first plan, which "
              f"its time limit cannot cut short); --time-limit {time_limit:g} is too short", file=sys.stderr)


def _head(plan, lengths, cost) -> str:
    """What was planned: the sequences kept (those dropped said apart), the model and cluster."""
    dropped = np.asarray(plan.dropped_seq_ids, dtype=np.int64)
    kept = len(lengths) - len(dropped)
    tokens = int(lengths.sum() - lengths[dropped].sum())
    return (f"{plan.planner} plan for {plural(kept, 'sequence')} ({plural(tokens, 'token')}"
            f"{f'; {len(dropped):,} dropped' if len(dropped) else ''}) of {cost.model_on_cluster} "
            f"({cost.num_gpus} GPUs)")


def _bound_name(plan) -> str:
    """What a plan's ``lower_bound_step_time_s`` bounds: auto's, every candidate it could choose."""
    return "lower bound of every candidate" if plan.planner == "auto" else "lower bound"


def _plan_table(plan, lengths, cost, limit: int) -> str:
    """``limit``: the length past which the planner dropped sequences."""
    lines = [_head(plan, lengths, cost), ""]
    if plan.barrier_free:  # no micro-batch barrier: row k is each GPU set's k-th pass, its slowest timed
        lines.append(f"{'pass':>4} {'time s':>7}  groups (degree x count: sequences, tokens), each from when its "
                     f"GPUs are free")
    else:
        lines.append(f"{'mb':>3} {'time s':>8}  groups (degree x count: sequences, tokens)")
    for m, mb in enumerate(plan.micro_batches):
        by_deg: dict[int, list] = {}
        for g in mb.groups:
            by_deg.setdefault(g.degree, []).append(g)
        parts = []
        for d in sorted(by_deg, reverse=True):
            gs = by_deg[d]
            nseq = sum(len(g.seq_ids) for g in gs)
            tok = sum(int(lengths[g.seq_ids].sum()) for g in gs)
            parts.append(f"{d}x{len(gs)}: {nseq} seq, {tok:,} tok")
        lines.append(f"{m:>3} {mb.estimated_time_s:>8.3f}  " + "; ".join(parts))
    lb = plan.lower_bound_step_time_s
    rb = plan.relaxed_bound_step_time_s
    bound = _bound_name(plan)
    lines += ["", f"estimated step time {plan.estimated_step_time_s:.3f} s   {bound} {lb:.3f} s "
              f"({plan.estimated_step_time_s / lb:.3f}x)   solved in {plan.solve_time_s * 1e3:.0f} ms "
              f"[{plan.solver_status}]"]
    if rb > 0:
        lines.append(f"any-degree bound {rb:.3f} s ({plan.estimated_step_time_s / rb:.3f}x): any number of GPUs per "
                     f"sequence, no head limit")
    if plan.dropped_seq_ids:
        lines.append(f"dropped {len(plan.dropped_seq_ids)} sequence(s) over the {limit}-token limit: "
                     f"ids {plan.dropped_seq_ids[:10]}{' ...' if len(plan.dropped_seq_ids) > 10 else ''}")
    if plan.baselines:
        lines += ["", f"{'baseline':<22} {'step s':>8} {'mbs':>4} {'speedup of ' + plan.planner:>20}"]
        for name, b in plan.baselines.items():
            lines.append(f"{name:<22} infeasible: {b['error']}" if "error" in b else
                         f"{name:<22} {b['estimated_step_time_s']:>8.3f} {b['num_micro_batches']:>4} "
                         f"{b['speedup']:>19.2f}x")
    return "\n".join(lines)


def run_pp_plan(args, cost, lengths, drawn: str | None = None) -> int:
    """``plan`` with a pipeline planner (elastic_pp, seq1f1b, batch_1f1b, auto): plans, times the
    baselines, prints the summary (or the StepPlan JSON with ``--json``), and draws the plan with
    ``--plot FILE.png``; ``drawn``: the note of where the batch came from."""
    from megatron_ext.planner.api import PP_BASELINES
    from megatron_ext.planner.options import PlannerOptions
    from megatron_ext.sim import simulate

    opts = pipeline_options_from_args(args)
    drop = PlannerOptions(time_limit=opts.time_limit, static_degree=getattr(args, "static_degree", None),
                          drop_over_max=getattr(args, "drop_over_max", False),
                          max_seq_len=getattr(args, "max_seq_len", None))
    overrides = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}
    plan = make_plan(args.planner, lengths, cost, drop, baselines=() if getattr(args, "no_baselines", False)
                     else PP_BASELINES, kinds=PIPELINE_KINDS, **overrides)
    _add_drop_to_compare_hint(plan, args)
    if plan.pipelines and plan.solve_time_s > PAST_LIMIT * opts.time_limit:  # (a run's loader falls back then)
        replicas = len({p.replica for p in plan.pipelines})
        each = f", every one of its {replicas:,} replicas needs one" if replicas > 1 else ""
        print(f"note: planned in {plan.solve_time_s:.2g} s, past --time-limit {opts.time_limit:g}: a pipeline search "
              f"is not cut short before its first candidate{each}, and building and checking "
              f"{sum(len(p.chunks) for p in plan.pipelines):,} chunks ({plural(len(lengths), 'sequence')}, the longest "
              f"{int(lengths.max()):,} tokens) takes that long here; raise --time-limit, or plan fewer or shorter "
              f"sequences", file=sys.stderr)
    notes = [drawn, plot_if_asked(args, plan, lengths, cost), trace_if_asked(args, plan, lengths, cost)]
    if getattr(args, "json", False):
        print(plan.to_json(indent=1))
    else:
        res = simulate(plan, lengths, cost, b1_scale=opts.b1_scale, events=False)
        shown = _shown(getattr(args, "pipelines", None), SHOWN_PIPELINES)
        print(_head(plan, lengths, cost) + "\n")
        print(describe_plan(plan, lengths, res, max_pipelines=shown))
        if plan.pipelines:
            print("\n" + pipeline_tables(plan, lengths, cost, opts.b1_scale, max_chunks=_shown(
                getattr(args, "chunks", None), SHOWN_CHUNKS), max_pipelines=shown))
    print_notes(notes)
    return 0


def _add_drop_to_compare_hint(plan, args) -> None:
    """A baseline that cannot run the batch's longest sequence names the --max-seq-len to compare
    at (``planner.api``); a lengths file over it is refused without --drop-over-max, so the hint
    names both."""
    if not getattr(args, "lengths", None) or getattr(args, "drop_over_max", False):
        return
    for b in plan.baselines.values():
        if b.get("error", "").endswith(")") and "pass --max-seq-len " in b["error"]:
            b["error"] = b["error"][:-1] + " --drop-over-max)"


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


def _more_pipelines(plan, shown: int | None) -> list[str]:
    """The line saying how many pipelines were left out (none where all were shown)."""
    left = len(plan.pipelines) - (len(plan.pipelines) if shown is None else shown)
    return [f"  ... {plural(left, 'more pipeline')} (--pipelines all describes them; --json gives the whole plan)"] \
        if left > 0 else []


def pipeline_tables(plan, lengths, cost, b1_scale: float = 1.0, max_pieces: int = 4,
                    max_chunks: int | None = None, max_pipelines: int | None = None) -> str:
    """What each pipeline of a plan runs: its chunks (kind, tokens, average-stage time, layers
    each stage recomputes, pieces as ``seq[start:end)``) and every stage's operation order. With
    ``max_chunks``, a pipeline of more chunks lists its first three quarters of that many and its
    last quarter, and each stage's order only its first operations; with ``max_pipelines``, only
    the first that many pipelines."""
    from megatron_ext.cost.pipeline import PipelineCost
    from megatron_ext.sim.engine import analyze_chunks

    lengths = np.asarray(lengths)
    groups = replica_groups(plan, plan.num_gpus)
    out = []
    for i, p in enumerate(plan.pipelines[:max_pipelines]):
        pc = PipelineCost(cost, p.stages, p.sp_degree, b1_scale)
        table = analyze_chunks(p.chunks, pc, f"pipeline {i}")
        ms = pc.stage_ms(table.work, table.tokens)
        rep = f" (replica {p.replica})" if len(groups) > 1 else ""
        n = len(p.chunks)
        shown = range(n) if max_chunks is None or n <= max_chunks else \
            [*range(max_chunks - max_chunks // 4), *range(n - max_chunks // 4, n)]
        rec = [c.recompute_layers_per_stage or [0] * p.stages for c in p.chunks]
        recomputes = any(any(r) for r in rec)
        digits = max(len(str(x)) for r in rec for x in r)  # (stages in aligned columns: ties show as diagonals)
        width = max(len("recompute"), p.stages * (digits + 1) - 1)
        out += [f"pipeline {i}{rep} chunks (forward order; ms: forward+backward on an average stage"
                + (f"; recompute: layers of {cost.model.num_layers // p.stages} each stage recomputes, . = none):"
                   if recomputes else "; no stage recomputes):"),
                f"  {'chunk':>5}  {'kind':<7} {'tokens':>9} {'ms':>8}  "
                + (f"{'recompute':<{width}}  " if recomputes else "") + "pieces (sequence[start:end))"]
        for k, j in enumerate(shown):
            if k and j != shown[k - 1] + 1:
                out.append(f"  {'...':>5}  {plural(j - shown[k - 1] - 1, 'chunk')} not listed "
                           f"(--chunks all lists them; --json gives the whole plan)")
            c = p.chunks[j]
            pieces = [f"{x.seq_id}[{x.start}:{x.end})" for x in c.pieces[:max_pieces]]
            more = len(c.pieces) - max_pieces
            if more > 0:
                pieces.append(f"+{plural(more, 'whole sequence')}"
                              if all(x.start == 0 and x.end == lengths[x.seq_id] for x in c.pieces[max_pieces:])
                              else f"+{more} more")
            cells = " ".join(str(x or ".").rjust(digits) for x in rec[j])
            layers = f"{cells:<{width}}  " if recomputes else ""
            out.append(f"  {c.id:>5}  {_chunk_kind(c, lengths):<7} {int(table.tokens[j]):>9,} {ms[j]:>8.1f}  "
                       f"{layers}{', '.join(pieces)}")
        out.append(f"pipeline {i} order per stage (F3 / B3: forward / backward of chunk 3):")
        for st, order in enumerate(p.order_per_stage):
            cut = len(order) if len(shown) == n else 2 * len(shown)
            out += _wrap(f"  stage {st}:", order[:cut] + ([f"... +{len(order) - cut:,} more"] if cut < len(order) else []))
    return "\n".join(out + _more_pipelines(plan, max_pipelines))


def _status_lines(head: str, status: str) -> list[str]:
    # a status names every pipeline and every alternative auto timed: wrapped at its clauses
    clauses = status.split("; ")
    return _wrap(head, [c + ";" for c in clauses[:-1]] + clauses[-1:], width=110)


def describe_plan(plan, lengths, result=None, max_pipelines: int | None = None) -> str:
    """A readable summary of a pipeline plan, or of an ``auto`` plan of either kind, with the
    simulated bubble, recompute and memory of ``result`` (a SimResult) if given; with
    ``max_pipelines``, a line for each of the first that many pipelines only."""
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
    for i, p in enumerate(plan.pipelines[:max_pipelines]):
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
    lines += _more_pipelines(plan, max_pipelines)
    idle = [r for r, pipes in enumerate(groups) if not pipes] if len(groups) > 1 else []
    if idle:
        lines.append(f"  replica{'s' if len(idle) > 1 else ''} {', '.join(map(str, idle))}: idle (fewer sequences "
                     f"than replicas)")
    if plan.dropped_seq_ids:
        ids = plan.dropped_seq_ids
        lines.append(f"dropped {plural(len(ids), 'sequence')} over the length limit "
                     f"({int(lengths[ids].max()):,} tokens the longest): ids {ids[:10]}{' ...' if len(ids) > 10 else ''}")
    bound = _bound_name(plan)
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


def print_notes(notes) -> None:
    """The notes of the files written (``plot_if_asked``, ``trace_if_asked``: None where none was),
    on stderr. The files are written before stdout's output, so that a reader that closes it early
    (``| head``) does not lose them."""
    for note in notes:
        if note:
            print(note, file=sys.stderr)


def plot_if_asked(args, plan, lengths, cost) -> str | None:
    """``--plot FILE``: draw ``plan`` (any kind) to FILE; returns the note saying where."""
    path = getattr(args, "plot", None)
    if not path:
        return None
    from megatron_ext.commands.plot import plot_plan

    opts = pipeline_options_from_args(args)
    try:
        plot_plan(plan, lengths, cost, path, b1_scale=opts.b1_scale)
    except OSError as e:
        raise ConfigError(f"cannot write the plot to {path}: {e.strerror or e}") from None
    return f"plot written to {path}"


def trace_if_asked(args, plan, lengths, cost) -> str | None:
    """``--trace FILE``: ``plan``'s simulated timeline as a Chrome trace in FILE; returns the note
    saying where."""
    path = getattr(args, "trace", None)
    if not path:
        return None
    from megatron_ext.sim.trace import plan_trace_events, trace_document, write_trace

    events = plan_trace_events(plan, lengths, cost, b1_scale=pipeline_options_from_args(args).b1_scale)
    try:
        write_trace(path, trace_document(events, model=cost.model.name, cluster=cost.cluster.name))
    except OSError as e:
        raise ConfigError(f"cannot write the trace to {path}: {e.strerror or e}") from None
    return f"trace of {plan.planner}'s plan written to {path} (open it in ui.perfetto.dev)"
