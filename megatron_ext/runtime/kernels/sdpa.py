"""The SDPA backend: torch's fused attention kernels, on any device.

* Whole sequences (``sdpa_packed``): one ``scaled_dot_product_attention`` call under a
  block-diagonal causal mask where the mask is small (``SDPA_DENSE_MASK_MAX_ELEMENTS``, by device
  type), else one causal call per packed sequence. On CPU the mask is rebuilt for the backward
  rather than kept (``masked_sdpa``), so activations stay linear in tokens.
* Slices over their prefix K/V (``prefixed_attention``, ``prefix_sdpa``): no slice x prefix mask;
  the prefix and the slice's own keys are two fused kernel calls (CPU flash attention, CUDA's
  memory-efficient kernel) merged by their log-sum-exps.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_ext.runtime.device import host_to_device
from megatron_ext.runtime.kernels.base import AttentionKernel, segment_sizes


# The SDPA backend runs one masked [S, S] call per micro-batch up to this many elements, by device
# type, else one causal call per packed sequence. A masked kernel costs S^2 however short the
# sequences (the cost model's sum of s^2 is the per-sequence calls'); on CUDA it saves launches for
# many short sequences, on CPU the per-sequence calls are always faster (2-10x measured), so 0.
SDPA_DENSE_MASK_MAX_ELEMENTS = {"cuda": 1 << 22, "cpu": 0}


def dense_mask_fits(rows: int, cols: int, device) -> bool:
    return rows * cols <= SDPA_DENSE_MASK_MAX_ELEMENTS.get(torch.device(device).type, 0)


# dtypes the CPU flash-attention kernels (forward and backward) are used for here
_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


# ---- attention over packed segments --------------------------------------------------------------

@functools.lru_cache(maxsize=8)  # every layer of a micro-batch, forward and backward, asks for the same
def _block_causal_mask(bounds: tuple[int, ...], causal: bool, device) -> Tensor:
    """bool [S, S], True where query i may attend key j: same segment (and j <= i if causal)."""
    sizes = torch.tensor(segment_sizes(bounds))
    # built on the host: no wait for the GPU
    seg = host_to_device(torch.repeat_interleave(torch.arange(len(sizes)), sizes), device)
    mask = seg[:, None] == seg[None, :]
    if causal:
        mask = torch.tril(mask)  # within a diagonal block, tril is exactly the causal mask
    return mask


class _MaskedFlashCPU(torch.autograd.Function):
    """CPU flash attention under a mask that is rebuilt for the backward instead of saved: what
    autograd keeps stays linear in the tokens (q, k, v, out, logsumexp) as on GPU kernels, where
    F.scaled_dot_product_attention would keep the [S, S_k] float mask of every layer."""

    @staticmethod
    def forward(ctx, q, k, v, make_mask, scale):
        groups = q.shape[1] // k.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, expand_kv(k, groups), expand_kv(v, groups), 0.0, False, attn_mask=_additive(make_mask(), q.dtype),
            scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.make_mask, ctx.scale, ctx.groups = make_mask, scale, groups
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        g = ctx.groups
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.contiguous(), q, expand_kv(k, g), expand_kv(v, g), out, lse, 0.0, False,
            attn_mask=_additive(ctx.make_mask(), q.dtype), scale=ctx.scale)
        return dq, fold_kv(dk, k.shape[1]), fold_kv(dv, v.shape[1]), None, None


def expand_kv(t: Tensor, groups: int) -> Tensor:
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def _ampere(q: Tensor) -> bool:
    """Whether ``q``'s GPU is an Ampere or newer (compute capability 8+)."""
    return torch.cuda.get_device_capability(q.device)[0] >= 8


def _flash_runs(q: Tensor, attn_mask) -> bool:
    """Whether torch's flash kernel takes this call: half precision, no mask, an Ampere or newer
    GPU, head size up to 256, and up to 192 on sm86 / sm89 (torch has no flash backward above 192
    there; counted for forward-only calls too, where expanding K/V costs memory only)."""
    if not (q.dtype in (torch.float16, torch.bfloat16) and attn_mask is None and _ampere(q)):
        return False
    return q.shape[-1] <= (192 if torch.cuda.get_device_capability(q.device) in ((8, 6), (8, 9)) else 256)


