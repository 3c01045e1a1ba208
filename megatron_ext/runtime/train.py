"""Real training of a small megatron-core GPT on CPU ranks (gloo) with per-step FlexSP plans.

Run under torchrun (``megatron-ext train`` launches it): every rank builds the same GPTModel with
Ulysses core attention, wraps it in megatron's DistributedDataParallel and optimizer, and trains
on the Python standard library corpus. Rank 0 plans each step one step ahead in a background
process and broadcasts the plan; every rank runs its shard of every micro-batch. Rank 0 prints
one line (or one JSON record) per step: loss, grad norm, tokens, measured and predicted step time
and the SP degrees used.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_ext.cost import CostModel
from megatron_ext.cost.pipeline import PipelineCost
from megatron_ext.data.datasets import DataError
from megatron_ext.errors import ConfigError, MegatronExtError
from megatron_ext.planner import PLANNERS, PlannerOptions
from megatron_ext.runtime.backends import ATTENTION_BACKENDS
from megatron_ext.runtime.checkpoint import check_checkpoint_args
from megatron_ext.runtime.device import DEVICE_CHOICES, init_rank_process_group, rank_device
from megatron_ext.runtime.timing import DeviceClock
from megatron_ext.sim.trace import RunTrace, ops_per_row, trace_document, write_trace
from megatron_ext.report import advice, fidelity, layout_counts, layouts_text, step_layout
from megatron_ext.spec import ModelSpec
from megatron_ext.text import plural


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-ext train", description=__doc__.splitlines()[0])
    p.add_argument("--planner", default="flexsp",
                   help=f"one of: {', '.join(PLANNERS)}; with --pp: elastic_pp, seq1f1b, batch_1f1b; auto: per "
                   f"step, the fastest of FlexSP (at --pp 1) and the pipelines of --pp stages")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (Ulysses degree inside a stage: --sp)")
    p.add_argument("--sp", type=int, help="with --pp: Ulysses degree inside a stage (default: ranks / pp; auto: "
                   "per step); below that, ranks / (pp x sp) replicas of the pipeline run side by side, each its "
                   "share of the batch")
    p.add_argument("--model", default="tiny", help="model preset or YAML (its layers, hidden size and heads)")
    p.add_argument("--cluster", default="cpu-4", help="cluster preset or YAML: its GPU count is the rank count")
    p.add_argument("--device", default="auto", choices=DEVICE_CHOICES,
                   help="where the ranks run: cuda (NCCL, one GPU per rank), cpu (gloo), or auto: cuda where there "
                   "is CUDA (default auto)")
    p.add_argument("--cost-model", metavar="PATH", help="cost-model YAML (overrides --model/--cluster)")
    p.add_argument("--steps", type=int, default=5, help="training steps (with --load: in all, the checkpoint's "
                   "included, as Megatron's --train-iters)")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step")
    p.add_argument("--max-seq-len", type=int, default=4096, help="longer documents are cut into pieces")
    p.add_argument("--seed", type=int, default=0, help="same seed: same data and initial weights for every planner")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--time-limit", type=float, default=1.0, help="planner time limit per step (s)")
    p.add_argument("--static-degree", type=int, help="degree of static_ulysses")
    p.add_argument("--data", nargs="+", metavar="PREFIX",
                   help="a Megatron indexed dataset (PREFIX.bin/.idx), or a blend as Megatron-LM's --data-path takes "
                   "it: W1 PREFIX1 W2 PREFIX2 ... (each its weight's share of every batch); the tokenizer is that of a "
                   "corpus made by megatron_ext.data.corpus, else give --vocab-size (default: the Python standard "
                   "library, BPE-tokenized; built once and cached)")
    p.add_argument("--vocab-size", type=int, metavar="N",
                   help="with --data: the model's vocabulary, every token id of the data checked to be below it "
                   "(needed for data not made by megatron_ext.data.corpus, which has no PREFIX.json tokenizer "
                   "manifest)")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
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


def initial_weights(spec: ModelSpec, vocab_size: int, max_seq_len: int, backend: str, seed: int) -> dict:
    """The whole model's initial weights, from megatron's own initialization with ``seed``: every
    pipeline layout then starts from the same function (each stage loads its part)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_ext.runtime.pipeline_model import build_pipeline_model

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    model, _ = build_pipeline_model(spec, vocab_size, max_seq_len, backend, ddp=False)
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in model.state_dict().items()}
    parallel_state.destroy_model_parallel()
    return state


