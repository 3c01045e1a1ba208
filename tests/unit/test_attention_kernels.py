"""The attention kernels of runtime/kernels (also through UlyssesAttention and runtime/slices.py)
against dense float64 references, and the backend resolution with stand-ins for flash-attn and Transformer Engine."""
import contextlib
import gc
import types
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

import megatron_ext.runtime.kernels.base as A  # where the optional packages are found and CUDA is asked for
from megatron_ext.runtime.attention import UlyssesAttention, UlyssesPackedSeqParams
from megatron_ext.runtime.kernels import SDPA_DENSE_MASK_MAX_ELEMENTS, masked_sdpa, prefix_sdpa, prefixed_attention
import megatron_ext.runtime.saved as saved
import megatron_ext.runtime.slices as slices
from megatron_ext.runtime.slices import PrefixKVCache


def _dense(q, k, v, allowed, scale):
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    return torch.einsum("bhqk,bhkd->bhqd", s.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def _bottom_right(n_q, n_k, device=None):
    """Query i of n_q, the last n_q of n_k positions, sees keys up to its own position."""
    return torch.arange(n_k, device=device)[None, :] <= torch.arange(n_q, device=device)[:, None] + (n_k - n_q)


def _varlen(q, k, v, cu_q, cu_k, scale, mask: str):
    """Token-major [t, h, d] attention within segments (q segment i against k segment i), with
    ``mask`` "none", "top_left" or "bottom_right" causal alignment; differentiable."""
    outs = []
    for i in range(len(cu_q) - 1):
        qa, qb, ka, kb = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        n_q, n_k = qb - qa, kb - ka
        if mask == "none":
            allowed = torch.ones(n_q, n_k, dtype=torch.bool)
        elif mask == "top_left":
            allowed = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None]
        else:
            allowed = _bottom_right(n_q, n_k)
        heads_first = [t.transpose(0, 1)[None] for t in (q[qa:qb], k[ka:kb], v[ka:kb])]
        outs.append(_dense(*heads_first, allowed, scale)[0].transpose(0, 1))
    return torch.cat(outs)


def _rel(got, want):
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max())


# ---- the mask-free prefix kernel -------------------------------------------------------------------

@pytest.mark.parametrize("hq,hk,prefix,own,causal", [(4, 2, 37, 23, True), (2, 2, 5, 64, True),
                                                     (8, 1, 300, 1, True), (4, 2, 19, 11, False)])
def test_prefix_attention_matches_a_dense_mask_in_fp32(hq, hk, prefix, own, causal):
    g = torch.Generator().manual_seed(hq * 100 + prefix)
    q = torch.randn(1, hq, own, 8, generator=g, requires_grad=True)
    kp, vp = (torch.randn(1, hk, prefix, 8, generator=g, requires_grad=True) for _ in range(2))
    ko, vo = (torch.randn(1, hk, own, 8, generator=g, requires_grad=True) for _ in range(2))
    grad = torch.randn(1, hq, own, 8, generator=g)
    out = prefix_sdpa(q, kp, vp, ko, vo, causal, 0.3)
    got = torch.autograd.grad(out, (q, kp, vp, ko, vo), grad)
    # query t of the slice sits at position prefix + t: it sees the whole prefix and its own keys up to t
    leaves = [t.detach().double().requires_grad_() for t in (q, kp, vp, ko, vo)]
    allowed = _bottom_right(own, prefix + own) if causal else torch.ones(own, prefix + own, dtype=torch.bool)
    ref = _dense(leaves[0], torch.cat(leaves[1::2], 2), torch.cat(leaves[2::2], 2), allowed, 0.3)
    want = torch.autograd.grad(ref, leaves, grad.double())
    assert _rel(out, ref) < 1e-5
    for name, a, b in zip(("q", "prefix k", "prefix v", "k", "v"), got, want):
        assert _rel(a, b) < 1e-5, name


