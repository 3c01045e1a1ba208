"""megatron-core on one CPU rank through apply_cpu_compat(): idempotent patches, a no-op where
CUDA exists, the RNG tracker on the CPU generator, GPTModel (local spec and with UlyssesAttention)
forward + backward, megatron's no-pipelining schedule and full recompute with dropout. Runs in a
forked child of a fresh interpreter (dist_harness), so the pytest process stays unpatched; the
checks live in compat_worker.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from dist_harness import assert_check, check_names, launch

WORKER = Path(__file__).with_name("compat_worker.py")
NAMES = check_names(WORKER)


@pytest.fixture(scope="module")
def results():
    return launch(WORKER, nprocs=1)


@pytest.mark.parametrize("name", NAMES)
def test_one_cpu_rank(results, name):
    assert_check(results, name)


def test_every_check_reported(results):
    assert set(NAMES) <= set(results), sorted(set(NAMES) - set(results))
