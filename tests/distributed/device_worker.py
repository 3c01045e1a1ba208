"""Worker for test_device_discipline.py: 2 gloo ranks under the check mode of runtime/device.py
(the harness turns it on for every worker) show that it refuses what NCCL refuses, and that the
planning loader's broadcast and the Megatron-LM step report pass it."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dist_harness import check, preload_megatron, setup_megatron
from megatron_ext.runtime.device import CHECKED, DeviceDisciplineError, rank_device

ST: dict = {}


def preload():
    preload_megatron("megatron_ext.megatron.step", "megatron_ext.data.loader")


def setup():
    ST["pool"] = setup_megatron()


def _step():
    from megatron_ext.data.loader import Step
    from megatron_ext.planner import PlannerOptions, make_plan

    lengths = np.array([150, 40, 25, 9])
    plan = make_plan("flexsp", lengths, _two_rank_cost(), PlannerOptions(time_limit=2.0))
    return Step(step=0, plan=plan, batch=[np.arange(n) % 50 for n in lengths], lengths=lengths,
                samples=np.zeros((len(lengths), 3), int), digest="", plan_source="test", plan_wait_s=0.0)


def _two_rank_cost():
    from megatron_ext.cost import CostModel
    from megatron_ext.spec import ClusterSpec, ModelSpec

    model = ModelSpec(name="t", num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4,
                      ffn_hidden_size=64, params_b=1e-5, act_mb_per_token=0.01, a1=1e-4, a2=0.05, launch_ms=5.0)
    return CostModel(model, ClusterSpec(name="c", num_nodes=1, gpus_per_node=2, memory_gb=1.0 / 1024,
                                        a2a_bandwidth_gbps={2: 0.01}))


@check
def host_tensor_into_our_all_to_all_is_refused():
    from megatron_ext.runtime.comm import all_to_all

    group = ST["pool"].get((0, 1))
    with pytest.raises(DeviceDisciplineError, match="all_to_all_single .* host tensor"):
        all_to_all(torch.randn(2, 4), group, scatter_dim=1, gather_dim=0)  # made without a device: the host
    x = torch.randn(2, 4, device=rank_device())
    y = all_to_all(x, group, scatter_dim=1, gather_dim=0)  # on the rank's device: passes, and exchanges
    assert y.shape == (4, 2)


@check
def dtype_nccl_lacks_is_refused():
    from megatron_ext.runtime.comm import all_to_all

    with pytest.raises(DeviceDisciplineError, match="int16 .* not one NCCL carries"):
        all_to_all(torch.zeros(2, 4, dtype=torch.int16, device=rank_device()), ST["pool"].get((0, 1)),
                   scatter_dim=1, gather_dim=0)


@check
def host_split_follows_moves_and_results():
    host = torch.zeros(3)
    moved = host.to(rank_device())
    assert host.device == moved.device  # one CPU underneath, two sides in the check mode
    for t, on_host in ((host, True), (moved, False), (moved + 1, False), (host * 2, True), (moved.cpu(), True),
                       (torch.zeros(2, device=moved.device), False), (torch.from_numpy(np.ones(2)), True),
                       (torch.zeros_like(moved), False), (host.new_ones(2), True)):
        assert t.__dict__.get("_megatron_ext_on_host", False) == on_host, (t, on_host)


@check
def megatron_step_report_passes_and_takes_the_slowest_rank():
    from megatron_ext.megatron.step import report_step

    before = CHECKED["all_gather"]
    r = dist.get_rank()
    lines: list[str] = []
    args = types.SimpleNamespace(curr_iteration=0, log_interval=1, flexsp=True)
    rec = report_step(_step(), 1.0 + r, [0.5 + r, 0.25], args=args, writer=None, printer=lines.append)
    assert CHECKED["all_gather"] == before + 1
    assert rec["step_time_s"] == 2.0, rec["step_time_s"]
    assert lines and "flexsp" in lines[0]


@check
def megatron_step_report_of_a_host_tensor_is_refused():
    """The report as it was: its times in a CPU tensor, which NCCL refuses ("No backend type
    associated with device type cpu") at the end of a cluster run's first step."""
    import megatron_ext.megatron.step as step_module

    saved = step_module.rank_device
    step_module.rank_device = lambda: torch.device("cpu")  # the host, as on a GPU machine
    try:
        with pytest.raises(DeviceDisciplineError, match=r"all_gather on group \[0, 1\]: a host tensor"):
            step_module.report_step(_step(), 1.0, [0.5, 0.25], writer=None, printer=lambda line: None,
                                    args=types.SimpleNamespace(curr_iteration=0, log_interval=1, flexsp=True))
    finally:
        step_module.rank_device = saved


@check
def planning_loader_broadcast_passes():
    from megatron_ext.data.loader import broadcast_plan, check_plan_agreement, plan_digest

    before = CHECKED["broadcast_object_list"], CHECKED["all_gather_object"]
    step = _step()
    plan, source = broadcast_plan(step.plan if dist.get_rank() == 0 else None, source="solver")
    check_plan_agreement(plan_digest(plan))  # raises unless every rank got rank 0's plan
    assert source == "solver" and plan.num_gpus == 2
    assert (CHECKED["broadcast_object_list"], CHECKED["all_gather_object"]) == (before[0] + 1, before[1] + 1)
