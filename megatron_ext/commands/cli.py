"""`megatron-ext`: plan and benchmark adaptive sequence-parallel steps.

Every command prints a readable table, or JSON with --json. Bad input is one line on stderr and
exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.data.batches import dataset_batches
from megatron_ext.data.lengths import read_lengths, sample_lengths
from megatron_ext.errors import ConfigError, MegatronExtError
from megatron_ext.planner import PLANNERS, PlannerOptions, make_plan
from megatron_ext.planner.api import BASELINES
from megatron_ext.sim.commands import (add_batch_source_args, add_pipeline_args, add_simulate_command, plot_if_asked,
                                       trace_if_asked)
from megatron_ext.text import plural


def parse_tokens(text: str) -> int:
    """'384K' -> 393216, '1M' -> 1048576, '8192' -> 8192."""
    t = text.strip().upper()
    scale = {"K": 1024, "M": 1024**2}.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if scale > 1 else t) * scale)
    except (ValueError, OverflowError):  # not a number, or inf / nan
        raise argparse.ArgumentTypeError(f"expected a token count like 8192 or 384K, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive token count, got {text!r}")
    return value


def add_cost_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and cluster")
    g.add_argument("--model", default="gpt-7b", help="model preset or YAML path (default: gpt-7b)")
    g.add_argument("--cluster", default="a100-40g-8x8", help="cluster preset or YAML path (default: a100-40g-8x8)")
    g.add_argument("--cost-model", metavar="PATH", help="cost-model YAML (overrides --model/--cluster)")
    g.add_argument("--zero-stage", type=int, default=3, choices=[0, 1, 2, 3],
                   help="ZeRO stage of the model states (16 bytes a parameter), a what-if: 0 every GPU holds them all "
                        "(DDP), 1 optimizer states and master weights sharded over the GPUs (Megatron's "
                        "--use-distributed-optimizer), 2 gradients too, 3 parameters too (FSDP; default, the FlexSP "
                        "paper's setting); not read with --cost-model (the file's zero_stage, else 3)")


def add_planner_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("planner")
    g.add_argument("--planner", default="flexsp",
                   help=f"one of: {', '.join(PLANNERS)}, elastic_pp, seq1f1b, batch_1f1b, auto (default: flexsp)")
    g.add_argument("--time-limit", type=float, default=1.0, metavar="SEC", help="solver time limit per step (default 1)")
    g.add_argument("--static-degree", type=int, help="degree of static_ulysses (default: the largest allowed)")
    g.add_argument("--drop-over-max", action="store_true",
                   help="drop (and report) sequences no group can hold instead of failing")


def cost_from_args(args) -> CostModel:
    cost = (CostModel.from_yaml(args.cost_model) if args.cost_model
            else CostModel.from_presets(args.model, args.cluster, args.zero_stage))
    memory = getattr(args, "memory_mb", None)  # plan / simulate: one budget for every planner
    return cost if memory is None else cost.with_memory(memory)


def options_from_args(args) -> PlannerOptions:
    if not (math.isfinite(args.time_limit) and args.time_limit > 0):
        raise ConfigError(f"--time-limit must be positive (seconds), got {args.time_limit}")
    return PlannerOptions(time_limit=args.time_limit, static_degree=args.static_degree,
                          drop_over_max=args.drop_over_max, max_seq_len=args.max_seq_len)


def lengths_from_args(args, limit: int) -> np.ndarray:
    """The batch of ``--lengths FILE`` (refused if over ``--max-seq-len`` without ``--drop-over-max``;
    the planners drop or refuse what they cannot run), step ``--step`` of ``--data`` (documents
    cut into pieces of at most ``--max-seq-len``, as training cuts them; its source on stderr), or sampled
    from ``--dist`` up to ``limit`` with the seed ``simulate`` gives that step."""
    if args.step < 0:
        raise ConfigError(f"--step must be a step number (0 or more), got {args.step}")
    if args.data:
        if args.batch < 1:
            raise ConfigError(f"--batch must be at least 1, got {args.batch}")
        batches, source = dataset_batches(args.data, args.batch, limit, args.seed, range(args.step, args.step + 1))
        print(f"batch: {source}", file=sys.stderr)
        return batches[0]
    if args.lengths:
        lengths = read_lengths(args.lengths)
        if args.max_seq_len:
            over = lengths > args.max_seq_len
            if over.any() and not args.drop_over_max:
                raise ConfigError(f"{int(over.sum())} sequence(s) exceed --max-seq-len {args.max_seq_len} "
                                  f"(longest {int(lengths.max())}); use --drop-over-max to drop them")
        return lengths
    return sample_lengths(args.dist, args.batch, args.seed + args.step, limit)


def _plan_table(plan, lengths, cost, max_seq_len: int | None = None) -> str:
    lines = [f"{plan.planner} plan for {plural(len(lengths), 'sequence')} "
             f"({int(lengths.sum()):,} tokens) "
             f"of {cost.model.name} on {cost.cluster.name} ({cost.num_gpus} GPUs)", ""]
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
    lines += ["", f"estimated step time {plan.estimated_step_time_s:.3f} s   lower bound {lb:.3f} s "
              f"({plan.estimated_step_time_s / lb:.3f}x)   solved in {plan.solve_time_s * 1e3:.0f} ms "
              f"[{plan.solver_status}]"]
    if plan.dropped_seq_ids:
        limit = min(cost.max_seq_len, max_seq_len or cost.max_seq_len)
        lines.append(f"dropped {len(plan.dropped_seq_ids)} sequence(s) over the {limit}-token limit: "
                     f"ids {plan.dropped_seq_ids[:10]}{' ...' if len(plan.dropped_seq_ids) > 10 else ''}")
    if plan.baselines:
        lines += ["", f"{'baseline':<22} {'step s':>8} {'mbs':>4} {'speedup of ' + plan.planner:>20}"]
        for name, b in plan.baselines.items():
            lines.append(f"{name:<22} infeasible: {b['error']}" if "error" in b else
                         f"{name:<22} {b['estimated_step_time_s']:>8.3f} {b['num_micro_batches']:>4} "
                         f"{b['speedup']:>19.2f}x")
    return "\n".join(lines)


def cmd_plan(args) -> int:
    from megatron_ext.planner.pipeline_api import PP_PLANNERS, max_seq_len
    from megatron_ext.sim.commands import check_args, pipeline_options_from_args, run_pp_plan

    if args.planner not in PLANNERS and args.planner not in PP_PLANNERS:
        raise ConfigError(f"unknown planner {args.planner!r}; choose one of {', '.join([*PLANNERS, *PP_PLANNERS])}")
    pipelines = args.planner in PP_PLANNERS
    check_args(args, pipelines)
    cost = cost_from_args(args)
    if args.static_degree is not None:
        cost.check_degree(args.static_degree)
    limit = args.max_seq_len or max_seq_len(args.planner, cost, pipeline_options_from_args(args) if pipelines else None)
    lengths = lengths_from_args(args, limit)
    if pipelines:
        return run_pp_plan(args, cost, lengths)
    options = options_from_args(args)
    if args.planner == "flexsp":
        _note_if_too_big(lengths[lengths <= cost.max_seq_len], cost, options.time_limit)
    plan = make_plan(args.planner, lengths, cost, options, baselines=() if args.no_baselines else BASELINES)
    print(plan.to_json(indent=1) if args.json else _plan_table(plan, lengths, cost, args.max_seq_len))
    plot_if_asked(args, plan, lengths, cost)
    trace_if_asked(args, plan, lengths, cost)
    return 0


def _note_if_too_big(lengths: np.ndarray, cost: CostModel, time_limit: float) -> None:
    """A note on stderr where flexsp's first plan alone, which its time limit cannot cut short,
    takes longer here than the limit (a batch of a million sequences)."""
    from megatron_ext.planner.flexsp import first_plan_seconds

    need = first_plan_seconds(lengths, cost) if len(lengths) else 0.0
    if need > time_limit:
        print(f"note: planning {len(lengths):,} sequences takes about {need:.2g} s here (flexsp's first plan, which "
              f"its time limit cannot cut short); --time-limit {time_limit:g} is too short", file=sys.stderr)


def cmd_bench(args) -> int:
    from megatron_ext.bench import bench_planner

    if args.batches < 1:
        raise ConfigError(f"--batches must be at least 1, got {args.batches}")
    cost = cost_from_args(args)
    result = bench_planner(cost, dists=args.dist.split(","), batches=args.batches, batch=args.batch,
                           max_seq_len=args.max_seq_len, options=options_from_args(args), planner=args.planner,
                           scale=not args.no_scale)
    print(json.dumps(result, indent=1) if args.json else result["table"])
    return 0


# CPU ranks a machine runs well: more than this many a core, or than fit in its free memory at
# CPU_RANK_MB each, and a run crawls or swaps (64 ranks of a GPU preset on 2 cores swap the machine).
CPU_RANKS_PER_CORE = 4
CPU_RANK_MB = 512  # a rank training the tiny model holds ~440 MB resident (torch, megatron-core, gloo)
_PIPE_GRACE_S = 5.0  # how long the launcher reads the ranks' last lines after torchrun exits
LAUNCHER_HELP = f"""
launcher:
  --allow-oversubscribe
                        start the ranks even where there are more than this machine runs well
                        (CPU ranks: over {CPU_RANKS_PER_CORE} a core, or over its free memory at {CPU_RANK_MB} MB each)

