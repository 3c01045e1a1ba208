"""The FlexSP cost model and the spec loaders, against numbers worked out by hand.

Reference numbers: PAPERS.md section 1 (GPT-7B on 64 A100-40GB, 28 GB usable, the published
coefficients and all-to-all bandwidth table).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from small_cost import small_cost
from megatron_ext.cost import CostModel
from megatron_ext.errors import ConfigError, InfeasibleError
from megatron_ext.spec import ClusterSpec, ModelSpec, load_cluster, load_model

# GPT-7B, published coefficients (ms, whole model, fwd+bwd)
A1, A2 = 5.128e-6, 0.18396
PARAMS_B = 7.85
L, H = 32, 4096
# The fixed cost of a micro-batch at ZeRO-3 over the 64 GPUs (cost/fixed.py), by hand: per layer
# a gather before the forward and one before the backward, plus the last reduce-scatter, each of
# the layer's bf16 parameters of which 7/8 enter every node over its 46 GB/s, plus 30 us a call;
# and the launch constant 32 x 0.87 ms. The FlexSP paper fitted 629.36 (+1.1%).
LAUNCH = 27.8
B1 = LAUNCH + (2 * L + 1) * (PARAMS_B * 1e9 / L * 2 * 7 / 8 / 46e6 + 0.03)
# Activations per token from the shape (cost/activations.py): 34 h + 4 heads bytes a layer, fp32
# logits and two h-wide bf16 inputs for the head. The paper published 4.48 (-0.4%).
ACT_MB = ((34 * H + 4 * 64) * L + 4 * 50257 + 2 * H * 2) / 2**20
BW = {2: 119.54, 4: 104.07, 8: 96.5, 16: 10.33, 32: 5.94, 64: 4.87}
MB_PER_TOKEN_A2A = 8 * L * H * 2 / 2**20  # 4 all-to-alls x fwd+bwd x 2 bytes, MB per token = 2.0


@pytest.fixture(scope="module")
def c7b() -> CostModel:
    return CostModel.from_presets("gpt-7b", "a100-40g-8x8")


@pytest.fixture(scope="module")
def tiny() -> CostModel:
    return small_cost()


def hand_seq_ms(s: float, d: int) -> float:
    comm = 0.0 if d == 1 else s * MB_PER_TOKEN_A2A / d / BW[d]
    return (A1 * s * s + A2 * s) / d + comm


# ---- memory --------------------------------------------------------------------------------

def test_model_states_zero3(c7b):
    assert c7b.zero_stage == 3
    assert c7b.model_states_mb == pytest.approx(7.85 * 16 * 1024 / 64, rel=1e-12)
    assert c7b.model_states_mb == pytest.approx(2009.6, rel=1e-12)


@pytest.mark.parametrize("stage, sharded, replicated", [
    (0, 0.0, 1.0), (1, 6 / 8, 2 / 8), (2, 7 / 8, 1 / 8), (3, 1.0, 0.0)])
def test_model_states_by_zero_stage(stage, sharded, replicated):
    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x8", zero_stage=stage)
    assert cost.model_states_mb == pytest.approx(7.85 * 16 * 1024 * (sharded / 64 + replicated), rel=1e-12)


def test_zero1_and_zero2_hand_values():
    z1 = CostModel.from_presets("gpt-7b", "a100-40g-8x8", zero_stage=1)
    z2 = CostModel.from_presets("gpt-7b", "a100-40g-8x8", zero_stage=2)
    assert z1.model_states_mb == pytest.approx(128614.4 * 0.26171875)  # 33,660.8 MB: over 28 GB
    assert z2.model_states_mb == pytest.approx(128614.4 * 0.138671875)  # 17,835.4 MB
    assert z2.tokens_per_gpu == pytest.approx((28 * 1024 - 128614.4 * 0.138671875) / ACT_MB)
    with pytest.raises(InfeasibleError, match="exceed"):
        z1.tokens_per_gpu  # ZeRO-1 states alone do not fit a 28 GB budget


def test_bad_zero_stage():
    for stage in (4, True, 1.0):  # (True is an int equal to 1 in Python; a YAML `true` is no stage)
        with pytest.raises(ConfigError, match="zero_stage"):
            CostModel.from_presets("gpt-7b", "a100-40g-8x8", zero_stage=stage)


def test_tokens_per_gpu_paper_example(c7b):
    # the paper's example (4.48 MB a token: 5,951 tokens, ~381K a micro-batch) with the shape's
    # 4.465 MB (cost/activations.py)
    assert c7b.tokens_per_gpu == pytest.approx((28 * 1024 - 2009.6) / ACT_MB, rel=1e-12)
    assert c7b.tokens_per_gpu == pytest.approx(5971.22, abs=0.01)
    assert c7b.token_capacity(1) == 5971
    assert c7b.token_capacity(64) == math.floor(64 * (28 * 1024 - 2009.6) / ACT_MB)  # ~381K per micro-batch
    assert c7b.max_seq_len == c7b.token_capacity(64) == 382157


def test_group_memory(c7b):
    assert c7b.group_memory_mb(8000, 2) == pytest.approx(4000 * ACT_MB + 2009.6)
    assert c7b.group_memory_mb(c7b.token_capacity(8), 8) <= c7b.cluster.memory_mb
    assert c7b.group_memory_mb(c7b.token_capacity(8) + 1, 8) > c7b.cluster.memory_mb


# ---- time ----------------------------------------------------------------------------------

def test_paper_worked_example_8k_sequence(c7b):
    # "an 8K sequence costs about 2,021 GPU-ms at degree 8 and 5,215 at degree 64"
    at8 = 8 * float(c7b.seq_time_ms(8192, 8))
    at64 = 64 * float(c7b.seq_time_ms(8192, 64))
    assert at8 == pytest.approx(2020.9, abs=0.05)
    assert at64 == pytest.approx(5215.4, abs=0.05)
    assert at8 == pytest.approx(A1 * 8192**2 + A2 * 8192 + 8192 * 2.0 / 96.5, rel=1e-12)
    assert at64 == pytest.approx(A1 * 8192**2 + A2 * 8192 + 8192 * 2.0 / 4.87, rel=1e-12)


def test_comm_per_token(c7b):
    assert MB_PER_TOKEN_A2A == 2.0
    assert c7b.comm_ms_per_token(1) == 0.0
    for d, bw in BW.items():
        assert c7b.comm_ms_per_token(d) == pytest.approx(2.0 / d / bw, rel=1e-12)


def test_all_to_all_volume_by_hand():
    """Per token and layer: Q, K, V and the attention's output forward (2 h + 2 k values, k the
    K/V width), their gradients backward; a recomputed layer sends its forward's again."""
    from megatron_ext.cost.model import a2a_mb_per_token

    gqa = dataclasses.replace(load_model("llama-13b"), num_query_groups=8)  # 40 heads of 128, 8 KV heads
    per_layer = 2 * (2 * 5120 + 2 * 8 * 128) * 2 / 2**20  # fwd + bwd, bf16
    assert a2a_mb_per_token(gqa) == pytest.approx(40 * per_layer)
    assert a2a_mb_per_token(gqa, recomputed=10) == pytest.approx(45 * per_layer)
    assert a2a_mb_per_token(load_model("gpt-7b")) == pytest.approx(8 * 32 * 4096 * 2 / 2**20)  # (MHA: 8 L h e)
    # llama-13b recomputes 18 of its 40 layers: 18 more forward all-to-alls' worth
    c13 = CostModel.from_presets("llama-13b", "a800-80g-8x4")
    mha = 2 * (4 * 5120) * 2 / 2**20
    assert c13.comm_ms_per_token(8) == pytest.approx((40 * mha + 18 * mha / 2) / 8 / c13.cluster.a2a_bandwidth(8))


