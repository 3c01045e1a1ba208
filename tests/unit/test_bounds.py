"""The step-time lower bounds (cost/bounds.py): below every plan found by exhaustive search on small
batches, above the plain bound they sharpen, and worked out by hand where each refinement binds."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from small_cost import small_cost
from megatron_ext.cost import CostModel


@pytest.fixture(scope="module")
def tiny() -> CostModel:
    return small_cost()


def set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]
        yield [[first]] + part


def best_step_ms(cost: CostModel, lengths, degrees) -> float:
    """The fastest plan by exhaustive search: every partition of the sequences into groups, every
    degree of each group that holds it, every partition of the groups into micro-batches that fit
    the GPUs; a micro-batch lasts as long as its slowest group."""
    best = math.inf
    for groups in set_partitions(list(range(len(lengths)))):
        tokens = [sum(lengths[i] for i in g) for g in groups]
        choices = [[d for d in degrees if t <= cost.token_capacity(d)] for t in tokens]
        for degs in itertools.product(*choices):
            times = [cost.group_time_ms([lengths[i] for i in g], d) for g, d in zip(groups, degs)]
            for mbs in set_partitions(list(range(len(groups)))):
                if all(sum(degs[k] for k in mb) <= cost.num_gpus for mb in mbs):
                    best = min(best, sum(max(times[k] for k in mb) for mb in mbs))
    return best


def plain_bound_ms(cost: CostModel, lengths) -> float:
    """The bound these sharpen: work spread at the cheapest degrees with the token count of
    micro-batches, or the longest sequence alone at its fastest degree."""
    longest = max(lengths)
    fastest = min(float(cost.seq_time_ms(longest, d)) + cost.a2a_latency_ms(d) for d in cost.degrees
                  if longest <= cost.token_capacity(d))
    spread = cost.min_microbatches(lengths) * cost.micro_batch_fixed_ms + cost.cheapest_gpu_ms(lengths).sum() / cost.num_gpus
    return max(spread, cost.micro_batch_fixed_ms + fastest)


@pytest.mark.parametrize("seed", range(12))
def test_bounds_below_the_best_plan(tiny, seed):
    rng = np.random.default_rng(seed)
    cap = tiny.token_capacity(4)
    lengths = [int(x) for x in rng.integers(1000, cap, size=4) // rng.choice([1, 4, 16], size=4)]
    best = best_step_ms(tiny, lengths, tiny.degrees)
    bound = tiny.lower_bound_ms(lengths)
    assert plain_bound_ms(tiny, lengths) <= bound + 1e-9 <= best + 2e-9
    # any degree 1..4 (3 too): a search over more plans, still above the relaxed bound
    relaxed = tiny.relaxed_bound_ms(lengths)
    assert relaxed <= bound + 1e-9
    assert relaxed <= best_step_ms(tiny, lengths, range(1, 5)) + 1e-9


def test_memory_forces_a_micro_batch_per_long_sequence(tiny):
    # three sequences of 55% of a micro-batch's tokens: 1.65 micro-batches of tokens, but no two
    # share one, so three passes, each with one sequence as its critical path
    cap = tiny.tokens_per_gpu * 4
    s = int(cap * 0.55)
    fastest = float(tiny.seq_time_ms(s, 4))  # it needs all 4 GPUs (no latency on this cluster)
    assert tiny.min_microbatches([s] * 3) == 2
    assert tiny.lower_bound_ms([s] * 3) == pytest.approx(3 * (tiny.micro_batch_fixed_ms + fastest), rel=1e-12)
    assert best_step_ms(tiny, [s] * 3, tiny.degrees) == pytest.approx(tiny.lower_bound_ms([s] * 3), rel=1e-12)


def test_longest_sequence_is_a_critical_path_in_every_pass_count():
    # gpt-7b on 1,024 GPUs: a 150K-token sequence runs on at most 64 GPUs (the head limit), so
    # its time, not the batch's work spread, sets its pass; short sequences that need a second
    # pass add that pass's b1 to it (the plain bound counted the path with one b1)
    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x128")
    long_ = 150_000
    short = [512] * int(cost.tokens_per_gpu * 1024 / 512)
    lengths = [long_] + short
    assert cost.min_microbatches(lengths) == 2
    b1 = cost.micro_batch_fixed_ms
    path = float(cost.seq_time_ms(long_, 64)) + cost.a2a_latency_ms(64)
    assert plain_bound_ms(cost, lengths) == pytest.approx(b1 + path, rel=1e-12)
    bound = cost.lower_bound_ms(lengths)
    assert bound >= 2 * b1 + path
    # the second pass holds at least the tokens the first cannot, at their cheapest
    overflow = sum(lengths) - cost.tokens_per_gpu * 1024
    assert bound <= 2 * b1 + path + overflow / 512 * cost.cheapest_gpu_ms([512])[0] / 1024 + 1e-6


def test_relaxed_bound_is_not_held_to_the_head_limit():
    # gpt-7b has 64 heads: a 300K-token sequence on 1,024 GPUs runs at degree 64 at most, but the
    # relaxed bound lets it span every GPU (at the widest tabulated all-to-all bandwidth, no ring)
    cost = CostModel.from_presets("gpt-7b", "a100-40g-8x128")
    s = 300_000
    b1 = cost.micro_batch_fixed_ms
    at64 = float(cost.seq_time_ms(s, 64)) + cost.a2a_latency_ms(64)
    assert cost.lower_bound_ms([s]) == pytest.approx(b1 + at64, rel=1e-12)
    at1024 = float(cost.seq_time_ms(s, 1024) - cost.ring_ms(s, 1024)) + cost.a2a_latency_ms(1024)
    assert cost.relaxed_bound_ms([s]) == pytest.approx(b1 + at1024, rel=1e-12)
    # a degree of no power of two is allowed: 17 GPUs hold what 16 cannot, at 16's bandwidth
    s17 = cost.token_capacity(17)
    cheapest17 = float(cost.seq_time_ms(s17, 1)) + s17 * 17 * cost.comm_ms_per_token(17)
    assert cost.relaxed_bound_ms([s17] * 1024) >= b1 * 1 + 1024 * cheapest17 / 1024 - 1e-6


@pytest.mark.parametrize("gpus", [64, 1024])
def test_bounds_order_on_sampled_batches(gpus):
    from megatron_ext.data.lengths import sample_lengths
    cost = CostModel.from_presets("gpt-7b", f"a100-40g-8x{gpus // 8}")
    for dist in ("wikipedia", "github"):
        lengths = sample_lengths(dist, 8 * gpus, 1, cost.max_seq_len)
        plain, bound, relaxed = plain_bound_ms(cost, lengths), cost.lower_bound_ms(lengths), cost.relaxed_bound_ms(lengths)
        assert relaxed <= bound and plain <= bound


def test_empty_batch_and_one_no_group_holds(tiny):
    assert tiny.lower_bound_ms([]) == 0.0 and tiny.relaxed_bound_ms([]) == 0.0
    too_long = tiny.token_capacity(4) + 1
    assert tiny.lower_bound_ms([too_long, 10]) == math.inf
    assert np.isinf(tiny.cheapest_gpu_ms([too_long, 10])).tolist() == [True, False]


# ---- pipelines (``pipeline_bound_ms``) --------------------------------------------------------

def test_pipeline_bound_is_the_step_of_one_chunk_on_one_stage():
    # one stage, one replica, one chunk: the bound's work, fixed cost and sync are the whole step
    from megatron_ext.planner.pp.elastic_pp import plan_elastic_pp

    one_node = CostModel.from_presets("llama-13b", "a800-80g-8x1", 3)
    for lengths in ([20000], [20000, 5000, 3000]):
        plan = plan_elastic_pp(np.array(lengths), one_node, 1, 8)
        assert sum(len(p.chunks) for p in plan.pipelines) == 1
        assert plan.lower_bound_step_time_s == pytest.approx(plan.estimated_step_time_s, rel=1e-12)


def test_pipeline_bound_counts_no_more_chunks_than_the_simulator_forces():
    # the bound's largest chunk is the largest one chunk the simulator lets a stage hold: one token
    # more, and the chunk alone is over the budget during its backward (recompute or not)
    from megatron_ext.cost.pipeline import PipelineCost
    from megatron_ext.errors import InvalidPlanError
    from megatron_ext.plan.schema import Chunk, Piece, Pipeline, StepPlan
    from megatron_ext.sim import simulate

    # (one stage: with more, the longest sequence's chain across them, which slices it finer, binds)
    cost = CostModel.from_presets("llama-13b", "a800-80g-8x1", 3)
    pc = PipelineCost(cost, 1, 8)

    def one_chunk(t: int, recompute: int) -> float:
        chunk = Chunk(0, [Piece(0, 0, t)], [recompute])
        plan = StepPlan(kind="elastic_pp", num_gpus=8, planner="test",
                        pipelines=[Pipeline(1, 8, [chunk], [["F0", "B0"]])])
        return simulate(plan, np.array([t]), cost).step_time_s

    t_max = int(pc.activation_room_mb / (pc.act_layer_mb * pc.layers_per_stage + float(pc.head_mb)))
    one_chunk(t_max, 0)
    for layers in (0, pc.layers_per_stage):
        with pytest.raises(InvalidPlanError, match="over the"):
            one_chunk(t_max + 1, layers)
    # two sequences of t_max tokens: two chunks at least; of t_max + 1: three
    F = pc.fixed_ms + 2 * cost.cluster.pipeline_op_overhead_ms
    grow = pc.lower_bound_ms([t_max + 1, t_max + 1]) - pc.lower_bound_ms([t_max, t_max])
    assert grow >= F * (1 - 1e-9)


@pytest.mark.parametrize("zero, memory_mb", [(1, None), (3, None), (3, 30_000)])
def test_pipeline_bound_below_every_pipeline_plan(zero, memory_mb):
    from megatron_ext.cost.pipeline import PipelineCost
    from megatron_ext.planner.api import make_plan
    from megatron_ext.planner.pp.pipeline import PipelineOptions
    from megatron_ext.errors import MegatronExtError

    cost = CostModel.from_presets("llama-13b", "a800-80g-8x4", zero)
    rng = np.random.default_rng(zero)
    planned = 0
    for (pp, sp), planner in itertools.product([(1, 8), (2, 8), (4, 4), (8, 1), (2, 2)],
                                               ["elastic_pp", "seq1f1b", "batch_1f1b"]):
        lengths = np.concatenate([rng.integers(100, 4000, 60), rng.integers(8000, 40000, 4)])
        try:
            plan = make_plan(planner, lengths, cost, PipelineOptions(time_limit=0.1, memory_mb=memory_mb, pp=pp, sp=sp))
        except MegatronExtError:
            continue
        pc = PipelineCost(cost, pp, sp, memory_mb=memory_mb)
        assert plan.lower_bound_step_time_s == pytest.approx(pc.lower_bound_ms(lengths) / 1e3, rel=1e-12)
        assert plan.estimated_step_time_s >= plan.lower_bound_step_time_s * (1 - 1e-9)
        # above the plain bound: a replica's share of the stage work and one chunk's fixed cost a stage
        plain = float(pc.prefix_ms(lengths).sum()) / pc.replicas + pc.pp * pc.fixed_ms + pc.step_sync_ms
        assert plan.lower_bound_step_time_s * 1e3 >= plain * (1 - 1e-12)
        planned += 1
    assert planned >= 6  # (some layouts cannot hold 40K tokens in 30 GB)


def test_pipeline_bound_recompute_is_what_the_simulator_forces():
    # a sequence over a stage's cap runs in slices; during its last slice's backward every earlier
    # slice is in flight, so memory forces X token-layers of them to be recomputed: the planner's
    # plan recomputes at least that, and one layer fewer than X is over the budget
    from megatron_ext.cost.pipeline import PipelineCost
    from megatron_ext.errors import InvalidPlanError
    from megatron_ext.planner.pp.elastic_pp import plan_elastic_pp
    from megatron_ext.sim import simulate

    cost = CostModel.from_presets("llama-13b", "a800-80g-8x1", 3)
    pc = PipelineCost(cost, 1, 8)
    whole = pc.act_layer_mb * pc.layers_per_stage + float(pc.head_mb)
    room, cap = pc.activation_room_mb, pc.activation_room_mb / whole
    s = int(1.6 * cap)  # (under the longest a stage holds, ~1.9 caps)
    X = (s * whole + (s - cap) * pc.kv_layer_mb * pc.layers_per_stage - room) / (pc.act_layer_mb - pc.input_layer_mb)
    assert X > 0
    plan = plan_elastic_pp(np.array([s]), cost, 1, 8)
    chunks = sorted(plan.pipelines[0].chunks, key=lambda c: c.pieces[0].start)[:-1]  # all but the last slice
    held = [(c, c.pieces[0].end - c.pieces[0].start) for c in chunks]
    assert sum(c.recompute_layers_per_stage[0] * t for c, t in held) >= X
    # the bound charges the least X token-layers can cost: every layer of the first X / L_s tokens
    y = X / pc.layers_per_stage
    least = float(pc.recompute_ms(cost.a1 * y * y + cost.a2 * y, y, pc.layers_per_stage)
                  - pc.recompute_ms(0.0, 0.0, pc.layers_per_stage))
    work = cost.a1 * s * s + cost.a2 * s
    base = float(pc.compute_ms(work, s, 0)) + s * pc.comm_ms_per_token + pc.step_sync_ms
    assert least > X * float(pc.recompute_ms(cost.a2, 1.0, 1) - pc.recompute_ms(0.0, 0.0, 1))  # (attention too)
    assert pc.lower_bound_ms([s]) >= base + least
    assert plan.estimated_step_time_s * 1e3 >= pc.lower_bound_ms([s])
    while sum(c.recompute_layers_per_stage[0] * t for c, t in held) >= X:  # one layer fewer at a time
        c, _ = max(held, key=lambda x: x[0].recompute_layers_per_stage[0] * (x[0].pieces[0].start + 1))
        c.recompute_layers_per_stage[0] -= 1
    with pytest.raises(InvalidPlanError, match="over the"):
        simulate(plan, np.array([s]), cost)


@pytest.mark.parametrize("cluster, pp, tokens, zero", [("a800-80g-8x2", 2, 96 * 1024, 3), ("a800-80g-8x4", 4, 48 * 1024, 1)])
def test_pipeline_bound_follows_one_long_sequence_across_the_stages(cluster, pp, tokens, zero):
    # one sequence on P stages: its slices' chain (the other stages wait for a slice's passes, each
    # slice pays the fixed cost) puts the bound within 2% of the planner's plan; by the stages'
    # work alone it would be 1.2-1.5x below. Every cut into equal slices is above it too.
    from megatron_ext.cost.pipeline import PipelineCost
    from megatron_ext.plan.schema import Chunk, Piece, Pipeline, StepPlan
    from megatron_ext.planner.pp.elastic_pp import plan_elastic_pp
    from megatron_ext.sim import simulate

    cost = CostModel.from_presets("llama-13b", cluster, zero)
    pc = PipelineCost(cost, pp, 8)
    assert pc.replicas == 1
    bound = pc.lower_bound_ms([tokens]) / 1e3
    plan = plan_elastic_pp(np.array([tokens]), cost, pp, 8)
    assert bound <= plan.estimated_step_time_s <= 1.03 * bound  # (1.006x and 1.018x)
    work = pc.stage_ms(cost.a1 * tokens ** 2 + cost.a2 * tokens, tokens, 0) + pc.step_sync_ms
    assert bound > 1.15 * work / 1e3
    for k in (1, 2, 3, 5, 8, 13, 21):
        cuts = np.linspace(0, tokens, k + 1).astype(int)
        chunks = [Chunk(i, [Piece(0, int(cuts[i]), int(cuts[i + 1]))], [0] * pp) for i in range(k)]
        order = [f"F{i}" for i in range(k)] + [f"B{i}" for i in reversed(range(k))]
        equal = StepPlan(kind="elastic_pp", num_gpus=cost.num_gpus, planner="test",
                         pipelines=[Pipeline(pp, 8, chunks, [order] * pp)])
        assert simulate(equal, np.array([tokens]), cost).step_time_s >= bound * (1 - 1e-9)


def test_pipeline_bound_puts_two_of_r_plus_one_long_sequences_on_one_replica():
    # 4 one-stage replicas, 5 equal sequences: some replica runs two of them one after the other,
    # which the planner's plan does exactly; 4 of them run side by side in half that
    from megatron_ext.cost.pipeline import PipelineCost
    from megatron_ext.planner.pp.elastic_pp import plan_elastic_pp

    cost = CostModel.from_presets("llama-13b", "a800-80g-8x4", 3)
    pc = PipelineCost(cost, 1, 8)
    assert pc.replicas == 4
    five, four = np.array([40_000] * 5), np.array([40_000] * 4)
    plan = plan_elastic_pp(five, cost, 1, 8)
    assert pc.lower_bound_ms(five) / 1e3 == pytest.approx(plan.estimated_step_time_s, rel=1e-9)
    # (the two share one chunk's fixed cost: 1.93x)
    assert pc.lower_bound_ms(five) - pc.step_sync_ms > 1.9 * (pc.lower_bound_ms(four) - pc.step_sync_ms)
