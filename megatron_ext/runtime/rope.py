"""RoPE at true positions: each token rotated by its position inside its own sequence, not by its
place in a rank's shard of a packed buffer.

``use_true_positions_for_rope(model)`` (once, after building a GPTModel) makes its RotaryEmbedding
return, for a ``UlyssesPackedSeqParams`` micro-batch, the frequencies at ``params.position_ids``
(``rotary_pos_emb_at``). Pieces of split sequences sit at their true positions the same way
(``UlyssesPackedSeqParams.build(..., starts=)``). Learned absolute position embeddings get the same
positions from the ``position_ids`` argument of GPTModel.forward.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megatron_ext.runtime.attention import UlyssesPackedSeqParams


def rotary_pos_emb_at(rotary: RotaryEmbedding, position_ids: Tensor, max_position: Optional[int] = None) -> Tensor:
    """Megatron's rotary frequencies for given positions: ``[n, 1, 1, dim]`` for ``n`` position ids,
    i.e. rows ``position_ids`` of ``rotary(L)`` (which covers positions 0..L-1). Feed it to the
    attention layers as ``rotary_pos_emb`` of a packed shard whose tokens sit at those positions."""
    pos = position_ids.reshape(-1).long()
    n = (int(pos.max()) if max_position is None else int(max_position)) + 1
    # megatron keeps the last 32 tables (an lru_cache on forward) and each micro-batch's longest
    # position differs: lengths rounded up to a power of two keep those few and under twice the
    # longest table (the rows are the same at any length)
    n = 1 << (n - 1).bit_length()
    table = RotaryEmbedding.forward(rotary, n, 0, True)  # packed_seq=True: no CP slicing; lru-cached
    return table.index_select(0, pos.to(table.device))


class TruePositionRotaryEmbedding(RotaryEmbedding):
    """GPTModel's RotaryEmbedding, made to honour ``UlyssesPackedSeqParams.position_ids``.

    GPTModel._preprocess calls ``get_rotary_seq_len(..., packed_seq_params)`` and then
    ``forward(seq_len, ...)``. For a UlyssesPackedSeqParams micro-batch the first call remembers the
    params and the second returns ``rotary_pos_emb_at(self, params.position_ids)``: one row per local
    token, at its position in its own sequence. Any other call behaves as RotaryEmbedding.
    Installed on an existing model by ``use_true_positions_for_rope``.
    """

    _pending_params: Optional[UlyssesPackedSeqParams] = None

    def get_rotary_seq_len(self, inference_context, transformer, transformer_input, transformer_config,
                           packed_seq_params=None, **kwargs) -> int:
        if isinstance(packed_seq_params, UlyssesPackedSeqParams):
            self._pending_params = packed_seq_params
            return packed_seq_params.shard_len
        self._pending_params = None
        return super().get_rotary_seq_len(inference_context, transformer, transformer_input, transformer_config,
                                           packed_seq_params, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> Tensor:
        params, self._pending_params = self._pending_params, None
        if params is None:
            return super().forward(max_seq_len, offset, packed_seq, cp_group)
        if max_seq_len != params.shard_len or offset:
            raise ValueError("TruePositionRotaryEmbedding: call get_rotary_seq_len with the same "
                             "UlyssesPackedSeqParams right before forward")
        return rotary_pos_emb_at(self, params.position_ids, params.max_position_id)


def _unwrap(model):
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def use_true_positions_for_rope(model) -> None:
    """Make a GPTModel's RoPE use UlyssesPackedSeqParams.position_ids (idempotent; a no-op for
    models without RoPE). Works through DDP / Float16Module wrappers."""
    m = _unwrap(model)
    rope = getattr(m, "rotary_pos_emb", None)
    if rope is None or isinstance(rope, TruePositionRotaryEmbedding):
        return
    if type(rope) is not RotaryEmbedding:
        raise NotImplementedError(f"true-position RoPE supports megatron's RotaryEmbedding, not {type(rope).__name__}")
    rope.__class__ = TruePositionRotaryEmbedding  # same state, position-aware methods
