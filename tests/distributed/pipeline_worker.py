"""Worker for test_pipeline_runtime.py: 4 gloo ranks, one launch (dist_harness).

Part 1 (parallel_state pp=1, dp=4): token-level slices. Sequences cut into slices run chunk by
chunk forward and in reverse backward through a GPTModel with Ulysses attention at SP degree 1
(every rank alone), 2 and 4, with and without recompute; loss and every parameter gradient must
equal the uncut sequences run by megatron's stock GPTModel, one sequence at a time.

Part 2 (pp=2 x dp=2, then pp=4 x dp=1): elastic pipelines through ``forward_backward_elastic``
with megatron DDP and finalize_model_grads: split, batched and hybrid chunks, several pipelines,
planner-made plans with recompute, orders that differ per stage, refused plans, and replicas side
by side (pp=2 x SP 1 and pp=1 x SP 2 on 4 ranks, hand-made and planned, one replica idle). Each must
give the loss and gradients of one process running the uncut sequences.
"""
from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist

from dist_harness import Failures, check, preload_megatron, setup_megatron

ST: dict = {}
VOCAB = 97
HEADS, KV_HEADS, HIDDEN, FFN = 8, 4, 32, 64


def preload():
    preload_megatron("megatron.core.distributed", "megatron_ext.planner.pp.elastic_pp", "megatron_ext.runtime.pipeline",
                     "megatron_ext.runtime.slices")


def setup():
    ST["pool"] = setup_megatron()
    ST["rank"] = dist.get_rank()


GRAD_TOL = dict(atol=3e-6, rtol=1e-4)


def _config(num_layers: int, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
                             num_query_groups=KV_HEADS, ffn_hidden_size=FFN, hidden_dropout=0.0, attention_dropout=0.0,
                             calculate_per_token_loss=True, use_cpu_initialization=True, **kw)


