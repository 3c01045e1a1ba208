"""Variable-length datasets: Megatron indexed files and documents in memory."""
import pickle

import numpy as np
import pytest

from megatron_ext.data.datasets import (DataError, IndexedDocuments, InMemoryDocuments, _megatron_datasets,
                                        document_stats, write_indexed_dataset)


def _random_docs(seed, n=40, vocab=258):
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([rng.integers(1, 50, n - 3), [0, 1, 5000]])  # an empty and a long one
    rng.shuffle(lengths)
    return [rng.integers(0, vocab, int(k)).astype(np.uint16) for k in lengths]


def test_indexed_round_trip(tmp_path):
    docs = _random_docs(0)
    prefix = write_indexed_dataset(tmp_path / "sub" / "ds", docs)
    ds = IndexedDocuments(prefix)
    assert len(ds) == len(docs)
    np.testing.assert_array_equal(ds.lengths, [d.size for d in docs])
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds.get(i), d)
        np.testing.assert_array_equal(ds[i], d)
    long_doc = int(np.argmax(ds.lengths))
    np.testing.assert_array_equal(ds.get(long_doc, 100, 7), docs[long_doc][100:107])
    assert ds.dtype == np.uint16
    assert not list((tmp_path / "sub").glob("*.tmp*")), "temporary files are cleaned up"
    # Megatron's own reader sees the same thing.
    raw = _megatron_datasets("indexed_dataset").IndexedDataset(prefix)
    np.testing.assert_array_equal(raw.sequence_lengths, ds.lengths)
    # Picklable (reopens from the prefix), as needed to hand it to another process.
    again = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(again.get(3), docs[3])


def test_token_range_reads_the_bin_in_blocks(tmp_path, monkeypatch):
    import megatron_ext.data.datasets as D
    docs = _random_docs(1)
    flat = np.concatenate(docs)
    flat[7], flat[-3] = 0, 60000  # the smallest early, the largest late: in different blocks
    cuts = np.cumsum([d.size for d in docs])[:-1]
    ds = IndexedDocuments(write_indexed_dataset(tmp_path / "ds", np.split(flat, cuts)))
    monkeypatch.setattr(D, "TOKEN_SCAN_BLOCK", 1000)  # several blocks, the last a partial one
    assert ds.token_range() == (0, 60000)


def test_indexed_multi_sequence_documents(tmp_path):
    """A sentence-split Megatron dataset: documents made of several index sequences."""
    mod = _megatron_datasets("indexed_dataset")
    prefix = str(tmp_path / "multi")
    b = mod.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    b.add_document(np.arange(10, dtype=np.uint16), [3, 7])
    b.add_document(np.arange(100, 105, dtype=np.uint16), [5])
    b.add_document(np.arange(200, 206, dtype=np.uint16), [1, 2, 3])
    b.finalize(prefix + ".idx")
    ds = IndexedDocuments(prefix)
    assert ds.num_sequences == 6
    assert ds.lengths.tolist() == [10, 5, 6]
    np.testing.assert_array_equal(ds.get(0), np.arange(10))
    np.testing.assert_array_equal(ds.get(2, 1, 4), np.arange(201, 205))


def test_indexed_errors(tmp_path):
    with pytest.raises(DataError, match="no indexed dataset"):
        IndexedDocuments(tmp_path / "missing")
    prefix = write_indexed_dataset(tmp_path / "ds", [np.arange(5)])
    ds = IndexedDocuments(prefix)
    with pytest.raises(IndexError):
        ds.get(1)
    with pytest.raises(IndexError):
        ds.get(0, 3, 5)
    with pytest.raises(DataError, match="outside the range"):
        write_indexed_dataset(tmp_path / "bad", [np.array([70000])])
    for floats in ([1.7, 2.2, 3.9], [np.nan, 5.0]):  # (written as [1, 2, 3] and [0, 5] before)
        with pytest.raises(DataError, match="document 0 is not a 1-D integer token array"):
            write_indexed_dataset(tmp_path / "floats", [np.array(floats)])
    (tmp_path / "junk.bin").write_bytes(b"x" * 10)
    (tmp_path / "junk.idx").write_bytes(b"not an index")
    with pytest.raises(DataError, match="not a readable"):
        IndexedDocuments(tmp_path / "junk")


def _patched_index(tmp_path, name, edit):
    """A copy of a 3-document dataset whose .idx bytes ``edit`` changed (a bytearray, in place)."""
    prefix = write_indexed_dataset(tmp_path / "ok", [np.arange(5), np.arange(7), np.arange(3)])
    idx = bytearray((tmp_path / "ok.idx").read_bytes())
    edit(idx)
    (tmp_path / f"{name}.idx").write_bytes(bytes(idx))
    (tmp_path / f"{name}.bin").write_bytes((tmp_path / "ok.bin").read_bytes())
    return str(tmp_path / name), prefix


HEAD = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, counts: then int32 lengths, int64 pointers


@pytest.mark.parametrize("name, edit, match", [
    ("zeroptr", lambda b: b.__setitem__(slice(HEAD + 12 + 8, HEAD + 12 + 16), bytes(8)), "sequence pointers"),
    ("farptr", lambda b: b.__setitem__(slice(HEAD + 12 + 16, HEAD + 12 + 24), (10 ** 9).to_bytes(8, "little")),
     "sequence pointers"),
    ("floats", lambda b: b.__setitem__(17, 7), "not a dataset of token ids .*dtype code is 7"),
    ("nodocs", lambda b: b.__setitem__(slice(26, 34), (1).to_bytes(8, "little")), "lists no documents"),
])
def test_a_corrupted_index_is_refused_in_one_line(tmp_path, name, edit, match):
    bad, good = _patched_index(tmp_path, name, edit)
    IndexedDocuments(good)  # (the copy it was made from reads)
    with pytest.raises(DataError, match=match):
        IndexedDocuments(bad)


def test_a_folder_for_the_bin_is_refused(tmp_path):
    write_indexed_dataset(tmp_path / "ds", [np.arange(5)])
    (tmp_path / "ds.bin").unlink()
    (tmp_path / "ds.bin").mkdir()
    with pytest.raises(DataError, match="ds.bin is not a file"):
        IndexedDocuments(tmp_path / "ds")


def test_in_memory_and_stats():
    docs = InMemoryDocuments([np.arange(5), np.arange(3000)])
    assert docs.lengths.tolist() == [5, 3000]
    np.testing.assert_array_equal(docs.get(1, 10, 3), [10, 11, 12])
    with pytest.raises(DataError):
        InMemoryDocuments([np.zeros((2, 2), dtype=np.int64)])
    s = document_stats([1, 2, 3, 100])
    assert s["documents"] == 4 and s["tokens"] == 106 and s["max"] == 100 and s["median"] == 2.5
