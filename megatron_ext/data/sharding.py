"""Which tokens of a step each rank holds: one rule, shared by the data loader and the runtime.

In a FlexSP micro-batch, an SP group of degree d packs its sequences into one token buffer: the
tokens of its ``seq_ids`` concatenated in that order (``cu_seqlens`` marks the boundaries). The
buffer is padded at its end to a multiple of d (``padded_buffer_length``, plan/program.py's: the
one padding rule of FlexSP groups and pipeline chunks alike), and the rank at
position p of the group (``ranks.index(rank)``) holds the contiguous shard
``[p * B/d, (p + 1) * B/d)`` of the padded buffer of length B. Ulysses attention all-to-alls
those shards into whole sequences over heads/d, so every rank of the group must cut the buffer the
same way: use these functions, never a private copy of the rule.

A group with a ring (``SPGroup.ring`` r > 1, degree d = u x r) cuts the same shards: the buffer's
r contiguous ring blocks of B/r tokens are each held by u ranks in order, so position p holds a
shard of ring block ``p // u`` (its ``ring_position``) as Ulysses rank ``p % u`` there.

Pure numpy: no torch, importable by the planner side and the runtime alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_ext.errors import InvalidPlanError
from megatron_ext.plan.program import padded_buffer_length
from megatron_ext.plan.schema import StepPlan

IGNORE_INDEX = -100  # label of tokens that predict nothing (each sequence's last token, padding)


def next_token_labels(seq: np.ndarray, start: int, n: int) -> np.ndarray:
    """THE label rule, for tokens ``[start, start + n)`` of one sequence: token t predicts token
    t + 1 of the same sequence; the sequence's last token predicts nothing (IGNORE_INDEX). A cut
    inside a sequence (a shard boundary, a pipeline slice) does not cut a label."""
    labels = np.full(n, IGNORE_INDEX, dtype=np.int64)
    nxt = seq[start + 1:start + n + 1]  # one shorter than the part when it reaches the sequence's end
    labels[:nxt.size] = nxt
    return labels


def model_labels(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the model is fed for ``labels`` (IGNORE_INDEX where nothing is predicted, padding
    included): (labels with IGNORE_INDEX replaced by 0, a valid class id; float32 loss mask, 0
    there and 1 elsewhere)."""
    mask = labels != IGNORE_INDEX
    return np.where(mask, labels, 0), mask.astype(np.float32)


def shard_bounds(num_tokens: int, degree: int, position: int) -> tuple[int, int]:
    """[start, end) of the padded buffer held by the rank at ``position`` of a degree-d group."""
    if not 0 <= position < degree:
        raise ValueError(f"position {position} is not in a group of degree {degree}")
    size = padded_buffer_length(num_tokens, degree) // degree
    return position * size, (position + 1) * size


@dataclass(frozen=True)
class RankShard:
    """One rank's share of one micro-batch: its SP group and its slice of the packed buffer."""

    micro_batch: int
    ranks: tuple[int, ...]  # the SP group
    position: int  # this rank's index in ``ranks``
    seq_ids: tuple[int, ...]  # the group's sequences, in buffer order
    seq_lengths: tuple[int, ...]
    num_tokens: int  # real tokens in the group's buffer
    pad: int  # pad tokens appended to the buffer (padded length - num_tokens)
    start: int  # this rank's shard of the padded buffer: [start, end)
    end: int
    ring: int = 1  # ring degree of the group (1: Ulysses only)

    @property
    def degree(self) -> int:
        return len(self.ranks)

    @property
    def ulysses(self) -> int:
        return self.degree // self.ring

    @property
    def ring_position(self) -> int:
        """The ring block this rank holds a shard of."""
        return self.position // self.ulysses

    @property
    def block(self) -> tuple[int, int]:
        """[start, end) of this rank's ring block in the padded buffer (the whole buffer without a ring)."""
        size = (self.num_tokens + self.pad) // self.ring
        return self.ring_position * size, (self.ring_position + 1) * size

    @property
    def cu_seqlens(self) -> np.ndarray:
        """Sequence boundaries in the (unpadded) packed buffer: [0, l0, l0+l1, ..., num_tokens]."""
        return np.concatenate([[0], np.cumsum(self.seq_lengths, dtype=np.int64)])

    @property
    def real_tokens(self) -> int:
        """Tokens of the shard that are not padding."""
        return max(0, min(self.end, self.num_tokens) - self.start)


