"""The stdlib corpus: a real long-tailed dataset built on the fly, deterministically."""
import os

import numpy as np
import pytest

from megatron_ext.data.corpus import corpus_manifest, stdlib_corpus, stdlib_files, stdlib_root
from megatron_ext.data.datasets import DataError, IndexedDocuments
from megatron_ext.data.tokenizer import ByteTokenizer


def test_stdlib_files_are_sorted_and_skip_tests_and_packages():
    files = stdlib_files()
    rel = [p.relative_to(stdlib_root()).as_posix() for p in files]
    assert rel == sorted(rel)
    assert len(files) > 300
    assert not any(part in ("site-packages", "dist-packages", "test", "tests", "__pycache__")
                   for r in rel for part in r.split("/"))
    assert "os.py" in rel and "json/decoder.py" in rel
    assert stdlib_files(max_files=7) == files[:7]


def test_small_corpus_tokens_are_the_file_bytes(tmp_path):
    tok = ByteTokenizer()
    prefix = stdlib_corpus(tmp_path, max_files=12)
    ds = IndexedDocuments(prefix)
    files = stdlib_files(max_files=12)
    assert len(ds) == 12
    for i, p in enumerate(files):
        data = p.read_bytes()
        tokens = ds.get(i)
        assert tokens[-1] == tok.eod
        assert tokens[:-1].astype(np.uint8).tobytes() == data
    m = corpus_manifest(prefix)
    assert m["files"] == [p.relative_to(stdlib_root()).as_posix() for p in files]
    assert m["stats"]["documents"] == 12 and m["stats"]["tokens"] == int(ds.lengths.sum())
    assert m["vocab_size"] == tok.vocab_size and m["eod"] == tok.eod


def test_deterministic_and_cached(tmp_path):
    a = stdlib_corpus(tmp_path / "a", max_files=25)
    b = stdlib_corpus(tmp_path / "b", max_files=25)
    assert os.path.basename(a) == os.path.basename(b)
    for ext in (".bin", ".idx"):
        assert open(a + ext, "rb").read() == open(b + ext, "rb").read()
    mtime = os.stat(a + ".bin").st_mtime_ns
    assert stdlib_corpus(tmp_path / "a", max_files=25) == a
    assert os.stat(a + ".bin").st_mtime_ns == mtime, "a second call reuses the cached files"
    assert stdlib_corpus(tmp_path / "a", max_files=24) != a, "another file set is another dataset"


def test_custom_root_and_content_change(tmp_path):
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "test").mkdir()
    (root / "site-packages").mkdir()
    (root / "b.py").write_text("b = 2\n")
    (root / "a.py").write_text("a = 1\n" * 100)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "test" / "test_x.py").write_text("skipped")
    (root / "site-packages" / "y.py").write_text("skipped")
    (root / "notes.txt").write_text("not python")
    prefix = stdlib_corpus(tmp_path / "cache", root=root)
    assert corpus_manifest(prefix)["files"] == ["a.py", "b.py", "pkg/__init__.py"]
    assert IndexedDocuments(prefix).lengths.tolist() == [601, 7, 1]
    (root / "b.py").write_text("b = 3\n")
    assert stdlib_corpus(tmp_path / "cache", root=root) != prefix
    with pytest.raises(DataError, match="no .py files"):
        stdlib_corpus(tmp_path / "cache", root=tmp_path / "cache")
    with pytest.raises(DataError, match="max_files"):
        stdlib_files(root, max_files=0)


def test_length_distribution_is_long_tailed(tmp_path):
    """Lengths come from file sizes alone, so check the whole library's shape without building it."""
    sizes = np.array([p.stat().st_size + 1 for p in stdlib_files()])
    median, p99, top = np.median(sizes), np.percentile(sizes, 99), sizes.max()
    assert 1_000 < median < 20_000
    assert p99 > 5 * median and top > 100_000