def _reference_model(num_layers: int, seed: int, tied: bool = False):
    """megatron's stock GPTModel (local spec, DotProductAttention), identical on every rank."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(seed)
    ref = GPTModel(_config(num_layers), get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=1024,
                   position_embedding_type="rope", pre_process=True, post_process=True,
                   share_embeddings_and_output_weights=tied)
    for p in ref.parameters():
        dist.broadcast(p.data, src=0)
    return ref


def _batch(lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(n)) for n in lengths]


def _reference(ref, batch):
    """Loss (per token over the batch) and gradients of the uncut sequences, one at a time."""
    ref.zero_grad()
    total, count = 0.0, 0
    for seq in batch:
        if len(seq) < 2:
            continue
        t = torch.from_numpy(seq)
        losses = ref(t[None, :-1], torch.arange(len(seq) - 1)[None], None, labels=t[None, 1:])
        total = total + losses.sum()
        count += len(seq) - 1
    (total / count).backward()
    return float(total / count), {n: p.grad.clone() for n, p in ref.named_parameters()}, count


# ---- part 1: token-level slices (pp = 1) --------------------------------------------------------

def _slice_model(num_layers=2, recompute_layers=0):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_ext.runtime.attention import get_gpt_layer_ulysses_spec
    from megatron_ext.runtime.rope import use_true_positions_for_rope

    key = ("slice_model", num_layers, recompute_layers)
    if key not in ST:
        extra = (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=recompute_layers)
                 if recompute_layers else {})
        model = GPTModel(_config(num_layers, **extra), get_gpt_layer_ulysses_spec(backend="sdpa"), vocab_size=128,
                         max_sequence_length=1024, position_embedding_type="rope")
        use_true_positions_for_rope(model)
        ref = _reference_model(num_layers, seed=11)
        model.load_state_dict(ref.state_dict())
        ST[key] = model, ref
    return ST[key]


def _layouts(chunks, lengths):
    from megatron_ext.plan.schema import Chunk, Piece, Pipeline
    from megatron_ext.plan.program import chunk_layouts

    pipe = Pipeline(1, 1, [Chunk(i, [Piece(*x) for x in c]) for i, c in enumerate(chunks)], [[]])
    lay = chunk_layouts(pipe, lengths)
    return [lay[i] for i in range(len(chunks))]


def run_slices(chunks, lengths, seed, group=None, recompute_layers=0, backward_order=None):
    """Run ``chunks`` (lists of (seq_id, start, end)) forward in order and backward in
    ``backward_order`` (default: reverse); compare with the uncut reference. Returns the cache."""
    from megatron_ext.runtime.pipeline import chunk_input
    from megatron_ext.runtime.slices import PrefixKVCache

    model, ref = _slice_model(recompute_layers=recompute_layers)
    batch = _batch(lengths, seed)
    ref_loss, ref_grads, n_tokens = _reference(ref, batch)
    model.zero_grad()
    cache = PrefixKVCache()
    outs, total, peak = [], torch.zeros(2), 0
    for lay in _layouts(chunks, lengths):
        inp = chunk_input(lay, batch, group, cache)
        out = model(inp.tokens, inp.position_ids, None, labels=inp.labels, packed_seq_params=inp.packed_seq_params)
        s = (out * inp.loss_mask).sum()
        outs.append(s / n_tokens)
        total += torch.stack([s.detach(), inp.loss_mask.sum()])
        peak = max(peak, cache.nbytes())
    for i in (backward_order or reversed(range(len(outs)))):
        outs[i].backward()
    fails = Failures()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if group is not None:
        dist.all_reduce(total, group=group)
        for g in grads.values():
            dist.all_reduce(g, group=group)
    fails.true(int(total[1]) == n_tokens, f"token count {int(total[1])} vs {n_tokens}")
    fails.close(float(total[0]) / n_tokens, ref_loss, "loss", atol=1e-6, rtol=1e-6)
    for name, g in grads.items():
        fails.close(g, ref_grads[name], f"grad of {name}", **GRAD_TOL)
    fails.true(len(cache) == 0, f"the prefix cache still holds {cache.keys()} after the backward")
    fails.true(peak > 0 or not any(a > 0 for c in chunks for _, a, _ in c), "nothing was cached")
    fails.raise_any()
    return peak


# A 61-token sequence in 4 uneven slices, a 37-token one in 2 (its tail packed with a whole short
# sequence: a hybrid chunk), and a chunk holding the heads of two split sequences.
SLICE_LENGTHS = [61, 37, 9, 23, 30]
SLICE_CHUNKS = [
    [(0, 0, 20)],
    [(0, 20, 33), (3, 0, 10)],           # a slice with a prefix + the head of another split sequence
    [(1, 0, 25), (0, 33, 50), (4, 0, 11)],  # three split heads / middles in one chunk
    [(3, 10, 23), (0, 50, 61)],          # two tails in one chunk
    [(1, 25, 37), (2, 0, 9)],            # hybrid: tail + a whole sequence
    [(4, 11, 30)],
]


@check
def slices_degree1_match_uncut_sequences():
    run_slices(SLICE_CHUNKS, SLICE_LENGTHS, seed=1 + ST["rank"])


@check
def slices_degree1_every_token_its_own_slice():
    n = 9
    run_slices([[(0, i, i + 1)] for i in range(n)] + [[(1, 0, 5)]], [n, 5], seed=2)


@check
def slices_degree2_match_uncut_sequences():
    r = ST["rank"]
    group = ST["pool"].get((0, 1) if r < 2 else (2, 3))
    run_slices(SLICE_CHUNKS, SLICE_LENGTHS, seed=3 + r // 2, group=group)


@check
def slices_degree4_gqa_one_kv_head_per_rank():
    run_slices(SLICE_CHUNKS, SLICE_LENGTHS, seed=4, group=ST["pool"].get((0, 1, 2, 3)))


@check
def slices_degree2_with_recompute_of_one_and_two_layers():
    r = ST["rank"]
    group = ST["pool"].get((0, 1) if r < 2 else (2, 3))
    run_slices(SLICE_CHUNKS, SLICE_LENGTHS, seed=5, group=group, recompute_layers=1)
    run_slices(SLICE_CHUNKS, SLICE_LENGTHS, seed=6, group=group, recompute_layers=2)


@check
def slices_backward_in_any_order_respecting_dependencies():
    # chunks 2 (seq 4 head) and 5 (seq 4 tail) vs the others: interleave the backward
    run_slices(SLICE_CHUNKS, SLICE_LENGTHS, seed=7, backward_order=[5, 4, 3, 2, 1, 0])
    run_slices([[(0, 0, 30)], [(1, 0, 12)], [(0, 30, 44)], [(1, 12, 20)]], [44, 20], seed=8,
               backward_order=[3, 2, 1, 0])
    run_slices([[(0, 0, 30)], [(1, 0, 12)], [(0, 30, 44)], [(1, 12, 20)]], [44, 20], seed=8,
               backward_order=[2, 0, 3, 1])


@check
def slices_dependency_violations_fail_clearly():
    import pytest

    from megatron_ext.runtime.pipeline import chunk_input
    from megatron_ext.runtime.slices import PrefixKVCache

    model, _ = _slice_model()
    lengths = [40]
    batch = _batch(lengths, 9)
    lays = _layouts([[(0, 0, 15)], [(0, 15, 40)]], lengths)

    def fwd(lay, cache):
        inp = chunk_input(lay, batch, None, cache)
        return model(inp.tokens, inp.position_ids, None, labels=inp.labels, packed_seq_params=inp.packed_seq_params).sum()

    with pytest.raises(RuntimeError, match=r"needs the K/V of positions \[0, 15\)"):
        fwd(lays[1], PrefixKVCache())  # the later slice first
    cache = PrefixKVCache()
    a = fwd(lays[0], cache)
    fwd(lays[1], cache)  # the later slice exists, so the earlier one must wait for it
    with pytest.raises(RuntimeError, match="last first|no later slice delivered"):
        a.backward()  # the earlier slice's backward first
    model.zero_grad()


@check
def slices_prefix_attention_matches_float64_reference():
    from megatron_ext.runtime import kernels as A

    g = torch.Generator().manual_seed(ST["rank"])
    fails = Failures()
    for dense_limit in (1 << 22, 0):  # one masked call, then per-segment calls
        saved, A.SDPA_DENSE_MASK_MAX_ELEMENTS["cpu"] = A.SDPA_DENSE_MASK_MAX_ELEMENTS["cpu"], dense_limit
        try:
            for case in range(4):
                segs = [random.Random(case).randint(1, 12) for _ in range(3)] + [2]
                plens = [0, 7, 0, 3] if case % 2 else [5, 0, 1, 0]
                bounds = [0] + list(np.cumsum(segs))
                S_ = bounds[-1]
                q = torch.randn(S_, 8, 4, generator=g, dtype=torch.float64)
                k, v = (torch.randn(S_, 2, 4, generator=g, dtype=torch.float64) for _ in range(2))
                pref = [None if c == 0 else (torch.randn(c, 2, 4, generator=g, dtype=torch.float64),
                                             torch.randn(c, 2, 4, generator=g, dtype=torch.float64)) for c in plens]
                out = A.prefixed_attention(q, k, v, bounds, pref, True, 0.5)
                for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
                    kk = k[a:b] if pref[i] is None else torch.cat([pref[i][0], k[a:b]])
                    vv = v[a:b] if pref[i] is None else torch.cat([pref[i][1], v[a:b]])
                    kk, vv = kk.repeat_interleave(4, 1), vv.repeat_interleave(4, 1)
                    s = torch.einsum("qhd,khd->hqk", q[a:b], kk) * 0.5
                    c = plens[i]
                    allowed = torch.arange(c + b - a)[None, :] <= (torch.arange(b - a)[:, None] + c)
                    s = s.masked_fill(~allowed, float("-inf"))
                    want = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
                    fails.close(out[a:b], want, f"segment {i}, case {case}, dense limit {dense_limit}",
                                atol=1e-10, rtol=1e-10)
        finally:
            A.SDPA_DENSE_MASK_MAX_ELEMENTS["cpu"] = saved
    fails.raise_any()


# ---- part 2: elastic pipelines ----------------------------------------------------------------

def _init_pipeline(pp: int):
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    ST.pop("stage", None)
    ST.pop("stage_tied", None)


def _spec(num_layers=4):
    from megatron_ext.spec import ModelSpec

    return ModelSpec(name="t", num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
                     num_query_groups=KV_HEADS, ffn_hidden_size=FFN, params_b=1e-5, act_mb_per_token=0.01, a1=1e-4,
                     a2=0.05, launch_ms=0.5, vocab_size=VOCAB)


def _stage_model(tied: bool = False):
    """This rank's stage (megatron DDP) and the whole reference model, same weights."""
    from megatron_ext.runtime.pipeline_model import build_pipeline_model, stage_state_dict

    key = "stage_tied" if tied else "stage"
    if key not in ST:
        model, config = build_pipeline_model(_spec(), VOCAB, 1024, backend="sdpa",
                                             share_embeddings_and_output_weights=tied)
        ref = _reference_model(4, seed=21, tied=tied)
        model.module.load_state_dict(stage_state_dict(ref.state_dict(), model))
        ST[key] = model, ref
    return ST[key]


