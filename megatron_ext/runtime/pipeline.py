"""The elastic pipeline executor: run the ``pipelines`` of an ``elastic_pp`` StepPlan on
megatron-core (``runtime.forward_backward`` dispatches elastic_pp steps here).

The layout is megatron's: ``parallel_state.initialize_model_parallel(1, P)`` on N ranks makes P
stages of ``d = N / P`` ranks each (stage p holds ranks ``[p d, (p + 1) d)``); every stage builds a
GPTModel with its ``L / P`` layers (``build_pipeline_model`` of runtime/pipeline_model.py:
``pre_process`` on the first stage, ``post_process`` on the last) and its data-parallel group is
the Ulysses group of the stage. A plan's pipeline must have ``stages == P`` and ``sp_degree``
dividing d: with ``sp_degree = s < d`` the stage's data-parallel ranks form d / s replicas (aligned
blocks of s ranks, each its own Ulysses group from an ``SPGroupPool``), and each rank runs the
pipelines of its replica (``Pipeline.replica``); megatron's pipeline group links the same
data-parallel rank of every stage, so a replica's stages talk only to each other.

Per pipeline of the plan, on every rank (``forward_backward_elastic``):

1. ``build_schedule`` (plan/program.py, torch-free) turns the pipeline into programs, without any
   communication, identically on every rank: it checks the pipeline (stages, chunk pieces tile
   their sequences, every stage runs each chunk's F and B exactly once, recompute counts), then
   runs the per-stage orders through the list scheduler with the dependencies below. If the orders
   deadlock, it raises ``InvalidPlanError`` on every rank before anything runs. Dependencies: F of
   chunk k on stage p after F of k on stage p-1; B of k on p after F of k on p and after B of k on
   p+1; for two consecutive slices a < b of one sequence, F of b after F of a and B of a after B of
   b (on the same stage: the prefix K/V and its gradient live there).
2. Communication is derived from that schedule as one global sequence of events: every op at its
   scheduled start, and every message (activation of F k from p to p+1, gradient of B k from p to
   p-1) at the end of the op that produces it. Each stage's program is its ops in that order, and
   before each op one ``batch_isend_irecv`` of the messages that fall between its previous op and
   this one (sends and receives, in global order). Every rank issues its messages in the one global
   order, so the programs cannot deadlock even if every send and receive were a blocking
   rendezvous (the earliest unfinished event always has both ends at it); sends are awaited lazily
   (gloo progresses them on its own), receives before the op that needs them. Shapes come from the
   plan: chunk k's activation is ``[S_k / d, 1, hidden]`` with S_k its tokens padded to a multiple
   of d. No shape handshakes; tags name each message.
3. F runs megatron's ``forward_step`` with this chunk's ``UlyssesPackedSeqParams`` (pieces at
   their true positions, a ``PrefixKVCache`` shared by the chunks of the pipeline for split
   sequences, see runtime/slices.py), recomputing the plan's number of layers for (stage, chunk)
   through megatron's own full-layer checkpointing (``recompute_method="block"``: the first n
   layers of the stage, each under ``tensor_parallel.checkpoint``). B runs megatron's
   ``backward_step``. The last stage computes the per-token loss sum and token count.
4. After every pipeline, gradients are reduced as megatron does: ``config.finalize_model_grads_func``
   (DDP's grad all-reduce over the stage's data-parallel group -- its SP group, or every replica's
   -- embedding grads across stages, per-token scaling by the global token count).

Pipelines of one plan run one after another. Loss contract: ``calculate_per_token_loss=True``; any
split or packing of the same batch gives the same loss and gradients as one process.

Use (every rank, under torchrun / gloo or NCCL)::

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=P)
    model, config = build_pipeline_model(model_spec, vocab_size, max_seq_len)   # this rank's stage, in DDP
    optimizer = get_megatron_optimizer(OptimizerConfig(...), [model])
    for step in loader:                          # step.plan: an elastic_pp StepPlan for N = P x d GPUs
        model.zero_grad_buffer(); optimizer.zero_grad()
        losses, stats = forward_backward(step, model, pad_id=pad)   # runtime.forward_backward
        optimizer.step()                         # losses: [{"lm loss": [sum, tokens]}] on the last stage

``plan.program.build_schedules(plan, lengths, P, d, layers_per_stage)`` alone (no torch) checks a
plan and shows each stage's program (``PipelineSchedule.describe(stage)``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from megatron_ext.data.sharding import IGNORE_INDEX, model_labels, next_token_labels
from megatron_ext.errors import InvalidPlanError
from megatron_ext.plan.program import BWD, FWD, ChunkLayout, PipelineSchedule, build_schedules, op_name
from megatron_ext.plan.schema import StepPlan
from megatron_ext.runtime.pipeline_model import unwrap_model
from megatron_ext.runtime.saved import counted
from megatron_ext.sim import simulated_op_times


def chunk_input(layout: ChunkLayout, batch: Sequence, sp_group, cache, pad_id: int = 0, device="cpu",
                read: bool = True):
    """This rank's shard of chunk ``layout`` as a ``runtime.forward.ModelInput`` (batch: int token
    arrays indexed by seq id). Labels follow the data layer's rule (``data.sharding.next_token_labels``:
    token t predicts token t + 1 of its sequence; a sequence's last token and the padding predict
    nothing). ``read=False`` (a middle stage, which takes neither tokens nor labels): padding and
    no labels of the same shape, the batch not read."""
    import torch

    from megatron_ext.runtime.attention import UlyssesPackedSeqParams
    from megatron_ext.runtime.device import host_to_device
    from megatron_ext.runtime.forward import ModelInput

    params = UlyssesPackedSeqParams.build(layout.lengths, sp_group, device=device, starts=layout.starts,
                                          keys=layout.seq_ids, continues=layout.continues, prefix_cache=cache)
    toks, labels = [], []
    for sid, a, n in zip(layout.seq_ids, layout.starts, layout.lengths):
        if not read:
            toks.append(np.full(n, pad_id, dtype=np.int64))
            labels.append(np.full(n, IGNORE_INDEX, dtype=np.int64))
            continue
        seq = np.asarray(batch[sid], dtype=np.int64)
        toks.append(seq[a:a + n])
        labels.append(next_token_labels(seq, a, n))
    tokens = params.shard(torch.from_numpy(np.concatenate(toks)), pad_value=pad_id)
    lab, mask = model_labels(params.shard(torch.from_numpy(np.concatenate(labels)), pad_value=IGNORE_INDEX).numpy())
    return ModelInput(host_to_device(tokens[None], device), params.position_ids[None],
                      host_to_device(torch.from_numpy(lab)[None], device),
                      host_to_device(torch.from_numpy(mask)[None], device), params)


@contextlib.contextmanager
def recompute_layers(model, n: int):
    """Within the block, the stage's TransformerBlock recomputes its first ``n`` layers, each under
    megatron's ``tensor_parallel.checkpoint`` (recompute_granularity="full", method "block"); n = 0:
    none. Restores the config's settings afterwards (the checkpoint keeps its own closure)."""
    block = unwrap_model(model).decoder
    cfg = block.config
    saved = (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers)
    layers = block.num_layers_per_pipeline_rank
    if not 0 <= n <= layers:
        raise InvalidPlanError(f"cannot recompute {n} layers of a stage with {layers}")
    if n:
        cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers = "full", "block", int(n)
    elif cfg.recompute_granularity == "full":  # (selective recompute inside layers is left alone)
        cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers = None, None, None
    try:
        yield
    finally:
        cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers = saved


