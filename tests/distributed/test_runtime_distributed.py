"""FlexSP runtime on 4 gloo CPU ranks, one launch: the SP group pool, Ulysses attention (outputs
and q/k/v gradients) against a single-process reference at degrees 1, 2, 4 with GQA, RoPE at true
positions, and a whole GPTModel against megatron's own attention run one sequence at a time.
The checks live in ulysses_worker.py; each is reported here as its own test."""
from __future__ import annotations

from pathlib import Path

import pytest

from dist_harness import assert_check, check_names, launch

WORKER = Path(__file__).with_name("ulysses_worker.py")
NAMES = check_names(WORKER)


@pytest.fixture(scope="module")
def results():
    return launch(WORKER, nprocs=4)


@pytest.mark.parametrize("name", NAMES)
def test_four_ranks(results, name):
    assert_check(results, name)


def test_every_check_reported(results):
    assert set(NAMES) <= set(results), sorted(set(NAMES) - set(results))
