"""How long a sequence an elastic pipeline can run, and how finely it must be cut.

A sequence cut into slices runs with all its slices in flight on every stage; its peak is on
the last stage, which also keeps every slice's logits (``sequence_peak_mb``, exactly what the
simulator counts for the sequence alone with every layer recomputed). From it: the finest
slicing the planner tries (``finest_slice``), what a sequence needs alone at the least the
search can make of it (``alone_peak_mb``), the longest sequence a layout can run
(``longest_sequence``), the check with an error that says what to change
(``check_sequences``), the largest slice that lets a sequence fit (``fit_cap``) and the
fewest equal-time slices that do (``fewest_slices``). Pure Python + numpy.
"""
from __future__ import annotations

import numpy as np

from megatron_ext.cost.pipeline import PipelineCost
from megatron_ext.errors import InfeasibleError
from megatron_ext.planner.pp.chunking import pack_round, slice_mesh


def sequence_peak_mb(pc: PipelineCost, bounds) -> float:
    """Peak activation memory (MB per GPU, no model states) of one sequence alone on its worst
    stage, the last (which also keeps the output layer's logits), cut at ``bounds``
    (0 = b_0 < b_1 < ... < b_K = s) with every layer recomputed, as sim/engine counts it: all K
    slices are in flight on every stage; during the backward of slice j (start a_j, t_j tokens,
    end b_j) the stage holds the inputs and cached K/V of slices 1..j-1, slice j re-materialized
    (its prefix K/V: the cache's), the dK/dV of its prefix and the cached K/V of the slices
    already run backward; the logits of slices 1..j. Per layer:
    a_j (input + kv) + t_j (act + kv) + a_K kv (+ b_j head) for j < K (a_j > 0), and
    a_K (input + 2 kv) + t_K act (+ s head) for the last slice. A lower bound of what any
    plan cutting the sequence there needs (its other chunks only add)."""
    b = np.asarray(bounds, dtype=np.float64)
    L = pc.layers_per_stage
    inp, kv, act, head = pc.input_layer_mb * L, pc.kv_layer_mb * L, pc.act_layer_mb * L, float(pc.head_mb)
    s = b[-1]
    if len(b) <= 2:
        return float(s * (act + head))
    a, t, e = b[:-2], np.diff(b)[:-1], b[1:-1]
    a_last = b[-2]
    during = a * (inp + kv) + t * (act + kv) + a_last * kv + e * head
    last = a_last * (inp + 2 * kv) + (s - a_last) * act + s * head
    return float(max(during.max(), last))


MAX_SLICES = 1024  # the finest slicing of a sequence: granularity-token slices, at most this many


