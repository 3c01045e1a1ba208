"""Whole FlexSP training steps on 4 gloo ranks (one launch) equal one process: loss and every
parameter gradient after megatron's gradient reduction, for flexsp and baseline plans. The checks
live in train_worker.py; each is reported here as its own test."""
from __future__ import annotations

from pathlib import Path

from dist_harness import checks_as_tests

results, test_checks, test_every_check_reported = checks_as_tests(Path(__file__).with_name("train_worker.py"), nprocs=4)
