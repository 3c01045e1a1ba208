"""The byte-level tokenizer: exact round trips, special tokens, errors."""
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