def _one_f_one_b(plan_chunks, stages, sp):
    """Elastic 1F1B orders by the simulator's own rule (sim/engine.py): forward in list order,
    backward the same with each split sequence's chunks reversed, warm-up for the slices."""
    from megatron_ext.cost.pipeline import PipelineCost
    from megatron_ext.sim.engine import analyze_chunks, backward_order, one_f_one_b, order_names

    table = analyze_chunks(plan_chunks, PipelineCost(_cost(1024.0), stages, sp))
    forward = list(range(table.n))
    return order_names(one_f_one_b(forward, backward_order(forward, table), stages), table.ids)


def _pipeline(chunks, stages, sp, orders=None, recompute=None):
    from megatron_ext.plan.schema import Chunk, Piece, Pipeline

    cs = [Chunk(i, [Piece(*x) for x in c], list(recompute[i]) if recompute and recompute[i] else [])
          for i, c in enumerate(chunks)]
    return Pipeline(stages, sp, cs, orders or _one_f_one_b(cs, stages, sp))


def _plan(pipelines):
    from megatron_ext.plan.schema import StepPlan

    return StepPlan(kind="elastic_pp", num_gpus=dist.get_world_size(), planner="test", pipelines=pipelines)


def run_pipeline_plan(plan, lengths, seed, what="", tied=False, sp_groups=None, cost=None):
    """One step of ``plan`` through forward_backward_elastic vs the uncut reference (with
    replicas, the loss and token count summed over them, and the gradients reduced over them);
    ``cost``: the runtime's messages in the order of the simulator's times on it."""
    from megatron.core import parallel_state

    from megatron_ext.runtime.pipeline import forward_backward_elastic

    model, ref = _stage_model(tied)
    batch = _batch(lengths, seed)
    ref_loss, ref_grads, n_tokens = _reference(ref, batch)
    model.zero_grad_buffer()
    losses, stats = forward_backward_elastic(plan, batch, model, sp_groups=sp_groups, cost=cost)
    total = torch.stack([d["lm loss"] for d in losses]).sum(0) if losses else torch.zeros(2)
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    fails = Failures()
    if parallel_state.is_pipeline_last_stage():
        n = sum(len(p.chunks) for p in plan.pipelines if p.replica == stats.replica)
        fails.true(len(losses) == n, f"{len(losses)} loss records for {n} chunks")
        fails.true(int(total[1]) == n_tokens, f"{what}: token count {int(total[1])} vs {n_tokens}")
        fails.close(float(total[0]) / n_tokens, ref_loss, f"{what}: loss", atol=1e-6, rtol=1e-6)
    else:
        fails.true(not losses, "loss records on a stage that is not the last")
    offset = model.module.decoder.layers[0].layer_number - 1
    for name, p in model.module.named_parameters():
        src = name
        if name.startswith("decoder.layers."):
            i, tail = name[len("decoder.layers."):].split(".", 1)
            src = f"decoder.layers.{int(i) + offset}.{tail}"
        if src not in ref_grads and name == "output_layer.weight":
            src = "embedding.word_embeddings.weight"  # tied: the last stage's copy gets the summed grad
        fails.close(p.main_grad, ref_grads[src], f"{what}: grad of {src}", **GRAD_TOL)
    fails.raise_any()
    return stats


