"""Worker for test_ring_runtime.py: 4 gloo ranks, groups with a ring (Ulysses x ring, runtime/ring.py).

References: the attention of the whole packed buffer in float64 under its block-diagonal causal
mask, and whole training steps against one process running every sequence alone through
megatron's stock GPTModel (as train_worker.py does for plain groups).
"""
from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist

from dist_harness import Failures, check, model_and_reference, preload_megatron, setup_megatron
from megatron_ext.runtime.device import rank_device

ST: dict = {}
SEQ_LEN = 512


def preload():
    preload_megatron("megatron_ext.runtime.schedule", "megatron_ext.runtime.train")


def setup():
    ST["pool"] = setup_megatron()
    ST["rank"] = dist.get_rank()


def _global_max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=rank_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


# ---- the pool's view of a ring group ----------------------------------------------------------

@check
def pool_ring_layout():
    import pytest

    from megatron_ext.errors import InvalidPlanError

    pool, r = ST["pool"], ST["rank"]
    ulysses, ring = pool.ring_layout((0, 1, 2, 3), 2)  # Ulysses 2 x ring 2
    assert dist.get_process_group_ranks(ulysses) == ([0, 1] if r < 2 else [2, 3])
    assert ring == ((0, 2) if r % 2 == 0 else (1, 3))
    ulysses, ring = pool.ring_layout((0, 1, 2, 3), 4)
    assert ulysses is None and ring == (0, 1, 2, 3)
    ulysses, ring = pool.ring_layout((0, 1, 2, 3), 1)
    assert dist.get_world_size(ulysses) == 4 and ring == ()
    mine = (0, 1) if r < 2 else (2, 3)
    assert pool.ring_layout(mine, 2) == (None, mine)
    with pytest.raises(InvalidPlanError, match="ring degree 3"):
        pool.ring_layout((0, 1, 2, 3), 3)
    with pytest.raises(InvalidPlanError, match="not a member"):
        pool.ring_layout((2, 3) if r < 2 else (0, 1), 2)


# ---- ring attention against the whole buffer's attention ----------------------------------------

