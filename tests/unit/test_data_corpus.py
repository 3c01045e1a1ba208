"""The stdlib corpus: a real long-tailed dataset built on the fly, deterministically."""
import json
import os

import numpy as np
import pytest

from megatron_ext.data.corpus import (corpus_manifest, stdlib_corpus, stdlib_files, stdlib_root,
                                      corpus_tokenizer)
from megatron_ext.data.datasets import DataError, IndexedDocuments
from megatron_ext.data.tokenizer import BPETokenizer, ByteTokenizer


def test_stdlib_files_are_sorted_and_skip_tests_and_packages():
    files = stdlib_files()
    rel = [p.relative_to(stdlib_root()).as_posix() for p in files]
    assert rel == sorted(rel)
    assert len(files) > 300
    assert not any(part in ("site-packages", "dist-packages", "test", "tests", "__pycache__")
                   for r in rel for part in r.split("/"))
    assert "os.py" in rel and "json/decoder.py" in rel
    assert stdlib_files(max_files=7) == files[:7]


def test_small_byte_corpus_tokens_are_the_file_bytes(tmp_path):
    tok = ByteTokenizer()
    prefix = stdlib_corpus(tmp_path, max_files=12, tokenizer="byte")
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
    assert m["tokenizer"] == "byte" and m["vocab_size"] == tok.vocab_size and m["eod"] == tok.eod
    assert not os.path.exists(prefix + ".tokenizer.json")
    got = corpus_tokenizer(prefix)
    assert isinstance(got, ByteTokenizer) and (got.vocab_size, got.eod, got.pad) == (258, 256, 257)


def test_small_bpe_corpus_decodes_to_the_files(tmp_path):
    prefix = stdlib_corpus(tmp_path, max_files=20, vocab_size=512)
    assert os.path.basename(prefix).startswith("stdlib-py") and "-20files-bpe512-" in prefix
    tok = corpus_tokenizer(prefix)
    assert isinstance(tok, BPETokenizer) and tok.vocab_size == 512 and (tok.eod, tok.pad) == (0, 1)
    assert corpus_tokenizer(prefix + ".bin").fingerprint == tok.fingerprint
    ds = IndexedDocuments(prefix)
    assert ds.dtype == np.uint16 and len(ds) == 20
    files = stdlib_files(max_files=20)
    for i, p in enumerate(files):
        tokens = ds.get(i)
        assert tokens[-1] == tok.eod and tok.eod not in tokens[:-1] and tok.pad not in tokens
        assert int(tokens.max()) < tok.vocab_size
        assert tok.decode(tokens) == p.read_text(encoding="utf-8")
    m = corpus_manifest(prefix)
    assert m["tokenizer"] == "bpe" and m["tokenizer_file"] == os.path.basename(prefix) + ".tokenizer.json"
    assert (m["vocab_size"], m["eod"], m["pad"], m["requested_vocab_size"]) == (512, 0, 1, 512)
    assert m["tokenizer_sha256"] == tok.fingerprint and m["non_utf8_files"] == []
    assert m["stats"]["documents"] == 20 and m["stats"]["tokens"] == int(ds.lengths.sum())
    assert m["stats"]["p10"] <= m["stats"]["median"] <= m["stats"]["p90"]
    # The tokenizer is the one trained on exactly these files.
    assert BPETokenizer.train(files, vocab_size=512).fingerprint == tok.fingerprint


def test_default_is_bpe_2048(tmp_path):
    prefix = stdlib_corpus(tmp_path, max_files=25)
    assert "-25files-bpe2048-" in os.path.basename(prefix)
    m = corpus_manifest(prefix)
    assert m["tokenizer"] == "bpe" and m["requested_vocab_size"] == 2048
    assert corpus_tokenizer(prefix).vocab_size == m["vocab_size"] <= 2048


def test_bpe_documents_are_shorter_than_bytes(tmp_path):
    bpe = IndexedDocuments(stdlib_corpus(tmp_path, max_files=25, vocab_size=1024)).lengths
    byte = IndexedDocuments(stdlib_corpus(tmp_path, max_files=25, tokenizer="byte")).lengths
    assert bpe.shape == byte.shape
    assert (bpe <= byte).all()
    assert (bpe[byte > 100] < byte[byte > 100] * 0.75).all()
    assert bpe.sum() < byte.sum() / 2
    assert np.median(bpe) < np.median(byte) / 2


