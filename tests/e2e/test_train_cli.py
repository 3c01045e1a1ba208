"""`megatron-ext train` end to end: real training on 4 CPU ranks (torchrun + gloo) with per-step
plans. Two launches: flexsp and static_ulysses on the same seed must report the same loss and
grad norm at every step (one function computed, whatever the layout)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "megatron_ext.cli"]
ARGS = ["train", "--steps", "3", "--global-batch", "6", "--max-seq-len", "2048", "--seed", "7", "--json"]


def _train(planner: str) -> list[dict]:
    done = subprocess.run([*CLI, *ARGS, "--planner", planner], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def runs():
    return {p: _train(p) for p in ("flexsp", "static_ulysses")}


def test_records_have_the_contract_keys(runs):
    for recs in runs.values():
        assert [r["step"] for r in recs] == [0, 1, 2]
        for r in recs:
            for key in ("step", "loss", "grad_norm", "tokens", "step_time_s", "predicted_step_time_s", "degrees"):
                assert key in r
            assert r["tokens"] > 0 and r["step_time_s"] > 0 and r["loss"] > 0


def test_same_loss_and_grad_norm_every_step(runs):
    a, b = runs["flexsp"], runs["static_ulysses"]
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) / y["loss"] < 1e-4, (x, y)
        assert abs(x["grad_norm"] - y["grad_norm"]) / y["grad_norm"] < 1e-4, (x, y)
    assert a[-1]["loss"] < a[0]["loss"], "three steps of Adam should lower the loss"


def test_static_ulysses_uses_only_its_degree(runs):
    assert all(r["degrees"] == [4] for r in runs["static_ulysses"])


def test_bad_option_is_one_line_error():
    done = subprocess.run([*CLI, "train", "--no-such-flag"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().startswith("megatron-ext: error:") and "Traceback" not in done.stderr