def test_prefix_attention_with_dropout_on_cpu_is_the_dense_one_under_the_same_dropout():
    # the CPU flash kernel has no dropout: explicit scores, dropped out as a dense attention would be
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 9, 8, generator=g, dtype=torch.float64, requires_grad=True)
    kp, vp = (torch.randn(1, 2, 13, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    ko, vo = (torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    torch.manual_seed(0)
    out = prefix_sdpa(q, kp, vp, ko, vo, True, 0.3, dropout_p=0.5)
    torch.manual_seed(0)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, torch.cat([kp, ko], 2).repeat_interleave(2, 1)) * 0.3
    probs = scores.masked_fill(~_bottom_right(9, 22), float("-inf")).softmax(-1)
    ref = torch.einsum("bhqk,bhkd->bhqd", F.dropout(probs, 0.5), torch.cat([vp, vo], 2).repeat_interleave(2, 1))
    assert not torch.allclose(ref, _dense(q, torch.cat([kp, ko], 2), torch.cat([vp, vo], 2), _bottom_right(9, 22), 0.3))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, kp, ko)), torch.autograd.grad(ref.sum(), (q, kp, ko))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_prefix_attention_calls_the_cuda_kernels_with_their_signatures(dropout_p):
    # no GPU here: the meta device runs the CUDA path's memory-efficient kernels for shapes only
    # (their log-sum-exps are padded to 32 rows: 50 queries exercise the padding)
    q = torch.empty(1, 4, 50, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    kp, vp = (torch.empty(1, 2, 70, 16, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    ko, vo = (torch.empty(1, 2, 50, 16, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = prefix_sdpa(q, kp, vp, ko, vo, True, 0.25, dropout_p)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out, (q, kp, vp, ko, vo), torch.empty_like(out))
    assert [tuple(t.shape) for t in grads] == [tuple(t.shape) for t in (q, kp, vp, ko, vo)]


# ---- packed segments, only some with a prefix ----------------------------------------------------

def _packed_case(seed, lengths, prefix_lens, hq, hk, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    S = sum(lengths)
    q = torch.randn(S, hq, 8, generator=g, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(S, hk, 8, generator=g, dtype=dtype, requires_grad=True) for _ in range(2))
    prefixes = [None if c == 0 else tuple(torch.randn(c, hk, 8, generator=g, dtype=dtype, requires_grad=True)
                                          for _ in range(2)) for c in prefix_lens]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return q, k, v, bounds, prefixes


@pytest.mark.parametrize("dense_limit", [0, 1 << 22])  # per-sequence SDPA calls, then one masked call
@pytest.mark.parametrize("hq,hk", [(4, 2), (2, 2)])
def test_packed_sequences_some_sliced_match_a_dense_reference(dense_limit, hq, hk, monkeypatch):
    monkeypatch.setitem(SDPA_DENSE_MASK_MAX_ELEMENTS, "cpu", dense_limit)
    lengths, prefix_lens = [7, 12, 3, 9, 5, 4], [0, 20, 0, 0, 6, 0]  # the last segment plays the padding
    q, k, v, bounds, prefixes = _packed_case(1, lengths, prefix_lens, hq, hk)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    out = prefixed_attention(q, k, v, bounds, prefixes, True, 0.4)
    prefix_leaves = [t for p in prefixes if p is not None for t in p]
    got = torch.autograd.grad(out, [q, k, v] + prefix_leaves, grad)

    leaves = [t.detach().double().requires_grad_() for t in [q, k, v] + prefix_leaves]
    q64, k64, v64, ref_prefixes = leaves[0], leaves[1], leaves[2], iter(leaves[3:])
    ks, vs, cu_k = [], [], [0]
    for (a, b), p in zip(zip(bounds[:-1], bounds[1:]), prefixes):
        if p is not None:
            ks.append(next(ref_prefixes))
            vs.append(next(ref_prefixes))
        ks.append(k64[a:b])
        vs.append(v64[a:b])
        cu_k.append(cu_k[-1] + b - a + (0 if p is None else p[0].shape[0]))
    ref = _varlen(q64, torch.cat(ks), torch.cat(vs), bounds, cu_k, 0.4, "bottom_right")
    want = torch.autograd.grad(ref, leaves, grad.double())
    assert _rel(out, ref) < 1e-5
    for i, (a, b) in enumerate(zip(got, want)):
        assert _rel(a, b) < 1e-5, f"gradient {i} (q, k, v, then each prefix's k and v)"


class _Sizes(TorchDispatchMode):
    """The largest tensor any aten op produces while active."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_sliced_sdpa_neither_builds_nor_keeps_anything_of_slice_by_prefix_size():
    slice_len, prefix_len = 64, 512  # a mask or score block of the slice against its prefix: 32768 elements
    q, k, v, bounds, prefixes = _packed_case(4, [slice_len, 40], [prefix_len, 0], 4, 2)
    saved = []
    with _Sizes() as sizes, torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                                     lambda t: t):
        out = prefixed_attention(q, k, v, bounds, prefixes, True, 0.3)
        out.sum().backward()
    # the largest things are the prefix K/V expanded to the query heads (4 * 512 * 8) and the like
    assert max(saved) < slice_len * prefix_len, max(saved)
    assert sizes.largest < slice_len * prefix_len, sizes.largest


def test_masked_attention_keeps_no_mask_for_the_backward():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 300, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 300, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    allowed = torch.ones(300, 300, dtype=torch.bool).tril()
    allowed[150:, :150] = False  # two packed sequences
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = masked_sdpa(q, k, v, (0, 150, 300), True, 0.3, 0.0)
    assert max(saved) < 300 * 300  # activations linear in the tokens: no [S, S] mask kept
    ref = _dense(q, k, v, allowed, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_masked_attention_elsewhere_shares_one_bias_over_the_layers():
    """Off the CPU flash path (here: float16, or dropout), SDPA gets the mask as an additive bias
    in the queries' dtype, built once per micro-batch and shared by every layer's call (a bool
    mask is converted anew at each call, and CUDA's memory-efficient kernel keeps each copy)."""
    from megatron_ext.runtime.kernels.sdpa import _block_causal_bias

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 300, 8, generator=g, dtype=torch.float32)
    k, v = (torch.randn(1, 2, 300, 8, generator=g, dtype=torch.float32) for _ in range(2))
    allowed = torch.ones(300, 300, dtype=torch.bool).tril()
    allowed[150:, :150] = False
    out = masked_sdpa(q.half(), k.half(), v.half(), (0, 150, 300), True, 0.3, 0.0)
    torch.testing.assert_close(out.float(), _dense(q, k, v, allowed, 0.3), rtol=2e-2, atol=2e-2)
    bias = _block_causal_bias((0, 150, 300), True, q.device, torch.float16)
    assert bias.dtype == torch.float16 and bias is _block_causal_bias((0, 150, 300), True, q.device, torch.float16)
    assert torch.equal(bias == 0, allowed)


# ---- backends: stand-ins for flash-attn and Transformer Engine on CPU tensors -----------------------

def _fake_flash(version="2.5.8"):
    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False):
        assert cu_q.dtype == cu_k.dtype == torch.int32 and dropout_p == 0.0
        assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())
        return _varlen(q, k, v, cu_q, cu_k, softmax_scale, "bottom_right" if causal else "none")  # flash-attn >= 2.1

    return types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func, __version__=version)


def _fake_te(mask_types=("padding", "padding_causal", "padding_causal_bottom_right"), no_kernel=False):
    """transformer_engine.pytorch and its constants: DotProductAttention in "thd" format with TE's
    mask semantics ("padding_causal" aligned top-left, "..._bottom_right" bottom-right)."""
    masks_run = []

    class DotProductAttention(torch.nn.Module):
        def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                     qkv_format="sbhd", attn_mask_type="causal", attention_type="self", softmax_scale=None,
                     layer_number=None):
            super().__init__()
            assert attn_mask_type in mask_types
            self.scale, self.attention_type = softmax_scale, attention_type

        def forward(self, q, k, v, qkv_format=None, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None,
                    max_seqlen_kv=None, attn_mask_type=None):
            if no_kernel:
                raise ValueError("No dot product attention backend is available for the provided inputs.")
            assert qkv_format == "thd" and "padding" in attn_mask_type and attn_mask_type in mask_types
            assert cu_seqlens_q.dtype == cu_seqlens_kv.dtype == torch.int32
            assert cu_seqlens_q.shape == cu_seqlens_kv.shape
            assert torch.equal(cu_seqlens_q, cu_seqlens_kv) or self.attention_type == "cross"
            masks_run.append(attn_mask_type)
            mask = {"padding": "none", "padding_causal": "top_left"}.get(attn_mask_type, "bottom_right")
            return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, self.scale, mask).reshape(q.shape[0], -1)

    pytorch = types.SimpleNamespace(DotProductAttention=DotProductAttention)
    return pytorch, types.SimpleNamespace(AttnMaskTypes=mask_types), masks_run


