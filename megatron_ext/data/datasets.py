"""Variable-length document datasets: every document keeps its own length, nothing is padded.

One interface (``Documents``: ``lengths``, ``len()``, ``get(i, offset, length)``) over:

- Megatron's indexed dataset (a ``PREFIX.bin`` of token ids and a ``PREFIX.idx`` index), read
  and written through ``megatron.core.datasets.indexed_dataset``. Same files Megatron-LM's
  ``tools/preprocess_data.py`` makes and its ``GPTDataset`` reads. A Megatron "document" may hold
  several index sequences (sentence splitting); we read a document as the concatenation of its
  sequences, which are contiguous in the ``.bin`` file. Read as written: the planning data loader
  splits long documents at its own ``max_seq_len``.
- token arrays in memory (``InMemoryDocuments``), and blends and concatenations of the above.

Text is turned into indexed datasets by ``data/corpus.py`` (or Megatron's own preprocessing).

megatron-core is imported only by the indexed-dataset functions, when called: the planner modules
never import this file's dependencies.
"""
from __future__ import annotations

import logging
import os
import struct
import tempfile
import warnings
from pathlib import Path
from typing import Iterable, Iterator, Protocol, Sequence

import numpy as np

from megatron_ext.errors import MegatronExtError

logger = logging.getLogger(__name__)


class DataError(MegatronExtError):
    """A dataset file is missing, unreadable or malformed (the message names file and line)."""


class Documents(Protocol):
    """Token documents of varying length."""

    @property
    def lengths(self) -> np.ndarray: ...  # int64, one entry per document

    def __len__(self) -> int: ...

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray: ...


def _check_range(n_docs: int, doc_len: int, i: int, offset: int, length: int | None) -> int:
    if not 0 <= i < n_docs:
        raise IndexError(f"document {i} out of range (there are {n_docs})")
    if length is None:
        length = doc_len - offset
    if offset < 0 or length < 0 or offset + length > doc_len:
        raise IndexError(f"tokens [{offset}, {offset + length}) out of range for document {i} "
                         f"of {doc_len} tokens")
    return length


# ---- in memory ------------------------------------------------------------------------------
class HeldLengths:
    """The ``lengths`` / ``len()`` of a ``Documents`` that holds its lengths in ``_lengths``."""

    _lengths: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    def __len__(self) -> int:
        return int(self._lengths.size)


class InMemoryDocuments(HeldLengths):
    """Documents held as a list of token arrays."""

    def __init__(self, docs: Sequence[np.ndarray]):
        self._docs = [np.asarray(d) for d in docs]
        for k, d in enumerate(self._docs):
            if d.ndim != 1 or not np.issubdtype(d.dtype, np.integer):
                raise DataError(f"document {k} is not a 1-D integer token array (shape {d.shape}, {d.dtype})")
        self._lengths = np.fromiter((d.size for d in self._docs), dtype=np.int64, count=len(self._docs))

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self._docs)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        length = _check_range(len(self), int(self._lengths[i]) if 0 <= i < len(self) else 0, i, offset, length)
        return self._docs[i][offset:offset + length]


# ---- Megatron indexed dataset ---------------------------------------------------------------
def _megatron_datasets(module: str):
    """A module of megatron.core.datasets, imported on first use (it pulls in megatron-core and
    torch; its warnings about missing Transformer Engine / Apex are expected on CPU)."""
    import importlib

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
        warnings.simplefilter("ignore", DeprecationWarning)  # megatron-core's and torch's import-time notices
        return importlib.import_module(f"megatron.core.datasets.{module}")


_IDX_MAGIC = b"MMIDIDX\x00\x00"  # first bytes of a Megatron .idx file
_IDX_HEAD = len(_IDX_MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence and document counts
_TOKEN_DTYPE_CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 8: "uint16"}  # megatron-core's DType
TOKEN_SCAN_BLOCK = 1 << 24  # tokens a vocabulary check reads at once (16M: 32-128 MB)