def test_group_time_degree_1_has_no_comm(c7b):
    lengths = [1000, 3000]
    expected = B1 + 5.128e-6 * (1000**2 + 3000**2) + 0.18396 * 4000  # = 1423.49
    assert expected == pytest.approx(1423.485, abs=1e-3)
    assert c7b.group_time_ms(lengths, 1) == pytest.approx(expected, rel=1e-12)


def test_group_time_degree_16_uses_inter_node_bandwidth(c7b):
    lengths = [1000, 3000]
    compute = (5.128e-6 * (1000**2 + 3000**2) + 0.18396 * 4000) / 16
    comm = 4000 * 8 * 32 * 4096 * 2 / 2**20 / 16 / 10.33
    assert c7b.group_time_ms(lengths, 16) == pytest.approx(B1 + compute + comm, rel=1e-12)
    assert c7b.group_time_ms(lengths, 16) == pytest.approx(733.963, abs=1e-3)


def test_micro_batch_overhead_is_paid_once_per_micro_batch(c7b):
    # profile's real FlexSP step measures it; groups, the planner's fixed cost and the bound pay it
    busy = CostModel(c7b.model, dataclasses.replace(c7b.cluster, micro_batch_overhead_ms=40.0), c7b.zero_stage)
    lengths = np.array([1000, 3000, 70000, 200000])
    assert busy.micro_batch_fixed_ms == pytest.approx(B1 + 40.0)
    for d in (1, 8, 16):
        assert busy.group_time_ms(lengths[:2], d) == pytest.approx(c7b.group_time_ms(lengths[:2], d) + 40.0)
    m = c7b.min_microbatches(lengths)
    spread = m * B1 + float(c7b.cheapest_gpu_ms(lengths).sum()) / c7b.num_gpus
    assert c7b.lower_bound_ms(lengths) >= spread - 1e-9
    assert busy.lower_bound_ms(lengths) >= spread + m * 40.0 - 1e-9
    with pytest.raises(ConfigError, match="micro_batch_overhead_ms"):
        load_cluster(dataclasses.replace(c7b.cluster, micro_batch_overhead_ms=-1.0))


