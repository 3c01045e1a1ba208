"""Worker for test_runtime_distributed.py: 4 gloo ranks, every check on every rank (dist_harness).

References are single-process computations each rank repeats for its own group: per-sequence
causal attention written out with einsum in float64, megatron's RoPE applied per sequence, and
megatron's own GPTModel (stock DotProductAttention) run one sequence at a time.
"""
from __future__ import annotations

import random

import torch
import torch.distributed as dist

from dist_harness import Failures, check, preload_megatron, setup_megatron
from megatron_ext.runtime.device import rank_device

WORLD = 4
ST: dict = {}  # state built once in setup()


def preload():
    preload_megatron()


def setup():
    ST["pool"] = setup_megatron()
    ST["rank"] = dist.get_rank()


def _my_group(groups):
    r = ST["rank"]
    for gi, g in enumerate(groups):
        if r in g:
            return gi, tuple(g)
    raise AssertionError(f"rank {r} in no group of {groups}")


def _global_max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


# ---- the group pool ----------------------------------------------------------------------------

@check
def pool_creates_every_aligned_block():
    from megatron_ext.runtime.groups import aligned_blocks

    pool, r = ST["pool"], ST["rank"]
    fails = Failures()
    fails.true(pool.creation_order == [(0, 1), (2, 3), (0, 1, 2, 3)], f"creation order {pool.creation_order}")
    fails.true((len(pool), pool.size, pool.rank) == (3, 4, r), f"{pool!r}")
    fails.true(aligned_blocks(8) == [(0, 1), (2, 3), (4, 5), (6, 7), (0, 1, 2, 3), (4, 5, 6, 7), tuple(range(8))],
               f"aligned_blocks(8) = {aligned_blocks(8)}")
    fails.true(aligned_blocks(1) == [], "aligned_blocks(1) is not empty")
    fails.true(pool.get((r,)) is None and pool.get([r]) is None, "degree 1 has a process group")
    for block in [(0, 1), (2, 3), (0, 1, 2, 3)]:
        if r not in block:
            continue
        g = pool.get(list(block))
        fails.true(dist.get_world_size(g) == len(block) and dist.get_rank(g) == block.index(r),
                   f"group {block}: size {dist.get_world_size(g)}, rank {dist.get_rank(g)}")
        t = torch.tensor([float(r)])
        dist.all_reduce(t, group=g)
        fails.true(int(t) == sum(block), f"all_reduce over {block} gave {t}")
    fails.raise_any()


@check
def pool_lookup_fails_clearly():
    import pytest

    from megatron_ext.errors import InvalidPlanError
    from megatron_ext.plan.schema import MicroBatchPlan, SPGroup
    from megatron_ext.runtime.groups import SPGroupPool

    pool, r = ST["pool"], ST["rank"]
    for bad in [(1, 2), (0, 1, 2), (3, 2), (0, 2), (), (4, 5), (0, 1, 2, 3, 4, 5, 6, 7)]:
        with pytest.raises(InvalidPlanError, match="aligned power-of-two block"):
            pool.get(bad)
    other = (2, 3) if r < 2 else (0, 1)
    with pytest.raises(InvalidPlanError, match="not a member"):
        pool.get(other)
    mb = MicroBatchPlan([SPGroup([0, 1], [4]), SPGroup([2], [0, 1])])
    got = pool.my_group(mb)
    if r < 2:
        assert got[0].ranks == [0, 1] and dist.get_world_size(got[1]) == 2
    elif r == 2:
        assert got[0].ranks == [2] and got[1] is None
    else:
        assert got is None
    with pytest.raises(ValueError, match="power-of-two|none of the domains"):
        SPGroupPool([range(3)])  # raises on every rank before any new_group


@check
def pool_beside_parallel_state():
    from megatron.core import parallel_state

    from megatron_ext.runtime.groups import SPGroupPool

    t = torch.ones(1)
    dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
    pool2 = SPGroupPool.from_parallel_state()
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    assert parallel_state.get_data_parallel_world_size() == WORLD
    assert int(t) == WORLD
    assert pool2.domains == [(0, 1, 2, 3)] and pool2.creation_order == ST["pool"].creation_order


