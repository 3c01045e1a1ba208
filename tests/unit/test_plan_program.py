"""plan/program.py is the one parser, list scheduler and deadlock message of pipeline orders:
plan validation, the simulator and the pipeline runtime refuse a bad order with the same words;
runtime.forward_backward dispatches a step by its plan's kind."""
from __future__ import annotations

import numpy as np
import pytest

from megatron_ext.cost import CostModel
from megatron_ext.data.sharding import IGNORE_INDEX, model_labels, next_token_labels
from megatron_ext.errors import InvalidPlanError
from megatron_ext.plan import Chunk, Piece, Pipeline, StepPlan, validate_pipelines
from megatron_ext.plan.program import BWD, FWD, OpKind, build_schedule, op_name, padded_buffer_length
from megatron_ext.sim import simulate

COST = CostModel.from_presets("llama-13b", "a800-80g-8x2")
LENGTHS = np.array([1000])


def _plan(order):
    chunks = [Chunk(0, [Piece(0, 0, 600)]), Chunk(1, [Piece(0, 600, 1000)])]
    return StepPlan(kind="elastic_pp", num_gpus=16, planner="test", pipelines=[Pipeline(2, 8, chunks, order)])


def _refusals(order) -> list[str]:
    plan = _plan(order)
    out = []
    for check in (lambda: validate_pipelines(plan, LENGTHS, COST), lambda: simulate(plan, LENGTHS, COST),
                  lambda: build_schedule(plan.pipelines[0], LENGTHS, where="pipeline 0")):
        with pytest.raises(InvalidPlanError) as e:
            check()
        out.append(str(e.value))
    return out


@pytest.mark.parametrize("order, match", [
    ([["F0", "F1", "B1"], ["F0", "F1", "B1", "B0"]], "pipeline 0, stage 0: B0 appears 0 times (missing B0"),
    ([["F0", "F1", "B1", "B0", "F0"], ["F0", "F1", "B1", "B0"]], "pipeline 0, stage 0: F0 appears 2 times"),
    ([["F0", "F1", "B1", "B7"], ["F0", "F1", "B1", "B0"]], "pipeline 0, stage 0: operation B7 names no chunk"),
    ([["F0", "F1", "B1", "X0"], ["F0", "F1", "B1", "B0"]], "pipeline 0, stage 0: operation 'X0' is not"),
    ([["F0", "F1", "B1", "B0"]], "pipeline 0: order_per_stage has 1 lists for 2 stages"),
])
def test_every_layer_refuses_a_malformed_order_with_the_same_message(order, match):
    msgs = _refusals(order)
    assert msgs[0] == msgs[1] == msgs[2], msgs
    assert msgs[0].startswith(match)


def test_simulator_and_runtime_report_a_deadlock_alike():
    plan = _plan([["F1", "F0", "B1", "B0"], ["F0", "F1", "B1", "B0"]])  # slice 1 before slice 0
    with pytest.raises(InvalidPlanError) as sim:
        simulate(plan, LENGTHS, COST)
    with pytest.raises(InvalidPlanError) as run:
        build_schedule(plan.pipelines[0], LENGTHS, where="pipeline 0")
    assert str(sim.value) == str(run.value)
    assert str(sim.value).startswith("pipeline 0: the operation order deadlocks: stage 0 cannot run F1 (operation 0 of "
                                     "its order): it waits for F0 on stage 0")


def test_ops_print_as_their_names_and_compare_as_ints():
    assert (FWD, BWD) == (0, 1) and (OpKind.F, OpKind.B) == (FWD, BWD)
    assert f"{OpKind.B}{3}" == op_name(BWD, 3) == "B3" and (OpKind.F, 2) in {(FWD, 2)}
    s = build_schedule(_plan([["F0", "F1", "B1", "B0"]] * 2).pipelines[0], LENGTHS)
    assert [op_name(*st.op) for st in s.program(1) if st.op] == ["F0", "F1", "B1", "B0"]
    # the last stage receives each activation before its forward, sends each gradient once it has it
    assert s.describe(1).splitlines() == ["[recv act0<-0] F0", "[recv act1<-0] F1", "B1", "[send grad1->0] B0",
                                          "[send grad0->0] (end)"]
    assert s.chunks[1].padded(8) == padded_buffer_length(400, 8) == 400 and padded_buffer_length(401, 8) == 408


