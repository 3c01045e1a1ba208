"""The elastic pipeline runtime's programs, without processes: ``build_schedule`` turns a
pipeline of a plan into per-stage programs (ops plus batched p2p in one global order). Checked on
planner plans and on random valid and invalid orders: programs never deadlock even when every
message is a blocking rendezvous, each message is sent after the op that produces it and received
before the op that needs it, and an order is refused exactly when the simulator finds it
deadlocks."""
from __future__ import annotations

import random

import numpy as np
import pytest

from megatron_ext.cost import CostModel
from megatron_ext.cost.pipeline import PipelineCost
from megatron_ext.errors import InvalidPlanError
from megatron_ext.plan.program import (BWD, FWD, Message, PipelineSchedule, build_schedule, build_schedules,
                                       check_rendezvous, chunk_layouts)
from megatron_ext.plan.program import ProgramStep as Step
from megatron_ext.plan.schema import Chunk, Piece, Pipeline, StepPlan
from megatron_ext.spec import ClusterSpec, ModelSpec

MODEL = ModelSpec(name="t", num_layers=8, hidden_size=32, num_attention_heads=8, num_query_groups=4,
                  ffn_hidden_size=64, params_b=1e-5, act_mb_per_token=0.01, a1=1e-4, a2=0.05, launch_ms=0.5, vocab_size=97)


def _cost(gpus=8, memory_mb=0.4):
    return CostModel(MODEL, ClusterSpec(name="c", num_nodes=1, gpus_per_node=gpus, memory_gb=memory_mb / 1024,
                                        a2a_bandwidth_gbps={2: 1.0, 4: 1.0, 8: 1.0}, p2p_bandwidth_gbps=1.0))


def _pipeline(chunks, stages, orders, sp=1):
    return Pipeline(stages, sp, [Chunk(i, [Piece(*x) for x in c]) for i, c in enumerate(chunks)], orders)


def check_program_invariants(s: PipelineSchedule) -> None:
    P = s.stages
    sends, recvs = {}, {}
    for p, prog in enumerate(s.programs):
        assert prog[-1].op is None and all(st.op is not None for st in prog[:-1])
        done = set()
        for st in prog:
            idx = [m.index for m, _ in st.comm]
            assert idx == sorted(idx), "a batch is not in global order"
            for m, role in st.comm:
                if role == "send":
                    assert m.src == p and m.index not in sends
                    sends[m.index] = p
                    producer = (FWD if m.kind == "act" else BWD, m.chunk)
                    assert producer in done, f"stage {p} sends {m} before running {producer}"
                else:
                    assert m.dst == p and m.index not in recvs
                    recvs[m.index] = p
            if st.op is not None:
                kind, c = st.op
                if kind == FWD and p > 0 or kind == BWD and p < P - 1:
                    need = ("act" if kind == FWD else "grad", c)
                    got = {(m.kind, m.chunk) for q in prog[:prog.index(st) + 1] for m, r in q.comm if r == "recv"}
                    assert need in got, f"stage {p} runs {kind}{c} before receiving {need}"
                done.add(st.op)
    n = len(s.chunks)
    assert len(s.messages) == 2 * (P - 1) * n == len(sends) == len(recvs)
    for m in s.messages:
        assert abs(m.src - m.dst) == 1 and (m.dst == m.src + 1) == (m.kind == "act")
    check_rendezvous(s)


def _random_chunking(rng: random.Random, n_seqs: int):
    lengths = [rng.randint(1, 60) for _ in range(n_seqs)]
    pieces = []
    for sid, L in enumerate(lengths):
        k = rng.choice([1, 1, 2, 3]) if L >= 3 else 1
        cuts = sorted(rng.sample(range(1, L), k - 1)) if k > 1 else []
        pieces.append([(sid, a, b) for a, b in zip([0] + cuts, cuts + [L])])
    chunks: list[list] = []
    queue = [list(p) for p in pieces]
    while any(queue):  # chunks take the next piece of 1-3 sequences, keeping slice order
        live = [q for q in queue if q]
        pick = rng.sample(live, min(len(live), rng.randint(1, 3)))
        chunks.append([q.pop(0) for q in pick])
    return lengths, chunks


