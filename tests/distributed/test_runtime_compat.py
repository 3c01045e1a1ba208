"""megatron-core on one CPU rank through apply_cpu_compat(): idempotent patches, a no-op where
CUDA exists, the RNG tracker on the CPU generator, GPTModel (local spec and with UlyssesAttention)
forward + backward, megatron's no-pipelining schedule and full recompute with dropout. Runs in a
forked child of a fresh interpreter (dist_harness), so the pytest process stays unpatched; the
checks live in compat_worker.py."""
from __future__ import annotations

from pathlib import Path

from dist_harness import checks_as_tests

results, test_checks, test_every_check_reported = checks_as_tests(Path(__file__).with_name("compat_worker.py"), nprocs=1)
