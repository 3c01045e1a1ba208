"""`megatron-ext train`: real training of a small megatron-core GPT with per-step plans.

On CPU ranks (gloo) or GPUs (NCCL); a line (or a JSON record, ``--json``) per step and a summary.

The launcher side (``run``) checks the options and starts one process per rank of the
cluster with torchrun (``launch.py``); with ``--compare P1,P2,...`` it trains once per planner, on
the same data and initial weights, and prints a table of measured step times, losses and the cost
model's error (``compare_table``). Every rank runs this module's ``main``: it joins the process
group and trains (``runtime/train.py``); rank 0 prints the steps, writes their records to
``--run-dir DIR/steps.jsonl`` (the schema of ``runtime/records.py``, which ``megatron-ext report``
reads) and the ``--trace`` file.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from megatron_ext.commands.args import ArgumentParser, check_output_dir, check_output_file, parse_tokens, path_arg
from megatron_ext.commands.launch import torchrun, with_launcher_help
from megatron_ext.commands.report import advice, fidelity, layout_counts, layouts_text, step_layout
from megatron_ext.cost import CostModel
from megatron_ext.data.batches import GlobalBatches
from megatron_ext.errors import ConfigError, MegatronExtError
from megatron_ext.files import replacing
from megatron_ext.lifetime import die_with_parent, exit_process, exit_quietly_on_stop_signals, say_rank_error
from megatron_ext.planner.api import planners_help
from megatron_ext.runtime.backends import ATTENTION_BACKENDS
from megatron_ext.runtime.checkpoint import holds_checkpoint
from megatron_ext.runtime.compat import quiet_fallback_warnings
from megatron_ext.runtime.device import DEVICE_CHOICES, choose_device
from megatron_ext.runtime.kernels import check_backend
from megatron_ext.runtime.train import (TRAIN_CLUSTER, TRAIN_MODEL, check_args, open_training_data, stage_sp,
                                        train_cost_model)
from megatron_ext.text import plural

RANKS = "megatron_ext.commands.train"  # what torchrun runs on every rank: this module


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="megatron-ext train", description=__doc__.splitlines()[0])
    p.add_argument("--planner", default="flexsp",
                   help=f"one of: {planners_help('sp')}; with --pp: {planners_help('pp')}; auto: per "
                   f"step, the fastest of FlexSP (at --pp 1) and the pipelines of --pp stages")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (Ulysses degree inside a stage: --sp)")
    p.add_argument("--sp", type=int, help="with --pp: Ulysses degree inside a stage (default: ranks / pp; auto: "
                   "per step); below that, ranks / (pp x sp) replicas of the pipeline run side by side, each its "
                   "share of the batch")
    p.add_argument("--model", help=f"model preset or YAML (its layers, hidden size and heads) (default: {TRAIN_MODEL})")
    p.add_argument("--cluster",
                   help=f"cluster preset or YAML: its GPU count is the rank count (default: {TRAIN_CLUSTER})")
    p.add_argument("--device", default="auto", choices=DEVICE_CHOICES,
                   help="where the ranks run: cuda (NCCL, one GPU per rank), cpu (gloo), or auto: cuda where there "
                   "is CUDA (default auto)")
    p.add_argument("--cost-model", type=path_arg, metavar="PATH",
                   help="cost-model YAML (the model and the cluster: not with --model / --cluster)")
    p.add_argument("--steps", type=int, default=5, help="training steps (with --load: in all, the checkpoint's "
                   "included, as Megatron's --train-iters) (default: %(default)s)")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step (default: %(default)s)")
    p.add_argument("--max-seq-len", type=parse_tokens, default=4096,
                   help="longer documents are cut into pieces (e.g. 4096 or 8K) (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="same seed: same data and initial weights for every planner")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (default: %(default)s)")
    p.add_argument("--time-limit", type=float, default=1.0, help="planner time limit per step, in seconds "
                   "(default: %(default)s)")
    p.add_argument("--static-degree", type=int, help="degree of static_ulysses")
    p.add_argument("--max-ring", type=int, default=1, metavar="R",
                   help="FlexSP groups may reach past the heads' Ulysses limit with a ring (context parallel) of up "
                   "to R Ulysses subgroups, K/V passed around it (a power of two; default 1: Ulysses only)")
    p.add_argument("--data", nargs="+", metavar="PREFIX",
                   help="a Megatron indexed dataset (PREFIX.bin/.idx), or a blend as Megatron-LM's --data-path takes "
                   "it: W1 PREFIX1 W2 PREFIX2 ... (each its weight's share of every batch); the tokenizer is that of a "
                   "corpus made by megatron_ext.data.corpus, else give --vocab-size (default: the Python standard "
                   "library, BPE-tokenized; built once and cached)")
    p.add_argument("--vocab-size", type=int, metavar="N",
                   help="with --data: the model's vocabulary, every token id of the data checked to be below it "
                   "(needed for data not made by megatron_ext.data.corpus, which has no PREFIX.json tokenizer "
                   "manifest)")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="core attention: sdpa (torch's, any device), te (Transformer Engine, CUDA) or flash "
                        "(flash-attn: bf16 only, refused as train runs fp32); auto: per call, the first of flash and "
                        "te that runs it, else sdpa (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="one JSON record per step")
    p.add_argument("--run-dir", metavar="DIR", help="also write the records to DIR/steps.jsonl (for `megatron-ext report`)")
    p.add_argument("--trace", metavar="FILE.json",
                   help="every step planned (the simulator's timeline) and measured, side by side, as a Chrome trace "
                   "(open it in ui.perfetto.dev)")
    p.add_argument("--save", metavar="DIR", help="save a checkpoint (model, optimizer, RNG states, data position) to "
                   "DIR after the last step (and every --save-interval steps)")
    p.add_argument("--save-interval", type=int, metavar="N", help="with --save: also after every N steps")
    p.add_argument("--load", metavar="DIR", help="resume from the newest checkpoint in DIR (saved by a run of the same "
                   "model, ranks, --pp, data, seed, batch and --lr) and train to step --steps")
    return p


def print_help() -> None:
    p = build_parser()  # (--compare is run's: each compared run's ranks parse the rest)
    p.add_argument_group("comparing planners").add_argument(
        "--compare", metavar="P1,P2,...", help="train once per planner, on the same data and initial weights, and "
        "print a table of their step times, losses and the cost model's error (it sets --planner and --json)")
    with_launcher_help(p).print_help()


def check_before_launch(args) -> CostModel:
    """Refuse what cannot run before any rank starts (``launch.torchrun`` calls it); the cost
    model, whose GPU count is the run's rank count."""
    cost = train_cost_model(args)
    check_args(args, cost, cost.num_gpus)
    check_backend(args.attention_backend, choose_device(args.device, cost.num_gpus), "fp32", "train",
                  "train runs fp32, as its cost model was measured: use auto or sdpa")
    if args.data is not None:  # a dataset that cannot be read or trained is refused before launching
        data = open_training_data(args.data, args.vocab_size)
        # (a global batch larger than the samples: the ranks found it, after a launch of tens of seconds)
        GlobalBatches(data.documents.lengths, args.global_batch, args.max_seq_len, args.seed,
                      source_sizes=data.source_sizes, weights=data.weights)
    if args.trace is not None:  # (written after the last step)
        check_output_file(args.trace, "--trace")
    for option, folder in (("--run-dir", args.run_dir), ("--save", args.save)):
        if folder is not None:
            check_output_dir(folder, option)
    if args.run_dir is not None:
        _check_run_dir(args.run_dir, args.load)
    return cost