exit status: 0 done; 2 bad input (one line says what); 1 a rank or torchrun died or failed (one line
names it, and every other process of the run is stopped); 128+N stopped by signal N (SIGTERM: 143,
SIGINT: 130), which is passed on to every rank"""


def _torchrun(rest: list[str], capture: bool = False, module: str = "megatron_ext.runtime.train"):
    """Run ``module`` (train or profile) on one process per rank of the cluster with torchrun
    (``runtime/torchrun.py``), relaying the ranks' stderr. Returns the exit status: 0, or 2 for
    bad input a rank reported (with ``capture``, a CompletedProcess holding the ranks' stdout). A
    run that dies (a rank or torchrun: status 1) or is stopped (SIGTERM or SIGINT: 128 + the
    signal) ends the command here, with one line."""
    import importlib
    import os
    import signal
    import subprocess
    import threading

    from megatron_ext.lifetime import exit_text

    oversubscribe = "--allow-oversubscribe" in rest  # the launcher's option, not the ranks'
    rest = [a for a in rest if a != "--allow-oversubscribe"]
    parser = importlib.import_module(module).build_parser()
    targs, unknown = parser.parse_known_args(rest)
    if unknown:
        raise ConfigError(f"unknown option(s): {' '.join(unknown)} (see {parser.prog} --help)")
    from megatron_ext.runtime.device import choose_device

    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if module == "megatron_ext.runtime.train":
        from megatron_ext.runtime.train import check_args, open_training_data, train_cost_model
        cost = train_cost_model(targs)
        check_args(targs, cost, cost.num_gpus)
        if targs.data is not None:  # a dataset that cannot be read or trained is refused before launching
            open_training_data(targs.data, targs.vocab_size)
    else:
        from megatron_ext.runtime.profile import check_args
        cost = CostModel.from_presets(targs.model, targs.cluster)
        check_args(targs, cost.num_gpus)
    if choose_device(targs.device, cost.num_gpus) == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # megatron runs on CPU ranks only where CUDA is absent (runtime/compat)
        if not oversubscribe:
            _check_cpu_ranks_fit(cost.num_gpus, cost.cluster.name)
    # A rank killed outright leaves its planner's semaphores to multiprocessing's resource tracker,
    # whose warning about them would follow the line naming the rank.
    env["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"),
                                                   "ignore:resource_tracker:UserWarning"]))
    cmd = [sys.executable, "-m", "megatron_ext.runtime.torchrun", "--standalone", f"--nproc-per-node={cost.num_gpus}",
           "-m", module, *rest]
    # The stop signals received. Each is passed on to torchrun as SIGTERM, which every process of the
    # run ends on quietly, even before it sets its handlers (SIGINT would print a KeyboardInterrupt
    # traceback from each rank still importing torch).
    stopped: list[int] = []
    proc = None

    def pass_on(signum, frame):
        stopped.append(signum)
        if proc is not None:
            proc.send_signal(signal.SIGTERM)

    handlers = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        # In a session of its own, torchrun gets a terminal's Ctrl-C once (from here, not also from the
        # terminal), and its process group can be killed whole.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        if stopped:  # (a signal before Popen returned)
            proc.send_signal(signal.SIGTERM)
        said: list[str] = []
        out: list[str] = []
        readers = [threading.Thread(target=_relay_stderr, args=(proc.stderr, said), daemon=True)]
        if capture:
            readers.append(threading.Thread(target=_read_lines, args=(proc.stdout, out), daemon=True))
        for reader in readers:
            reader.start()
        code = proc.wait()
        # A process that outlives torchrun holding the pipes (it dies with its parent, soon) is not waited for.
        for reader in readers:
            reader.join(_PIPE_GRACE_S)
    finally:
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # the usual case: nothing is left in it
                pass
            proc.wait()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if stopped:
        print(f"megatron-ext: stopped by {signal.Signals(stopped[0]).name}", file=sys.stderr, flush=True)
        raise SystemExit(128 + stopped[0])
    if code and not said:  # torchrun itself died or failed before it named a rank
        print(f"megatron-ext: error: torchrun {exit_text(code)}; the run stopped", file=sys.stderr, flush=True)
    if code not in (0, 2):
        raise SystemExit(1)
    return subprocess.CompletedProcess(cmd, code, "".join(out)) if capture else code


def _relay_stderr(stream, said: list) -> None:
    """Copy the ranks' stderr to ours until its first "megatron-ext: error:" line (bad input a rank
    reports, or the line naming the rank that died): what follows is the ranks being torn down,
    which says nothing more. Reads to the end, so that no writer blocks."""
    for line in stream:
        if not said:
            sys.stderr.write(line)
            sys.stderr.flush()
            if line.startswith("megatron-ext: error:"):
                said.append(line)


def _read_lines(stream, lines: list) -> None:
    for line in stream:
        lines.append(line)


def _check_cpu_ranks_fit(ranks: int, cluster: str) -> None:
    """Refuse, in one line before anything starts, more CPU ranks than this machine runs well:
    over CPU_RANKS_PER_CORE a core (of those this process may use), or over its free memory at
    CPU_RANK_MB a rank."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    free_mb = _free_memory_mb()
    if ranks > CPU_RANKS_PER_CORE * cores:
        why = (f"are over the {CPU_RANKS_PER_CORE * cores} this machine runs well ({CPU_RANKS_PER_CORE} a core, "
               f"{plural(cores, 'core')})")
    elif free_mb is not None and ranks * CPU_RANK_MB > free_mb:
        why = f"need about {ranks * CPU_RANK_MB / 1024:.1f} GB of memory, over the {free_mb / 1024:.1f} GB free"
    else:
        return
    raise ConfigError(f"{cluster} has {ranks} GPUs: {ranks} CPU ranks {why}; use --cluster cpu-4, or "
                      f"--allow-oversubscribe to start them anyway")


