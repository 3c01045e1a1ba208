"""The dataset provider of ``--flexsp`` and ``--elastic-pp`` runs: planned steps over whole documents.

Megatron's GPT datasets cut the token stream into fixed ``--seq-length`` samples; FlexSP and elastic
pipelines train on whole documents of their own lengths. So the provider returns, for train /
valid / test, an iterator of ``megatron_ext.data.loader.Step`` (one per training iteration: the
global batch of ``--global-batch-size`` documents and its plan), made by a
``PlanningDataLoader`` that plans one step ahead in a background process on rank 0 and
broadcasts each plan. Megatron passes these iterators through untouched
(``--dataloader-type external``) to the forward-backward function of ``megatron/step.py``.

Documents come from:

* ``--data-path PREFIX``: a Megatron indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``, as made by
  Megatron's ``tools/preprocess_data.py`` or ``megatron_ext.data.datasets.write_indexed_dataset``),
  one entry per document; ``--split`` divides the documents (in file order) into train, valid
  and test ranges by its ratios. A blend (``--data-path W1 PREFIX1 W2 PREFIX2 ...``) splits each
  dataset so, and gives each its weight's share of every global batch
  (``megatron_ext.data.batches``); unweighted prefixes are one dataset, one after another;
* ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path`` (each a prefix or a blend,
  taken whole), or any of these read from ``--data-args-path`` / ``--per-split-data-args-path``
  as Megatron reads them (``data_blends``);
* ``--mock-data``: synthetic documents, their lengths drawn from a long-tailed distribution
  (``megatron_ext.data.lengths``, "wikipedia"), their tokens random ids below the tokenizer's
  vocabulary size ending in ``<eod>``, all from ``--seed``: every rank sees the same documents.

Documents longer than ``--seq-length`` (with ``--flexsp``, or than the longest sequence the cost
model can place in one SP group) are cut into consecutive pieces of that length; the pieces are the
samples. Step k of a run
resumed at iteration k reads the same batch as an uninterrupted run.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from megatron_ext.data.datasets import DataError, HeldLengths
from megatron_ext.data.lengths import DISTRIBUTIONS

MOCK_DOCUMENTS = 16384
MOCK_DISTRIBUTION = "wikipedia"


class MockDocuments(HeldLengths):
    """Seeded synthetic documents (the ``Documents`` protocol): lengths from a long-tailed
    distribution capped at ``max_len``, tokens uniform below ``vocab_size`` with ``eod`` last.
    A document's tokens depend only on (seed, index): nothing is held in memory."""

    def __init__(self, num_docs: int, vocab_size: int, eod: int, seed: int, max_len: int,
                 distribution: str = MOCK_DISTRIBUTION):
        if vocab_size < 2:
            raise DataError(f"mock data needs a vocabulary of at least 2 tokens, got {vocab_size}")
        self.vocab_size, self.eod, self.seed = int(vocab_size), int(eod), int(seed)
        rng = np.random.default_rng([self.seed, 0x6D6F636B])
        self._lengths = np.maximum(DISTRIBUTIONS[distribution].sample(int(num_docs), rng, int(max_len)), 2)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        n = int(self._lengths[i])
        length = n - offset if length is None else length
        if not 0 <= offset <= offset + length <= n:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for mock document {i} of {n}")
        tokens = np.random.default_rng([self.seed, 1, int(i)]).integers(0, self.vocab_size, n, dtype=np.int64)
        tokens[-1] = self.eod
        return tokens[offset:offset + length]


class SubsetDocuments:
    """Documents [start, end) of another ``Documents``."""

    def __init__(self, documents, start: int, end: int):
        if not 0 <= start <= end <= len(documents):
            raise DataError(f"document range [{start}, {end}) is outside the {len(documents)} documents")
        self.documents, self.start, self.end = documents, int(start), int(end)

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray(self.documents.lengths)[self.start:self.end]

    def __len__(self) -> int:
        return self.end - self.start

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"document {i} out of range (there are {len(self)})")
        return self.documents.get(self.start + int(i), offset, length)


