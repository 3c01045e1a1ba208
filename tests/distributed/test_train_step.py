"""Whole FlexSP training steps on 4 gloo ranks (one launch) equal one process: loss and every
parameter gradient after megatron's gradient reduction, for flexsp and baseline plans. The checks
live in train_worker.py; each is reported here as its own test."""
from __future__ import annotations

from pathlib import Path

import pytest

from dist_harness import assert_check, check_names, launch

WORKER = Path(__file__).with_name("train_worker.py")
NAMES = check_names(WORKER)


@pytest.fixture(scope="module")
def results():
    return launch(WORKER, nprocs=4)


@pytest.mark.parametrize("name", NAMES)
def test_four_ranks(results, name):
    assert_check(results, name)


def test_every_check_reported(results):
    assert set(NAMES) <= set(results), sorted(set(NAMES) - set(results))
