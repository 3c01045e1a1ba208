"""Gradients of a sequence cut into token-level slices, in bf16, against the same sequence uncut.

A sliced sequence's earlier slices receive the gradient of their K/V from every later slice, summed
in the gradient's dtype (``runtime/slices.py``: one bf16 rounding per later slice). This measures
what that costs: the relative error (L2) of dQ, dK and dV of one attention layer
(``UlyssesAttention``, SDPA) over one causal sequence cut into 1, 2, 4, 8 and 16 equal slices, each
run in bf16 and compared with the uncut fp32 pass on the same inputs.

    .venv/bin/python benchmarks/slice_precision.py                      # CPU, 2,048 tokens
    python3 benchmarks/slice_precision.py --device cuda --tokens 65536 --heads 32 --kv-heads 8
"""
from __future__ import annotations

import argparse
import time

import torch

from megatron_ext.runtime.compat import quiet_fallback_warnings

quiet_fallback_warnings()

from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_ext.runtime.attention import UlyssesAttention, UlyssesPackedSeqParams  # noqa: E402
from megatron_ext.runtime.slices import PrefixKVCache  # noqa: E402

HEAD_DIM = 128


def sliced_grads(module, inputs, slices: int, dtype, device) -> list[torch.Tensor]:
    """dQ, dK, dV (float64, on the host) of one sequence run as ``slices`` slices: forwards in
    order, backwards last first, as a pipeline runs them."""
    q_all, k_all, v_all, grad_all = inputs
    n = q_all.shape[0]
    cuts = [n * i // slices for i in range(slices + 1)]
    cache, runs = PrefixKVCache(), []
    for i in range(slices):
        a, b = cuts[i], cuts[i + 1]
        params = UlyssesPackedSeqParams.build([b - a], starts=[a], keys=["seq"], continues=[i < slices - 1],
                                              prefix_cache=cache, device=device)
        q, k, v = (t[a:b].to(device, dtype).requires_grad_() for t in (q_all, k_all, v_all))
        out = module(q, k, v, None, packed_seq_params=params)
        runs.append((q, k, v, out, grad_all[a:b].to(device, dtype)))
    for q, k, v, out, grad in reversed(runs):
        out.backward(grad.view(out.shape))
    return [torch.cat([r[i].grad for r in runs]).double().cpu() for i in range(3)]


def relative_errors(tokens: int, heads: int, kv_heads: int, counts: list[int], device="cpu") -> dict[int, list[float]]:
    """Slice count -> relative L2 errors of the bf16 dQ, dK, dV against the uncut fp32 pass."""
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * HEAD_DIM, num_attention_heads=heads,
                            num_query_groups=kv_heads, attention_dropout=0.0, hidden_dropout=0.0)
    module = UlyssesAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=ProcessGroupCollection(tp=None))
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(tokens, 1, h, HEAD_DIM, generator=g)  # q, k, v, the output's gradient
              for h in (heads, kv_heads, kv_heads, heads)]
    ref = sliced_grads(module, inputs, 1, torch.float32, device)
    return {n: [((x - y).norm() / y.norm()).item() for x, y in zip(sliced_grads(module, inputs, n, torch.bfloat16,
                                                                                  device), ref)]
            for n in counts}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--slices", default="1,2,4,8,16")
    args = ap.parse_args(argv)
    try:
        counts = [int(x) for x in args.slices.split(",")]
    except ValueError:
        ap.error(f"--slices takes whole numbers separated by commas, got {args.slices!r}")
    if min(args.tokens, args.heads, args.kv_heads) < 1 or args.heads % args.kv_heads:
        ap.error("--tokens, --heads and --kv-heads must be positive, --heads a multiple of --kv-heads")
    if min(counts) < 1 or max(counts) > args.tokens:
        ap.error(f"every slice count must be in 1..{args.tokens} (--tokens)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA GPU here")
    t0 = time.perf_counter()
    errors = relative_errors(args.tokens, args.heads, args.kv_heads, counts, args.device)
    print(f"{args.tokens:,} tokens, {args.heads} heads / {args.kv_heads} KV heads of {HEAD_DIM}, on {args.device}: "
          f"bf16 gradients' relative error against the uncut fp32 pass")
    print(f"{'slices':>6}  {'dQ':>8}  {'dK':>8}  {'dV':>8}")
    for n, errs in errors.items():
        print(f"{n:>6}  " + "  ".join(f"{e:8.2e}" for e in errs))
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
