"""A real long-tailed corpus on every machine: the Python standard library's own sources.

``stdlib_corpus()`` tokenizes the ``.py`` files under ``sysconfig.get_paths()['stdlib']`` (without
``site-packages``/``dist-packages``, test suites and caches), one document per file followed by
``<eod>``, in sorted relative-path order, writes them once as a Megatron indexed dataset in a cache
directory and returns its path prefix. A ``PREFIX.json`` manifest next to it lists the files
(document i is file i), the tokenizer (kind, vocab_size, eod, pad) and the length statistics;
``corpus_tokenizer(prefix)`` returns the tokenizer that made a corpus.

Two tokenizers (``tokenizer=``):
- ``"bpe"`` (default): a byte-level BPE of ``vocab_size`` (default 2048) tokens trained on the same
  files (``data/tokenizer.py``; deterministic), saved as ``PREFIX.tokenizer.json`` beside the data.
- ``"byte"``: one token per UTF-8 byte (vocab 258); documents are ~3x longer.

The cache name carries the tokenizer (``byte`` / ``bpe2048``) and a hash of the file list and
contents, the tokenizer settings and (for BPE) the ``tokenizers`` version, so another Python (or an
edited file, or another vocabulary) gets its own dataset, and the same name always holds the same
bytes. Files appear atomically (tokenizer first, then the data, the manifest last), so a corpus is
complete when its manifest exists; an interrupted build is finished by the next call.

What it looks like (CPython 3.11.7, all 734 files, tokens incl. <eod>):
    bpe2048: documents 734, tokens 3.93M, p10 302, median 2.5K, p90 13.5K, p99 35K,
             max 213K (pydoc_data/topics.py); built in ~9 s on 2 CPU cores (train 4.6 s, encode 4.5 s).
    byte:    documents 734, tokens 12.1M, median 7.8K, p90 37K, p99 107K, max 757K.
With BPE 62% of the documents fit in 4K tokens, yet the longer ones still carry ~99% of the
attention work (sum of s^2): long-tailed like code corpora (PAPERS.md section 5). With byte tokens
nearly every document is over 4K, so samples cut at 4K would all have the same length.
Run ``python -m megatron_ext.data.corpus [--tokenizer byte]`` for the figures on this machine.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from megatron_ext.data.datasets import (DataError, IndexedDocuments, document_stats, indexed_dataset_exists,
                                        write_indexed_dataset)
from megatron_ext.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer
from megatron_ext.errors import MegatronExtError
from megatron_ext.files import replacing

logger = logging.getLogger(__name__)

CORPUS_FORMAT = 2  # bump when the document rule changes: it is part of the cache key
TOKENIZER_SUFFIX = ".tokenizer.json"  # PREFIX.tokenizer.json: the BPE tokenizer of corpus PREFIX
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def default_cache_dir() -> Path:
    """``$MEGATRON_EXT_CACHE`` or ``~/.cache/megatron_ext``."""
    env = os.environ.get("MEGATRON_EXT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "megatron_ext"


def stdlib_files(root: str | Path | None = None, max_files: int | None = None) -> list[Path]:
    """The corpus files, sorted by path relative to ``root``; the first ``max_files`` of them."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise DataError(f"standard library directory {root} does not exist")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                p = Path(dirpath) / name
                found.append((p.relative_to(root).as_posix(), p))
    found.sort(key=lambda x: x[0])
    if max_files is not None:
        if max_files < 1:
            raise DataError(f"max_files must be at least 1, got {max_files}")
        found = found[:max_files]
    if not found:
        raise DataError(f"no .py files under {root}")
    return [p for _, p in found]


TOKENIZERS = ("bpe", "byte")
BPE_RECIPE = 1  # bump when BPETokenizer.train_from_texts changes (pre-tokenizer, specials...): in the cache key


def _tokenizers_version() -> str:
    import tokenizers
    return tokenizers.__version__


def _check_tokenizer_args(tokenizer: str, vocab_size: int) -> None:
    if tokenizer not in TOKENIZERS:
        raise DataError(f"unknown corpus tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")
    if tokenizer == "bpe":
        try:
            BPETokenizer.check_vocab_size(vocab_size)
        except ValueError as e:
            raise DataError(str(e)) from None


def _tokenizer_tag(tokenizer: str, vocab_size: int) -> str:
    """The tokenizer part of the corpus name and key: ``byte`` or ``bpe<vocab_size>``."""
    return "byte" if tokenizer == "byte" else f"bpe{int(vocab_size)}"


