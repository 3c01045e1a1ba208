"""What Megatron-LM's training loop calls in a ``--flexsp`` or ``--elastic-pp`` run: datasets,
forward-backward, logs.

Megatron's ``train_step`` calls ``forward_backward_func(forward_step_func=..., data_iterator=...,
num_microbatches=get_num_microbatches(), ...)`` once per iteration. In a planned run the data
iterator yields one planned ``Step`` per iteration (``data.py``) and the plan, not Megatron,
decides the micro-batches:

* ``flexsp_forward_backward`` takes the step and runs it through ``runtime.forward_backward`` (the
  one step API of ``runtime/step.py``, as ``megatron-ext train`` does), which for a FlexSP plan
  cuts this rank's inputs (its shard of its SP group's packed tokens and the
  ``UlyssesPackedSeqParams`` naming the group) and runs megatron-core's own
  ``forward_backward_no_pipelining`` over them with ``runtime.forward.forward_step``;
* ``elastic_forward_backward`` takes the step and runs it through ``runtime.forward_backward``,
  which for an elastic_pp plan runs the elastic pipeline executor on this rank's stage: the
  plan's chunks in each stage's planned order, point-to-point over Megatron's pipeline group, each stage's data-parallel ranks one Ulysses group (with
  ``--elastic-pp-sp`` D below them: dp / D groups of D, one per pipeline replica, each replica
  running its own pipelines), the planned layers recomputed per chunk, then Megatron's
  ``finalize_model_grads``.

Loss is per token (``--calculate-per-token-loss``): each micro-batch (chunk) returns its token-loss
sum and token count; Megatron sums both over the data-parallel ranks (on the last pipeline stage),
so its "lm loss" is the global batch's mean token loss whatever the plan (replicas included: the
last stage's data-parallel ranks are every replica's last stage).

A FlexSP rank with no sequence in a micro-batch runs the model on a single pad token whose loss
counts zero: every module hook and collective of a real micro-batch runs (DDP marks every gradient
ready, which ``--overlap-grad-reduce`` relies on in the last micro-batch; the distributed
optimizer's ``--overlap-param-gather`` hooks fire), and no gradient changes. (In a pipeline every
rank of a stage holds a shard of every chunk of its replica, and every replica has chunks: the
planner gives each replica a sequence before any gets two, and ``arguments.validate_args`` asks
for at least as many sequences a step as there are replicas.)

After each training step the measured forward-backward time (slowest rank) is set beside the
plan's prediction: every ``--log-interval`` iterations one line through Megatron's logger, every
iteration TensorBoard scalars under ``flexsp/`` or ``elastic-pp/`` (Megatron's writer, when
``--tensorboard-dir`` is set), and one JSON record per step in ``--planner-log``.
"""
from __future__ import annotations

import atexit
import copy
import json
import logging
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron_ext.data.loader import Step
from megatron_ext.megatron.arguments import mode_flag
from megatron_ext.runtime import records
from megatron_ext.runtime.device import rank_device
from megatron_ext.runtime.forward import forward_step, idle_loss
from megatron_ext.runtime.step import forward_backward
from megatron_ext.runtime.timing import DeviceClock
from megatron_ext.text import plural

logger = logging.getLogger(__name__)


@dataclass
class _State:
    pool: object = None  # SPGroupPool over megatron's data-parallel groups (FlexSP; replicas of SP > 1 or auto)
    pad_id: int = 0
    device: object = "cpu"
    loaders: tuple = ()
    last_step: Step | None = None  # the last training step (Megatron's FLOPs count reads its lengths)
    counted_step: Step | None = None  # the last step whose FLOPs were counted
    counted_flops: tuple = ()  # the counts of the steps since Megatron last logged
    trace: object = None  # --planner-trace's RunTrace (rank 0)
    cost: object = None  # the planner's cost model (the pipeline runtime orders its messages by its times)
    checkpoint_args: object = None  # the arguments of the run --load resumes (hooks.py keeps them)


STATE = _State()


def _args():
    from megatron.training import get_args

    return get_args()