def build_optimizer(ddp, lr: float):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    return get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=1.0,
                                                  bf16=False, fp16=False), [ddp])


def _record(step, losses, grad_norm, tokens, step_time, plan, times) -> dict:
    degrees = sorted({g.degree for mb in plan.micro_batches for g in mb.groups} | {p.sp_degree for p in plan.pipelines},
                     reverse=True)
    return {
        "step": step.step, "loss": losses, "grad_norm": grad_norm, "tokens": tokens,
        "longest_sequence": int(step.lengths.max()) if len(step.lengths) else 0, "step_time_s": step_time,
        "predicted_step_time_s": plan.estimated_step_time_s,
        "micro_batches": len(plan.micro_batches) or sum(len(p.chunks) for p in plan.pipelines),
        "degrees": degrees, "planner": plan.planner, "kind": plan.kind, "plan_source": step.plan_source,
        "micro_batch_times_s": times, "predicted_micro_batch_times_s": [mb.estimated_time_s for mb in plan.micro_batches],
    }


def stage_sp(args, cost: CostModel) -> int | None:
    """The Ulysses degree of the run's pipeline stages: ``--sp``, else ranks / pp (or, over the
    head limit, the largest allowed degree dividing it; the rest run as replicas). None without
    pipelines, and for auto without ``--sp`` (chosen per step)."""
    from megatron_ext.planner.pipeline import resolve_layout
    from megatron_ext.planner.pipeline_api import PP_PLANNERS

    if args.planner == "auto":
        return args.sp
    if args.planner not in PP_PLANNERS:
        return None
    return resolve_layout(cost, args.pp, args.sp)[1]


@dataclass(frozen=True)
class TrainingData:
    """What ``--data`` trains on: the documents (a blend's one after another, with the source sizes
    and weights ``GlobalBatches`` blends by), the vocabulary size and the padding id."""

    prefixes: list[str]
    documents: object
    source_sizes: list[int] | None
    weights: list[float] | None
    vocab_size: int
    pad: int


def open_training_data(values: list[str], vocab_size: int | None) -> TrainingData:
    """``--data`` (``open_blend``: a prefix or a blend) and its vocabulary: ``--vocab-size``, every
    token id of every source checked to be in it (padding then uses id 0: padded positions carry no
    loss, so any id does), or else the tokenizer every source's corpus manifest names (they must
    agree)."""
    from megatron_ext.data.corpus import corpus_tokenizer
    from megatron_ext.data.datasets import blend_documents, open_blend

    if vocab_size is not None and vocab_size < 1:
        raise ConfigError(f"--vocab-size must be at least 1, got {vocab_size}")
    sources = open_blend(values)
    docs, sizes, weights = blend_documents(sources)
    prefixes = [d.prefix for _, d in sources]
    if vocab_size is not None:
        for _, d in sources:
            lo, hi = d.token_range()
            if lo < 0 or hi >= vocab_size:
                raise DataError(f"{d.prefix} holds token id {lo if lo < 0 else hi}, outside the vocabulary "
                                f"[0, {vocab_size}); give --vocab-size above every token id of the data")
        return TrainingData(prefixes, docs, sizes, weights, vocab_size, 0)
    made = [Path(p + ".json").exists() for p in prefixes]
    if not all(made):
        raise ConfigError(f"{prefixes[made.index(False)]} has no tokenizer manifest (PREFIX.json: it was not made by "
                          f"megatron_ext.data.corpus); give --vocab-size, above every token id of the data")
    toks = [corpus_tokenizer(p) for p in prefixes]
    for p, t in zip(prefixes[1:], toks[1:]):
        if (type(t), getattr(t, "fingerprint", None)) != (type(toks[0]), getattr(toks[0], "fingerprint", None)):
            raise ConfigError(f"{p} and {prefixes[0]} were made by different tokenizers; a blend's sources "
                              f"share one")
    return TrainingData(prefixes, docs, sizes, weights, toks[0].vocab_size, toks[0].pad)