def _install(monkeypatch, flash=None, te=None, on_gpu=True):
    """Make runtime/kernels see these packages (None: absent) and, with ``on_gpu``, take CPU
    tensors for what its GPU kernels take."""
    modules = {"flash_attn": flash}
    if te is not None:
        modules.update({"transformer_engine.pytorch": te[0], "transformer_engine.pytorch.constants": te[1]})
    monkeypatch.setattr(A, "_optional", modules.get)
    if on_gpu:
        monkeypatch.setattr(A, "_gpu_refusal", lambda t, auto: None)


def _module(backend="auto"):
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            attention_dropout=0.0, hidden_dropout=0.0)
    return UlyssesAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=ProcessGroupCollection(tp=None),
                            backend=backend)


# Sequence "A" (40 tokens) runs as three slices; the others whole. Chunk 1: A[0:15], B. Chunk 2: C,
# A[15:28], D and padding. Chunk 3: A[28:40] (its prefix: two cached slices) and padding.
_SEQS = {"A": 40, "B": 9, "C": 6, "D": 5}
_CHUNKS = [dict(pieces=[("A", 0, 15), ("B", 0, 9)], continues=[True, False]),
           dict(pieces=[("C", 0, 6), ("A", 15, 28), ("D", 0, 5)], continues=[False, True, False]),
           dict(pieces=[("A", 28, 40)], continues=[False])]


