"""Which documents each training step's global batch holds, from document lengths alone.

Documents longer than ``max_seq_len`` are cut into consecutive ``max_seq_len`` pieces; the pieces
are the samples. Each epoch is a permutation of the samples drawn from ``(seed, epoch)``; step k
takes ``global_batch_size`` consecutive samples of its epoch (an epoch's remainder is not used).

A weighted blend of sources (Megatron's ``--data-path W1 PREFIX1 W2 PREFIX2``) gives every source
its share of each batch: the k * batch samples of steps 0..k-1 are divided between the two halves
of the source list by their weights, rounded to the nearest sample, then each half between its
halves, and so on, so source i's cumulative count stays within ceil(log2 n) / 2 samples of
w_i * k * batch (n sources: half a sample for two) and never decreases. A step's share is the
difference of two such counts: no state, any step at once. Each source runs through its own epochs (permutations drawn from ``(seed, i,
epoch)``), so a small source with a large weight is seen several times while a large one is
not finished (and a batch where such a source starts a new epoch may hold one of its samples
twice, as in Megatron's own blends). Unweighted sources (``PREFIX1 PREFIX2``: Megatron weighs
them by size) are one dataset, their documents one after another.

The batches depend on the data, the seed, the batch size, the weights and ``max_seq_len`` only --
never on the planner -- so every planner, and ``plan`` / ``simulate --data`` on a laptop, see the
batches a training run sees.
"""
from __future__ import annotations

import logging
import math

import numpy as np

from megatron_ext.data.datasets import DataError, blend_documents, open_blend
from megatron_ext.data.lengths import MAX_BATCH, check_seed, cut_documents
from megatron_ext.text import plural

logger = logging.getLogger(__name__)

# The last step a run may reach: a blend's shares count samples of steps 0..k as floats, exact
# below 2^53 (steps x the largest batch).
MAX_STEP = 2**53 // MAX_BATCH - 1


class TooFewSamples(DataError):
    """The documents (or a source of a blend) make fewer samples than one global batch takes."""


def make_samples(doc_lengths, max_seq_len: int) -> np.ndarray:
    """Samples of the documents, shape [n, 3]: (doc, start, end). A document longer than
    ``max_seq_len`` becomes consecutive pieces of ``max_seq_len`` tokens (the last shorter);
    samples of under 2 tokens are left out (``cut_documents``)."""
    if max_seq_len < 1:
        raise DataError(f"max_seq_len must be at least 1, got {max_seq_len}")
    return cut_documents(doc_lengths, max_seq_len)  # the one rule, shared with --dist sampling


