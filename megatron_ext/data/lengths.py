"""Sequence-length batches: lengths files and synthetic long-tailed distributions.

The distributions follow the published shapes (PAPERS.md section 5): a lognormal body with a
Pareto tail mixed in, so the few very long documents that dominate attention work are there.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_ext.errors import LengthsError
from megatron_ext.files import TooBigError, read_text
from megatron_ext.spec import MAX_LENGTH


@dataclass(frozen=True)
class LengthDistribution:
    """Lognormal(mu, sigma) body; with probability ``tail_p`` a Pareto(alpha) draw above ``tail_min``."""

    name: str
    mu: float
    sigma: float
    tail_p: float
    tail_min: float
    tail_alpha: float
    note: str

    def documents(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n document lengths >= 1 at their natural lengths (the tail is not truncated)."""
        body = rng.lognormal(self.mu, self.sigma, n)
        tail = self.tail_min * (1.0 + rng.pareto(self.tail_alpha, n))
        return np.maximum(1, np.minimum(np.where(rng.random(n) < self.tail_p, tail, body), 2.0**62)).astype(np.int64)

    def sample(self, n: int, rng: np.random.Generator, max_len: int | None = None) -> np.ndarray:
        """n training sequences: documents drawn at their natural lengths, those over ``max_len``
        cut in place into pieces of ``max_len`` tokens (the last shorter), as training cuts them
        (``cut_documents``, which data/batches.make_samples uses); the first n pieces. A larger
        ``max_len`` keeps the long documents longer (and makes fewer pieces of them); where no
        document is over it, the batch is the one the documents make."""
        out = np.empty(0, dtype=np.int64)
        while out.size < n:
            k = 2 * (n - out.size) + 16
            x = self.documents(k, rng)
            if max_len is not None:
                # no more than n pieces of one document can be kept: shorten the rest away first
                x = np.minimum(x, int(max_len) * (n + 1))
                cut = cut_documents(x, int(max_len))
                x = (cut[:, 2] - cut[:, 1]).astype(np.int64)
            out = np.concatenate([out, x])
        return out[:n]


# The rule by which cut_documents makes samples, named in checkpoints (a resumed run must draw the
# batches the saved one would have): a new rule, a new name.
SAMPLE_RULE = "pieces of max_seq_len, under 2 tokens left out"


CUT_BLOCK = 1 << 22  # documents cut at a time: the temporaries stay ~0.3 GB however large the corpus
INT32_END = 2**31  # samples are held as int32 where every value they hold, or index them by, is below it