def _free_memory_mb() -> float | None:
    """MemAvailable of /proc/meminfo (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def cmd_train(rest: list[str]) -> int:
    """``train [--compare P1,P2,...] ARGS``: one run, or one run per planner on the same data and
    initial weights, then a table of measured step times, losses and the cost model's error."""
    if "--compare" not in rest:
        return _torchrun(rest)
    i = rest.index("--compare")
    if i + 1 >= len(rest):
        raise ConfigError("--compare needs a comma-separated list of planners, e.g. flexsp,static_ulysses")
    planners = rest[i + 1].split(",")
    base = [a for j, a in enumerate(rest) if j not in (i, i + 1)]
    if "--planner" in base or "--json" in base:
        raise ConfigError("--compare sets --planner and --json itself")
    twice = sorted({p for p in planners if planners.count(p) > 1})
    if twice:
        raise ConfigError(f"--compare names {', '.join(twice)} more than once")
    _check_compared_runs(base, planners)
    runs = {}
    for planner in planners:
        print(f"training with --planner {planner} ...", file=sys.stderr, flush=True)
        done = _torchrun([*base, "--planner", planner, "--json"], capture=True)
        if done.returncode != 0:
            raise ConfigError(f"the {planner} run failed (exit {done.returncode})")
        runs[planner] = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    print(compare_table(runs))
    return 0


