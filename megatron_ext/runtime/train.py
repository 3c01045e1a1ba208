"""Real training of a small megatron-core GPT on CPU ranks (gloo) or GPUs (NCCL) with per-step plans:
the engine of ``megatron-ext train`` (``commands/train.py`` parses its options, starts the ranks,
prints the steps and writes the files the user asked for).

On every rank ``Training(args, rank, world)`` builds the same GPTModel with Ulysses core attention,
wraps it in megatron's DistributedDataParallel and optimizer, and opens the data (``--data``, or
the Python standard library corpus). ``Training.steps()`` trains: rank 0 plans each step one step
ahead in a background process and broadcasts the plan; every rank runs its shard of every
micro-batch (or its stage of every pipeline). Each step yields its record (``runtime/records.py``:
loss, grad norm, tokens, measured and predicted step time, the SP degrees used; for pipelines each
stage measured against the simulator, on rank 0), then saves a checkpoint where ``--save`` asks.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from megatron_ext.cost import CostModel
from megatron_ext.cost.model import check_presets_not_beside_file
from megatron_ext.cost.pipeline import PipelineCost
from megatron_ext.data.datasets import DataError
from megatron_ext.data.lengths import MAX_BATCH, check_seed
from megatron_ext.errors import ConfigError, DivergedError
from megatron_ext.planner import PlannerOptions
from megatron_ext.planner.api import PIPELINE_KINDS, get_planner, max_seq_len, planner_names
from megatron_ext.runtime.checkpoint import check_checkpoint_args
from megatron_ext.runtime.device import rank_device
from megatron_ext.runtime.records import step_record
from megatron_ext.runtime.timing import DeviceClock
from megatron_ext.spec import MB, ModelSpec, is_power_of_two, read_yaml


def initial_weights(spec: ModelSpec, vocab_size: int, max_seq_len: int, backend: str, seed: int) -> dict:
    """The whole model's initial weights, from megatron's own initialization with ``seed``: every
    pipeline layout then starts from the same function (each stage loads its part)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_ext.runtime.pipeline_model import build_pipeline_model

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    # in host memory: the whole model, on each rank, beside its stage (twice a 13B model's fp32
    # weights would not fit an 80 GB GPU)
    model, _ = build_pipeline_model(spec, vocab_size, max_seq_len, backend, ddp=False, on_host=True)
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in model.state_dict().items()}
    parallel_state.destroy_model_parallel()
    return state


def model_recompute(spec: ModelSpec) -> dict:
    """The TransformerConfig fields of the model's own recompute policy (``recompute: full``: its
    first ``recompute_layers`` layers keep only their input, Megatron's full block method), which
    the cost model prices; FlexSP planners run it (``train_cost_model`` leaves it out for pipelines)."""
    n = spec.recomputed_layers
    return dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=n) if n else {}


def build_optimizer(ddp, lr: float):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    return get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=1.0,
                                                  bf16=False, fp16=False), [ddp])


def stage_sp(args, cost: CostModel) -> int | None:
    """The Ulysses degree of the run's pipeline stages: ``--sp``, else ranks / pp (or, over the
    head limit, the largest allowed degree dividing it; the rest run as replicas). None without
    pipelines, and for auto without ``--sp`` (chosen per step)."""
    from megatron_ext.planner.pp.pipeline import resolve_layout

    if args.planner == "auto":
        return args.sp
    if args.planner not in planner_names(*PIPELINE_KINDS):
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


def open_training_data(values: list[str], vocab_size: int | None, check_tokens: bool = True) -> TrainingData:
    """``--data`` (``open_blend``: a prefix or a blend) and its vocabulary: ``--vocab-size``, every
    token id of every source checked to be in it (unless ``check_tokens`` is False: the ranks, whose
    launcher checked them; padding then uses id 0: padded positions carry no loss, so any id does),
    or else the tokenizer every source's corpus manifest names (they must agree)."""
    from megatron_ext.data.corpus import corpus_tokenizer
    from megatron_ext.data.datasets import blend_documents, open_blend

    if vocab_size is not None and vocab_size < 1:
        raise ConfigError(f"--vocab-size must be at least 1, got {vocab_size}")
    sources = open_blend(values)
    docs, sizes, weights = blend_documents(sources)
    prefixes = [d.prefix for _, d in sources]
    if vocab_size is not None:
        for _, d in sources if check_tokens else ():
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
TRAIN_MODEL, TRAIN_CLUSTER = "tiny", "cpu-4"  # without --model / --cluster (and --cost-model)


