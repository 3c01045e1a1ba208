"""Elastic pipelines on megatron-core: run the ``pipelines`` of an ``elastic_pp`` StepPlan.

The layout is megatron's: ``parallel_state.initialize_model_parallel(1, P)`` on N ranks makes P
stages of ``d = N / P`` ranks each (stage p holds ranks ``[p d, (p + 1) d)``); every stage builds a
GPTModel with its ``L / P`` layers (``build_pipeline_model``: ``pre_process`` on the first stage,
``post_process`` on the last) and its data-parallel group is the Ulysses group of the stage. A
plan's pipeline must have ``stages == P`` and ``sp_degree`` dividing d: with ``sp_degree = s < d``
the stage's data-parallel ranks form d / s replicas (aligned blocks of s ranks, each its own
Ulysses group from an ``SPGroupPool``), and each rank runs the pipelines of its replica
(``Pipeline.replica``); megatron's pipeline group links the same data-parallel rank of every
stage, so a replica's stages talk only to each other.

Per pipeline of the plan, on every rank (``forward_backward_elastic``):

1. ``build_schedule`` turns the pipeline into programs, without any communication, identically on
   every rank: it checks the pipeline (stages, chunk pieces tile their sequences, every stage runs
   each chunk's F and B exactly once, recompute counts), then runs the per-stage orders through a
   list scheduler with the dependencies below. If the orders deadlock, it raises
   ``InvalidPlanError`` on every rank before anything runs. Dependencies: F of chunk k on stage p
   after F of k on stage p-1; B of k on p after F of k on p and after B of k on p+1; for two
   consecutive slices a < b of one sequence, F of b after F of a and B of a after B of b (on the
   same stage: the prefix K/V and its gradient live there).
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
        losses, stats = forward_backward_elastic(step.plan, step.batch, model, pad_id=pad)
        optimizer.step()                         # losses: [{"lm loss": [sum, tokens]}] on the last stage

``build_schedules(plan, lengths, P, d, layers_per_stage)`` alone (no torch.distributed) checks a
plan and shows each stage's program (``PipelineSchedule.describe(stage)``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional, Sequence

import numpy as np

from megatron_ext.errors import InvalidPlanError
from megatron_ext.plan.schema import Pipeline, StepPlan

FWD, BWD = "F", "B"
IGNORE_INDEX = -100


# ---- the schedule, as data (pure Python: no torch) --------------------------------------------

@dataclass(frozen=True)
class ChunkLayout:
    """One chunk's packed buffer: its pieces in packing order."""

    id: int
    seq_ids: tuple[int, ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    continues: tuple[bool, ...]  # later pieces of the sequence follow in other chunks
    recompute: tuple[int, ...]  # layers to recompute on each stage

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def padded(self, degree: int) -> int:
        """Buffer length: tokens padded to a multiple of the SP degree (UlyssesPackedSeqParams' rule)."""
        return -(-self.tokens // degree) * degree

    @property
    def sliced(self) -> bool:
        return any(self.starts) or any(self.continues)


@dataclass(frozen=True)
class Message:
    """One p2p transfer: the activation of F ``chunk`` from ``src`` to ``src + 1``, or the gradient of
    B ``chunk`` from ``src`` to ``src - 1``. ``index``: position in the pipeline's global order."""

    index: int
    kind: str  # "act" | "grad"
    chunk: int
    src: int
    dst: int


@dataclass(frozen=True)
class Step:
    """Post ``comm`` (one batch), wait for its receives, then run ``op`` (None: the final batch)."""

    comm: tuple[tuple[Message, str], ...]  # (message, "send" | "recv"), in global order
    op: Optional[tuple[str, int]]  # (FWD | BWD, chunk id)


@dataclass
class PipelineSchedule:
    """What every stage of one pipeline does, derived from the plan alone."""

    stages: int
    sp_degree: int
    chunks: dict[int, ChunkLayout]
    events: list[tuple]  # the global sequence: ("op", stage, kind, chunk) | ("msg", Message)
    messages: list[Message]
    programs: list[list[Step]]  # per stage
    times: dict = field(default_factory=dict)  # (kind, stage, chunk) -> (start, end) in schedule units

    def program(self, stage: int) -> list[Step]:
        return self.programs[stage]

    def describe(self, stage: int) -> str:
        """One line per step: ``[send act3->1, recv grad2<-1] F4``."""
        out = []
        for st in self.programs[stage]:
            comm = ", ".join(f"{role} {m.kind}{m.chunk}{'->' if role == 'send' else '<-'}"
                             f"{m.dst if role == 'send' else m.src}" for m, role in st.comm)
            op = f"{st.op[0]}{st.op[1]}" if st.op else "(end)"
            out.append(f"[{comm}] {op}" if comm else op)
        return "\n".join(out)


def default_op_time(chunk: ChunkLayout, kind: str, stage: int, layers_per_stage: Optional[int] = None) -> float:
    """Relative op durations used to place messages in the global order (never for correctness):
    tokens plus causal attention pairs / 1024 (prefix included); a backward costs twice a forward
    plus its recomputed share of the forward."""
    work = sum(n + n * (2 * a + n) / 2048.0 for a, n in zip(chunk.starts, chunk.lengths)) + 1.0
    if kind == FWD:
        return work
    rec = chunk.recompute[stage] if chunk.recompute else 0
    return 2.0 * work + work * rec / max(1, layers_per_stage or max(chunk.recompute or [1]))


def _parse_op(name, stage: int, ids: set, where: str) -> tuple[str, int]:
    if not isinstance(name, str) or len(name) < 2 or name[0] not in "FB" or not name[1:].isdigit():
        raise InvalidPlanError(f"{where}, stage {stage}: operation {name!r} is not 'F<chunk id>' or 'B<chunk id>'")
    cid = int(name[1:])
    if cid not in ids:
        raise InvalidPlanError(f"{where}, stage {stage}: operation {name} names no chunk of the pipeline")
    return name[0], cid


def chunk_layouts(pipeline: Pipeline, lengths: Sequence[int], layers_per_stage: Optional[int] = None,
                  where: str = "pipeline") -> dict[int, ChunkLayout]:
    """Check the chunks of a pipeline against the batch's lengths and lay them out."""
    P = pipeline.stages
    by_seq: dict[int, list[tuple[int, int, int]]] = {}
    out: dict[int, ChunkLayout] = {}
    for c in pipeline.chunks:
        if not isinstance(c.id, (int, np.integer)) or int(c.id) in out or c.id < 0:
            raise InvalidPlanError(f"{where}: chunk id {c.id!r} is not a unique non-negative integer")
        if not c.pieces:
            raise InvalidPlanError(f"{where}, chunk {c.id}: has no pieces")
        seen = set()
        for x in c.pieces:
            sid, a, b = int(x.seq_id), int(x.start), int(x.end)
            if not 0 <= sid < len(lengths) or not 0 <= a < b <= int(lengths[sid]):
                raise InvalidPlanError(f"{where}, chunk {c.id}: piece {sid}[{a}:{b}] is outside its sequence")
            if sid in seen:
                raise InvalidPlanError(f"{where}, chunk {c.id}: holds two pieces of sequence {sid}")
            seen.add(sid)
            by_seq.setdefault(sid, []).append((a, b, int(c.id)))
        r = list(c.recompute_layers_per_stage or [])
        if r and (len(r) != P or any(int(v) < 0 or (layers_per_stage is not None and int(v) > layers_per_stage)
                                     for v in r)):
            raise InvalidPlanError(f"{where}, chunk {c.id}: recompute_layers_per_stage must be {P} integers in "
                                   f"0..{layers_per_stage}, got {r!r:.60}")
        out[int(c.id)] = ChunkLayout(int(c.id), tuple(int(x.seq_id) for x in c.pieces),
                                     tuple(int(x.start) for x in c.pieces),
                                     tuple(int(x.end - x.start) for x in c.pieces), (), tuple(int(v) for v in r))
    for sid, ps in by_seq.items():
        ps.sort()
        pos = 0
        for a, b, _ in ps:
            if a != pos:
                raise InvalidPlanError(f"{where}: the pieces of sequence {sid} do not tile it (gap or overlap at {pos})")
            pos = b
        if pos != int(lengths[sid]):
            raise InvalidPlanError(f"{where}: the pieces of sequence {sid} end at {pos}, it has {int(lengths[sid])} tokens")
    last_end = {sid: ps[-1][1] for sid, ps in by_seq.items()}
    for cid, ch in list(out.items()):
        cont = tuple(a + n < last_end[s] for s, a, n in zip(ch.seq_ids, ch.starts, ch.lengths))
        out[cid] = ChunkLayout(ch.id, ch.seq_ids, ch.starts, ch.lengths, cont, ch.recompute)
    return out


def build_schedule(pipeline: Pipeline, lengths: Sequence[int], *, stages: Optional[int] = None,
                   sp_degree: Optional[int] = None, layers_per_stage: Optional[int] = None,
                   op_time: Callable[[ChunkLayout, str, int], float] = default_op_time,
                   forward_only: bool = False, where: str = "pipeline") -> PipelineSchedule:
    """Validate one pipeline of a plan and derive every stage's program (module doc, steps 1-2).
    ``stages`` / ``sp_degree`` / ``layers_per_stage``: the runtime's layout, checked against the
    plan. ``forward_only``: the programs of the plan's forwards alone (same order, no gradients).
    Raises InvalidPlanError (the same on every rank) for a malformed or deadlocking plan (the full
    order is checked even when only the forwards will run)."""
    P = pipeline.stages
    if not isinstance(P, (int, np.integer)) or P < 1:
        raise InvalidPlanError(f"{where}: stages must be a positive integer, got {P!r}")
    if stages is not None and P != stages:
        raise InvalidPlanError(f"{where}: the plan has {P} stages, the runtime runs {stages}")
    if sp_degree is not None and pipeline.sp_degree != sp_degree:
        raise InvalidPlanError(f"{where}: the plan's SP degree is {pipeline.sp_degree}, the runtime's is {sp_degree} "
                               f"(every pipeline of a plan runs at one degree)")
    if not pipeline.chunks:
        raise InvalidPlanError(f"{where}: has no chunks")
    chunks = chunk_layouts(pipeline, lengths, layers_per_stage, where)
    ids = set(chunks)
    if len(pipeline.order_per_stage) != P:
        raise InvalidPlanError(f"{where}: order_per_stage has {len(pipeline.order_per_stage)} lists for {P} stages")
    orders = []
    for p, names in enumerate(pipeline.order_per_stage):
        ops = [_parse_op(n, p, ids, where) for n in names]
        for kind in (FWD, BWD):
            counts = {}
            for k, c in ops:
                if k == kind:
                    counts[c] = counts.get(c, 0) + 1
            bad = sorted(c for c in ids if counts.get(c, 0) != 1)
            if bad:
                raise InvalidPlanError(f"{where}, stage {p}: {kind}{bad[0]} appears {counts.get(bad[0], 0)} times (each "
                                       f"chunk's forward and backward run once per stage)")
        orders.append(ops)

    # slice dependencies: consecutive pieces of one sequence
    fwd_pred: dict[int, list[int]] = {c: [] for c in ids}
    bwd_pred: dict[int, list[int]] = {c: [] for c in ids}
    pieces: dict[int, list[tuple[int, int]]] = {}
    for cid, ch in chunks.items():
        for s, a in zip(ch.seq_ids, ch.starts):
            pieces.setdefault(s, []).append((a, cid))
    for ps in pieces.values():
        ps.sort()
        for (_, prev), (_, nxt) in zip(ps, ps[1:]):
            fwd_pred[nxt].append(prev)
            bwd_pred[prev].append(nxt)

    def deps(p, kind, c):
        if kind == FWD:
            return ([(FWD, p - 1, c)] if p > 0 else []) + [(FWD, p, j) for j in fwd_pred[c]]
        return [(FWD, p, c)] + ([(BWD, p + 1, c)] if p < P - 1 else []) + [(BWD, p, j) for j in bwd_pred[c]]

    if op_time is default_op_time:
        op_time = partial(default_op_time, layers_per_stage=layers_per_stage)
    if forward_only:
        _list_schedule(orders, deps, P, chunks, op_time, where)  # refuse what the full order would
        orders = [[op for op in o if op[0] == FWD] for o in orders]
    raw, times = _list_schedule(orders, deps, P, chunks, op_time, where)
    raw.sort()  # by time; at equal times messages before ops, then by creation
    events: list[tuple] = []
    messages: list[Message] = []
    pending: list[list[tuple[Message, str]]] = [[] for _ in range(P)]
    programs: list[list[Step]] = [[] for _ in range(P)]
    for _, _, _, ev in raw:
        if ev[0] == "msg":
            m = Message(len(messages), ev[1], ev[2], ev[3], ev[4])
            messages.append(m)
            events.append(("msg", m))
            pending[m.src].append((m, "send"))
            pending[m.dst].append((m, "recv"))
        else:
            _, p, kind, c = ev
            events.append(ev)
            programs[p].append(Step(tuple(pending[p]), (kind, c)))
            pending[p] = []
    for p in range(P):
        programs[p].append(Step(tuple(pending[p]), None))
    return PipelineSchedule(P, int(pipeline.sp_degree), chunks, events, messages, programs, times)


def _list_schedule(orders, deps, P, chunks, op_time, where):
    """Timed list scheduling of the per-stage orders: repeatedly start, over all stages, the next
    op that can start earliest. Returns the events (op starts, message sends at the producing op's
    end) as sortable tuples and each op's (start, end); raises InvalidPlanError on a deadlock."""
    end: dict[tuple, float] = {}
    times: dict[tuple, tuple[float, float]] = {}
    ptr = [0] * P
    free = [0.0] * P
    raw: list[tuple] = []  # (time, order class, seq, event)
    seq = 0
    remaining = sum(len(o) for o in orders)
    while remaining:
        best = None
        for p in range(P):
            if ptr[p] == len(orders[p]):
                continue
            kind, c = orders[p][ptr[p]]
            ds = deps(p, kind, c)
            if all(d in end for d in ds):
                start = max([free[p]] + [end[d] for d in ds])
                if best is None or start < best[0]:
                    best = (start, p, kind, c)
        if best is None:
            raise InvalidPlanError(_deadlock_message(orders, ptr, end, deps, where))
        start, p, kind, c = best
        dur = float(op_time(chunks[c], kind, p))
        if not dur > 0:
            raise ValueError(f"op_time must be positive, got {dur} for {kind}{c} on stage {p}")
        finish = start + dur
        end[(kind, p, c)] = finish
        times[(kind, p, c)] = (start, finish)
        free[p] = finish
        ptr[p] += 1
        remaining -= 1
        raw.append((start, 1, seq, ("op", p, kind, c)))
        seq += 1
        if kind == FWD and p < P - 1:
            raw.append((finish, 0, seq, ("msg", "act", c, p, p + 1)))
            seq += 1
        elif kind == BWD and p > 0:
            raw.append((finish, 0, seq, ("msg", "grad", c, p, p - 1)))
            seq += 1
    return raw, times


def _deadlock_message(orders, ptr, end, deps, where) -> str:
    for p, ops in enumerate(orders):
        if ptr[p] == len(ops):
            continue
        kind, c = ops[ptr[p]]
        waits = [f"{k}{j} on stage {q}" for k, q, j in deps(p, kind, c) if (k, q, j) not in end]
        return (f"{where}: the operation order deadlocks: stage {p} cannot run {kind}{c} (operation {ptr[p]} of its "
                f"order): it waits for {', '.join(waits)}, which cannot run first")
    return f"{where}: the operation order deadlocks"  # pragma: no cover


def check_rendezvous(schedule: PipelineSchedule) -> None:
    """Execute the programs abstractly with every message a blocking rendezvous posted in batches
    (a batch completes when each of its messages has both ends posted) and raise InvalidPlanError
    if some stage would wait forever. ``build_schedule``'s construction guarantees it never does;
    this is the check the tests run on many plans."""
    P = schedule.stages
    step = [0] * P  # index of the next step of each stage
    posted: list[set] = [set() for _ in range(P)]  # message indices each stage has posted
    waiting = [False] * P  # stage has posted its current batch and waits for it
    done = [False] * P
    while not all(done):
        progressed = False
        for p in range(P):
            if done[p]:
                continue
            st = schedule.programs[p][step[p]]
            if not waiting[p]:
                posted[p].update(m.index for m, _ in st.comm)
                waiting[p] = True
                progressed = True
            peer_ok = all(m.index in posted[m.dst if role == "send" else m.src] for m, role in st.comm)
            if peer_ok:
                waiting[p] = False
                step[p] += 1
                done[p] = step[p] == len(schedule.programs[p])
                progressed = True
        if not progressed:
            stuck = [p for p in range(P) if not done[p]]
            raise InvalidPlanError(f"the communication programs deadlock under rendezvous semantics at stages {stuck}")


# ---- the runtime -------------------------------------------------------------------------------

@dataclass
class ChunkInput:
    """What one rank feeds its stage for one chunk (tensors are this rank's shard, [1, S/d])."""

    tokens: object
    position_ids: object
    labels: object
    loss_mask: object
    packed_seq_params: object


def chunk_input(layout: ChunkLayout, batch: Sequence, sp_group, cache, pad_id: int = 0, device="cpu") -> ChunkInput:
    """This rank's shard of chunk ``layout`` (batch: int token arrays indexed by seq id). Labels
    follow the data layer's rule: token t predicts token t + 1 of its sequence; a sequence's last
    token and the padding predict nothing."""
    import torch

    from megatron_ext.runtime.attention import UlyssesPackedSeqParams

    params = UlyssesPackedSeqParams.build(layout.lengths, sp_group, device=device, starts=layout.starts,
                                          keys=layout.seq_ids, continues=layout.continues, prefix_cache=cache)
    toks, labels = [], []
    for sid, a, n in zip(layout.seq_ids, layout.starts, layout.lengths):
        seq = np.asarray(batch[sid], dtype=np.int64)
        toks.append(seq[a:a + n])
        lab = np.full(n, IGNORE_INDEX, dtype=np.int64)
        nxt = seq[a + 1:a + n + 1]
        lab[:nxt.size] = nxt
        labels.append(lab)
    tokens = params.shard(torch.from_numpy(np.concatenate(toks)), pad_value=pad_id)
    lab = params.shard(torch.from_numpy(np.concatenate(labels)), pad_value=IGNORE_INDEX)
    mask = (lab != IGNORE_INDEX).float()
    lab = torch.where(lab == IGNORE_INDEX, torch.zeros_like(lab), lab)
    return ChunkInput(tokens[None].to(device), params.position_ids[None], lab[None].to(device), mask[None].to(device),
                      params)


def chunk_forward_step(data_iterator, model):
    """The default ``forward_step_func`` of ``forward_backward_elastic``: the stage's GPTModel on
    one ``ChunkInput``, the per-token loss on the last stage."""
    from megatron_ext.runtime.schedule import per_token_loss

    inp: ChunkInput = next(data_iterator)
    out = model(inp.tokens, inp.position_ids, None, labels=inp.labels, packed_seq_params=inp.packed_seq_params)
    return out, partial(per_token_loss, inp.loss_mask)


def _unwrap(model):
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


@contextlib.contextmanager
def recompute_layers(model, n: int):
    """Within the block, the stage's TransformerBlock recomputes its first ``n`` layers, each under
    megatron's ``tensor_parallel.checkpoint`` (recompute_granularity="full", method "block"); n = 0:
    none. Restores the config's settings afterwards (the checkpoint keeps its own closure)."""
    block = _unwrap(model).decoder
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


def build_schedules(plan: StepPlan, lengths: Sequence[int], stages: int, sp_degree: int,
                    layers_per_stage: Optional[int] = None, op_time=default_op_time,
                    forward_only: bool = False) -> list[PipelineSchedule]:
    """``build_schedule`` for every pipeline of an elastic_pp plan, every replica's (a sequence in
    two pipelines is refused too)."""
    if plan.kind != "elastic_pp":
        raise InvalidPlanError(f"the pipeline runtime runs elastic_pp plans, not {plan.kind!r} plans")
    if not plan.pipelines:
        raise InvalidPlanError("an elastic_pp plan needs at least one pipeline")
    owner: dict[int, int] = {}
    out = []
    for i, pipe in enumerate(plan.pipelines):
        s = build_schedule(pipe, lengths, stages=stages, sp_degree=sp_degree, layers_per_stage=layers_per_stage,
                           op_time=op_time, forward_only=forward_only, where=f"pipeline {i}")
        for ch in s.chunks.values():
            for sid in ch.seq_ids:
                if owner.setdefault(sid, i) != i:
                    raise InvalidPlanError(f"sequence {sid} has pieces in pipelines {owner[sid]} and {i}")
        out.append(s)
    return out


def forward_backward_elastic(plan: StepPlan, batch: Sequence, model, *, pad_id: int = 0, forward_only: bool = False,
                             schedules: Optional[list[PipelineSchedule]] = None, device=None,
                             finalize: bool = True, forward_step_func: Optional[Callable] = None,
                             sp_groups=None) -> tuple[list[dict], PipelineStepStats]:
    """Forward and backward of every chunk of an elastic_pp ``plan`` on this rank's stage (module
    doc). ``batch``: the step's token arrays indexed by seq id; ``model``: this stage's model (a
    megatron DDP-wrapped GPTModel from ``build_pipeline_model``, or a bare one). Returns megatron's
    loss dicts (last stage: one per chunk, ``{"lm loss": [sum, tokens]}``; empty elsewhere) and this
    rank's op timings. ``finalize=False`` skips ``finalize_model_grads`` (e.g. to accumulate several
    plans). ``forward_step_func(data_iterator, model) -> (output, loss_func)``: megatron's contract;
    the iterator yields one ``ChunkInput`` (default: GPTModel with labels and ``per_token_loss``).
    ``schedules``: from ``build_schedules`` (e.g. built one step ahead). ``sp_groups``: an
    ``SPGroupPool.from_parallel_state()``, needed when the plan's SP degree is below a stage's
    data-parallel size (replicas side by side; each rank runs its replica's pipelines). Every rank
    must call it with the same plan."""
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel.schedules import backward_step, deallocate_output_tensor, forward_step
    from megatron.core.utils import get_model_config, get_model_type

    from megatron_ext.plan.pipelines import replica_groups
    from megatron_ext.runtime.device import rank_device
    from megatron_ext.runtime.slices import PrefixKVCache
    from megatron_ext.runtime.timing import DeviceClock

    config = get_model_config(model)
    if not config.calculate_per_token_loss:
        raise ValueError("the elastic pipeline runtime needs calculate_per_token_loss=True (per-token loss "
                         "normalisation makes every chunking give the same loss)")
    st = _Stage(plan.pipelines[0].sp_degree if plan.pipelines else None, sp_groups)
    lengths = [len(s) for s in batch]
    block = _unwrap(model).decoder
    if schedules is None:
        schedules = build_schedules(plan, lengths, st.P, st.sp, block.num_layers_per_pipeline_rank,
                                    forward_only=forward_only)
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
    schedules = [(i, schedules[i]) for i in replicas[st.replica]]
    several = len(schedules) > 1  # the simulator names ops by pipeline only then
    step_func = forward_step_func or chunk_forward_step
    dtype = config.pipeline_dtype or config.params_dtype
    hidden = config.hidden_size
    model_type = get_model_type(model)
    n_chunks = sum(len(s.chunks) for _, s in schedules)
    stats = PipelineStepStats(replica=st.replica)
    device = rank_device() if device is None else device
    clock = DeviceClock(device)
    began = clock.mark()
    op_marks: list[tuple[str, object, object]] = []  # (op name, start, end): read once, after the step
    wait_marks: list[tuple[object, object]] = []
    store: list = []
    total_tokens = torch.zeros((), dtype=torch.int, device=device)

    no_sync = config.no_sync_func or contextlib.nullcontext
    sync_ctx = None
    if not forward_only:
        sync_ctx = no_sync()
        sync_ctx.__enter__()
    last_b = None  # (pipeline index, step index) of this rank's last backward
    if not forward_only:
        for i, s in schedules:
            for j, step in enumerate(s.program(st.p)):
                if step.op and step.op[0] == BWD:
                    last_b = (i, j)

    tag_base = 0
    first_forward = True
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    live_bytes: dict[int, int] = {}  # chunk -> bytes saved for its backward, while in flight
    try:
        for pi, sched in schedules:
            cache = PrefixKVCache()
            saved: dict[int, tuple] = {}  # chunk -> (input tensor, output tensor)
            outgoing: dict[tuple[str, int], object] = {}  # (kind, chunk) -> tensor to send
            received: dict[tuple[str, int], object] = {}
            sends: list[tuple[object, object, tuple]] = []  # (work, tensor, (kind, chunk))
            d = sched.sp_degree

            def shape(c):
                return (sched.chunks[c].padded(d) // d, 1, hidden)

            def reap(force_key=None):
                """Retire completed sends (and the send of ``force_key``, waiting for it); free the
                sent activations' data when megatron's deallocate_pipeline_outputs is on."""
                keep = []
                for work, t, key in sends:
                    if key == force_key or work.is_completed():
                        work.wait()
                        if key[0] == "act" and config.deallocate_pipeline_outputs and key[1] in saved:
                            deallocate_output_tensor(t, True)
                    else:
                        keep.append((work, t, key))
                sends[:] = keep

            for j, step in enumerate(sched.program(st.p)):
                t0, nvtx = clock.mark(), clock.range_start("p2p") if step.comm else None
                posts = []  # (role, key, tensor, P2POp), in the global message order
                for m, role in step.comm:
                    key = (m.kind, m.chunk)
                    if role == "send":
                        t = outgoing.pop(key)
                        peer = st.next_rank if m.kind == "act" else st.prev_rank
                        posts.append((role, key, t, dist.P2POp(dist.isend, t, peer, group=st.pp_group,
                                                               tag=tag_base + m.index)))
                    else:
                        t = torch.empty(shape(m.chunk), dtype=dtype, device=device)
                        peer = st.prev_rank if m.kind == "act" else st.next_rank
                        posts.append((role, key, t, dist.P2POp(dist.irecv, t, peer, group=st.pp_group,
                                                               tag=tag_base + m.index)))
                if posts:
                    works = dist.batch_isend_irecv([x[3] for x in posts])
                    if len(works) != len(posts):  # a coalesced batch (NCCL): one handle for all
                        for w in works:
                            w.wait()
                        works = [None] * len(posts)
                    for (role, key, t, _), w in zip(posts, works):
                        if role == "send":
                            if w is not None:
                                sends.append((w, t, key))
                        else:
                            if w is not None:
                                w.wait()
                            received[key] = t
                reap()
                wait_marks.append((t0, clock.mark()))
                clock.range_end(nvtx)
                if step.op is None:
                    break
                kind, c = step.op
                op_name = f"{kind}{c}" + (f" of pipeline {pi}" if several else "")
                t1, nvtx = clock.mark(), clock.range_start(op_name)  # Nsight: the op over its kernels
                if kind == FWD:
                    layout = sched.chunks[c]
                    inp = chunk_input(layout, batch, st.sp_group, cache, pad_id, device)
                    x = received.pop(("act", c), None)
                    if x is not None and not forward_only:
                        x.requires_grad_(True)
                    n_rec = layout.recompute[st.p] if layout.recompute and not forward_only else 0
                    grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
                    chunk_saved: dict[int, int] = {}

                    def count_saved(t, chunk_saved=chunk_saved):
                        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in param_ptrs:
                            chunk_saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                        return t

                    with grad_ctx, recompute_layers(model, n_rec), \
                            torch.autograd.graph.saved_tensors_hooks(count_saved, lambda t: t):
                        out, num_tokens = forward_step(step_func, iter([inp]), model, n_chunks, x, store,
                                                       config, 1, is_first_microbatch=first_forward,
                                                       is_last_stage=st.last)
                    live_bytes[c] = sum(chunk_saved.values())
                    stats.activation_peak_bytes = max(stats.activation_peak_bytes,
                                                      sum(live_bytes.values()) + cache.nbytes())
                    first_forward = False
                    total_tokens += num_tokens
                    if not st.last:
                        outgoing[("act", c)] = out
                    if not forward_only:
                        saved[c] = (x, out)
                    stats.prefix_cache_peak_bytes = max(stats.prefix_cache_peak_bytes, cache.nbytes())
                else:
                    reap(force_key=("act", c))
                    live_bytes.pop(c, None)
                    x, out = saved.pop(c)
                    g = received.pop(("grad", c), None)
                    if last_b == (pi, j) and sync_ctx is not None:
                        sync_ctx.__exit__(None, None, None)
                        sync_ctx = None
                    gx = backward_step(x, out, g, model_type, config)
                    if not st.first:
                        outgoing[("grad", c)] = gx
                op_marks.append((op_name, t1, clock.mark()))
                clock.range_end(nvtx)
            for work, _, _ in sends:
                work.wait()
            if outgoing or received:
                raise RuntimeError(f"pipeline {pi}: messages left over on stage {st.p}: "
                                   f"{sorted(outgoing)} to send, {sorted(received)} received")
            if not forward_only and len(cache):
                raise RuntimeError(f"pipeline {pi}: prefix K/V of {cache.keys()} still cached after the backward")
            cache.clear()
            tag_base += len(sched.messages)
    finally:
        if sync_ctx is not None:
            sync_ctx.__exit__(None, None, None)

    stats.ops = [(name, clock.seconds(a, b)) for name, a, b in op_marks]
    stats.op_starts_s = [clock.seconds(began, a) for _, a, _ in op_marks]
    stats.comm_wait_s = sum(clock.seconds(a, b) for a, b in wait_marks)
    if finalize and not forward_only and config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func([model], total_tokens if config.calculate_per_token_loss else None)
    return store, stats


# ---- building the stage model ------------------------------------------------------------------

def build_pipeline_model(spec, vocab_size: int, max_seq_len: int, backend: str = "auto", *, ddp: bool = True,
                         share_embeddings_and_output_weights: bool = False, **config_overrides):
    """This rank's stage of a GPTModel (fp32, RoPE, Ulysses core attention with prefix K/V) for
    megatron's pipeline layout (parallel_state must be initialized with the pipeline size), wrapped
    in megatron DDP over the stage's data-parallel (= SP) group with ``finalize_model_grads``.
    ``spec``: a ModelSpec (layers, hidden size, heads, KV heads, FFN size). Returns (model, config)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.runtime.attention import get_gpt_layer_ulysses_spec
    from megatron_ext.runtime.rope import use_true_positions_for_rope
    from megatron_ext.runtime.device import rank_device

    P = ps.get_pipeline_model_parallel_world_size()
    kw = dict(num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
              num_query_groups=spec.kv_heads, ffn_hidden_size=spec.ffn_hidden_size or 4 * spec.hidden_size,
              hidden_dropout=0.0, attention_dropout=0.0, calculate_per_token_loss=True, use_cpu_initialization=True,
              params_dtype=torch.float32, pipeline_dtype=torch.float32, pipeline_model_parallel_size=P)
    kw.update(config_overrides)
    config = TransformerConfig(**kw)
    if spec.num_layers % P:
        raise ValueError(f"{P} pipeline stages do not divide the {spec.num_layers} layers")
    padded_vocab = -(-vocab_size // 128) * 128
    model = GPTModel(config, get_gpt_layer_ulysses_spec(backend=backend), vocab_size=padded_vocab,
                     max_sequence_length=max_seq_len, position_embedding_type="rope",
                     pre_process=ps.is_pipeline_first_stage(ignore_virtual=True),
                     post_process=ps.is_pipeline_last_stage(ignore_virtual=True),
                     share_embeddings_and_output_weights=share_embeddings_and_output_weights)
    use_true_positions_for_rope(model)
    device = rank_device()
    if device.type == "cuda":  # built on the host (use_cpu_initialization: the same weights on any layout)
        model.cuda(device)
    if not ddp:
        return model, config
    wrapped = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    config.no_sync_func = wrapped.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped, config


def stage_state_dict(full_state_dict: dict, stage_model) -> dict:
    """The entries of a whole (one-stage) GPTModel's state dict that belong to ``stage_model``,
    renamed to its local layer numbering (``decoder.layers.<global - offset>``)."""
    m = _unwrap(stage_model)
    mine = m.state_dict()
    offset = m.decoder.layers[0].layer_number - 1 if len(m.decoder.layers) else 0
    out = {}
    for name in mine:
        src = name
        if name.startswith("decoder.layers."):
            rest = name[len("decoder.layers."):]
            i, tail = rest.split(".", 1)
            src = f"decoder.layers.{int(i) + offset}.{tail}"
        if src not in full_state_dict and name == "output_layer.weight":
            src = "embedding.word_embeddings.weight"  # tied embeddings: the last stage's copy
        if src not in full_state_dict:
            raise KeyError(f"{src} (for {name}) is not in the full model's state dict")
        out[name] = full_state_dict[src]
    return out


__all__ = ["BWD", "FWD", "ChunkInput", "ChunkLayout", "Message", "PipelineSchedule", "PipelineStepStats", "Step",
           "build_pipeline_model", "build_schedule", "build_schedules", "check_rendezvous", "chunk_forward_step",
           "chunk_input", "chunk_layouts", "default_op_time", "forward_backward_elastic", "recompute_layers",
           "stage_state_dict"]
