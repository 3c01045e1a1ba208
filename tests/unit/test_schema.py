"""StepPlan: the JSON contract (DESIGN.md) and validate()'s invariants."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from small_cost import small_cost
from megatron_ext.cost import CostModel
from megatron_ext.errors import InvalidPlanError
from megatron_ext.plan import (Chunk, MicroBatchPlan, Piece, Pipeline, SPGroup, StepPlan, fill_estimates,
                               validate)
from megatron_ext.plan.schema import VERSION


@pytest.fixture(scope="module")
def tiny() -> CostModel:  # 4 ranks, degrees 1, 2, 4
    return small_cost()


@pytest.fixture(scope="module")
def c7b() -> CostModel:  # 64 ranks, degrees 1 .. 64, 5951 tokens per GPU
    return CostModel.from_presets("gpt-7b", "a100-40g-8x8")


LENGTHS = np.array([100, 200, 300, 400])


def flexsp_plan(*micro_batches, num_gpus=4, dropped=()) -> StepPlan:
    """micro_batches: lists of (ranks, seq_ids)."""
    return StepPlan(kind="flexsp", num_gpus=num_gpus, planner="hand",
                    micro_batches=[MicroBatchPlan([SPGroup(list(r), list(s)) for r, s in mb])
                                   for mb in micro_batches],
                    dropped_seq_ids=list(dropped))


def valid_plan() -> StepPlan:
    # mb 0: a degree-2 group on ranks 0-1 with seqs 0 and 3, seq 1 alone on rank 2 (rank 3 idle)
    # mb 1: seq 2 on all four ranks
    return flexsp_plan([([0, 1], [0, 3]), ([2], [1])], [([0, 1, 2, 3], [2])])


def elastic_plan() -> StepPlan:
    return StepPlan(
        kind="elastic_pp", num_gpus=4, planner="hand", solve_time_s=0.25, estimated_step_time_s=3.5,
        lower_bound_step_time_s=3.0, solver_status="milp",
        pipelines=[Pipeline(stages=2, sp_degree=2,
                            chunks=[Chunk(0, [Piece(3, 0, 250)], [2, 1]),
                                    Chunk(1, [Piece(3, 250, 400), Piece(0, 0, 100)], [0, 0]),
                                    Chunk(2, [Piece(1, 0, 200), Piece(2, 0, 300)])],
                            order_per_stage=[["F0", "F1", "F2", "B2", "B1", "B0"],
                                             ["F0", "F1", "B1", "F2", "B2", "B0"]])],
        baselines={"static_ulysses": {"estimated_step_time_s": 6.1, "speedup": 1.7}})


# ---- JSON ----------------------------------------------------------------------------------

def test_json_round_trip_flexsp(tiny):
    plan = fill_estimates(valid_plan(), LENGTHS, tiny)
    plan.solve_time_s = 0.125
    plan.solver_status = "lp_rounded"
    plan.baselines = {"batchada": {"estimated_step_time_s": 1.5, "num_micro_batches": 2, "speedup": 1.1}}
    text = plan.to_json()
    back = StepPlan.from_json(text)
    assert back == plan
    assert back.to_json() == text
    assert isinstance(back.micro_batches[0].groups[0], SPGroup)


def test_json_round_trip_pipelines():
    plan = elastic_plan()
    back = StepPlan.from_json(plan.to_json(indent=1))
    assert back == plan
    assert isinstance(back.pipelines[0].chunks[1].pieces[1], Piece)
    assert back.pipelines[0].chunks[2].recompute_layers_per_stage == []
    assert back.pipelines[0].order_per_stage[1][3] == "F2"


def test_json_keys_follow_the_contract(tiny):
    d = json.loads(fill_estimates(valid_plan(), LENGTHS, tiny).to_json())
    for key in ("version", "kind", "num_gpus", "solve_time_s", "estimated_step_time_s", "micro_batches",
                "pipelines", "baselines"):
        assert key in d
    assert d["version"] == VERSION == 1
    mb = d["micro_batches"][0]
    assert set(mb) >= {"estimated_time_s", "groups"}
    assert mb["groups"][0]["ranks"] == [0, 1] and mb["groups"][0]["seq_ids"] == [0, 3]
    piece = json.loads(elastic_plan().to_json())["pipelines"][0]["chunks"][0]
    assert piece == {"id": 0, "pieces": [{"seq_id": 3, "start": 0, "end": 250}], "recompute_layers_per_stage": [2, 1]}


def test_from_json_tolerates_missing_optional_keys():
    text = json.dumps({"version": 1, "kind": "flexsp", "num_gpus": 4,
                       "micro_batches": [{"groups": [{"ranks": [0], "seq_ids": [0]}]}]})
    plan = StepPlan.from_json(text)
    assert plan.micro_batches[0].estimated_time_s == 0.0 and plan.pipelines == []


@pytest.mark.parametrize("text", [
    "{not json",
    "",
    "[]",
    "null",
    '{"kind": "flexsp", "num_gpus": 4}',  # no version
    '{"version": 2, "kind": "flexsp", "num_gpus": 4}',
    '{"version": 1, "kind": "flexsp", "num_gpus": 4, "colour": "red"}',
    '{"version": 1, "kind": "flexsp"}',
    '{"version": 1, "kind": "flexsp", "num_gpus": 4, "micro_batches": [{"groups": [{"ranks": [0]}]}]}',
    '{"version": 1, "kind": "flexsp", "num_gpus": 4, "micro_batches": [{"estimated_time_s": 1}]}',
    '{"version": 1, "kind": "flexsp", "num_gpus": 4, "micro_batches": [5]}',
    '{"version": 1, "kind": "elastic_pp", "num_gpus": 4, "pipelines": [{"stages": 2, "chunks": []}]}',
    '{"version": 1, "kind": "elastic_pp", "num_gpus": 4, "pipelines": [{"stages": 2, "sp_degree": 1, '
    '"chunks": [{"id": 0, "pieces": [{"seq_id": 0, "start": 0}]}]}]}',
])
def test_malformed_json(text):
    with pytest.raises(InvalidPlanError):
        StepPlan.from_json(text)


# ---- validate: accepts ---------------------------------------------------------------------

def test_accepts_hand_made_plan(tiny):
    plan = valid_plan()
    assert validate(plan, LENGTHS, tiny) is plan
    assert validate(StepPlan.from_json(plan.to_json()), LENGTHS.tolist(), tiny)


def test_accepts_plan_at_the_memory_limit(c7b):
    cap = c7b.token_capacity(2)
    validate(flexsp_plan([([0, 1], [0])], num_gpus=64), [cap], c7b)


def test_accepts_dropped_sequences(tiny):
    validate(flexsp_plan([([0, 1, 2, 3], [0, 2, 3])], dropped=[1]), LENGTHS, tiny)


def test_accepts_elastic_pipeline(tiny):
    validate(elastic_plan(), LENGTHS, tiny)


def test_fill_estimates(tiny):
    plan = fill_estimates(valid_plan(), LENGTHS, tiny)
    g0, g1 = plan.micro_batches[0].groups
    assert g0.estimated_time_s == pytest.approx(tiny.group_time_ms([100, 400], 2) / 1e3)
    assert g1.estimated_time_s == pytest.approx(tiny.group_time_ms([200], 1) / 1e3)
    assert plan.micro_batches[0].estimated_time_s == max(g0.estimated_time_s, g1.estimated_time_s)
    mb1 = tiny.group_time_ms([300], 4) / 1e3
    assert plan.estimated_step_time_s == pytest.approx(plan.micro_batches[0].estimated_time_s + mb1)
    assert plan.lower_bound_step_time_s == pytest.approx(tiny.lower_bound_ms(LENGTHS) / 1e3)
    assert plan.lower_bound_step_time_s <= plan.estimated_step_time_s
    dropped = fill_estimates(flexsp_plan([([0, 1, 2, 3], [0, 2, 3])], dropped=[1]), LENGTHS, tiny)
    assert dropped.lower_bound_step_time_s == pytest.approx(tiny.lower_bound_ms([100, 300, 400]) / 1e3)


# ---- validate: rejects ---------------------------------------------------------------------

@pytest.mark.parametrize("plan, match", [
    (flexsp_plan([([0, 1], [0, 3]), ([2], [1])]), "sequence 2 is missing"),
    (flexsp_plan([([0, 1], [0, 3]), ([2], [1])], [([0, 1, 2, 3], [2, 3])]), "sequence 3 appears more than once"),
    (flexsp_plan([([0, 1], [0, 3, 0]), ([2], [1, 2])]), "sequence 0 appears more than once"),
    (flexsp_plan([([0, 1], [0, 3]), ([1], [1])], [([0, 1, 2, 3], [2])]), "overlaps"),
    (flexsp_plan([([0, 1, 2, 3], [0, 3]), ([2, 3], [1])], [([0, 1, 2, 3], [2])]), "overlaps"),
    (flexsp_plan([([1, 2], [0, 3]), ([0], [1])], [([0, 1, 2, 3], [2])]), "aligned"),
    (flexsp_plan([([0, 2], [0, 3]), ([1], [1])], [([0, 1, 2, 3], [2])]), "aligned"),
    (flexsp_plan([([1, 0], [0, 3]), ([2], [1])], [([0, 1, 2, 3], [2])]), "aligned"),
    (flexsp_plan([([0, 1, 2], [0, 1, 3])], [([0, 1, 2, 3], [2])]), "degree 3 is not allowed"),
    (flexsp_plan([([4], [0, 1, 3])], [([0, 1, 2, 3], [2])]), "aligned"),
    # (rank -1 beside a group on rank 3: an empty slice of the ranks in use saw no overlap)
    (flexsp_plan([([-1], [0]), ([0], [1]), ([1], [2]), ([2], [3])]), "aligned"),
    (flexsp_plan([([], [0, 1, 3])], [([0, 1, 2, 3], [2])]), "degree 0"),
    (flexsp_plan([([0, 1], []), ([2], [0, 1, 3])], [([0, 1, 2, 3], [2])]), "no sequences"),
    (flexsp_plan([([0, 1], [0, 3, 4]), ([2], [1])], [([0, 1, 2, 3], [2])]), "out of range"),
    (flexsp_plan([([0, 1], [0, 3, -1]), ([2], [1])], [([0, 1, 2, 3], [2])]), "out of range"),
    (flexsp_plan([([0, 1], [0, 3, 2**64]), ([2], [1])], [([0, 1, 2, 3], [2])]), "out of range"),  # (past int64)
    (flexsp_plan([([0, 1], [0, 3]), ([2], [1])], []), "no groups"),
    (flexsp_plan([([0, 1], [0, 3]), ([2], [1])], [([0, 1, 2, 3], [2])], dropped=[2]), "more than once"),
    (flexsp_plan([([0, 1], [0, 3]), ([2], [1])], [([0, 1, 2, 3], [2])], dropped=[4]), "out of range"),
    (flexsp_plan([([0, 1], [0, 3]), ([2], [1])], [([0, 1, 2, 3], [2])], num_gpus=8), "8 GPUs"),
    (flexsp_plan([([0, 1], [0, 3]), ([2], [1])], [([0, 1, 2, 3], [2])], num_gpus=2), "2 GPUs"),
])
def test_rejects(tiny, plan, match):
    with pytest.raises(InvalidPlanError, match=match):
        validate(plan, LENGTHS, tiny)


def test_rejects_unaligned_block(c7b):
    lengths = [10, 20]
    validate(flexsp_plan([([4, 5, 6, 7], [0]), ([0, 1], [1])], num_gpus=64), lengths, c7b)
    with pytest.raises(InvalidPlanError, match=r"aligned block \[k\*4, \(k\+1\)\*4\)"):
        validate(flexsp_plan([([2, 3, 4, 5], [0]), ([0, 1], [1])], num_gpus=64), lengths, c7b)
    with pytest.raises(InvalidPlanError, match="aligned"):  # an 8-block straddling two nodes
        validate(flexsp_plan([(list(range(4, 12)), [0, 1])], num_gpus=64), lengths, c7b)
    with pytest.raises(InvalidPlanError, match="aligned"):  # past the last rank
        validate(flexsp_plan([([64], [0, 1])], num_gpus=64), lengths, c7b)


def test_rejects_non_power_of_two(c7b):
    with pytest.raises(InvalidPlanError, match="degree 6 is not allowed"):
        validate(flexsp_plan([(list(range(6)), [0])], num_gpus=64), [10], c7b)


def test_rejects_degree_over_head_limit():
    cost = CostModel.from_presets("tiny", "a100-40g-8x1")  # 8 GPUs, but tiny allows degree <= 4
    validate(flexsp_plan([([0, 1, 2, 3], [0])], num_gpus=8), [10], cost)
    with pytest.raises(InvalidPlanError, match="degree 8 is not allowed"):
        validate(flexsp_plan([(list(range(8)), [0])], num_gpus=8), [10], cost)


def test_rejects_group_over_memory(c7b):
    cap1 = c7b.token_capacity(1)  # 5951 tokens fit one GPU
    validate(flexsp_plan([([0], [0])], num_gpus=64), [cap1], c7b)
    with pytest.raises(InvalidPlanError, match="over the 28672 MB budget"):
        validate(flexsp_plan([([0], [0])], num_gpus=64), [cap1 + 1], c7b)
    with pytest.raises(InvalidPlanError, match="MB per GPU"):  # two that fit alone, not together
        validate(flexsp_plan([([0, 1], [0, 1])], num_gpus=64), [cap1, cap1 + 10], c7b)
    validate(flexsp_plan([([0, 1], [0]), ([2, 3], [1])], num_gpus=64), [cap1, cap1 + 10], c7b)


def test_rejects_unknown_kind(tiny):
    plan = valid_plan()
    plan.kind = "magic"
    with pytest.raises(InvalidPlanError, match="unknown plan kind"):
        validate(plan, LENGTHS, tiny)


def _pieces_plan(pieces, dropped=()) -> StepPlan:
    """One stage of SP 4, each piece its own chunk, run F then B per chunk (order of pieces)."""
    order = [x for k in range(len(pieces)) for x in (f"F{k}", f"B{k}")]
    return StepPlan(kind="elastic_pp", num_gpus=4, dropped_seq_ids=list(dropped),
                    pipelines=[Pipeline(1, 4, [Chunk(k, [Piece(*p)], [0]) for k, p in enumerate(pieces)], [order])])


@pytest.mark.parametrize("pieces, match", [
    ([(0, 0, 100), (1, 0, 200), (2, 0, 300)], "sequence 3 is missing"),
    ([(0, 0, 100), (1, 0, 200), (2, 0, 300), (3, 0, 200), (3, 250, 400)], "gap or overlap"),
    ([(0, 0, 100), (1, 0, 200), (2, 0, 300), (3, 0, 250), (3, 200, 400)], "gap or overlap"),
    ([(0, 0, 100), (1, 0, 200), (2, 0, 300), (3, 0, 399)], "end at 399"),
    ([(0, 0, 100), (1, 0, 200), (2, 0, 300), (3, 0, 401)], r"piece 3\[0:401\] is outside its sequence"),
    ([(0, 0, 100), (1, 0, 200), (2, 0, 300), (3, 0, 400), (3, 400, 400)], r"piece 3\[400:400\] is outside"),
    ([(0, 0, 100), (1, 0, 200), (2, 0, 300), (3, 0, 400), (4, 0, 10)], r"piece 4\[0:10\] is outside"),
])
def test_rejects_bad_pieces(tiny, pieces, match):
    with pytest.raises(InvalidPlanError, match=match):
        validate(_pieces_plan(pieces), LENGTHS, tiny)


def test_pieces_with_dropped(tiny):
    validate(_pieces_plan([(0, 0, 100), (2, 0, 300), (3, 0, 400)], dropped=[1]), LENGTHS, tiny)
    with pytest.raises(InvalidPlanError, match="more than once"):
        validate(_pieces_plan([(0, 0, 100), (1, 0, 200), (2, 0, 300), (3, 0, 400)], dropped=[1]), LENGTHS, tiny)


def _as_json_dict(plan: StepPlan) -> dict:
    return json.loads(plan.to_json())


@pytest.mark.parametrize("edit", [
    lambda d: d["micro_batches"][0]["groups"][0].update(ranks=[0.0, 1.0]),
    lambda d: d["micro_batches"][0]["groups"][0].update(ranks="01"),
    lambda d: d["micro_batches"][0]["groups"][0].update(seq_ids="03"),
    lambda d: d["micro_batches"][0]["groups"][0].update(seq_ids=[0, 3.0]),
    lambda d: d["micro_batches"][0]["groups"][1].update(seq_ids=[True]),
    lambda d: d.update(num_gpus="4"),
    lambda d: d.update(dropped_seq_ids=[0.5]),
    lambda d: d.update(dropped_seq_ids="1"),
    # sequence 0 run nowhere, "dropped" as 0.5: must not pass as covered
    lambda d: (d["micro_batches"][0]["groups"][0].update(seq_ids=[3]), d.update(dropped_seq_ids=[0.5])),
])
def test_rejects_wrongly_typed_json_fields(tiny, edit):
    """A plan from JSON is checked before it runs: wrong types are an InvalidPlanError, never a
    TypeError deep in validate() nor a plan that silently passes."""
    d = _as_json_dict(valid_plan())
    edit(d)
    with pytest.raises(InvalidPlanError):
        validate(StepPlan.from_dict(copy.deepcopy(d)), LENGTHS, tiny)


def test_numpy_integer_ids_are_accepted(tiny):
    plan = flexsp_plan([(np.arange(2), np.array([0, 3])), ([np.int64(2)], [np.int64(1)])],
                       [([0, 1, 2, 3], [2])])
    validate(plan, LENGTHS, tiny)