@check
def pipeline_pp1_sp4_slices_in_one_stage():
    _init_pipeline(1)
    lengths = [70, 9, 30]
    chunks = [[(0, 0, 30)], [(0, 30, 51), (1, 0, 9)], [(0, 51, 70), (2, 0, 30)]]
    run_pipeline_plan(_plan([_pipeline(chunks, 1, 4, recompute=[[1], [0], [4]])]), lengths, seed=25,
                      what="one stage, SP 4")


@check
def pipeline_pp2_sp2_sequence_cut_in_slices_matches_uncut():
    _init_pipeline(2)
    lengths = [90]
    for k, cuts in ((1, [0, 90]), (3, [0, 40, 68, 90]), (5, [0, 25, 44, 61, 77, 90])):
        chunks = [[(0, a, b)] for a, b in zip(cuts[:-1], cuts[1:])]
        stats = run_pipeline_plan(_plan([_pipeline(chunks, 2, 2)]), lengths, seed=30 + k, what=f"{k} slices")
        assert (stats.prefix_cache_peak_bytes > 0) == (k > 1)


@check
def pipeline_pp2_sp2_mixed_chunks_and_recompute_match_reference():
    lengths = [70, 33, 12, 5, 26, 3, 48]
    chunks = [
        [(0, 0, 30)],                        # split
        [(0, 30, 52)],                       # split
        [(0, 52, 70), (2, 0, 12), (3, 0, 5)],  # hybrid: tail + whole sequences
        [(1, 0, 33), (5, 0, 3)],             # batched
        [(6, 0, 20), (4, 0, 26)],            # head of a split sequence + a whole one
        [(6, 20, 48)],                       # its tail
    ]
    recompute = [[2, 0], [1, 1], None, [0, 2], [2, 2], [0, 1]]
    run_pipeline_plan(_plan([_pipeline(chunks, 2, 2)]), lengths, seed=40, what="1F1B, no recompute")
    run_pipeline_plan(_plan([_pipeline(chunks, 2, 2, recompute=recompute)]), lengths, seed=41, what="1F1B + recompute")
    # two pipelines, one after the other
    p1 = _pipeline(chunks[:3], 2, 2, recompute=recompute[:3])
    p2 = _pipeline([[(1, 0, 33), (5, 0, 3)], [(6, 0, 20), (4, 0, 26)], [(6, 20, 48)]], 2, 2)
    p2.chunks = [type(c)(c.id + 10, c.pieces, c.recompute_layers_per_stage) for c in p2.chunks]
    p2.order_per_stage = [[op[0] + str(int(op[1:]) + 10) for op in o] for o in p2.order_per_stage]
    run_pipeline_plan(_plan([p1, p2]), lengths, seed=42, what="two pipelines")
    # all forwards first, then all backwards (GPipe-like), slices backward last first
    n = len(chunks)
    gpipe = [[f"F{i}" for i in range(n)] + [f"B{i}" for i in (5, 4, 3, 2, 1, 0)]] * 2
    run_pipeline_plan(_plan([_pipeline(chunks, 2, 2, orders=gpipe, recompute=recompute)]), lengths, seed=43,
                      what="GPipe order")