def _pad_id(tokenizer) -> int:
    """The id written into padding (its loss mask is 0, so any valid id does): the tokenizer's pad,
    else its end-of-document token (Megatron's tokenizers raise NotImplementedError for what they lack)."""
    for name in ("pad", "eod"):
        try:
            value = getattr(tokenizer, name)
        except (AttributeError, NotImplementedError):
            continue
        if value is not None and value >= 0:
            return int(value)
    return 0


# ---- datasets ------------------------------------------------------------------------------------
def planned_datasets_provider(train_val_test_num_samples=None, vp_stage=None):
    """Megatron's ``train_valid_test_datasets_provider`` for --flexsp and --elastic-pp: iterators of
    planned steps (train, valid, test; None for an empty split or with --eval-iters 0). Called on
    every rank (``is_distributed``); it also creates the SP group pool, collectively, once: FlexSP's
    groups, or the groups of elastic pipeline replicas of SP above 1, or of every degree with
    --elastic-pp-sp auto (an elastic stage of one SP group uses Megatron's data-parallel group
    itself, and SP 1 needs none)."""
    from megatron.core import parallel_state
    from megatron.training import get_tokenizer, print_rank_0

    from megatron_ext.megatron.cost import cap_cost_model, head_degree_limit, megatron_cost_model
    from megatron_ext.data.batches import TooFewSamples
    from megatron_ext.data.datasets import DataError
    from megatron_ext.megatron.data import make_loader, planned_splits
    from megatron_ext.runtime.attention import add_sp_dropout_rng
    from megatron_ext.runtime.groups import SPGroupPool

    args = _args()
    flag = mode_flag(args)
    elastic = flag == "--elastic-pp"
    dp = parallel_state.get_data_parallel_world_size()
    if STATE.pool is None and (not elastic or args.elastic_pp_sp == "auto" or 1 < args.elastic_pp_sp < dp):
        # (Megatron's own groups' timeout: the default would be torch's, not --distributed-timeout-minutes)
        STATE.pool = SPGroupPool.from_parallel_state(timeout=timedelta(minutes=args.distributed_timeout_minutes))
    tokenizer = get_tokenizer()
    STATE.pad_id = _pad_id(tokenizer)
    STATE.device = rank_device()
    # each SP rank draws its own attention-dropout masks, from the step the run starts at (after
    # Megatron's seeding and checkpoint load: runtime/attention.py)
    add_sp_dropout_rng(args.seed, int(args.iteration))

    tp = args.tensor_model_parallel_size
    kv = args.num_query_groups if args.group_query_attention else None
    cap = head_degree_limit(args.num_attention_heads, kv, tp)
    if not elastic:
        cap = min(cap, args.flexsp_max_sp_size or STATE.pool.size)
    cost = STATE.cost = cap_cost_model(megatron_cost_model(args), cap)
    if getattr(args, "planner_trace", None) and dist.get_rank() == 0 and STATE.trace is None:
        from megatron_ext.sim.trace import RunTrace
        STATE.trace = RunTrace(cost)
    splits = planned_splits(args, tokenizer)
    start = int(args.iteration)
    consumed = int(getattr(args, "consumed_train_samples", 0) or 0)
    if consumed != start * int(args.global_batch_size):  # (step k's batch is a function of the batch size)
        raise DataError(f"{flag}: the checkpoint trained {consumed:,} samples in {start:,} iterations, not "
                        f"--global-batch-size {args.global_batch_size} each: resume with the batch size it was "
                        f"saved with (a planned run's step k draws batch k of that size)")
    starts = (start, valid_start_step(args), 0)  # test starts at its first batch, as in Megatron
    loaders = []
    for k, (docs, sizes, weights, _) in enumerate(splits):
        if k > 0 and not args.eval_iters:
            loaders.append(None)
            continue
        steps = max(0, int(args.train_iters) - start) if k == 0 and args.train_iters else None
        name = ("train", "validation", "test")[k]
        try:
            loaders.append(make_loader(docs, cost, args, num_steps=steps, start_step=starts[k],
                                       seed=args.seed + k, source_sizes=sizes, weights=weights))
        except TooFewSamples as e:  # (samples: documents cut at the run's longest sequence)
            if k == 2:  # not tested, as Megatron leaves a split without a dataset
                loaders.append(None)
                continue
            hint = (f"; --eval-iters {args.eval_iters} needs one: set --eval-iters 0, or give validation documents "
                    f"(--split, --valid-data-path)" if k == 1 else "")
            raise DataError(f"{flag}: the {name} split: {e}{hint}") from None
        except DataError as e:
            raise DataError(f"{flag}: the {name} split: {e}") from None
    STATE.loaders = tuple(loaders)
    atexit.register(_close_loaders)
    train = loaders[0]
    check_sample_cut(args, train.max_seq_len, flag)
    if elastic:
        sp = train.options.sp
        replicas = 1 if sp is None else dp // sp
        layout = ((f"{replicas} pipeline replicas of " if replicas > 1 else "")
                  + f"{train.options.pp} stages x SP {sp or 'chosen per step (and replicas)'}, recompute "
                  + ("per chunk (--adaptive-recompute)" if train.options.recompute == "ilp"
                     else "none, or every layer when a step does not fit"))
    else:
        layout = f"degrees {list(cost.degrees)}" + (" or, per step, one-stage pipeline replicas"
                                                    if train.planner == "auto" else "")
    names = splits[0][3] if splits[1][3] in (splits[0][3], "none") else f"train {splits[0][3]}, valid {splits[1][3]}"
    print_rank_0(f"> {flag[2:]}: {sum(len(d) for d, *_ in splits)} documents ({names}), "
                 f"split {[len(d) for d, *_ in splits]}; planner {train.planner} with {cost.model.name} on "
                 f"{cost.cluster.name}, {layout}, sequences up to {train.max_seq_len} tokens")
    return tuple(None if ld is None else iter(ld) for ld in loaders)