def _run_chunks(module, seed=0, after_forwards=None):
    """Forward of the chunks, backward last first; per chunk: (q, k, v leaves, output, output grad).
    ``after_forwards()`` runs between the forwards and the backwards."""
    g = torch.Generator().manual_seed(seed)
    cache, runs = PrefixKVCache(), []
    for chunk in _CHUNKS:
        lengths = [b - a for _, a, b in chunk["pieces"]]
        params = UlyssesPackedSeqParams.build(lengths, pad_to_multiple_of=8, starts=[a for _, a, _ in chunk["pieces"]],
                                              keys=[name for name, _, _ in chunk["pieces"]],
                                              continues=chunk["continues"], prefix_cache=cache)
        S = params.total_tokens
        q = torch.randn(S, 1, 4, 8, generator=g, requires_grad=True)
        k, v = (torch.randn(S, 1, 2, 8, generator=g, requires_grad=True) for _ in range(2))
        out = module(q, k, v, None, packed_seq_params=params)
        grad = torch.randn(out.shape, generator=g) * params.loss_mask[:, None, None]  # padding: no loss
        runs.append((q, k, v, out, grad))
    if after_forwards is not None:
        after_forwards()
    for q, k, v, out, grad in reversed(runs):
        out.backward(grad)
    return runs


def _check_against_whole_sequences(runs):
    """Each sequence's rows gathered from the chunks: causal attention over the whole sequence."""
    rows = {name: [] for name in _SEQS}  # (chunk, first row in the chunk, length)
    for c, chunk in enumerate(_CHUNKS):
        first = 0
        for name, a, b in chunk["pieces"]:
            rows[name].append((c, first, b - a))
            first += b - a
    for name, pieces in rows.items():
        assert sum(n for _, _, n in pieces) == _SEQS[name]

        def gather(i):
            return torch.cat([runs[c][i][r:r + n, 0] for c, r, n in pieces]).detach().double()

        q, k, v = (gather(i).requires_grad_() for i in range(3))
        grad = torch.cat([runs[c][4][r:r + n, 0] for c, r, n in pieces]).double().view(q.shape)
        ref = _varlen(q, k, v, [0, len(q)], [0, len(q)], 8 ** -0.5, "top_left")
        ref.backward(grad)
        got_out = torch.cat([runs[c][3][r:r + n, 0] for c, r, n in pieces]).view(ref.shape)
        assert _rel(got_out, ref) < 1e-5, name
        for i, want in enumerate((q.grad, k.grad, v.grad)):
            got = torch.cat([runs[c][i].grad[r:r + n, 0] for c, r, n in pieces])
            assert _rel(got, want) < 1e-5, f"sequence {name}, gradient of {'qkv'[i]}"


