"""The Python half of scripts/gpu_smoke.sh (run it through that script).

  python scripts/gpu_smoke.py cuda               CUDA, the GPUs, NCCL's version
  python scripts/gpu_smoke.py cluster N PATH     a cluster YAML of N of this machine's GPUs
  torchrun ... scripts/gpu_smoke.py nccl         an all-reduce and a p2p ring over NCCL, every rank
  python scripts/gpu_smoke.py backends           every installed attention backend against SDPA

Each prints one result line (``ok: ...`` or ``FAIL: ...``) last and exits non-zero on failure.
"""
from __future__ import annotations

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
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.runtime.attention import UlyssesAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                            num_query_groups=kv_heads, attention_dropout=0.0, hidden_dropout=0.0)
    return UlyssesAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=ProcessGroupCollection(tp=None),
                            backend=backend)


# (name, start, end) pieces per chunk: "packed" whole sequences from 5 to 3,000 tokens; "sliced"
# a 3,000-token sequence cut in two slices, the second attending to the first's cached K/V.
CASES = {"packed": [[("A", 0, 3000), ("B", 0, 5), ("C", 0, 777), ("D", 0, 64), ("E", 0, 1200)]],
         "sliced": [[("A", 0, 1500), ("B", 0, 300)], [("C", 0, 40), ("A", 1500, 3000)]]}


def _chunks(backend: str, dtype, pieces_per_chunk, heads=16, kv_heads=4, head_dim=128):
    """Forward of each chunk, backward last first (as a pipeline does); outputs and q/k/v grads."""
    from megatron_ext.runtime.attention import UlyssesPackedSeqParams
    from megatron_ext.runtime.slices import PrefixKVCache

    module, cache, runs = _attention(backend, heads, kv_heads, head_dim), PrefixKVCache(), []
    ends = {}
    for pieces in pieces_per_chunk:
        for name, _, end in pieces:
            ends[name] = max(ends.get(name, 0), end)
    g = torch.Generator(device="cuda").manual_seed(0)
    for pieces in pieces_per_chunk:
        params = UlyssesPackedSeqParams.build([b - a for _, a, b in pieces], None, device=torch.device("cuda", 0),
                                              pad_to_multiple_of=8, starts=[a for _, a, _ in pieces],
                                              keys=[n for n, _, _ in pieces],
                                              continues=[b < ends[n] for n, _, b in pieces], prefix_cache=cache)
        S = params.total_tokens
        q, k, v = (torch.randn(S, 1, h, head_dim, generator=g, device="cuda").to(dtype).requires_grad_()
                   for h in (heads, kv_heads, kv_heads))
        dy = torch.randn(S, 1, heads * head_dim, generator=g, device="cuda") * params.loss_mask[:, None, None]
        runs.append((q, k, v, module(q, k, v, None, packed_seq_params=params), dy))
    for q, k, v, out, dy in reversed(runs):
        out.backward(dy.to(out.dtype))
    return [t.float() for q, k, v, out, _ in runs for t in (out.detach(), q.grad, k.grad, v.grad)]


def _heads_first_backward() -> float:
    """The fused kernel's backward the ring runs (``lse_kernels``) given its output as a slice of a
    heads-first buffer, as the ring keeps it, against autograd SDPA, bf16, 8 heads: the max
    relative error of dq, dk, dv (the kernel once read such an output at the wrong rows)."""
    from megatron_ext.runtime.kernels import lse_kernels

    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, 8, 512, 64, generator=g, device="cuda").bfloat16() for _ in range(3))
    dy = torch.randn(1, 8, 512, 64, generator=g, device="cuda").bfloat16()
    forward, backward = lse_kernels(q, 0.0)
    out, lse, rng = forward(q, k, v, True, 0.125, 0.0)
    buffer = torch.zeros(1, 8, 600, 64, dtype=out.dtype, device="cuda")  # heads first, longer: a slice of it
    buffer[:, :, 40:552] = out
    got = backward(dy, q, k, v, buffer[:, :, 40:552], lse, rng, True, 0.125, 0.0)
    ref_in = [t.float().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*ref_in, is_causal=True, scale=0.125).backward(dy.float())
    return max(float((a.float() - b.grad).abs().max() / b.grad.abs().max()) for a, b in zip(got, ref_in))


def backends() -> int:
    """Each installed backend in bf16 against SDPA in fp32 on the same inputs (GQA 16/4 heads of
    128): packed causal sequences, and a sequence in two slices over the prefix K/V cache; the
    outputs and the gradients of q, k and v. Then the ring's kernel backward (``_heads_first_backward``)."""
    from megatron_ext.runtime.kernels import available_backends

    failed = []
    for case, pieces in CASES.items():
        reference = _chunks("sdpa", torch.float32, pieces)
        for backend in [b for b in available_backends() if b != "sdpa"] + ["sdpa"]:
            got = _chunks(backend, torch.bfloat16, pieces)
            worst = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) for a, b in zip(got, reference))
            ok = worst < 3e-2  # bf16 keeps 8 bits of mantissa (SDPA itself in bf16 on CPU: 1.4-1.7e-2 here)
            print(f"  {case:6s} {backend:6s} bf16 vs sdpa fp32: max relative error {worst:.1e}"
                  + ("" if ok else "  (over 3e-2)"))
            if not ok:
                failed.append(f"{backend} ({case})")
    worst = _heads_first_backward()
    print(f"  ring kernel backward, heads-first output: max relative error {worst:.1e}"
          + ("" if worst < 3e-2 else "  (over 3e-2)"))
    if worst >= 3e-2:
        failed.append("the ring's kernel backward")
    names = ", ".join(available_backends())
    print(f"FAIL: {', '.join(failed)} off the SDPA reference" if failed else f"ok: {names} agree with SDPA at bf16")
    return 1 if failed else 0


if __name__ == "__main__":
    what, rest = sys.argv[1], sys.argv[2:]
    if what == "cluster":
        sys.exit(cluster(int(rest[0]), rest[1]))
    sys.exit({"cuda": cuda, "nccl": nccl, "backends": backends}[what]())