def cut_documents(doc_lengths, max_seq_len: int) -> np.ndarray:
    """How training cuts documents into samples, shape [n, 3]: (doc, start, end). A document
    longer than ``max_seq_len`` becomes consecutive pieces of ``max_seq_len`` tokens (the last
    shorter); a document or last piece of under 2 tokens is left out (no token of it predicts
    another: a step of only such samples would have no loss). int32 where every value fits (each
    rank holds these: 12 bytes a sample, not 24, and cut block by block, no int64 temporaries of
    the whole corpus: 100M documents peaked at 9 GB)."""
    lengths = np.asarray(doc_lengths)
    n = int(lengths.size)

    def blocks():
        return (lengths[lo:lo + CUT_BLOCK].astype(np.int64) for lo in range(0, n, CUT_BLOCK))

    def pieces_of(block: np.ndarray) -> np.ndarray:
        return -(-block // max_seq_len)  # 0 for empty documents

    def kept_of(block: np.ndarray, pieces: np.ndarray) -> int:
        """Samples kept: the full pieces (max_seq_len tokens each: none under 2), and each last
        piece of 2 tokens or more."""
        full = int(np.maximum(pieces - 1, 0).sum()) if max_seq_len >= 2 else 0
        return full + int(np.count_nonzero((pieces > 0) & (block - (pieces - 1) * max_seq_len >= 2)))

    kept = sum(kept_of(b, pieces_of(b)) for b in blocks())
    # (the values: document ids, token offsets, and the sample ids that index these rows elsewhere)
    dtype = np.int32 if max(n, kept, int(lengths.max(initial=0))) < INT32_END else np.int64
    out = np.empty((kept, 3), dtype=dtype)
    at = 0
    for i, block in enumerate(blocks()):
        pieces = pieces_of(block)
        doc = np.repeat(np.arange(block.size, dtype=np.int64), pieces)
        start = (np.arange(doc.size, dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * max_seq_len
        end = np.minimum(start + max_seq_len, block[doc])
        keep = end - start >= 2
        k = int(np.count_nonzero(keep))
        out[at:at + k, 0] = doc[keep] + i * CUT_BLOCK
        out[at:at + k, 1] = start[keep]
        out[at:at + k, 2] = end[keep]
        at += k
    assert at == kept  # (every row written: the count above is the one rule's)
    return out


DISTRIBUTIONS = {
    d.name: d
    for d in (
        LengthDistribution("wikipedia", 5.95, 1.26, 0.03, 2500, 1.3,
                           "median ~350, p99 ~11K, p99.9 ~37K, heavy tail"),
        LengthDistribution("commoncrawl", 6.4, 1.25, 0.035, 4000, 1.2,
                           "between Wikipedia and GitHub"),
        LengthDistribution("github", 6.9, 1.4, 0.04, 4000, 1.3,
                           "most files under 16K, ~0.3% over 64K"),
        LengthDistribution("lmsys", 5.6, 1.0, 0.002, 4000, 0.9,
                           "chat: >99% under 4K, rare very long"),
    )
}


MAX_BATCH = 2**20  # sequences in one batch: past this, a typo (hours of planning, gigabytes to draw)
MAX_SEED = 2**63 - 1  # (torch's seeds are 64-bit signed)


def check_seed(seed: int, error: type[Exception] = LengthsError) -> None:
    """Refuse a seed the random streams cannot take (as ``error``: the caller's kind of bad input)."""
    if not 0 <= seed <= MAX_SEED:
        raise error(f"--seed must be from 0 to 2^63 - 1, got {seed}")


def sample_lengths(dist: str, batch: int, seed: int, max_len: int | None = None) -> np.ndarray:
    if dist not in DISTRIBUTIONS:
        raise LengthsError(f"unknown length distribution {dist!r}; choose one of {', '.join(DISTRIBUTIONS)}")
    if not 1 <= batch <= MAX_BATCH:
        raise LengthsError(f"--batch must be from 1 to {MAX_BATCH:,} sequences, got {batch:,}")
    check_seed(seed)
    if max_len is not None:
        if max_len < 2:  # (every piece would be left out: the batch would never fill)
            raise LengthsError(f"--max-seq-len must be at least 2 tokens (one token predicts nothing), got {max_len:,}")
        max_len = min(int(max_len), MAX_LENGTH)  # (a limit from a cost model that holds any length)
    return DISTRIBUTIONS[dist].sample(batch, np.random.default_rng(seed), max_len)


def read_lengths(path: str | Path) -> np.ndarray:
    """One positive integer per line; blank lines and '#' comments are ignored."""
    try:
        text = read_text(path, 2**28)  # (256 MB: ~30 million lengths)
    except OSError as e:
        raise LengthsError(f"cannot read lengths file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise LengthsError(f"lengths file {path} is not text") from None
    except TooBigError as e:
        raise LengthsError(f"lengths file {path} is too big to be one: {e}") from None
    values = []
    # (a BOM: some editors' UTF-8; lines end at \r\n, \r or \n: splitlines would also cut one at a
    # form feed or \x85, into two lengths)
    for no, line in enumerate(re.split(r"\r\n|\r|\n", text.removeprefix("\ufeff")), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if re.fullmatch(r"-?[0-9]+", line) is None:  # (not int()'s "1_000" or "+5": a length file is plain digits)
            raise LengthsError(f"{path}:{no}: expected one integer per line, got {line[:40]!r}")
        if len(line.lstrip("-")) > 19:  # (int() refuses 4,300 digits)
            raise LengthsError(f"{path}:{no}: a sequence length must be at most {MAX_LENGTH:,} tokens, got "
                               f"{line[:40]}...")
        v = int(line)
        if v < 1:
            raise LengthsError(f"{path}:{no}: a sequence length must be positive, got {v}")
        if v > MAX_LENGTH:
            raise LengthsError(f"{path}:{no}: a sequence length must be at most {MAX_LENGTH:,} tokens, got {v:,}")
        values.append(v)
        if len(values) > MAX_BATCH:
            raise LengthsError(f"lengths file {path} holds more than {MAX_BATCH:,} lengths, the most a batch may "
                               f"hold: split it into batches of at most that many")
    if not values:
        raise LengthsError(f"lengths file {path} holds no lengths")
    return np.asarray(values, dtype=np.int64)