def check_sample_cut(args, max_len: int, flag: str) -> None:
    """Documents are cut into samples at the longest sequence the run plans (--seq-length, capped
    by what the largest SP group holds, which the GPU count sets), and step k's batch is drawn
    from those samples: a run resumed with another cut would draw other batches, repeating and
    skipping documents. The cut goes into the checkpoint's arguments (``planned_max_seq_len``);
    a resume that would cut otherwise is refused."""
    saved = getattr(STATE.checkpoint_args, "planned_max_seq_len", None)
    if saved is not None and int(saved) != max_len:
        from megatron_ext.data.datasets import DataError

        saved = int(saved)
        if max_len == int(args.seq_length):  # (not capped here: --seq-length itself differs)
            why = f"--seq-length {args.seq_length}"
            fix = f"resume with --seq-length {saved}"
        else:
            why = f"--seq-length {args.seq_length} capped by what this cluster's largest SP group holds"
            fix = (f"resume on the GPU count it was saved with" + (f", or with --seq-length {saved}"
                                                                    if saved < max_len else ""))
        raise DataError(f"{flag}: the checkpoint's run cut documents into samples of at most {saved:,} tokens, "
                        f"this one would cut them at {max_len:,} ({why}), and so draw other batches: {fix}")
    args.planned_max_seq_len = max_len


def valid_start_step(args) -> int:
    """The validation batch a run starts at: where Megatron's own validation sampler starts, the
    batches ``args.consumed_valid_samples`` counts (restored from a checkpoint by ``--load``, so a
    resumed run goes on scoring new documents), or the first with ``--skip-train`` (which
    evaluates the split from its start)."""
    if getattr(args, "skip_train", False):
        return 0
    return int(args.consumed_valid_samples) // int(args.global_batch_size)


def _close_loaders() -> None:
    """Stop the planner processes before the interpreter tears down (at exit)."""
    for loader in STATE.loaders:
        if loader is not None:
            loader.close()
    STATE.loaders = ()