def _reference(q, k, v, lengths, scale):
    """float64 attention of the packed real tokens under the block-diagonal causal mask."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = (seg[:, None] == seg[None, :]).tril()
    rep = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(rep, 1)) * scale
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(rep, 1))


def _attention(heads, kv_heads, head_dim):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.runtime.attention import UlyssesAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                            num_query_groups=kv_heads, attention_dropout=0.0, hidden_dropout=0.0)
    return UlyssesAttention(cfg, 1, AttnMaskType.causal, "self", backend="sdpa")


def _ring_case(groups, ring, seed, heads=4, kv_heads=2, head_dim=8, layout=None):
    """Every group (all with ring degree ``ring``) attends its own random length mixes; returns the
    largest error of this rank's real tokens (output, dq, dk, dv). ``layout``: describe the tokens
    with other lengths than their true ones (the check that a wrong layout shows)."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.runtime.attention import UlyssesPackedSeqParams

    gi, ranks = next((i, g) for i, g in enumerate(groups) if ST["rank"] in g)
    ulysses, ring_ranks = ST["pool"].ring_layout(ranks, ring)
    attn = _attention(heads, kv_heads, head_dim)
    rng = random.Random(seed * 100 + gi)
    mixes = [[1], [5, 3], [40], [9, 30, 1, 6]] + [[rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
                                                  for _ in range(4)]
    fails, worst = Failures(), 0.0
    for case, lengths in enumerate(mixes):
        params = UlyssesPackedSeqParams.build(layout(lengths) if layout else lengths, ulysses, ring_ranks=ring_ranks)
        fails.true(params.ring_degree == ring and params.sp_degree * ring == len(ranks), f"params {params}")
        T, S = sum(lengths), params.total_tokens
        g = torch.Generator().manual_seed(seed * 10_000 + gi * 100 + case)  # the same on the group's ranks
        q, k, v = (torch.randn(S, h, head_dim, generator=g) for h in (heads, kv_heads, kv_heads))
        dy = torch.randn(S, heads * head_dim, generator=g)  # pad tokens get gradients too: must not leak
        ref_in = [t[:T].double().requires_grad_() for t in (q, k, v)]
        ref = _reference(*ref_in, lengths, head_dim ** -0.5).reshape(T, -1)
        (ref * dy[:T].double()).sum().backward()

        local = [params.shard(t).unsqueeze(1).to(rank_device()).requires_grad_() for t in (q, k, v)]
        out = attn(*local, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
        (out[:, 0] * params.shard(dy).to(rank_device())).sum().backward()
        start, end = params.shard_range
        n = max(0, min(end, T) - start)
        pairs = [(out[:n, 0], ref[start:start + n])] + [(x.grad[:n, 0], r.grad[start:start + n])
                                                        for x, r in zip(local, ref_in)]
        for what, (a, b) in zip(("out", "dq", "dk", "dv"), pairs):
            worst = max(worst, (a.double() - b).abs().max().item() if n else 0.0)
            if layout is None:
                fails.close(a.double(), b.detach(), f"{what}, lengths {lengths}, group {ranks} ring {ring}",
                            atol=2e-5, rtol=1e-5)
    fails.raise_any()
    return worst


@check
def ring_ulysses2_x_ring2_matches_reference():
    _ring_case([(0, 1, 2, 3)], ring=2, seed=1)


@check
def ring_ulysses1_x_ring2_matches_reference():
    _ring_case([(0, 1), (2, 3)], ring=2, seed=2, heads=2, kv_heads=1)


@check
def ring_ulysses1_x_ring4_matches_reference():
    _ring_case([(0, 1, 2, 3)], ring=4, seed=3, heads=4, kv_heads=1, head_dim=16)


@check
def ring_wrong_layout_is_detected():
    # sensitivity: the same tokens described as one long sequence must give other results
    worst = _ring_case([(0, 1, 2, 3)], ring=2, seed=4, layout=lambda ls: [sum(ls)])
    assert _global_max(worst) > 1e-2, worst


@check
def ring_refuses_clearly():
    import pytest
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.runtime.attention import UlyssesPackedSeqParams
    from megatron_ext.runtime.slices import PrefixKVCache

    r = ST["rank"]
    others = tuple(x for x in range(4) if x != r)
    with pytest.raises(ValueError, match=rf"this rank \({r}\) is not in the ring"):
        UlyssesPackedSeqParams.build([8], None, ring_ranks=others[:2])
    with pytest.raises(ValueError, match="token-level slices\\) run without a ring"):
        UlyssesPackedSeqParams.build([8], None, ring_ranks=(0, 1, 2, 3), starts=[4], keys=["a"], continues=[False],
                                     prefix_cache=PrefixKVCache())
    attn = _attention(2, 1, 8)
    attn.dropout_p = 0.1  # no CPU kernel with log-sum-exps takes attention dropout
    params = UlyssesPackedSeqParams.build([8], None, ring_ranks=(0, 1, 2, 3))
    q = torch.randn(2, 1, 2, 8, device=rank_device())
    with pytest.raises(ValueError, match="ring attention needs a fused kernel with log-sum-exps"):
        attn(q, q[:, :, :1], q[:, :, :1], None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)


# ---- whole training steps --------------------------------------------------------------------------

def _cost(max_ring: int = 2):
    """4 ranks, a model with 2 KV heads (Ulysses up to 2) and a memory that puts the long
    sequences on degree 4 = Ulysses 2 x ring 2."""
    from megatron_ext.cost import CostModel
    from megatron_ext.spec import ClusterSpec, ModelSpec

    model = ModelSpec(name="t", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=64, params_b=1e-5, act_mb_per_token=0.01, a1=1e-4, a2=0.05, launch_ms=5.0)
    cluster = ClusterSpec(name="c", num_nodes=1, gpus_per_node=4, memory_gb=1.2 / 1024,
                          a2a_bandwidth_gbps={2: 0.01, 4: 0.01})
    return CostModel(model, cluster).with_max_ring(max_ring)


def _models():
    if "models" not in ST:
        ST["models"] = model_and_reference(_cost().model, vocab_size=97, max_seq_len=SEQ_LEN)
    return ST["models"]


def _batch(seed: int):
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([rng.integers(2, 60, 9), rng.integers(120, 400, 3)])
    return lengths, [rng.integers(0, 97, n) for n in lengths]


def _run_step(plan, lengths, batch):
    """The step through the runtime against every sequence alone through megatron's attention."""
    from megatron_ext.data.loader import Step
    from megatron_ext.runtime.schedule import forward_backward_flexsp

    ddp, reference = _models()
    step = Step(step=0, plan=plan, batch=batch, lengths=lengths, samples=np.zeros((len(lengths), 3), int),
                digest="", plan_source="test", plan_wait_s=0.0)
    ddp.zero_grad_buffer()
    losses, _ = forward_backward_flexsp(step, ddp, ST["pool"], pad_id=0)
    total = torch.stack([d["lm loss"] for d in losses]).sum(0)
    dist.all_reduce(total)
    reference.zero_grad()
    ref_total = 0.0
    for seq in batch:
        tokens = torch.from_numpy(seq)
        ref_total = ref_total + reference(tokens[None, :-1], torch.arange(len(seq) - 1)[None], None,
                                          labels=tokens[None, 1:]).sum()
    count = int(sum(len(s) - 1 for s in batch))
    (ref_total / count).backward()
    fails = Failures()
    fails.close(float(total[0] / total[1]), float(ref_total / count), "loss", atol=0, rtol=1e-5)
    for (name, p), ref in zip(ddp.module.named_parameters(), reference.parameters()):
        fails.close(p.main_grad, ref.grad, name, atol=2e-6, rtol=1e-4)
    fails.raise_any()


@check
def hand_made_ring_plan_matches_single_process():
    # every layout in one step: Ulysses 2 x ring 2, ring 4, two rings of 2 (Ulysses 1) beside each
    # other, and plain groups; multi-document groups throughout
    from megatron_ext.plan.schema import MicroBatchPlan, SPGroup, StepPlan

    lengths, batch = _batch(5)
    mbs = [MicroBatchPlan([SPGroup([0, 1, 2, 3], [9, 0, 1], ring=2)]),
           MicroBatchPlan([SPGroup([0, 1, 2, 3], [10, 2], ring=4)]),
           MicroBatchPlan([SPGroup([0, 1], [11, 3, 4], ring=2), SPGroup([2, 3], [5, 6], ring=2)]),
           MicroBatchPlan([SPGroup([0, 1], [7], ring=1), SPGroup([2], [8])])]
    _run_step(StepPlan(kind="flexsp", num_gpus=4, micro_batches=mbs), lengths, batch)


@check
def planned_ring_step_matches_single_process():
    from megatron_ext.planner import PlannerOptions, make_plan

    lengths, batch = _batch(6)
    box = [make_plan("flexsp", lengths, _cost(), PlannerOptions(time_limit=5.0)) if ST["rank"] == 0 else None]
    dist.broadcast_object_list(box, src=0)
    rings = {(g.degree, g.ring) for mb in box[0].micro_batches for g in mb.groups}
    assert (4, 2) in rings, f"the plan should put the long sequences on Ulysses 2 x ring 2, got {rings}"
    _run_step(box[0], lengths, batch)


@check
def ring_steps_ran_under_nccl_rules():
    """The checks above ran in the check mode (runtime/device.py): their ring p2p calls were checked."""
    from megatron_ext.runtime.device import CHECKED

    assert CHECKED["batch_isend_irecv"] > 0, dict(CHECKED)
