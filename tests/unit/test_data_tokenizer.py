"""The tokenizers: byte-level and byte-level BPE; exact round trips, special tokens, determinism, errors."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_ext.data.tokenizer import ByteTokenizer, get_tokenizer


def test_vocab_and_specials():
    tok = get_tokenizer("byte")
    assert tok.vocab_size == 258
    assert tok.eod == 256 and tok.pad == 257
    assert len({tok.eod, tok.pad}) == 2 and min(tok.eod, tok.pad) >= 256


def test_ids_are_utf8_bytes():
    tok = ByteTokenizer()
    ids = tok.encode("aé€", append_eod=True)
    assert ids.tolist() == list("aé€".encode("utf-8")) + [256]
    assert ids.dtype == np.uint16


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip(text):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, append_eod=True)) == text
    assert tok.detokenize(tok.tokenize(text)) == text


def test_round_trip_of_a_large_real_file():
    import os
    text = open(os.__file__, encoding="utf-8").read()
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.size == len(text.encode("utf-8")) > 10_000
    assert tok.decode(ids) == text


def test_special_tokens_in_decode():
    tok = ByteTokenizer()
    ids = np.concatenate([tok.encode("ab"), [tok.eod], tok.encode("c"), [tok.pad]])
    assert tok.decode(ids) == "abc"
    assert tok.decode(ids, skip_special=False) == "ab<eod>c<pad>"


def test_bad_ids_and_types():
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="258"):
        tok.decode([1, 258])
    with pytest.raises(ValueError, match="-1"):
        tok.decode([-1])
    with pytest.raises(TypeError):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="unknown tokenizer"):
        get_tokenizer("gpt2")


# ---- byte-level BPE -------------------------------------------------------------------------
from megatron_ext.data.corpus import stdlib_files  # noqa: E402
from megatron_ext.data.tokenizer import BPETokenizer  # noqa: E402


@pytest.fixture(scope="module")
def bpe_files():
    return stdlib_files(max_files=30)


@pytest.fixture(scope="module")
def bpe(bpe_files):
    return BPETokenizer.train(bpe_files, vocab_size=512)


def test_bpe_vocab_and_specials(bpe):
    assert bpe.vocab_size == 512
    assert (bpe.eod, bpe.pad) == (0, 1)
    assert bpe.hf_tokenizer.id_to_token(bpe.eod) == "<eod>" and bpe.hf_tokenizer.id_to_token(bpe.pad) == "<pad>"
    assert bpe.dtype == np.uint16
    ids = bpe.encode("def f(x):\n    return x\n", append_eod=True)
    assert ids.dtype == np.uint16 and ids[-1] == bpe.eod
    assert bpe.eod not in ids[:-1] and bpe.pad not in ids


def test_bpe_is_deterministic(bpe, bpe_files):
    again = BPETokenizer.train(bpe_files, vocab_size=512)
    assert again.to_str() == bpe.to_str() and again.fingerprint == bpe.fingerprint
    texts = [p.read_text(encoding="utf-8") for p in bpe_files]
    assert BPETokenizer.train_from_texts(texts, vocab_size=512).to_str() == bpe.to_str()
    assert BPETokenizer.train(bpe_files, vocab_size=600).to_str() != bpe.to_str()


@settings(max_examples=200, deadline=None)
@given(st.text() | st.lists(st.sampled_from(["<eod>", "<pad>", "<", "eod>", " ", "\n", "é", "def"])).map("".join))
def test_bpe_round_trip(bpe, text):
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert bpe.eod not in ids and bpe.pad not in ids, "special-token text is encoded as plain text"
    assert bpe.decode(bpe.encode(text, append_eod=True)) == text
    assert bpe.detokenize(bpe.tokenize(text)) == text


def test_bpe_round_trip_of_large_real_files_and_compression(bpe, bpe_files):
    import os
    for path in [os.__file__, *bpe_files[:10]]:
        text = open(path, encoding="utf-8").read()
        ids = bpe.encode(text)
        assert bpe.decode(ids) == text
    text = open(os.__file__, encoding="utf-8").read()
    assert bpe.encode(text).size < len(text.encode("utf-8")) / 2


def test_bpe_encode_many_matches_encode(bpe, bpe_files):
    texts = [p.read_text(encoding="utf-8") for p in bpe_files] + ["", "x"]
    many = list(bpe.encode_many(texts, append_eod=True))
    assert len(many) == len(texts)
    for ids, text in zip(many, texts):
        assert ids.tolist() == bpe.encode(text, append_eod=True).tolist()
    with pytest.raises(TypeError):
        list(bpe.encode_many([b"bytes"]))


def test_bpe_special_tokens_in_decode(bpe):
    ids = np.concatenate([bpe.encode("ab"), [bpe.eod], bpe.encode("c"), [bpe.pad]])
    assert bpe.decode(ids) == "abc"
    assert bpe.decode(ids, skip_special=False) == "ab<eod>c<pad>"


def test_bpe_save_load_and_get_tokenizer(bpe, tmp_path):
    path = tmp_path / "sub" / "bpe.json"
    assert bpe.save(path) == str(path)
    assert path.read_text(encoding="utf-8") == bpe.to_str()
    assert [p.name for p in path.parent.iterdir()] == ["bpe.json"], "no temporary file left behind"
    for loaded in (BPETokenizer.load(path), get_tokenizer(path), get_tokenizer(str(path))):
        assert isinstance(loaded, BPETokenizer)
        assert loaded.fingerprint == bpe.fingerprint
        assert (loaded.vocab_size, loaded.eod, loaded.pad) == (bpe.vocab_size, bpe.eod, bpe.pad)
        text = "x = '<eod>'  # é\n"
        assert loaded.encode(text).tolist() == bpe.encode(text).tolist()
        assert loaded.decode(loaded.encode(text)) == text


def test_bpe_errors(bpe, tmp_path):
    with pytest.raises(ValueError, match="512"):
        bpe.decode([1, 512])
    with pytest.raises(ValueError, match="-1"):
        bpe.decode([-1])
    with pytest.raises(TypeError):
        bpe.encode(b"bytes")
    with pytest.raises(ValueError, match="from 258 "):
        BPETokenizer.train_from_texts(["abc"], vocab_size=100)
    with pytest.raises(ValueError, match="to 1,048,576, got 10000000000"):  # (the trainer aborted the process)
        BPETokenizer.train_from_texts(["abc"], vocab_size=10**10)
    with pytest.raises(TypeError):
        BPETokenizer.train_from_texts([b"abc"], vocab_size=300)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a tokenizers JSON"):
        BPETokenizer.load(bad)
    with pytest.raises(OSError):
        BPETokenizer.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="unknown tokenizer"):
        get_tokenizer(tmp_path / "missing.json")


def test_bpe_small_text_stops_early():
    tok = BPETokenizer.train_from_texts(["aaaa bbbb"], vocab_size=2048)
    assert BPETokenizer.MIN_VOCAB <= tok.vocab_size < 2048
    assert tok.decode(tok.encode("aaaa bbbb ccc")) == "aaaa bbbb ccc"
