"""The sequence blaster: micro-batch counts, balanced contiguous splits, DP bucketing.

Sorting a batch by length and cutting it into contiguous token-balanced parts puts sequences of
similar length (similar time per token) in the same micro-batch, so each micro-batch can be
balanced over the GPUs without one kind of sequence idling while memory-bound.
"""
from __future__ import annotations

import numpy as np


def balanced_split(order: np.ndarray, lengths: np.ndarray, parts: int) -> list[np.ndarray]:
    """Cut ``order`` (ids sorted by length) into ``parts`` contiguous pieces of near-equal tokens.

    Minimizes the largest piece exactly (binary search on the bound with a greedy check), then
    spreads the slack so later pieces are not left nearly empty.
    """
    tokens = lengths[order].astype(np.int64)
    parts = max(1, min(parts, len(order)))
    prefix = np.concatenate([[0], np.cumsum(tokens)])
    lo, hi = int(tokens.max()), int(prefix[-1])
    while lo < hi:  # smallest bound B such that a greedy split into <= parts pieces fits
        mid = (lo + hi) // 2
        if _greedy_pieces(prefix, mid) <= parts:
            hi = mid
        else:
            lo = mid + 1
    bound = lo
    cuts = [0]
    for p in range(parts - 1, 0, -1):
        # Aim for an even share of what is left, but never over the bound nor leaving
        # more than the bound for each remaining piece.
        start = cuts[-1]
        target = prefix[start] + (prefix[-1] - prefix[start]) / (p + 1)
        c = int(np.searchsorted(prefix, target, side="left"))
        c = max(c, start + 1, int(np.searchsorted(prefix, prefix[-1] - p * bound, side="left")))
        c = min(c, int(np.searchsorted(prefix, prefix[start] + bound, side="right")) - 1, len(order) - p)
        cuts.append(max(c, start + 1))
    cuts.append(len(order))
    return [order[a:b] for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def _greedy_pieces(prefix: np.ndarray, bound: int) -> int:
    pieces, start, n = 0, 0, len(prefix) - 1
    while start < n:
        start = int(np.searchsorted(prefix, prefix[start] + bound, side="right")) - 1
        pieces += 1
    return pieces


def dp_buckets(sorted_lengths: np.ndarray, num_buckets: int, max_atoms: int = 256) -> np.ndarray:
    """Bucket ends (exclusive indices) of ascending ``sorted_lengths`` minimizing the padding
    error sum_i (max of i's bucket - s_i) (FlexSP Eq. 15-16).

    The DP runs over at most ``max_atoms`` runs of equal (or, for big batches, geometrically
    close) lengths, so its cost does not grow with the batch.
    """
    s = np.asarray(sorted_lengths, dtype=np.float64)
    n = len(s)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    # Atoms: runs of sequences treated as one unit (their ends index into s).
    ends = np.flatnonzero(np.diff(s)) + 1
    ends = np.append(ends, n)
    if len(ends) > max_atoms:
        logs = np.log(s)
        grid = np.linspace(logs[0], logs[-1] + 1e-9, max_atoms + 1)[1:]
        ends = np.unique(np.searchsorted(logs, grid, side="right"))
        ends = ends[ends > 0]
        if ends[-1] != n:
            ends = np.append(ends, n)
    a = len(ends)
    q = min(num_buckets, a)
    prefix = np.concatenate([[0.0], np.cumsum(s)])
    top = s[ends - 1]  # max length up to each atom end
    starts = np.concatenate([[0], ends[:-1]])
    # pad[j, k]: padding of one bucket spanning atoms j..k = (count) * top[k] - (sum)
    count = ends[None, :] - starts[:, None]
    total = prefix[ends][None, :] - prefix[starts][:, None]
    pad = np.where(count > 0, count * top[None, :] - total, np.inf)
    err = pad[0].copy()  # err[k]: least padding of atoms 0..k in the buckets used so far
    back = np.full((q, a), -1, dtype=np.int64)  # back[b, k]: atom ending bucket b-1, or -1: unused
    for b in range(1, q):
        cand = err[:-1, None] + pad[1:, :]  # cand[j, k]: buckets up to atom j, then atoms j+1..k
        best = np.argmin(cand, axis=0)
        new = cand[best, np.arange(a)]
        better = new < err
        back[b] = np.where(better, best, -1)
        err = np.where(better, new, err)
    cuts, k = [], a - 1
    for b in range(q - 1, -1, -1):
        if b > 0 and back[b, k] < 0:
            continue
        cuts.append(int(ends[k]))
        if b == 0:
            break
        k = int(back[b, k])
    return np.array(cuts[::-1], dtype=np.int64)