def indexed_dataset_exists(prefix: str | Path) -> bool:
    prefix = str(prefix)
    return os.path.exists(prefix + ".idx") and os.path.exists(prefix + ".bin")


def write_indexed_dataset(prefix: str | Path, docs: Iterable[np.ndarray], dtype=np.uint16) -> str:
    """Write documents (one index sequence each) as ``prefix.bin`` + ``prefix.idx`` with
    megatron-core's IndexedDatasetBuilder. The files appear atomically (written under a temporary
    name, then renamed), so concurrent writers of the same content are safe. Returns the prefix."""
    idx_mod = _megatron_datasets("indexed_dataset")
    prefix = str(prefix)
    directory = os.path.dirname(os.path.abspath(prefix))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(prefix) + ".", suffix=".tmp", dir=directory)
    os.close(fd)
    os.unlink(tmp)
    info = np.iinfo(dtype)
    try:
        builder = idx_mod.IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
        for k, d in enumerate(docs):
            arr = np.asarray(d)
            if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
                raise DataError(f"document {k} is not a 1-D integer token array (shape {arr.shape}, {arr.dtype})")
            if arr.size and (arr.min() < info.min or arr.max() > info.max):
                raise DataError(f"document {k}: token ids outside the range of {np.dtype(dtype).name}")
            builder.add_document(arr.astype(dtype, copy=False), [int(arr.size)])
        builder.finalize(tmp + ".idx")
        os.replace(tmp + ".bin", prefix + ".bin")
        os.replace(tmp + ".idx", prefix + ".idx")
    finally:
        for ext in (".bin", ".idx"):
            if os.path.exists(tmp + ext):
                os.unlink(tmp + ext)
    return prefix