def _corpus_key(root: Path, files: list[Path], contents: list[bytes], tokenizer: str, vocab_size: int) -> str:
    recipe = f"format={CORPUS_FORMAT};tokenizer={_tokenizer_tag(tokenizer, vocab_size)};"
    if tokenizer == "bpe":  # the trained vocabulary may depend on the library's version
        recipe += f"bpe_recipe={BPE_RECIPE};tokenizers={_tokenizers_version()};"
    h = hashlib.sha256(recipe.encode())
    for p, data in zip(files, contents):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(data).digest())
    return h.hexdigest()[:16]


def _decode_texts(files: list[Path], contents: list[bytes], root: Path) -> tuple[list[str], list[str]]:
    """The files as text (BPE works on text), and the ones that were not UTF-8 (their bad bytes
    become U+FFFD; none in CPython 3.11's library)."""
    texts, bad = [], []
    for p, data in zip(files, contents):
        try:
            texts.append(data.decode("utf-8"))
        except UnicodeDecodeError:
            texts.append(data.decode("utf-8", errors="replace"))
            bad.append(p.relative_to(root).as_posix())
    if bad:
        logger.warning("%d corpus file(s) are not UTF-8; their undecodable bytes become U+FFFD: %s",
                       len(bad), ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else ""))
    return texts, bad


def stdlib_corpus(cache_dir: str | Path | None = None, max_files: int | None = None,
                  rebuild: bool = False, root: str | Path | None = None,
                  tokenizer: str = "bpe", vocab_size: int = 2048) -> str:
    """Path prefix of the stdlib corpus as a Megatron indexed dataset, built if missing.

    ``tokenizer`` is ``"bpe"`` (a byte-level BPE of ``vocab_size`` tokens trained on the same
    files, saved as ``PREFIX.tokenizer.json``) or ``"byte"`` (one token per byte; ``vocab_size``
    is ignored). ``max_files`` keeps only the first files (sorted order) -- for tests; ``root``
    replaces the standard library directory. Same files, contents and tokenizer settings -> same
    prefix and identical bytes. Get the tokenizer of a corpus with ``corpus_tokenizer(prefix)``."""
    _check_tokenizer_args(tokenizer, vocab_size)
    root = Path(root) if root is not None else stdlib_root()
    files = stdlib_files(root, max_files)
    contents = []
    for p in files:
        try:
            contents.append(p.read_bytes())
        except OSError as e:
            raise DataError(f"cannot read {p}: {e.strerror}") from None
    key = _corpus_key(root, files, contents, tokenizer, vocab_size)
    tag = f"py{sys.version_info.major}.{sys.version_info.minor}"
    name = f"stdlib-{tag}-{len(files)}files-{_tokenizer_tag(tokenizer, vocab_size)}-{key}"
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    prefix = str(directory / name)
    manifest = Path(prefix + ".json")
    tok_path = Path(prefix + TOKENIZER_SUFFIX)
    if (not rebuild and indexed_dataset_exists(prefix) and manifest.exists()
            and (tokenizer == "byte" or tok_path.exists())):
        try:  # (a cut .bin, a garbled index, manifest or tokenizer: say the way out)
            IndexedDocuments(prefix)
            corpus_tokenizer(prefix)
        except DataError as e:
            raise DataError(f"{e}; the corpus cache is damaged: `python -m megatron_ext.data.corpus --rebuild` "
                            f"makes it anew") from None
        return prefix
    logger.info("building the stdlib corpus from %d files under %s into %s", len(files), root, prefix)
    start = time.perf_counter()
    info: dict = {"format": CORPUS_FORMAT, "tokenizer": tokenizer}
    lengths: list[int] = []
    if tokenizer == "byte":
        tok = ByteTokenizer()
        docs = (tok.encode_bytes(data, append_eod=True) for data in contents)
    else:
        texts, bad = _decode_texts(files, contents, root)
        tok = None
        if not rebuild and tok_path.exists():  # trained by an interrupted build of the same files
            try:
                tok = BPETokenizer.load(tok_path)
            except (OSError, ValueError) as e:
                logger.warning("retraining the corpus tokenizer: %s", e)
        if tok is None:
            tok = BPETokenizer.train_from_texts(texts, vocab_size)
            tok.save(tok_path)
        logger.info("BPE tokenizer (%d tokens) ready after %.1f s", tok.vocab_size, time.perf_counter() - start)
        docs = tok.encode_many(texts, append_eod=True)
        info.update({"tokenizer_file": tok_path.name, "tokenizer_sha256": tok.fingerprint,
                     "requested_vocab_size": int(vocab_size), "tokenizers_version": _tokenizers_version(),
                     "non_utf8_files": bad})

    def counted(it):
        for d in it:
            lengths.append(int(d.size))
            yield d

    write_indexed_dataset(prefix, counted(docs), dtype=tok.dtype)
    info.update({"vocab_size": tok.vocab_size, "eod": tok.eod, "pad": tok.pad, "dtype": np.dtype(tok.dtype).name,
                 "python": sys.version.split()[0], "root": str(root),
                 "files": [p.relative_to(root).as_posix() for p in files],
                 "stats": _stats(lengths)})
    with replacing(manifest) as tmp:
        tmp.write_text(json.dumps(info, indent=1))
    logger.info("built %s (%d documents, %d tokens) in %.1f s", prefix, len(lengths), sum(lengths),
                time.perf_counter() - start)
    return prefix