@pytest.mark.parametrize("kind", ["bpe", "byte"])
def test_deterministic_and_cached(tmp_path, kind):
    a = stdlib_corpus(tmp_path / "a", max_files=25, tokenizer=kind, vocab_size=512)
    b = stdlib_corpus(tmp_path / "b", max_files=25, tokenizer=kind, vocab_size=512)
    assert os.path.basename(a) == os.path.basename(b)
    exts = (".bin", ".idx") + ((".tokenizer.json",) if kind == "bpe" else ())
    for ext in exts:
        assert open(a + ext, "rb").read() == open(b + ext, "rb").read()
    mtimes = {ext: os.stat(a + ext).st_mtime_ns for ext in exts}
    assert stdlib_corpus(tmp_path / "a", max_files=25, tokenizer=kind, vocab_size=512) == a
    assert {ext: os.stat(a + ext).st_mtime_ns for ext in exts} == mtimes, "a second call reuses the cached files"
    assert stdlib_corpus(tmp_path / "a", max_files=24, tokenizer=kind, vocab_size=512) != a, \
        "another file set is another dataset"
    assert sorted(p.name for p in (tmp_path / "a").iterdir() if ".tmp" in p.name) == [], "no temporary files left"


def test_cache_key_has_tokenizer_kind_and_vocab_size(tmp_path):
    names = {os.path.basename(stdlib_corpus(tmp_path, max_files=10, tokenizer=kind, vocab_size=v))
             for kind, v in [("byte", 512), ("byte", 600), ("bpe", 512), ("bpe", 600)]}
    assert len(names) == 3, names  # byte ignores vocab_size
    assert sum("-byte-" in n for n in names) == 1
    assert sum("-bpe512-" in n for n in names) == 1 and sum("-bpe600-" in n for n in names) == 1


def test_interrupted_build_reuses_the_tokenizer_and_rebuild_retrains(tmp_path):
    prefix = stdlib_corpus(tmp_path, max_files=12, vocab_size=400)
    data = open(prefix + ".bin", "rb").read()
    tok_mtime = os.stat(prefix + ".tokenizer.json").st_mtime_ns
    os.unlink(prefix + ".bin")  # as if the build stopped after training
    os.unlink(prefix + ".json")
    assert stdlib_corpus(tmp_path, max_files=12, vocab_size=400) == prefix
    assert open(prefix + ".bin", "rb").read() == data
    assert os.stat(prefix + ".tokenizer.json").st_mtime_ns == tok_mtime
    os.unlink(prefix + ".tokenizer.json")  # a manifest without its tokenizer is not a finished corpus
    assert stdlib_corpus(tmp_path, max_files=12, vocab_size=400) == prefix
    assert corpus_tokenizer(prefix).vocab_size == 400
    assert stdlib_corpus(tmp_path, max_files=12, vocab_size=400, rebuild=True) == prefix
    assert open(prefix + ".bin", "rb").read() == data


def test_a_damaged_cache_says_rebuild(tmp_path):
    prefix = stdlib_corpus(tmp_path, max_files=6, tokenizer="byte")
    data = open(prefix + ".bin", "rb").read()
    open(prefix + ".bin", "wb").write(data[:-7])  # cut short, as a full disk leaves it
    with pytest.raises(DataError, match="the corpus cache is damaged: `python -m megatron_ext.data.corpus --rebuild`"):
        stdlib_corpus(tmp_path, max_files=6, tokenizer="byte")
    assert stdlib_corpus(tmp_path, max_files=6, tokenizer="byte", rebuild=True) == prefix  # the way out works
    assert open(prefix + ".bin", "rb").read() == data


