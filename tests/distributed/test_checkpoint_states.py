"""Save and load (runtime/checkpoint.py) on 2 gloo ranks bring back the weights, the optimizer
state and every rank's random streams exactly; the checks live in checkpoint_worker.py."""
from __future__ import annotations

from pathlib import Path

from dist_harness import checks_as_tests

results, test_checks, test_every_check_reported = checks_as_tests(Path(__file__).with_name("checkpoint_worker.py"),
                                                                  nprocs=2)
