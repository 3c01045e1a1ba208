"""Wording shared by the CLI, the plots and the data readers."""
from __future__ import annotations


def plural(n: int, noun: str, many: str = "") -> str:
    """'1 sequence', '3,000 sequences', '2 micro-batches' (``many``: the plural when not noun + s)."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {many or noun + 's'}"