def gqa_sdpa(qb: Tensor, kb: Tensor, vb: Tensor, attn_mask: Tensor | None = None, **kw) -> Tensor:
    """F.scaled_dot_product_attention where K/V [b, hk, S, d] may have fewer heads than Q. On CUDA
    torch runs ``enable_gqa`` in its flash kernel (half precision, no mask) or its math one, which
    keeps an [S, S] matrix per head (fp32 ``tiny`` at 8,192 tokens ran out of an H100's 80 GB): where
    flash cannot run, K/V are expanded so the memory-efficient kernel does."""
    groups = qb.shape[1] // kb.shape[1]
    if groups > 1 and qb.device.type == "cuda" and not _flash_runs(qb, attn_mask):
        kb, vb, groups = expand_kv(kb, groups), expand_kv(vb, groups), 1
    return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=attn_mask, enable_gqa=groups > 1, **kw)


def fold_kv(grad: Tensor, heads: int) -> Tensor:
    """The gradient of an expanded K/V summed back over the query heads each KV head served."""
    return grad.unflatten(1, (heads, grad.shape[1] // heads)).sum(2) if grad.shape[1] != heads else grad


# A slice's attention over its prefix (every key visible) and its own keys (causal), without a mask
# over the prefix: each part is one fused kernel call that also returns its log-sum-exps, and the
# two are merged by them. Kernels by device: CPU flash attention (no dropout) and, elsewhere, the
# memory-efficient kernel (CUDA; the meta device runs it for shapes only). Their log-sum-exps are
# float32 [b, h, s], padded on CUDA to a multiple of 32 rows with +inf (no weight in the backward).

def _cpu_flash_forward(q, k, v, causal, scale, dropout_p):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, None


def _cpu_flash_backward(grad, q, k, v, out, lse, rng, causal, scale, dropout_p):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal,
                                                                               scale=scale)


def _efficient_forward(q, k, v, causal, scale, dropout_p):
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p,
                                                                                    causal, scale=scale)
    return out, lse, (seed, offset)  # the backward regenerates the dropout mask from the seed


def _efficient_backward(grad, q, k, v, out, lse, rng, causal, scale, dropout_p):
    # the kernel reads ``out`` [b, h, s, d] as its forward wrote it, [b, s, h, d] in memory, whatever
    # its strides say (o_strideM is h * d; at half precision it computes delta from out itself):
    # a slice of a heads-first buffer (the ring's) would be read at the wrong rows
    out = out.transpose(1, 2).contiguous().transpose(1, 2)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, None, out, lse, rng[0], rng[1], dropout_p, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def lse_kernels(q: Tensor, dropout_p: float):
    """(forward, backward) of a fused kernel that takes ``q`` and returns log-sum-exps, or None."""
    if q.device.type == "cpu":
        return (_cpu_flash_forward, _cpu_flash_backward) if dropout_p == 0.0 and q.dtype in _CPU_FLASH_DTYPES else None
    if q.dtype == torch.bfloat16 and q.device.type == "cuda" and not _ampere(q):
        return None  # (the kernel has no bf16 build before Ampere)
    if q.dtype in (torch.float16, torch.bfloat16, torch.float32) and q.shape[-1] % 8 == 0:
        return _efficient_forward, _efficient_backward
    return None


def lse_merge(o1: Tensor, l1: Tensor, o2: Tensor, l2: Tensor) -> tuple[Tensor, Tensor]:
    """Two attentions of the same queries over disjoint keys as one: outputs ``o`` [..., s, d] and
    their log-sum-exps ``l`` [..., >= s] (a kernel's padding rows beyond s merge like the others)
    -> (the output of the union of the keys, its log-sum-exp)."""
    s = o1.shape[-2]
    lse = torch.logaddexp(l1, l2)
    w1, w2 = (torch.exp(l[..., :s] - lse[..., :s]).unsqueeze(-1) for l in (l1, l2))
    return o1 * w1 + o2 * w2, lse