@dataclass
class PipelineStepStats:
    """Wall time of this rank's ops (seconds), in execution order: ("F3", 0.012), ... (when the rank's
    replica runs more than one pipeline: ("F3 of pipeline 1", ...), as the simulator names them)."""

    ops: list[tuple[str, float]] = field(default_factory=list)
    op_starts_s: list[float] = field(default_factory=list)  # each op's start, from this rank's step start
    replica: int = 0  # the rank's pipeline replica (its stats are row replica x stages + stage of a simulation)
    comm_wait_s: float = 0.0
    prefix_cache_peak_bytes: int = 0
    # Activation memory measured, not modelled: bytes autograd saved for backward by the chunks
    # in flight (each chunk's from its forward to its backward), at their peak, plus the prefix cache.
    activation_peak_bytes: int = 0


class _Stage:
    """This rank's view of the pipeline layout (megatron parallel_state): its stage and, for plans of
    SP degree ``sp`` below the stage's data-parallel size d, its replica (``Pipeline.replica``):
    the aligned block of ``sp`` data-parallel ranks it belongs to (block r: ranks [r sp, (r + 1) sp)).
    Megatron's pipeline group joins the same data-parallel index on every stage, so the stages of
    a replica talk only to each other."""

    def __init__(self, sp: Optional[int] = None, sp_groups=None):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        self.P = ps.get_pipeline_model_parallel_world_size()
        self.p = ps.get_pipeline_model_parallel_rank()
        self.first = ps.is_pipeline_first_stage(ignore_virtual=True)
        self.last = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.next_rank = ps.get_pipeline_model_parallel_next_rank() if not self.last else None
        self.prev_rank = ps.get_pipeline_model_parallel_prev_rank() if not self.first else None
        if ps.get_tensor_model_parallel_world_size() != 1 or ps.get_context_parallel_world_size() != 1:
            raise NotImplementedError("the elastic pipeline runtime runs with tensor and context parallel size 1 "
                                      "(Ulysses SP inside each stage)")
        if ps.get_virtual_pipeline_model_parallel_world_size() not in (None, 1):
            raise NotImplementedError("the elastic pipeline runtime does not support virtual pipeline stages")
        dp = ps.get_data_parallel_group()
        d, dp_rank = dist.get_world_size(dp), dist.get_rank(dp)
        self.sp = d if sp is None else int(sp)
        if self.sp < 1 or d % self.sp:
            raise InvalidPlanError(f"the plan's SP degree {self.sp} does not divide a stage's {d} data-parallel ranks")
        self.replica = dp_rank // self.sp
        if self.sp == d:
            self.sp_group = dp if d > 1 else None
        elif self.sp == 1:  # every rank its own replica: no all-to-all
            self.sp_group = None
        elif sp_groups is None:
            raise InvalidPlanError(f"a plan of SP degree {self.sp} on stages of {d} ranks runs {d // self.sp} "
                                   f"replicas: pass sp_groups (an SPGroupPool over the data-parallel groups)")
        else:
            self.sp_group = sp_groups.get(range(self.replica * self.sp, (self.replica + 1) * self.sp))