# ---- Ulysses attention vs a single-process reference -------------------------------------------

def reference_attention(q, k, v, lengths, scale):
    """Per-sequence causal attention, float64: q [T, H, D], k/v [T, G, D] -> [T, H, D]."""
    out, a = [], 0
    rep = q.shape[1] // k.shape[1]
    for n in lengths:
        qs, ks, vs = q[a:a + n], k[a:a + n].repeat_interleave(rep, 1), v[a:a + n].repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vs))
        a += n
    return torch.cat(out)


def _attention_module(heads, kv_heads, head_dim):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.runtime.attention import UlyssesAttention

    key = ("attn", heads, kv_heads, head_dim)
    if key not in ST:
        cfg = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                                num_query_groups=kv_heads, attention_dropout=0.0, hidden_dropout=0.0)
        ST[key] = UlyssesAttention(cfg, 1, AttnMaskType.causal, "self", backend="sdpa")
    return ST[key]


def _mixes(seed: int, count: int):
    rng = random.Random(seed)
    fixed = [[1], [7], [3, 1, 1, 1, 1], [33, 2, 17], [16, 16]]
    return fixed + [[rng.randint(1, 48) for _ in range(rng.randint(1, 6))] for _ in range(count)]


def run_attention_case(groups, heads=8, kv_heads=4, head_dim=8, seed=0, mixes_per_group=4,
                       layout_lengths=None):
    """Every group runs its own length mixes; returns the largest error of this rank's real tokens
    (output and q/k/v gradients) against reference_attention."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.runtime.attention import UlyssesPackedSeqParams

    gi, ranks = _my_group(groups)
    group = ST["pool"].get(ranks)
    attn = _attention_module(heads, kv_heads, head_dim)
    scale = head_dim ** -0.5
    worst = 0.0
    fails = Failures()
    for case, lengths in enumerate(_mixes(seed * 100 + gi, mixes_per_group)):
        params = UlyssesPackedSeqParams.build(layout_lengths(lengths) if layout_lengths else lengths, group)
        T, S = sum(lengths), params.total_tokens
        g = torch.Generator().manual_seed(seed * 10_000 + gi * 100 + case)  # same on the group's ranks
        q, k, v = (torch.randn(S, h, head_dim, generator=g) for h in (heads, kv_heads, kv_heads))
        dy = torch.randn(S, heads * head_dim, generator=g)  # pad tokens get gradients too: must not leak

        ref_in = [t[:T].double().requires_grad_() for t in (q, k, v)]
        ref = reference_attention(*ref_in, lengths, scale).reshape(T, -1)
        (ref * dy[:T].double()).sum().backward()

        # on the rank's device, as a GPU run would hand them over (runtime/device.py's check mode)
        local = [params.shard(t).unsqueeze(1).clone().to(rank_device()).requires_grad_() for t in (q, k, v)]
        out = attn(*local, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
        fails.true(out.shape == (params.shard_len, 1, heads * head_dim), f"output shape {out.shape}")
        fails.true(bool(torch.isfinite(out).all()), f"non-finite output, lengths {lengths}")
        (out[:, 0] * params.shard(dy)).sum().backward()

        start, end = params.shard_range
        n_real = max(0, min(end, T) - start)
        pairs = [(out[:n_real, 0], ref[start:start + n_real])]
        pairs += [(x.grad[:n_real, 0], r.grad[start:start + n_real]) for x, r in zip(local, ref_in)]
        for what, (a, b) in zip(("out", "dq", "dk", "dv"), pairs):
            err = (a.double() - b).abs().max().item() if n_real else 0.0
            if not layout_lengths:
                fails.close(a.double(), b.detach(), f"{what}, lengths {lengths}, group {ranks}", atol=2e-5, rtol=1e-5)
            worst = max(worst, err)
    fails.raise_any()
    return worst


@check
def ulysses_degree1_matches_reference():
    run_attention_case([(0,), (1,), (2,), (3,)], seed=1)


@check
def ulysses_degree2_matches_reference():
    run_attention_case([(0, 1), (2, 3)], seed=2)


@check
def ulysses_degree4_matches_reference():
    run_attention_case([(0, 1, 2, 3)], seed=3)


@check
def ulysses_mixed_degrees_in_one_micro_batch():
    run_attention_case([(0, 1), (2,), (3,)], seed=4)


@check
def ulysses_degree4_multi_head_one_head_per_rank():
    run_attention_case([(0, 1, 2, 3)], heads=4, kv_heads=4, seed=5)


@check
def ulysses_degree2_gqa_two_query_heads_per_kv_head():
    run_attention_case([(0, 1), (2, 3)], heads=8, kv_heads=2, head_dim=4, seed=6)


@check
def ulysses_dense_mask_sdpa_path():
    # CPU runs one call per sequence; the one-masked-call path (CUDA's default for small buffers)
    # must give the same attention
    import megatron_ext.runtime.kernels as A

    saved = A.SDPA_DENSE_MASK_MAX_ELEMENTS["cpu"]
    A.SDPA_DENSE_MASK_MAX_ELEMENTS["cpu"] = 1 << 22
    try:
        run_attention_case([(0, 1, 2, 3)], seed=7, mixes_per_group=2)
        run_attention_case([(0, 1), (2, 3)], seed=8, mixes_per_group=2)
    finally:
        A.SDPA_DENSE_MASK_MAX_ELEMENTS["cpu"] = saved


@check
def ulysses_wrong_layout_is_detected():
    # Sensitivity: the same tokens described as one long sequence must give different results.
    worst = run_attention_case([(0, 1, 2, 3)], seed=9, mixes_per_group=2, layout_lengths=lambda ls: [sum(ls)])
    assert _global_max(worst) > 1e-2, worst


@check
def ulysses_rejects_heads_not_divisible_by_degree():
    import pytest
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.runtime.attention import UlyssesPackedSeqParams

    attn = _attention_module(8, 2, 4)
    params = UlyssesPackedSeqParams.build([8], ST["pool"].get((0, 1, 2, 3)))
    q, k = torch.randn(2, 1, 8, 4), torch.randn(2, 1, 2, 4)
    with pytest.raises(ValueError, match="must divide the attention heads"):
        attn(q, k, k, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
    with pytest.raises(ValueError, match="shard"):
        attn(q[:1], k[:1], k[:1], None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)


def _dropout_masks(group, S=8, H=4, D=8):
    """Which keys each query of each head keeps under attention dropout 0.5 ([S, H, S], the whole
    group's heads): with q = k = 0 and v one-hot per key, a head's output is its mask."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.runtime.attention import UlyssesAttention, UlyssesPackedSeqParams

    cfg = TransformerConfig(num_layers=1, hidden_size=H * D, num_attention_heads=H, attention_dropout=0.5,
                            hidden_dropout=0.0)
    attn = UlyssesAttention(cfg, 1, AttnMaskType.causal, "self", backend="sdpa").train()
    params = UlyssesPackedSeqParams.build([S], group)
    dev = rank_device()
    zeros = torch.zeros(S, 1, H, D, device=dev)
    v = torch.eye(S, D, device=dev)[:, None, None, :].expand(S, 1, H, D).contiguous()
    torch.manual_seed(1234)  # (the default generator alike on every rank, as runs seed it)
    states = get_cuda_rng_tracker().get_states()
    out = attn(params.shard(zeros), params.shard(zeros), params.shard(v), None, attn_mask_type=AttnMaskType.causal,
               packed_seq_params=params)
    get_cuda_rng_tracker().set_states(states)  # as activation checkpointing restores them
    torch.manual_seed(1234)
    again = attn(params.shard(zeros), params.shard(zeros), params.shard(v), None, attn_mask_type=AttnMaskType.causal,
                 packed_seq_params=params)
    assert torch.equal(out, again), "a recomputed forward drew other dropout masks"
    out = out.reshape(-1, H, D)
    if group is not None:
        parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, out, group=group)
        out = torch.cat(parts)
    return out != 0


