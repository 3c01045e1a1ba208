"""Wording shared by the CLI, the plots and the data readers."""
from __future__ import annotations


def plural(n: int, noun: str, many: str = "") -> str:
    """'1 sequence', '3,000 sequences', '2 micro-batches' (``many``: the plural when not noun + s)."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {many or noun + 's'}"


def numbered(noun: str, indices: list[int]) -> str:
    """'pipeline 3', 'pipelines 0-5, 7' (``indices`` ascending): runs of consecutive ones as ranges."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    spans = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"{noun}{'s' if len(indices) > 1 else ''} {spans}"