def forward_backward_elastic(plan: StepPlan, batch: Sequence, model, *, pad_id: int = 0, forward_only: bool = False,
                             schedules: Optional[list[PipelineSchedule]] = None, device=None,
                             finalize: bool = True, forward_step_func: Optional[Callable] = None,
                             sp_groups=None, lengths: Optional[Sequence[int]] = None, cost=None
                             ) -> tuple[list[dict], PipelineStepStats]:
    """Forward and backward of every chunk of an elastic_pp ``plan`` on this rank's stage (module
    doc). ``batch``: the step's token arrays indexed by seq id; ``model``: this stage's model (a
    megatron DDP-wrapped GPTModel from ``build_pipeline_model``, or a bare one). Returns megatron's
    loss dicts (last stage: one per chunk, ``{"lm loss": [sum, tokens]}``; empty elsewhere) and this
    rank's op timings. ``finalize=False`` skips ``finalize_model_grads`` (e.g. to accumulate several
    plans). ``forward_step_func(data_iterator, model) -> (output, loss_func)``: megatron's contract;
    the iterator yields one ``runtime.forward.ModelInput`` (default: ``runtime.forward.forward_step``).
    ``schedules``: from ``build_schedules`` (e.g. built one step ahead). ``sp_groups``: an
    ``SPGroupPool.from_parallel_state()``, needed when the plan's SP degree is below a stage's
    data-parallel size (replicas side by side; each rank runs its replica's pipelines). ``lengths``:
    each sequence's tokens (default: read off ``batch``; a ``data.loader.BatchTokens`` would read
    every sequence for it). ``cost``: the run's cost model, whose times order the messages as the
    simulator runs the step (``sim.simulated_op_times``; without it, ``default_op_time``'s). Every
    rank must call it with the same plan and cost model."""
    import torch.distributed as dist
    from megatron.core.utils import get_model_config

    from megatron_ext.plan.validate import replica_groups

    config = get_model_config(model)
    if not config.calculate_per_token_loss:
        raise ValueError("the elastic pipeline runtime needs calculate_per_token_loss=True (per-token loss "
                         "normalisation makes every chunking give the same loss)")
    st = _Stage(plan.pipelines[0].sp_degree if plan.pipelines else None, sp_groups)
    lengths = [len(s) for s in batch] if lengths is None else [int(n) for n in lengths]
    if schedules is None:
        layers = unwrap_model(model).decoder.num_layers_per_pipeline_rank
        schedules = build_schedules(plan, lengths, st.P, st.sp, layers, forward_only=forward_only,
                                    op_time_of=simulated_op_times(cost) if cost is not None else None)
    # this rank's replica's pipelines (by their index in the plan); a replica may have none and
    # then only takes part in the gradient reduction
    replicas = replica_groups(plan, dist.get_world_size())
    if not forward_only and not all(replicas) and getattr(getattr(model, "ddp_config", None),
                                                          "overlap_grad_reduce", False):
        # (megatron's overlapped reduce starts a bucket when its grads are ready: an idle rank has none)
        idle = [r for r, g in enumerate(replicas) if not g]
        raise InvalidPlanError(f"replica{'s' if len(idle) > 1 else ''} {', '.join(map(str, idle))} of the plan "
                               f"run{'' if len(idle) > 1 else 's'} no pipeline: not supported with DDP's "
                               f"overlap_grad_reduce")
    run = _ElasticStep(model, config, st, [(i, schedules[i]) for i in replicas[st.replica]], batch, pad_id,
                       forward_only, device, forward_step_func)
    try:
        for pi, sched in run.schedules:
            run.pipeline(pi, sched)
    finally:
        run.end_no_sync()
    run.time_ops()
    if finalize and not forward_only and config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func([model], run.total_tokens if config.calculate_per_token_loss else None)
    return run.store, run.stats


