"""Token-level slices and elastic pipelines on 4 gloo ranks, one launch: slices at SP degree 1, 2
and 4 (with and without recompute) equal the uncut sequences; elastic_pp plans (hand-made split,
batched and hybrid chunks, several pipelines, random valid orders, planner plans with recompute)
through a 2-stage x SP 2 and a 4-stage pipeline, and replicas side by side (2 stages x SP 1, 1
stage x SP 2, one replica idle), equal one process; impossible orders are refused before anything
runs. The checks live in pipeline_worker.py; each is reported as its own test."""
from __future__ import annotations

from pathlib import Path

from dist_harness import checks_as_tests

WORKER = Path(__file__).with_name("pipeline_worker.py")
results, test_checks, test_every_check_reported = checks_as_tests(WORKER, nprocs=4)