class _PrefixAttention(torch.autograd.Function):
    """q [1, hq, s, d] over its prefix's K/V (all visible) and its own K/V [1, hk, ., d] (causal or
    not) as two kernel calls merged by their log-sum-exps. The backward runs each part's kernel
    backward against the merged output and log-sum-exp, which gives exactly that part's gradient
    (the probabilities are those of the union). Saved: q, the K/V, the output and the log-sum-exps."""

    @staticmethod
    def forward(ctx, q, kp, vp, ko, vo, causal, scale, dropout_p, kernels):
        g = q.shape[1] // kp.shape[1]
        forward_kernel = kernels[0]
        o1, l1, rng1 = forward_kernel(q, expand_kv(kp, g), expand_kv(vp, g), False, scale, dropout_p)
        o2, l2, rng2 = forward_kernel(q, expand_kv(ko, g), expand_kv(vo, g), causal, scale, dropout_p)
        out, lse = lse_merge(o1, l1, o2, l2)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kp, vp, ko, vo, out, lse)
        ctx.causal, ctx.scale, ctx.dropout_p, ctx.kernels, ctx.rng = causal, scale, dropout_p, kernels, (rng1, rng2)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, kp, vp, ko, vo, out, lse = ctx.saved_tensors
        g, hk, grad = q.shape[1] // kp.shape[1], kp.shape[1], grad.contiguous()
        backward_kernel, p = ctx.kernels[1], ctx.dropout_p
        dq1, dkp, dvp = backward_kernel(grad, q, expand_kv(kp, g), expand_kv(vp, g), out, lse, ctx.rng[0], False,
                                        ctx.scale, p)
        dq2, dko, dvo = backward_kernel(grad, q, expand_kv(ko, g), expand_kv(vo, g), out, lse, ctx.rng[1],
                                        ctx.causal, ctx.scale, p)
        return (dq1 + dq2, fold_kv(dkp, hk), fold_kv(dvp, hk), fold_kv(dko, hk), fold_kv(dvo, hk),
                None, None, None, None)


def _prefix_attention_unfused(q, kp, vp, ko, vo, causal: bool, scale: float, dropout_p: float) -> Tensor:
    """The same attention with explicit scores, for inputs no fused kernel above takes (dropout on
    CPU, float64 on CUDA, ...): like any unfused attention it holds slice x (prefix + slice) scores
    per head; the only mask is the slice's own [s, s] triangle."""
    g, s, c = q.shape[1] // kp.shape[1], q.shape[2], kp.shape[2]
    prefix_scores = torch.matmul(q, expand_kv(kp, g).transpose(-1, -2)) * scale
    own_scores = torch.matmul(q, expand_kv(ko, g).transpose(-1, -2)) * scale
    if causal:
        own_scores = own_scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)  # at least fp32 for half inputs
    probs = torch.softmax(torch.cat([prefix_scores, own_scores], -1), -1, dtype=softmax_dtype).to(q.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs[..., :c], expand_kv(vp, g)) + torch.matmul(probs[..., c:], expand_kv(vo, g))


def prefix_sdpa(q: Tensor, kp: Tensor, vp: Tensor, ko: Tensor, vo: Tensor, causal: bool, scale: float,
                dropout_p: float = 0.0) -> Tensor:
    """Attention of a slice at its true positions: ``q`` [1, hq, s, d] over its prefix's K/V
    ``kp``/``vp`` [1, hk, c, d] (all visible) and its own ``ko``/``vo`` [1, hk, s, d] (up to each
    query when ``causal``). No [s, c] mask is built and nothing of that size is kept for the backward."""
    kernels = lse_kernels(q, dropout_p)
    if kernels is None:
        return _prefix_attention_unfused(q, kp, vp, ko, vo, causal, scale, dropout_p)
    return _PrefixAttention.apply(q, kp, vp, ko, vo, causal, scale, dropout_p, kernels)


def _additive(mask: Tensor, dtype) -> Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


@functools.lru_cache(maxsize=8)
def _block_causal_bias(bounds: tuple[int, ...], causal: bool, device, dtype) -> Tensor:
    """``_block_causal_mask`` as SDPA's additive bias in the queries' dtype, built once for every
    layer of a micro-batch: a bool mask is converted to a new float one at every call, and the
    memory-efficient CUDA kernel keeps each layer's for the backward (S^2 a layer)."""
    return _additive(_block_causal_mask(bounds, causal, device), dtype)


def masked_sdpa(qb: Tensor, kb: Tensor, vb: Tensor, bounds: tuple[int, ...], causal: bool, scale: float,
                dropout_p: float) -> Tensor:
    """Attention of ``qb`` [1, hq, S, d] over ``kb``/``vb`` [1, hk, S, d] within the segments of
    ``bounds`` (causal within each if ``causal``); GQA when hk < hq. On CPU without dropout the mask
    is not kept for the backward (``_MaskedFlashCPU``); elsewhere every layer shares one bias."""
    if qb.device.type == "cpu" and dropout_p == 0.0 and qb.dtype in _CPU_FLASH_DTYPES:
        return _MaskedFlashCPU.apply(qb, kb, vb, functools.partial(_block_causal_mask, bounds, causal, qb.device),
                                     scale)
    return gqa_sdpa(qb, kb, vb, attn_mask=_block_causal_bias(bounds, causal, qb.device, qb.dtype),
                    dropout_p=dropout_p, scale=scale)


