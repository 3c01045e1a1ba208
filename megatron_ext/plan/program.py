"""The pipeline program compiler: an elastic pipeline of a StepPlan, as what every stage does.

Torch-free (numpy only), shared by plan validation (plan/validate.py), the simulator
(sim/engine.py, sim/simulator.py, and through them the planner) and the elastic pipeline runtime
(runtime/pipeline.py). Everything here is derived from the plan alone, identically on every rank.

Operations. A stage runs each chunk's forward and backward once, in its ``order_per_stage``
list of names ``"F<chunk id>"`` / ``"B<chunk id>"``. In code an operation is ``(kind, chunk)``
with ``kind`` one of ``FWD`` / ``BWD`` (the ints 0 / 1: array indices, and fast in the planner's
inner loop) and ``chunk`` the chunk's index in the pipeline's chunk list (``parse_order``) or, in
a compiled program (``ProgramStep.op``), the chunk's id; there ``kind`` is an ``OpKind``, the
same 0 / 1 printed ``F`` / ``B``. ``op_name`` names an op as in the orders; ``parse_order`` is
the one parser and checker of orders.

Dependencies (InfiniPipe / Seq1F1B). F of chunk k on stage p after F of k on stage p-1 (plus a
p2p transfer); B of k on p after F of k on p and after B of k on p+1 (plus a transfer); for two
consecutive slices a < b of one sequence, F of b after F of a and B of a after B of b, on the same
stage (b attends to a's K/V; a's dK/dV needs the gradient b sends back for the prefix).
``list_schedule`` is the one list scheduler: each stage runs its order one op after another,
every op as soon as its stage is free and its dependencies are done; if no stage can start its
next op while some remain, the order deadlocks and it raises ``InvalidPlanError`` naming the
stage, the op and what it waits for (``deadlock_message``). The planner scores candidate orders
with it in its inner loop (arrays in, arrays out, plain-float lookups inside).

Programs (``build_schedule``). The runtime turns one pipeline into per-stage programs: it checks
the pipeline (stages, chunk pieces tile their sequences, each chunk's F and B once per stage,
recompute counts), list-schedules the orders with relative op times (``default_op_time``), and
derives communication as one global sequence of events: every op at its scheduled start, every
message (activation of F k from p to p+1, gradient of B k from p to p-1) at the end of the op
that produces it. Each stage's program is its ops in that order, each preceded by one batch of
the messages that fall between its previous op and this one (``ProgramStep``). Every rank issues
its messages in the one global order, so the programs cannot deadlock even if every send and
receive were a blocking rendezvous (``check_rendezvous`` verifies it). Chunk k's buffer is its
tokens padded to a multiple of the SP degree (``padded_buffer_length``, THE padding rule).
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from enum import IntEnum
from functools import partial
from numbers import Integral
from typing import Callable, Optional, Sequence

import numpy as np

from megatron_ext.errors import InvalidPlanError
from megatron_ext.plan.schema import Pipeline, StepPlan


FWD, BWD = 0, 1  # an operation's kind


class OpKind(IntEnum):
    """FWD / BWD (equal to them, same hash) printed ``F`` / ``B``: the kind of a compiled
    program's ops (``ProgramStep.op``), so that ``f"{kind}{chunk}"`` is the op's name."""

    F = FWD
    B = BWD

    def __str__(self) -> str:
        return self.name

    def __format__(self, spec: str) -> str:
        return format(self.name, spec)


def op_name(kind, chunk) -> str:
    """``"F3"`` / ``"B3"``: an operation's name in ``order_per_stage``."""
    return f"{'FB'[kind]}{chunk}"


