"""Concrete rank blocks for SP groups: aligned power-of-two blocks, intra-node first.

Placing groups in descending degree order at consecutive offsets aligns every block (each
offset is a multiple of all later, smaller degrees), and a block no larger than a node never
straddles two nodes, so the fast intra-node all-to-all is what small groups get.
"""
from __future__ import annotations

from megatron_ext.errors import InvalidPlanError


def place_groups(degrees: list[int], num_gpus: int) -> list[list[int]]:
    """Rank lists for groups of the given degrees, in the given order of groups."""
    order = sorted(range(len(degrees)), key=lambda i: (-degrees[i], i))
    ranks: list[list[int]] = [[] for _ in degrees]
    offset = 0
    for i in order:
        d = degrees[i]
        ranks[i] = list(range(offset, offset + d))
        offset += d
    if offset > num_gpus:
        raise InvalidPlanError(f"groups of degrees {sorted(degrees, reverse=True)} need {offset} GPUs, "
                               f"only {num_gpus} exist")
    return ranks
