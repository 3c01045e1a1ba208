"""Worker for test_train_step.py: 4 gloo ranks run whole training steps through the runtime
(megatron DDP + optimizer + megatron's schedule with FlexSP micro-batches) and compare them with
one process running every sequence alone through megatron's stock GPTModel."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from dist_harness import check, model_and_reference, preload_megatron, setup_megatron

ST: dict = {}
SEQ_LEN = 512


def preload():
    preload_megatron("megatron_ext.runtime.schedule", "megatron_ext.runtime.pipeline", "megatron_ext.runtime.train")


def setup():
    ST["pool"] = setup_megatron()


def _cost():
    """A 4-rank cluster whose memory forces long sequences onto SP groups of degree 2 and 4."""
    from megatron_ext.cost import CostModel
    from megatron_ext.spec import ClusterSpec, ModelSpec

    model = ModelSpec(name="t", num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4,
                      ffn_hidden_size=64, params_b=1e-5, act_mb_per_token=0.01, a1=1e-4, a2=0.05, launch_ms=5.0)
    cluster = ClusterSpec(name="c", num_nodes=1, gpus_per_node=4, memory_gb=1.2 / 1024,
                          a2a_bandwidth_gbps={2: 0.01, 4: 0.01})  # costly all-to-all: degree 1 where it fits
    return CostModel(model, cluster)


def _models():
    if "models" not in ST:
        from megatron_ext.runtime.train import build_optimizer

        ddp, reference = model_and_reference(_cost().model, vocab_size=97, max_seq_len=SEQ_LEN)
        ST["models"] = ddp, reference, build_optimizer(ddp, lr=1e-3)
    return ST["models"]


def _step(planner: str, seed: int, lengths=None, plan=None):
    """A random length mix (some over one rank's memory), planned once on rank 0 and broadcast;
    or the ``lengths`` and ``plan`` given, with random tokens."""
    from megatron_ext.data.loader import Step
    from megatron_ext.planner import PlannerOptions, make_plan

    rng = np.random.default_rng(seed)
    if lengths is None:
        lengths = np.concatenate([rng.integers(2, 60, 9), rng.integers(120, 400, 3)])
    batch = [rng.integers(0, 97, n) for n in lengths]
    box = [plan or make_plan(planner, lengths, _cost(), PlannerOptions(time_limit=5.0)) if dist.get_rank() == 0
           else None]
    dist.broadcast_object_list(box, src=0)
    return Step(step=0, plan=box[0], batch=batch, lengths=lengths, samples=np.zeros((len(lengths), 3), int),
                digest="", plan_source="test", plan_wait_s=0.0)


def _reference_grads(reference, step):
    """Per-token loss over the whole batch, every sequence alone through megatron's attention."""
    reference.zero_grad()
    total, count = 0.0, 0
    for seq in step.batch:
        tokens = torch.from_numpy(seq)
        losses = reference(tokens[None, :-1], torch.arange(len(seq) - 1)[None], None, labels=tokens[None, 1:])
        total = total + losses.sum()
        count += len(seq) - 1
    (total / count).backward()
    return float(total / count), {n: p.grad.clone() for n, p in reference.named_parameters()}


def _run(planner: str, seed: int, **given):
    from megatron_ext.runtime.schedule import forward_backward_flexsp

    ddp, reference, _ = _models()
    step = _step(planner, seed, **given)
    ddp.zero_grad_buffer()
    losses, _ = forward_backward_flexsp(step, ddp, ST["pool"], pad_id=0)
    total = torch.stack([d["lm loss"] for d in losses]).sum(0)
    dist.all_reduce(total)
    ref_loss, ref_grads = _reference_grads(reference, step)
    degrees = {g.degree for mb in step.plan.micro_batches for g in mb.groups}
    errors = []
    if not np.isclose(float(total[0] / total[1]), ref_loss, rtol=1e-5):
        errors.append(f"loss {float(total[0] / total[1])} vs reference {ref_loss}")
    for name, p in ddp.module.named_parameters():
        try:
            torch.testing.assert_close(p.main_grad, ref_grads[name], atol=2e-6, rtol=1e-4)
        except AssertionError as e:
            errors.append(f"{name}: {e}")
    assert not errors, f"{planner} plan with degrees {sorted(degrees)}: " + "\n".join(errors[:4])
    return degrees


@check
def flexsp_step_matches_single_process():
    degrees = _run("flexsp", seed=1)
    assert len(degrees) > 1, f"the test batch should need mixed degrees, got {degrees}"


@check
def static_ulysses_step_matches_single_process():
    _run("static_ulysses", seed=2)


@check
def batchada_step_matches_single_process():
    _run("batchada", seed=3)


@check
def barrier_free_step_matches_single_process():
    """No barrier between micro-batches: ranks 0-1 run one pass of degree 2, ranks 2 and 3 three
    passes each alone (ranks 0-1 idle through the last two), then the gradients sync."""
    import dataclasses

    from megatron_ext.plan import MicroBatchPlan, SPGroup, StepPlan, fill_estimates, validate

    lengths = np.array([200, 50, 30, 40, 20, 60, 10, 45, 15])
    passes = [[([0, 1], [0]), ([2], [1]), ([3], [5])], [([2], [2, 3]), ([3], [6])], [([2], [4]), ([3], [7, 8])]]
    plan = StepPlan("flexsp", 4, "timelines", [MicroBatchPlan([SPGroup(r, ids) for r, ids in mb]) for mb in passes],
                    barrier_free=True)
    cost = dataclasses.replace(_cost(), zero_stage=2)  # (barrier-free plans need ZeRO 0/1/2)
    validate(fill_estimates(plan, lengths, cost), lengths, cost)
    assert _run("timelines", seed=5, lengths=lengths, plan=plan) == {1, 2}


@check
def optimizer_step_runs_and_changes_weights():
    from megatron_ext.runtime.schedule import forward_backward_flexsp

    ddp, _, optimizer = _models()
    before = [p.detach().clone() for p in ddp.module.parameters()]
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward_flexsp(_step("flexsp", seed=4), ddp, ST["pool"], pad_id=0)
    ok, grad_norm, _ = optimizer.step()
    assert ok and np.isfinite(grad_norm) and grad_norm > 0
    changed = [not torch.equal(a, p) for a, p in zip(before, ddp.module.parameters())]
    assert all(changed), f"{changed.count(False)} parameters did not change"
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [float(p.detach().sum()) for p in ddp.module.parameters()])
    assert all(g == gathered[0] for g in gathered), "ranks diverged after the optimizer step"


@check
def flexsp_steps_ran_under_nccl_rules():
    """The steps above ran in the check mode (runtime/device.py): their Ulysses all-to-alls were checked."""
    from megatron_ext.runtime.device import CHECKED

    assert CHECKED["all_to_all_single"] > 0, dict(CHECKED)