@check
def pipeline_pp2_tied_embeddings_match_reference():
    lengths = [44, 13, 20]
    chunks = [[(0, 0, 20)], [(0, 20, 44), (1, 0, 13)], [(2, 0, 20)]]
    run_pipeline_plan(_plan([_pipeline(chunks, 2, 2, recompute=[[0, 1], [2, 0], None])]), lengths, seed=57,
                      what="tied embeddings", tied=True)


@check
def pipeline_pp2_forward_only_and_deallocated_outputs():
    from megatron.core import parallel_state

    from megatron_ext.runtime.pipeline import forward_backward_elastic

    model, ref = _stage_model()
    lengths = [50, 19, 7]
    chunks = [[(0, 0, 22)], [(0, 22, 50), (2, 0, 7)], [(1, 0, 19)]]
    plan = _plan([_pipeline(chunks, 2, 2, recompute=[[1, 1], None, [2, 0]])])
    batch = _batch(lengths, 55)
    ref_loss, _, n_tokens = _reference(ref, batch)
    model.zero_grad_buffer()
    losses, _ = forward_backward_elastic(plan, batch, model, forward_only=True)
    total = torch.stack([d["lm loss"] for d in losses]).sum(0) if losses else torch.zeros(2)
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    if parallel_state.is_pipeline_last_stage():
        assert int(total[1]) == n_tokens and abs(float(total[0]) / n_tokens - ref_loss) < 1e-5, (total, ref_loss)
    assert all(float(p.main_grad.abs().sum()) == 0 for p in model.module.parameters()), "forward_only made gradients"
    config = model.config
    config.deallocate_pipeline_outputs = True  # (as Megatron-LM runs it)
    import torch.distributed as tdist

    orig = tdist.batch_isend_irecv

    class Batch:  # NCCL's one handle for a whole batch (its sends were never freed)
        def __init__(self, works):
            self.works = works

        def wait(self):
            for w in self.works:
                w.wait()

        def is_completed(self):
            return all(w.is_completed() for w in self.works)

    def coalesced(ops):
        works = orig(ops)
        return [Batch(works)] if len(works) > 1 else works

    try:
        run_pipeline_plan(plan, lengths, seed=56, what="deallocate_pipeline_outputs")
        tdist.batch_isend_irecv = coalesced
        run_pipeline_plan(plan, lengths, seed=57, what="deallocate_pipeline_outputs, coalesced p2p batches")
    finally:
        config.deallocate_pipeline_outputs = False
        tdist.batch_isend_irecv = orig


@check
def pipeline_pp2_recompute_runs_exactly_the_planned_layers():
    from megatron_ext.runtime.pipeline import forward_backward_elastic

    model, _ = _stage_model()
    lengths = [40, 17, 22]
    chunks = [[(0, 0, 20)], [(0, 20, 40), (1, 0, 17)], [(2, 0, 22)]]
    recompute = [[2, 1], [0, 2], [1, 0]]
    calls = {}
    layers = model.module.decoder.layers
    handles = [layer.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls.get(i, 0) + 1))
               for i, layer in enumerate(layers)]
    try:
        model.zero_grad_buffer()
        forward_backward_elastic(_plan([_pipeline(chunks, 2, 2, recompute=recompute)]), _batch(lengths, 50), model)
    finally:
        for h in handles:
            h.remove()
    from megatron.core import parallel_state

    p = parallel_state.get_pipeline_model_parallel_rank()
    want = {i: len(chunks) + sum(1 for r in recompute if r[p] > i) for i in range(len(layers))}
    assert calls == want, f"stage {p}: layer forward calls {calls}, expected {want}"


def _random_valid_orders(chunks, stages, rng):
    """Per-stage orders of a random execution that respects every dependency: valid, and as
    irregular as possible (forward orders may differ between stages)."""
    n = len(chunks)
    prev, nxt = {}, {}
    last = {}
    for i, c in enumerate(chunks):
        for sid, a, _ in sorted(c, key=lambda x: x[1]):
            if sid in last:
                prev.setdefault(i, []).append(last[sid])
                nxt.setdefault(last[sid], []).append(i)
            last[sid] = i
    done = set()
    orders = [[] for _ in range(stages)]
    while len(done) < 2 * n * stages:
        ready = []
        for p in range(stages):
            for k in range(n):
                if ("F", p, k) not in done and (p == 0 or ("F", p - 1, k) in done) and \
                        all(("F", p, j) in done for j in prev.get(k, [])):
                    ready.append(("F", p, k))
                if ("B", p, k) not in done and ("F", p, k) in done and (p == stages - 1 or ("B", p + 1, k) in done) \
                        and all(("B", p, j) in done for j in nxt.get(k, [])):
                    ready.append(("B", p, k))
        op = ready[rng.randrange(len(ready))]
        done.add(op)
        orders[op[1]].append(f"{op[0]}{op[2]}")
    return orders


