"""Workload-balanced chunking (InfiniPipe Algorithm 1, PAPERS.md section 2).

Given the sequences of one pipeline and a target chunk time ``T_t`` (stage milliseconds):

1. The longest sequence is cut into ``K = ceil(T(s_max) / T_t)`` slices of equal *time*, where the
   time of tokens [a, b) is ``T(b) - T(a)`` with ``T(x) = alpha x^2 + beta x`` (causal attention:
   later slices attend to a longer prefix, so they hold fewer tokens). The cut points (the mesh)
   are rounded to ``granularity`` tokens.
2. Every sequence longer than the first cut point is cut on the same mesh: its full slices are
   *split chunks* (each one slice of one sequence, time ``T(s_max) / K``) and its remainder, the
   *tail* (time below one slice), seeds a bucket.
3. The other (short) sequences, longest first, go best-fit into a bucket: among the buckets whose
   time stays within the slice time and whose tokens stay within ``token_cap``, the fullest by
   time (``fit="best"``) or, as in the paper, the one with the lowest time/tokens ratio
   (``fit="ratio"``); if none has room a new bucket opens. A bucket seeded by a tail is a
   *hybrid chunk*, one of short sequences only a *batched chunk*. Tails only seed buckets, so two
   tails never share a chunk.

When ``T_t`` is at least the longest sequence's time nothing is split and short sequences are
packed up to ``T_t``. The planner (planner/pp/chunk_search.py) searches ``T_t`` (and so K).

``max_slice_tokens`` (when memory binds): no slice holds more tokens than this. The mesh is then
cut greedily from the start: each slice ends at the equal-time point or after
``max_slice_tokens`` tokens, whichever comes first (``capped_mesh``), so the early slices, which
hold the most tokens, are shortened without cutting the rest finer; equal-time slicing would
need about (s_max / max_slice_tokens)^2 slices for the same cap where attention dominates.
"""
from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megatron_ext.cost.pipeline import PipelineCost
from megatron_ext.errors import ConfigError

Pieces = list[tuple[int, int, int]]  # (seq_id, start, end)


@dataclass
class Chunking:
    """Chunks of one pipeline in forward order (longer sequences first), as piece lists."""

    chunks: list[Pieces]
    slices: int  # K: slices of the longest sequence
    slice_ms: float  # time cap of a chunk (stage ms, without the fixed cost)
    token_cap: float
    mesh: np.ndarray  # cut points of the longest sequence, 0 < x_1 < ... < x_{K-1} < s_max


def slice_mesh(s_max: int, slices: int, pc: PipelineCost, granularity: int = 1) -> np.ndarray:
    """Interior cut points of ``slices`` equal-time slices of a sequence of ``s_max`` tokens."""
    if slices <= 1 or s_max <= 1:
        return np.zeros(0, dtype=np.int64)
    total = float(pc.prefix_ms(s_max))
    x = pc.prefix_tokens(total * np.arange(1, slices) / slices)
    g = max(1, int(granularity))
    x = np.round(x / g).astype(np.int64) * g
    x = x[(x > 0) & (x < s_max)]
    return np.unique(x)


