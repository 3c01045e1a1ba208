"""A byte-level tokenizer: exact, offline, the same on every machine.

Token ids 0..255 are the UTF-8 bytes of the text; after them come the special tokens
(``<eod>`` = 256 ends a document, ``<pad>`` = 257 fills shard padding). Encoding never loses
anything: ``decode(encode(text)) == text`` for every string. It needs no vocabulary file and no
download, which is what the CPU demo and the tests need; a model trained with it has a
``vocab_size`` of 258 (Megatron pads the embedding table further itself).

The method names ``tokenize`` / ``detokenize`` / ``eod`` / ``pad`` / ``vocab_size`` match the
duck type Megatron's dataset code uses, so it can stand in for a Megatron tokenizer.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus ``<eod>`` and ``<pad>``."""

    name = "byte"
    NUM_BYTES = 256
    EOD = 256
    PAD = 257
    SPECIAL = {EOD: "<eod>", PAD: "<pad>"}

    @property
    def vocab_size(self) -> int:
        return self.NUM_BYTES + len(self.SPECIAL)

    @property
    def eod(self) -> int:
        return self.EOD

    @property
    def pad(self) -> int:
        return self.PAD

    @property
    def dtype(self) -> type:
        """The narrowest integer type holding every id (what the indexed dataset stores)."""
        return np.uint16

    def encode(self, text: str, append_eod: bool = False) -> np.ndarray:
        """The UTF-8 bytes of ``text`` as ids (uint16), optionally followed by ``<eod>``."""
        if not isinstance(text, str):
            raise TypeError(f"ByteTokenizer.encode takes a str, got {type(text).__name__}")
        return self.encode_bytes(text.encode("utf-8"), append_eod)

    def encode_bytes(self, data: bytes, append_eod: bool = False) -> np.ndarray:
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
        if append_eod:
            ids = np.append(ids, np.uint16(self.EOD))
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of the ids. Special tokens are dropped (or written as ``<eod>``/``<pad>`` with
        ``skip_special=False``); byte runs that are not valid UTF-8 decode to U+FFFD."""
        arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = int(arr[(arr < 0) | (arr >= self.vocab_size)][0])
            raise ValueError(f"token id {bad} is outside the byte vocabulary [0, {self.vocab_size})")
        special = arr >= self.NUM_BYTES
        if not special.any():
            return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        parts: list[str] = []
        cuts = np.flatnonzero(special)
        prev = 0
        for c in cuts:
            parts.append(arr[prev:c].astype(np.uint8).tobytes().decode("utf-8", errors="replace"))
            if not skip_special:
                parts.append(self.SPECIAL[int(arr[c])])
            prev = c + 1
        parts.append(arr[prev:].astype(np.uint8).tobytes().decode("utf-8", errors="replace"))
        return "".join(parts)

    # Megatron's tokenizer duck type.
    def tokenize(self, text: str) -> list[int]:
        return self.encode(text).tolist()

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.decode(ids)


def get_tokenizer(name: str = "byte") -> ByteTokenizer:
    """The tokenizer called ``name``; only the offline byte-level one exists for now."""
    if name != "byte":
        raise ValueError(f"unknown tokenizer {name!r}; available: byte")
    return ByteTokenizer()