def finest_slice(seq_len: int, granularity: int) -> int:
    """Tokens per slice of the finest slicing the planner tries: ``granularity``, or more (a
    multiple of it) to keep a sequence within ``MAX_SLICES`` slices."""
    g = max(1, int(granularity))
    return max(g, -(-(-(-int(seq_len) // MAX_SLICES)) // g) * g)


def even_bounds(seq_len: int, slice_tokens: int) -> np.ndarray:
    """Cut points of ``slice_tokens``-token slices (the last holds the rest)."""
    return np.append(np.arange(0, seq_len, max(1, int(slice_tokens))), seq_len)


def alone_peak_mb(pc: PipelineCost, seq_len: int, granularity: int, recompute: str = "ilp",
                  slices: int | None = None) -> float:
    """What a sequence needs alone on its worst stage at the least its planner can make of it:
    elastic_pp (``slices`` None) cuts it at the finest slicing it tries (``finest_slice``), every
    layer recomputed; a packed baseline runs its pack (up to the sequence rounded up, ``pack_round``,
    counted as one sequence) in ``slices`` equal-compute slices (1: whole). With recompute
    ``none``, whole (cut with nothing recomputed, every slice keeps its activations and the earlier
    ones the prefix cache too, so slicing only adds)."""
    if slices is not None:
        seq_len = pack_round(seq_len)
    if recompute == "none" or slices == 1:
        return sequence_peak_mb(pc, [0, seq_len])
    if slices is not None:
        return sequence_peak_mb(pc, np.concatenate([[0], slice_mesh(seq_len, slices, pc, granularity), [seq_len]]))
    return sequence_peak_mb(pc, even_bounds(seq_len, finest_slice(seq_len, granularity)))


def longest_sequence(pc: PipelineCost, granularity: int = 128, recompute: str = "ilp", slices: int | None = None) -> int:
    """The longest sequence the planner can run on this layout (``alone_peak_mb`` within a stage's
    activation room); 0 if none."""
    room = pc.activation_room_mb

    def fits(s: int) -> bool:
        return alone_peak_mb(pc, s, granularity, recompute, slices) <= room

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi) and hi < 2**40:
        lo, hi = hi, hi * 2
    return _largest(fits, lo, hi)


def _largest(fits, lo: int, hi: int) -> int:
    """The largest x in [lo, hi) with ``fits(x)``, for a monotone ``fits`` true at ``lo``."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _mb(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}"


def what_to_change(pc: PipelineCost, granularity: int, recompute: str = "ilp", slices: int | None = None) -> str:
    """The end of an error about a sequence too long for the layout: the limit, and what to change."""
    longest = longest_sequence(pc, granularity, recompute, slices)
    if slices is not None:  # (a packed baseline: its slices are fixed)
        also = " or a planner that cuts sequences finer (elastic_pp)"
    else:
        also = " or let layers be recomputed (--recompute ilp)" if recompute == "none" else ""
    return (f"sequences up to {longest} tokens fit {pc.pp} stages x SP {pc.sp} in {_mb(pc.budget_mb)} MB"
            + (" with no layer recomputed" if recompute == "none" else "") + f": use a shorter --max-seq-len "
            f"(at most {longest}) or drop the longest sequences, more stages (--pp), a larger SP degree (--sp), "
            f"more memory per GPU (--memory-mb){also}")


def check_sequences(seq_ids: np.ndarray, lengths: np.ndarray, pc: PipelineCost, granularity: int,
                    recompute: str = "ilp", slices: int | None = None) -> None:
    """Refuse a batch whose longest sequences cannot run even alone at the least the planner can
    make of them (``alone_peak_mb``)."""
    room = pc.activation_room_mb
    for sid in seq_ids[np.argsort(-lengths[seq_ids], kind="stable")][:8].tolist():
        s = int(lengths[sid])
        need = alone_peak_mb(pc, s, granularity, recompute, slices)
        if need > room:
            if slices is not None:  # (a packed baseline)
                how = (f"in a pack of up to {pack_round(s)} tokens" + (" whole" if recompute == "none" or slices == 1
                       else f" cut into {slices} equal-compute slices with every layer recomputed"))
            elif recompute == "none":
                how = "whole with no layer recomputed (--recompute none: cut, it would need more)"
            else:
                how = f"even cut into {finest_slice(s, granularity)}-token slices with every layer recomputed"
            where = "its last stage (which also keeps the output layer's logits)" if pc.pp > 1 else "its stage"
            raise InfeasibleError(
                f"sequence {sid} of {s} tokens does not fit a stage {how}: it needs {_mb(need)} MB per GPU on "
                f"{where}, a stage has {_mb(room)} MB of activation room ({_mb(pc.budget_mb)} MB budget - "
                f"{_mb(pc.model_states_mb)} MB model states); " + what_to_change(pc, granularity, recompute, slices))


def fit_cap(seq_len: int, pc: PipelineCost, granularity: int) -> int | None:
    """The most tokens a slice may hold for a sequence of ``seq_len`` tokens to fit alone cut
    into slices of that many tokens (``sequence_peak_mb``; a multiple of ``granularity``, at
    least ``finest_slice``); None when it fits unsliced."""
    room = pc.activation_room_mb
    if sequence_peak_mb(pc, [0, seq_len]) <= room:
        return None
    g = max(1, int(granularity))
    m = _largest(lambda m: sequence_peak_mb(pc, even_bounds(seq_len, m * g)) <= room,  # in multiples of g
                 finest_slice(seq_len, g) // g, max(1, -(-seq_len // g)))
    return m * g


def memory_slices(seq_len: int, pc: PipelineCost, granularity: int) -> int:
    """Slices a sequence of ``seq_len`` tokens is cut into to fit alone: 1 where it fits whole,
    else equal slices of its ``fit_cap``."""
    cap = fit_cap(seq_len, pc, granularity)
    return 1 if cap is None else -(-int(seq_len) // cap)


def fewest_slices(seq_len: int, pc: PipelineCost, granularity: int, min_slice_tokens: int) -> int | None:
    """The fewest equal-time slices (of at least ``min_slice_tokens``, the search's meshes) that
    let a sequence of ``seq_len`` tokens fit alone (``sequence_peak_mb``); None if none does, so
    its mesh must be token-capped."""
    room = pc.activation_room_mb
    g = max(1, int(granularity))
    k_max = max(1, seq_len // max(1, min_slice_tokens))
    return next((k for k in range(1, k_max + 1)
                 if sequence_peak_mb(pc, np.concatenate([[0], slice_mesh(seq_len, k, pc, g), [seq_len]])) <= room),
                None)


__all__ = ["MAX_SLICES", "alone_peak_mb", "check_sequences", "even_bounds", "fewest_slices", "finest_slice", "fit_cap",
           "longest_sequence", "memory_slices", "sequence_peak_mb", "what_to_change"]