# ---- forward and backward ------------------------------------------------------------------------
def _idle_forward(model):
    """A rank with no sequence in a micro-batch runs the model on one pad token with loss weight
    0: every module hook (DDP gradient-ready, distributed-optimizer parameter gathers) and every
    tensor-parallel collective runs as in a real micro-batch, and the gradients do not change."""
    from megatron_ext.runtime.attention import UlyssesPackedSeqParams

    params = UlyssesPackedSeqParams.build([1], None, device=STATE.device)
    token = torch.full((1, 1), STATE.pad_id, dtype=torch.long, device=STATE.device)
    output = model(token, params.position_ids[None], None, labels=torch.zeros_like(token), packed_seq_params=params)
    return output, idle_loss


def _checked(loss_func):
    """Megatron's NaN / Inf checks of pretrain_gpt's loss_func, around the runtime's loss."""

    def loss(output):
        value, count, report = loss_func(output)
        args = _args()
        if getattr(args, "check_for_nan_in_loss_and_grad", False):
            from megatron.core.rerun_state_machine import get_rerun_state_machine

            rsm = get_rerun_state_machine()
            rsm.validate_result(result=value, rejection_func=torch.isnan,
                                message="found NaN in local forward loss calculation", tolerance=0.0, fatal=True)
            rsm.validate_result(result=value, rejection_func=torch.isinf,
                                message="found Inf in local forward loss calculation", tolerance=0.0, fatal=True)
        return value, count, report

    return loss


def _forward_step(data_iterator, model, *unused):
    """forward_step_func of one FlexSP micro-batch or pipeline chunk (``data_iterator`` yields a
    ``runtime.forward.ModelInput``, or None where a FlexSP rank idles): the runtime's, with an idle
    pass through the model and Megatron's loss checks added."""
    inp = next(data_iterator)
    if inp is None:
        return _idle_forward(model)
    output, loss_func = forward_step(iter([inp]), model)
    return output, _checked(loss_func)


def _planned_step(data_iterator, flag: str) -> Step:
    step = next(data_iterator)
    if not isinstance(step, Step):
        raise TypeError(f"{flag}: the data iterator yielded {type(step).__name__}, not a planned Step; "
                        f"the datasets provider is not megatron_ext's (is pretrain_gpt.py patched?)")
    return step


def _one_model_chunk(model, flag: str):
    chunks = model if isinstance(model, list) else [model]
    if len(chunks) != 1:
        raise ValueError(f"{flag} runs one model chunk per rank (no virtual pipeline stages)")
    return chunks[0]


def flexsp_forward_backward(*, forward_step_func=None, data_iterator, model, num_microbatches=None,
                            seq_length=None, micro_batch_size=None, forward_only=False, **kwargs):
    """Megatron's forward_backward_func for --flexsp (same keywords). Consumes one ``Step`` from
    ``data_iterator`` and runs its micro-batches through megatron-core's schedule; Megatron's
    ``num_microbatches``, ``seq_length`` and ``forward_step_func`` are ignored (the plan decides).
    A step ``--flexsp-planner auto`` planned as one-stage pipeline replicas runs as an elastic step."""
    step = _planned_step(data_iterator, "--flexsp")
    if step.plan.kind == "elastic_pp":  # --flexsp-planner auto: this step runs as one-stage pipeline replicas
        return _run_elastic(step, model, forward_only, "--flexsp")
    if STATE.pool is None:
        raise RuntimeError("--flexsp: the SP group pool is missing (the planned datasets provider did not run)")
    chunk = _one_model_chunk(model, "--flexsp")
    clock = DeviceClock(STATE.device)
    start = clock.mark()
    losses, times = forward_backward(step, chunk, pool=STATE.pool, pad_id=STATE.pad_id, forward_only=forward_only,
                                     device=STATE.device, forward_step_func=_forward_step,
                                     seq_length=int(seq_length or 0), **kwargs)
    end = clock.mark()
    if not forward_only:
        report_step(step, clock.seconds(start, end), times.micro_batches)
    return losses


