"""The SP group pool: one process group per aligned power-of-two block of the data-parallel domain.

A FlexSP plan (``megatron_ext.plan.schema``) names each Ulysses group by its ``ranks``: an aligned
block ``[k*d, (k+1)*d)`` of the data-parallel domain, d a power of two. NCCL/gloo groups are
expensive to create and creation is collective over the whole world, so every block of every size
2, 4, ..., N is created once at start-up (N/2 + N/4 + ... + 1 = N - 1 groups per domain), in one
deterministic order on all ranks, and micro-batches only look groups up. A degree-1 group needs no
communicator: its lookup returns None.

Plan ranks are indices into the data-parallel domain (0..N-1). With tp = pp = cp = 1 (the FlexSP
setting) the domain is the whole world and plan rank i is global rank i. With several domains
(e.g. one per pipeline stage or tensor-parallel rank) pass them all as ``domains``; every rank
creates the groups of every domain (torch.distributed requires all ranks to take part in every
``new_group``) and looks up in its own domain.

A group with a ring (``SPGroup.ring`` r > 1, ``runtime/ring.py``) of degree d = u x r needs no
group of its own: its Ulysses subgroups ``ranks[i*u:(i+1)*u]`` are aligned blocks of size u, which
the pool holds already, and its rings (``ranks[p::u]``) pass K/V blocks with p2p over the default
group, between global ranks (``ring_layout``). Nothing is created per micro-batch, so ranks can
never disagree on a creation order.

The pool works beside megatron-core's ``parallel_state``: it only adds groups and never touches
megatron's.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from megatron_ext.errors import InvalidPlanError
from megatron_ext.runtime.device import rank_device
from megatron_ext.spec import is_power_of_two


def aligned_blocks(n: int) -> list[tuple[int, ...]]:
    """Every aligned power-of-two block of size >= 2 of range(n), in the pool's creation order:
    by size ascending, then by start."""
    if not is_power_of_two(n):
        raise ValueError(f"the data-parallel domain must have a power-of-two size, got {n}")
    out = []
    d = 2
    while d <= n:
        out.extend(tuple(range(s, s + d)) for s in range(0, n, d))
        d *= 2
    return out


class SPGroupPool:
    """All Ulysses groups of the data-parallel domain(s), created once.

    ``SPGroupPool()`` after ``torch.distributed.init_process_group`` pools the whole world as one
    domain (tp = pp = cp = 1). ``SPGroupPool.from_parallel_state()`` takes megatron's data-parallel
    groups as the domains. Construction is collective: call it on every rank, at the same point.

    Lookups take the plan's ranks (domain-local indices, a tuple or list) and return the
    ``ProcessGroup`` (None for degree 1); group rank i is plan rank ``ranks[i]``, so the i-th
    member of a plan group holds the i-th shard of the group's packed tokens.
    """

    def __init__(self, domains: Sequence[Sequence[int]] | None = None, *, backend: str | None = None,
                 timeout=None):
        if not dist.is_initialized():
            raise RuntimeError("SPGroupPool needs torch.distributed to be initialized first")
        world = dist.get_world_size()
        if domains is None:
            domains = [range(world)]
        self.domains: list[tuple[int, ...]] = [tuple(int(r) for r in d) for d in domains]
        flat = [r for d in self.domains for r in d]
        if sorted(flat) != sorted(set(flat)) or any(not 0 <= r < world for r in flat):
            raise ValueError(f"domains must be disjoint lists of ranks in [0, {world}), got {self.domains}")
        if len({len(d) for d in self.domains}) > 1:
            raise ValueError("all data-parallel domains must have the same size")
        self.size = len(self.domains[0]) if self.domains else 0
        me = dist.get_rank()
        mine = [d for d in self.domains if me in d]
        if not mine:
            raise ValueError(f"rank {me} is in none of the domains {self.domains}")
        self.domain: tuple[int, ...] = mine[0]
        self.rank: int = self.domain.index(me)  # this process's plan rank
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self.creation_order: list[tuple[int, ...]] = []  # global ranks of every new_group call
        blocks = aligned_blocks(self.size)
        for domain in sorted(self.domains):
            for block in blocks:
                global_ranks = [domain[i] for i in block]
                pg = dist.new_group(ranks=global_ranks, backend=backend, timeout=timeout)
                self.creation_order.append(tuple(global_ranks))
                if domain == self.domain:
                    self._groups[block] = pg
        # NCCL sets a group up at its first collective, which would fall in a planned step (its
        # time, its buffers): every group of this rank is set up now, in the same order on all
        # (the domain's other groups are not this rank's: a collective there only warns)
        device = rank_device()
        for block, pg in self._groups.items():
            if len(block) > 1 and self.rank in block:
                dist.all_reduce(torch.zeros(1, device=device), group=pg)

    @classmethod
    def from_parallel_state(cls, **kw) -> "SPGroupPool":
        """Pool over megatron's data-parallel groups (parallel_state must be initialized)."""
        from megatron.core import parallel_state

        mine = dist.get_process_group_ranks(parallel_state.get_data_parallel_group())
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, list(mine))
        domains = sorted({tuple(g) for g in gathered})
        return cls(domains, **kw)

    # ---- lookups -------------------------------------------------------------------------
    def _check_block(self, ranks: tuple[int, ...]) -> None:
        d = len(ranks)
        ok = (d >= 1 and is_power_of_two(d) and ranks[0] % d == 0 and ranks[0] + d <= self.size
              and ranks == tuple(range(ranks[0], ranks[0] + d)))
        if not ok:
            raise InvalidPlanError(
                f"SP group ranks {list(ranks)} are not an aligned power-of-two block "
                f"[k*d, (k+1)*d) of the {self.size}-rank data-parallel domain")

    def get(self, ranks: Iterable[int]) -> dist.ProcessGroup | None:
        """The process group of a plan group's ranks; None for degree 1. Raises InvalidPlanError
        for ranks that are not an aligned block, and if this rank is not a member."""
        key = tuple(int(r) for r in ranks)
        self._check_block(key)
        if self.rank not in key:
            raise InvalidPlanError(f"plan rank {self.rank} looked up SP group {list(key)} it is not a member of")
        if len(key) == 1:
            return None
        return self._groups[key]

    def ring_layout(self, ranks: Iterable[int], ring: int) -> tuple[dist.ProcessGroup | None, tuple[int, ...]]:
        """This rank's part of a plan group with a ring of ``ring`` Ulysses subgroups: (the
        process group of its Ulysses subgroup, None for Ulysses degree 1; the global ranks of its
        ring in ring order, () for ring 1), as ``UlyssesPackedSeqParams.build`` takes them."""
        key = tuple(int(r) for r in ranks)
        if not (is_power_of_two(ring) and len(key) % ring == 0):
            raise InvalidPlanError(f"SP group {list(key)}: ring degree {ring} is not a power of two dividing its "
                                   f"{len(key)} ranks")
        self.get(key)  # an aligned block with this rank in it
        u, p = len(key) // ring, key.index(self.rank)
        block = p // u
        ulysses = self.get(key[block * u:(block + 1) * u])
        ring_ranks = tuple(self.domain[r] for r in key[p % u::u]) if ring > 1 else ()
        return ulysses, ring_ranks

    def my_group(self, micro_batch) -> tuple[object, dist.ProcessGroup | None] | None:
        """``(plan_group, process_group)`` of the group of ``micro_batch`` (a MicroBatchPlan, or any
        object with ``.groups`` of objects with ``.ranks``) that contains this rank, or None when
        this rank has no work in that micro-batch."""
        for g in micro_batch.groups:
            if self.rank in g.ranks:
                return g, self.get(g.ranks)
        return None

    def __len__(self) -> int:
        return len(self._groups)

    def __repr__(self) -> str:
        return f"SPGroupPool(rank={self.rank}, size={self.size}, groups={len(self._groups)})"
