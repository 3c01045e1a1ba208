"""Global batches from document lengths: samples, epochs, and weighted blends of sources."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import megatron_ext.data.lengths as lengths_mod
from megatron_ext.data.batches import GlobalBatches, make_samples
from megatron_ext.data.datasets import ConcatDocuments, DataError, InMemoryDocuments, parse_blend


def test_make_samples_splits_long_documents():
    s = make_samples([5, 0, 12, 4, 1, 6], 4)  # (a 1-token document and last piece: nothing to predict)
    assert s.tolist() == [[0, 0, 4], [2, 0, 4], [2, 4, 8], [2, 8, 12], [3, 0, 4], [5, 0, 4], [5, 4, 6]]
    with pytest.raises(DataError):
        make_samples([3], 0)


def test_samples_are_cut_block_by_block_in_the_smallest_dtype(monkeypatch):
    """The samples every rank holds: int32 where every value fits, int64 past it; cut a block of
    documents at a time, the same rows whatever the block; epochs are Generator.permutation's."""
    docs = np.random.default_rng(1).integers(0, 40, 101)
    want = [[d, a, min(a + 16, n)] for d, n in enumerate(docs.tolist()) for a in range(0, n, 16)
            if min(a + 16, n) - a >= 2]
    whole = make_samples(docs, 16)
    assert whole.dtype == np.int32 and whole.tolist() == want
    monkeypatch.setattr(lengths_mod, "CUT_BLOCK", 7)
    assert make_samples(docs, 16).tolist() == want
    huge = make_samples([3, 2**31 + 5], 2**31)
    assert huge.dtype == np.int64 and huge.tolist() == [[0, 0, 3], [1, 0, 2**31], [1, 2**31, 2**31 + 5]]
    # the sample ids index the rows too: more samples than int32 holds is int64, whatever the documents
    monkeypatch.setattr(lengths_mod, "INT32_END", 12)
    assert make_samples([10, 10, 10], 2).dtype == np.int64 and make_samples([10, 10], 5).dtype == np.int32
    monkeypatch.undo()
    # pieces of 1 token predict nothing: none is kept (every counted row is written)
    assert make_samples([5, 3], 1).shape == (0, 3) and make_samples([5, 3, 1, 0, 2], 2).tolist() == [
        [0, 0, 2], [0, 2, 4], [1, 0, 2], [4, 0, 2]]
    gb = GlobalBatches(docs, 5, 16, seed=3)
    epoch1 = np.random.default_rng([3, 1]).permutation(len(want))
    assert gb.batch_sample_ids(gb.steps_per_epoch + 2).tolist() == epoch1[10:15].tolist()
    assert gb.batch_samples(0).dtype == np.int64


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=2, max_size=4),
       raw=st.lists(st.integers(0, 9), min_size=4, max_size=4),
       batch=st.integers(1, 12), seed=st.integers(0, 2**31))