def group_shards(plan: StepPlan, lengths) -> list[list[list[RankShard]]]:
    """Every shard of a FlexSP plan: ``[micro_batch][group][position]``."""
    if plan.kind != "flexsp":
        raise InvalidPlanError(f"rank parts are defined for FlexSP plans, not {plan.kind!r} plans")
    lengths = np.asarray(lengths, dtype=np.int64)
    out = []
    for m, mb in enumerate(plan.micro_batches):
        groups = []
        for g in mb.groups:
            ids = tuple(int(i) for i in g.seq_ids)
            if any(not 0 <= i < lengths.size for i in ids):
                raise InvalidPlanError(f"micro-batch {m}: a sequence id is out of range for {lengths.size} sequences")
            seq_lengths = tuple(int(lengths[i]) for i in ids)
            total = sum(seq_lengths)
            d = len(g.ranks)
            padded = padded_buffer_length(total, d)
            groups.append([RankShard(m, tuple(int(r) for r in g.ranks), p, ids, seq_lengths, total, padded - total,
                                     *shard_bounds(total, d, p), ring=g.ring) for p in range(d)])
        out.append(groups)
    return out


def rank_part(plan: StepPlan, rank: int, lengths) -> list[RankShard | None]:
    """``rank``'s shard in each micro-batch of a FlexSP plan (None where the rank is in no group).
    ``lengths`` are the batch's sequence lengths, indexed by seq id."""
    if not 0 <= rank < plan.num_gpus:
        raise InvalidPlanError(f"rank {rank} is not in a plan for {plan.num_gpus} GPUs")
    part: list[RankShard | None] = []
    for groups in group_shards(plan, lengths):
        mine = [shards[shards[0].ranks.index(rank)] for shards in groups if rank in shards[0].ranks]
        if len(mine) > 1:
            raise InvalidPlanError(f"micro-batch {groups[0][0].micro_batch}: rank {rank} is in {len(mine)} groups")
        part.append(mine[0] if mine else None)
    return part


@dataclass
class ShardTokens:
    """The tokens of one shard with what the model needs next to them (all int64, same length)."""

    tokens: np.ndarray  # token ids; ``pad_id`` in the padding
    positions: np.ndarray  # each token's position in its own sequence (RoPE); 0 in the padding
    seq_index: np.ndarray  # the batch seq id each token belongs to; -1 in the padding
    labels: np.ndarray  # next token of the same sequence; IGNORE_INDEX at each sequence's end and in padding

    @property
    def loss_mask(self) -> np.ndarray:
        return self.labels != IGNORE_INDEX


def shard_tokens(shard: RankShard, batch: Sequence[np.ndarray], pad_id: int) -> ShardTokens:
    """Cut the shard's tokens out of the global batch (token arrays indexed by seq id).

    Labels follow ``next_token_labels``: a sequence of L tokens has L - 1 labelled tokens
    (``num_loss_tokens``); a shard boundary inside a sequence does not cut a label."""
    n = shard.end - shard.start
    tokens = np.full(n, pad_id, dtype=np.int64)
    positions = np.zeros(n, dtype=np.int64)
    seq_index = np.full(n, -1, dtype=np.int64)
    labels = np.full(n, IGNORE_INDEX, dtype=np.int64)
    cu = shard.cu_seqlens
    for j, sid in enumerate(shard.seq_ids):
        lo, hi = max(shard.start, int(cu[j])), min(shard.end, int(cu[j + 1]))
        if lo >= hi:
            continue
        seq = np.asarray(batch[sid])
        if seq.size != shard.seq_lengths[j]:
            raise InvalidPlanError(f"sequence {sid} has {seq.size} tokens, the plan's lengths say {shard.seq_lengths[j]}")
        a, b = lo - int(cu[j]), hi - int(cu[j])  # the part of this sequence, in sequence coordinates
        out = slice(lo - shard.start, hi - shard.start)
        tokens[out] = seq[a:b]
        positions[out] = np.arange(a, b)
        seq_index[out] = sid
        labels[out] = next_token_labels(seq, a, b - a)
    return ShardTokens(tokens, positions, seq_index, labels)


def num_loss_tokens(lengths, dropped_seq_ids: Sequence[int] = ()) -> int:
    """Labelled tokens of a global batch under ``shard_tokens``' rule: sum of (L - 1) over the
    planned sequences -- the divisor of the per-token loss."""
    lengths = np.asarray(lengths, dtype=np.int64)
    keep = np.ones(lengths.size, dtype=bool)
    keep[list(dropped_seq_ids)] = False
    return int(np.maximum(lengths[keep] - 1, 0).sum())
