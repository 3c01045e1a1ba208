"""FlexSP runtime on 4 gloo CPU ranks, one launch: the SP group pool, Ulysses attention (outputs
and q/k/v gradients) against a single-process reference at degrees 1, 2, 4 with GQA, RoPE at true
positions, and a whole GPTModel against megatron's own attention run one sequence at a time.
The checks live in ulysses_worker.py; each is reported here as its own test."""
from __future__ import annotations

from pathlib import Path

from dist_harness import checks_as_tests

results, test_checks, test_every_check_reported = checks_as_tests(Path(__file__).with_name("ulysses_worker.py"), nprocs=4)
