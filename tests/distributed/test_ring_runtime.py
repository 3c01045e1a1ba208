"""Groups with a ring (Ulysses x ring) on 4 gloo CPU ranks, one launch: the pool's ring layout, ring
attention (outputs and q/k/v gradients) against the whole buffer's attention at Ulysses 2 x ring 2,
1 x 2 and 1 x 4, and whole training steps with ring groups against a single process. The checks
live in ring_worker.py; each is reported here as its own test."""
from __future__ import annotations

from pathlib import Path

from dist_harness import checks_as_tests

results, test_checks, test_every_check_reported = checks_as_tests(Path(__file__).with_name("ring_worker.py"), nprocs=4)