@check
def ulysses_ranks_draw_their_own_dropout_masks():
    """The ranks of an SP group hold other heads of the same tokens: their masks differ, as one
    process's heads' do; and without the stream an SP group refuses to draw from the default one."""
    import pytest

    from megatron_ext.runtime.attention import add_sp_dropout_rng

    group = ST["pool"].get((0, 1) if ST["rank"] < 2 else (2, 3))
    with pytest.raises(RuntimeError, match="add_sp_dropout_rng"):
        _dropout_masks(group)
    add_sp_dropout_rng(1234)
    add_sp_dropout_rng(1234)  # (again at the same step: a re-seed, not an error)
    one = _dropout_masks(None)
    assert not any(torch.equal(one[:, h], one[:, h + 2]) for h in range(2))
    two = _dropout_masks(group)  # heads 0, 1 on the group's first rank, 2, 3 on its second
    assert not any(torch.equal(two[:, h], two[:, h + 2]) for h in range(2))
    assert 0.3 < float(two[torch.ones(8, 8, dtype=torch.bool).tril()[:, None, :].expand(8, 4, 8)].float().mean()) < 0.7


@check
def all_to_all_exchanges_sequence_and_heads():
    from megatron_ext.runtime.comm import all_to_all

    pool, r = ST["pool"], ST["rank"]
    g = pool.get((0, 1, 2, 3))
    # rank r holds tokens [2r, 2r+2) of every head h; value = 100 * token + h
    x = torch.tensor([[100.0 * (2 * r + s) + h for h in range(8)] for s in range(2)],
                     device=rank_device()).requires_grad_()
    y = all_to_all(x, g, scatter_dim=1, gather_dim=0)  # -> all 8 tokens, heads [2r, 2r+2)
    want = torch.tensor([[100.0 * s + h for h in range(2 * r, 2 * r + 2)] for s in range(8)])
    w = torch.randn(8, 2, generator=torch.Generator().manual_seed(r))
    (y * w).sum().backward()
    # gradient of x[s, h] is w on rank h // 2 at token 2r + s, column h % 2
    ws = [torch.empty(8, 2) for _ in range(WORLD)]
    dist.all_gather(ws, w)
    want_grad = torch.tensor([[float(ws[h // 2][2 * r + s, h % 2]) for h in range(8)] for s in range(2)])
    z = all_to_all(y, g, scatter_dim=0, gather_dim=1)
    assert torch.equal(y, want), y
    assert torch.equal(x.grad, want_grad)
    assert torch.equal(z, x)


# ---- RoPE at true positions --------------------------------------------------------------------

@check
def rope_uses_true_positions():
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.runtime.attention import UlyssesPackedSeqParams
    from megatron_ext.runtime.rope import TruePositionRotaryEmbedding, rotary_pos_emb_at, use_true_positions_for_rope

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    D = 16
    rope = RotaryEmbedding(kv_channels=D, rotary_percent=1.0)
    lengths = [5, 9, 2, 11, 1]
    fails = Failures()
    for ranks in [(0, 1, 2, 3), (0, 1) if ST["rank"] < 2 else (2, 3), (ST["rank"],)]:
        params = UlyssesPackedSeqParams.build(lengths, ST["pool"].get(ranks))
        T = sum(lengths)
        x = torch.randn(params.total_tokens, 1, 4, D, generator=torch.Generator().manual_seed(11))
        ref, a = [], 0
        for n in lengths:
            ref.append(apply_rotary_pos_emb(x[a:a + n], rope(n), cfg))
            a += n
        ref = torch.cat(ref)
        start, end = params.shard_range
        n_real = max(0, min(end, T) - start)
        local = params.shard(x)
        got = apply_rotary_pos_emb(local, rotary_pos_emb_at(rope, params.position_ids), cfg)
        fails.close(got[:n_real], ref[start:start + n_real], f"RoPE over {ranks}", atol=1e-6, rtol=1e-6)
        naive = apply_rotary_pos_emb(local, rope(params.shard_len), cfg)  # positions of the shard
        bad = (naive[:n_real] - ref[start:start + n_real]).abs().max().item() if n_real else 0.0
        if len(ranks) > 1:
            fails.true(_global_max(bad) > 1e-2, f"shard-local positions went unnoticed over {ranks}")
    fails.raise_any()

    holder = torch.nn.Module()
    holder.rotary_pos_emb = RotaryEmbedding(kv_channels=D, rotary_percent=1.0)
    use_true_positions_for_rope(holder)
    use_true_positions_for_rope(holder)  # idempotent
    r2 = holder.rotary_pos_emb
    assert isinstance(r2, TruePositionRotaryEmbedding)
    params = UlyssesPackedSeqParams.build(lengths, ST["pool"].get((0, 1, 2, 3)))
    n = r2.get_rotary_seq_len(None, None, None, cfg, params)
    assert n == params.shard_len
    torch.testing.assert_close(r2(n), rotary_pos_emb_at(rope, params.position_ids), atol=0, rtol=0)
    # without Ulysses params it is megatron's RotaryEmbedding
    x = torch.zeros(12, 1, 4)
    assert r2.get_rotary_seq_len(None, None, x, cfg, None) == 12
    torch.testing.assert_close(r2(12), rope(12), atol=0, rtol=0)
    # each micro-batch's longest position differs; the tables megatron caches stay few and short
    fresh = RotaryEmbedding(kv_channels=D, rotary_percent=1.0)
    RotaryEmbedding.forward.cache_clear()
    for top in range(40, 70):
        pos = torch.arange(top + 1)
        torch.testing.assert_close(rotary_pos_emb_at(fresh, pos), fresh.get_emb(top + 1), atol=0, rtol=0)
    assert RotaryEmbedding.forward.cache_info().currsize == 2  # 64 and 128 rows (was 30 tables)


# ---- whole GPTModel: Ulysses + true-position RoPE vs megatron, one sequence at a time ------------

def _gpt_models(recompute: bool = False):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.runtime.attention import get_gpt_layer_ulysses_spec
    from megatron_ext.runtime.rope import use_true_positions_for_rope

    key = ("gpt", recompute)
    if key in ST:
        return ST[key]
    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4,
                            ffn_hidden_size=64, hidden_dropout=0.0, attention_dropout=0.0, **extra)
    kw = dict(vocab_size=97, max_sequence_length=256, position_embedding_type="rope")
    model = GPTModel(cfg, get_gpt_layer_ulysses_spec(backend="sdpa"), **kw)
    use_true_positions_for_rope(model)
    for p in model.parameters():  # identical weights on every rank
        dist.broadcast(p.data, src=0)
    reference = GPTModel(cfg, get_gpt_layer_local_spec(), **kw)  # megatron's DotProductAttention
    reference.load_state_dict(model.state_dict())
    ST[key] = model, reference
    return model, reference


def run_gpt_case(groups, seed, recompute=False):
    from megatron_ext.runtime.attention import UlyssesPackedSeqParams

    model, reference = _gpt_models(recompute)
    gi, ranks = _my_group(groups)
    group = ST["pool"].get(ranks)
    rng = random.Random(seed * 7 + gi)
    lengths = [rng.randint(1, 40) for _ in range(rng.randint(2, 5))]
    g = torch.Generator().manual_seed(seed * 31 + gi)
    T = sum(lengths)
    tokens, labels = torch.randint(0, 97, (T,), generator=g), torch.randint(0, 97, (T,), generator=g)
    weights = torch.rand(T, generator=g)  # per-token loss weights: a generic scalar loss

    reference.zero_grad()
    ref_losses, a = [], 0
    for n in lengths:
        ref_losses.append(reference(tokens[a:a + n][None], torch.arange(n)[None], None,
                                    labels=labels[a:a + n][None])[0])
        a += n
    ref_loss = torch.cat(ref_losses)
    (ref_loss * weights).sum().backward()

    model.zero_grad()
    params = UlyssesPackedSeqParams.build(lengths, group)
    loss = model(params.shard(tokens)[None], params.position_ids[None], None,
                 labels=params.shard(labels)[None], packed_seq_params=params)[0]
    (loss * params.shard(weights) * params.loss_mask).sum().backward()

    start, end = params.shard_range
    n_real = max(0, min(end, T) - start)
    fails = Failures()
    fails.close(loss[:n_real], ref_loss[start:start + n_real].detach(), f"per-token loss, lengths {lengths}",
                atol=1e-5, rtol=1e-5)
    ref_grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        if group is not None:
            dist.all_reduce(grad, group=group)  # the group's ranks together hold the whole loss
        fails.close(grad, ref_grads[name].grad, f"grad of {name}, lengths {lengths}", atol=2e-5, rtol=1e-4)
    fails.raise_any()


@check
def gpt_model_degree2_matches_megatron_reference():
    run_gpt_case([(0, 1), (2, 3)], seed=1)


@check
def gpt_model_degree4_matches_megatron_reference():
    run_gpt_case([(0, 1, 2, 3)], seed=2)


@check
def gpt_model_mixed_degrees_with_full_recompute():
    run_gpt_case([(0, 1), (2,), (3,)], seed=3, recompute=True)



# ---- last: megatron's 1F1B pipeline schedule (pp=2) over gloo with the compat layer -------------

@check
def megatron_pipeline_schedule_pp2_matches_one_process():
    """Re-initializes parallel_state as pp=2 x dp=2, so it runs last. The compat layer's p2p and
    schedule patches under megatron's own 1F1B schedule, UlyssesAttention at degree 1 and variable
    lengths: each micro-batch's loss (last stage) and each stage's gradients are the whole model's
    in one process (megatron's stock GPTModel, each sequence alone)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.runtime.attention import UlyssesPackedSeqParams, get_gpt_layer_ulysses_spec
    from megatron_ext.runtime.pipeline_model import stage_state_dict
    from megatron_ext.runtime.rope import use_true_positions_for_rope

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    shape = dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64,
                 hidden_dropout=0.0, attention_dropout=0.0, calculate_per_token_loss=True)
    cfg = TransformerConfig(**shape, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                            variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    model = GPTModel(cfg, get_gpt_layer_ulysses_spec(backend="sdpa"), vocab_size=97, max_sequence_length=128,
                     pre_process=first, post_process=last, position_embedding_type="rope")
    use_true_positions_for_rope(model)
    torch.manual_seed(5)
    ref = GPTModel(TransformerConfig(**shape), get_gpt_layer_local_spec(), vocab_size=97, max_sequence_length=128,
                   pre_process=True, post_process=True, position_embedding_type="rope")
    for p in ref.parameters():
        dist.broadcast(p.data, src=0)
    model.load_state_dict(stage_state_dict(ref.state_dict(), model))
    dp = parallel_state.get_data_parallel_rank()
    batches, expected = [], []
    for i, lengths in enumerate([[7, 3, 12], [1, 2], [20, 5]]):
        params = UlyssesPackedSeqParams.build(lengths)
        g = torch.Generator().manual_seed(100 * dp + i)
        tokens = torch.randint(0, 97, (sum(lengths),), generator=g)
        batches.append((params.shard(tokens)[None], params))
        expected.append(sum(ref(seq[None], torch.arange(len(seq))[None], None, labels=seq[None]).sum()
                            for seq in tokens.split(lengths)))
    torch.stack(expected).sum().backward()
    ref_grads = {**ref.state_dict(), **{name: p.grad for name, p in ref.named_parameters()}}  # (stage names)

    def forward_step(data_iterator, model):
        tokens, params = next(data_iterator)
        out = model(tokens, params.position_ids[None], None, labels=tokens, packed_seq_params=params)

        def loss_func(loss):
            total = (loss[0] * params.loss_mask).sum()
            return total, params.loss_mask.sum().int(), {"lm loss": total.detach()}

        return out, loss_func

    out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                                      num_microbatches=len(batches), seq_length=32, micro_batch_size=1,
                                      forward_only=False)
    fails = Failures()
    if last:
        fails.close(torch.stack([o["lm loss"] for o in out]), torch.stack(expected).detach(), "micro-batch losses",
                    atol=1e-5, rtol=1e-6)
    want = stage_state_dict(ref_grads, model)
    for name, p in model.named_parameters():
        fails.close(p.grad, want[name], f"grad of {name} (stage {int(not first)})", atol=3e-6, rtol=1e-4)
    fails.raise_any()