def sdpa_packed(q: Tensor, k: Tensor, v: Tensor, bounds: Sequence[int], causal: bool, scale: float,
                dropout_p: float) -> Tensor:
    """q [S, hq, dh], k/v [S, hk, dh] -> [S, hq, dh], attention within each segment."""
    S = q.shape[0]
    qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, h, S, dh]
    if len(bounds) == 2:
        o = gqa_sdpa(qb, kb, vb, dropout_p=dropout_p, is_causal=causal, scale=scale)
    elif dense_mask_fits(S, S, q.device):
        o = masked_sdpa(qb, kb, vb, tuple(bounds), causal, scale, dropout_p)
    else:
        # split, not one slice per segment: a slice's backward writes a zero gradient the size of
        # the whole buffer, n segments cost n x S (on an H200, 25% of a 16-sequence micro-batch)
        sizes = segment_sizes(bounds)
        o = torch.cat([gqa_sdpa(qs, ks, vs, dropout_p=dropout_p, is_causal=causal, scale=scale)
                       for qs, ks, vs in zip(qb.split(sizes, 2), kb.split(sizes, 2), vb.split(sizes, 2))], dim=2)
    return o.squeeze(0).transpose(0, 1)


# ---- attention over packed segments, some with a prefix ---------------------------------------

def prefixed_attention(q: Tensor, k: Tensor, v: Tensor, bounds: Sequence[int], prefixes: Sequence, causal: bool,
                       scale: float, dropout_p: float = 0.0) -> Tensor:
    """SDPA within each packed segment of ``q`` [S, hq, dh], ``k``/``v`` [S, hk, dv], where segment i
    (``bounds[i]:bounds[i+1]``) also attends to ``prefixes[i] = (pk, pv)`` ([C_i, hk, d], all visible:
    they precede the segment) or to nothing (None). No mask covers a prefix: a segment with one runs
    ``prefix_sdpa`` (the prefix and its own keys as two kernel calls merged by log-sum-exps), and
    the runs of segments between such segments go through the packed path of whole sequences."""
    def heads_first(t):
        return t.transpose(0, 1).unsqueeze(0)  # [n, h, d] -> [1, h, n, d]

    # pieces: each segment with a prefix alone, the runs between them whole; cut by one split
    # (a slice per piece would cost a buffer-sized zero gradient each in the backward)
    cuts = sorted({0, bounds[-1]} | {bounds[j] for i, p in enumerate(prefixes) if p is not None for j in (i, i + 1)})
    sizes = segment_sizes(cuts)
    segment_at = {a: i for i, a in enumerate(bounds)}
    outs = []
    for a, b, qp, kp, vp in zip(cuts[:-1], cuts[1:], q.split(sizes), k.split(sizes), v.split(sizes)):
        i = segment_at[a]
        prefix = prefixes[i]
        if prefix is None:  # segments i.. up to b, none with a prefix
            outs.append(sdpa_packed(qp, kp, vp, [x - a for x in bounds[i:segment_at[b] + 1]], causal, scale,
                                    dropout_p))
            continue
        o = prefix_sdpa(heads_first(qp), heads_first(prefix[0].to(k.dtype)), heads_first(prefix[1].to(v.dtype)),
                        heads_first(kp), heads_first(vp), causal, scale, dropout_p)
        outs.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


# ---- the backend ----------------------------------------------------------------------------------

class SdpaKernel(AttentionKernel):
    """torch's scaled_dot_product_attention and its fused kernels: runs anything, on any device."""

    name = "sdpa"

    def packed(self, q, k, v, bounds, causal, *, training, cache=None):
        return sdpa_packed(q, k, v, bounds, causal, self.softmax_scale, self.dropout(training))

    def prefixed(self, q, k, v, bounds, prefixes, causal, *, training, cache=None):
        return prefixed_attention(q, k, v, bounds, prefixes, causal, self.softmax_scale, self.dropout(training))