class _ElasticStep:
    """One ``forward_backward_elastic`` call on this rank: its pipelines run one after another
    (``pipeline``), each step of a stage's program a batch of messages (``_exchange``) then its
    op (``_forward`` / ``_backward``); megatron's outputs, the token count and the op timings."""

    def __init__(self, model, config, st: _Stage, schedules: list[tuple[int, PipelineSchedule]], batch: Sequence,
                 pad_id: int, forward_only: bool, device, step_func: Optional[Callable]):
        import torch
        from megatron.core.pipeline_parallel import schedules as megatron_schedules
        from megatron.core.utils import get_model_type

        from megatron_ext.runtime.device import rank_device
        from megatron_ext.runtime.forward import forward_step as chunk_forward_step
        from megatron_ext.runtime.timing import DeviceClock

        self.model, self.config, self.st, self.schedules = model, config, st, schedules
        self.megatron = megatron_schedules  # (megatron's forward_step, backward_step and output deallocation, per op)
        self.batch, self.pad_id, self.forward_only = batch, pad_id, forward_only
        self.step_func = step_func or chunk_forward_step
        self.several = len(schedules) > 1  # the simulator names ops by pipeline only then
        self.dtype = config.pipeline_dtype or config.params_dtype
        self.model_type = get_model_type(model)
        self.n_chunks = sum(len(s.chunks) for _, s in schedules)
        self.stats = PipelineStepStats(replica=st.replica)
        self.device = rank_device() if device is None else device
        self.clock = DeviceClock(self.device)
        self.began = self.clock.mark()
        self.op_marks: list[tuple[str, object, object]] = []  # (op name, start, end): read once, after the step
        self.wait_marks: list[tuple[object, object]] = []
        self.store: list = []
        self.total_tokens = torch.zeros((), dtype=torch.int, device=self.device)
        self.sync_ctx = None  # megatron's no_sync, left at this rank's last backward (the grads reduce then)
        self.last_b = None  # (pipeline index, step index) of this rank's last backward
        if not forward_only:
            self.sync_ctx = (config.no_sync_func or contextlib.nullcontext)()
            self.sync_ctx.__enter__()
            for i, sched in schedules:
                for j, ps in enumerate(sched.program(st.p)):
                    if ps.op and ps.op[0] == BWD:
                        self.last_b = (i, j)
        self.tag_base = 0  # the pipelines' messages are tagged one after another
        self.first_forward = True
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live_bytes: dict[int, int] = {}  # chunk -> bytes saved for its backward, while in flight

    def end_no_sync(self) -> None:
        if self.sync_ctx is not None:
            self.sync_ctx.__exit__(None, None, None)
            self.sync_ctx = None

    def pipeline(self, pi: int, sched: PipelineSchedule) -> None:
        """Pipeline ``pi``'s program on this rank's stage, to its end: every message sent and received."""
        from megatron_ext.runtime.slices import PrefixKVCache

        st, clock = self.st, self.clock
        cache = PrefixKVCache()
        saved: dict[int, tuple] = {}  # chunk -> (input tensor, output tensor)
        msgs = _Messages(self.config, saved, self.megatron.deallocate_output_tensor)
        for j, step in enumerate(sched.program(st.p)):
            self._exchange(step, sched, msgs)
            if step.op is None:
                break
            kind, c = step.op
            label = op_name(kind, c) + (f" of pipeline {pi}" if self.several else "")
            t1, nvtx = clock.mark(), clock.range_start(label)  # Nsight: the op over its kernels
            if kind == FWD:
                self._forward(sched, c, cache, msgs, saved)
            else:
                self._backward((pi, j), c, msgs, saved)
            self.op_marks.append((label, t1, clock.mark()))
            clock.range_end(nvtx)
        for work, _, _ in msgs.sends:
            work.wait()
        if msgs.outgoing or msgs.received:
            raise RuntimeError(f"pipeline {pi}: messages left over on stage {st.p}: "
                               f"{sorted(msgs.outgoing)} to send, {sorted(msgs.received)} received")
        if not self.forward_only and len(cache):
            raise RuntimeError(f"pipeline {pi}: prefix K/V of {cache.keys()} still cached after the backward")
        cache.clear()
        self.tag_base += len(sched.messages)

    def _exchange(self, step, sched: PipelineSchedule, msgs: _Messages) -> None:
        """The step's messages, posted in the global order as one ``batch_isend_irecv``; receives
        waited for, finished sends retired."""
        import torch
        import torch.distributed as dist

        st, hidden, d = self.st, self.config.hidden_size, sched.sp_degree
        t0, nvtx = self.clock.mark(), self.clock.range_start("p2p") if step.comm else None
        posts = []  # (role, key, tensor, P2POp), in the global message order
        for m, role in step.comm:
            key = (m.kind, m.chunk)
            if role == "send":
                t = msgs.outgoing.pop(key)
                peer = st.next_rank if m.kind == "act" else st.prev_rank
                posts.append((role, key, t, dist.P2POp(dist.isend, t, peer, group=st.pp_group,
                                                       tag=self.tag_base + m.index)))
            else:
                t = torch.empty((sched.chunks[m.chunk].padded(d) // d, 1, hidden), dtype=self.dtype,
                                device=self.device)
                peer = st.prev_rank if m.kind == "act" else st.next_rank
                posts.append((role, key, t, dist.P2POp(dist.irecv, t, peer, group=st.pp_group,
                                                       tag=self.tag_base + m.index)))
        if posts:
            works = dist.batch_isend_irecv([x[3] for x in posts])
            if len(works) != len(posts):  # a coalesced batch (NCCL): one handle for all
                for w in works:
                    w.wait()
                works = [None] * len(posts)
            for (role, key, t, _), w in zip(posts, works):
                if role == "send":
                    if w is not None:
                        msgs.sends.append((w, t, key))
                    else:  # (waited for with its batch: stream-ordered, so freed now)
                        msgs.sent(t, key)
                else:
                    if w is not None:
                        w.wait()
                    msgs.received[key] = t
        msgs.reap()
        self.wait_marks.append((t0, self.clock.mark()))
        self.clock.range_end(nvtx)

    def _forward(self, sched: PipelineSchedule, c: int, cache, msgs: _Messages, saved: dict) -> None:
        """Chunk ``c``'s forward through megatron's ``forward_step``, its plan's layers recomputed;
        what autograd saves for its backward counted."""
        import torch
        st, forward_only = self.st, self.forward_only
        layout = sched.chunks[c]
        inp = chunk_input(layout, self.batch, st.sp_group, cache, self.pad_id, self.device,
                          read=st.first or st.last)  # (the embedding, the loss)
        x = msgs.received.pop(("act", c), None)
        if x is not None and not forward_only:
            x.requires_grad_(True)
        n_rec = layout.recompute[st.p] if layout.recompute and not forward_only else 0
        grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        chunk_saved: dict[int, int] = {}

        def count_saved(t):
            if t.untyped_storage().data_ptr() not in self.param_ptrs:
                chunk_saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())

        with grad_ctx, recompute_layers(self.model, n_rec), counted(count_saved):
            out, num_tokens = self.megatron.forward_step(self.step_func, iter([inp]), self.model, self.n_chunks, x,
                                                         self.store, self.config, 1,
                                                         is_first_microbatch=self.first_forward, is_last_stage=st.last)
        self.live_bytes[c] = sum(chunk_saved.values())
        self.stats.activation_peak_bytes = max(self.stats.activation_peak_bytes,
                                               sum(self.live_bytes.values()) + cache.nbytes())
        self.first_forward = False
        self.total_tokens += num_tokens
        if not st.last:
            msgs.outgoing[("act", c)] = out
        if not forward_only:
            saved[c] = (x, out)
        self.stats.prefix_cache_peak_bytes = max(self.stats.prefix_cache_peak_bytes, cache.nbytes())

    def _backward(self, at: tuple[int, int], c: int, msgs: _Messages, saved: dict) -> None:
        """Chunk ``c``'s backward through megatron's ``backward_step`` (``at``: its pipeline and
        program step; at this rank's last backward, the gradients' reduction is let through)."""
        msgs.reap(force_key=("act", c))
        self.live_bytes.pop(c, None)
        x, out = saved.pop(c)
        g = msgs.received.pop(("grad", c), None)
        if self.last_b == at:
            self.end_no_sync()
        gx = self.megatron.backward_step(x, out, g, self.model_type, self.config)
        if not self.st.first:
            msgs.outgoing[("grad", c)] = gx

    def time_ops(self) -> None:
        """The op timings, read off the clock once the step is done."""
        clock, stats = self.clock, self.stats
        stats.ops = [(name, clock.seconds(a, b)) for name, a, b in self.op_marks]
        stats.op_starts_s = [clock.seconds(self.began, a) for _, a, _ in self.op_marks]
        stats.comm_wait_s = sum(clock.seconds(a, b) for a, b in self.wait_marks)