def test_one_label_rule():
    seq = np.array([5, 6, 7, 8])
    assert next_token_labels(seq, 0, 4).tolist() == [6, 7, 8, IGNORE_INDEX]
    assert next_token_labels(seq, 1, 2).tolist() == [7, 8]  # a cut inside the sequence keeps its labels
    labels, mask = model_labels(np.array([6, IGNORE_INDEX]))
    assert labels.tolist() == [6, 0] and mask.tolist() == [1.0, 0.0] and mask.dtype == np.float32


def test_forward_backward_dispatches_on_the_plan_kind():
    from megatron_ext.data.loader import Step
    from megatron_ext.runtime import forward_backward

    def step(kind):
        return Step(0, StepPlan(kind=kind, num_gpus=1), [np.arange(3)], np.array([3]), np.zeros((1, 3)), "", "", 0.0)

    with pytest.raises(InvalidPlanError, match="unknown plan kind 'bogus'"):
        forward_backward(step("bogus"), model=None)
    with pytest.raises(ValueError, match="SP group pool"):
        forward_backward(step("flexsp"), model=None)


def _replayed_ms(schedule, pipe, pc) -> float:
    """The programs run with the simulator's op and transfer times, as gloo runs them: a step
    posts its messages, waits for each of its receives (the sender's post, then the transfer),
    then runs its op; a send never blocks."""
    import numpy as np

    from megatron_ext.plan.program import FWD
    from megatron_ext.sim.engine import analyze_chunks, op_times

    table = analyze_chunks(pipe.chunks, pc)
    index = table.index()
    rec = np.array([[c.recompute_layers_per_stage[p] if c.recompute_layers_per_stage else 0 for c in pipe.chunks]
                    for p in range(pc.pp)])
    fwd, bwd, _, p2p = op_times(table, pc, rec)
    fwd = np.broadcast_to(fwd, bwd.shape)
    programs, posted, free, at = schedule.programs, {}, [0.0] * pc.pp, [0] * pc.pp
    while any(a < len(prog) for a, prog in zip(at, programs)):
        moved = False
        for p, prog in enumerate(programs):
            while at[p] < len(prog):
                st = prog[at[p]]
                for m, role in st.comm:
                    posted.setdefault((m.index, role), free[p])
                recvs = [m for m, role in st.comm if role == "recv"]
                if any((m.index, "send") not in posted for m in recvs):
                    break
                t = max([free[p]] + [max(posted[(m.index, "send")], posted[(m.index, "recv")]) + p2p[index[m.chunk]]
                                     for m in recvs])
                if st.op is not None:
                    kind, c = st.op
                    t += (fwd if kind == FWD else bwd)[p, index[c]]
                free[p], at[p], moved = t, at[p] + 1, True
        assert moved, "the programs deadlocked"
    return max(free) + pc.step_sync_ms


def test_simulated_op_times_run_the_programs_as_the_simulator_times_the_step():
    """The runtime's programs place their messages by op times: with ``default_op_time``'s
    (relative, no fixed costs) a stage's step waits on receives its next op does not need, and
    the step, replayed with the simulator's own times, ran 20% past the simulated one; built on
    the simulator's times (``sim.simulated_op_times``, what the runtime passes) it matches."""
    import numpy as np

    from megatron_ext.cost import CostModel
    from megatron_ext.cost.pipeline import PipelineCost
    from megatron_ext.data.lengths import sample_lengths
    from megatron_ext.plan.program import build_schedules
    from megatron_ext.planner.pp.elastic_pp import plan_elastic_pp
    from megatron_ext.sim import simulate, simulated_op_times

    cost = CostModel.from_presets("llama-7b", "h100-80g-8x4", 1)
    lengths = np.minimum(sample_lengths("github", 256, 0), 131072)
    plan = plan_elastic_pp(lengths, cost, 4, 8, time_limit=0.5)
    pipe, pc = plan.pipelines[0], PipelineCost(cost, 4, 8)
    simulated = simulate(plan, lengths, cost, events=False).step_time_s * 1e3
    ours, = build_schedules(plan, lengths, 4, 8, pc.layers_per_stage, op_time_of=simulated_op_times(cost))
    relative, = build_schedules(plan, lengths, 4, 8, pc.layers_per_stage)
    assert len(plan.pipelines) == 1 and _replayed_ms(ours, pipe, pc) == pytest.approx(simulated, rel=0.01)
    assert _replayed_ms(relative, pipe, pc) > 1.05 * simulated
