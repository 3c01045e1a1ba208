"""Best-fit decreasing packing by tokens: the fewest-bins heuristic both kinds of planner use
(static Ulysses' and FlexSP's groups, the pipeline baselines' and elastic_pp's packed
micro-batches)."""
from __future__ import annotations

import bisect

import numpy as np

from megatron_ext.errors import InfeasibleError

_BIN_MASK = (1 << 32) - 1  # the bin index in best_fit_bins' keys


def best_fit_bins(ids, lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """The sequences ``ids`` longest first (ties by id), each into the bin it fills tightest (the
    lowest bin on ties), a new bin when none has room; bins of ``capacity`` tokens, in opening
    order."""
    ids = np.asarray(ids, dtype=np.int64)
    order = ids[np.lexsort((ids, -lengths[ids]))]  # longest first, ties by id
    bins: list[list[int]] = []
    # Bins with room, as sorted keys room << 32 | bin: a bisection finds the tightest fit, the
    # lowest bin on ties, in log time (a scan of every bin per sequence is quadratic at 100,000).
    with_room: list[int] = []
    for i, s in zip(order.tolist(), lengths[order].tolist()):
        if s > capacity:
            raise InfeasibleError(f"a sequence of {s} tokens exceeds the group capacity of {capacity} tokens")
        k = bisect.bisect_left(with_room, s << 32)
        if k < len(with_room):
            key = with_room.pop(k)
            b, room = key & _BIN_MASK, (key >> 32) - s
            bins[b].append(i)
        else:
            b, room = len(bins), capacity - s
            bins.append([i])
        if room:
            bisect.insort(with_room, room << 32 | b)
    return bins


__all__ = ["best_fit_bins"]
