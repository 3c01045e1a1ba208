"""Which documents each training step's global batch holds, from document lengths alone.

Documents longer than ``max_seq_len`` are cut into consecutive ``max_seq_len`` pieces; the pieces
are the samples. Each epoch is a permutation of the samples drawn from ``(seed, epoch)``; step k
takes ``global_batch_size`` consecutive samples of its epoch (an epoch's remainder is not used).
The batches depend on the data, the seed, the batch size and ``max_seq_len`` only -- never on the
planner -- so every planner, and ``plan`` / ``simulate --data`` on a laptop, see the batches a
training run sees.
"""
from __future__ import annotations

import logging

import numpy as np

from megatron_ext.data.datasets import DataError, IndexedDocuments

logger = logging.getLogger(__name__)


def make_samples(doc_lengths, max_seq_len: int) -> np.ndarray:
    """Samples of the documents, shape [n, 3]: (doc, start, end). A document longer than
    ``max_seq_len`` becomes consecutive pieces of ``max_seq_len`` tokens (the last shorter);
    empty documents are left out."""
    if max_seq_len < 1:
        raise DataError(f"max_seq_len must be at least 1, got {max_seq_len}")
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    pieces = -(-lengths // max_seq_len)  # 0 for empty documents
    doc = np.repeat(np.arange(lengths.size, dtype=np.int64), pieces)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    start = (np.arange(doc.size, dtype=np.int64) - first) * max_seq_len
    end = np.minimum(start + max_seq_len, lengths[doc])
    return np.stack([doc, start, end], axis=1)


class GlobalBatches:
    """The global batch of every step: ``batch_sample_ids(k)`` index ``samples`` ((doc, start,
    end) rows), and the batch's seq ids index those ids in order."""

    def __init__(self, doc_lengths, global_batch_size: int, max_seq_len: int, seed: int = 0,
                 shuffle: bool = True):
        if global_batch_size < 1:
            raise DataError(f"global_batch_size must be at least 1, got {global_batch_size}")
        if seed < 0:
            raise DataError(f"--seed must be non-negative, got {seed}")
        self.global_batch_size = int(global_batch_size)
        self.max_seq_len = int(max_seq_len)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.samples = make_samples(doc_lengths, self.max_seq_len)
        self.num_documents = int(np.asarray(doc_lengths).size)
        self.split_documents = int(np.count_nonzero(np.asarray(doc_lengths) > self.max_seq_len))
        if self.split_documents:
            logger.info("%d document(s) longer than %d tokens are split into pieces of at most %d tokens "
                        "(%d samples from %d documents)", self.split_documents, self.max_seq_len,
                        self.max_seq_len, len(self.samples), self.num_documents)
        if len(self.samples) < self.global_batch_size:
            raise DataError(f"the dataset has {len(self.samples)} samples, fewer than one global batch of "
                            f"{self.global_batch_size}")
        self.steps_per_epoch = len(self.samples) // self.global_batch_size
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    def batch_sample_ids(self, step: int) -> np.ndarray:
        """Sample ids of step ``step``'s global batch (its seq ids index this array)."""
        epoch, k = divmod(int(step), self.steps_per_epoch)
        if epoch != self._perm_epoch:
            n = len(self.samples)
            self._perm = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                          else np.arange(n))
            self._perm_epoch = epoch
        b = self.global_batch_size
        return self._perm[k * b:(k + 1) * b]

    def batch_samples(self, step: int) -> np.ndarray:
        return self.samples[self.batch_sample_ids(step)]

    def batch_lengths(self, step: int) -> np.ndarray:
        s = self.batch_samples(step)
        return s[:, 2] - s[:, 1]


def dataset_batches(prefix: str, global_batch_size: int, max_seq_len: int, seed: int,
                    steps: range) -> tuple[list[np.ndarray], str]:
    """The lengths of ``steps`` of a training run on the Megatron indexed dataset at ``prefix``
    (``train --data PREFIX --seed S --global-batch N --max-seq-len L``), and a line naming them."""
    for ext in (".bin", ".idx"):  # the prefix, or either of its files
        if prefix.endswith(ext):
            prefix = prefix[:-len(ext)]
    docs = IndexedDocuments(prefix)
    batches = GlobalBatches(docs.lengths, global_batch_size, max_seq_len, seed)
    split = f", {batches.split_documents:,} cut into pieces" if batches.split_documents else ""
    first, last = steps[0], steps[-1]
    which = f"step {first}" if first == last else f"steps {first}-{last}"
    source = (f"{prefix}: {batches.num_documents:,} documents{split}, batch {global_batch_size}, "
              f"at most {max_seq_len:,} tokens each, {which} from seed {seed}")
    return [batches.batch_lengths(k) for k in steps], source