def elastic_forward_backward(*, forward_step_func=None, data_iterator, model, num_microbatches=None,
                             seq_length=None, micro_batch_size=None, forward_only=False, **kwargs):
    """Megatron's forward_backward_func for --elastic-pp (same keywords). Consumes one ``Step``
    from ``data_iterator`` and runs on this rank's stage the pipelines of this rank's replica
    (``runtime.forward_backward``, which ends with Megatron's ``finalize_model_grads``). Returns
    the last stage's loss dicts, one per chunk (``{"lm loss": [sum, tokens]}``), and nothing
    elsewhere, as Megatron's pipeline schedules do; Megatron's other keywords are ignored (the
    plan decides)."""
    return _run_elastic(_planned_step(data_iterator, "--elastic-pp"), model, forward_only, "--elastic-pp")


def _run_elastic(step: Step, model, forward_only: bool, flag: str):
    from megatron.core import parallel_state

    chunk = _one_model_chunk(model, flag)
    clock = DeviceClock(STATE.device)
    start = clock.mark()
    losses, stats = forward_backward(step, chunk, pool=STATE.pool, pad_id=STATE.pad_id, forward_only=forward_only,
                                     device=STATE.device, forward_step_func=_forward_step, cost=STATE.cost)
    end = clock.mark()
    if not forward_only:
        stages = parallel_state.get_pipeline_model_parallel_world_size()
        busy = [0.0] * stages
        busy[parallel_state.get_pipeline_model_parallel_rank()] = sum(t for _, t in stats.ops)
        per_row = None
        if getattr(_args(), "planner_trace", None):  # (set on every rank; rank 0 writes the trace)
            from megatron_ext.sim.trace import ops_per_row

            mine = (stats.replica * stages + parallel_state.get_pipeline_model_parallel_rank(), stats)
            gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(mine, gathered, dst=0)
            per_row = ops_per_row(gathered) if gathered is not None else None
        report_step(step, clock.seconds(start, end), busy, ops_per_row=per_row)
    return losses


FORWARD_BACKWARD = {"--flexsp": flexsp_forward_backward, "--elastic-pp": elastic_forward_backward}


# ---- Megatron's FLOPs count ------------------------------------------------------------------------
def step_floating_point_operations(count, args) -> float | None:
    """Megatron's ``num_floating_point_operations`` (``count``) in a planned run, or None before
    its first step. Megatron calls it twice: once each iteration, for the FLOPs done so far (the
    last step's count), and at each log for the throughput, which it divides by the mean
    iteration time of the interval (the mean count of the interval's steps: steps differ by 2x
    and more, and the last one alone is not the interval's)."""
    step = STATE.last_step
    if step is None:
        return None
    if step is not STATE.counted_step:
        STATE.counted_step = step
        flops = _planned_step_flops(step, count, args)
        STATE.counted_flops += (flops,)
        return flops
    window, STATE.counted_flops = STATE.counted_flops, ()
    return sum(window) / len(window) if window else 0.0


def _planned_step_flops(step: Step, count, args) -> float:
    """``count(args, batch_size)`` counts ``batch_size`` samples of ``--seq-length`` tokens; a
    planned step trains documents of their own lengths, and attention grows with each document's
    square, so the step's count is ``count`` of one sample at each document's length, summed
    (once per distinct length: a step may hold hundreds of documents)."""
    lengths, repeats = np.unique(step.trained_lengths, return_counts=True)
    one = copy.copy(args)  # count may set fields of its args (num_query_groups); Megatron's stay as they are
    total = 0.0
    for length, n in zip(lengths.tolist(), repeats.tolist()):
        one.seq_length = length
        total += n * count(one, 1)
    return total


# ---- logging -------------------------------------------------------------------------------------
def _degrees(plan) -> dict[int, int]:
    out: dict[int, int] = {}
    for mb in plan.micro_batches:
        for g in mb.groups:
            out[g.degree] = out.get(g.degree, 0) + 1
    return dict(sorted(out.items(), reverse=True))


