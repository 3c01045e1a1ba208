"""Worker for test_runtime_compat.py: one CPU rank (a 1-rank gloo group) running megatron-core with
``apply_cpu_compat()``; dist_harness forks it from a fresh interpreter, so the patches never
touch the pytest process."""
from __future__ import annotations

import logging

import torch

from dist_harness import check

ST: dict = {}


def preload():
    """Before anything is patched: on a "GPU machine" apply_cpu_compat must change nothing."""
    import pytest  # noqa: F401
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as random

    from megatron_ext.runtime import compat

    before = (torch.cuda.current_device, torch.cuda.synchronize, schedules.forward_backward_no_pipelining,
              random._get_cuda_rng_state, random.CudaRNGStatesTracker.fork)
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        ST["gpu_result"] = compat.apply_cpu_compat()
    finally:
        torch.cuda.is_available = real
    after = (torch.cuda.current_device, torch.cuda.synchronize, schedules.forward_backward_no_pipelining,
             random._get_cuda_rng_state, random.CudaRNGStatesTracker.fork)
    ST["gpu_untouched"] = all(a is b for a, b in zip(before, after)) and not compat.cpu_compat_applied()
    ST["cpu_result"] = compat.apply_cpu_compat()
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.models.gpt.gpt_model  # noqa: F401
    import megatron_ext.runtime.attention  # noqa: F401


def setup():
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def _patched_objects():
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as random
    import megatron.core.transformer.utils as tutils
    from megatron.core.fusions import fused_softmax

    return (torch.cuda.current_device, torch.cuda.synchronize, schedules.forward_backward_no_pipelining,
            schedules.forward_backward_pipelining_without_interleaving, tutils.get_default_causal_mask,
            fused_softmax.get_default_causal_mask, random._get_cuda_rng_state, random._set_cuda_rng_state,
            random.CudaRNGStatesTracker.add, random.CudaRNGStatesTracker.fork)


@check
def compat_is_a_no_op_with_cuda():
    assert ST["gpu_result"] is False and ST["gpu_untouched"]


@check
def compat_applies_once_and_is_idempotent():
    from megatron_ext.runtime.compat import apply_cpu_compat, cpu_compat_applied

    assert ST["cpu_result"] is True and cpu_compat_applied()
    first = _patched_objects()
    assert apply_cpu_compat() is True
    again = _patched_objects()
    assert all(a is b for a, b in zip(first, again))
    sched = first[2]
    assert not getattr(sched.__wrapped__, "__megatron_ext_cpu_compat__", False), "wrapped twice"
    assert first[4] is first[5], "a by-name import of a patched function was missed"
    assert torch.cuda.current_device() == torch.device("cpu") and torch.cuda.synchronize() is None
    assert not torch.cuda.is_available()
    assert torch.equal(first[4](3), torch.triu(torch.ones(3, 3), diagonal=1).bool())


@check
def rng_tracker_forks_cpu_state():
    from megatron.core import tensor_parallel

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("megatron.core.tensor_parallel.random").addHandler(handler)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(77)
        tracker = tensor_parallel.get_cuda_rng_tracker()
        torch.manual_seed(5)
        plain = torch.rand(4)
        torch.manual_seed(5)
        a = torch.rand(2)
        with tracker.fork():
            inside1 = torch.rand(4)
            with tracker.fork("expert-parallel-rng"):
                torch.rand(3)
            inside1b = torch.rand(2)
        b = torch.rand(2)
        assert torch.equal(torch.cat([a, b]), plain), "fork did not restore the outer state"
        with tracker.fork():
            inside2 = torch.rand(4)
        assert not torch.equal(inside1, inside2), "the tracked state did not advance"
        tensor_parallel.model_parallel_cuda_manual_seed(77)
        with tracker.fork():
            assert torch.equal(torch.rand(4), inside1) and torch.equal(torch.rand(2), inside1b)
        assert not torch.equal(inside1, plain)
        assert not records, [r.getMessage() for r in records]
    finally:
        logging.getLogger("megatron.core.tensor_parallel.random").removeHandler(handler)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64,
                hidden_dropout=0.0, attention_dropout=0.0)
    return TransformerConfig(**{**base, **kw})


