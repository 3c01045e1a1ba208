"""Writing output files whole or not at all."""
from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` (same folder, same suffix: writers that go by the suffix
    still can) for the block to write; renamed over ``path`` when the block ends, removed if it
    fails: a failed or cut-short write leaves the old file as it was and no part of the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


class TooBigError(ValueError):
    """An input file over the size its reader takes."""


def read_text(path: str | Path, limit_bytes: int) -> str:
    """The UTF-8 text of an input file of at most ``limit_bytes`` (``TooBigError`` past it: a
    device such as /dev/zero, or the wrong file, would otherwise be read until memory runs out)."""
    with open(path, "rb") as f:
        data = f.read(limit_bytes + 1)
    if len(data) > limit_bytes:
        raise TooBigError(f"over {limit_bytes:,} bytes")
    return data.decode("utf-8")