def _pipelines(plan, lengths) -> list[dict]:
    """Each pipeline of an elastic_pp plan: its layout and replica, chunks, chunks holding a slice
    (a piece that is not its whole sequence) and layers recomputed (summed over chunks and stages)."""
    out = []
    for p in plan.pipelines:
        sliced = sum(any(x.start > 0 or x.end < int(lengths[x.seq_id]) for x in c.pieces) for c in p.chunks)
        out.append({"stages": p.stages, "sp_degree": p.sp_degree, "replica": p.replica, "chunks": len(p.chunks),
                    "sliced_chunks": sliced, "recomputed_layers": sum(sum(c.recompute_layers_per_stage or [])
                                                                      for c in p.chunks)})
    return out


def step_record(step: Step, iteration: int, measured_s: float, rank_parts_s: list[list[float]]) -> dict:
    """One step's record, of the schema ``megatron-ext train`` writes too (``runtime/records.py``),
    with what only a Megatron-LM run knows. ``rank_parts_s``: every rank's time in each micro-batch
    (FlexSP: ``sim.trace.group_spans``) or in its own stage, forward and backward ops without waits,
    zeros elsewhere (elastic pipelines; per stage, the slowest replica's: ``measured_stage_busy_s``)."""
    plan = step.plan
    predicted = float(plan.estimated_step_time_s)
    kept = step.trained_lengths
    piped = plan.kind == "elastic_pp"
    rec = {
        "iteration": iteration,
        **records.step_record(plan, step.lengths, step=step.step, tokens=int(kept.sum()), step_time_s=measured_s,
                              rank_micro_batch_s=None if piped else rank_parts_s, plan_source=step.plan_source),
        "solver_status": plan.solver_status, "solve_time_s": plan.solve_time_s,
        "plan_wait_s": step.plan_wait_s, "sequences": len(kept), "dropped_seq_ids": list(plan.dropped_seq_ids),
        "cost_model_error": (predicted - measured_s) / measured_s if measured_s > 0 else None,
        "digest": step.digest,
    }
    if piped:
        rec.update(pipelines=_pipelines(plan, step.lengths), measured_stage_busy_s=[max(t) for t in zip(*rank_parts_s)])
    else:
        rec.update(groups_by_degree=_degrees(plan))
    return rec


def summary_line(rec: dict) -> str:
    if rec.get("kind") == "elastic_pp":
        pipes = rec["pipelines"]
        replicas = f" over {rec['replicas']} replicas" if rec["replicas"] > 1 else ""
        stages = pipes[0]["stages"]
        layout = (f"pipelines {len(pipes)} x {plural(stages, 'stage')} x SP {pipes[0]['sp_degree']}"
                  f"{replicas} | "
                  f"chunks {rec['micro_batches']} ({sum(p['sliced_chunks'] for p in pipes)} with slices) | "
                  f"recomputed layers {sum(p['recomputed_layers'] for p in pipes)}")
    else:
        layout = (f"micro-batches {rec['micro_batches']} | groups (degree x count) "
                  + " ".join(f"{d}x{n}" for d, n in rec["groups_by_degree"].items()))
    err = rec["cost_model_error"]
    return (f" {rec['mode']} iteration {rec['iteration']:>8} | plan {rec['planner']} ({rec['plan_source']}, "
            f"{rec['solve_time_s'] * 1e3:.0f} ms, waited {rec['plan_wait_s'] * 1e3:.0f} ms) | "
            f"{rec['sequences']} seqs {rec['tokens']} tokens | {layout} | fwd-bwd predicted "
            f"{rec['predicted_step_time_s']:.3f} s measured {rec['step_time_s']:.3f} s"
            + (f" ({err:+.0%})" if err is not None else "") + " |")