def _check_run_dir(run_dir: str, load: str | None) -> None:
    """Refuse a --run-dir holding an earlier run's records, which this run's would replace; with
    --load the run continues them (a resumed run keeps the records before its first step)."""
    steps = Path(run_dir) / "steps.jsonl"
    if load is None and steps.is_file() and steps.stat().st_size:
        raise ConfigError(f"--run-dir {run_dir} holds the records of an earlier run ({steps}), which this run "
                          f"would replace; give a new directory, or --load that run's checkpoint to resume it")


def rank_model_states_mb(args, cost: CostModel) -> float:
    """MB of model states a rank holds (the launcher's memory check): its stage's share of the
    fp32 weights, gradients and Adam moments (16 bytes a parameter; train runs ZeRO 0)."""
    return cost.model_states_mb / args.pp


def run(rest: list[str]) -> int:
    """``train [--compare P1,P2,...] ARGS``: one run, or one run per planner on the same data and
    initial weights, then a table of measured step times, losses and the cost model's error."""
    if "--compare" not in rest:
        args = build_parser().parse_known_args(rest)[0]
        _check_static_degree(args.static_degree, [args.planner])
        return torchrun(RANKS, rest)
    i = rest.index("--compare")
    if i + 1 >= len(rest):
        raise ConfigError("--compare needs a comma-separated list of planners, e.g. flexsp,static_ulysses")
    planners = [p.strip() for p in rest[i + 1].split(",")]
    if not all(planners):
        raise ConfigError(f"--compare needs a comma-separated list of planners, e.g. flexsp,static_ulysses, "
                          f"got {rest[i + 1]!r}")
    base = [a for j, a in enumerate(rest) if j not in (i, i + 1)]
    # (what the runs' options say, in any spelling argparse takes: --planner=x, --plan x)
    given, _ = build_parser().parse_known_args(base, argparse.Namespace(planner=None, json=None))
    if given.planner is not None or given.json is not None:
        raise ConfigError("--compare sets --planner and --json itself")
    _check_static_degree(given.static_degree, planners)
    twice = sorted({p for p in planners if planners.count(p) > 1})
    if twice:
        raise ConfigError(f"--compare names {', '.join(twice)} more than once")
    argv = {planner: [*base, *_own_outputs(given, planner), "--planner", planner] for planner in planners}
    for planner in planners:  # any run that could not start is refused before the first one trains
        check_before_launch(build_parser().parse_known_args(argv[planner])[0])  # (unknown options: the first run)
    runs = {}
    for planner in planners:
        print(f"training with --planner {planner} ...", file=sys.stderr, flush=True)
        done = torchrun(RANKS, [*argv[planner], "--json"], capture=True)
        if done.returncode != 0:
            raise ConfigError(f"the {planner} run failed (exit {done.returncode})")
        runs[planner] = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        if not runs[planner]:  # (a --load checkpoint already at --steps)
            raise ConfigError(f"the {planner} run trained no steps: nothing to compare (is --steps past the "
                              f"checkpoint's step?)")
    print(compare_table(runs))
    return 0