def split_ranges(num_docs: int, split: str | None) -> list[tuple[int, int]]:
    """Megatron's ``--split`` ("969,30,1", "90,5,5", "100,0,0"; default all train) as document
    ranges [start, end) for train, valid and test, read and rounded as Megatron's dataset builder
    does (``parse_and_normalize_split``, then each bound at round(fraction * documents))."""
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    text = split or "1"
    try:
        with np.errstate(invalid="ignore", divide="ignore"):
            ratios = parse_and_normalize_split(text)
    except AssertionError:  # more than three proportions
        ratios = [math.nan]
    if not all(math.isfinite(r) for r in ratios) or "-" in text:
        raise DataError(f"--split {split!r}: expected up to three non-negative proportions, e.g. 969,30,1")
    bounds = [int(round(f * num_docs)) for f in np.cumsum([0.0, *ratios])]
    bounds[-1] = num_docs
    return [(bounds[k], bounds[k + 1]) for k in range(3)]


SPLITS = ("train", "valid", "test")


def mock_document_count(split: str | None, global_batch: int) -> int:
    """Mock documents enough for two global batches in every split ``--split`` gives a share
    (Megatron's mock data makes as many samples as a run asks; "990,9,1" leaves 1% of the default
    count to validation, under one batch of 512), up to 2^24."""
    served = [b > a for a, b in split_ranges(2**24, split)]
    n = MOCK_DOCUMENTS
    while n < 2**24 and any(k and b - a < 2 * global_batch for k, (a, b) in zip(served, split_ranges(n, split))):
        n *= 2
    return n


def data_blends(args) -> tuple[list[str] | None, list[list[str] | None] | None]:
    """Megatron's data arguments as value lists ``parse_blend`` reads: (the ``--data-path`` values,
    to be split by ``--split``; None) or (None, the train / valid / test values of
    ``--train-data-path`` ..., None for a split not given), read from ``--data-args-path``
    (whitespace-separated) or ``--per-split-data-args-path`` (JSON, lists or strings under
    "train", "valid", "test") as Megatron reads them. (None, None) with no data argument."""
    import json

    def read(path: str) -> str:
        try:
            with open(path) as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"cannot read {path}: {e}") from None

    if getattr(args, "data_args_path", None):
        return read(args.data_args_path).split(), None
    if getattr(args, "data_path", None):
        return list(args.data_path), None
    if getattr(args, "per_split_data_args_path", None):
        try:
            spec = json.loads(read(args.per_split_data_args_path))
            per_split = [spec.get(k) for k in SPLITS]
        except (json.JSONDecodeError, AttributeError):
            raise DataError(f"{args.per_split_data_args_path}: expected a JSON object with \"train\", \"valid\" "
                            f"and \"test\" lists") from None
        for k, v in zip(SPLITS, per_split):
            if not (v is None or isinstance(v, str) or isinstance(v, list) and all(
                    isinstance(x, (str, int, float)) and not isinstance(x, bool) for x in v)):
                raise DataError(f"{args.per_split_data_args_path}: \"{k}\" must be a string or a list of prefixes "
                                f"(and weights), got {json.dumps(v)}")
        return None, [v.split() if isinstance(v, str) else (list(map(str, v)) if v else None) for v in per_split]
    per_split = [getattr(args, f"{k}_data_path", None) or None for k in SPLITS]
    return None, (per_split if any(per_split) else None)


def planned_splits(args, tokenizer) -> list[tuple[object, list[int] | None, list[float] | None, str]]:
    """Train, valid and test: (documents, source sizes, weights, what they are) each. Mock
    documents or one ``--data-path`` (a prefix or a blend) are cut by ``--split``, every dataset of
    a blend on its own (as Megatron splits them); per-split paths are taken whole. Sizes and
    weights are what ``GlobalBatches`` blends by (None unless the sources are weighted)."""
    from megatron_ext.data.datasets import InMemoryDocuments, blend_documents, open_blend

    if getattr(args, "mock_data", False):
        mock = MockDocuments(mock_document_count(args.split, int(args.global_batch_size)), tokenizer.vocab_size,
                             tokenizer.eod, args.seed, max_len=4 * int(args.seq_length))
        return [(*split, "mock") for split in split_sources([(None, mock)], args.split)]

    def named(sources) -> str:
        return " + ".join(f"{w:g} x {d.prefix}" if w is not None else d.prefix for w, d in sources)

    whole, per_split = data_blends(args)
    if whole is not None:
        sources = open_blend(whole)
        return [(*split, named(sources)) for split in split_sources(sources, args.split)]
    out = []
    for values in per_split:
        if values is None:
            out.append((InMemoryDocuments([]), None, None, "none"))
        else:
            sources = open_blend(values)
            out.append((*blend_documents(sources), named(sources)))  # taken whole
    return out