@check
def pipeline_pp2_random_valid_orders_match_reference():
    rng = random.Random(5)
    lengths = [50, 21, 8, 30]
    chunks = [[(0, 0, 18)], [(0, 18, 35), (2, 0, 8)], [(1, 0, 21)], [(3, 0, 12), (0, 35, 50)], [(3, 12, 30)]]
    for trial in range(3):
        orders = _random_valid_orders(chunks, 2, rng)
        run_pipeline_plan(_plan([_pipeline(chunks, 2, 2, orders=orders)]), lengths, seed=60 + trial,
                          what=f"random orders {orders}")


def _cost(memory_mb):
    """The 4-layer test model on 4 ranks with ``memory_mb`` MB per rank."""
    from megatron_ext.cost import CostModel
    from megatron_ext.spec import ClusterSpec

    cluster = ClusterSpec(name="c", num_nodes=1, gpus_per_node=4, memory_gb=memory_mb / 1024,
                          a2a_bandwidth_gbps={2: 1.0, 4: 1.0}, p2p_bandwidth_gbps=1.0)
    return CostModel(_spec(), cluster)


def _planner_plan(lengths, pp, sp, memory_gb, seed=0):
    from megatron_ext.planner.pp.elastic_pp import plan_elastic_pp

    box = [plan_elastic_pp(lengths, _cost(memory_gb), pp=pp, sp=sp, granularity=8, min_slice_tokens=16,
                           time_limit=2.0) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _kinds(plan, lengths):
    out = set()
    for p in plan.pipelines:
        for c in p.chunks:
            split = [x for x in c.pieces if x.start > 0 or x.end < lengths[x.seq_id]]
            out.add("split" if len(c.pieces) == 1 and split else "hybrid" if split else "batched")
    return out


@check
def pipeline_pp2_planner_plans_match_reference():
    rng = np.random.default_rng(7)
    lengths = np.concatenate([rng.integers(3, 30, 6), rng.integers(100, 160, 2)])
    seen, rec = set(), 0
    for mem in (4.0, 0.4):  # MB per GPU: roomy, then tight enough for recompute
        plan = _planner_plan(lengths, 2, 2, mem)
        seen |= _kinds(plan, lengths)
        rec += sum(sum(c.recompute_layers_per_stage) for p in plan.pipelines for c in p.chunks)
        # (its messages posted in the order of the simulator's times on the planner's own cost model)
        run_pipeline_plan(plan, lengths, seed=70, what=f"planner plan at {mem} MB: {plan.solver_status}",
                          cost=_cost(mem))
    assert rec > 0, "expected a plan with recompute"
    assert "split" in seen, f"chunk kinds covered: {seen}"  # (the planner's choice; hand-made plans cover all)


def _sp_groups():
    """The SP group pool over this layout's data-parallel groups (collective: every rank)."""
    from megatron_ext.runtime.groups import SPGroupPool

    return SPGroupPool.from_parallel_state()


@check
def pipeline_replicas_pp2_sp1_match_reference():
    # 2 stages x SP 1 on 4 ranks: two replicas side by side, each its own sequences; replica 1
    # runs two pipelines one after another
    from megatron.core import parallel_state as ps

    _init_pipeline(2)
    # megatron's rank order (tp-cp-ep-dp-pp): a stage's data-parallel ranks are contiguous, and
    # the pipeline neighbours of a rank hold its data-parallel index, i.e. are in its replica
    dp_rank, stage = ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    assert dist.get_process_group_ranks(ps.get_data_parallel_group()) == [2 * stage, 2 * stage + 1]
    pp_dp = [None] * 2
    dist.all_gather_object(pp_dp, dp_rank, group=ps.get_pipeline_model_parallel_group())
    assert pp_dp == [dp_rank, dp_rank], pp_dp
    lengths = [60, 25, 9, 40, 14, 31]
    r0 = _pipeline([[(0, 0, 35)], [(0, 35, 60), (2, 0, 9)]], 2, 1, recompute=[[1, 0], None])
    r1a = _pipeline([[(1, 0, 25)], [(3, 0, 22)], [(3, 22, 40), (4, 0, 14)]], 2, 1)
    r1b = _pipeline([[(5, 0, 31)]], 2, 1)
    r1a.replica = r1b.replica = 1
    stats = run_pipeline_plan(_plan([r0, r1a, r1b]), lengths, seed=90, what="2 replicas of 2 stages")
    assert stats.replica == dp_rank
    # ops named as the simulator names them: by pipeline only where the replica runs several
    want = {"F0", "B0", "F1", "B1"} if stats.replica == 0 else \
        {f"{k}{c} of pipeline 1" for k in "FB" for c in range(3)} | {"F0 of pipeline 2", "B0 of pipeline 2"}
    assert {op for op, _ in stats.ops} == want, stats.ops


@check
def pipeline_replicas_an_idle_replica_reduces_and_does_not_hang():
    # fewer sequences than replicas: replica 1 has no pipeline, runs nothing, and still reduces
    # its (zero) gradients and token count with replica 0's
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_ext.errors import InvalidPlanError
    from megatron_ext.runtime.pipeline import forward_backward_elastic
    from megatron_ext.runtime.pipeline_model import build_pipeline_model

    _init_pipeline(2)
    alone = _pipeline([[(0, 0, 35)], [(0, 35, 60), (1, 0, 9)]], 2, 1, recompute=[[1, 0], None])
    stats = run_pipeline_plan(_plan([alone]), [60, 9], seed=91, what="an idle replica")
    assert (stats.ops == []) == (stats.replica == 1), stats
    # megatron's overlapped grad reduce starts each bucket from its grads' hooks, which an idle
    # rank never fires: refused on every rank before anything runs
    module, config = build_pipeline_model(_spec(), VOCAB, 1024, backend="sdpa", ddp=False)
    overlapped = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True), module)
    import pytest
    with pytest.raises(InvalidPlanError, match="replica 1 of the plan runs no pipeline: not supported with"):
        forward_backward_elastic(_plan([alone]), _batch([60, 9], 91), overlapped)
    forward_backward_elastic(_plan([alone]), _batch([60, 9], 91), overlapped, forward_only=True)


