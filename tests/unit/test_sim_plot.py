"""--plot: the drawing data of known plans (boxes, memory curves), the files, the CLI flags."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from megatron_ext.cost import CostModel
from megatron_ext.cost.pipeline import PipelineCost
from megatron_ext.plan import StepPlan
from megatron_ext.planner import make_plan
from megatron_ext.planner.pipeline import build_pipeline, plan_elastic_pp
from megatron_ext.sim import simulate
from megatron_ext.sim.plot import PACKED_COLOR, plot_comparison, plot_data, plot_plan

COST = CostModel.from_presets("llama-13b", "a800-80g-8x4")
PNG = b"\x89PNG\r\n\x1a\n"


def _pipeline_plan(recompute: str):
    """Two stages x SP 16 of llama-7b on 32 GPUs; chunks: two slices of sequence 0 (the second with
    sequence 1), and sequence 2 alone."""
    cost = CostModel.from_presets("llama-7b", "a800-80g-8x4")
    pc = PipelineCost(cost, 2, 16)
    lengths = np.array([20000, 3000, 5000])
    built = build_pipeline([[(0, 0, 12000)], [(0, 12000, 20000), (1, 0, 3000)], [(2, 0, 5000)]], pc, recompute)
    plan = StepPlan(kind="elastic_pp", num_gpus=32, planner="test", pipelines=[built.to_pipeline(pc)])
    return cost, lengths, plan


def test_pipeline_boxes_of_a_known_plan():
    cost, lengths, plan = _pipeline_plan("none")
    data = plot_data(plan, lengths, cost)
    n, P = 3, 2
    assert data.kind == "elastic_pp" and data.rows == P
    assert data.count("F") == n * P and data.count("B") == n * P and data.count("R") == 0
    # every chunk's F and B once per stage, on its stage's row, inside the step
    for kind in "FB":
        labels = sorted((b.row, b.label) for b in data.boxes if b.kind == kind)
        assert labels == sorted((p, f"{kind}{c}") for p in range(P) for c in range(n))
    assert all(0 <= b.start_s < b.end_s <= data.step_time_s + 1e-9 for b in data.boxes)
    # colours: the chunks holding slices of sequence 0 share its colour; sequence 2 alone is "packed"
    keys = {b.label: b.key for b in data.boxes if b.row == 0}
    assert keys["F0"] == keys["F1"] == keys["B1"] == 0 and keys["F2"] is None
    assert data.colors[None] == PACKED_COLOR
    # the stage rows never overlap in time
    for p in range(P):
        spans = sorted((b.start_s, b.end_s) for b in data.boxes if b.row == p and b.kind in "FB")
        assert all(b0 >= e1 - 1e-9 for (_, e1), (b0, _) in zip(spans, spans[1:]))
    # memory: one curve per stage, peaking where the simulator says
    res = simulate(plan, lengths, cost)
    assert len(data.memory) == P
    for (_, t, gb), peak in zip(data.memory, res.peak_memory_mb):
        assert gb.max() * 1024 == pytest.approx(peak, rel=1e-9)
        assert (np.diff(t) >= -1e-12).all() and t[-1] == pytest.approx(data.step_time_s)
    assert "bubble" in data.title and f"{data.step_time_s:.2f} s" in data.title


def test_recompute_boxes():
    cost, lengths, plan = _pipeline_plan("full")  # every layer of every chunk recomputed on every stage
    data = plot_data(plan, lengths, cost)
    assert data.count("R") == 3 * 2 and data.count("B") == 3 * 2
    for r in (b for b in data.boxes if b.kind == "R"):  # a recompute box ends where its backward starts
        b = next(x for x in data.boxes if x.kind == "B" and x.row == r.row and x.label[1:] == r.label[1:])
        assert r.end_s == pytest.approx(b.start_s)


def test_flexsp_boxes_are_groups():
    lengths = np.array([60000, 20000, 9000, 3000, 3000, 800, 500, 100])
    plan = make_plan("flexsp", lengths, COST)
    data = plot_data(plan, lengths, COST)
    assert data.kind == "flexsp" and data.rows == COST.num_gpus
    groups = [g for mb in plan.micro_batches for g in mb.groups]
    assert data.count("G") == len(groups)
    assert sorted(b.height for b in data.boxes) == sorted(g.degree for g in groups)
    assert {b.key for b in data.boxes} <= set(data.colors)
    assert len(data.marks) == len(plan.micro_batches)
    assert data.memory[0][2].max() * 1024 == pytest.approx(simulate(plan, lengths, COST).max_peak_memory_mb)


def test_files_are_written(tmp_path):
    cost, lengths, plan = _pipeline_plan("greedy")
    out = tmp_path / "pipe.png"
    plot_plan(plan, lengths, cost, out)
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 10_000
    lengths = np.array([30000, 9000, 4000, 1000, 500, 500])
    flex = make_plan("flexsp", lengths, COST)
    plot_plan(flex, lengths, COST, tmp_path / "flex.png")
    assert (tmp_path / "flex.png").read_bytes()[:8] == PNG
    pipe = plan_elastic_pp(lengths, COST, 4, 8, time_limit=0.3)
    summary = [{"planner": "elastic_pp", "step_time_s": pipe.estimated_step_time_s, "bubble_ratio": 0.1},
               {"planner": "flexsp", "step_time_s": flex.estimated_step_time_s, "bubble_ratio": 0.0},
               {"planner": "seq1f1b", "error": "infeasible"}]
    plot_comparison(pipe, lengths, COST, summary, "elastic_pp", tmp_path / "cmp.png", "test batch")
    assert (tmp_path / "cmp.png").read_bytes()[:8] == PNG


def test_cli_plot_flags(tmp_path, capsys):
    from megatron_ext import cli

    base = ["--model", "llama-13b", "--cluster", "a800-80g-8x4", "--dist", "github", "--batch", "48",
            "--max-seq-len", "32K", "--no-baselines", "--time-limit", "0.3"]
    for planner in ("elastic_pp", "flexsp", "auto"):
        out = tmp_path / f"{planner}.png"
        assert cli.main(["plan", "--planner", planner, "--plot", str(out), *base]) == 0
        assert out.read_bytes()[:8] == PNG
        assert f"plot written to {out}" in capsys.readouterr().err
    out = tmp_path / "sim.png"
    assert cli.main(["simulate", "--model", "llama-7b", "--cluster", "a800-80g-8x1", "--dist", "github",
                     "--batch", "16", "--steps", "1", "--max-seq-len", "16K", "--pp", "2", "--sp", "4",
                     "--planners", "elastic_pp,flexsp", "--time-limit", "0.3", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG
    # an unwritable path is one line on stderr, exit status 2
    bad = tmp_path / "missing-dir" / "x.png"
    assert cli.main(["plan", "--planner", "elastic_pp", "--plot", str(bad), *base]) == 2
    assert "cannot write the plot" in capsys.readouterr().err


def test_plot_refuses_unknown_kinds():
    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot plot"):
        plot_data(StepPlan(kind="other", num_gpus=32), np.array([1]), COST, result=argparse.Namespace(events=[1]))