def _check_static_degree(static_degree: int | None, planners: list[str]) -> None:
    """Refuse a --static-degree that none of the run's ``planners`` uses: it is static_ulysses's
    degree (every planner takes it, so that --compare can pass it to all)."""
    if static_degree is not None and "static_ulysses" not in planners:
        raise ConfigError(f"--static-degree is static_ulysses's degree: it applies to --planner static_ulysses or "
                          f"a --compare list naming it, not to {', '.join(planners)}")


def _own_outputs(given, planner: str) -> list[str]:
    """A compared run's own --run-dir, --save and --trace (each planner's in DIR/PLANNER and
    FILE.PLANNER.json; one place for all, each run overwrote the one before), given after the
    shared ones, which they override; --load DIR too where DIR holds no checkpoint of its own but
    the compared runs' (each resumes what it saved; else every planner starts from DIR's)."""
    out = []
    load = given.load is not None and not holds_checkpoint(given.load)
    for option, folder in (("--run-dir", given.run_dir), ("--save", given.save), ("--load", load and given.load)):
        if folder:
            out += [option, str(Path(folder) / planner)]
    if given.trace is not None and given.trace.lower().endswith(".json"):  # (any other name is refused as given)
        out += ["--trace", f"{given.trace[:-5]}.{planner}{given.trace[-5:]}"]
    return out


def compare_table(runs: dict[str, list[dict]]) -> str:
    """Measured step time (median after the first step), tokens/s, the cost model's median error,
    and the largest loss / grad-norm difference from the first planner's run at any step."""
    first = next(iter(runs.values()))
    lines = [f"{'planner':<22}{'steps':>6}{'step s':>9}{'tokens/s':>10}{'vs first':>9}{'model err':>10}"
             f"{'max loss diff':>15}{'max grad diff':>15}  ran"]
    base_time = None
    for name, recs in runs.items():
        body = recs[1:] or recs  # the first step pays start-up costs
        measured = np.array([r["step_time_s"] for r in body])
        t = float(np.median(measured))
        base_time = base_time or t
        loss_diff = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(recs, first))
        grad_diff = max(abs(a["grad_norm"] - b["grad_norm"]) / abs(b["grad_norm"]) for a, b in zip(recs, first))
        lines.append(f"{name:<22}{len(recs):>6}{t:>9.3f}{sum(r['tokens'] for r in body) / measured.sum():>10,.0f}"
                     f"{base_time / t:>8.2f}x{fidelity(recs)['step_median_abs_error']:>9.0%} "
                     f"{loss_diff:>14.1e}{grad_diff:>15.1e}  "
                     + layouts_text(layout_counts(recs)))
    return "\n".join(lines)