@check
def pipeline_replicas_pp1_sp2_use_their_own_ulysses_groups():
    # one stage of 4 data-parallel ranks as 2 replicas of SP 2: each replica's chunks (split
    # sequences with a prefix included) all-to-all inside its own pair of ranks
    _init_pipeline(1)
    pool = _sp_groups()
    lengths = [70, 9, 30, 44, 12]
    r0 = _pipeline([[(0, 0, 30)], [(0, 30, 51), (1, 0, 9)], [(0, 51, 70)]], 1, 2, recompute=[[1], [0], [4]])
    r1 = _pipeline([[(2, 0, 30), (4, 0, 12)], [(3, 0, 20)], [(3, 20, 44)]], 1, 2)
    r1.replica = 1
    run_pipeline_plan(_plan([r0, r1]), lengths, seed=92, what="2 replicas of SP 2", sp_groups=pool)
    import pytest

    from megatron_ext.errors import InvalidPlanError
    with pytest.raises(InvalidPlanError, match="pass sp_groups"):
        run_pipeline_plan(_plan([r0, r1]), lengths, seed=92)


@check
def pipeline_replicas_planner_plans_match_reference():
    _init_pipeline(2)
    rng = np.random.default_rng(11)
    lengths = np.concatenate([rng.integers(3, 30, 7), rng.integers(90, 150, 2)])
    plan = _planner_plan(lengths, 2, 1, 4.0)
    assert {p.replica for p in plan.pipelines} == {0, 1}, plan.solver_status
    run_pipeline_plan(plan, lengths, seed=93, what=f"planner plan: {plan.solver_status}")