def test_seq_time_is_array_friendly(c7b):
    s = np.array([1, 100, 5000])
    for d in c7b.degrees:
        got = c7b.seq_time_ms(s, d)
        assert got.shape == (3,)
        assert got == pytest.approx([hand_seq_ms(x, d) for x in s], rel=1e-12)


def test_bandwidth_beyond_table_uses_widest_entry():
    cl = load_cluster("a100-40g-8x16")  # 128 GPUs; the table stops at 64
    assert cl.num_gpus == 128
    assert cl.a2a_bandwidth(128) == 4.87
    assert cl.a2a_bandwidth(64) == 4.87
    assert cl.a2a_bandwidth(2) == 119.54
    assert cl.a2a_bandwidth(1) == float("inf")  # a degree-1 group moves nothing


# ---- degrees and limits --------------------------------------------------------------------

def test_degrees_7b(c7b):
    assert c7b.degrees == (1, 2, 4, 8, 16, 32, 64)


def test_degrees_respect_head_limit(tiny):
    # tiny: 8 attention heads, 4 KV heads: Ulysses degree at most 4
    assert tiny.model.num_attention_heads == 8 and tiny.model.kv_heads == 4
    assert tiny.model.max_sp_degree == 4
    assert tiny.degrees == (1, 2, 4)
    big = CostModel.from_presets("tiny", "a100-40g-8x8")  # 64 GPUs do not lift the head limit
    assert big.degrees == (1, 2, 4)
    assert big.max_seq_len == big.token_capacity(4)


@pytest.mark.parametrize("heads, kv, limit", [(64, None, 64), (12, None, 4), (64, 8, 8), (32, 2, 2), (7, None, 1)])
def test_max_sp_degree(heads, kv, limit):
    m = dataclasses.replace(load_model("gpt-7b"), num_attention_heads=heads, num_query_groups=kv)
    assert m.max_sp_degree == limit
    cost = CostModel(m, load_cluster("a100-40g-8x8"))
    assert cost.degrees[-1] == limit


def test_degrees_limited_by_gpu_count():
    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x2")
    assert cost.num_gpus == 16
    assert cost.degrees == (1, 2, 4, 8, 16)


def test_min_degree(c7b):
    assert c7b.min_degree(1) == 1
    assert c7b.min_degree(5971) == 1
    assert c7b.min_degree(5972) == 2
    assert c7b.min_degree(8192) == 2
    assert c7b.min_degree(c7b.token_capacity(8)) == 8
    assert c7b.min_degree(c7b.token_capacity(8) + 1) == 16
    assert c7b.min_degree(382157) == 64


def test_too_long_sequence_is_infeasible(c7b):
    with pytest.raises(InfeasibleError, match="382158 tokens"):
        c7b.min_degree(382158)
    with pytest.raises(InfeasibleError, match="drop or cut it, or use a larger cluster or a pipeline planner"):
        c7b.check_lengths([100, 382158, 5])
    c7b.check_lengths([100, 382157, 5])  # at the limit: fine
    c7b.check_lengths([])


def test_tiny_min_degree_and_max_len(tiny):
    cap1 = tiny.token_capacity(1)
    assert cap1 == math.floor((4 * 1024 - 0.0077 * 16 * 1024 / 4) / 0.05)
    assert tiny.min_degree(cap1 + 1) == 2
    assert tiny.max_seq_len == tiny.token_capacity(4)
    with pytest.raises(InfeasibleError):
        tiny.min_degree(tiny.max_seq_len + 1)


def test_min_microbatches(c7b):
    per_mb = c7b.tokens_per_gpu * 64
    assert c7b.min_microbatches([1]) == 1
    assert c7b.min_microbatches([382157]) == 1
    assert c7b.min_microbatches([382157, 1000]) == 2
    assert c7b.min_microbatches([5000] * 128) == math.ceil(640000 / per_mb) == 2


