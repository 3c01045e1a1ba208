"""The Python half of scripts/gpu_smoke.sh (run it through that script).

  python scripts/gpu_smoke.py cuda               CUDA, the GPUs, NCCL's version
  python scripts/gpu_smoke.py cluster N PATH     a cluster YAML of N of this machine's GPUs
  torchrun ... scripts/gpu_smoke.py nccl         an all-reduce and a p2p ring over NCCL, every rank
  python scripts/gpu_smoke.py backends           every installed attention backend against SDPA

Each prints one result line (``ok: ...`` or ``FAIL: ...``) last and exits non-zero on failure.
"""
from __future__ import annotations

import os
import sys

import torch


def cuda() -> int:
    if not torch.cuda.is_available():
        print("FAIL: torch.cuda.is_available() is False")
        return 1
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "absent"
    print(f"ok: {torch.cuda.device_count()} x {', '.join(names)}; torch {torch.__version__}, CUDA "
          f"{torch.version.cuda}, NCCL {nccl}")
    return 0


def cluster(gpus: int, path: str) -> int:
    """One node of ``gpus`` GPUs with their memory (less 10% for the CUDA context and caches);
    link figures are placeholders: `megatron-ext profile` measures them."""
    memory_gb = 0.9 * torch.cuda.get_device_properties(0).total_memory / 2**30
    degrees = [2**i for i in range(1, gpus.bit_length()) if 2**i <= gpus]
    lines = [f"# {gpus} x {torch.cuda.get_device_name(0)} (written by scripts/gpu_smoke.py)",
             "num_nodes: 1", f"gpus_per_node: {gpus}", f"memory_gb: {memory_gb:.1f}"]
    if degrees:
        lines.append("a2a_bandwidth_gbps: {" + ", ".join(f"{d}: 100.0" for d in degrees) + "}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"ok: {path}: {gpus} GPUs of {memory_gb:.0f} GB")
    return 0


def nccl() -> int:
    import torch.distributed as dist

    from megatron_ext.runtime.device import init_rank_process_group

    device = init_rank_process_group("cuda")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(t)
    want = world * (world + 1) / 2
    ring = torch.full((4,), float(rank), device=device)
    got = torch.empty_like(ring)
    ops = [dist.P2POp(dist.isend, ring, (rank + 1) % world), dist.P2POp(dist.irecv, got, (rank - 1) % world)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    torch.cuda.synchronize()
    ok = bool((t == want).all()) and bool((got == (rank - 1) % world).all())
    dist.destroy_process_group()
    if rank == 0:
        print(f"{'ok' if ok else 'FAIL'}: all-reduce and p2p ring over NCCL on {world} GPU(s)")
    return 0 if ok else 1


def _attention(backend: str, heads: int, kv_heads: int, head_dim: int):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.runtime.attention import UlyssesAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                            num_query_groups=kv_heads, attention_dropout=0.0, hidden_dropout=0.0)
    return UlyssesAttention(cfg, 1, AttnMaskType.causal, "self", backend=backend)


def backends() -> int:
    """Packed causal attention (GQA, lengths from 5 to 3,000 tokens) on each installed backend in
    bf16 against SDPA in fp32 on the same inputs: outputs and the gradients of q, k and v."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.runtime.attention import UlyssesPackedSeqParams, available_backends

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    parallel_state.initialize_model_parallel(1, 1)
    heads, kv_heads, head_dim, lengths = 16, 4, 128, [3000, 5, 777, 64, 1200]
    params = UlyssesPackedSeqParams.build(lengths, None, device=torch.device("cuda", 0))
    g = torch.Generator(device="cuda").manual_seed(0)
    S = params.total_tokens
    q, k, v = (torch.randn(S, 1, h, head_dim, generator=g, device="cuda") for h in (heads, kv_heads, kv_heads))
    dy = torch.randn(S, 1, heads * head_dim, generator=g, device="cuda")

    def run(backend, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = _attention(backend, heads, kv_heads, head_dim)(*leaves, None, attn_mask_type=AttnMaskType.causal,
                                                             packed_seq_params=params)
        (out.float() * dy).sum().backward()
        return [out.float()] + [t.grad.float() for t in leaves]

    reference = run("sdpa", torch.float32)
    failed = []
    for backend in [b for b in available_backends() if b != "sdpa"] + ["sdpa"]:
        errors = [float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) for a, b in
                  zip(run(backend, torch.bfloat16), reference)]
        worst = max(errors)
        ok = worst < 2e-2  # bf16 keeps 8 bits of mantissa: ~0.4% per element, sums of thousands
        print(f"  {backend:6s} bf16 vs sdpa fp32: max relative error out/dq/dk/dv "
              + " ".join(f"{e:.1e}" for e in errors) + ("" if ok else "  (over 2e-2)"))
        if not ok:
            failed.append(backend)
    dist.destroy_process_group()
    names = ", ".join(available_backends())
    print(f"FAIL: {', '.join(failed)} off the SDPA reference" if failed else f"ok: {names} agree with SDPA at bf16")
    return 1 if failed else 0


if __name__ == "__main__":
    what, rest = sys.argv[1], sys.argv[2:]
    if what == "cluster":
        sys.exit(cluster(int(rest[0]), rest[1]))
    sys.exit({"cuda": cuda, "nccl": nccl, "backends": backends}[what]())