def padded_buffer_length(num_tokens: int, degree: int) -> int:
    """THE padding rule: a packed buffer of ``num_tokens`` real tokens (a FlexSP group's, a
    pipeline chunk's) is padded at its end to the next multiple of its SP degree (no padding if it
    already divides), so that each of the degree's ranks holds an equal shard (``degree``: the SP
    degree, times any multiple a kernel asks each shard to be)."""
    if degree < 1:
        raise ValueError(f"degree must be at least 1, got {degree}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be non-negative, got {num_tokens}")
    return -(-num_tokens // degree) * degree


def is_int(v) -> bool:
    """An integer from JSON or numpy, not a bool."""
    return type(v) is int or (isinstance(v, Integral) and not isinstance(v, bool))  # (the common case first)


# ---- orders ------------------------------------------------------------------------------------

def parse_order(order_per_stage, chunk_ids, stages: int, where: str = "pipeline") -> list[list[tuple[int, int]]]:
    """THE order parser: per stage, its names ``"F<chunk id>"`` / ``"B<chunk id>"`` as ``(FWD|BWD,
    chunk index)`` (the index of the chunk in ``chunk_ids``: a list of ids, or anything with an
    ``ids`` list such as sim's ChunkTable). Raises InvalidPlanError unless there is one list per
    stage and every stage runs each chunk's F and B exactly once."""
    ids = list(getattr(chunk_ids, "ids", chunk_ids))
    if len(order_per_stage) != stages:
        raise InvalidPlanError(f"{where}: order_per_stage has {len(order_per_stage)} lists for {stages} stages")
    index = {cid: i for i, cid in enumerate(ids)}
    n = len(ids)
    parsed: dict[str, tuple[int, int]] = {}  # (each name recurs on every stage: parsed once)
    out = []
    for p, names in enumerate(order_per_stage):
        ops = []
        for name in names:
            op = parsed.get(name) if type(name) is str else None
            if op is None:
                if not isinstance(name, str) or len(name) < 2 or name[0] not in "FB" or not name[1:].isdigit():
                    raise InvalidPlanError(f"{where}, stage {p}: operation {name!r} is not 'F<chunk id>' or "
                                           f"'B<chunk id>'")
                k = index.get(int(name[1:]))
                if k is None:
                    raise InvalidPlanError(f"{where}, stage {p}: operation {name} names no chunk of the pipeline")
                op = parsed[name] = (FWD if name[0] == "F" else BWD, k)
            ops.append(op)
        if len(ops) != 2 * n or len(set(ops)) != 2 * n:  # (else each of the 2n ops is there once)
            seen = Counter(ops)
            kind, bad = next(op for op in itertools.product((FWD, BWD), range(n)) if seen[op] != 1)
            count = seen[kind, bad]
            raise InvalidPlanError(f"{where}, stage {p}: {op_name(kind, ids[bad])} appears {count} times "
                                   + (f"(missing {op_name(kind, ids[bad])}: " if count == 0 else "(")
                                   + "each chunk's forward and backward run once per stage)")
        out.append(ops)
    return out


def slice_predecessors(n: int, chains) -> tuple[list[list[int]], list[list[int]]]:
    """(fwd_pred, bwd_pred) per chunk index of a pipeline's ``n`` chunks. ``chains``: per sequence
    cut into several pieces, the indices of the chunks holding them, in token order. For two
    consecutive slices a < b of one sequence, F of b follows F of a and B of a follows B of b."""
    fwd_pred: list[list[int]] = [[] for _ in range(n)]
    bwd_pred: list[list[int]] = [[] for _ in range(n)]
    for chain in chains:
        for prev, nxt in zip(chain, chain[1:]):
            fwd_pred[nxt].append(prev)
            bwd_pred[prev].append(nxt)
    return fwd_pred, bwd_pred


# ---- the list scheduler ------------------------------------------------------------------------

def _start(free: float, neighbour: list | None, k: int, preds: list[int], own: list, p2p: list[float]):
    """When an op of chunk ``k`` can start on a stage free at ``free``: after its neighbouring
    stage's op (``neighbour``'s end, plus the p2p transfer) and its same-stage predecessors
    (``own``'s ends); None while one of them has not run (the stage is blocked)."""
    t = free
    if neighbour is not None:
        e = neighbour[k]
        if e is None:
            return None
        t = max(t, e + p2p[k])
    for j in preds:
        e = own[j]
        if e is None:
            return None
        t = max(t, e)
    return t


def list_schedule(ops: list[list[tuple[int, int]]], fwd: np.ndarray, bwd: np.ndarray, p2p: np.ndarray,
                  fwd_pred: list[list[int]], bwd_pred: list[list[int]], start: np.ndarray | None = None,
                  name=None, where: str | None = None):
    """Start and end of every operation: [2, P, n] arrays (FWD, BWD; NaN for ops not in ``ops``).
    ``ops``: per stage, its (FWD|BWD, chunk index) in order; ``fwd`` is [n] or [P, n], ``bwd``
    [P, n], ``p2p`` [n] (the transfer after a chunk's F or B to the next stage); ``start`` the time
    each stage becomes free. Raises InvalidPlanError naming the stage and operation (``name(kind,
    k)``, default ``F<k>``; prefixed ``where: ``) if the order deadlocks."""
    P = len(ops)
    n = len(p2p)
    fwd = np.broadcast_to(fwd, (P, n))
    free = np.zeros(P) if start is None else np.array(start, dtype=np.float64)
    ptr = [0] * P
    # python lists and floats: far faster lookups than numpy's in this loop
    begin_l = [[[None] * n for _ in range(P)] for _ in range(2)]
    end_l = [[[None] * n for _ in range(P)] for _ in range(2)]
    fwd_l = fwd.tolist()
    bwd_l = bwd.tolist()
    p2p_l = p2p.tolist()
    free_l = free.tolist()
    fwd_end, bwd_end = end_l[FWD], end_l[BWD]
    remaining = sum(len(o) for o in ops)
    while remaining:
        progressed = False
        for p in range(P):
            op_list = ops[p]
            at, stop = ptr[p], len(op_list)
            ready = free_l[p]
            own_f, own_b = fwd_end[p], bwd_end[p]
            prev_f = fwd_end[p - 1] if p > 0 else None
            next_b = bwd_end[p + 1] if p < P - 1 else None
            while at < stop:
                kind, k = op_list[at]
                if kind == FWD:
                    t = _start(ready, prev_f, k, fwd_pred[k], own_f, p2p_l)
                    dur = fwd_l[p][k]
                else:
                    e = own_f[k]  # (its own forward first)
                    t = None if e is None else _start(max(ready, e), next_b, k, bwd_pred[k], own_b, p2p_l)
                    dur = bwd_l[p][k]
                if t is None:
                    break
                begin_l[kind][p][k] = t
                ready = t + dur
                end_l[kind][p][k] = ready
                at += 1
            if at > ptr[p]:
                remaining -= at - ptr[p]
                ptr[p], free_l[p] = at, ready
                progressed = True
        if not progressed:
            msg = deadlock_message(ops, ptr, end_l, fwd_pred, bwd_pred, name)
            raise InvalidPlanError(f"{where}: {msg}" if where else msg)
    begin = np.array([[[np.nan if v is None else v for v in row] for row in begin_l[kind]] for kind in (FWD, BWD)])
    end = np.array([[[np.nan if v is None else v for v in row] for row in end_l[kind]] for kind in (FWD, BWD)])
    return begin.reshape(2, P, n), end.reshape(2, P, n)


def deadlock_message(ops, ptr, end_l, fwd_pred, bwd_pred, name=None) -> str:
    """Why ``list_schedule`` stopped: the first stage with ops left, its next op and what that
    waits for. ``end_l[kind][p][k]``: the end of each op that ran, None for the others."""
    name = name or op_name
    P = len(ops)
    for p in range(P):
        if ptr[p] >= len(ops[p]):
            continue
        kind, k = ops[p][ptr[p]]
        waits = []
        if kind == FWD:
            if p > 0 and end_l[FWD][p - 1][k] is None:
                waits.append(f"{name(FWD, k)} on stage {p - 1}")
            waits += [f"{name(FWD, j)} on stage {p}" for j in fwd_pred[k] if end_l[FWD][p][j] is None]
        else:
            if end_l[FWD][p][k] is None:
                waits.append(f"{name(FWD, k)} on stage {p}")
            if p < P - 1 and end_l[BWD][p + 1][k] is None:
                waits.append(f"{name(BWD, k)} on stage {p + 1}")
            waits += [f"{name(BWD, j)} on stage {p}" for j in bwd_pred[k] if end_l[BWD][p][j] is None]
        return (f"the operation order deadlocks: stage {p} cannot run {name(kind, k)} (operation {ptr[p]} of its "
                f"order): it waits for {', '.join(waits)}, which cannot run first")
    return "the operation order deadlocks"  # pragma: no cover


# ---- chunks ------------------------------------------------------------------------------------

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
        """Buffer length: tokens padded to a multiple of the SP degree (``padded_buffer_length``)."""
        return padded_buffer_length(self.tokens, degree)

    @property
    def sliced(self) -> bool:
        return any(self.starts) or any(self.continues)


def piece_arrays(pieces: Sequence[Sequence[tuple[int, int, int]]], ids: Sequence[int], where: str = "pipeline",
                 lengths: Optional[np.ndarray] = None):
    """A pipeline's chunks, each a list of (seq_id, start, end) pieces, as arrays over every piece:
    (owner, seq_id, start, end, order), ``owner`` the chunk's index and ``order`` the pieces by
    sequence, chunk, then start. Refuses a chunk holding two pieces of one sequence and, given the
    batch's ``lengths``, a piece outside its sequence. (All at once: one piece at a time, 128
    pipelines of 32,768 sequences took 90 ms, and the plan check and the simulator each walk them.)"""
    counts = np.fromiter((len(c) for c in pieces), dtype=np.int64, count=len(pieces))
    owner = np.repeat(np.arange(len(pieces)), counts)
    flat = [x for c in pieces for x in c]
    try:
        sid, a, b = np.array(flat, dtype=np.int64).reshape(-1, 3).T
    except OverflowError:  # (an integer past int64 is outside any sequence)
        sid = a = b = np.full(len(flat), -1, dtype=np.int64)
    if lengths is not None:
        within = (sid >= 0) & (sid < len(lengths))
        bad = ~within | (a < 0) | (a >= b) | (b > lengths[np.where(within, sid, 0)])
        if bad.any():
            i = int(np.argmax(bad))
            raise InvalidPlanError(f"{where}, chunk {ids[owner[i]]}: piece {flat[i][0]}[{flat[i][1]}:{flat[i][2]}] "
                                   f"is outside its sequence")
    order = np.lexsort((a, owner, sid))  # (a repeat within a chunk is adjacent)
    s, o = sid[order], owner[order]
    twice = np.flatnonzero((s[1:] == s[:-1]) & (o[1:] == o[:-1]))
    if twice.size:
        i = order[twice[0]]
        raise InvalidPlanError(f"{where}, chunk {ids[owner[i]]}: holds two pieces of sequence {sid[i]}")
    return owner, sid, a, b, order


def chunk_layouts(pipeline: Pipeline, lengths: Sequence[int], layers_per_stage: Optional[int] = None,
                  where: str = "pipeline") -> dict[int, ChunkLayout]:
    """Check the chunks of a pipeline against the batch's lengths and lay them out (by id, in the
    pipeline's chunk order): unique non-negative integer ids, integer pieces within their sequence,
    at most one piece of a sequence per chunk, the pipeline's pieces of a sequence tile it,
    ``recompute_layers_per_stage`` empty or one integer in [0, layers_per_stage] per stage (the
    pieces all at once: ``piece_arrays``)."""
    P = pipeline.stages
    ids: list[int] = []
    pieces: list[list[tuple[int, int, int]]] = []
    recompute: list[tuple[int, ...]] = []
    seen: set[int] = set()
    for c in pipeline.chunks:
        if not is_int(c.id) or c.id < 0 or int(c.id) in seen:
            raise InvalidPlanError(f"{where}: chunk id {c.id!r} is not a unique non-negative integer")
        if not c.pieces:
            raise InvalidPlanError(f"{where}, chunk {c.id}: has no pieces")
        ps = [(x.seq_id, x.start, x.end) for x in c.pieces]
        if not all(type(sid) is int and type(a) is int and type(b) is int for sid, a, b in ps):
            if not all(is_int(sid) and is_int(a) and is_int(b) for sid, a, b in ps):
                raise InvalidPlanError(f"{where}, chunk {c.id}: piece seq_id, start and end must be integers")
            ps = [(int(sid), int(a), int(b)) for sid, a, b in ps]
        r = list(c.recompute_layers_per_stage or [])
        if r and (len(r) != P or any(not is_int(v) or v < 0 or (layers_per_stage is not None and v > layers_per_stage)
                                     for v in r)):
            raise InvalidPlanError(f"{where}, chunk {c.id}: recompute_layers_per_stage must be {P} integers in "
                                   f"0..{layers_per_stage}, got {r!r:.60}")
        seen.add(int(c.id))
        ids.append(int(c.id))
        pieces.append(ps)
        recompute.append(tuple(int(v) for v in r))
    lengths = np.asarray(lengths, dtype=np.int64)
    owner, sid, a, b, _ = piece_arrays(pieces, ids, where, lengths)
    order = np.lexsort((a, sid))  # each sequence's pieces by start: each must begin where the last ended
    s, a_s, b_s = sid[order], a[order], b[order]
    first = np.concatenate([[True], s[1:] != s[:-1]])
    ends = np.where(first, 0, np.concatenate([[0], b_s[:-1]]))
    gap = np.flatnonzero(a_s != ends)
    if gap.size:
        i = gap[0]
        raise InvalidPlanError(f"{where}: the pieces of sequence {s[i]} do not tile it (gap or overlap at {ends[i]})")
    last = np.concatenate([s[1:] != s[:-1], [True]])
    short = np.flatnonzero(last & (b_s != lengths[s]))
    if short.size:
        i = short[0]
        raise InvalidPlanError(f"{where}: the pieces of sequence {s[i]} end at {b_s[i]}, it has "
                               f"{lengths[s[i]]} tokens")
    sids, starts, lens, cont = sid.tolist(), a.tolist(), (b - a).tolist(), (b < lengths[sid]).tolist()
    out: dict[int, ChunkLayout] = {}
    lo = 0
    for cid, ps, r in zip(ids, pieces, recompute):
        hi = lo + len(ps)
        out[cid] = ChunkLayout(cid, tuple(sids[lo:hi]), tuple(starts[lo:hi]), tuple(lens[lo:hi]), tuple(cont[lo:hi]), r)
        lo = hi
    return out


def check_one_pipeline_per_sequence(pipelines: Sequence[Pipeline]) -> None:
    """A sequence's pieces stay in one pipeline (its slices share a prefix K/V cache)."""
    owner: dict[int, int] = {}
    for i, pipe in enumerate(pipelines):
        for c in pipe.chunks:
            for x in c.pieces:
                if is_int(x.seq_id) and owner.setdefault(int(x.seq_id), i) != i:  # (chunk_layouts: not ints)
                    raise InvalidPlanError(f"sequence {x.seq_id} has pieces in pipelines {owner[int(x.seq_id)]} and "
                                           f"{i}: a sequence must stay in one pipeline")


# ---- programs ----------------------------------------------------------------------------------

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
class ProgramStep:
    """Post ``comm`` (one batch), wait for its receives, then run ``op`` (None: the final batch)."""

    comm: tuple[tuple[Message, str], ...]  # (message, "send" | "recv"), in global order
    op: Optional[tuple[OpKind, int]]  # (FWD | BWD as an OpKind, chunk id)


@dataclass
class PipelineSchedule:
    """What every stage of one pipeline does, derived from the plan alone."""

    stages: int
    sp_degree: int
    chunks: dict[int, ChunkLayout]
    events: list[tuple]  # the global sequence: ("op", stage, kind, chunk) | ("msg", Message)
    messages: list[Message]
    programs: list[list[ProgramStep]]  # per stage
    times: dict = field(default_factory=dict)  # (kind, stage, chunk) -> (start, end) in schedule units

    def program(self, stage: int) -> list[ProgramStep]:
        return self.programs[stage]

    def describe(self, stage: int) -> str:
        """One line per step: ``[send act3->1, recv grad2<-1] F4``."""
        out = []
        for st in self.programs[stage]:
            comm = ", ".join(f"{role} {m.kind}{m.chunk}{'->' if role == 'send' else '<-'}"
                             f"{m.dst if role == 'send' else m.src}" for m, role in st.comm)
            op = op_name(*st.op) if st.op else "(end)"
            out.append(f"[{comm}] {op}" if comm else op)
        return "\n".join(out)


def default_op_time(chunk: ChunkLayout, kind, stage: int, layers_per_stage: Optional[int] = None) -> float:
    """Relative op durations used to place messages in the global order (never for correctness):
    tokens plus causal attention pairs / 1024 (prefix included); a backward costs twice a forward
    plus its recomputed share of the forward."""
    work = sum(n + n * (2 * a + n) / 2048.0 for a, n in zip(chunk.starts, chunk.lengths)) + 1.0
    if kind == FWD:
        return work
    rec = chunk.recompute[stage] if chunk.recompute else 0
    return 2.0 * work + work * rec / max(1, layers_per_stage or max(chunk.recompute or [1]))


def build_schedule(pipeline: Pipeline, lengths: Sequence[int], *, stages: Optional[int] = None,
                   sp_degree: Optional[int] = None, layers_per_stage: Optional[int] = None,
                   op_time: Callable[[ChunkLayout, int, int], float] = default_op_time,
                   forward_only: bool = False, where: str = "pipeline") -> PipelineSchedule:
    """Validate one pipeline of a plan and derive every stage's program (module doc).
    ``stages`` / ``sp_degree`` / ``layers_per_stage``: the runtime's layout, checked against the
    plan. ``op_time(chunk, kind, stage)``: relative durations (positive). ``forward_only``: the
    programs of the plan's forwards alone (same order, no gradients). Raises InvalidPlanError (the
    same on every rank) for a malformed or deadlocking plan (the full order is checked even when
    only the forwards will run)."""
    P = pipeline.stages
    if not is_int(P) or P < 1:
        raise InvalidPlanError(f"{where}: stages must be a positive integer, got {P!r}")
    if stages is not None and P != stages:
        raise InvalidPlanError(f"{where}: the plan has {P} stages, the runtime runs {stages}")
    if sp_degree is not None and pipeline.sp_degree != sp_degree:
        raise InvalidPlanError(f"{where}: the plan's SP degree is {pipeline.sp_degree}, the runtime's is {sp_degree} "
                               f"(every pipeline of a plan runs at one degree)")
    if not pipeline.chunks:
        raise InvalidPlanError(f"{where}: has no chunks")
    chunks = chunk_layouts(pipeline, lengths, layers_per_stage, where)
    ids = list(chunks)
    layouts = list(chunks.values())
    n = len(ids)
    orders = parse_order(pipeline.order_per_stage, ids, P, where)
    by_seq: dict[int, list[tuple[int, int]]] = {}
    for k, ch in enumerate(layouts):
        for sid, a in zip(ch.seq_ids, ch.starts):
            by_seq.setdefault(sid, []).append((a, k))
    fwd_pred, bwd_pred = slice_predecessors(n, [[k for _, k in sorted(ps)] for ps in by_seq.values() if len(ps) > 1])

    if op_time is default_op_time:
        op_time = partial(default_op_time, layers_per_stage=layers_per_stage)
    dur = np.zeros((2, P, n))
    for kind in (FWD, BWD):
        for p in range(P):
            for k, ch in enumerate(layouts):
                d = float(op_time(ch, kind, p))
                if not d > 0:
                    raise ValueError(f"op_time must be positive, got {d} for {op_name(kind, ch.id)} on stage {p}")
                dur[kind, p, k] = d
    no_p2p = np.zeros(n)  # the order of events needs no transfer times
    name = lambda kind, k: op_name(kind, ids[k])  # noqa: E731
    begin, end = list_schedule(orders, dur[FWD], dur[BWD], no_p2p, fwd_pred, bwd_pred, name=name, where=where)
    if forward_only:  # the full order was checked above
        orders = [[op for op in o if op[0] == FWD] for o in orders]
        begin, end = list_schedule(orders, dur[FWD], dur[BWD], no_p2p, fwd_pred, bwd_pred, name=name, where=where)

    # the global sequence of events, by time; at equal times messages before ops; ties among ops
    # (and among messages) by their producing op's start, then stage
    raw: list[tuple] = []
    times: dict[tuple, tuple[float, float]] = {}
    for p, o in enumerate(orders):
        for kind, k in o:
            s, e = float(begin[kind, p, k]), float(end[kind, p, k])
            c = ids[k]
            times[(OpKind(kind), p, c)] = (s, e)
            raw.append((s, 1, s, p, 0, ("op", p, OpKind(kind), c)))
            if kind == FWD and p < P - 1:
                raw.append((e, 0, s, p, 1, ("msg", "act", c, p, p + 1)))
            elif kind == BWD and p > 0:
                raw.append((e, 0, s, p, 1, ("msg", "grad", c, p, p - 1)))
    raw.sort(key=lambda r: r[:5])
    events: list[tuple] = []
    messages: list[Message] = []
    pending: list[list[tuple[Message, str]]] = [[] for _ in range(P)]
    programs: list[list[ProgramStep]] = [[] for _ in range(P)]
    for *_, ev in raw:
        if ev[0] == "msg":
            m = Message(len(messages), ev[1], ev[2], ev[3], ev[4])
            messages.append(m)
            events.append(("msg", m))
            pending[m.src].append((m, "send"))
            pending[m.dst].append((m, "recv"))
        else:
            _, p, kind, c = ev
            events.append(ev)
            programs[p].append(ProgramStep(tuple(pending[p]), (OpKind(kind), c)))
            pending[p] = []
    for p in range(P):
        programs[p].append(ProgramStep(tuple(pending[p]), None))
    return PipelineSchedule(P, int(pipeline.sp_degree), chunks, events, messages, programs, times)


def build_schedules(plan: StepPlan, lengths: Sequence[int], stages: int, sp_degree: int,
                    layers_per_stage: Optional[int] = None, op_time_of: Optional[Callable] = None,
                    forward_only: bool = False) -> list[PipelineSchedule]:
    """``build_schedule`` for every pipeline of an elastic_pp plan, every replica's (a sequence in
    two pipelines is refused too). ``op_time_of(pipeline)``: that pipeline's ``op_time`` (default:
    ``default_op_time``; the runtime's, ``sim.simulated_op_times``)."""
    if plan.kind != "elastic_pp":
        raise InvalidPlanError(f"the pipeline runtime runs elastic_pp plans, not {plan.kind!r} plans")
    if not plan.pipelines:
        raise InvalidPlanError("an elastic_pp plan needs at least one pipeline")
    out = [build_schedule(pipe, lengths, stages=stages, sp_degree=sp_degree, layers_per_stage=layers_per_stage,
                          op_time=op_time_of(pipe) if op_time_of is not None else default_op_time,
                          forward_only=forward_only, where=f"pipeline {i}")
           for i, pipe in enumerate(plan.pipelines)]
    check_one_pipeline_per_sequence(plan.pipelines)
    return out


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


__all__ = ["BWD", "ChunkLayout", "FWD", "Message", "OpKind", "PipelineSchedule", "ProgramStep", "build_schedule",
           "build_schedules", "check_one_pipeline_per_sequence", "check_rendezvous", "chunk_layouts",
           "deadlock_message", "default_op_time", "is_int", "list_schedule", "op_name", "padded_buffer_length",
           "parse_order", "piece_arrays", "slice_predecessors"]