# ---- lower bound ---------------------------------------------------------------------------

def test_lower_bound_single_sequence_is_its_fastest_degree(c7b):
    # one 1000-token sequence: cheapest GPU-ms at degree 1 (no comm) = 189.088, spread over 64
    # GPUs that is ~639.3 ms; but alone it runs no faster than at degree 64: b1 + 9.37 ms.
    cheapest = A1 * 1000**2 + A2 * 1000
    assert cheapest == pytest.approx(189.088)
    spread = B1 + cheapest / 64
    fastest = min(hand_seq_ms(1000, d) for d in (1, 2, 4, 8, 16, 32, 64))
    assert fastest == pytest.approx(hand_seq_ms(1000, 64))
    assert c7b.lower_bound_ms([1000]) == pytest.approx(max(spread, B1 + fastest), rel=1e-12)
    assert c7b.lower_bound_ms([1000]) == pytest.approx(B1 + 189.088 / 64 + 1000 * 2 / 64 / 4.87, rel=1e-12)


def test_lower_bound_spread_dominates(c7b):
    per_seq = A1 * 5000**2 + A2 * 5000  # 5000 tokens fit degree 1: cheapest is without comm
    assert c7b.lower_bound_ms([5000] * 64) == pytest.approx(B1 + 64 * per_seq / 64, rel=1e-12)
    # 128 of them need two micro-batches by memory: b1 twice
    assert c7b.lower_bound_ms([5000] * 128) == pytest.approx(2 * B1 + 128 * per_seq / 64, rel=1e-12)


def test_lower_bound_long_sequence_cheapest_feasible_degree(c7b):
    # 20,000 tokens need degree >= 4; cheapest GPU-ms is at the smallest feasible degree here
    s = 20000
    cheapest = min(d * hand_seq_ms(s, d) for d in (4, 8, 16, 32, 64))
    assert cheapest == pytest.approx(4 * hand_seq_ms(s, 4))
    np.testing.assert_allclose(c7b.cheapest_gpu_ms([s]), [cheapest], rtol=1e-12)
    lb = c7b.lower_bound_ms([s] * 16)
    assert lb == pytest.approx(max(B1 + 16 * cheapest / 64, B1 + hand_seq_ms(s, 64)), rel=1e-12)


def test_lower_bound_empty(c7b):
    assert c7b.lower_bound_ms([]) == 0.0


# ---- spec loading --------------------------------------------------------------------------

def test_presets_load():
    m = load_model("gpt-7b")
    assert (m.name, m.num_layers, m.hidden_size, m.num_attention_heads) == ("gpt-7b", 32, 4096, 64)
    assert (m.a1, m.a2, m.launch_ms, m.params_b) == (A1, A2, LAUNCH, PARAMS_B)
    assert m.act_mb_per_token is None  # derived from the shape by the cost model
    assert CostModel(m, load_cluster("a100-40g-8x8")).act_mb_per_token == pytest.approx(ACT_MB, rel=1e-12)
    assert B1 == pytest.approx(629.36, rel=0.02) and ACT_MB == pytest.approx(4.48, rel=0.01)
    c = load_cluster("a100-40g-8x8")
    assert (c.name, c.num_nodes, c.gpus_per_node, c.num_gpus, c.memory_gb) == ("a100-40g-8x8", 8, 8, 64, 28)
    assert c.memory_mb == 28 * 1024
    assert c.a2a_bandwidth_gbps == BW
    cpu = load_cluster("cpu-4")
    assert cpu.num_gpus == 4
    for name in ("gpt-13b", "gpt-30b", "tiny"):
        assert load_model(name).name == name


def test_cluster_family():
    c = load_cluster("h100-80g-8x16")
    assert c.name == "h100-80g-8x16"
    assert (c.num_nodes, c.gpus_per_node, c.num_gpus, c.memory_gb) == (16, 8, 128, 72)
    assert load_cluster("h100-80g-8x1").num_gpus == 8
    assert load_cluster("a100-40g-8x2").num_gpus == 16
    assert load_cluster("a100-40g-8x128").num_gpus == 1024


def test_spec_objects_pass_through():
    m, c = load_model("tiny"), load_cluster("cpu-4")
    assert load_model(m) is m and load_cluster(c) is c
    assert CostModel.from_presets(m, c).num_gpus == 4


@pytest.mark.parametrize("loader, ref", [(load_model, "gpt-999b"), (load_cluster, "tpu-v5"),
                                         (load_cluster, "b200-8xN"), (load_cluster, "nonexistent-8x4")])
