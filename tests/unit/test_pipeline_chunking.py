"""Workload-balanced chunking (InfiniPipe Algorithm 1): coverage, slice order, the tail rule."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ext.cost import CostModel
from megatron_ext.cost.pipeline import PipelineCost
from megatron_ext.planner.pp.chunking import (_best_fit, _put, balanced_chunks, check_chunking, chunk_time, ramp_chunks,
                                              slice_mesh)

COST = CostModel.from_presets("llama-13b", "a800-80g-8x4")
PC = PipelineCost(COST, 4, 8)

lengths_st = st.lists(st.one_of(st.integers(1, 4096), st.integers(4096, 98_304)), min_size=1, max_size=40)


def _time(a, b):
    return float(PC.prefix_ms(b) - PC.prefix_ms(a))


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, k=st.integers(1, 24), cap=st.sampled_from([math.inf, 8192.0, 30000.0]),
       fit=st.sampled_from(["best", "ratio"]), gran=st.sampled_from([1, 128]), scale=st.sampled_from([0.3, 1.0, 4.0]))
def test_chunking_invariants(lengths, k, cap, fit, gran, scale):
    lengths = np.array(lengths)
    s_max = int(lengths.max())
    target = _time(0, s_max) / k * (scale if k == 1 else 1.0)
    ch = balanced_chunks(np.arange(len(lengths)), lengths, PC, target, cap, gran, fit, min_tail=gran)
    check_chunking(ch.chunks, lengths)  # every token once, slices in forward order, <= 1 tail per chunk
    for c in ch.chunks:
        mid = [(s, a, b) for s, a, b in c if a > 0 or b < lengths[s]]
        # a slice that is not a sequence's last piece is a split chunk on its own
        for s, a, b in mid:
            if b < lengths[s]:
                assert len(c) == 1
        if len(c) > 1:
            assert sum(b - a for _, a, b in c) <= cap
            assert sum(_time(a, b) for _, a, b in c) <= ch.slice_ms * (1 + 1e-9)


@settings(max_examples=80, deadline=None)
@given(s_max=st.integers(2048, 200_000), k=st.integers(2, 16))
def test_slices_have_equal_time(s_max, k):
    mesh = slice_mesh(s_max, k, PC, 1)
    bounds = [0, *mesh.tolist(), s_max]
    times = [_time(a, b) for a, b in zip(bounds, bounds[1:])]
    assert len(times) == k
    # one token of rounding at most per boundary
    tol = 2 * float(PC.prefix_ms(s_max) - PC.prefix_ms(s_max - 1))
    assert max(times) - min(times) <= tol
    # later slices are shorter in tokens (they attend to a longer prefix)
    sizes = np.diff(bounds)
    assert (np.diff(sizes) <= 1).all()


def test_long_sequences_share_the_mesh_and_tails_seed_hybrid_chunks():
    lengths = np.array([65536, 40000, 30000, 3000, 2000, 1000, 500, 500, 200])
    ch = balanced_chunks(np.arange(len(lengths)), lengths, PC, _time(0, 65536) / 4, math.inf, 1)
    check_chunking(ch.chunks, lengths)
    assert ch.slices == 4
    mesh = set(ch.mesh.tolist())
    cut_points = {a for c in ch.chunks for s, a, b in c if a > 0}
    assert cut_points <= mesh  # every long sequence is cut on the longest one's mesh
    hybrid = [c for c in ch.chunks if any(a > 0 for _, a, _ in c) and len(c) > 1]
    assert hybrid, "short sequences fill the tails' buckets"
    # the longest sequence's slices come first, in order
    assert [c[0][:2] for c in ch.chunks[:4]] == [(0, 0)] + [(0, int(x)) for x in sorted(mesh)]


def test_no_split_when_the_target_exceeds_the_longest():
    lengths = np.array([5000, 4000, 3000, 100, 100])
    ch = balanced_chunks(np.arange(5), lengths, PC, 10 * _time(0, 5000))
    assert ch.slices == 1
    assert all(a == 0 and b == lengths[s] for c in ch.chunks for s, a, b in c)
    assert len(ch.chunks) == 1


@settings(max_examples=100, deadline=None)
@given(lengths=lengths_st, k=st.integers(1, 8), front=st.sampled_from([(), (0.5,), (0.33, 0.67)]),
       back=st.sampled_from([(), (0.6,), (0.9, 0.7, 0.5, 0.3)]), cap=st.sampled_from([math.inf, 8192.0]))
def test_ramps_keep_the_chunking_rules(lengths, k, front, back, cap):
    lengths = np.array(lengths)
    ch = balanced_chunks(np.arange(len(lengths)), lengths, PC, _time(0, int(lengths.max())) / k, cap, 128,
                         min_tail=128)
    out = ramp_chunks(ch.chunks, lengths, PC, ch.slice_ms, front, back, token_cap=cap)
    check_chunking(out, lengths)
    # split and hybrid chunks are untouched and keep their order
    touched = [c for c in ch.chunks if any(a > 0 or b < lengths[s] for s, a, b in c)]
    assert [c for c in out if any(a > 0 or b < lengths[s] for s, a, b in c)] == touched
    for c in out:  # no chunk over the time or token cap
        if len(c) > 1:
            assert chunk_time(c, PC) <= ch.slice_ms * (1 + 1e-9)
            assert sum(b - a for _, a, b in c) <= cap


def test_ramps_put_small_chunks_first_and_last():
    lengths = np.array([40000] + [600] * 400)
    ch = balanced_chunks(np.arange(len(lengths)), lengths, PC, _time(0, 40000) / 2, math.inf, 128)
    out = ramp_chunks(ch.chunks, lengths, PC, ch.slice_ms, (0.25, 0.5), (0.8, 0.6, 0.4))
    check_chunking(out, lengths)
    t = [chunk_time(c, PC) / ch.slice_ms for c in out]
    assert len(out) > len(ch.chunks)  # small chunks replace a few full ones
    assert t[0] < t[1] < 0.6 and t[0] <= 0.26  # warm-up: the smallest chunk first
    assert t[-1] < t[-2] < t[-3] < 0.85 and t[-1] <= 0.41  # cool-down: shrinking
    assert ramp_chunks(ch.chunks, lengths, PC, ch.slice_ms) is ch.chunks  # no ramp, nothing changes


def _best_fit_by_definition(short, t_short, lengths, cap, token_cap, b_pieces, b_time, b_tok) -> None:
    for sid, t in zip(short, t_short):
        s = float(lengths[sid])
        fits = [(b_time[j], j) for j in range(len(b_time)) if b_time[j] <= cap - t and b_tok[j] + s <= token_cap]
        _put(max(fits)[1] if fits else None, sid, s, t, b_pieces, b_time, b_tok)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.one_of(st.integers(1, 5000), st.sampled_from([100, 200, 400])), min_size=1, max_size=200),
       cap=st.floats(50, 3000), token_cap=st.sampled_from([math.inf, 600.0, 5000.0, 20000.0]),
       tails=st.lists(st.tuples(st.floats(0, 3000), st.integers(0, 3000)), max_size=4))
def test_best_fit_puts_each_sequence_in_the_fullest_bucket_it_fits(lengths, cap, token_cap, tails):
    """``_best_fit``'s heap of buckets without room makes the choice of its definition: the fullest
    (by time, then index) bucket with room for the sequence's time and tokens, else a new one."""
    lengths = np.array(lengths)
    short = np.argsort(-lengths, kind="stable").tolist()
    t_short = [float(x) ** 1.3 / 100 for x in lengths[short]]
    got, want = [], []
    for fill, out in ((_best_fit, got), (_best_fit_by_definition, want)):
        b_pieces = [[(-1, 0, 1)] for _ in tails]
        b_time, b_tok = [float(t) for t, _ in tails], [float(k) for _, k in tails]
        fill(short, t_short, lengths, cap, token_cap, b_pieces, b_time, b_tok)
        out.extend([b_pieces, b_time, b_tok])
    assert got == want