# build_optimizer: megatron's Adam without the distributed optimizer, under DDP: every rank holds
# every model state (ZeRO 0), and the planner must budget that.
TRAIN_ZERO_STAGE = 0


def train_cost_model(args) -> CostModel:
    """The cost model a run plans with: ``--cost-model``, else the ``--model`` and ``--cluster``
    presets, at the ZeRO stage ``train`` runs (a YAML stating another stage is refused)."""
    if not args.cost_model:
        return CostModel.from_presets(args.model, args.cluster, TRAIN_ZERO_STAGE)
    cost = CostModel.from_yaml(args.cost_model, TRAIN_ZERO_STAGE)
    if cost.zero_stage != TRAIN_ZERO_STAGE:
        raise ConfigError(f"--cost-model {args.cost_model} says zero_stage: {cost.zero_stage}, but train keeps every "
                          f"model state on every rank (stage {TRAIN_ZERO_STAGE}: no distributed optimizer); "
                          f"drop the stage from the file or make it {TRAIN_ZERO_STAGE}")
    return cost


def check_args(args, cost: CostModel, world: int) -> bool:
    """Refuse what cannot run, before anything starts (the launcher calls it too). Returns
    whether the planner plans pipelines (``auto`` included: its steps are FlexSP or pipelines of
    the run's stages, whichever is faster, as the model's stages are fixed for the run)."""
    from megatron_ext.planner.pipeline_api import PP_PLANNERS, max_seq_len

    if cost.num_gpus != world:
        raise ConfigError(f"cluster {cost.cluster.name} has {cost.num_gpus} GPUs but {world} ranks were launched")
    if not (np.isfinite(args.lr) and args.lr >= 0):
        raise ConfigError(f"--lr must be a finite number, 0 or more, got {args.lr}")
    if not (np.isfinite(args.time_limit) and args.time_limit > 0):
        raise ConfigError(f"--time-limit must be positive (seconds), got {args.time_limit}")
    pipelined = args.planner in PP_PLANNERS
    runnable = ", ".join(PP_PLANNERS)
    if args.planner not in PLANNERS and not pipelined:
        raise ConfigError(f"unknown planner {args.planner!r}; choose one of {', '.join([*PLANNERS, *PP_PLANNERS])}")
    if args.pp > 1 and not pipelined:
        raise ConfigError(f"--pp {args.pp} needs a pipeline planner ({runnable}), not {args.planner}")
    if args.pp < 1 or world % args.pp or cost.model.num_layers % args.pp:
        raise ConfigError(f"--pp {args.pp} must divide the {world} ranks and the {cost.model.num_layers} layers")
    if args.sp is not None and not pipelined:
        raise ConfigError(f"--sp applies only to pipeline planners ({runnable}); {args.planner} chooses its SP "
                          f"degrees itself")
    if pipelined:
        sp = stage_sp(args, cost)  # (auto: per step, unless pinned)
        if sp is not None:
            PipelineCost(cost, args.pp, sp)  # names what is wrong with the layout
        limit = max_seq_len(args.planner, cost, PlannerOptions(pp=args.pp, sp=sp))
        if args.max_seq_len > limit:
            what = f"SP {sp}" if sp is not None else "any SP degree"
            raise ConfigError(f"--max-seq-len {args.max_seq_len} is over the {limit} tokens a {args.pp}-stage pipeline "
                              f"of {what} holds even at the finest slicing; lower it, or use a larger --sp or more "
                              f"--pp")
    if not pipelined and args.max_seq_len > cost.max_seq_len:
        raise ConfigError(f"--max-seq-len {args.max_seq_len} is over the {cost.max_seq_len} tokens the largest SP group "
                          f"of {cost.cluster.name} holds; lower it or use a pipeline planner (--pp, elastic_pp)")
    if args.static_degree is not None:  # (every planner takes it, so that --compare can pass it to all)
        cost.check_degree(args.static_degree)
        if args.planner == "static_ulysses" and args.max_seq_len > cost.token_capacity(args.static_degree):
            raise ConfigError(f"--max-seq-len {args.max_seq_len} is over the {cost.token_capacity(args.static_degree)} "
                              f"tokens a group of --static-degree {args.static_degree} holds; lower it or raise the degree")
    if args.steps < 1 or args.global_batch < 1:
        raise ConfigError("--steps and --global-batch must be at least 1")
    if args.data is None and args.vocab_size is not None:
        raise ConfigError("--vocab-size applies to --data; the default corpus has its tokenizer")
    check_checkpoint_args(args, cost)
    if args.trace and not args.trace.lower().endswith(".json"):
        raise ConfigError(f"--trace {args.trace}: the file name must end in .json (Chrome trace-event JSON)")
    return pipelined