def test_unknown_preset(loader, ref):
    with pytest.raises(ConfigError, match="unknown"):
        loader(ref)


def test_family_with_node_count_not_power_of_two():
    with pytest.raises(ConfigError, match="power of two"):
        load_cluster("a100-40g-8x3")


TINY_YAML = """\
num_layers: 2
hidden_size: 64
num_attention_heads: 4
params_b: 0.001
act_mb_per_token: 0.01
a1: 1.0e-6
a2: 0.01
launch_ms: 5.0
"""
CLUSTER_YAML = """\
num_nodes: 2
gpus_per_node: 4
memory_gb: 16
a2a_bandwidth_gbps: {2: 100.0, 4: 80.0, 8: 10.0}
"""


def test_user_yaml_files(tmp_path):
    (tmp_path / "mymodel.yaml").write_text(TINY_YAML)
    (tmp_path / "mycluster.yml").write_text(CLUSTER_YAML)
    m = load_model(str(tmp_path / "mymodel.yaml"))
    assert m.name == "mymodel" and m.num_layers == 2 and m.max_sp_degree == 4
    c = load_cluster(str(tmp_path / "mycluster.yml"))
    assert c.name == "mycluster" and c.num_gpus == 8 and c.a2a_bandwidth(8) == 10.0
    cost = CostModel.from_presets(str(tmp_path / "mymodel.yaml"), str(tmp_path / "mycluster.yml"))
    assert cost.degrees == (1, 2, 4)
    assert cost.model_states_mb == pytest.approx(0.001 * 16 * 1024 / 8)


def test_yaml_name_field_wins(tmp_path):
    (tmp_path / "m.yaml").write_text(TINY_YAML + "name: custom\n")
    assert load_model(str(tmp_path / "m.yaml")).name == "custom"


def test_cluster_yaml_num_nodes_3(tmp_path):
    p = tmp_path / "three.yaml"
    p.write_text(CLUSTER_YAML.replace("num_nodes: 2", "num_nodes: 3"))
    with pytest.raises(ConfigError, match="num_nodes=3 is not a power of two"):
        load_cluster(str(p))
    # (an integer written as a float or a string was "not a power of two")
    for old, new, says in (("num_nodes: 2", "num_nodes: 2.0", "num_nodes must be a positive integer, got 2.0"),
                           ("num_nodes: 2", 'num_nodes: "2"', "num_nodes must be a positive integer, got '2'"),
                           ("gpus_per_node: 4", "gpus_per_node: 4.0", "gpus_per_node must be a positive integer")):
        p.write_text(CLUSTER_YAML.replace(old, new))
        with pytest.raises(ConfigError, match=f"^cluster 'three': {says}"):
            load_cluster(str(p))


@pytest.mark.parametrize("text, match", [
    ("num_layers: [1, 2\n", "not valid YAML"),
    ("- 1\n- 2\n", "mapping"),
    ("", "mapping"),
    (TINY_YAML + "num_experts: 8\n", "unknown field"),
    (TINY_YAML.replace("a2: 0.01\n", ""), "missing field.*a2"),
    (TINY_YAML + "b1: 5.0\n", "b1 is no longer a model field"),
    (TINY_YAML + "recompute: some\n", "recompute must be 'none' or 'full'"),
    (TINY_YAML + "recompute_layers: 3\n", "recompute_layers must be an integer in 0..2"),
    (TINY_YAML + "recompute_layers: 1\n", "recompute_layers \\(1\\) applies with recompute: full, not 'none'"),
    (TINY_YAML.replace("num_layers: 2", "num_layers: two"), "num_layers"),
    (TINY_YAML.replace("a2: 0.01", "a2: -0.01"), "a2"),
    (TINY_YAML.replace("act_mb_per_token: 0.01", "act_mb_per_token: 0"), "act_mb_per_token"),
    (TINY_YAML + "num_query_groups: 3\n", "num_query_groups"),
    (TINY_YAML + "num_query_groups: four\n", "num_query_groups"),
    (TINY_YAML + "num_query_groups: -2\n", "num_query_groups"),
    (TINY_YAML.replace("a1: 1.0e-6", "a1: .inf"), "a1 must be a non-negative finite number, got inf"),
    (TINY_YAML.replace("launch_ms: 5.0", "launch_ms: .nan"), "launch_ms must be a non-negative finite number, got nan"),
    (TINY_YAML.replace("act_mb_per_token: 0.01", "act_mb_per_token: .inf"), "act_mb_per_token must be a positive"),
    (TINY_YAML.replace("num_layers: 2", "num_layers: true"), "num_layers must be a positive integer, got True"),
    (TINY_YAML + "vocab_size: -1\n", "vocab_size must be a positive integer"),
    (TINY_YAML + "ffn_hidden_size: 0\n", "ffn_hidden_size must be a positive integer"),
    (TINY_YAML + "swiglu: 1\n", "swiglu must be true or false"),
    (TINY_YAML + "head_time_share: .nan\n", "head_time_share"),
    (TINY_YAML + "activation_bytes: true\n", "activation_bytes must be 1, 2, 4 or 8, got True"),
    (TINY_YAML.replace("hidden_size: 64", "hidden_size: 63"), "hidden_size 63 must divide by num_attention_heads"),
    (TINY_YAML.replace("a1: 1.0e-6", "a1: 0").replace("a2: 0.01", "a2: 0"), "a1 and a2 are both 0"),
    (TINY_YAML.replace("a1: 1.0e-6", "a1: 1e307"), "a1 must be at most 1e"),
    (TINY_YAML + "name: [1, 2]\n", "model name: must be a string"),
    ("x: &a [1, 2]\n" + TINY_YAML.replace("num_layers: 2", "num_layers: *a"), r"\*a: aliases are not read here"),
    (TINY_YAML + "1: 2\nfoo: 3\n", "unknown field\\(s\\) 1, foo; known: name"),  # (a number as a key: a TypeError)
    (TINY_YAML + "? [1]\n: 2\n", "not valid YAML"),  # (an unhashable key: a TypeError)
])
def test_bad_model_yaml(tmp_path, text, match):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_model(str(p))