class IndexedDocuments(HeldLengths):
    """A Megatron indexed dataset (``prefix.bin`` / ``prefix.idx``), one entry per document.

    Reads through megatron-core's ``IndexedDataset`` (memory-mapped). Picklable: it reopens the
    files from the prefix."""

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        if not indexed_dataset_exists(self.prefix):
            raise DataError(f"no indexed dataset at {self.prefix} (expected {self.prefix}.bin and {self.prefix}.idx)")
        self._open()

    def _open(self) -> None:
        try:
            self._check_files()
        except OSError as e:  # (a folder named PREFIX.idx, a file without read permission)
            raise DataError(f"cannot read the indexed dataset {self.prefix}: {e.filename}: {e.strerror or e}") from None
        idx_mod = _megatron_datasets("indexed_dataset")
        try:
            self._ds = idx_mod.IndexedDataset(self.prefix)
        except Exception as e:  # a foreign file: whatever megatron-core trips over, it is unreadable
            said = str(e).strip() or f"{type(e).__name__} in megatron-core's reader"
            raise DataError(f"{self.prefix}: not a readable Megatron indexed dataset ({said})") from None
        seq_lengths = np.asarray(self._ds.sequence_lengths, dtype=np.int64)
        doc_idx = np.asarray(self._ds.document_indices, dtype=np.int64)
        if (seq_lengths < 0).any() or doc_idx.size < 1 or (np.diff(doc_idx) < 0).any() or \
                doc_idx[0] != 0 or doc_idx[-1] != seq_lengths.size:
            raise DataError(f"{self.prefix}.idx: not a readable Megatron indexed dataset (inconsistent index)")
        cum = np.concatenate([[0], np.cumsum(seq_lengths)])
        itemsize = np.dtype(self._ds.index.dtype).itemsize
        # Sequences one after another from the start of the .bin, as megatron-core writes them (a
        # document is read across its sequences from the first): any other pointer reads other tokens.
        if not np.array_equal(np.asarray(self._ds.index.sequence_pointers, dtype=np.int64), cum[:-1] * itemsize):
            raise DataError(f"{self.prefix}.idx: not a readable Megatron indexed dataset (its sequence pointers do "
                            f"not follow its sequence lengths: corrupted)")
        tokens_bytes = int(cum[-1]) * itemsize
        if tokens_bytes > os.path.getsize(self.prefix + ".bin"):
            raise DataError(f"{self.prefix}.bin holds {os.path.getsize(self.prefix + '.bin'):,} bytes, fewer than the "
                            f"{tokens_bytes:,} its index describes (truncated, or not this index's data file)")
        self._first_seq = doc_idx[:-1]
        self._lengths = cum[doc_idx[1:]] - cum[doc_idx[:-1]]
        self._tokens = int(cum[-1])

    def _check_files(self) -> None:
        """What megatron-core would trip over, as clear errors: the .idx header and size (its
        reader maps counts it does not check), and an empty .bin (it cannot map one)."""
        idx = self.prefix + ".idx"
        with open(idx, "rb") as f:
            head = f.read(_IDX_HEAD)
        if head[:len(_IDX_MAGIC)] != _IDX_MAGIC:
            raise DataError(f"{idx}: not a readable Megatron indexed dataset (bad header)")
        if len(head) < _IDX_HEAD:
            raise DataError(f"{idx}: not a readable Megatron indexed dataset (truncated header)")
        version, code, sequences, documents = struct.unpack("<QBQQ", head[len(_IDX_MAGIC):])
        want = _IDX_HEAD + sequences * 12 + documents * 8  # int32 lengths, int64 pointers, int64 doc indices
        if version != 1 or want > os.path.getsize(idx):
            raise DataError(f"{idx}: not a readable Megatron indexed dataset (version {version}, "
                            f"{sequences} sequences and {documents} document indices in "
                            f"{os.path.getsize(idx):,} bytes: truncated or corrupted)")
        if documents < 2:  # (document indices: 0, then where each document ends)
            raise DataError(f"{idx}: the index lists no documents")
        if code not in _TOKEN_DTYPE_CODES:
            raise DataError(f"{idx}: not a dataset of token ids (its dtype code is {code}; megatron-core's integer "
                            f"types are {', '.join(f'{c} ({n})' for c, n in _TOKEN_DTYPE_CODES.items())})")
        if not os.path.isfile(self.prefix + ".bin"):
            raise DataError(f"{self.prefix}.bin is not a file")
        if os.path.getsize(self.prefix + ".bin") == 0:
            raise DataError(f"{self.prefix}.bin is empty: the dataset holds no tokens")

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._open()

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self._ds.index.dtype)

    def token_range(self) -> tuple[int, int]:
        """The smallest and the largest token id in the dataset (one pass over the mapped .bin)."""
        if self._tokens == 0:
            return 0, -1
        tokens = np.memmap(self.prefix + ".bin", dtype=self.dtype, mode="r", shape=(self._tokens,))
        lo, hi = np.iinfo(self.dtype).max, np.iinfo(self.dtype).min
        for a in range(0, self._tokens, TOKEN_SCAN_BLOCK):  # (one pass: each block read once, for both)
            block = tokens[a:a + TOKEN_SCAN_BLOCK]
            lo, hi = min(lo, int(block.min())), max(hi, int(block.max()))
        return int(lo), int(hi)

    @property
    def num_sequences(self) -> int:
        """Index sequences (more than documents if the data was sentence-split)."""
        return len(self._ds)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self.get(i) for i in range(len(self)))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of document i (a read-only view of the mapped file)."""
        n = len(self)
        length = _check_range(n, int(self._lengths[i]) if 0 <= i < n else 0, i, offset, length)
        if length == 0:
            return np.empty(0, dtype=self.dtype)
        # A document's sequences are contiguous in the .bin file: read across them from the first.
        return self._ds.get(int(self._first_seq[i]), offset=offset, length=length)


class ConcatDocuments(HeldLengths):
    """Several ``Documents`` one after another (the sources of a blend): document i of the whole
    is document i - offset of the part holding it."""

    def __init__(self, parts: Sequence[Documents]):
        if not parts:
            raise DataError("no documents to concatenate")
        self.parts = list(parts)
        self.sizes = [len(p) for p in self.parts]
        self._offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self._lengths = np.concatenate([np.asarray(p.lengths, dtype=np.int64) for p in self.parts])

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"document {i} out of range (there are {len(self)})")
        k = int(np.searchsorted(self._offsets, i, side="right")) - 1
        return self.parts[k].get(int(i - self._offsets[k]), offset, length)


def parse_blend(values: Sequence[str]) -> list[tuple[float | None, str]]:
    """Megatron's ``--data-path`` forms, read by Megatron's own ``get_blend_from_list``: ``PREFIX``,
    ``W1 PREFIX1 W2 PREFIX2 ...`` (weights: shares of every batch, normalised), or ``PREFIX1
    PREFIX2 ...`` (weight None: by size). What Megatron would misread is refused here: a number
    where a prefix belongs, an odd count of weight-prefix pairs, negative or all-zero weights. A
    ``.bin`` / ``.idx`` ending is taken off."""
    values = [str(v).strip() for v in values]
    if not values:
        raise DataError("no dataset given")
    try:
        prefixes, weights = _megatron_datasets("utils").get_blend_from_list(values)
    except AssertionError:
        prefixes, weights = values, None
    if weights is None and len(values) % 2 == 0 and any(_is_number(v) for v in values[::2]):
        # (pairs, one of whose weights is not a number)
        bad = next(v for v in values[::2] if not _is_number(v))
        raise DataError(f"a blend is weight-prefix pairs (W1 PREFIX1 W2 PREFIX2 ...): {bad!r} is not a weight")
    if weights is None and len(values) > 1 and _is_number(values[0]):
        raise DataError(f"a blend is weight-prefix pairs, got an odd count: {' '.join(values)}")
    if weights is not None and not (all(np.isfinite(w) and w >= 0 for w in weights) and any(w > 0 for w in weights)):
        raise DataError(f"blend weights must be non-negative numbers, not all zero: {' '.join(values)}")
    out = []
    for k, prefix in enumerate(prefixes):
        if _is_number(prefix):
            raise DataError(f"expected a dataset prefix, got the number {prefix!r} (a blend is W1 PREFIX1 W2 PREFIX2 ...)")
        for ext in (".bin", ".idx"):
            if prefix.endswith(ext):
                prefix = prefix[:-len(ext)]
        out.append((None if weights is None else weights[k], prefix))
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def open_blend(values: Sequence[str]) -> list[tuple[float | None, IndexedDocuments]]:
    """The indexed datasets of ``--data-path`` style values (``parse_blend``), with their weights."""
    return [(w, IndexedDocuments(prefix)) for w, prefix in parse_blend(values)]


def blend_documents(sources) -> tuple[Documents, list[int] | None, list[float] | None]:
    """(weight, documents) sources as one ``Documents``, with the source sizes and weights
    ``GlobalBatches`` blends by: None for one source, weights None for unweighted sources (one
    dataset, the documents one after another)."""
    if len(sources) == 1:
        return sources[0][1], None, None
    docs = ConcatDocuments([d for _, d in sources])
    return docs, docs.sizes, [w for w, _ in sources] if sources[0][0] is not None else None


def document_stats(lengths) -> dict:
    """Count, total, median, p90, p99 and max of document lengths (tokens)."""
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.size == 0:
        return {"documents": 0, "tokens": 0}
    return {"documents": int(arr.size), "tokens": int(arr.sum()),
            "median": float(np.median(arr)), "p90": float(np.percentile(arr, 90)),
            "p99": float(np.percentile(arr, 99)), "max": int(arr.max()),
            "attention_share_over_4k": float((arr[arr > 4096].astype(np.float64) ** 2).sum()
                                             / (arr.astype(np.float64) ** 2).sum())}