def _stats(lengths) -> dict:
    """``document_stats`` with the 10th percentile added."""
    stats = document_stats(lengths)
    if not stats["documents"]:
        return stats
    p10 = float(np.percentile(np.asarray(lengths, dtype=np.int64), 10))
    out = {}
    for k, v in stats.items():
        if k == "median":
            out["p10"] = p10
        out[k] = v
    return out


def _strip_prefix(prefix: str | Path) -> str:
    prefix = str(prefix)
    for ext in (".bin", ".idx", ".json"):
        if prefix.endswith(ext) and not prefix.endswith(TOKENIZER_SUFFIX):
            return prefix[:-len(ext)]
    return prefix


def corpus_manifest(prefix: str | Path) -> dict:
    """The manifest written next to a corpus: files in document order, tokenizer, statistics."""
    prefix = _strip_prefix(prefix)
    try:
        manifest = json.loads(Path(prefix + ".json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"no readable manifest for corpus {prefix}: {e}") from None
    if not isinstance(manifest, dict):
        raise DataError(f"no readable manifest for corpus {prefix}: {prefix}.json holds no JSON object")
    return manifest


def corpus_tokenizer(prefix: str | Path) -> Tokenizer:
    """The tokenizer that made the corpus at ``prefix`` (from its manifest, and for BPE the
    ``PREFIX.tokenizer.json`` beside it): what a trainer needs for ``vocab_size``, ``eod``, ``pad``."""
    prefix = _strip_prefix(prefix)
    m = corpus_manifest(prefix)
    kind = m.get("tokenizer")
    if kind == "byte":
        tok = ByteTokenizer()
    elif kind == "bpe":
        if "tokenizer_file" not in m:
            raise DataError(f"the manifest of corpus {prefix} names no tokenizer file")
        path = Path(prefix).parent / m["tokenizer_file"]
        try:
            tok = BPETokenizer.load(path)
        except (OSError, ValueError) as e:
            raise DataError(f"cannot load the tokenizer of corpus {prefix}: {e}") from None
        if m.get("tokenizer_sha256") not in (None, tok.fingerprint):
            raise DataError(f"{path} is not the tokenizer corpus {prefix} was built with (sha256 differs)")
    else:
        raise DataError(f"corpus {prefix} was made by an unknown tokenizer {kind!r}")
    for field in ("vocab_size", "eod", "pad"):
        if field in m and m[field] != getattr(tok, field):
            raise DataError(f"corpus {prefix}: the manifest says {field} {m[field]}, its tokenizer has "
                            f"{getattr(tok, field)}")
    return tok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_ext.data.corpus",
                                 description="Build (if missing) the stdlib corpus and print its length statistics.")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--max-files", type=int, default=None)
    ap.add_argument("--tokenizer", choices=TOKENIZERS, default="bpe")
    ap.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary size (default 2048)")
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    try:  # (bad input one line, as the CLI's)
        prefix = stdlib_corpus(args.cache_dir, args.max_files, args.rebuild, tokenizer=args.tokenizer,
                               vocab_size=args.vocab_size)
        tok = corpus_tokenizer(prefix)
        stats = _stats(IndexedDocuments(prefix).lengths)
    except (MegatronExtError, OSError) as e:
        why = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.strerror else e
        print(f"{ap.prog}: error: {why}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (the cache keeps only whole files: a rerun builds what is missing)
        print(f"{ap.prog}: interrupted", file=sys.stderr)
        return 130
    seconds = time.perf_counter() - start
    extra = {"tokenizer": _tokenizer_tag(args.tokenizer, tok.vocab_size), "vocab_size": tok.vocab_size,
             "eod": tok.eod, "pad": tok.pad, "seconds": round(seconds, 2)}
    if args.json:
        print(json.dumps({"prefix": prefix, **extra, **stats}))
    else:
        print(f"corpus: {prefix} (ready in {seconds:.1f} s)")
        for k, v in {**{k: v for k, v in extra.items() if k != "seconds"}, **stats}.items():
            print(f"  {k:>24}: {v:,.3f}" if isinstance(v, float) else
                  f"  {k:>24}: {v:,}" if isinstance(v, int) else f"  {k:>24}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