def capped_mesh(seq_len: int, step_ms: float, pc: PipelineCost, granularity: int, max_tokens: int) -> np.ndarray:
    """Interior cut points of a sequence of ``seq_len`` tokens: slices of ``step_ms`` of time
    each, except that none holds more than ``max_tokens`` tokens. A step holds fewer tokens the
    later it starts (causal attention), so the cap binds at the start only: slices of exactly
    the cap up to the first point x* whose step holds at most the cap (less one granule, so that
    rounding keeps it), then equal-time steps from x*. Cut points on multiples of
    ``granularity``, at least one multiple apart."""
    g = max(1, int(granularity))
    cap = max(g, int(max_tokens) // g * g)
    n = max(1, -(-int(seq_len) // cap))
    x = np.arange(n, dtype=np.int64) * cap  # candidate starts of capped slices
    reach = pc.prefix_tokens(pc.prefix_ms(x.astype(np.float64)) + step_ms) - x  # tokens of a step from x
    free = np.flatnonzero(reach <= cap - g) if cap > g else np.flatnonzero(reach <= cap)
    i = int(free[0]) if free.size else n
    head = x[1:i + 1] if i < n else x[1:]
    if i >= n:
        return head[head < seq_len]
    x0 = float(x[i])
    t0 = float(pc.prefix_ms(x0))
    m = int(math.ceil((float(pc.prefix_ms(seq_len)) - t0) / max(step_ms, 1e-12))) + 1
    tail = np.round(pc.prefix_tokens(t0 + step_ms * np.arange(1, m + 1)) / g).astype(np.int64) * g
    tail = tail[(tail > x0) & (tail < seq_len)]
    return np.unique(np.concatenate([head[head < seq_len], tail]))


def balanced_chunks(seq_ids, lengths, pc: PipelineCost, target_ms: float, token_cap: float = math.inf,
                    granularity: int = 1, fit: str = "best", min_tail: int = 0,
                    max_slice_tokens: Callable[[int], int | None] | None = None) -> Chunking:
    """Algorithm 1 for one pipeline's sequences at chunk time target ``target_ms``. With
    ``max_slice_tokens`` (a function of a sequence's length giving its slice cap in tokens, None
    for none), every long sequence is cut on its own capped mesh (``capped_mesh``, the same time
    step), so only those that need it are cut finely; ``token_cap`` then caps the buckets only."""
    seq_ids = np.asarray(seq_ids, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if seq_ids.size == 0:
        return Chunking([], 1, 0.0, token_cap, np.zeros(0, dtype=np.int64))
    lens = lengths[seq_ids]
    order = seq_ids[np.lexsort((seq_ids, -lens))]  # longest first, ties by id
    s_max = int(lengths[order[0]])
    t_max = float(pc.prefix_ms(s_max))
    target_ms = max(float(target_ms), 1e-9)
    slices = max(1, math.ceil(t_max / target_ms - 1e-9))
    cap_of = max_slice_tokens
    if cap_of is not None:

        def own_mesh(s: int) -> np.ndarray:  # (the slices' cap is max_slice_tokens, not token_cap)
            c = cap_of(s)
            return capped_mesh(s, t_max / slices, pc, granularity, s if c is None else min(c, s))

        mesh = own_mesh(s_max)
        bounds = np.concatenate([[0], mesh, [s_max]])
        slices = len(mesh) + 1
        cap_ms = float(np.max(np.diff(pc.prefix_ms(bounds)))) if slices > 1 else max(target_ms, t_max)
    else:
        # the largest slice (the first) must respect the token cap too
        while slices < s_max and pc.prefix_tokens(t_max / slices) > token_cap:
            slices += 1
        mesh = slice_mesh(s_max, slices, pc, granularity)
        slices = len(mesh) + 1
        cap_ms = t_max / slices if slices > 1 else max(target_ms, t_max)
    first_cut = int(mesh[0]) if mesh.size else s_max + 1

    split_chunks: list[list[Pieces]] = []  # per long sequence, its full slices
    b_pieces: list[Pieces] = []
    b_time: list[float] = []
    b_tok: list[float] = []
    short: list[int] = []
    for sid in order.tolist():
        s = int(lengths[sid])
        if s <= first_cut:
            short.append(sid)
            continue
        cuts = [int(x) for x in (mesh if cap_of is None or s == s_max else own_mesh(s)) if x < s]
        if min_tail and cuts and s - cuts[-1] < min_tail and (
                cap_of is None or s - (cuts[-2] if len(cuts) > 1 else 0) <= (cap_of(s) or s)):
            cuts.pop()  # a tiny tail joins the previous slice
        bounds = [0] + cuts + [s]
        full = [[(sid, bounds[j], bounds[j + 1])] for j in range(len(bounds) - 2)]
        split_chunks.append(full)
        a = bounds[-2]
        b_pieces.append([(sid, a, s)])
        b_time.append(float(pc.prefix_ms(s) - pc.prefix_ms(a)))
        b_tok.append(float(s - a))

    if short:
        sh = np.asarray(short, dtype=np.int64)
        t_short = pc.prefix_ms(lengths[sh]).tolist()
        eps = 1e-9 * cap_ms
        if fit == "best":
            _best_fit(short, t_short, lengths, cap_ms + eps, token_cap, b_pieces, b_time, b_tok)
        elif fit == "ratio":
            _ratio_fit(short, t_short, lengths, cap_ms + eps, token_cap, b_pieces, b_time, b_tok)
        else:
            raise ConfigError(f"unknown chunk fit {fit!r}; use 'best' or 'ratio'")

    # forward order: each long sequence's slices then its tail bucket (longest first), then the
    # batched chunks, slowest first
    chunks: list[Pieces] = []
    for i, full in enumerate(split_chunks):
        chunks.extend(full)
        chunks.append(b_pieces[i])
    rest = list(range(len(split_chunks), len(b_pieces)))
    rest.sort(key=lambda j: -b_time[j])
    chunks.extend(b_pieces[j] for j in rest)
    return Chunking(chunks, slices, cap_ms, token_cap, mesh)


def chunk_time(chunk: Pieces, pc: PipelineCost) -> float:
    """Stage ms of a chunk's pieces (each at its prefix), without the fixed cost."""
    return float(sum(pc.prefix_ms(b) - pc.prefix_ms(a) for _, a, b in chunk))


def ramp_chunks(chunks: list[Pieces], lengths, pc: PipelineCost, cap_ms: float, front=(), back=(),
                token_cap: float = math.inf) -> list[Pieces]:
    """Warm-up and cool-down ramps: re-pack whole short sequences into a few small chunks at the
    start of the forward order (times ``front[i] * cap_ms``, smallest first) and at its end
    (``back[i] * cap_ms``, largest first).

    A pipeline's first stage waits for the first chunk to cross every stage, and its last
    backwards trickle down the stages one by one: the idle time of a P-stage pipeline is about
    (P - 1) x (forward of the first chunk + backward of the last) plus what uneven chunks add in
    between. Small first and last chunks shrink it for (about) one fixed cost per extra chunk.
    The sequences come from the batched chunks (whole sequences only) at the end of the order,
    the lightest, as many as the ramps need; sequences that fit no ramp chunk go into chunks of
    up to ``cap_ms`` just before the cool-down ramp. Split and hybrid chunks are not touched, so
    the chunking rules (slices in order, never two tails in a chunk) still hold."""
    if not front and not back:
        return chunks
    sids = [s for c in chunks for s, _, _ in c]
    lens = dict(zip(sids, np.asarray(lengths)[sids].tolist()))  # (the chunks' sequences only: a batch may be huge)
    whole = [i for i, c in enumerate(chunks) if all(a == 0 and b == lens[s] for s, a, b in c)]
    if not whole:
        return chunks
    caps = [f * cap_ms for f in front] + [f * cap_ms for f in back]
    need = sum(caps)
    # the whole chunks' times, last first, at once (a prefix_ms call per piece was a quarter of a
    # search's time)
    ends = [b for i in reversed(whole) for _, _, b in chunks[i]]
    times = pc.prefix_ms(np.asarray(ends, dtype=np.float64)).tolist()
    take: list[int] = []
    timed: list[tuple] = []  # (piece, ms) of the chunks taken
    got, at = 0.0, 0
    for i in reversed(whole):
        if got >= need:
            break
        take.append(i)
        for x in chunks[i]:
            timed.append((x, times[at]))
            got += times[at]
            at += 1
    timed.sort(key=lambda xt: (-(xt[0][2] - xt[0][1]), xt[0][0]))
    bins: list[Pieces] = [[] for _ in caps]
    load = [0.0] * len(caps)
    tok = [0.0] * len(caps)
    extra: list[list] = []  # [pieces, time, tokens]
    for x, t in timed:
        s = x[2] - x[1]
        fits = [j for j in range(len(caps)) if load[j] + t <= caps[j] * (1 + 1e-9) and tok[j] + s <= token_cap]
        if fits:
            j = min(fits, key=lambda j: (caps[j] - load[j] - t, j))
            bins[j].append(x)
            load[j] += t
            tok[j] += s
            continue
        fits = [j for j, e in enumerate(extra) if e[1] + t <= cap_ms * (1 + 1e-9) and e[2] + s <= token_cap]
        if fits:
            e = extra[min(fits, key=lambda j: (cap_ms - extra[j][1] - t, j))]
            e[0].append(x)
            e[1] += t
            e[2] += s
        else:
            extra.append([[x], t, s])
    nf = len(front)
    head = [bins[j] for j in sorted((j for j in range(nf) if bins[j]), key=lambda j: load[j])]
    tail = [bins[j] for j in sorted((j for j in range(nf, len(caps)) if bins[j]), key=lambda j: -load[j])]
    taken = set(take)
    middle = [c for i, c in enumerate(chunks) if i not in taken]
    middle += [e[0] for e in sorted(extra, key=lambda e: -e[1])]
    return head + middle + tail


def check_chunking(chunks: list[Pieces], lengths, seq_ids=None) -> None:
    """Assert the chunking invariants (for tests): every token of every sequence exactly once,
    slices of a sequence in forward order, no two tails in one chunk."""
    lengths = np.asarray(lengths)
    spans: dict[int, list[tuple[int, int, int]]] = {}
    for ci, c in enumerate(chunks):
        tails = sum(1 for s, a, b in c if a > 0)
        assert tails <= 1, f"chunk {ci} holds {tails} tails"
        for s, a, b in c:
            spans.setdefault(s, []).append((a, b, ci))
    want = set(range(len(lengths))) if seq_ids is None else set(int(i) for i in seq_ids)
    assert set(spans) == want, "sequences missing or extra"
    for s, sp in spans.items():
        sp.sort()
        pos = 0
        last_chunk = -1
        for a, b, ci in sp:
            assert a == pos and b > a, f"sequence {s}: gap or overlap at {pos}"
            assert ci > last_chunk, f"sequence {s}: slices out of forward order"
            pos, last_chunk = b, ci
        assert pos == lengths[s], f"sequence {s}: ends at {pos} of {lengths[s]}"


def _put(j, sid, s: float, t: float, b_pieces, b_time, b_tok) -> int:
    """Whole sequence ``sid`` (s tokens, t ms) into bucket j, or into a new bucket if j is None."""
    if j is None:
        j = len(b_pieces)
        b_pieces.append([])
        b_time.append(0.0)
        b_tok.append(0.0)
    b_pieces[j].append((int(sid), 0, int(s)))
    b_time[j] += t
    b_tok[j] += s
    return j


def _best_fit(short, t_short, lengths, cap, token_cap, b_pieces, b_time, b_tok) -> None:
    """Each short sequence (longest first) into the fullest (by time) bucket it fits; a new bucket
    otherwise. Buckets without room for the current sequence's tokens wait in a heap by tokens and
    come back as the sequences get shorter: walking past them made a 2,560-token cap's chunking of
    4,096 sequences quadratic (0.14 s, against 0.027 s)."""
    keys: list[tuple[float, int]] = []  # buckets with room for the current sequence's tokens, by time
    full = [(b_tok[j], j) for j in range(len(b_time))]  # the others, fewest tokens first
    heapq.heapify(full)
    for sid, t in zip(short, t_short):
        s = float(lengths[sid])
        while full and full[0][0] + s <= token_cap:
            bisect.insort(keys, (b_time[full[0][1]], heapq.heappop(full)[1]))
        pos = bisect.bisect_right(keys, (cap - t, math.inf)) - 1
        j = _put(keys.pop(pos)[1] if pos >= 0 else None, sid, s, t, b_pieces, b_time, b_tok)
        if b_tok[j] + s <= token_cap:
            bisect.insort(keys, (b_time[j], j))
        else:
            heapq.heappush(full, (b_tok[j], j))


def _ratio_fit(short, t_short, lengths, cap, token_cap, b_pieces, b_time, b_tok) -> None:
    """The paper's rule: among the buckets with room, the one of lowest time/tokens ratio."""
    for sid, t in zip(short, t_short):
        s = float(lengths[sid])
        best, best_r = -1, math.inf
        for j in range(len(b_pieces)):
            if b_time[j] + t <= cap and b_tok[j] + s <= token_cap:
                r = b_time[j] / max(b_tok[j], 1.0)
                if r < best_r:
                    best, best_r = j, r
        _put(best if best >= 0 else None, sid, s, t, b_pieces, b_time, b_tok)


# ---- packed micro-batches (Megatron-style packs, packing.best_fit_bins) cut into Seq1F1B slices ------

PACK_ROUND = 1024  # a packed micro-batch holds its longest sequence rounded up to this many tokens


def pack_round(tokens: int) -> int:
    """The tokens of a pack sized for a sequence of ``tokens`` (``pipeline.pack_capacity``)."""
    return -(-int(tokens) // PACK_ROUND) * PACK_ROUND


def split_pack(pack: list[int], lengths: np.ndarray, pc: PipelineCost, slices: int) -> list[Pieces]:
    """Seq1F1B: cut a packed micro-batch into ``slices`` parts of equal compute (each document
    attends causally to its own earlier tokens)."""
    lens = np.asarray(lengths)[pack].tolist()
    t_doc = pc.prefix_ms(np.asarray(lens, dtype=np.float64)).tolist()
    total = sum(t_doc)
    cuts = []  # positions (doc index, token offset)
    acc, d = 0.0, 0
    for j in range(1, slices):
        target = total * j / slices
        while d < len(lens) - 1 and acc + t_doc[d] < target:
            acc += t_doc[d]
            d += 1
        x = int(round(float(pc.prefix_tokens(max(0.0, target - acc)))))
        x = min(max(x, 0), lens[d])
        cuts.append((d, x))
    bounds = [(0, 0)] + cuts + [(len(lens) - 1, lens[-1])]
    out: list[Pieces] = []
    for (d0, x0), (d1, x1) in zip(bounds, bounds[1:]):
        piece: Pieces = []
        for d in range(d0, d1 + 1):
            a = x0 if d == d0 else 0
            b = x1 if d == d1 else lens[d]
            if b > a:
                piece.append((pack[d], a, b))
        if piece:
            out.append(piece)
    return out