@pytest.mark.parametrize("text, match", [
    (CLUSTER_YAML + "num_switches: 3\n", "unknown field"),
    (CLUSTER_YAML.replace("memory_gb: 16\n", ""), "missing field.*memory_gb"),
    (CLUSTER_YAML.replace("gpus_per_node: 4", "gpus_per_node: 6"), "gpus_per_node"),
    (CLUSTER_YAML.replace("memory_gb: 16", "memory_gb: 0"), "memory_gb"),
    (CLUSTER_YAML.replace("{2: 100.0, 4: 80.0, 8: 10.0}", "{4: 80.0, 8: 10.0}"), "degree 2"),
    (CLUSTER_YAML.replace("{2: 100.0, 4: 80.0, 8: 10.0}", "{2: 100.0, 3: 80.0}"), "power-of-two"),
    (CLUSTER_YAML.replace("{2: 100.0, 4: 80.0, 8: 10.0}", "{2: 100.0, x: 80.0}"), "integer degrees"),
    (CLUSTER_YAML.replace("{2: 100.0, 4: 80.0, 8: 10.0}", "{2: -1.0}"), "positive"),
    (CLUSTER_YAML.replace("num_nodes: 2", "num_nodes: 0"), "num_nodes"),
    (CLUSTER_YAML.replace("memory_gb: 16", "memory_gb: .inf"), "memory_gb must be a positive finite number, got inf"),
    (CLUSTER_YAML.replace("memory_gb: 16", "memory_gb: .nan"), "memory_gb must be a positive finite number, got nan"),
    (CLUSTER_YAML.replace("memory_gb: 16", "memory_gb: -16"), "memory_gb must be a positive finite number, got -16"),
    (CLUSTER_YAML.replace("memory_gb: 16", "memory_gb: 1.0e+6"), "memory_gb must be at most 10,000, got 1000000.0"),
    (CLUSTER_YAML + "p2p_bandwidth_gbps: 0\n", "p2p_bandwidth_gbps must be a positive"),
    (CLUSTER_YAML + "micro_batch_overhead_ms: .inf\n", "micro_batch_overhead_ms must be a non-negative finite"),
    (CLUSTER_YAML.replace("{2: 100.0, 4: 80.0, 8: 10.0}", "{2: 100.0, 4: .inf}"), r"a2a_bandwidth_gbps\[4\]"),
    (CLUSTER_YAML + "a2a_latency_ms: {2: .nan}\n", r"a2a_latency_ms\[2\] must be a non-negative finite"),
    (CLUSTER_YAML.replace("num_nodes: 2", "num_nodes: 1073741824"), "4,294,967,296 GPUs is over the 1,048,576"),
    (CLUSTER_YAML.replace("{2: 100.0, 4: 80.0, 8: 10.0}", "{2: 100.0, 2.5: 1.0}"), "integer degrees, got 2, 2.5"),
    (CLUSTER_YAML + "memory_gb: 80\n", "key 'memory_gb' given twice"),
    (CLUSTER_YAML.replace("{2: 100.0, 4: 80.0, 8: 10.0}", "{'2': 100.0, 2: 50.0}"), "gives a degree twice"),
    (CLUSTER_YAML.replace("{2: 100.0, 4: 80.0, 8: 10.0}", "{2: 1e-300}"), r"a2a_bandwidth_gbps\[2\] must be at least"),
    (CLUSTER_YAML + "a2a_latency_ms: {2: 1e300}\n", r"a2a_latency_ms\[2\] must be at most 1e\+09"),
])
def test_bad_cluster_yaml(tmp_path, text, match):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_cluster(str(p))


