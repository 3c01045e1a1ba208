"""The pipeline-stage cost model (cost/pipeline.py) and the LLaMA / A800 presets."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

import pytest

from megatron_ext.cost import CostModel
from megatron_ext.cost.pipeline import FWD_FRACTION, PipelineCost, default_layout
from megatron_ext.errors import ConfigError, InfeasibleError
from megatron_ext.spec import load_cluster, load_model

COST = CostModel.from_presets("llama-13b", "a800-80g-8x4")
VOCAB_B = 32000 * 5120 / 1e9  # llama-13b's vocabulary table, billions of parameters


def test_presets_load():
    for name, layers, hidden, heads, max_sp in (("llama-7b", 32, 4096, 32, 32), ("llama-13b", 40, 5120, 40, 8),
                                               ("llama-30b", 60, 6656, 52, 4)):
        m = load_model(name)
        assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.vocab_size) == (layers, hidden, heads, 32000)
        assert m.max_sp_degree == max_sp
    c = load_cluster("a800-80g-8x4")
    assert c.num_gpus == 32 and c.memory_gb == 72 and c.p2p_bandwidth_gbps is None  # (handoffs: the links)
    assert c.a2a_bandwidth(8) > 9 * c.a2a_bandwidth(16)  # NVLink inside a node, IB across


def test_stages_add_up_to_the_flexsp_group_time():
    """One whole sequence through all pp stages does the work FlexSP charges a degree-sp group;
    only the fixed costs differ: a stage gathers its own layers inside its node (cost/fixed.py),
    a FlexSP micro-batch the whole model over every GPU."""
    for pp, sp in ((4, 8), (8, 4), (2, 8)):
        pc = PipelineCost(COST, pp, sp)
        for s in (1, 1000, 50_000):
            stages = pp * (float(pc.stage_ms(pc.piece_work(s), s)) - pc.fixed_ms)
            assert stages == pytest.approx(COST.group_time_ms([s], sp) - COST.group_fixed_ms(sp), rel=1e-12)
        assert pp * pc.pass_fixed_ms < COST.pass_fixed_ms / 2  # NVLink, not the nodes' NICs
    # one stage over the whole cluster's GPUs is a FlexSP micro-batch: the same fixed cost
    node = CostModel.from_presets("llama-13b", "a800-80g-8x1")
    assert PipelineCost(node, 1, 8).pass_fixed_ms == pytest.approx(node.pass_fixed_ms, rel=1e-12)


def test_prefix_attention_and_slices():
    pc = PipelineCost(COST, 4, 8)
    m = COST.model
    # a slice [C, C+s) costs a1((C+s)^2 - C^2) + a2 s: slices add up to the whole sequence
    cuts = [0, 7000, 12000, 20000]
    parts = sum(float(pc.piece_work(b - a, a)) for a, b in zip(cuts, cuts[1:]))
    assert parts == pytest.approx(float(pc.piece_work(20000)), rel=1e-12)
    # (the model recomputes 18 of its 40 layers: a third of their pass once more, cost/activations.py)
    assert COST.a1 == pytest.approx(m.a1 * (1 + 18 / 40 / 3)) and COST.a2 == pytest.approx(m.a2 * (1 + 18 / 40 / 3))
    assert float(pc.piece_work(100, 1000)) == pytest.approx(COST.a1 * (1100**2 - 1000**2) + COST.a2 * 100)
    # prefix_tokens inverts prefix_ms
    for x in (1, 10, 4096, 98304):
        assert float(pc.prefix_tokens(pc.prefix_ms(x))) == pytest.approx(x, rel=1e-9)
    # forward is a third, recompute of all layers equals the forward
    w, t = pc.piece_work(8192), 8192
    assert float(pc.fwd_ms(w, t)) == pytest.approx(FWD_FRACTION * float(pc.stage_ms(w, t)))
    assert float(pc.fwd_ms(w, t) + pc.bwd_ms(w, t)) == pytest.approx(float(pc.stage_ms(w, t)))
    # recomputing every layer re-runs the forward of the stage's layers, not of the output layer:
    # a third of their compute and launches, half of their all-to-alls (the forward's 4 of 8
    # calls), no ZeRO-3 gather (by hand: the pass's parts)
    comm = t * pc.comm_ms_per_token
    lat = COST.a2a_latency_ms(8, pc.layers_per_stage)
    launch = m.launch_ms / 4
    compute = float(pc.stage_ms(w, t, head=False)) - comm - pc.fixed_ms
    assert pc.fixed_ms == pytest.approx(pc.pass_fixed_ms + lat) and pc.pass_fixed_ms > 2 * launch  # (gathers)
    layers_only = FWD_FRACTION * (compute + launch) + (comm + lat) / 2
    assert float(pc.recompute_ms(w, t, pc.layers_per_stage)) == pytest.approx(layers_only)
    assert float(pc.recompute_ms(w, t, 3)) == pytest.approx(layers_only * 3 / 10)
    assert layers_only < float(pc.fwd_ms(w, t))
    assert float(pc.recompute_ms(w, t, 0)) == 0.0


def test_output_layer_runs_on_the_last_stage():
    m = COST.model
    # LLaMA-13B: 40 layers of h(h + 2 kv) + h^2 + 3 h ffn, head h x 32000: about 1.3% of the work
    layer = 5120 * (5120 + 2 * 5120) + 5120**2 + 3 * 5120 * 13824
    assert m.head_share == pytest.approx(5120 * 32000 / (40 * layer + 5120 * 32000))
    pc = PipelineCost(COST, 4, 8)
    w, t = pc.piece_work(8192), 8192
    per_stage = [float(pc.stage_ms(w, t, p)) for p in range(4)]
    assert per_stage[0] == per_stage[1] == per_stage[2] < per_stage[3]
    # the stages together do the whole model's work once: the average stage is their mean
    assert np.mean(per_stage) == pytest.approx(float(pc.stage_ms(w, t)))
    # a measured share (profile's head_time_share) replaces the FLOP estimate
    tiny = CostModel.from_presets("tiny", "cpu-4")
    assert tiny.model.head_share == tiny.model.head_time_share
    flops = dataclasses.replace(tiny.model, head_time_share=None)
    assert flops.head_share > 0.5  # vocabulary 2048 against hidden 64: the output layer's FLOPs dominate
    two = PipelineCost(tiny, 2, 2)
    w = 1000 * tiny.model.a2
    last, first = float(two.stage_ms(w, 1000, 1)), float(two.stage_ms(w, 1000, 0))
    fixed = two.fixed_ms + 1000 * two.comm_ms_per_token
    h = tiny.model.head_time_share
    assert (last - fixed) / (first - fixed) == pytest.approx(((1 - h) / 2 + h) / ((1 - h) / 2))


def test_p2p_and_fixed_cost():
    pc = PipelineCost(COST, 4, 8)
    # 1M tokens x 5120 x 2 bytes = 10,000 MB, each stage a node: every handoff crosses nodes, the
    # node's 8 GPUs sending 1/8 each over its NICs (46 GB/s of 1e9 bytes), plus the link latency
    mb_per_ms = 46 * 1e6 / 2**20
    assert float(pc.p2p_ms(2**20)) == pytest.approx(10240 / mb_per_ms + 0.03)
    # two stages per node (SP 4, 32 GPUs, 8 stages): 3 of the 7 handoffs cross nodes (each with a
    # stage's 4 GPUs sending at once), 4 stay on NVLink (155 GB/s a GPU, 1/4 each)
    half = PipelineCost(COST, 8, 4)
    nvlink = 10240 / 4 / (155 * 1e6 / 2**20)
    latency = (3 * 0.03 + 4 * 0.01) / 7
    assert float(half.p2p_ms(2**20)) == pytest.approx((3 * 10240 / mb_per_ms + 4 * nvlink) / 7 + latency)
    # two replicas of SP 4 per stage share their node's NICs: twice the time of one of SP 8
    shared = PipelineCost(COST, 4, 4)
    assert float(shared.p2p_ms(2**20)) == pytest.approx(2 * 10240 / mb_per_ms + 0.03)
    # a measured pair rate (`profile`): each of the SP ranks sends its share at that rate
    # a measured pair rate (`profile`, pairs of one node) prices the handoffs inside a node, each of
    # the SP ranks sending its share at that rate; across nodes the NICs still do
    measured = dataclasses.replace(COST.cluster, p2p_bandwidth_gbps=10.0)
    one_node = PipelineCost(CostModel(COST.model, dataclasses.replace(measured, num_nodes=1)), 4, 2)
    assert float(one_node.p2p_ms(2**20)) == pytest.approx(10240 / 2 / 10.0)
    assert float(PipelineCost(CostModel(COST.model, measured), 4, 8).p2p_ms(2**20)) == pytest.approx(10240 / mb_per_ms)
    # a stage of two nodes (2 stages x SP 8 x 2 replicas): 16 GPUs send, 8 through each node's NICs
    assert float(PipelineCost(COST, 2, 8).p2p_ms(2**20)) == pytest.approx(10240 / mb_per_ms + 0.03)
    # a handoff latency (what `profile` measures in place) is paid once per transfer
    slow = PipelineCost(CostModel(COST.model, dataclasses.replace(COST.cluster, p2p_latency_ms=3.0)), 4, 8)
    assert float(slow.p2p_ms(1000)) == pytest.approx(float(pc.p2p_ms(1000)) + 3.0)
    # a per-operation overhead (profile's real pipeline step) is paid by every forward and backward
    busy = PipelineCost(CostModel(COST.model, dataclasses.replace(COST.cluster, pipeline_op_overhead_ms=5.0)), 4, 8)
    w = pc.piece_work(4096)
    assert float(busy.fwd_ms(w, 4096)) == pytest.approx(float(pc.fwd_ms(w, 4096)) + 5.0)
    assert float(busy.bwd_ms(w, 4096, 3)) == pytest.approx(float(pc.bwd_ms(w, 4096, 3)) + 5.0)
    assert float(busy.recompute_ms(w, 4096, 2)) == pytest.approx(float(pc.recompute_ms(w, 4096, 2)))
    # the fixed cost of a chunk (cost/fixed.py), by hand: ZeRO-3 over the stage's 8 GPUs of one
    # node; per layer 13e9 / 40 bf16 parameters, 7/8 of them into every GPU over NVLink at 155
    # GB/s, 10 us a call; gathers before each of the 10 layers' forward and backward, the last
    # reduce-scatter; a quarter of the launch constant (40 x 0.87 ms)
    one = 13e9 / 40 * 2 * 7 / 8 / 155e6 + 0.01
    assert pc.fixed_ms == pytest.approx(34.8 / 4 + 21 * one)
    assert PipelineCost(COST, 4, 8, b1_scale=0.5).fixed_ms == pytest.approx((34.8 / 4 + 21 * one) / 2)
    assert pc.step_sync_ms == 0.0  # ZeRO-3, no replicas: the reductions are per pass
    # ZeRO-3 with replicas (pp 2 x sp 8 twice, on two nodes each): a stage is sharded over its own
    # 8 GPUs only, so each GPU's 1/8 shard is all-reduced with its peer in the other replica once a
    # step, one layer of it exposed each way: 1/8 of a layer over 1/8 of a node's 46 GB/s
    z3 = PipelineCost(COST, 2, 8)
    assert z3.replicas == 2
    assert z3.step_sync_ms == pytest.approx(2 * (13e9 / 40 * 2 / 8 / 2 / (46e6 / 8) + 0.03))
    # ZeRO-1: no pass gathers; once per step one layer's reduction and gather stay exposed, over
    # the stage's GPUs in every replica (two replicas of pp 2: two nodes, 1/2 over 46 GB/s each)
    z1 = CostModel.from_presets("llama-13b", "a800-80g-8x4", zero_stage=1)
    assert PipelineCost(z1, 4, 8).fixed_ms == pytest.approx(34.8 / 4)
    assert PipelineCost(z1, 4, 8).step_sync_ms == pytest.approx(2 * one)
    assert PipelineCost(z1, 2, 8).step_sync_ms == pytest.approx(2 * (13e9 / 40 * 2 / 2 / 46e6 + 0.03))
    # ranks in Megatron's order (pipeline outermost): the two replicas of pp 4 x sp 4 hold each
    # stage on one node's 8 consecutive GPUs, the GPUs pp 4 x sp 8 holds it on: the same sync
    assert PipelineCost(z1, 4, 4).stage_ranks(1, 1) == range(12, 16)
    assert PipelineCost(z1, 4, 4).step_sync_ms == pytest.approx(PipelineCost(z1, 4, 8).step_sync_ms)
    # and the distributed optimizer shards over them all: 16 GPUs hold the stages of pp 2 (an end
    # stage's half of the layers and its vocabulary table, 32,000 x 5,120: VOCAB_B)
    stage = (13.0 - VOCAB_B) / 2 + VOCAB_B
    assert PipelineCost(z1, 2, 8).model_states_mb == pytest.approx(stage * 16 * 1024 * (6 / 8 / 16 + 2 / 8))


def test_memory_terms():
    pc = PipelineCost(COST, 4, 8)
    m = COST.model
    # ZeRO-3 over the 8 ranks of a stage: a quarter of the layers' parameters and, on the first and
    # the last stage, a vocabulary table (the embedding, the output layer), 16 bytes each, / 8
    assert pc.model_states_mb == pytest.approx(((13.0 - VOCAB_B) / 4 + VOCAB_B) * 16 * 1024 / 8)
    assert PipelineCost(COST, 1, 8).model_states_mb == pytest.approx(13.0 * 16 * 1024 / 8)  # (one stage: all)
    # the whole-model figure includes the last stage's fp32 logits: the layers share the rest
    head = 32000 * 4 + 2 * 5120 * 2  # fp32 logits, the inputs of the final norm and output layer
    assert pc.act_layer_mb == pytest.approx((COST.act_mb_per_token - head / 2**20) / 40 / 8)
    assert pc.input_layer_mb == pytest.approx(5120 * 2 / 2**20 / 8)
    assert pc.kv_layer_mb == pytest.approx(2 * 40 * 128 * 2 / 2**20 / 8)
    assert pc.head_mb == pytest.approx(head / 2**20 / 8)
    full, save = pc.chunk_memory(1000, 0, False)
    assert float(full) == pytest.approx(1000 * pc.act_layer_mb * 10)
    assert float(save) == pytest.approx(1000 * (pc.act_layer_mb - pc.input_layer_mb))
    # a split piece: the prefix cache's copy of its K/V stays, even when recomputed
    full_last, save_split = pc.chunk_memory(1000, 1000, True)
    assert float(full_last) == pytest.approx(float(full) + 1000 * pc.head_mb + 1000 * pc.kv_layer_mb * 10)
    assert float(save_split) == pytest.approx(float(save))
    # fp32 activations (the CPU runtime) double what is sent and kept per element
    fp32 = PipelineCost(CostModel(dataclasses.replace(m, activation_bytes=4), COST.cluster), 4, 8)
    assert fp32.input_layer_mb == pytest.approx(2 * pc.input_layer_mb)
    assert fp32.kv_layer_mb == pytest.approx(2 * pc.kv_layer_mb)
    latency = float(pc.p2p_ms(0))
    assert float(fp32.p2p_ms(1000)) - latency == pytest.approx(2 * (float(pc.p2p_ms(1000)) - latency))


def test_all_to_all_latency_is_paid_per_call():
    lat = dataclasses.replace(COST.cluster, a2a_latency_ms={2: 0.5, 8: 0.25})
    cost = CostModel(COST.model, lat)
    # 4 all-to-alls per layer each way, and the forward's 4 again in each of the 18 layers the model
    # recomputes; degree 4 takes degree 2's figure, degree 1 pays none
    assert cost.group_fixed_ms(8) == pytest.approx(cost.micro_batch_fixed_ms + (8 * 40 + 4 * 18) * 0.25)
    assert cost.group_fixed_ms(4) == pytest.approx(cost.micro_batch_fixed_ms + (8 * 40 + 4 * 18) * 0.5)
    assert cost.group_fixed_ms(1) == cost.micro_batch_fixed_ms
    assert cost.group_time_ms([1000], 8) == pytest.approx(COST.group_time_ms([1000], 8) + (8 * 40 + 4 * 18) * 0.25)
    # a stage of 10 layers pays its own layers' calls on every chunk
    # (a stage's 10 layers: their share of the recomputed layers' calls too)
    assert PipelineCost(cost, 4, 8).fixed_ms == pytest.approx(PipelineCost(COST, 4, 8).fixed_ms
                                                              + (8 + 4 * 18 / 40) * 10 * 0.25)


def test_layout_errors():
    with pytest.raises(ConfigError, match="does not divide the 40 layers"):
        PipelineCost(COST, 3, 8)
    with pytest.raises(ConfigError, match="SP degree 16 is not allowed"):
        PipelineCost(COST, 2, 16)  # 40 heads: at most 8
    with pytest.raises(ConfigError, match="GPUs"):
        PipelineCost(COST, 8, 8)
    with pytest.raises(InfeasibleError, match="below the model states"):
        PipelineCost(COST, 4, 8, memory_mb=1024)
    with pytest.raises(ConfigError, match="b1_scale"):
        PipelineCost(COST, 4, 8, b1_scale=-1)
    with pytest.raises(ConfigError, match=r"b1_scale \(--b1-scale\) must be from 0 to 1000, got 1e\+300"):
        PipelineCost(COST, 4, 8, b1_scale=1e300)  # (inf x 0 recomputed layers: NaN times, a "cycle" refused)
    # activations per token no more than the output layer keeps: no layer would keep any (a zero division)
    thin = dataclasses.replace(COST, model=dataclasses.replace(COST.model, act_mb_per_token=0.1))
    with pytest.raises(ConfigError, match="act_mb_per_token 0.1 MB is no more than what its output layer alone keeps"):
        PipelineCost(thin, 4, 8)
    with pytest.raises(ConfigError, match="20 GPUs does not divide the 32 GPUs"):
        PipelineCost(COST, 5, 4)
    # a launch-bound profile fitted both to 0 (an H100, tiny at up to 4,096 tokens): chunk counts were NaN
    flat = dataclasses.replace(COST, model=dataclasses.replace(COST.model, a1=0.0, a2=0.0))
    with pytest.raises(ConfigError, match="a1 and a2 are both 0"):
        PipelineCost(flat, 4, 8)
    assert PipelineCost(COST, 2, 8).replicas == 2 and PipelineCost(COST, 4, 8).replicas == 1
    assert default_layout(COST) == (4, 8)
    # 52 heads: SP 4, 8 stages across would not divide the 60 layers: 4 stages, 2 replicas
    assert default_layout(CostModel.from_presets("llama-30b", "a800-80g-8x4")) == (4, 4)
    assert default_layout(CostModel.from_presets("gpt-7b", "a100-40g-8x64")) == (32, 8)  # (32 layers)
    assert math.isclose(PipelineCost(COST, 4, 8, memory_mb=40_000).budget_mb, 40_000)
