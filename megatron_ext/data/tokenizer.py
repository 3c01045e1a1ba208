"""Two offline tokenizers with one interface: byte-level, and a byte-level BPE trained locally.

``ByteTokenizer``: token ids 0..255 are the UTF-8 bytes of the text; after them come the special
tokens (``<eod>`` = 256 ends a document, ``<pad>`` = 257 fills shard padding). It needs no
vocabulary file and no download; a model trained with it has a ``vocab_size`` of 258 (Megatron pads
the embedding table further itself). Its documents are long: one token per byte.

``BPETokenizer``: a byte-level BPE (GPT-2 style: ``ByteLevel`` pre-tokenizer without a prefix
space, ``ByteLevel`` decoder, all 256 byte symbols in the initial alphabet) trained with HF
``tokenizers`` on local text, e.g. the corpus it will encode (``BPETokenizer.train(files)``). The
special tokens are ``<eod>`` = 0 and ``<pad>`` = 1. Training is deterministic (same texts and
vocabulary size -> the same JSON) and takes seconds; the tokenizer is saved and loaded as the
``tokenizers`` JSON file (``save`` / ``load``), which is all a consumer needs.

Both never lose anything: ``decode(encode(text)) == text`` for every string, and the text
``"<eod>"`` is encoded as ordinary characters, never as the special id (only ``append_eod`` adds
it). The method names ``tokenize`` / ``detokenize`` / ``eod`` / ``pad`` / ``vocab_size`` match the
duck type Megatron's dataset code uses, so either can stand in for a Megatron tokenizer.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Iterator, Protocol, Sequence

import numpy as np

from megatron_ext.files import replacing


class Tokenizer(Protocol):
    """What the data code needs from a tokenizer (``ByteTokenizer`` and ``BPETokenizer`` have it)."""

    name: str

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod(self) -> int: ...

    @property
    def pad(self) -> int: ...

    @property
    def dtype(self) -> type: ...

    def encode(self, text: str, append_eod: bool = False) -> np.ndarray: ...

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str: ...

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: Iterable[int]) -> str: ...


def _as_id_array(ids: Iterable[int], vocab_size: int, what: str) -> np.ndarray:
    """``ids`` as int64, ValueError naming the first id outside [0, vocab_size)."""
    arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        bad = int(arr[(arr < 0) | (arr >= vocab_size)][0])
        raise ValueError(f"token id {bad} is outside the {what} vocabulary [0, {vocab_size})")
    return arr


def _id_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


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
        arr = _as_id_array(ids, self.vocab_size, "byte")
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


class BPETokenizer:
    """Byte-level BPE (HF ``tokenizers``) with ``<eod>`` = 0 and ``<pad>`` = 1.

    Build one with ``BPETokenizer.train(files, vocab_size)`` (or ``train_from_texts``), keep it
    with ``save(path)`` and get it back with ``BPETokenizer.load(path)``."""

    name = "bpe"
    EOD_TOKEN = "<eod>"
    PAD_TOKEN = "<pad>"
    SPECIAL_TOKENS = (EOD_TOKEN, PAD_TOKEN)
    MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # the byte alphabet and the special tokens, no merges
    MAX_VOCAB = 1 << 20  # past this the trainer asks for memory by the vocabulary (10^10: 567 GB, then aborts)
    ENCODE_BATCH = 64  # texts per encode_batch call in encode_many (bounds the memory of the encodings)

    def __init__(self, tokenizer):
        """Wrap a ``tokenizers.Tokenizer`` that has the ``<eod>`` and ``<pad>`` special tokens."""
        ids = [tokenizer.token_to_id(t) for t in self.SPECIAL_TOKENS]
        if None in ids:
            missing = [t for t, i in zip(self.SPECIAL_TOKENS, ids) if i is None]
            raise ValueError(f"the tokenizer has no {' / '.join(missing)} token")
        self._tok = tokenizer
        # The text "<eod>" must stay text: only append_eod adds the id, and round trips stay exact.
        # (A runtime flag of the tokenizers library; the JSON file does not keep it.)
        self._tok.encode_special_tokens = True
        self._eod, self._pad = ids
        self._vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._special = {self._eod: self.EOD_TOKEN, self._pad: self.PAD_TOKEN}

    # ---- building, saving, loading ----------------------------------------------------------
    @classmethod
    def check_vocab_size(cls, vocab_size) -> None:
        """ValueError unless ``vocab_size`` is an integer in [MIN_VOCAB, MAX_VOCAB] (the byte alphabet
        and the special tokens at least)."""
        if not isinstance(vocab_size, (int, np.integer)) or isinstance(vocab_size, bool) \
                or not cls.MIN_VOCAB <= vocab_size <= cls.MAX_VOCAB:
            raise ValueError(f"BPE vocab_size must be an integer from {cls.MIN_VOCAB} to {cls.MAX_VOCAB:,}, "
                             f"got {vocab_size!r}")

    @classmethod
    def train(cls, files: Iterable[str | Path], vocab_size: int = 2048) -> "BPETokenizer":
        """Train on the UTF-8 text files, in the order given (undecodable bytes become U+FFFD)."""
        texts = []
        for f in files:
            try:
                data = Path(f).read_bytes()
            except OSError as e:
                raise OSError(e.errno, f"cannot read {f}: {e.strerror}") from None
            texts.append(data.decode("utf-8", errors="replace"))
        return cls.train_from_texts(texts, vocab_size)

    @classmethod
    def train_from_texts(cls, texts: Iterable[str], vocab_size: int = 2048) -> "BPETokenizer":
        """Train on the texts (each a whole document). ``vocab_size`` counts the 256 byte
        symbols, the merges and the two special tokens; on a small text the merges may run out
        first, so ``vocab_size`` of the result can be smaller. Deterministic: the merges are
        ranked by pair count, ties by token ids, and counts do not depend on threads or order."""
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

        cls.check_vocab_size(vocab_size)
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), special_tokens=list(cls.SPECIAL_TOKENS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(_checked_texts(texts), trainer)
        return cls(tok)

    @classmethod
    def from_str(cls, json_text: str) -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer
        return cls(HFTokenizer.from_str(json_text))

    @classmethod
    def load(cls, path: str | Path) -> "BPETokenizer":
        """A tokenizer saved by ``save`` (any ``tokenizers`` JSON with ``<eod>`` and ``<pad>``)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise OSError(e.errno, f"cannot read tokenizer file {path}: {e.strerror}") from None
        from tokenizers import Tokenizer as HFTokenizer
        try:
            hf = HFTokenizer.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise ValueError(f"{path} is not a tokenizers JSON file: {e}") from None
        try:
            return cls(hf)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def to_str(self) -> str:
        """The tokenizer as ``tokenizers`` JSON (deterministic: equal tokenizers, equal strings)."""
        return self._tok.to_str()

    def save(self, path: str | Path) -> str:
        """Write the JSON to ``path`` atomically (temporary file, then rename). Returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path) as tmp:
            tmp.write_text(self.to_str(), encoding="utf-8")
        return str(path)

    @property
    def fingerprint(self) -> str:
        """sha256 of the JSON: equal fingerprints, equal tokenizers."""
        return hashlib.sha256(self.to_str().encode("utf-8")).hexdigest()

    @property
    def hf_tokenizer(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    # ---- the tokenizer interface ------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def dtype(self) -> type:
        """The narrowest integer type holding every id (uint16 up to 65536 tokens)."""
        return _id_dtype(self._vocab_size)

    def _ids(self, ids: list[int], append_eod: bool) -> np.ndarray:
        if append_eod:
            ids = ids + [self._eod]
        return np.asarray(ids, dtype=self.dtype)

    def encode(self, text: str, append_eod: bool = False) -> np.ndarray:
        """The ids of ``text`` (``dtype``), optionally followed by ``<eod>``."""
        if not isinstance(text, str):
            raise TypeError(f"BPETokenizer.encode takes a str, got {type(text).__name__}")
        return self._ids(self._tok.encode(text, add_special_tokens=False).ids, append_eod)

    def encode_many(self, texts: Sequence[str], append_eod: bool = False) -> Iterator[np.ndarray]:
        """``encode`` of each text, in order, computed in parallel batches."""
        batch_fn = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        for start in range(0, len(texts), self.ENCODE_BATCH):
            batch = list(texts[start:start + self.ENCODE_BATCH])
            for k, t in enumerate(batch):
                if not isinstance(t, str):
                    raise TypeError(f"BPETokenizer.encode_many: text {start + k} is a {type(t).__name__}, not a str")
            for enc in batch_fn(batch, add_special_tokens=False):
                yield self._ids(enc.ids, append_eod)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of the ids. Special tokens are dropped (or written as ``<eod>``/``<pad>`` with
        ``skip_special=False``); byte runs that are not valid UTF-8 decode to U+FFFD."""
        arr = _as_id_array(ids, self._vocab_size, "BPE")
        special = np.isin(arr, list(self._special))
        if not special.any():
            return self._tok.decode(arr.tolist(), skip_special_tokens=True)
        # Decode the text between special tokens piece by piece, as ByteTokenizer does: no byte
        # sequence is glued across a special token.
        parts: list[str] = []
        prev = 0
        for c in np.flatnonzero(special):
            parts.append(self._tok.decode(arr[prev:c].tolist(), skip_special_tokens=True))
            if not skip_special:
                parts.append(self._special[int(arr[c])])
            prev = c + 1
        parts.append(self._tok.decode(arr[prev:].tolist(), skip_special_tokens=True))
        return "".join(parts)

    def tokenize(self, text: str) -> list[int]:
        return self.encode(text).tolist()

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.decode(ids)


def _checked_texts(texts: Iterable[str]) -> Iterator[str]:
    for k, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"BPE training text {k} is a {type(t).__name__}, not a str")
        yield t


def get_tokenizer(name: str | Path = "byte") -> Tokenizer:
    """``"byte"``: the byte-level tokenizer; a path to a saved BPE JSON file: that BPE tokenizer."""
    if str(name) == "byte":
        return ByteTokenizer()
    if Path(name).is_file():
        return BPETokenizer.load(name)
    raise ValueError(f"unknown tokenizer {str(name)!r}; available: 'byte' or the path of a saved BPE "
                     f"tokenizer JSON file")