def test_blend_shares_every_batch_by_weight(sizes, raw, batch, seed):
    weights = raw[:len(sizes)]
    if not any(weights):
        weights[0] = 1
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 300, sum(sizes))  # (every document a sample)
    w = np.asarray(weights, float) / sum(weights)
    if any(np.ceil(w * batch - 1e-9) > sizes):  # a source smaller than its share of a batch
        with pytest.raises(DataError, match="fewer than its share of one global batch"):
            GlobalBatches(lengths, batch, 1000, seed, source_sizes=sizes, weights=weights)
        return
    gb = GlobalBatches(lengths, batch, 1000, seed, source_sizes=sizes, weights=weights)
    owner = np.repeat(np.arange(len(sizes)), sizes)
    steps = 3 * max(sizes) // batch + 3  # several epochs of the smaller sources
    drawn = [gb.batch_sample_ids(k) for k in range(steps)]
    count = np.zeros(len(sizes))
    streams = [[] for _ in sizes]
    for k, ids in enumerate(drawn):
        assert len(ids) == batch
        for i in ids:
            streams[owner[gb.samples[i, 0]]].append(int(i))
        before = count.copy()
        count += np.bincount(owner[gb.samples[ids, 0]], minlength=len(sizes))
        crosses = np.any((before // sizes != (count - 1) // sizes) & (count > before))
        assert crosses or len(set(ids.tolist())) == batch, "a sample twice only where a source starts an epoch"
        bound = math.ceil(math.log2(len(sizes))) / 2 + 1e-6  # half a sample per halving of the sources
        assert np.all(np.abs(count - w * (k + 1) * batch) <= bound), (count, w * (k + 1) * batch)
    for i, stream in enumerate(streams):
        assert weights[i] or not stream, "a source of weight 0 is never drawn"
        n = sizes[i]
        for e in range(len(stream) // n):  # each full epoch of a source holds each of its samples once
            assert sorted(stream[e * n:(e + 1) * n]) == sorted(np.flatnonzero(owner[gb.samples[:, 0]] == i).tolist())
    # Deterministic, and a resumed run (a fresh object asked for a late step first) agrees.
    again = GlobalBatches(lengths, batch, 1000, seed, source_sizes=sizes, weights=weights)
    np.testing.assert_array_equal(again.batch_sample_ids(steps - 1), drawn[-1])


def test_blend_steps_far_ahead_and_huge_weights():
    lengths = np.arange(1, 101)
    gb = GlobalBatches(lengths, 10, 1000, 7, source_sizes=[30, 70], weights=[5e307, 1.5e308])  # their sum overflows
    assert np.allclose(gb.weights, [0.25, 0.75])
    far = 10**9  # any step at once (a resumed run), without walking the steps before it
    ids = gb.batch_sample_ids(far)
    assert len(ids) == 10 and np.count_nonzero(gb.samples[ids, 0] < 30) in (2, 3)
    np.testing.assert_array_equal(GlobalBatches(lengths, 10, 1000, 7, source_sizes=[30, 70],
                                                weights=[1, 3]).batch_sample_ids(far), ids)


def test_one_source_and_unweighted_blends_are_plain_batches():
    lengths = np.arange(2, 42)
    plain = GlobalBatches(lengths, 8, 100, 3)
    for sizes, weights in (([40], [0.7]), ([10, 30], None)):
        other = GlobalBatches(lengths, 8, 100, 3, source_sizes=sizes, weights=weights)
        assert other.steps_per_epoch == plain.steps_per_epoch == 5
        for k in range(7):
            np.testing.assert_array_equal(other.batch_sample_ids(k), plain.batch_sample_ids(k))


def test_blend_errors():
    with pytest.raises(DataError, match="document count of each"):
        GlobalBatches(np.arange(1, 11), 4, 100, source_sizes=[10], weights=[1, 1])
    with pytest.raises(DataError, match="sources hold 9 documents"):
        GlobalBatches(np.arange(1, 11), 4, 100, source_sizes=[4, 5], weights=[1, 1])
    with pytest.raises(DataError, match="source 1 of the blend has 2 samples"):
        GlobalBatches(np.arange(1, 11), 8, 100, source_sizes=[8, 2], weights=[1, 1])
    with pytest.raises(DataError, match="non-negative"):
        GlobalBatches(np.arange(1, 11), 4, 100, source_sizes=[5, 5], weights=[1, float("nan")])
    with pytest.raises(DataError, match="--seed must be from 0 to 2\\^63 - 1"):
        GlobalBatches(np.arange(1, 11), 4, 100, seed=-1)


def test_parse_blend():
    assert parse_blend(["a"]) == [(None, "a")]
    assert parse_blend(["a.bin", "b.idx"]) == [(None, "a"), (None, "b")]
    assert parse_blend(["0.3", "a", "0.7", "b"]) == [(0.3, "a"), (0.7, "b")]
    for bad, match in ((["1", "a", "2"], "odd count"), ([], "no dataset"), (["1", "2"], "the number '2'"),
                       (["inf", "a", "1", "b"], "non-negative"),
                       (["x", "a", "1", "b"], "'x' is not a weight"),  # (it blamed the number '1')
                       (["1", "a", "x", "b"], "'x' is not a weight"), (["a", "b", "2024"], "the number '2024'"),
                       (["a", "1"], "the number '1'")):
        with pytest.raises(DataError, match=match):
            parse_blend(bad)


def test_concat_documents():
    a = InMemoryDocuments([np.arange(3), np.arange(5)])
    b = InMemoryDocuments([np.arange(10, 14)])
    docs = ConcatDocuments([a, b])
    assert len(docs) == 3 and docs.lengths.tolist() == [3, 5, 4] and docs.sizes == [2, 1]
    np.testing.assert_array_equal(docs.get(2, 1, 2), [11, 12])
    np.testing.assert_array_equal(docs.get(1), np.arange(5))
    with pytest.raises(IndexError):
        docs.get(3)


def test_steps_past_the_exact_count_are_refused():
    from megatron_ext.data.batches import MAX_STEP

    gb = GlobalBatches(np.full(40, 5), 8, 100, 3, source_sizes=[20, 20], weights=[1, 3])
    assert len(gb.batch_sample_ids(MAX_STEP)) == 8
    for step in (-1, MAX_STEP + 1):
        with pytest.raises(DataError, match="not a step of a run"):
            gb.batch_sample_ids(step)