@pytest.mark.parametrize("installed", ["nothing", "flash", "te", "te without bottom-right", "te without kernels"])
def test_slices_through_the_module_match_whole_sequences_on_every_backend(installed, monkeypatch):
    te_masks = ("padding", "padding_causal") if installed == "te without bottom-right" else \
        ("padding", "padding_causal", "padding_causal_bottom_right")
    te = _fake_te(te_masks, no_kernel=installed == "te without kernels")
    _install(monkeypatch, flash=_fake_flash() if installed == "flash" else None,
             te=te if installed.startswith("te") else None, on_gpu=installed != "nothing")
    falls_back = installed == "te without kernels"
    with pytest.warns(UserWarning, match="runs SDPA") if falls_back else contextlib.nullcontext():
        runs = _run_chunks(_module())
    _check_against_whole_sequences(runs)
    # the unsliced first chunk and the sliced others: which TE masks ran
    assert te[2] == {"te": ["padding_causal", "padding_causal_bottom_right", "padding_causal_bottom_right"],
                     "te without bottom-right": ["padding_causal"]}.get(installed, [])


@pytest.mark.parametrize("installed", ["nothing", "flash"])
def test_slices_keep_no_copy_of_their_prefix_for_the_backward(installed, monkeypatch):
    """What a slice's attention joins (the prefix's cached slices; [prefix; own] for varlen kernels)
    is gone once its forward is done: autograd keeps the parts and joins them again in the
    backward, which still matches whole sequences."""
    _install(monkeypatch, flash=_fake_flash() if installed == "flash" else None, te=None, on_gpu=installed == "flash")
    joined = []

    def recording(parts):
        out = saved.concatenate(parts)
        if len(parts) > 1:
            joined.append(weakref.ref(out))
        return out

    monkeypatch.setattr(slices, "concatenate", recording)
    monkeypatch.setattr(A, "concatenate", recording)

    def all_freed():
        gc.collect()
        assert joined and all(r() is None for r in joined)

    _check_against_whole_sequences(_run_chunks(_module(), after_forwards=all_freed))


def test_auto_with_te_and_without_flash_picks_what_runs(monkeypatch):
    module, q = _module(), torch.zeros(8, 4, 8)
    _install(monkeypatch, te=_fake_te())
    assert (module._resolve_backend(q), module._resolve_backend(q, sliced=True)) == ("te", "te")
    _install(monkeypatch, te=_fake_te(("padding", "padding_causal")))  # a TE before 1.9
    assert (module._resolve_backend(q), module._resolve_backend(q, sliced=True)) == ("te", "sdpa")
    with pytest.raises(RuntimeError, match="'te' cannot attend from a slice.*'padding_causal_bottom_right'"):
        _module("te")._resolve_backend(q, sliced=True)
    _install(monkeypatch, flash=_fake_flash(), te=_fake_te())
    assert module._resolve_backend(q, sliced=True) == "flash"
    monkeypatch.undo()  # the real checks: CPU tensors take SDPA whatever is installed
    _install(monkeypatch, flash=_fake_flash(), te=_fake_te(), on_gpu=False)
    assert (module._resolve_backend(q), module._resolve_backend(q, sliced=True)) == ("sdpa", "sdpa")
    with pytest.raises(RuntimeError, match="'te' needs CUDA tensors"):
        _module("te")._resolve_backend(q)


