"""The CPU attention kernels of runtime/attention.py against dense float64 references."""
import pytest
import torch

from megatron_ext.runtime.attention import masked_sdpa, prefix_causal_sdpa


def _dense(q, k, v, allowed, scale):
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    return torch.einsum("bhqk,bhkd->bhqd", s.masked_fill(~allowed, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("hq,hk,prefix,own", [(4, 2, 37, 23), (2, 2, 5, 64), (8, 1, 300, 1)])
def test_prefix_causal_attention_is_exact(hq, hk, prefix, own):
    g = torch.Generator().manual_seed(hq * 100 + prefix)
    q = torch.randn(1, hq, own, 8, generator=g, dtype=torch.float64, requires_grad=True)
    kp, vp = (torch.randn(1, hk, prefix, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    ko, vo = (torch.randn(1, hk, own, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = prefix_causal_sdpa(q, kp, vp, ko, vo, 0.3)
    # query t of the slice sits at position prefix + t: it sees the whole prefix and its own keys up to t
    allowed = torch.arange(prefix + own)[None, :] <= torch.arange(own)[:, None] + prefix
    ref = _dense(q, torch.cat([kp, ko], 2), torch.cat([vp, vo], 2), allowed, 0.3)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, kp, vp, ko, vo), grad)
    want = torch.autograd.grad(ref, (q, kp, vp, ko, vo), grad)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_masked_attention_keeps_no_mask_for_the_backward():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 300, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 300, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    allowed = torch.ones(300, 300, dtype=torch.bool).tril()
    allowed[150:, :150] = False  # two packed sequences
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = masked_sdpa(q, k, v, lambda: allowed, 0.3, 0.0)
    assert max(saved) < 300 * 300  # activations linear in the tokens: no [S, S] mask kept
    ref = _dense(q, k, v, allowed, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
