"""Variable-length datasets: Megatron indexed files, JSONL and text readers."""
import json
import logging
import pickle

import numpy as np
import pytest

from megatron_ext.data.datasets import (DataError, IndexedDocuments, InMemoryDocuments, _megatron_indexed,
                                        document_stats, open_documents, read_jsonl, read_text_files,
                                        split_document, write_indexed_dataset)
from megatron_ext.data.tokenizer import ByteTokenizer


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
    raw = _megatron_indexed().IndexedDataset(prefix)
    np.testing.assert_array_equal(raw.sequence_lengths, ds.lengths)
    # Picklable (reopens from the prefix), as needed to hand it to another process.
    again = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(again.get(3), docs[3])


def test_indexed_multi_sequence_documents(tmp_path):
    """A sentence-split Megatron dataset: documents made of several index sequences."""
    mod = _megatron_indexed()
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
    (tmp_path / "junk.bin").write_bytes(b"x" * 10)
    (tmp_path / "junk.idx").write_bytes(b"not an index")
    with pytest.raises(DataError, match="not a readable"):
        IndexedDocuments(tmp_path / "junk")


def test_jsonl_reader(tmp_path, caplog):
    tok = ByteTokenizer()
    p = tmp_path / "d.jsonl"
    texts = ["hello", "wörld ✓", "x" * 25, "", "last"]
    p.write_text("\n".join(json.dumps({"text": t, "id": k}) for k, t in enumerate(texts)) + "\n\n")
    with caplog.at_level(logging.WARNING, logger="megatron_ext.data.datasets"):
        docs = read_jsonl(p, max_len=12)
    assert docs.stats.empty_skipped == 1
    assert docs.stats.documents_split == 1 and docs.stats.pieces_from_split == 3
    assert "split into 3 pieces" in caplog.text
    assert docs.lengths.tolist() == [6, 11, 12, 12, 2, 5]
    # Pieces concatenated give back every document with its <eod>: nothing lost, nothing padded.
    expected = np.concatenate([tok.encode(t, append_eod=True) for t in texts if t])
    np.testing.assert_array_equal(np.concatenate(list(docs)), expected)
    # Other key.
    q = tmp_path / "c.jsonl"
    q.write_text('{"content": "abc"}\n')
    assert read_jsonl(q, key="content").lengths.tolist() == [4]


@pytest.mark.parametrize("line, message", [
    ('{"text": "ok"', "not valid JSON"),
    ('["text"]', "expected a JSON object"),
    ('{"body": "x"}', "no 'text' key"),
    ('{"text": 3}', "must be a string"),
])
def test_jsonl_malformed_line_names_line(tmp_path, line, message):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "a"}\n\n' + line + '\n{"text": "b"}\n')
    with pytest.raises(DataError, match=rf"bad\.jsonl:3: .*{message}"):
        read_jsonl(p)


def test_jsonl_not_utf8_and_missing(tmp_path):
    p = tmp_path / "bin.jsonl"
    p.write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    with pytest.raises(DataError, match=r"bin\.jsonl:2: not UTF-8"):
        read_jsonl(p)
    with pytest.raises(DataError, match="cannot read"):
        read_jsonl(tmp_path / "nope.jsonl")


def test_text_files(tmp_path):
    tok = ByteTokenizer()
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first doc\n\nsecond doc")
    b.write_text("ünïcode " * 10)
    docs = read_text_files([a, b])
    assert docs.lengths.tolist() == [len("first doc\n\nsecond doc") + 1, len(("ünïcode " * 10).encode()) + 1]
    assert tok.decode(docs.get(1)) == "ünïcode " * 10
    parts = read_text_files([a], separator="\n\n")
    assert [tok.decode(d) for d in parts] == ["first doc", "second doc"]
    split = read_text_files([b], max_len=16, append_eod=False)
    np.testing.assert_array_equal(np.concatenate(list(split)), tok.encode("ünïcode " * 10))
    assert split.lengths.max() == 16
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"line one\nline two \xc3\x28\n")
    with pytest.raises(DataError, match=r"bad\.txt:2: not UTF-8"):
        read_text_files([bad])


def test_split_document_and_max_len_checks(tmp_path):
    t = np.arange(10)
    assert [p.tolist() for p in split_document(t, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert len(split_document(t, 10)) == 1 and len(split_document(t, None)) == 1
    p = tmp_path / "a.txt"
    p.write_text("abc")
    with pytest.raises(DataError, match="max_len"):
        read_text_files([p], max_len=0)


def test_open_documents_dispatch(tmp_path):
    prefix = write_indexed_dataset(tmp_path / "ds", [np.arange(3), np.arange(4)])
    for ref in (prefix, prefix + ".bin", prefix + ".idx"):
        assert isinstance(open_documents(ref), IndexedDocuments)
    (tmp_path / "d.jsonl").write_text('{"text": "hi"}\n')
    assert open_documents(tmp_path / "d.jsonl").lengths.tolist() == [3]
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "b.txt").write_text("bb")
    (tmp_path / "txt" / "a.txt").write_text("a")
    assert open_documents(tmp_path / "txt").lengths.tolist() == [2, 3]  # sorted: a.txt, b.txt
    with pytest.raises(DataError, match="no dataset"):
        open_documents(tmp_path / "nothing")


def test_in_memory_and_stats():
    docs = InMemoryDocuments([np.arange(5), np.arange(3000)])
    assert docs.lengths.tolist() == [5, 3000]
    np.testing.assert_array_equal(docs.get(1, 10, 3), [10, 11, 12])
    with pytest.raises(DataError):
        InMemoryDocuments([np.zeros((2, 2), dtype=np.int64)])
    s = document_stats([1, 2, 3, 100])
    assert s["documents"] == 4 and s["tokens"] == 106 and s["max"] == 100 and s["median"] == 2.5
