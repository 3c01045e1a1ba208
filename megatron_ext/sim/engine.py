"""The core of the pipeline simulator, on arrays: chunk tables, dependencies, memory and timing.

Everything here is derived from a pipeline's chunks (their pieces) and per-stage operation
orders; nothing trusts the planner's own bookkeeping. The planner calls these functions to score
candidate plans, and ``megatron_ext.sim.simulate`` calls them to time and check a StepPlan.

Dependencies (InfiniPipe / Seq1F1B): for two consecutive pieces of one sequence, held by chunks a
(earlier tokens) and b (later tokens), on every stage the forward of b follows the forward of a
(b attends to a's K/V), and the backward of a follows the backward of b (a's dK/dV needs the
gradient b sends back for the prefix). Across stages, the forward of a chunk on stage p follows
its forward on stage p-1 plus one p2p transfer, the backward on p its backward on p+1 plus one.
The operations, the order parser and the list scheduler are plan/program.py's (``FWD``, ``BWD``,
``parse_order``, ``list_schedule``), shared with plan validation and the pipeline runtime.

Each stage executes its operations one after another in the given order, so its memory is a
function of the order alone (not of the times): after a forward, the chunk's retained memory is
added; during a backward, the chunk's full activations are back (recomputed layers re-run) and,
for split sequences, the prefix dK/dV buffer is live. The list scheduler starts every operation
as soon as its stage is free and its dependencies are done; if no stage can start its next
operation while some remain, the order deadlocks.
"""
from __future__ import annotations

import heapq
import math

from dataclasses import dataclass

import numpy as np

from megatron_ext.cost.pipeline import PipelineCost
from megatron_ext.errors import InvalidPlanError
from megatron_ext.plan.program import BWD, FWD, op_name, piece_arrays, slice_predecessors
from megatron_ext.plan.schema import Chunk


@dataclass
class ChunkTable:
    """Per-chunk data of one pipeline (index = position in the pipeline's chunk list)."""

    ids: list[int]
    tokens: np.ndarray  # tokens per chunk
    work: np.ndarray  # whole-model one-GPU fwd+bwd ms of the chunk's pieces (with their prefixes)
    cached_tokens: np.ndarray  # tokens in pieces whose sequence continues in a later chunk (K/V cached)
    fwd_pred: list[list[int]]  # chunks whose forward must come first (same stage)
    bwd_pred: list[list[int]]  # chunks whose backward must come first (same stage)
    split_pieces: list[list[tuple[int, int, int]]]  # (seq_id, start, end) of split pieces, per chunk
    seq_end: dict[int, int]  # split sequence -> its length

    @property
    def n(self) -> int:
        return len(self.ids)

    def index(self) -> dict[int, int]:
        return {cid: i for i, cid in enumerate(self.ids)}


def analyze_chunks(chunks: list[Chunk], pc: PipelineCost, where: str = "pipeline") -> ChunkTable:
    """Tokens, work and dependencies of a pipeline's chunks, from their pieces alone."""
    return analyze_pieces([[(x.seq_id, x.start, x.end) for x in c.pieces] for c in chunks], pc, where,
                          [c.id for c in chunks])


def analyze_pieces(pieces: list[list[tuple[int, int, int]]], pc: PipelineCost, where: str = "pipeline",
                   ids: list[int] | None = None) -> ChunkTable:
    """``analyze_chunks`` of chunks given as their (seq_id, start, end) pieces (ids: their
    positions unless given), as the planner builds them: no plan objects per candidate. (All
    pieces at once; only a split sequence's are walked one by one, to chain its slices.)"""
    n = len(pieces)
    ids = list(range(n)) if ids is None else [int(c) for c in ids]
    if len(set(ids)) != n:
        raise InvalidPlanError(f"{where}: chunk ids are not unique")
    owner, sid, a, b, order = piece_arrays(pieces, ids, where)
    same = sid[order][1:] == sid[order][:-1]
    lens = (b - a).astype(np.float64)
    work = np.bincount(owner, weights=pc.piece_work(lens, a.astype(np.float64)), minlength=n)
    tokens = np.bincount(owner, weights=lens, minlength=n)
    split = np.zeros(n)
    split_pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    seq_end: dict[int, int] = {}
    chains = []  # per split sequence, the chunks of its slices in order
    multi = np.concatenate([[False], same]) | np.concatenate([same, [False]])  # in a sequence of 2+ pieces
    if multi.any():
        order = order[multi]
        order = order[np.lexsort((a[order], sid[order]))]  # each split sequence's pieces by start
        s, a_s, b_s, o = sid[order].tolist(), a[order].tolist(), b[order].tolist(), owner[order].tolist()
        j = 0
        while j < len(s):
            k = j
            while k < len(s) and s[k] == s[j]:
                k += 1
            chains.append(o[j:k])
            seq_end[s[j]] = b_s[k - 1]
            for q in range(j, k):
                split_pieces[o[q]].append((s[q], a_s[q], b_s[q]))
                if q < k - 1:
                    split[o[q]] += b_s[q] - a_s[q]
            j = k
    fwd_pred, bwd_pred = slice_predecessors(n, chains)
    return ChunkTable(ids, tokens, work, split, fwd_pred, bwd_pred, split_pieces, seq_end)