# ---- on every rank (under torchrun) -------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    import signal
    import time

    import torch.distributed as dist

    from megatron_ext.runtime.device import init_rank_process_group

    # Stopped (torchrun passes a stop signal on as SIGTERM), a rank ends quietly; orphaned (torchrun
    # died), at once: no stop to save on, nor a launcher left to clear what a stuck rank leaves.
    exit_quietly_on_stop_signals()
    die_with_parent(signal.SIGKILL)
    args = build_parser().parse_args(argv)
    quiet_fallback_warnings()
    if args.save:
        from megatron_ext.runtime.checkpoint import save_and_stop_on_signals
        save_and_stop_on_signals()
    try:
        init_rank_process_group(args.device)
    except MegatronExtError as e:
        return say_rank_error(e, int(os.environ.get("RANK", "0")))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        return _train(args, rank, world)
    except MegatronExtError as e:
        return say_rank_error(e, rank)
    except Exception:
        # A rank that dies breaks its peers' collectives; torchrun (checking every 0.1 s) stops them a
        # moment later and names it. Wait for that stop, quiet, rather than print a traceback about it.
        # Under --save the stop may have come already, taken as "save after this step", which cannot
        # be (the step's collectives broke): it ends the rank now, as one to come will.
        exit_quietly_on_stop_signals()
        if args.save:
            from megatron_ext.runtime.checkpoint import stop_requested
            if stop_requested():
                raise SystemExit(128 + signal.SIGTERM) from None
        time.sleep(5.0)
        raise
    finally:
        dist.destroy_process_group()


def _train(args, rank: int, world: int) -> int:
    """Train on this rank; rank 0 prints the run's header, a line or JSON record per step, writes
    the records to ``--run-dir`` and the ``--trace``, and prints the summary."""
    from megatron_ext.data.batches import sources_text
    from megatron_ext.runtime.train import Training
    from megatron_ext.sim.trace import RunTrace, ops_per_row, trace_document, write_trace

    run = Training(args, rank, world)
    cost, data = run.cost, run.data
    if rank == 0 and not args.json:
        print(_header(args, cost, world, sources_text(data.prefixes, data.source_sizes, run.loader.weights)),
              flush=True)
    if rank == 0 and data.vocab_size != cost.model.vocab_size:
        print(f"note: the cost model's {cost.model.name} has a {cost.model.vocab_size:,}-word output layer, this model "
              f"{data.vocab_size:,} words (the data's): predicted step times and the last stage's memory leave out "
              f"the difference", file=sys.stderr, flush=True)
    if rank == 0 and run.resumed_from:
        print(f"resumed from {run.resumed_from} at step {run.done}" + (f"; --steps {args.steps} are done already"
                                                                       if run.done >= args.steps else ""),
              file=sys.stderr, flush=True)
    records = []
    log = None
    trace = RunTrace(cost) if rank == 0 and args.trace else None
    if rank == 0 and args.run_dir:
        Path(args.run_dir).mkdir(parents=True, exist_ok=True)
        log = _open_step_log(Path(args.run_dir) / "steps.jsonl", run.done)
    try:
        for trained in run.steps():
            rec, step = trained.record, trained.step
            if trace is not None:
                trace.add_step(step.step, step.plan, step.lengths, rec["step_time_s"],
                               rank_micro_batch_s=trained.rank_micro_batch_s,
                               ops_per_row=ops_per_row(trained.ranks) if trained.ranks is not None else None)
            records.append(rec)
            if rank == 0:
                _print_record(json.dumps(rec) if args.json else _line(rec))
                if log:
                    print(json.dumps(rec), file=log, flush=True)
    finally:
        if log:
            log.close()
    if trace is not None:
        try:
            write_trace(args.trace, trace_document(trace.events, model=cost.model.name, cluster=cost.cluster.name))
        except OSError as e:
            raise ConfigError(f"cannot write the trace to {args.trace}: {e.strerror or e}") from None
        print(f"trace of {plural(len(records), 'step')} written to {args.trace} (open it in ui.perfetto.dev)",
              file=sys.stderr, flush=True)
    if rank == 0 and not args.json:
        print(_summary(args.planner, records), flush=True)
    return 0