def main(argv: list[str] | None = None) -> int:
    import signal
    import time

    from megatron_ext.lifetime import die_with_parent, exit_quietly_on_stop_signals

    # Stopped (torchrun passes SIGTERM / SIGINT on) or orphaned (torchrun died), a rank ends quietly.
    exit_quietly_on_stop_signals()
    die_with_parent(signal.SIGTERM)
    args = build_parser().parse_args(argv)
    if args.save:
        from megatron_ext.runtime.checkpoint import save_and_stop_on_signals
        save_and_stop_on_signals()
    # megatron-core says, once per rank and module, that CPU runs use its plain-torch fallbacks.
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine)( and Apex)? (is|are) not installed")
    warnings.filterwarnings("ignore", message=r"full scope is deprecated")
    try:
        init_rank_process_group(args.device)
    except MegatronExtError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"megatron-ext: error: {e}", file=sys.stderr)
        return 2
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        return _train(args, rank, world)
    except MegatronExtError as e:
        if rank == 0:
            print(f"megatron-ext: error: {e}", file=sys.stderr)
        return 2
    except Exception:
        # A rank that dies breaks its peers' collectives; torchrun (checking every 0.1 s) stops them a
        # moment later and names it. Wait for that stop, quiet, rather than print a traceback about it.
        time.sleep(5.0)
        raise
    finally:
        dist.destroy_process_group()