# ---- memory ----------------------------------------------------------------------------------

@dataclass
class Moments:
    """The moments of one stage that can peak (after each forward, during each backward), as
    arrays: moment r (operation ``pos[r]`` of the stage's order, ``kind[r]`` of ``chunk[r]``) holds
    ``const[r]`` MB with nothing recomputed (activations, logits, dK/dV buffers; no model states),
    less ``save[k] * recompute[k]`` for each chunk k in flight then: forwarded and not yet
    backwarded, ``fwd_pos[k] <= pos[r] < bwd_pos[k]`` (a chunk is not in flight during its own
    backward; one backwarded before its forward, which the scheduler refuses, stays in flight from
    its forward on, as nothing frees it). The chunks in flight are intervals of positions, so a
    moment's are found, not stored: hundreds of one sequence's slices in flight at thousands of
    moments made lists of millions of entries."""

    kind: np.ndarray  # [moments] FWD / BWD
    chunk: np.ndarray  # [moments]
    pos: np.ndarray  # [moments], ascending
    const: np.ndarray  # [moments]
    fwd_pos: np.ndarray  # [chunks]
    bwd_pos: np.ndarray  # [chunks]
    by_fwd: np.ndarray  # the chunks in forward order (by ``fwd_pos``; each stage forwards every chunk once)

    def __post_init__(self):
        self._fwd_sorted = self.fwd_pos[self.by_fwd]

    def __len__(self) -> int:
        return len(self.pos)

    def in_flight(self, r: int) -> np.ndarray:
        """The chunks in flight at moment ``r``, in forward order."""
        pos = self.pos[r]
        k = self.by_fwd[:int(np.searchsorted(self._fwd_sorted, pos, side="right"))]
        return k[self.bwd_pos[k] > pos]

    def runs(self, among: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where each chunk is in flight, a run of the moments ``among`` (ascending indices):
        ``lo:hi``, counted among them, empty where none."""
        at = self.pos[among]
        lo = np.searchsorted(at, self.fwd_pos, side="left")
        return lo, np.maximum(lo, np.searchsorted(at, self.bwd_pos, side="left"))

    def memory(self, save: np.ndarray, recompute: np.ndarray) -> np.ndarray:
        """MB (no model states) at each moment for per-chunk recompute layer counts."""
        red = save * recompute
        return np.array([self.const[r] - float(red[self.in_flight(r)].sum()) for r in range(len(self))])


class _SliceBuffers:
    """Per split sequence, what outlives a slice's backward, in tokens of K/V-sized buffers
    (``PipelineCost.dkv_mb`` per token): the gradient of the prefix K/V waiting for the earlier
    slices (dK/dV), and the cached K/V of slices already run backward, which the prefix cache
    frees only with the sequence's first slice."""

    def __init__(self, table: ChunkTable):
        self.table = table
        self.dkv: dict[int, int] = {}  # seq -> prefix tokens whose dK/dV waits
        self.cached: dict[int, int] = {}  # seq -> tokens of backwarded slices still cached
        self.held = 0  # the sum of both (kept as it changes: read at every operation)

    def tokens(self, during: int | None = None) -> int:
        """Held now; ``during``: while that chunk's backward runs (its prefix dK/dV is live)."""
        if during is None or not self.table.split_pieces[during]:
            return self.held
        raised: dict[int, int] = {}  # seq -> its prefix dK/dV while the chunk runs, where that grows
        for sid, a, b in self.table.split_pieces[during]:
            if a > raised.get(sid, self.dkv.get(sid, 0)):
                raised[sid] = a
        return self.held + sum(a - self.dkv.get(sid, 0) for sid, a in raised.items())

    def backward_done(self, k: int) -> None:
        for sid, a, b in self.table.split_pieces[k]:
            self.held -= self.dkv.pop(sid, 0)
            if a == 0:
                self.held -= self.cached.pop(sid, 0)
                continue
            self.dkv[sid] = a
            self.held += a
            if b < self.table.seq_end[sid]:
                self.cached[sid] = self.cached.get(sid, 0) + b - a
                self.held += b - a


def memory_checkpoints(ops: list[tuple[int, int]], table: ChunkTable, full: np.ndarray,
                       pc: PipelineCost, room: float | None = None) -> Moments:
    """The moments that can peak on one stage: after each forward and during each backward;
    with ``room``, only those over it with nothing recomputed (recompute only lowers memory, so
    the others hold whatever it is)."""
    live_sum = 0.0
    live: set[int] = set()
    per_token = float(pc.dkv_mb(1))
    full = full.tolist()
    held = _SliceBuffers(table)
    limit = -math.inf if room is None else room
    end = len(ops)  # (a chunk not backwarded after its forward stays in flight to the end)
    fwd_pos, bwd_pos = [end] * table.n, [end] * table.n
    kinds, chunks, poss, consts, by_fwd = [], [], [], [], []
    for pos, (kind, k) in enumerate(ops):
        if kind == FWD:
            fwd_pos[k] = pos
            by_fwd.append(k)
            live.add(k)
            live_sum += full[k]
            const = live_sum + per_token * held.tokens()
        else:
            const = live_sum + per_token * held.tokens(during=k)
            if k in live:
                bwd_pos[k] = pos
                live.discard(k)
                live_sum -= full[k]
            else:  # backward before forward: the scheduler reports the deadlock
                const += full[k]
            held.backward_done(k)
        if const > limit:
            kinds.append(kind)
            chunks.append(k)
            poss.append(pos)
            consts.append(const)
    return Moments(np.asarray(kinds, dtype=np.int64), np.asarray(chunks, dtype=np.int64),
                   np.asarray(poss, dtype=np.int64), np.asarray(consts, dtype=np.float64),
                   np.asarray(fwd_pos, dtype=np.int64), np.asarray(bwd_pos, dtype=np.int64),
                   np.asarray(by_fwd, dtype=np.int64))


def memory_levels(ops: list[tuple[int, int]], table: ChunkTable, full: np.ndarray, save: np.ndarray,
                  recompute: np.ndarray, pc: PipelineCost) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Memory of one stage (MB per GPU, no model states) around each operation of its order:
    (before, during, after). A forward builds up its chunk's retained activations (full minus
    what recomputed layers drop); during a backward the chunk's activations are all back and a
    split sequence's prefix dK/dV buffer is live; after it, the chunk is freed but for the cached
    K/V of a slice whose sequence's first slice has not run backward yet. The peaks agree
    with ``Moments.memory`` (after each forward, during each backward)."""
    kept = (full - save * recompute).tolist()
    full_l = full.tolist()
    per_token = float(pc.dkv_mb(1))
    live: dict[int, None] = {}
    live_sum = 0.0
    buffers = _SliceBuffers(table)
    m = len(ops)
    before, during, after = np.zeros(m), np.zeros(m), np.zeros(m)
    for pos, (kind, k) in enumerate(ops):
        before[pos] = live_sum + per_token * buffers.tokens()
        if kind == FWD:
            live[k] = None
            live_sum += kept[k]
            during[pos] = after[pos] = live_sum + per_token * buffers.tokens()
            continue
        held = kept[k] if k in live else 0.0
        during[pos] = live_sum - held + full_l[k] + per_token * buffers.tokens(during=k)
        if k in live:
            del live[k]
            live_sum -= held
        buffers.backward_done(k)
        after[pos] = live_sum + per_token * buffers.tokens()
    return before, during, after


# ---- time ------------------------------------------------------------------------------------

def op_times(table: ChunkTable, pc: PipelineCost, recompute: np.ndarray):
    """fwd[P, n], bwd[P, n] (with recompute), rec[P, n] and p2p[n] in ms."""
    fwd = np.stack([pc.fwd_ms(table.work, table.tokens, p) for p in range(pc.pp)]).reshape(pc.pp, table.n)
    rec = pc.recompute_ms(table.work, table.tokens, recompute)  # [P, n]
    bwd = np.stack([pc.bwd_ms(table.work, table.tokens, p) for p in range(pc.pp)]).reshape(pc.pp, table.n) + rec
    return fwd, bwd, rec, pc.p2p_ms(table.tokens)


# ---- order -----------------------------------------------------------------------------------

def backward_order(forward: list[int], table: ChunkTable) -> list[int]:
    """The forward order with every group of chunks linked by split sequences reversed in place:
    slices run backward last first, everything else in forward order."""
    n = table.n
    parent = list(range(n))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for k in range(n):
        for j in table.fwd_pred[k]:
            parent[find(j)] = find(k)
    blocks: dict[int, list[int]] = {}
    for pos, k in enumerate(forward):
        blocks.setdefault(find(k), []).append(pos)
    out = list(forward)
    for positions in blocks.values():
        if len(positions) > 1:
            members = [forward[q] for q in positions]
            for q, k in zip(positions, reversed(members)):
                out[q] = k
    return out


def one_f_one_b(forward: list[int], backward: list[int], stages: int, extra_warmup: int = 0) -> list[list[tuple[int, int]]]:
    """Elastic 1F1B: stage p runs ``P - 1 - p + e`` forwards first, then alternates one forward
    and one backward, then drains. ``e`` (the extra warm-up) is the least that lets every
    backward find its forward done locally: ``max_j (max_{i<=j} pos_F(b_i) - j)``, i.e. the
    number of slices of the first split sequence minus one."""
    n = len(forward)
    pos = {k: i for i, k in enumerate(forward)}
    e, run = 0, -1
    for j, k in enumerate(backward):
        run = max(run, pos[k])
        e = max(e, run - j)
    out = []
    for p in range(stages):
        w = min(n, stages - 1 - p + e + extra_warmup)
        ops = [(FWD, k) for k in forward[:w]]
        f = w
        for j in range(n):
            if f < n:
                ops.append((FWD, forward[f]))
                f += 1
            ops.append((BWD, backward[j]))
        out.append(ops)
    return out


def greedy_orders(forward: list[int], backward: list[int], table: ChunkTable, fwd: np.ndarray, bwd: np.ndarray,
                  p2p: np.ndarray, stages: int, full: list[np.ndarray] | None = None,
                  room: float | None = None,
                  forwards_first: bool = True) -> tuple[list[list[tuple[int, int]]], float, int]:
    """Per-stage orders by list scheduling (an alternative to ``one_f_one_b``): operations are
    placed in time order; a free stage runs whichever of its next backward (in ``backward``
    order) and its next forward (in ``forward`` order) can start first. On a tie, with
    ``forwards_first``, the stages before the last run the forward: the last stage, which also
    runs the output layer, paces the pipeline, and forwards sent ahead keep it fed where uneven
    chunks would leave it waiting (the others have the slack to run their backwards later); the
    last stage runs the backward, which frees its memory and passes the work back. Without it,
    every stage runs the backward, as 1F1B does (auto's steps over the regime map 1.006x those
    with it, geometric mean, and up to 1.07x: gpt-30b on 256 A800s at 96K CommonCrawl ZeRO-3).

    A forward is held back while it would take the stage's in-flight activations
    (``full[p][k]`` per chunk, no recompute) over ``room`` MB, unless the stage's next backward
    needs it; with uneven chunks (slices of long sequences, small warm-up / cool-down chunks) a
    stage fills its waits with forwards instead of idling at a fixed warm-up count. Returns
    (orders, makespan ms, how many times a forward was held back by memory while its stage
    idled). The orders respect every dependency of ``list_schedule``, which reproduces the same
    times from them."""
    P, n = stages, table.n
    fwd = np.broadcast_to(fwd, (P, n)).tolist()
    bwd = np.broadcast_to(bwd, (P, n)).tolist()
    p2p_l = np.asarray(p2p, dtype=np.float64).tolist()
    inf = float("inf")
    fe = [[inf] * n for _ in range(P)]
    be = [[inf] * n for _ in range(P)]
    fdone = [[False] * n for _ in range(P)]
    mem = [m.tolist() for m in full] if full is not None and room is not None else None
    used = [0.0] * P
    fptr, bptr = [0] * P, [0] * P
    free = [0.0] * P
    ops: list[list[tuple[int, int]]] = [[] for _ in range(P)]
    fwd_pred, bwd_pred = table.fwd_pred, table.bwd_pred
    # (the tie-break of a stage's backward; its forward's is the other)
    backward_tie = [int(forwards_first and p < P - 1) for p in range(P)]

    def stage(p):
        """(the op stage p would run next, a forward it holds back for memory): (start, tie, p, kind, k)."""
        cand = held = None
        if bptr[p] < n:
            k = backward[bptr[p]]
            r = fe[p][k]
            if p < P - 1:
                r = max(r, be[p + 1][k] + p2p_l[k])
            for j in bwd_pred[k]:
                r = max(r, be[p][j])
            if r < inf:
                cand = (max(r, free[p]), backward_tie[p], p, BWD, k)
        if fptr[p] < n:
            k = forward[fptr[p]]
            r = fe[p - 1][k] + p2p_l[k] if p > 0 else 0.0
            for j in fwd_pred[k]:
                r = max(r, fe[p][j])
            if r < inf:
                c = (max(r, free[p]), 1 - backward_tie[p], p, FWD, k)
                if (mem is not None and used[p] + mem[p][k] > room
                        and not (bptr[p] < n and not fdone[p][backward[bptr[p]]])):
                    held = c
                elif cand is None or c < cand:
                    cand = c
        return cand, held

    # each stage's candidate and held-back forward sit in two heaps, stale entries (of a stage
    # whose state changed since) skipped when they surface: the next op in O(log P), not O(P)
    version = [0] * P
    runnable: list[tuple] = []
    holding: list[tuple] = []

    def refresh(q: int) -> None:
        version[q] += 1
        c, h = stage(q)
        if c is not None:
            heapq.heappush(runnable, (c, version[q]))
        if h is not None:
            heapq.heappush(holding, (h, version[q]))

    def top(heap: list[tuple]):
        while heap and heap[0][1] != version[heap[0][0][2]]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    for p in range(P):
        refresh(p)
    makespan = 0.0
    holds = 0
    for _ in range(2 * n * P):
        best, blocked = top(runnable), top(holding)
        if blocked is not None and (best is None or blocked[0] < best[0]):
            holds += 1
        if best is None:  # every runnable op is held by memory: run one anyway (recompute will pay)
            best = blocked
        if best is None:
            raise InvalidPlanError("the dependencies of the chunks form a cycle")  # pragma: no cover
        s, _, p, kind, k = best
        if kind == FWD:
            fe[p][k] = e = s + fwd[p][k]
            fptr[p] += 1
            fdone[p][k] = True
            if mem is not None:
                used[p] += mem[p][k]
        else:
            be[p][k] = e = s + bwd[p][k]
            bptr[p] += 1
            if mem is not None:
                used[p] -= mem[p][k]
        free[p] = e
        makespan = max(makespan, e)
        ops[p].append((kind, k))
        refresh(p)
        q = p + 1 if kind == FWD else p - 1  # the neighbour waiting on this op (the next stage's forward
        if 0 <= q < P:                       # on a forward, the previous stage's backward on a backward)
            refresh(q)
    return ops, makespan, holds


def warmup_counts(ops: list[list[tuple[int, int]]]) -> list[int]:
    """Forwards each stage runs before its first backward: the paper's in-flight window
    |W_p| = P - p + e (0-based p; e + 1 = slices of the first split sequence), capped by the
    chunk count. Megatron's "warm-up micro-batches" is one less (its steady state opens with a
    forward)."""
    out = []
    for o in ops:
        w = 0
        for kind, _ in o:
            if kind == BWD:
                break
            w += 1
        out.append(w)
    return out


def order_names(ops: list[list[tuple[int, int]]], ids: list[int]) -> list[list[str]]:
    return [[op_name(kind, ids[k]) for kind, k in o] for o in ops]