def _random_valid_orders(chunks, stages, rng):
    """Per-stage orders of a random execution that respects every dependency."""
    n = len(chunks)
    prev, nxt, last = {}, {}, {}
    for i, c in enumerate(chunks):
        for sid, _, _ in c:
            if sid in last:
                prev.setdefault(i, []).append(last[sid])
                nxt.setdefault(last[sid], []).append(i)
            last[sid] = i
    done, orders = set(), [[] for _ in range(stages)]
    while len(done) < 2 * n * stages:
        ready = [(k, p, c) for p in range(stages) for c in range(n) for k in "FB" if (k, p, c) not in done and (
            (k == "F" and (p == 0 or ("F", p - 1, c) in done) and all(("F", p, j) in done for j in prev.get(c, [])))
            or (k == "B" and ("F", p, c) in done and (p == stages - 1 or ("B", p + 1, c) in done)
                and all(("B", p, j) in done for j in nxt.get(c, []))))]
        op = rng.choice(ready)
        done.add(op)
        orders[op[1]].append(f"{op[0]}{op[2]}")
    return orders


@pytest.mark.parametrize("pp,sp,memory", [(2, 4, 4.0), (2, 4, 0.25), (4, 2, 0.4), (8, 1, 0.3), (8, 1, 4.0)])
def test_planner_plans_give_deadlock_free_programs(pp, sp, memory):
    from megatron_ext.planner.pp.elastic_pp import plan_elastic_pp

    rng = np.random.default_rng(pp * 10 + sp)
    lengths = np.concatenate([rng.integers(3, 30, 8), rng.integers(100, 200, 2)])
    plan = plan_elastic_pp(lengths, _cost(memory_mb=memory), pp=pp, sp=sp, granularity=8, min_slice_tokens=16,
                           time_limit=1.0)
    for s in build_schedules(plan, lengths, pp, sp, MODEL.num_layers // pp):
        check_program_invariants(s)
        # the programs run each stage's ops in the plan's order
        for p, prog in enumerate(s.programs):
            got = [f"{k}{c}" for k, c in (st.op for st in prog if st.op)]
            pipe = next(x for x in plan.pipelines if set(s.chunks) == {c.id for c in x.chunks})
            assert got == pipe.order_per_stage[p]


def test_random_valid_orders_give_deadlock_free_programs():
    rng = random.Random(0)
    for trial in range(150):
        lengths, chunks = _random_chunking(rng, rng.randint(1, 5))
        P = rng.choice([1, 2, 3, 4, 6])
        orders = _random_valid_orders(chunks, P, rng)
        check_program_invariants(build_schedule(_pipeline(chunks, P, orders), lengths))


def _deadlocks(orders, table, P: int) -> bool:
    """By the dependencies alone, apart from any scheduler: each stage runs its ops in its order,
    an F once the previous stage's F of the chunk and the chunk's earlier slices' F here are done,
    a B once the next stage's B of the chunk and its later slices' B here are done. Running a ready
    op never blocks another, so the order deadlocks iff this stops short."""
    done, at = set(), [0] * P

    def ready(kind: str, k: int, p: int) -> bool:
        if kind == "F":
            return (p == 0 or ("F", k, p - 1) in done) and all(("F", j, p) in done for j in table.fwd_pred[k])
        return (p == P - 1 or ("B", k, p + 1) in done) and all(("B", j, p) in done for j in table.bwd_pred[k])

    moved = True
    while moved:
        moved = False
        for p in range(P):
            while at[p] < len(orders[p]) and ready(orders[p][at[p]][0], int(orders[p][at[p]][1:]), p):
                done.add((orders[p][at[p]][0], int(orders[p][at[p]][1:]), p))
                at[p] += 1
                moved = True
    return any(a < len(o) for a, o in zip(at, orders))


def test_refusal_agrees_with_the_simulator():
    """Random per-stage orders (each chunk's F before its B, otherwise shuffled): the runtime
    refuses exactly the orders the simulator's list scheduler finds deadlocking, and those are the
    orders that deadlock by their dependencies alone (``_deadlocks``)."""
    from megatron_ext.plan.program import list_schedule, parse_order
    from megatron_ext.sim.engine import analyze_chunks, op_times

    rng = random.Random(1)
    refused = accepted = 0
    for trial in range(300):
        lengths, chunks = _random_chunking(rng, rng.randint(1, 4))
        P = rng.choice([1, 2, 3, 4])
        n = len(chunks)
        orders = []
        for _ in range(P):
            ops = [f"F{k}" for k in range(n)] + [f"B{k}" for k in range(n)]
            rng.shuffle(ops)
            for k in range(n):  # keep F before B
                i, j = ops.index(f"F{k}"), ops.index(f"B{k}")
                if j < i:
                    ops[i], ops[j] = ops[j], ops[i]
            orders.append(ops)
        pipe = _pipeline(chunks, P, orders)
        pc = PipelineCost(_cost(), P if MODEL.num_layers % P == 0 else 1, 1)
        table = analyze_chunks(pipe.chunks, pc)
        fwd, bwd, _, p2p = op_times(table, pc, np.zeros((P, n)))
        bwd = np.broadcast_to(bwd[:1], (P, n))
        try:
            list_schedule(parse_order(orders, table, P), fwd, bwd, p2p, table.fwd_pred, table.bwd_pred)
            sim_ok = True
        except InvalidPlanError:
            sim_ok = False
        try:
            s = build_schedule(pipe, lengths)
            ok = True
        except InvalidPlanError as e:
            assert "deadlock" in str(e)
            ok = False
        assert table.ids == list(range(n))  # (op names are chunk indices)
        assert ok == sim_ok == (not _deadlocks(orders, table, P)), (orders, chunks)
        if ok:
            check_program_invariants(s)
            accepted += 1
        else:
            refused += 1
    assert refused > 30 and accepted > 30, (refused, accepted)


def test_rendezvous_checker_catches_naive_programs():
    """The order that shows why messages follow one global order: stage 1 runs the forwards in
    the reverse order. Eager send after each op / receive right before each op, both blocking,
    deadlocks; the derived programs do not."""
    chunks, lengths = [[(0, 0, 5)], [(1, 0, 5)]], [5, 5]
    orders = [["F0", "F1", "B1", "B0"], ["F1", "F0", "B0", "B1"]]
    s = build_schedule(_pipeline(chunks, 2, orders), lengths)
    check_program_invariants(s)
    a0, a1, g0, g1 = (Message(i, k, c, src, dst) for i, (k, c, src, dst) in
                      enumerate([("act", 0, 0, 1), ("act", 1, 0, 1), ("grad", 0, 1, 0), ("grad", 1, 1, 0)]))
    naive = PipelineSchedule(2, 1, s.chunks, [], [a0, a1, g0, g1], [
        [Step((), (FWD, 0)), Step(((a0, "send"),), (FWD, 1)), Step(((a1, "send"), (g1, "recv")), (BWD, 1)),
         Step(((g0, "recv"),), (BWD, 0)), Step((), None)],
        [Step(((a1, "recv"),), (FWD, 1)), Step(((a0, "recv"),), (FWD, 0)), Step((), (BWD, 0)),
         Step(((g0, "send"),), (BWD, 1)), Step(((g1, "send"),), None)],
    ])
    with pytest.raises(InvalidPlanError, match="deadlock"):
        check_rendezvous(naive)


# (a malformed order, and a forward out of slice order, are refused alike by every layer: test_plan_program.py)
@pytest.mark.parametrize("mutate,match", [
    (lambda p: p.chunks[0].pieces.append(Piece(0, 3, 5)), "two pieces of sequence 0"),
    (lambda p: p.chunks[1].pieces.__setitem__(0, Piece(0, 4, 9)), "do not tile"),
    (lambda p: p.chunks[1].pieces.__setitem__(0, Piece(0, 5, 8)), "end at 8"),
    (lambda p: p.chunks[0].pieces.__setitem__(0, Piece(0, 0, 99)), "outside its sequence"),
    (lambda p: p.chunks[0].pieces.__setitem__(0, Piece(0, 0, 2 ** 70)), r"piece 0\[0:1180591620717411303424\] is"),
    (lambda p: p.chunks[0].pieces.__setitem__(0, Piece(0, 3, 3)), "outside its sequence"),
    (lambda p: p.chunks[0].pieces.__setitem__(0, Piece(True, 0, 5)), "must be integers"),
    (lambda p: setattr(p.chunks[1], "id", 0), "unique"),
    (lambda p: setattr(p.chunks[0], "recompute_layers_per_stage", [1]), "recompute_layers_per_stage must be 2"),
    (lambda p: setattr(p.chunks[0], "recompute_layers_per_stage", [5, 0]), "recompute_layers_per_stage must be 2"),
    # (stage 1 runs a backward out of slice order)
    (lambda p: setattr(p, "order_per_stage", [["F0", "F1", "B1", "B0"], ["F0", "F1", "B0", "B1"]]), "deadlocks"),
])
def test_malformed_pipelines_are_refused(mutate, match):
    pipe = _pipeline([[(0, 0, 5)], [(0, 5, 10)]], 2, [["F0", "F1", "B1", "B0"], ["F0", "F1", "B1", "B0"]])
    build_schedule(pipe, [10], layers_per_stage=4)
    mutate(pipe)
    with pytest.raises(InvalidPlanError, match=match):
        build_schedule(pipe, [10], layers_per_stage=4)


def test_numpy_integers_lay_out_as_python_ints():
    pipe = _pipeline([[(0, 0, 5), (1, 0, 3)], [(0, 5, 10)]], 2, [["F0", "F1", "B1", "B0"]] * 2)
    pipe.chunks[0].id = np.int64(0)
    pipe.chunks[0].pieces[1] = Piece(np.int32(1), np.int64(0), np.int64(3))
    layouts = chunk_layouts(pipe, np.array([10, 3]), 4)
    assert {k: (v.seq_ids, v.starts, v.lengths, v.continues) for k, v in layouts.items()} == {
        0: ((0, 1), (0, 0), (5, 3), (True, False)), 1: ((0,), (5,), (5,), (False,))}
    assert all(type(x) is int for v in layouts.values() for x in v.seq_ids + v.starts + v.lengths)


def test_plan_level_refusals():
    good = _pipeline([[(0, 0, 5)]], 2, [["F0", "B0"]] * 2, sp=2)
    with pytest.raises(InvalidPlanError, match="elastic_pp plans, not 'flexsp'"):
        build_schedules(StepPlan("flexsp", 4), [5], 2, 2)
    with pytest.raises(InvalidPlanError, match="the plan has 2 stages, the runtime runs 4"):
        build_schedules(StepPlan("elastic_pp", 4, pipelines=[good]), [5], 4, 1)
    with pytest.raises(InvalidPlanError, match="SP degree is 2"):
        build_schedules(StepPlan("elastic_pp", 4, pipelines=[good]), [5], 2, 4)
    split = [_pipeline([[(0, 0, 2)]], 2, [["F0", "B0"]] * 2, sp=2), _pipeline([[(0, 2, 5)]], 2, [["F0", "B0"]] * 2, sp=2)]
    with pytest.raises(InvalidPlanError, match="do not tile|end at"):
        build_schedules(StepPlan("elastic_pp", 4, pipelines=split), [5], 2, 2)
