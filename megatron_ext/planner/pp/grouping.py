"""Sharing a step's sequences among side-by-side pipeline replicas (``split_replicas``), the
step time and chunk count of one 1F1B pipeline of equal chunks (``pipeline_estimate``), and
grouping a replica's sequences into consecutive 1F1B pipelines run one after another (InfiniPipe's
DP, PAPERS.md section 2): ``dp[j] = min_i dp[i] + T(i..j)`` over the sequences sorted longest
first, T an analytic estimate of a pipeline (work, per-chunk fixed cost, warm-up/cool-down, the
recompute forced by stage-0 memory). Past ``GROUP_BLOCKS`` sequences the DP runs over that many
contiguous blocks. Pure Python + numpy.
"""
from __future__ import annotations

import heapq
import math

import numpy as np

from megatron_ext.cost.pipeline import FWD_FRACTION, PipelineCost


ROUNDS_FROM = 16  # split_replicas goes in rounds from this many replicas, below one sequence at a time
GROUP_BLOCKS = 512  # the grouping DP runs over at most this many contiguous blocks of sequences


def _group_bounds(order: np.ndarray, lengths: np.ndarray, pc: PipelineCost,
                  max_blocks: int = GROUP_BLOCKS) -> np.ndarray:
    """Where a group may start or end in the sorted sequences ``order``: every position for up to
    ``max_blocks`` sequences; otherwise the edges of at most ``max_blocks`` contiguous blocks, half
    of them of equal count and half of equal work (so the few long sequences, which carry most of
    the work, keep a fine resolution). Always 0 and n."""
    n = len(order)
    if n <= max_blocks:
        return np.arange(n + 1)
    half = max(1, max_blocks // 2)
    by_count = np.round(np.linspace(0, n, half + 1)).astype(np.int64)
    cw = np.cumsum(pc.prefix_ms(lengths[order]))
    by_work = np.searchsorted(cw, cw[-1] * np.arange(1, half) / half, side="right")
    return np.unique(np.concatenate([[0, 1, n], by_count, np.clip(by_work, 0, n)]))


def _group_estimates(order: np.ndarray, lengths: np.ndarray, pc: PipelineCost,
                     bounds: np.ndarray | None = None) -> np.ndarray:
    """est[a, b]: estimated ms of a pipeline of the sorted sequences order[bounds[a]:bounds[b]]
    (inf if a >= b); ``bounds`` defaults to every position (est[i, j] of order[i:j])."""
    n = len(order)
    if bounds is None:
        bounds = np.arange(n + 1)
    m = len(bounds) - 1
    w = pc.prefix_ms(lengths[order])
    cw = np.concatenate([[0.0], np.cumsum(w)])[bounds]
    ct = np.concatenate([[0.0], np.cumsum(lengths[order].astype(np.float64))])[bounds]
    P = pc.pp
    b = pc.fixed_ms
    act_tok = pc.act_layer_mb * pc.layers_per_stage
    save_tok = max(1e-12, (pc.act_layer_mb - pc.input_layer_mb - pc.kv_layer_mb) * pc.layers_per_stage)
    room = pc.activation_room_mb
    # every (start a, end b) at once, a row per start (a loop over 512 starts: 7 ms a replica, the
    # most of planning 32 replicas of 1,024 sequences in a hurry)
    valid = np.arange(m + 1)[None, :] > np.arange(m)[:, None]
    W = cw[None, :] - cw[:m, None]
    W = np.where(valid, W, 1.0)
    tok = ct[None, :] - ct[:m, None]
    s_max = lengths[order[bounds[:m]]].astype(np.float64)[:, None]
    lo = np.minimum(cw[1:] - cw[:m], 1e-9 + pc.prefix_ms(np.minimum(s_max[:, 0], 1024.0)))[:, None]
    tau = np.clip(np.sqrt(b * W / max(1, P - 1)) if P > 1 else W, lo, W)
    nch = np.maximum(1.0, W / tau)
    T = W + nch * b + (P - 1) * (tau + b)
    inflight = act_tok * (s_max + (P - 1) * tok / nch)
    frac = np.maximum(0.0, inflight - room) / np.maximum(1e-9, save_tok * (s_max + (P - 1) * tok / nch))
    est = np.full((m + 1, m + 1), np.inf)
    est[:m] = np.where(valid & (frac <= 1), T + frac * W / 3, np.inf)
    return est


def pipeline_estimate(lengths: np.ndarray, pc: PipelineCost, min_slice_tokens: int = 1024) -> tuple[float, int]:
    """Milliseconds of one 1F1B pipeline of n equal chunks running ``lengths``, at the best n:
    ``W + n b + (P - 1)(W / n + b)`` (W: work per stage, b: fixed cost per chunk), with at least
    the chunks memory needs: stage 0 holds P chunks in flight, either whole (no recompute) or, with
    every layer recomputed (W grows by a forward), one whole and the others' inputs and K/V; at most
    a chunk per sequence or per ``min_slice_tokens`` (sequences are cut into slices: a few
    sequences on many stages still fill the pipeline); one stage also recomputes each sequence's
    share over the room. Ramps, list scheduling and partial recompute beat it by up to ~7%.
    Returns (ms, n). (``pipeline_estimates`` of one part.)"""
    lengths = np.asarray(lengths)
    ms, chunks = pipeline_estimates(lengths, [np.arange(len(lengths))], pc, min_slice_tokens)
    return float(ms[0]), int(chunks[0])


def pipeline_estimates(lengths: np.ndarray, parts: list[np.ndarray], pc: PipelineCost,
                       min_slice_tokens: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """``pipeline_estimate`` of each of ``parts`` (non-empty arrays of indices into ``lengths``),
    all at once: (ms, n) per part (512 replicas of 64 sequences: 4 ms, not 20 ms one by one)."""
    sizes = np.array([len(p) for p in parts], dtype=np.int64)
    lens = np.asarray(lengths, dtype=np.float64)[np.concatenate(parts)]
    own = np.repeat(np.arange(len(parts)), sizes)
    work_each = pc.prefix_ms(lens)
    W = np.bincount(own, weights=work_each, minlength=len(parts))
    tokens = np.bincount(own, weights=lens, minlength=len(parts))
    P, b, L_s, room = pc.pp, pc.fixed_ms, pc.layers_per_stage, pc.activation_room_mb
    whole, kept = pc.act_layer_mb * L_s, (pc.input_layer_mb + pc.kv_layer_mb) * L_s
    most = np.maximum(np.maximum(2, sizes), np.ceil(tokens / min_slice_tokens)).astype(np.int64)
    n = np.arange(1, int(most.max()) + 1, dtype=np.float64)[None, :]
    upto = n <= most[:, None]
    best, chunks = np.full(len(parts), math.inf), most.astype(np.float64)
    for work, chunk_mb in ((W, P * whole), (W * (1 + FWD_FRACTION), (P - 1) * kept + whole)):
        fits = upto & (n * room >= tokens[:, None] * chunk_mb)  # n chunks of tokens / n each
        t = np.where(fits, work[:, None] + n * b + (P - 1) * (work[:, None] / n + b), math.inf)
        at = t.argmin(axis=1)
        low = t[np.arange(len(parts)), at]
        better = low < best
        best, chunks = np.where(better, low, best), np.where(better, n[0, at], chunks)
    none = ~np.isfinite(best)
    if none.any():  # not even one chunk per sequence fits: no memory bound to offer
        t = np.where(upto, W[:, None] + n * b + (P - 1) * (W[:, None] / n + b), math.inf)
        at = t.argmin(axis=1)
        best = np.where(none, t[np.arange(len(parts)), at], best)
        chunks = np.where(none, n[0, at], chunks)
    if P == 1:
        # one stage holds all of a sequence's slices until their backwards (later slices attend to
        # the earlier ones' K/V): the share of a sequence over the room is recomputed, which equal
        # chunks do not see (llama-13b 1 x 8 x 4 at 96K: estimated 67.0 s, planned 72.8 s)
        full = lens * ((pc.act_layer_mb + pc.kv_layer_mb) * L_s + pc.head_mb)
        save = np.maximum(1e-12, lens * (pc.act_layer_mb - pc.input_layer_mb) * L_s)
        share = np.clip((full - room) / save, 0.0, 1.0)
        best = best + np.bincount(own, weights=share * work_each, minlength=len(parts)) * FWD_FRACTION
    # waves: a sequence two of which a stage cannot hold in flight (activations and K/V, nothing
    # recomputed, over half the room; the last stage's logits too) runs through the stages with
    # its k slices one after another, each wave with its own fill and drain: (P - 1) slices' time
    # idle on each stage, plus k fixed costs, at the k that minimizes the two (at most
    # min_slice_tokens a slice). The idle time grows from none at half the room (the other half
    # runs other sequences' chunks beside it) to all of it at the whole room: a cliff at half
    # ranked gpt-7b's 4 x 8 at 48K (its 48K sequences just over half: planned in 0.2 s, 4 slices
    # each, 29.9 s) 14% behind 8 x 4 (32.1 s)
    held = (pc.act_layer_mb + pc.kv_layer_mb) * L_s + pc.head_mb
    wave = (lens * held > room / 2) & (P > 1)
    if wave.any():
        s = lens[wave]
        t = work_each[wave] * np.minimum(1.0, 2 * s * held / room - 1)
        k = np.clip(np.sqrt((P - 1) * t / max(b, 1e-9)), 1, np.maximum(1, s / min_slice_tokens))
        waves = np.bincount(own[wave], weights=(P - 1) * t / k + k * b, minlength=len(parts))
        slices = np.bincount(own[wave], weights=k, minlength=len(parts))
        over = (np.bincount(own[wave], minlength=len(parts)) > 0) & (W + waves > best)
        best = np.where(over, W + waves, best)
        chunks = np.where(over, np.maximum(chunks, np.floor(slices)), chunks)
    return best, chunks.astype(np.int64)


def group_sequences(seq_ids, lengths, pc: PipelineCost, max_groups: int = 3) -> list[np.ndarray]:
    """The grouping DP over sequences sorted longest first (consecutive groups; past
    ``GROUP_BLOCKS`` sequences, over contiguous blocks of them: ``_group_bounds``)."""
    seq_ids = np.asarray(seq_ids, dtype=np.int64)
    order = seq_ids[np.lexsort((seq_ids, -lengths[seq_ids]))]
    n = len(order)
    bounds = _group_bounds(order, lengths, pc)
    est = _group_estimates(order, lengths, pc, bounds)
    m = len(bounds) - 1
    G = max(1, min(max_groups, n))
    dp = np.full((G + 1, m + 1), np.inf)
    arg = np.zeros((G + 1, m + 1), dtype=np.int64)
    dp[0, 0] = 0.0
    for g in range(1, G + 1):
        v = dp[g - 1][:, None] + est  # v[i, j]: groups up to i, then one of i..j
        arg[g] = np.argmin(v, axis=0)
        dp[g] = v[arg[g], np.arange(m + 1)]
        dp[g, 0] = np.inf
    g = int(np.argmin(dp[1:, m])) + 1
    if not np.isfinite(dp[g, m]):  # the estimate sees no feasible grouping: split by tokens
        cuts = np.searchsorted(np.cumsum(lengths[order]), lengths[order].sum() * np.arange(1, G) / G) + 1
        return [x for x in np.split(order, np.unique(np.clip(cuts, 1, n - 1))) if x.size]
    cuts = []
    j = m
    for gg in range(g, 0, -1):
        i = int(arg[gg, j])
        cuts.append((int(bounds[i]), int(bounds[j])))
        j = i
    return [order[i:j] for i, j in reversed(cuts) if j > i]


def split_replicas(seq_ids, lengths, pc: PipelineCost, replicas: int) -> list[np.ndarray]:
    """The sequences over ``replicas`` pipelines that run side by side (data parallelism): longest
    processing time first -- each sequence, by its stage time, longest first, goes to the replica
    with the least work so far (ties: the lowest index). Each replica's ids in ascending order; a
    replica may get none.

    Exact, and in rounds from ``ROUNDS_FROM`` replicas: the next sequences go to the least loaded
    replicas, one each in order, as long as every replica given one in the round then holds more
    than the next one's load (so each is the least loaded in turn); rounds are nearly always whole
    (32,768 GitHub sequences on 128 replicas: 257 rounds, 5 ms, against 20 ms one sequence at a
    time). A round gives out at most one sequence a replica: with fewer replicas, a heap of their
    loads, one sequence at a time (2 replicas: 10 ms against 80 ms in rounds)."""
    seq_ids = np.asarray(seq_ids, dtype=np.int64)
    if replicas <= 1:
        return [seq_ids]
    tokens = np.asarray(lengths)[seq_ids].astype(np.int64)
    # by stage time, which grows with the tokens: longest first, ties by id, as one integer key
    # (a quarter of the time of sorting by time and id): the tokens above the ids' bits (a length
    # is at most 2^40 tokens, a batch at most 2^20 sequences)
    shift = max(1, int(seq_ids.max()).bit_length())
    order = np.argsort((-tokens << shift) | seq_ids)
    w = pc.prefix_ms(tokens[order])
    owner = np.empty(len(seq_ids), dtype=np.int64)
    if replicas < ROUNDS_FROM:
        heap = [(0.0, r) for r in range(replicas)]  # (load, replica): ties to the lowest index
        to = [0] * len(w)
        for at, x in zip(order.tolist(), w.tolist()):
            load, r = heap[0]
            to[at] = r
            heapq.heapreplace(heap, (load + x, r))
        owner[:] = to
    else:
        loads = np.zeros(replicas)
        i = 0
        while i < len(w):
            least = np.argsort(loads, kind="stable")[:len(w) - i]  # by load, ties by index
            now = loads[least]
            then = now + w[i:i + len(least)]
            # the k-th goes to least[k] while every replica given one before holds more than its load
            late = np.flatnonzero(np.minimum.accumulate(then)[:-1] <= now[1:])
            k = int(late[0]) + 1 if late.size else len(least)
            owner[order[i:i + k]] = least[:k]
            loads[least[:k]] = then[:k]
            i += k
    by_owner = np.argsort((owner << shift) | seq_ids)  # (not a mask per replica: 4,096 x 32,768 compares)
    return np.split(seq_ids[by_owner], np.cumsum(np.bincount(owner, minlength=replicas))[:-1])


__all__ = ["GROUP_BLOCKS", "group_sequences", "pipeline_estimate", "pipeline_estimates", "split_replicas"]