@check
def pipeline_pp2_impossible_orders_are_refused_before_running():
    import pytest

    from megatron_ext.errors import InvalidPlanError
    from megatron_ext.runtime import pipeline as PL

    model, _ = _stage_model()
    lengths = [40, 17]
    batch = _batch(lengths, 80)
    chunks = [[(0, 0, 20)], [(0, 20, 40)], [(1, 0, 17)]]
    calls = []
    bad_plans = {
        # slices backward first first: B0 before B1 on stage 1 while B1 needs ... deadlock
        "slice backward order": [["F0", "F1", "F2", "B2", "B1", "B0"], ["F0", "F1", "F2", "B0", "B1", "B2"]],
        # the later slice's forward before the earlier one's
        "slice forward order": [["F1", "F0", "F2", "B2", "B1", "B0"], ["F0", "F1", "F2", "B2", "B1", "B0"]],
        # stage 0 waits for B2 from stage 1, which waits for F2 that stage 0 runs later
        "cross-stage cycle": [["F0", "F1", "B1", "B0", "F2", "B2"], ["F0", "F1", "F2", "B2", "B1", "B0"]],
        "missing op": [["F0", "F1", "F2", "B2", "B1"], ["F0", "F1", "F2", "B2", "B1", "B0"]],
        "unknown chunk": [["F0", "F1", "F2", "F7", "B2", "B1", "B0"], ["F0", "F1", "F2", "B2", "B1", "B0"]],
    }
    import torch.distributed as tdist

    orig = tdist.batch_isend_irecv
    tdist.batch_isend_irecv = lambda ops: calls.append(len(ops)) or orig(ops)
    try:
        for what, orders in bad_plans.items():
            with pytest.raises(InvalidPlanError, match="deadlock|appears|names no chunk"):
                PL.forward_backward_elastic(_plan([_pipeline(chunks, 2, 2, orders=orders)]), batch, model)
        with pytest.raises(InvalidPlanError, match="3 stages"):
            PL.forward_backward_elastic(_plan([_pipeline(chunks, 3, 2, orders=[["F0"]] * 3)]), batch, model)
        with pytest.raises(InvalidPlanError, match="SP degree 3 does not divide a stage's 2 data-parallel ranks"):
            gpipe = [["F0", "F1", "F2", "B2", "B1", "B0"]] * 2
            PL.forward_backward_elastic(_plan([_pipeline(chunks, 2, 3, orders=gpipe)]), batch, model)
        with pytest.raises(InvalidPlanError, match="do not tile|end at"):
            PL.forward_backward_elastic(_plan([_pipeline([[(0, 0, 20)], [(1, 0, 17)]], 2, 2)]), batch, model)
        with pytest.raises(InvalidPlanError, match="recompute"):
            PL.forward_backward_elastic(_plan([_pipeline(chunks, 2, 2, recompute=[[3, 0], None, None])]), batch, model)
        assert not calls, f"{len(calls)} p2p batches were posted before the plan was refused"
    finally:
        tdist.batch_isend_irecv = orig
    # the runtime is still usable
    run_pipeline_plan(_plan([_pipeline(chunks, 2, 2)]), lengths, seed=81, what="after refusals")


@check
def pipeline_pp2_optimizer_step_keeps_stage_replicas_identical():
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ext.runtime.pipeline import forward_backward_elastic

    model, _ = _stage_model()
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, clip_grad=1.0,
                                                 bf16=False, fp16=False), [model])
    before = [p.detach().clone() for p in model.module.parameters()]
    lengths = [60, 9, 14]
    chunks = [[(0, 0, 25)], [(0, 25, 60), (1, 0, 9)], [(2, 0, 14)]]
    model.zero_grad_buffer()
    opt.zero_grad()
    forward_backward_elastic(_plan([_pipeline(chunks, 2, 2, recompute=[[1, 0], [0, 1], [2, 2]])]),
                             _batch(lengths, 90), model)
    ok, grad_norm, _ = opt.step()
    assert ok and np.isfinite(grad_norm) and grad_norm > 0
    assert all(not torch.equal(a, p) for a, p in zip(before, model.module.parameters()))
    dp = parallel_state.get_data_parallel_group()
    sums = torch.tensor([float(p.detach().double().sum()) for p in model.module.parameters()], dtype=torch.float64)
    gathered = [torch.empty_like(sums) for _ in range(dist.get_world_size(dp))]
    dist.all_gather(gathered, sums, group=dp)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "SP replicas of a stage diverged"
    ST.pop("stage", None)  # weights changed: rebuild for later checks


@check
def pipeline_pp4_planner_and_random_orders_match_reference():
    _init_pipeline(4)
    ST.pop("stage_tied", None)
    rng = np.random.default_rng(8)
    lengths = np.concatenate([rng.integers(3, 30, 5), rng.integers(90, 140, 2)])
    for mem in (0.3, 4.0):
        plan = _planner_plan(lengths, 4, 1, mem)
        run_pipeline_plan(plan, lengths, seed=100, what=f"pp4 planner plan at {mem} MB: {plan.solver_status}")
    r = random.Random(9)
    chunks = [[(0, 0, 30)], [(0, 30, 50), (1, 0, 6)], [(2, 0, 40)], [(2, 40, 70), (0, 50, 66)], [(3, 0, 11)]]
    lens = [66, 6, 70, 11]
    for trial in range(2):
        orders = _random_valid_orders(chunks, 4, r)
        recompute = [[r.randint(0, 1) for _ in range(4)] for _ in chunks]
        run_pipeline_plan(_plan([_pipeline(chunks, 4, 1, orders=orders, recompute=recompute)]), lens,
                          seed=110 + trial, what=f"pp4 random orders {orders}")


@check
def pipeline_steps_ran_under_nccl_rules():
    """The pipelines above ran in the check mode (runtime/device.py): their p2p batches were checked."""
    from megatron_ext.runtime.device import CHECKED

    assert CHECKED["batch_isend_irecv"] > 0, dict(CHECKED)