def _check_compared_runs(base: list[str], planners: list[str]) -> None:
    """Refuse a ``--compare`` whose run of any planner could not start (an unknown planner, one
    the other options do not suit), before the first run trains."""
    from megatron_ext.runtime.train import build_parser as train_parser, check_args, train_cost_model

    for planner in planners:
        targs, _ = train_parser().parse_known_args([*base, "--planner", planner])  # (unknown options: the first run)
        cost = train_cost_model(targs)
        check_args(targs, cost, cost.num_gpus)


def cmd_report(args) -> int:
    from megatron_ext.report import fidelity, load_run, report_table

    records = load_run(args.run_dir)
    print(json.dumps(fidelity(records), indent=1) if args.json else report_table(records))
    return 0


def cmd_profile(rest: list[str]) -> int:
    return _torchrun(rest, module="megatron_ext.runtime.profile")


def compare_table(runs: dict[str, list[dict]]) -> str:
    """Measured step time (median after the first step), tokens/s, the cost model's median error,
    and the largest loss / grad-norm difference from the first planner's run at any step."""
    from megatron_ext.report import layout_counts, layouts_text

    first = next(iter(runs.values()))
    lines = [f"{'planner':<22}{'steps':>6}{'step s':>9}{'tokens/s':>10}{'vs first':>9}{'model err':>10}"
             f"{'max loss diff':>15}{'max grad diff':>15}  ran"]
    base_time = None
    for name, recs in runs.items():
        body = recs[1:] or recs  # the first step pays start-up costs
        measured = np.array([r["step_time_s"] for r in body])
        predicted = np.array([r["predicted_step_time_s"] for r in body])
        t = float(np.median(measured))
        base_time = base_time or t
        loss_diff = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(recs, first))
        grad_diff = max(abs(a["grad_norm"] - b["grad_norm"]) / abs(b["grad_norm"]) for a, b in zip(recs, first))
        lines.append(f"{name:<22}{len(recs):>6}{t:>9.3f}{sum(r['tokens'] for r in body) / measured.sum():>10,.0f}"
                     f"{base_time / t:>8.2f}x{np.median(np.abs(predicted - measured) / measured):>9.0%} "
                     f"{loss_diff:>14.1e}{grad_diff:>15.1e}  "
                     + layouts_text(layout_counts(recs)))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megatron-ext", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan one step from lengths and print the StepPlan")
    add_batch_source_args(p, default_dist="wikipedia")
    p.add_argument("--step", type=int, default=0, metavar="K",
                   help="with --dist or --data: plan step K of `simulate` (seed + K) or of a training run on --data "
                        "(default 0)")
    p.add_argument("--max-seq-len", type=parse_tokens, metavar="L",
                   help="longest sequence, e.g. 384K (default: the longest the planner can run on the cluster; "
                        "with --data, needed: the length training cuts documents at)")
    p.add_argument("--json", action="store_true", help="print the StepPlan JSON")
    p.add_argument("--no-baselines", action="store_true", help="skip timing the baselines")
    add_cost_args(p)
    add_planner_args(p)
    add_pipeline_args(p)
    p.set_defaults(func=cmd_plan)
    add_simulate_command(sub, add_cost_args, cost_from_args, parse_tokens)

    b = sub.add_parser("bench", help="benchmarks that print tables")
    bsub = b.add_subparsers(dest="what", required=True)
    bp = bsub.add_parser("planner", help="planner latency and quality against the lower bound and baselines")
    bp.add_argument("--dist", default="wikipedia,commoncrawl,github",
                    help="comma-separated distributions (default: wikipedia,commoncrawl,github)")
    bp.add_argument("--batches", type=int, default=5, help="batches per distribution")
    bp.add_argument("--batch", type=int, default=512, help="sequences per batch")
    bp.add_argument("--max-seq-len", type=parse_tokens, default=parse_tokens("384K"), metavar="L",
                    help="longest sampled sequence (default: 384K); longer ones than the cluster holds are dropped")
    bp.add_argument("--no-scale", action="store_true", help="skip the 1,024-GPU / 8,192-sequence row")
    bp.add_argument("--json", action="store_true")
    add_cost_args(bp)
    add_planner_args(bp)
    bp.set_defaults(func=cmd_bench)

    t = sub.add_parser("train", add_help=False,
                       help="train a small GPT on CPU ranks with per-step plans (torchrun); --help for options")
    t.set_defaults(func=cmd_train)
    rp = sub.add_parser("report", help="how well the cost model predicted a run: a `train --run-dir` directory, or "
                                        "Megatron-LM's --planner-log file")
    rp.add_argument("run_dir", metavar="RUN", help="a `train --run-dir` directory (or its steps.jsonl), or the JSONL "
                                                   "file of pretrain_gpt.py --planner-log")
    rp.add_argument("--json", action="store_true")
    rp.set_defaults(func=cmd_report)
    pr = sub.add_parser("profile", add_help=False,
                        help="measure the cost model's coefficients here and write a cost-model YAML; --help")
    pr.set_defaults(func=cmd_profile)
    return ap


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        if args.func is cmd_profile:
            if "-h" in rest or "--help" in rest:
                from megatron_ext.runtime.profile import build_parser as profile_parser
                profile_parser().print_help()
                print(LAUNCHER_HELP)
                return 0
            return cmd_profile(rest)
        if args.func is cmd_train:
            if "-h" in rest or "--help" in rest:
                from megatron_ext.runtime.train import build_parser as train_parser
                train_parser().print_help()
                print("\n  --compare P1,P2,...   train once per planner (same data and weights) and compare")
                print(LAUNCHER_HELP)
                return 0
            return cmd_train(rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return args.func(args)
    except MegatronExtError as e:
        print(f"megatron-ext: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. piped into head
        return 0


if __name__ == "__main__":
    sys.exit(main())