def test_a_flash_attn_before_2_1_runs_whole_sequences_only(monkeypatch):
    """Before 2.1 flash-attn aligns ``causal=True`` top-left: a slice would miss part of its prefix."""
    module, q = _module(), torch.zeros(8, 4, 8)
    _install(monkeypatch, flash=_fake_flash("2.0.9"))
    assert (module._resolve_backend(q), module._resolve_backend(q, sliced=True)) == ("flash", "sdpa")
    with pytest.raises(RuntimeError, match="'flash' cannot attend from a slice.*flash-attn 2.0.9"):
        _module("flash")._resolve_backend(q, sliced=True)
    _install(monkeypatch, flash=_fake_flash("2.1.0"))
    assert module._resolve_backend(q, sliced=True) == "flash"


def test_a_named_te_backend_reports_why_te_has_no_kernel(monkeypatch):
    _install(monkeypatch, te=_fake_te(no_kernel=True))
    q, k, v, bounds, prefixes = _packed_case(5, [6, 10], [0, 4], 4, 2)
    with pytest.raises(RuntimeError, match=r"no kernel for this attention \(THD\)"):
        _module("te")._packed(q, k, v, bounds, True, None)
    with pytest.raises(RuntimeError, match="no kernel for this attention .'padding_causal_bottom_right'"):
        _module("te")._packed(q, k, v, bounds, True, None, prefixes)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lengths,r", [([5, 3, 9, 1, 6], 4), ([24], 2), ([1, 1, 1, 13], 8), ([7, 9], 2)])
def test_ring_pieces_over_all_blocks_are_the_block_diagonal_mask(lengths, r, causal):
    from megatron_ext.runtime.kernels.sdpa import _block_causal_mask
    from megatron_ext.runtime.ring import ring_pieces

    total = -(-sum(lengths) // r) * r  # padded to a multiple of the ring blocks
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()] + ([total] if total > sum(lengths) else [])
    block = total // r
    got = torch.zeros(total, total, dtype=torch.bool)
    for i in range(r):
        for j in range(r):
            for qa, qb, ka, kb, c in ring_pieces(bounds, block, i, j, causal):
                part = torch.ones(qb - qa, kb - ka, dtype=torch.bool)
                got[i * block + qa:i * block + qb, j * block + ka:j * block + kb] = part.tril() if c else part
    assert torch.equal(got, _block_causal_mask(tuple(bounds), causal, "cpu"))


@pytest.mark.parametrize("capability, head, dtype, mask, flash", [
    ((9, 0), 256, torch.bfloat16, None, True), ((8, 0), 224, torch.float16, None, True),
    ((8, 6), 192, torch.bfloat16, None, True), ((8, 6), 224, torch.bfloat16, None, False),
    ((8, 9), 256, torch.bfloat16, None, False), ((9, 0), 320, torch.bfloat16, None, False),
    ((7, 5), 128, torch.float16, None, False), ((9, 0), 128, torch.float32, None, False),
    ((9, 0), 128, torch.bfloat16, "mask", False)])
def test_gqa_keeps_kv_unexpanded_only_where_torch_runs_flash(capability, head, dtype, mask, flash, monkeypatch):
    from megatron_ext.runtime.kernels.sdpa import _flash_runs

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    q = types.SimpleNamespace(dtype=dtype, shape=(1, 8, 64, head), device="cuda:0")
    assert _flash_runs(q, mask) is flash


def test_bf16_slices_lose_little_precision_against_the_uncut_sequence():
    # earlier slices' dK/dV sum their later slices' gradients in bf16 (one rounding each): within
    # bf16's own error of the uncut pass (an H100 at 65,536 tokens, 16 slices: dK 5.4e-3 against
    # 4.7e-3 uncut; docs/gpu.md). What this catches: a prefix gradient lost or counted twice, or
    # summed coarser than bf16 (on CPU the sliced errors even come out a little under the uncut one)
    import importlib.util
    from pathlib import Path
    path = Path(__file__).parents[2] / "benchmarks" / "slice_precision.py"
    spec = importlib.util.spec_from_file_location("slice_precision", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    errors = bench.relative_errors(512, 4, 2, [1, 4, 16])
    uncut = errors[1]
    assert all(e < 2e-2 for e in uncut)  # bf16 at all: a few 1e-3
    for n in (4, 16):
        assert all(e < 1.5 * u for e, u in zip(errors[n], uncut)), (n, errors[n], uncut)