def train_cost_model(args) -> CostModel:
    """The cost model a run plans with: ``--cost-model``, else the ``--model`` and ``--cluster``
    presets, at the ZeRO stage ``train`` runs (a YAML stating another stage is refused), with
    groups of up to ``--max-ring`` Ulysses subgroups in a ring. Under a pipeline planner (auto
    included) the model's own recompute (``recompute: full``) is left out: the pipelines choose
    each chunk's recompute, and FlexSP steps of auto run none."""
    if not is_power_of_two(args.max_ring):  # (read here first: check_args gets the model it makes)
        raise ConfigError(f"--max-ring must be a power of two (1: no ring), got {args.max_ring}")
    if args.cost_model is None:
        cost = CostModel.from_presets(train_model(args), TRAIN_CLUSTER if args.cluster is None else args.cluster,
                                      TRAIN_ZERO_STAGE).with_max_ring(args.max_ring)
    else:
        check_presets_not_beside_file(args.model, args.cluster)
        cost = CostModel.from_yaml(args.cost_model, TRAIN_ZERO_STAGE).with_max_ring(args.max_ring)
        if cost.zero_stage != TRAIN_ZERO_STAGE:
            raise ConfigError(f"--cost-model {args.cost_model} says zero_stage: {cost.zero_stage}, but train keeps "
                              f"every model state on every rank (stage {TRAIN_ZERO_STAGE}: no distributed optimizer); "
                              f"drop the stage from the file or make it {TRAIN_ZERO_STAGE}")
        measured_in = read_yaml(Path(args.cost_model)).get("dtype", "fp32")
        if measured_in != "fp32":  # its times and activation bytes would not be this run's
            raise ConfigError(f"--cost-model {args.cost_model} was measured in {measured_in}, but train runs fp32: "
                              f"measure it with `megatron-ext profile --dtype fp32`")
    if cost.model.recomputed_layers and get_planner(args.planner).kind in PIPELINE_KINDS:
        cost = cost.with_recompute()
    return cost


def train_model(args) -> str:
    """The model preset or YAML a run without --cost-model trains."""
    return TRAIN_MODEL if args.model is None else args.model


def check_args(args, cost: CostModel, world: int, read_checkpoint: bool = True) -> bool:
    """Refuse what cannot run, before anything starts (the launcher calls it, then every rank,
    which passes ``read_checkpoint`` False: the launcher has read every byte of a --load
    checkpoint). Returns whether the planner plans pipelines (``auto`` included: its steps are
    FlexSP or pipelines of the run's stages, whichever is faster, as the model's stages are fixed
    for the run)."""
    if cost.num_gpus != world:
        raise ConfigError(f"cluster {cost.cluster.name} has {cost.num_gpus} GPUs but {world} ranks were launched")
    if not (np.isfinite(args.lr) and args.lr >= 0):
        raise ConfigError(f"--lr must be a finite number, 0 or more, got {args.lr}")
    if not (np.isfinite(args.time_limit) and args.time_limit > 0):
        raise ConfigError(f"--time-limit must be a finite number of seconds over 0, got {args.time_limit}")
    pipelined = get_planner(args.planner).kind in PIPELINE_KINDS
    runnable = ", ".join(planner_names(*PIPELINE_KINDS))
    if args.pp > 1 and not pipelined:
        raise ConfigError(f"--pp {args.pp} needs a pipeline planner ({runnable}), not {args.planner}")
    if args.pp < 1 or world % args.pp or cost.model.num_layers % args.pp:
        raise ConfigError(f"--pp {args.pp} must divide the {world} ranks and the {cost.model.num_layers} layers")
    if cost.max_ring > 1 and pipelined:
        raise ConfigError(f"--max-ring {cost.max_ring} applies to FlexSP planners; the stages of {args.planner} run "
                          f"Ulysses groups only")
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
            packed = args.planner in ("batch_1f1b", "seq1f1b")  # (their packs are cut into fixed slices)
            raise ConfigError(f"--max-seq-len {args.max_seq_len} is over the {limit} tokens a {args.pp}-stage pipeline "
                              f"of {what} holds " + ("in its packs" if packed else "even at the finest slicing")
                              + "; lower it, or use a larger --sp or more --pp" + (", or elastic_pp" if packed else ""))
    if not pipelined and args.max_seq_len > cost.max_seq_len:
        raise ConfigError(f"--max-seq-len {args.max_seq_len} is over the {cost.max_seq_len} tokens the largest SP group "
                          f"of {cost.cluster.name} holds; lower it or use a pipeline planner (--pp, elastic_pp)")
    if args.static_degree is not None:  # (every planner takes it, so that --compare can pass it to all)
        cost.check_degree(args.static_degree)
        if args.planner == "static_ulysses" and args.max_seq_len > cost.token_capacity(args.static_degree):
            raise ConfigError(f"--max-seq-len {args.max_seq_len} is over the {cost.token_capacity(args.static_degree)} "
                              f"tokens a group of --static-degree {args.static_degree} holds; lower it or raise the degree")
    if args.steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {args.steps}")
    if not 1 <= args.global_batch <= MAX_BATCH:
        raise ConfigError(f"--global-batch must be from 1 to {MAX_BATCH:,}, got {args.global_batch}")
    if args.max_seq_len < 2:  # (its one token has no next token: no loss, NaN steps)
        raise ConfigError(f"--max-seq-len must be at least 2 tokens, got {args.max_seq_len}")
    check_seed(args.seed, ConfigError)
    if args.data is None and args.vocab_size is not None:
        raise ConfigError("--vocab-size applies to --data; the default corpus has its tokenizer")
    check_checkpoint_args(args, cost, read_checkpoint)
    if args.trace and not args.trace.lower().endswith(".json"):
        raise ConfigError(f"--trace {args.trace}: the file name must end in .json (Chrome trace-event JSON)")
    return pipelined