class _Messages:
    """One pipeline's messages on this rank: tensors to send (by kind and chunk), those received,
    and the sends in flight (awaited lazily: gloo progresses them on its own)."""

    def __init__(self, config, saved: dict, deallocate: Callable):
        self.config, self.saved, self.deallocate = config, saved, deallocate  # (megatron's deallocate_output_tensor)
        self.outgoing: dict[tuple[str, int], object] = {}  # (kind, chunk) -> tensor to send
        self.received: dict[tuple[str, int], object] = {}
        self.sends: list[tuple[object, object, tuple]] = []  # (work, tensor, (kind, chunk))

    def sent(self, t, key) -> None:
        """A send is done: free the sent activation's data when megatron's
        deallocate_pipeline_outputs is on (its backward then expects it freed)."""
        if key[0] == "act" and self.config.deallocate_pipeline_outputs and key[1] in self.saved:
            self.deallocate(t, True)

    def reap(self, force_key=None) -> None:
        """Retire completed sends (and the send of ``force_key``, waiting for it)."""
        keep = []
        for work, t, key in self.sends:
            if key == force_key or work.is_completed():
                work.wait()
                self.sent(t, key)
            else:
                keep.append((work, t, key))
        self.sends[:] = keep


__all__ = ["PipelineStepStats", "chunk_input", "forward_backward_elastic", "recompute_layers"]
