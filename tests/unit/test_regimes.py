"""benchmarks/regimes.py: one cell planned for real, and how its rows read against the targets."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).parents[2] / "benchmarks" / "regimes.py"


@pytest.fixture(scope="module")
def regimes():
    spec = importlib.util.spec_from_file_location("regimes", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_cell_reports_a_bound_under_every_plan_of_auto_s_candidates(regimes):
    row = regimes.cell({"model": "llama-13b", "gpus": 32, "memory_gb": 80, "context": 48 * 1024, "dist": "github",
                        "zero": 3, "batch": 64, "seed": 0, "time_limit": 0.3,
                        "planners": ("flexsp", "seq1f1b", "auto")})
    assert row["cluster"] == "a800-80g-8x4"
    # FlexSP and Seq1F1B's layout are among auto's candidates: their plans are no faster than the bound
    assert row["floor_s"] <= row["bound_s"] <= min(row["auto_s"], row["flexsp_s"], row["seq1f1b_s"])
    d = regimes.derived(row)
    assert d["auto_over_bound"] == pytest.approx(row["auto_s"] / row["bound_s"])
    assert d["bound_over_floor"] >= 1.0


def _row(**times):
    return {"model": "gpt-7b", "gpus": 64, "memory_gb": 40, "context": 98304, "dist": "github", "zero": 3,
            "floor_s": 10.0, "auto_chose": "elastic_pp pp8 x sp8", **times}


def test_targets_say_which_misses_the_bound_puts_out_of_reach(regimes):
    # FlexSP at 1.6x the floor: auto's targets are 1.35x the floor and 1.3x over FlexSP (12.3 s)
    reachable = regimes.targets(_row(auto_s=14.0, flexsp_s=16.0, seq1f1b_s=17.0, bound_s=11.0))
    assert reachable.startswith("floor 1.40x > 1.35;") and "out of reach" not in reachable
    beyond = regimes.targets(_row(auto_s=14.0, flexsp_s=16.0, seq1f1b_s=17.0, bound_s=13.6))
    assert "floor 1.40x > 1.35 (out of reach: bound 1.36x)" in beyond
    assert "needs auto at 1.23x the floor, under the bound's 1.36x: out of reach" in beyond
    # Seq1F1B at 17 s: 1.2x over it needs auto at 14.17 s, 1.42x the floor
    assert "vs seq1f1b" not in beyond and "vs seq1f1b" not in reachable
    slow = regimes.targets(_row(auto_s=14.0, flexsp_s=16.0, seq1f1b_s=15.0, bound_s=13.6))
    assert "vs seq1f1b 1.07x < 1.2 (needs auto at 1.25x the floor, under the bound's 1.36x: out of reach)" in slow
    assert "vs seq1f1b 1.07x < 1.2 (needs auto at 1.25x the floor)" in regimes.targets(
        _row(auto_s=14.0, flexsp_s=16.0, seq1f1b_s=15.0, bound_s=11.0))
    assert regimes.targets(_row(auto_s=12.0, flexsp_s=16.0, seq1f1b_s=15.0, bound_s=11.0)) == "met"
    # rows of an older run, without a bound, read as before
    assert "out of reach" not in regimes.targets(_row(auto_s=14.0, flexsp_s=16.0, seq1f1b_s=17.0))
    table = regimes.markdown([_row(auto_s=14.0, flexsp_s=16.0, seq1f1b_s=17.0, bound_s=13.6)])
    assert "| bound s |" in table and "| 13.60 |" in table and "| 1.03 |" in table  # auto / bound