def _train(args, rank: int, world: int) -> int:
    from megatron.core import parallel_state

    from megatron_ext.data.batches import sources_text
    from megatron_ext.data.corpus import stdlib_corpus
    from megatron_ext.data.loader import PlanningDataLoader
    from megatron_ext.runtime.checkpoint import load_checkpoint, run_identity, save_checkpoint, stop_requested_anywhere
    from megatron_ext.runtime.compat import apply_cpu_compat
    from megatron_ext.runtime.groups import SPGroupPool
    from megatron_ext.runtime.pipeline_model import build_pipeline_model, stage_state_dict
    from megatron_ext.runtime.step import forward_backward

    cost = train_cost_model(args)
    pipelined = check_args(args, cost, world)
    apply_cpu_compat()
    device = rank_device()
    clock = DeviceClock(device)
    # The same data on every rank: rank 0 builds the default corpus once, the others wait for it.
    values = args.data
    if values is None:
        box = [stdlib_corpus() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        values = [box[0]]
    data = open_training_data(values, args.vocab_size)
    weights = initial_weights(cost.model, data.vocab_size, args.max_seq_len, args.attention_backend, args.seed)
    parallel_state.initialize_model_parallel(1, args.pp)
    model, _ = build_pipeline_model(cost.model, data.vocab_size, args.max_seq_len, args.attention_backend)
    model.module.load_state_dict(stage_state_dict(weights, model))
    optimizer = build_optimizer(model, args.lr)
    done, resumed_from = load_checkpoint(args.load, model, optimizer) if args.load else (0, None)
    auto = args.planner == "auto"
    sp = stage_sp(args, cost)
    # FlexSP: every aligned group of the world; pipelines of several replicas (or of any degree,
    # auto): their SP groups inside each stage's data-parallel ranks, which at one stage are the
    # world's (collective: every rank builds the pool)
    pool = None
    if not pipelined:
        pool = SPGroupPool()
    elif auto or world // args.pp > sp > 1:
        pool = SPGroupPool.from_parallel_state()
    options = PlannerOptions(time_limit=args.time_limit, static_degree=args.static_degree,
                             pp=args.pp if pipelined else None, sp=sp)
    loader = PlanningDataLoader(data.documents, cost, args.global_batch, planner=args.planner, options=options,
                                seed=args.seed, max_seq_len=args.max_seq_len, start_step=done,
                                num_steps=max(args.steps - done, 0), sync="broadcast",
                                source_sizes=data.source_sizes, weights=data.weights,
                                fallback="batchada" if not pipelined or (auto and args.pp == 1) else "batch_1f1b")
    if rank == 0 and not args.json:
        print(_header(args, cost, world, sources_text(data.prefixes, data.source_sizes, loader.weights)), flush=True)
    if rank == 0 and data.vocab_size != cost.model.vocab_size:
        print(f"note: the cost model's {cost.model.name} has a {cost.model.vocab_size:,}-word output layer, this model "
              f"{data.vocab_size:,} words (the data's): predicted step times and the last stage's memory leave out "
              f"the difference", file=sys.stderr, flush=True)
    if rank == 0 and resumed_from:
        print(f"resumed from {resumed_from} at step {done}" + (f"; --steps {args.steps} are done already"
                                                               if done >= args.steps else ""),
              file=sys.stderr, flush=True)
    records = []
    log = None
    trace = RunTrace(cost) if rank == 0 and args.trace else None
    if rank == 0 and args.run_dir:
        Path(args.run_dir).mkdir(parents=True, exist_ok=True)
        log = open(Path(args.run_dir) / "steps.jsonl", "w")
    with loader:
        for step in loader:
            dist.barrier()
            start = clock.mark()
            model.zero_grad_buffer()
            optimizer.zero_grad()
            piped = step.plan.kind == "elastic_pp"  # (auto: per step)
            losses, times = forward_backward(step, model, pool=pool, pad_id=data.pad)
            if piped:
                mb_times = torch.zeros(0, dtype=torch.float64, device=device)
                # the simulator's row of this rank's stage: replica x stages + stage
                mine = (times.replica * args.pp + parallel_state.get_pipeline_model_parallel_rank(), times)
            else:
                mb_times = torch.tensor(times.micro_batches, dtype=torch.float64, device=device)
            ok, grad_norm, _ = optimizer.step()
            dist.barrier()
            step_time = clock.seconds(start, clock.mark())
            # Only ranks holding loss (every FlexSP rank, a pipeline's last stage) report non-zero sums.
            total = torch.stack([d["lm loss"] for d in losses]).sum(0) if losses else torch.zeros(2, device=device)
            dist.all_reduce(total)
            dist.all_reduce(mb_times, op=dist.ReduceOp.MAX)  # a micro-batch lasts as long as its slowest rank
            rec = _record(step, float(total[0] / total[1]), float(grad_norm), int(total[1]), step_time, step.plan,
                          mb_times.tolist())
            if piped:
                ranks = [None] * world
                dist.all_gather_object(ranks, mine)
                if rank == 0:  # the one that reports
                    rec.update(_stage_report(ranks, step, cost))
            if not args.cost_model:  # the preset or YAML `report` tells to re-profile
                rec["model"] = args.model
            if trace is not None:
                trace.add_step(step.step, step.plan, step.lengths, step_time, micro_batch_s=rec["micro_batch_times_s"],
                               ops_per_row=ops_per_row(ranks) if piped else None)
            records.append(rec)
            if rank == 0:
                print(json.dumps(rec) if args.json else _line(rec), flush=True)
                if log:
                    print(json.dumps(rec), file=log, flush=True)
            done = step.step + 1
            stop = stop_requested_anywhere(device)
            if args.save and (stop or done == args.steps or args.save_interval and done % args.save_interval == 0):
                path = save_checkpoint(args.save, done, model, optimizer, run_identity(args, cost))
                if rank == 0:
                    print(f"saved step {done} to {path}", file=sys.stderr, flush=True)
            if stop:
                break
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



def _stage_report(ranks: list, step, cost: CostModel) -> dict:
    """Each stage measured (its slowest rank) next to what the simulator predicts for the same
    plan: activation peak (MB per rank), forward and backward time (s, recompute included), p2p
    wait, and every operation's measured and predicted seconds, in the stage's order. With
    replicas a "stage" is one replica's stage, replica-major (the simulator's rows)."""
    from megatron_ext.plan.validate import replica_groups
    from megatron_ext.sim import simulate

    pipe = step.plan.pipelines[0]
    pc = PipelineCost(cost, pipe.stages, pipe.sp_degree)
    states = pc.model_states_mb
    sim = simulate(step.plan, step.lengths, cost)
    predicted: dict[tuple[int, str], float] = {}
    # ops are named by pipeline when their replica runs more than one (the runtime's and simulator's names)
    several = [len(g) > 1 for g in replica_groups(step.plan, cost.num_gpus)]
    for e in sim.events:  # a backward's recompute ("R") counts toward the backward
        if e.kind in ("F", "B", "R"):
            pi, cid = e.label.split(":", 1)  # "p<pipeline>:<chunk>"
            name = ("B" if e.kind == "R" else e.kind) + cid
            key = (e.where, name + (f" of pipeline {pi[1:]}" if several[e.where // pipe.stages] else ""))
            predicted[key] = predicted.get(key, 0.0) + e.end_s - e.start_s
    P = len(sim.peak_memory_mb)  # replicas x stages
    peak, fwd, bwd, wait = [0.0] * P, [0.0] * P, [0.0] * P, [0.0] * P
    ops: list[dict[str, float]] = [{} for _ in range(P)]
    for stage, st in ranks:
        peak[stage] = max(peak[stage], st.activation_peak_bytes / 2**20)
        fwd[stage] = max(fwd[stage], sum(t for op, t in st.ops if op[0] == "F"))
        bwd[stage] = max(bwd[stage], sum(t for op, t in st.ops if op[0] == "B"))
        wait[stage] = max(wait[stage], st.comm_wait_s)
        for op, t in st.ops:
            ops[stage][op] = max(ops[stage].get(op, 0.0), t)

    def r(xs):
        return [round(float(x), 4) for x in xs]

    return {"stages": pipe.stages, "activation_room_mb": round(pc.activation_room_mb, 4),
            "activation_peak_mb_per_stage": r(peak),
            "planned_activation_mb_per_stage": r(x - states for x in sim.peak_memory_mb),
            "forward_s_per_stage": r(fwd), "backward_s_per_stage": r(bwd), "p2p_wait_s_per_stage": r(wait),
            "predicted_busy_s_per_stage": r(sim.busy_s),
            "ops_per_stage": [[[op, round(t, 5), round(predicted[(p, op)], 5) if (p, op) in predicted else None]
                               for op, t in ops[p].items()] for p in range(P)]}


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
    return (f"train: {cost.model.name} on {cost.cluster.name} ({world} ranks), planner {args.planner} ({layout}); "
            f"{args.global_batch} sequences a step of up to {args.max_seq_len:,} tokens, {plural(args.steps, 'step')}, "
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
            + f", median step {np.median(measured):.2f} s, {tokens / measured.sum():,.0f} tokens/s (after the first "
              f"step); cost-model error {f['step_median_abs_error']:.0%} (median)"
            + "".join(f"\n  {line}" for line in advice(records, f) if f["recalibrate"]))


if __name__ == "__main__":
    sys.exit(main())