def test_corpus_tokenizer_errors(tmp_path):
    prefix = stdlib_corpus(tmp_path, max_files=10, vocab_size=300)
    with pytest.raises(DataError, match="no readable manifest"):
        corpus_tokenizer(tmp_path / "nothing")
    for text in (b"[]", b"\xff\xfe"):  # a list, not a manifest; not text
        (tmp_path / "odd.json").write_bytes(text)
        with pytest.raises(DataError, match="no readable manifest for corpus"):
            corpus_tokenizer(tmp_path / "odd")
    other = BPETokenizer.train_from_texts(["print('hello world')\n" * 50], vocab_size=300)
    good = open(prefix + ".tokenizer.json").read()
    other.save(prefix + ".tokenizer.json")
    with pytest.raises(DataError, match="sha256|vocab_size"):
        corpus_tokenizer(prefix)
    open(prefix + ".tokenizer.json", "w").write(good)
    m = corpus_manifest(prefix)
    with open(prefix + ".json", "w") as f:
        json.dump({**m, "tokenizer": "gpt2"}, f)
    with pytest.raises(DataError, match="unknown tokenizer"):
        corpus_tokenizer(prefix)
    with pytest.raises(DataError, match="unknown corpus tokenizer"):
        stdlib_corpus(tmp_path, max_files=3, tokenizer="gpt2")
    with pytest.raises(DataError, match="from 258 to 1,048,576, got 100"):
        stdlib_corpus(tmp_path, max_files=3, vocab_size=100)


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
    prefix = stdlib_corpus(tmp_path / "cache", root=root, tokenizer="byte")
    assert corpus_manifest(prefix)["files"] == ["a.py", "b.py", "pkg/__init__.py"]
    assert IndexedDocuments(prefix).lengths.tolist() == [601, 7, 1]
    bpe = stdlib_corpus(tmp_path / "cache", root=root)
    tok = corpus_tokenizer(bpe)
    lengths = IndexedDocuments(bpe).lengths.tolist()
    assert lengths[2] == 1 and lengths[0] < 601, lengths
    assert tok.decode(IndexedDocuments(bpe).get(0)) == "a = 1\n" * 100
    (root / "b.py").write_text("b = 3\n")
    assert stdlib_corpus(tmp_path / "cache", root=root, tokenizer="byte") != prefix
    assert stdlib_corpus(tmp_path / "cache", root=root) != bpe
    with pytest.raises(DataError, match="no .py files"):
        stdlib_corpus(tmp_path / "cache", root=tmp_path / "cache")
    with pytest.raises(DataError, match="max_files"):
        stdlib_files(root, max_files=0)


def test_non_utf8_file_is_kept_with_replacement_characters(tmp_path):
    root = tmp_path / "lib"
    root.mkdir()
    (root / "a.py").write_bytes(b"x = '\xff'\n")
    prefix = stdlib_corpus(tmp_path / "cache", root=root)
    assert corpus_manifest(prefix)["non_utf8_files"] == ["a.py"]
    assert corpus_tokenizer(prefix).decode(IndexedDocuments(prefix).get(0)) == "x = '\ufffd'\n"


def test_length_distribution_is_long_tailed(tmp_path):
    """Byte lengths come from file sizes alone, so check the whole library's shape without building it."""
    sizes = np.array([p.stat().st_size + 1 for p in stdlib_files()])
    median, p99, top = np.median(sizes), np.percentile(sizes, 99), sizes.max()
    assert 1_000 < median < 20_000
    assert p99 > 5 * median and top > 100_000


@pytest.mark.parametrize("argv, says", [
    (["--max-files", "0"], "max_files must be at least 1, got 0"),
    (["--vocab-size", "5"], "BPE vocab_size must be an integer from 258 to 1,048,576, got 5"),
    (["--vocab-size", "10000000000"], "BPE vocab_size must be an integer from 258 to 1,048,576, got 10000000000"),
])
def test_the_corpus_command_says_bad_input_in_one_line(tmp_path, capsys, argv, says):
    from megatron_ext.data.corpus import main

    assert main(["--cache-dir", str(tmp_path), *argv]) == 2
    assert capsys.readouterr().err == f"python -m megatron_ext.data.corpus: error: {says}\n"


def test_the_corpus_command_says_an_unwritable_cache_in_one_line(tmp_path, capsys):
    from megatron_ext.data.corpus import main

    (tmp_path / "a-file").write_text("")
    assert main(["--cache-dir", str(tmp_path / "a-file" / "below"), "--max-files", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m megatron_ext.data.corpus: error: ") and "Not a directory" in err, err