def report_step(step: Step, elapsed_s: float, parts_s: list[float], *, args=None, writer="megatron",
                wandb=None, printer=None, ops_per_row=None) -> dict:
    """Gather this step's times from every rank (the step lasts as long as its slowest rank, a
    micro-batch as its slowest group, ``sim.trace.measured_micro_batch_s``, a stage as its slowest
    rank) and log them next to the plan's predictions (see the module doc). ``parts_s``: this
    rank's time per micro-batch (FlexSP), or its busy time in its own stage's slot and zeros
    elsewhere (elastic pipelines). Collective: every rank calls it once per training step (one
    process alone: its times stand for every rank's). ``args``, ``writer`` (a TensorBoard SummaryWriter or None) and
    ``printer`` default to Megatron's (get_args, get_tensorboard_writer, print_rank_last); with
    Megatron's writer comes its W&B writer (``--wandb-project``: the same scalars, on the rank that
    has one), else ``wandb`` (an object with W&B's ``log(dict, step)``, or None). With
    ``--planner-trace`` rank 0 adds the step to the trace (``ops_per_row``: an elastic step's
    measured ops, ``sim.trace.ops_per_row``) and rewrites the file."""
    args = _args() if args is None else args
    t = torch.tensor([elapsed_s] + list(parts_s), dtype=torch.float64, device=rank_device())
    if dist.is_initialized():
        from megatron.core import parallel_state

        # a FlexSP plan's ranks are the data-parallel ranks, in that group's order (tensor-parallel
        # partners run one plan rank); a pipeline plan's rows are the world's (stages x replicas)
        group = None if step.plan.kind == "elastic_pp" else parallel_state.get_data_parallel_group()
        gathered = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, t, group=group)
        ranks = torch.stack(gathered).tolist()
    else:
        ranks = [t.tolist()] * step.plan.num_gpus
    iteration = int(getattr(args, "curr_iteration", step.step)) + 1
    elapsed_s = max(r[0] for r in ranks)
    rank_parts_s = [r[1:] for r in ranks]
    rec = step_record(step, iteration, elapsed_s, rank_parts_s)
    flag = mode_flag(args)  # the run's, not the step's kind: --flexsp-planner auto runs pipeline steps too
    rec["mode"] = flag[2:] if flag else "elastic-pp" if rec["kind"] == "elastic_pp" else "flexsp"
    STATE.last_step = step
    rank = dist.get_rank() if dist.is_initialized() else 0
    interval = max(1, int(getattr(args, "log_interval", 1) or 1))
    if iteration % interval == 0:
        if printer is None:
            from megatron.training.utils import print_rank_last as printer
        printer(summary_line(rec))
    if writer == "megatron":
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

        writer, wandb = get_tensorboard_writer(), get_wandb_writer()
    scalars = {f"{rec['mode']}/{name}": value for name, value in tensorboard_scalars(rec).items()}
    if writer is not None:
        for name, value in scalars.items():
            writer.add_scalar(name, value, iteration)
    if wandb is not None:
        wandb.log(scalars, iteration)
    if STATE.trace is not None:
        from megatron_ext.sim.trace import trace_document, write_trace

        STATE.trace.add_step(iteration, step.plan, step.lengths, elapsed_s, rank_micro_batch_s=rank_parts_s,
                             ops_per_row=ops_per_row)
        write_trace(args.planner_trace, trace_document(STATE.trace.events))
    path = getattr(args, "planner_log", None)
    if path and rank == 0:
        with open(path, "a") as f:
            f.write(json.dumps(dict(rec, plan=step.plan.to_dict())) + "\n")
    return rec


def tensorboard_scalars(rec: dict) -> dict[str, float]:
    """The TensorBoard scalars of one step record (logged under ``flexsp/`` or ``elastic-pp/``;
    an elastic step's micro-batches are its chunks, its SP degree the stages')."""
    if rec.get("kind") == "elastic_pp":
        pipes = rec["pipelines"]
        layout = {"max-sp-degree": max(p["sp_degree"] for p in pipes),
                  "recomputed-layers": sum(p["recomputed_layers"] for p in pipes)}
    else:
        layout = {"max-sp-degree": max(rec["groups_by_degree"], default=0)}
    values = {
        "predicted-fwd-bwd-time": rec["predicted_step_time_s"], "measured-fwd-bwd-time": rec["step_time_s"],
        "cost-model-error": rec["cost_model_error"], "num-microbatches": rec["micro_batches"], **layout,
        "plan-solve-time": rec["solve_time_s"], "plan-wait-time": rec["plan_wait_s"],
        "plan-fallback": float(rec["plan_source"].endswith("fallback")), "tokens": rec["tokens"],
    }
    return {k: float(v) for k, v in values.items() if v is not None}