class GlobalBatches:
    """The global batch of every step: ``batch_sample_ids(k)`` index ``samples`` ((doc, start,
    end) rows), and the batch's seq ids index those ids in order. ``source_sizes`` and
    ``weights``: the documents are sources one after another, ``source_sizes[i]`` documents each,
    blended by ``weights`` (see the module doc; ``steps_per_epoch`` is then None)."""

    def __init__(self, doc_lengths, global_batch_size: int, max_seq_len: int, seed: int = 0,
                 shuffle: bool = True, source_sizes=None, weights=None):
        if not 1 <= global_batch_size <= MAX_BATCH:
            raise DataError(f"the global batch must be from 1 to {MAX_BATCH:,} sequences, got {global_batch_size:,}")
        check_seed(seed, DataError)
        self.global_batch_size = int(global_batch_size)
        self.max_seq_len = int(max_seq_len)
        self.seed = int(seed)
        self.shuffle = shuffle
        doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
        self.samples = make_samples(doc_lengths, self.max_seq_len)
        self.num_documents = int(doc_lengths.size)
        self.split_documents = int(np.count_nonzero(doc_lengths > self.max_seq_len))
        if self.split_documents:
            logger.info("%d document(s) longer than %d tokens are split into pieces of at most %d tokens "
                        "(%d samples from %d documents)", self.split_documents, self.max_seq_len,
                        self.max_seq_len, len(self.samples), self.num_documents)
        self._perms: dict[int, dict[int, np.ndarray]] = {}  # per source (-1: no blend), recent epochs
        self.weights = None if weights is None or len(weights) < 2 else self._blend(source_sizes, weights)
        if self.weights is None:
            if len(self.samples) < self.global_batch_size:
                raise TooFewSamples(f"the dataset has {plural(len(self.samples), 'sample')}, fewer than one global batch "
                                f"of {self.global_batch_size}")
            self.steps_per_epoch = len(self.samples) // self.global_batch_size
        else:
            self.steps_per_epoch = None

    def _blend(self, source_sizes, weights) -> np.ndarray:
        w = np.asarray(weights, dtype=np.float64)
        if source_sizes is None or len(source_sizes) != w.size:
            raise DataError(f"a blend of {w.size} weights needs the document count of each of its sources")
        if not (np.all(np.isfinite(w)) and np.all(w >= 0) and w.max() > 0):
            raise DataError(f"blend weights must be non-negative numbers, not all zero: {list(weights)}")
        w = w / w.max()  # first: a sum of huge weights would overflow
        w = w / w.sum()
        bounds = np.concatenate([[0], np.cumsum(source_sizes)])
        if bounds[-1] != self.num_documents:
            raise DataError(f"the sources hold {bounds[-1]} documents, the dataset {self.num_documents}")
        # the samples run in document order and each source is a range of documents: source i's
        # samples are a range too, [sample_bounds[i], sample_bounds[i + 1]) (no per-sample owner)
        self._sample_bounds = np.searchsorted(self.samples[:, 0], bounds).astype(np.int64)
        for i, size in enumerate(np.diff(self._sample_bounds).tolist()):
            need = math.ceil(w[i] * self.global_batch_size - 1e-9)
            if size < need:
                raise TooFewSamples(f"source {i} of the blend has {plural(size, 'sample')}, fewer than its share of one "
                                f"global batch ({need} of {self.global_batch_size} at weight {w[i]:.3g})")
        self._weight_sums = np.concatenate([[0.0], np.cumsum(w)])
        return w

    def _perm(self, source: int, epoch: int, n: int) -> np.ndarray:
        recent = self._perms.setdefault(source, {})
        if epoch not in recent:
            for old in [e for e in recent if e < epoch - 1]:  # steps move forward: keep two epochs
                del recent[old]
            seed = [self.seed, epoch] if source < 0 else [self.seed, source, epoch]
            # in the samples' dtype (int32 where they fit: half the memory); shuffling an arange in
            # place draws what Generator.permutation(n) draws
            perm = np.arange(n, dtype=self.samples.dtype)
            if self.shuffle:
                np.random.default_rng(seed).shuffle(perm)
            recent[epoch] = perm
        return recent[epoch]

    def _blend_counts(self, step: int) -> np.ndarray:
        """Samples of each source in steps 0..step-1 (the module doc's halving)."""
        counts = np.zeros(self.weights.size, dtype=np.int64)
        sums = self._weight_sums

        def share(total: int, lo: int, hi: int) -> None:
            if hi - lo == 1:
                counts[lo] = total
                return
            mid = (lo + hi) // 2
            whole = sums[hi] - sums[lo]
            left = int(math.floor((sums[mid] - sums[lo]) / whole * total + 0.5)) if whole > 0 else 0
            share(left, lo, mid)
            share(total - left, mid, hi)

        share(int(step) * self.global_batch_size, 0, self.weights.size)
        return counts

    def batch_sample_ids(self, step: int) -> np.ndarray:
        """Sample ids of step ``step``'s global batch (its seq ids index this array)."""
        step = int(step)
        if not 0 <= step <= MAX_STEP:
            raise DataError(f"step {step:,} is not a step of a run: steps are numbered 0 to {MAX_STEP:,}")
        b = self.global_batch_size
        if self.weights is None:
            epoch, k = divmod(step, self.steps_per_epoch)
            return self._perm(-1, epoch, len(self.samples))[k * b:(k + 1) * b].astype(np.int64)
        lo, hi = self._blend_counts(step), self._blend_counts(step + 1)
        parts = []
        for i, (first, end) in enumerate(zip(self._sample_bounds[:-1].tolist(), self._sample_bounds[1:].tolist())):
            size = end - first
            pos = np.arange(lo[i], hi[i])
            for epoch in np.unique(pos // size) if pos.size else ():
                at = pos[pos // size == epoch] % size
                parts.append(first + self._perm(i, int(epoch), size)[at].astype(np.int64))
        return np.concatenate(parts)

    def batch_samples(self, step: int) -> np.ndarray:
        return self.samples[self.batch_sample_ids(step)].astype(np.int64)  # (held as int32 where they fit)

    def batch_lengths(self, step: int) -> np.ndarray:
        s = self.batch_samples(step)
        return s[:, 2] - s[:, 1]


def sources_text(prefixes: list[str], sizes: list[int] | None, weights) -> str:
    """The data's name: its prefix, or each source of a blend with its documents and (weighted:
    ``GlobalBatches.weights``) its share of every batch."""
    if sizes is None:
        return prefixes[0]
    return " + ".join(f"{p} ({plural(n, 'document')}{f', {100 * w:.3g}% of each batch' if weights is not None else ''})"
                      for p, n, w in zip(prefixes, sizes, weights if weights is not None else [None] * len(sizes)))


def dataset_batches(values, global_batch_size: int, max_seq_len: int, seed: int,
                    steps: range) -> tuple[list[np.ndarray], str]:
    """The lengths of ``steps`` of a training run on Megatron indexed datasets: ``values`` as
    Megatron's ``--data-path`` takes them (``open_blend``: one prefix or a blend), and a line
    naming them."""
    sources = open_blend(values)
    docs, sizes, weights = blend_documents(sources)
    batches = GlobalBatches(docs.lengths, global_batch_size, max_seq_len, seed, source_sizes=sizes,
                            weights=weights)
    name = sources_text([d.prefix for _, d in sources], sizes, batches.weights)
    split = f", {batches.split_documents:,} cut into pieces" if batches.split_documents else ""
    first, last = steps[0], steps[-1]
    which = f"step {first}" if first == last else f"steps {first}-{last}"
    source = (f"{name}: {plural(batches.num_documents, 'document')}{split}, batch {global_batch_size}, "
              f"at most {max_seq_len:,} tokens each, {which} from seed {seed}")
    return [batches.batch_lengths(k) for k in steps], source