def _print_record(line: str) -> None:
    """Rank 0's line of a step. Where the reader of its output is gone (``train --json | head``),
    the run stops after the step, as any stopped run (saving under --save), and prints no more."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        from megatron_ext.runtime.checkpoint import request_stop

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (what is buffered goes nowhere)
        request_stop()


def _open_step_log(path: Path, done: int):
    """--run-dir's steps.jsonl, to append to: a run resumed at step ``done`` keeps the records of
    the steps before it (those of a run that went on past its last checkpoint are trained again)."""
    kept = []
    if done and path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                step = json.loads(line).get("step")
            except (json.JSONDecodeError, AttributeError):
                continue
            if type(step) is int and step < done:
                kept.append(line + "\n")
    with replacing(path) as tmp:
        tmp.write_text("".join(kept))
    return open(path, "a")


def _header(args, cost: CostModel, world: int, data: str) -> str:
    """What the run trains, on what, with which planner and data (printed before its steps)."""
    sp = stage_sp(args, cost)
    if args.planner == "auto":
        layout = ("FlexSP or one-stage pipeline replicas per step" if args.pp == 1 else
                  f"pipelines of {args.pp} stages" + (f" x SP {sp}" if sp else ", their SP degree per step"))
    elif sp is not None:
        layout = f"pipelines of {args.pp} stages x SP {sp}" + (f", {world // (args.pp * sp)} replicas"
                                                              if world > args.pp * sp else "")
    else:
        layout = "SP groups per micro-batch"
    return (f"train: {cost.model_on_cluster} ({world} ranks), planner {args.planner} ({layout}); "
            f"{plural(args.global_batch, 'sequence')} a step of up to {args.max_seq_len:,} tokens, "
            f"{plural(args.steps, 'step')}, "
            f"seed {args.seed}; data {data}")


def _line(r: dict) -> str:
    peak = r.get("activation_peak_mb_per_stage")
    return (f"step {r['step']:>3}  " + (f"[{step_layout(r)}]  " if r["planner"] == "auto" else "")
            + f"loss {r['loss']:.4f}  grad {r['grad_norm']:.3f}  tokens {r['tokens']:>7,}  "
            f"time {r['step_time_s']:6.2f}s  predicted {r['predicted_step_time_s']:6.2f}s  "
            f"{'chunks' if peak else 'mbs'} {r['micro_batches']}  degrees {','.join(map(str, r['degrees']))}"
            + (f"  activations MB/stage {'/'.join(f'{x:.1f}' for x in peak)} (room {r['activation_room_mb']:.1f})"
               if peak else "")
            + ("" if r["plan_source"].endswith("planner") else f"  [{r['plan_source']}]"))


def _summary(planner: str, records: list[dict]) -> str:
    if not records:
        return "no steps run"
    measured = np.array([r["step_time_s"] for r in records[1:] or records])
    f = fidelity(records)
    tokens = sum(r["tokens"] for r in records[1:] or records)
    chose = f" ({layouts_text(layout_counts(records))})" if planner == "auto" else ""
    late = sum(r["plan_source"].endswith("fallback") for r in records)
    return (f"{planner}: {plural(len(records), 'step')}{chose}"
            + (f", {late} of them on a fallback plan" if late else "")
            + f", median step {np.median(measured):.2f} s, {tokens / measured.sum():,.0f} tokens/s"
            + (" (after the first step)" if len(records) > 1 else "")  # (one step: that one, start-up and all)
            + f"; cost-model error {f['step_median_abs_error']:.0%} (median)"
            + "".join(f"\n  {line}" for line in advice(records, f) if f["recalibrate"]))


if __name__ == "__main__":
    exit_process(main())