def split_sources(sources, split: str | None) -> list[tuple[object, list[int] | None, list[float] | None]]:
    """Train, valid and test: each source cut by ``--split`` (as Megatron splits every dataset of a
    blend), one split's parts one after another, with the part sizes and weights ``GlobalBatches``
    blends by (None unless the sources are weighted)."""
    from megatron_ext.data.datasets import blend_documents

    ranges = [split_ranges(len(docs), split) for _, docs in sources]
    return [blend_documents([(w, SubsetDocuments(docs, *r[k])) for (w, docs), r in zip(sources, ranges)])
            for k in range(3)]


def make_loader(documents, cost, args, *, num_steps: int | None, start_step: int, seed: int,
                source_sizes=None, weights=None):
    """The PlanningDataLoader of one split, configured from Megatron's and megatron_ext's args:
    with ``--elastic-pp`` the elastic_pp planner on ``--pipeline-model-parallel-size`` stages of SP
    degree ``--elastic-pp-sp`` (set by ``arguments.validate_args``; below GPUs / stages, that many
    / SP pipeline replicas side by side; ``auto``: the auto planner on those stages, any degree per
    step), batch 1F1B when a plan is late; else ``--flexsp-planner``
    (``auto``: each step FlexSP or one-stage pipeline replicas; BatchAda when late)."""
    from megatron_ext.data.loader import PlanningDataLoader
    from megatron_ext.planner import PlannerOptions

    limit = float(args.planner_time_limit)
    if getattr(args, "elastic_pp", False):
        # A pipeline cuts a long sequence into slices: --seq-length bounds it, and what the finest
        # slicing of a stage holds (documents are cut at the lower, not dropped). Without
        # --adaptive-recompute a step recomputes nothing if it fits, else every layer ("auto").
        from megatron_ext.planner.api import max_seq_len

        pp = int(args.pipeline_model_parallel_size)
        auto = args.elastic_pp_sp == "auto"  # per step, the SP degree (and replicas) the simulator finds fastest
        options = PlannerOptions(time_limit=limit, drop_over_max=True, pp=pp,
                                 sp=None if auto else int(args.elastic_pp_sp),
                                 recompute="ilp" if args.adaptive_recompute else "auto",
                                 flexsp=pp == 1)  # (a model cut into stages cannot run FlexSP's passes)
        planner, fallback = ("auto" if auto else "elastic_pp"), "batch_1f1b"
        max_len = min(int(args.seq_length), max_seq_len(planner, cost, options))
        options = dataclasses.replace(options, max_seq_len=max_len)
    elif args.flexsp_planner == "auto":
        # FlexSP or one-stage pipeline replicas (which slice what no group holds), per step
        from megatron_ext.planner.api import max_seq_len

        options = PlannerOptions(time_limit=limit, drop_over_max=True, pp=1,
                                 recompute="ilp" if args.adaptive_recompute else "auto")
        max_len = min(int(args.seq_length), max_seq_len("auto", cost, options))
        options = dataclasses.replace(options, max_seq_len=max_len)
        planner, fallback = "auto", "batchada"
    else:
        # (static_ulysses: what its degree's groups hold, so documents are cut there, not dropped)
        from megatron_ext.planner.api import group_limit

        max_len = min(int(args.seq_length), group_limit(args.flexsp_planner, cost, args.flexsp_static_degree))
        options = PlannerOptions(time_limit=limit, static_degree=args.flexsp_static_degree, drop_over_max=True,
                                 max_seq_len=max_len)
        planner, fallback = args.flexsp_planner, "batchada"
    return PlanningDataLoader(documents, cost, int(args.global_batch_size), planner=planner, options=options,
                              seed=seed, max_seq_len=max_len, num_steps=num_steps, start_step=start_step,
                              background=int(args.plan_ahead) >= 1, fallback=fallback, sync="broadcast",
                              source_sizes=source_sizes, weights=weights)