@dataclass
class TrainedStep:
    """One trained step: the planned ``step`` (``data.loader.Step``), its ``record`` (every rank's;
    the stage report of a pipeline step only on rank 0), for a pipeline step ``ranks``: every
    rank's (simulator row, measured stage stats), gathered on rank 0 (None elsewhere, and for FlexSP
    steps), and for a FlexSP step ``rank_micro_batch_s``: every rank's seconds in each micro-batch
    (``sim.trace.group_spans``)."""

    step: object
    record: dict
    ranks: list | None
    rank_micro_batch_s: list | None = None


class Training:
    """A training run on this rank, set up: the cost model, the data, the model (its stage of the
    run's pipeline) with the run's initial weights, the optimizer, the checkpoint resumed from
    (``done`` steps: ``--load``) and the loader that plans the steps. Collective: every rank of
    the run builds one, then iterates ``steps()``."""

    def __init__(self, args, rank: int, world: int):
        from megatron.core import parallel_state

        from megatron_ext.data.corpus import stdlib_corpus
        from megatron_ext.data.loader import PlanningDataLoader
        from megatron_ext.runtime.checkpoint import check_resumed_data, load_checkpoint, resume_from
        from megatron_ext.runtime.compat import apply_cpu_compat
        from megatron_ext.runtime.groups import SPGroupPool
        from megatron_ext.runtime.pipeline_model import build_pipeline_model, stage_state_dict

        self.args, self.rank, self.world = args, rank, world
        self.cost = cost = train_cost_model(args)
        self.pipelined = pipelined = check_args(args, cost, world, read_checkpoint=False)
        apply_cpu_compat()
        self.device = rank_device()
        self.clock = DeviceClock(self.device)
        # The same data on every rank: rank 0 builds the default corpus once, the others wait for it.
        values = args.data
        if values is None:
            box = [stdlib_corpus() if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            values = [box[0]]
        # (every token id of --data was checked against --vocab-size before the ranks started: a pass
        # over every .bin, not repeated by each rank)
        self.data = data = open_training_data(values, args.vocab_size, check_tokens=False)
        weights = initial_weights(cost.model, data.vocab_size, args.max_seq_len, args.attention_backend, args.seed)
        parallel_state.initialize_model_parallel(1, args.pp)
        self.model, _ = build_pipeline_model(cost.model, data.vocab_size, args.max_seq_len, args.attention_backend,
                                             **model_recompute(cost.model))
        self.model.module.load_state_dict(stage_state_dict(weights, self.model))
        self.optimizer = build_optimizer(self.model, args.lr)
        resume = resume_from(args)  # (None: no --load, or --save's own directory before its first save)
        if resume is not None:
            check_resumed_data(resume, data)
        self.done, self.resumed_from = (load_checkpoint(resume, self.model, self.optimizer) if resume is not None
                                        else (0, None))
        auto = args.planner == "auto"
        sp = stage_sp(args, cost)
        # FlexSP: every aligned group of the world; pipelines of several replicas (or of any degree,
        # auto): their SP groups inside each stage's data-parallel ranks, which at one stage are the
        # world's (collective: every rank builds the pool)
        self.pool = None
        if not pipelined:
            self.pool = SPGroupPool()
        elif auto or world // args.pp > sp > 1:
            self.pool = SPGroupPool.from_parallel_state()
        options = PlannerOptions(time_limit=args.time_limit, static_degree=args.static_degree,
                                 pp=args.pp if pipelined else None, sp=sp,
                                 flexsp=args.pp == 1)  # (a model cut into stages cannot run FlexSP's passes)
        self.loader = PlanningDataLoader(data.documents, cost, args.global_batch, planner=args.planner,
                                         options=options, seed=args.seed, max_seq_len=args.max_seq_len,
                                         start_step=self.done, num_steps=max(args.steps - self.done, 0),
                                         sync="broadcast", source_sizes=data.source_sizes, weights=data.weights,
                                         fallback="batchada" if not pipelined or (auto and args.pp == 1)
                                         else "batch_1f1b")

    def steps(self) -> Iterator[TrainedStep]:
        """Train the run's steps, yielding each; after each, a checkpoint where ``--save`` asks
        for one (every ``--save-interval`` steps, after the last, or on a stop signal, which ends
        the run there)."""
        from megatron.core import parallel_state

        from megatron_ext.runtime.checkpoint import run_identity, save_checkpoint, stop_requested_anywhere
        from megatron_ext.runtime.step import forward_backward

        args, model, optimizer, device, clock = self.args, self.model, self.optimizer, self.device, self.clock
        identity = None  # what the checkpoints are saved with (``run_identity``), at the first save
        with self.loader:
            for step in self.loader:
                dist.barrier()
                start = clock.mark()
                model.zero_grad_buffer()
                optimizer.zero_grad()
                piped = step.plan.kind == "elastic_pp"  # (auto: per step)
                losses, times = forward_backward(step, model, pool=self.pool, pad_id=self.data.pad, cost=self.cost)
                if piped:
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
                rank_mb = None  # FlexSP: every rank's micro-batch times, each group's span read from them
                if not piped:
                    gathered = [torch.empty_like(mb_times) for _ in range(self.world)]
                    dist.all_gather(gathered, mb_times)
                    rank_mb = torch.stack(gathered).tolist()
                rec = {"step": step.step, "loss": float(total[0] / total[1]), "grad_norm": float(grad_norm),
                       **step_record(step.plan, step.lengths, step=step.step, tokens=int(total[1]),
                                     step_time_s=step_time, rank_micro_batch_s=rank_mb,
                                     plan_source=step.plan_source)}
                ranks = None
                if piped:  # every stage's operations, to the rank that reports
                    gathered = [None] * self.world if self.rank == 0 else None
                    dist.gather_object(mine, gathered, dst=0)
                    if gathered is not None:
                        ranks = gathered
                        rec.update(_stage_report(ranks, step, self.cost))
                if not args.cost_model:  # the preset or YAML `report` tells to re-profile
                    rec["model"] = train_model(args)
                yield TrainedStep(step, rec, ranks, rank_mb)
                if not (math.isfinite(rec["loss"]) and math.isfinite(rec["grad_norm"])):
                    # (every rank has the same two numbers: all stop; nothing of this step is saved,
                    # so the last checkpoint stays the newest, as Megatron-LM's NaN check does)
                    raise DivergedError(f"step {step.step}: loss {rec['loss']}, grad norm {rec['grad_norm']}; the run "
                                        f"stops here, unsaved" + (f" (the newest checkpoint stays in {args.save})"
                                                                  if args.save else ""))
                done = step.step + 1
                stop = stop_requested_anywhere(device)
                if args.save and (stop or done == args.steps or args.save_interval and done % args.save_interval == 0):
                    if identity is None:  # (once a run: the data's fingerprint reads every length)
                        identity = run_identity(args, self.cost, self.data)
                    path = save_checkpoint(args.save, done, model, optimizer, identity)
                    if self.rank == 0:
                        print(f"saved step {done} to {path}", file=sys.stderr, flush=True)
                if stop:
                    break

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
        peak[stage] = max(peak[stage], st.activation_peak_bytes / MB)
        fwd[stage] = max(fwd[stage], sum(t for op, t in st.ops if op[0] == "F"))
        bwd[stage] = max(bwd[stage], sum(t for op, t in st.ops if op[0] == "B"))
        wait[stage] = max(wait[stage], st.comm_wait_s)
        for op, t in st.ops:
            ops[stage][op] = max(ops[stage].get(op, 0.0), t)

    def r(xs):
        return [round(float(x), 4) for x in xs]

    return {"activation_room_mb": round(pc.activation_room_mb, 4),
            "activation_peak_mb_per_stage": r(peak),
            "planned_activation_mb_per_stage": r(x - states for x in sim.peak_memory_mb),
            "forward_s_per_stage": r(fwd), "backward_s_per_stage": r(bwd), "p2p_wait_s_per_stage": r(wait),
            "predicted_busy_s_per_stage": r(sim.busy_s),
            "ops_per_stage": [[[op, round(t, 5), round(predicted[(p, op)], 5) if (p, op) in predicted else None]
                               for op, t in ops[p].items()] for p in range(P)]}