def _models(ulysses_backend="sdpa", **cfg):
    """(megatron local spec model, Ulysses-spec model with the same weights)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_ext.runtime.attention import get_gpt_layer_ulysses_spec
    from megatron_ext.runtime.rope import use_true_positions_for_rope

    config = _config(**cfg)
    kw = dict(vocab_size=97, max_sequence_length=128, position_embedding_type="rope")
    ref = GPTModel(config, get_gpt_layer_local_spec(), **kw)
    mine = GPTModel(config, get_gpt_layer_ulysses_spec(backend=ulysses_backend), **kw)
    mine.load_state_dict(ref.state_dict())
    use_true_positions_for_rope(mine)
    return ref, mine


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _close_grads(a, b, **tol):
    assert a.keys() == b.keys() and a
    for n in a:
        torch.testing.assert_close(a[n], b[n], msg=lambda m: f"{n}: {m}", **tol)


@check
def megatron_gpt_local_spec_trains_on_cpu():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    ref, _ = _models()
    assert isinstance(ref.decoder.layers[0].self_attention.core_attention, DotProductAttention)
    assert all(p.device.type == "cpu" for p in ref.parameters())
    ids = torch.randint(0, 97, (2, 24))
    loss = ref(ids, torch.arange(24).expand(2, -1), None, labels=ids)
    assert loss.shape == (2, 24) and torch.isfinite(loss).all()
    loss.mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ref.parameters())


@check
def ulysses_spec_equals_dot_product_attention_on_plain_batches():
    from megatron_ext.runtime.attention import UlyssesAttention

    ref, mine = _models()
    assert isinstance(mine.decoder.layers[1].self_attention.core_attention, UlyssesAttention)
    ids = torch.randint(0, 97, (3, 20))
    pos = torch.arange(20).expand(3, -1)
    for mask in (None, torch.rand(3, 1, 20, 20) > 0.7):
        if mask is not None:
            mask[..., torch.arange(20), torch.arange(20)] = False  # every query keeps one key
        ref.zero_grad(), mine.zero_grad()
        a = ref(ids, pos, mask, labels=ids)
        b = mine(ids, pos, mask, labels=ids)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        a.sum().backward(), b.sum().backward()
        _close_grads(_grads(mine), _grads(ref), atol=1e-5, rtol=1e-4)


def _sequences(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=g) for n in lengths]


@check
def packed_degree1_equals_megatron_one_sequence_at_a_time():
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_ext.runtime.attention import UlyssesPackedSeqParams

    ref, mine = _models()
    lengths = [5, 17, 1, 9]
    seqs = _sequences(lengths)
    ref_loss = torch.cat([ref(s[None], torch.arange(len(s))[None], None, labels=s[None])[0] for s in seqs])
    ref_loss.sum().backward()
    want = _grads(ref)

    # our packed layout (degree 1): rope at true positions
    params = UlyssesPackedSeqParams.build(lengths)
    tokens = params.shard(torch.cat(seqs))[None]
    loss = mine(tokens, params.position_ids[None], None, labels=tokens, packed_seq_params=params)[0]
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-5, rtol=1e-5)
    loss.sum().backward()
    _close_grads(_grads(mine), want, atol=1e-5, rtol=1e-4)

    # megatron's own "thd" PackedSeqParams through the same module
    mine.zero_grad()
    cu = params.cu_seqlens_q
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                          max_seqlen_kv=max(lengths))
    loss = mine(tokens, params.position_ids[None], None, labels=tokens, packed_seq_params=thd)[0]
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-5, rtol=1e-5)
    loss.sum().backward()
    _close_grads(_grads(mine), want, atol=1e-5, rtol=1e-4)


@check
def packed_layout_pads_to_the_degree_and_masks_padding():
    from megatron_ext.runtime.attention import UlyssesPackedSeqParams

    p = UlyssesPackedSeqParams.build([3, 2], pad_to_multiple_of=4)
    assert (p.num_tokens, p.total_tokens, p.shard_len, p.shard_range) == (5, 8, 8, (0, 8))
    assert p.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert p.loss_mask.tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert p.cu_seqlens_q.tolist() == [0, 3, 5] and p.cu_seqlens_q_padded.tolist() == [0, 3, 8]
    assert p.segment_bounds() == [0, 3, 5, 8] and p.max_seqlen_q == 3 and p.qkv_format == "sbhd"
    assert p.shard(torch.arange(5), pad_value=-1).tolist() == [0, 1, 2, 3, 4, -1, -1, -1]
    import pytest

    with pytest.raises(ValueError, match="at least one sequence"):
        UlyssesPackedSeqParams.build([])
    with pytest.raises(ValueError, match="tokens along dim"):
        p.shard(torch.arange(6))


@check
def megatron_schedule_runs_with_ulysses_micro_batches():
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ext.runtime.attention import UlyssesPackedSeqParams

    ref, mine = _models(calculate_per_token_loss=True)
    micro_batches = [[7, 3, 12], [1, 2], [20]]
    batches = []
    for i, lengths in enumerate(micro_batches):
        seqs = _sequences(lengths, seed=10 + i)
        params = UlyssesPackedSeqParams.build(lengths)
        tokens = params.shard(torch.cat(seqs))[None]
        batches.append((tokens, params))

    def forward_step(data_iterator, model):
        tokens, params = next(data_iterator)
        out = model(tokens, params.position_ids[None], None, labels=tokens, packed_seq_params=params)

        def loss_func(loss):
            mask = params.loss_mask
            total = (loss[0] * mask).sum()
            return total, mask.sum().int(), {"lm loss": total.detach()}

        return out, loss_func

    fb = get_forward_backward_func()
    out = fb(forward_step_func=forward_step, data_iterator=iter(batches), model=[mine],
             num_microbatches=len(batches), seq_length=32, micro_batch_size=1, forward_only=False)
    got = sum(float(o["lm loss"]) for o in out)

    want = 0.0
    for i, lengths in enumerate(micro_batches):
        for s in _sequences(lengths, seed=10 + i):
            loss = ref(s[None], torch.arange(len(s))[None], None, labels=s[None]).sum()
            loss.backward()
            want += float(loss)
    assert abs(got - want) < 1e-4 * max(1.0, abs(want)), (got, want)
    _close_grads(_grads(mine), _grads(ref), atol=1e-5, rtol=1e-4)


@check
def recompute_with_dropout_reproduces_rng_on_cpu():
    from megatron.core import tensor_parallel

    from megatron_ext.runtime.attention import UlyssesPackedSeqParams

    _, plain = _models(hidden_dropout=0.2, attention_dropout=0.2)
    _, recomputed = _models(hidden_dropout=0.2, attention_dropout=0.2, recompute_granularity="full",
                            recompute_method="uniform", recompute_num_layers=1)
    recomputed.load_state_dict(plain.state_dict())
    lengths = [9, 4, 13]
    params = UlyssesPackedSeqParams.build(lengths)
    tokens = params.shard(torch.cat(_sequences(lengths)))[None]
    losses = []
    for model in (plain, recomputed):
        torch.manual_seed(3)
        tensor_parallel.model_parallel_cuda_manual_seed(3)
        loss = model(tokens, params.position_ids[None], None, labels=tokens, packed_seq_params=params)
        loss.sum().backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], atol=0, rtol=0)
    _close_grads(_grads(recomputed), _grads(plain), atol=1e-6, rtol=1e-5)
    torch.manual_seed(4)  # a different seed gives different dropout: the comparison can fail
    other = plain(tokens, params.position_ids[None], None, labels=tokens, packed_seq_params=params)
    assert not torch.equal(other.detach(), losses[0])
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


@check
def hard_coded_cuda_helpers_run_on_cpu():
    import torch.distributed as dist
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank
    from megatron.core.tensor_parallel.data import broadcast_data
    from megatron.core.transformer.utils import get_sliding_window_causal_mask

    from megatron_ext.runtime.compat import _CpuDeviceMode

    emb = torch.arange(8.0).view(8, 1, 1, 1)
    assert torch.equal(get_pos_emb_on_this_cp_rank(emb, 0, dist.group.WORLD), emb)  # pin_memory + .cuda()
    data = {"tokens": torch.arange(6).view(2, 3), "labels": torch.ones(2, 3, dtype=torch.int64)}
    out = broadcast_data(["tokens", "labels"], data, torch.int64)  # .cuda() on the batch
    assert all(torch.equal(out[k], data[k]) for k in data)
    assert get_sliding_window_causal_mask(4, 4, (1, 0)).device.type == "cpu"
    x = torch.ones(2)
    with _CpuDeviceMode():
        made = [torch.zeros(2, device="cuda"), x.cuda(), x.to("cuda"), x.to(device=torch.device("cuda", 0)),
                torch.tensor([1.0], pin_memory=True), x.pin_memory(), torch.empty(1, device=0)]
    assert all(t.device.type == "cpu" for t in made)


@check
def backends_on_cpu_and_bf16():
    import pytest
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.runtime.attention import UlyssesAttention, UlyssesPackedSeqParams, get_gpt_layer_ulysses_spec
    from megatron_ext.runtime.kernels import available_backends

    assert available_backends() == ["sdpa"]
    cfg = _config()
    auto = UlyssesAttention(cfg, 1, AttnMaskType.causal, "self")
    flash = UlyssesAttention(cfg, 1, AttnMaskType.causal, "self", backend="flash")
    with pytest.raises(ValueError, match="unknown attention backend"):
        UlyssesAttention(cfg, 1, AttnMaskType.causal, "self", backend="xformers")
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_gpt_layer_ulysses_spec(backend="xformers")
    params = UlyssesPackedSeqParams.build([6, 3])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, 1, h, 4, generator=g) for h in (8, 4, 4))
    with pytest.raises(RuntimeError, match="needs CUDA"):
        flash(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
    full = auto(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
    half = auto(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, attn_mask_type=AttnMaskType.causal,
                packed_seq_params=params)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), full, atol=3e-2, rtol=3e-2)