def test_yaml_exponents_without_a_dot_are_numbers_and_binary_files_are_refused(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text(TINY_YAML.replace("a1: 1.0e-6", "a1: 5e-6"))
    assert load_model(str(p)).a1 == 5e-6
    p.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_model(str(p))
    p.write_text("num_layers: " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError, match="holds a number of over 4,300 digits"):
        load_model(str(p))
    with pytest.raises(ConfigError, match="/dev/zero: too big to be a model, cluster or cost-model YAML"):
        load_model("/dev/zero")


def test_missing_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_model(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_cluster(str(tmp_path / "nope.yaml"))


def test_model_states_over_memory_is_infeasible():
    cost = CostModel.from_presets("gpt-30b", "a100-40g-8x1", zero_stage=0)
    with pytest.raises(InfeasibleError, match="model states"):
        cost.max_seq_len


# ---- CostModel.from_yaml -------------------------------------------------------------------

def test_from_yaml_inline_mappings(tmp_path):
    model = "\n".join("  " + line for line in TINY_YAML.splitlines())
    cluster = "\n".join("  " + line for line in CLUSTER_YAML.splitlines())
    p = tmp_path / "lab.yaml"
    p.write_text(f"model:\n{model}\ncluster:\n{cluster}\nzero_stage: 2\n")
    cost = CostModel.from_yaml(p)
    assert cost.model.name == "lab" and cost.cluster.name == "lab"
    assert cost.zero_stage == 2
    assert cost.num_gpus == 8 and cost.degrees == (1, 2, 4)
    assert cost.model_states_mb == pytest.approx(0.001 * 16 * 1024 * (7 / 8 / 8 + 1 / 8))
    assert cost.group_time_ms([100], 1) == pytest.approx(5.0 + 1e-6 * 100**2 + 0.01 * 100)


def test_from_yaml_presets_and_default_stage(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model: gpt-7b\ncluster: a100-40g-8x8\n")
    cost = CostModel.from_yaml(str(p))
    assert cost.zero_stage == 3 and cost.model_states_mb == pytest.approx(2009.6)
    p.write_text("model: gpt-7b\ncluster: h100-80g-8x16\n")
    assert CostModel.from_yaml(p).num_gpus == 128


def test_from_yaml_reads_relative_files_from_its_folder(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "mymodel.yaml").write_text(TINY_YAML)
    (tmp_path / "conf" / "cost.yaml").write_text("model: mymodel.yaml\ncluster: cpu-4\n")
    monkeypatch.chdir(tmp_path)  # (not the YAML's folder)
    assert CostModel.from_yaml("conf/cost.yaml").model.name == "mymodel"


def test_from_yaml_takes_what_profile_measured_on_as_metadata(tmp_path):
    """A profiled YAML names its device, dtype and attention backend: it loads like any cost
    model, with the same costs as without them, and its ZeRO stage."""
    plain = "model: gpt-7b\ncluster: h100-80g-8x1\n"
    (tmp_path / "plain.yaml").write_text(plain)
    (tmp_path / "profiled.yaml").write_text(plain + "zero_stage: 1\ndevice: NVIDIA H100 80GB HBM3\ndtype: bf16\n"
                                            "attention_backend: flash\nprofile: {host: nccl, ranks: 8}\n")
    base, profiled = CostModel.from_yaml(tmp_path / "plain.yaml"), CostModel.from_yaml(tmp_path / "profiled.yaml")
    assert profiled.zero_stage == 1
    assert profiled.model == base.model and profiled.cluster == base.cluster
    assert profiled.model_states_mb == CostModel.from_presets("gpt-7b", "h100-80g-8x1", 1).model_states_mb


@pytest.mark.parametrize("text, match", [
    ("model: gpt-7b\n", "needs 'model' and 'cluster'"),
    ("model: gpt-7b\ncluster: cpu-4\nextra: 1\n", "unknown: extra"),
    ("model: gpt-7b\ncluster: cpu-4\nzero_stage: 5\n", "zero_stage"),
    ("model: gpt-7b\ncluster: cpu-4\nzero_stage: abc\n", "zero_stage"),
    ("model: 5\ncluster: cpu-4\n", "model"),
    ("model: gpt-7b\ncluster: [1, 2]\n", "cluster"),
    ("model: gpt-7b\ncluster: {num_nodes: 3, gpus_per_node: 8, memory_gb: 28, "
     "a2a_bandwidth_gbps: {2: 100}}\n", "power of two"),
    ("model: {num_layers: 2}\ncluster: cpu-4\n", "missing field"),
    ("model: gpt-7b\ncluster: cpu-4\n: :\n  - [\n", "not valid YAML"),
    ("model: gpt-7b\ncluster: cpu-4\nzero_stage: 5\n", "bad.yaml: zero_stage must be one of 0, 1, 2, 3, got 5"),
])
def test_from_yaml_errors(tmp_path, text, match):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=match) as e:
        CostModel.from_yaml(p)
    assert str(p) in str(e.value)  # every error names the file


def test_spec_dataclasses_are_frozen():
    m = load_model("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.num_layers = 3  # type: ignore[misc]
    assert isinstance(m, ModelSpec) and isinstance(load_cluster("cpu-4"), ClusterSpec)


def test_a_model_that_holds_no_token_is_refused_not_sampled_for_ever(tmp_path):
    from megatron_ext.planner.api import max_seq_len

    p = tmp_path / "deep.yaml"
    p.write_text(TINY_YAML.replace("act_mb_per_token: 0.01", "act_mb_per_token: 1.0e+9"))
    cost = CostModel.from_presets(str(p), "cpu-4")
    for planner in ("flexsp", "elastic_pp", "auto"):
        with pytest.raises(InfeasibleError, match="holds no sequence at all"):
            max_seq_len(planner, cost)


def test_a_family_of_clusters_needs_its_node_count():
    with pytest.raises(ConfigError, match="h100-80g-8xN names a family of clusters: give the node count, e.g. "
                                          "h100-80g-8x4"):
        load_cluster("h100-80g-8xN")
    assert load_cluster("h100-80g-8x2").num_nodes == 2


def test_link_figures_and_tables_convert_between_their_units():
    """All-to-all and p2p tables are MB per ms; link figures GB/s of 1e9 bytes (spec.py, units).
    A cluster without link figures or a p2p figure takes them from its all-to-all table, each in
    its own unit: the ring's neighbour gets exactly the table's cross-node MB per ms, and a ZeRO
    collective (cost/fixed.py: bytes over GB/s x 1e6) moves the table's MB per ms."""
    cluster = ClusterSpec("plain", num_nodes=2, gpus_per_node=4, memory_gb=80,
                          a2a_bandwidth_gbps={2: 40.0, 4: 30.0, 8: 10.0}, a2a_latency_ms={2: 0.0})
    assert cluster.intra_node_gbps * 1e9 / 1e3 / 2**20 == pytest.approx(30.0)  # bytes a ms, in MB
    assert cluster.inter_node_gbps / 4 * 1e9 / 1e3 / 2**20 == pytest.approx(10.0)
    cost = CostModel(load_model("gpt-7b"), cluster, 1, max_ring=2)
    assert cluster.pair_mb_per_ms(True, 4) == pytest.approx(10.0)  # (a node's 4 GPUs sending across)


def test_a_ring_inside_a_node_runs_on_nvlink_and_across_nodes_on_the_shared_nics():
    """llama-30b's 52 heads cap Ulysses at 4: a group of 8 is 4 x a ring of 2 inside one node
    (NVLink, 155 GB/s a GPU on A800), one of 16 spans two nodes, each crossing hop carrying a
    Ulysses part's 4 GPUs over the node's 46 GB/s (every ring GPU was priced at the node's NICs)."""
    cost = CostModel.from_presets("llama-30b", "a800-80g-8x4", 3).with_max_ring(4)
    m, s = cost.model, 256
    kv = 2 * m.kv_heads * (m.hidden_size // m.num_attention_heads) * m.activation_bytes / 2**20 / 4
    for degree, mb_per_ms in ((8, 155e6 / 2**20), (16, 46e6 / 2**20 / 4)):
        r = degree // 4
        exposed = 3 * (r - 1) * m.num_layers * (s / r) * kv / mb_per_ms - cost.a1 * s * s / degree
        assert float(cost.ring_ms(s, degree)) == pytest.approx(max(0.0, exposed)) and exposed > 0
