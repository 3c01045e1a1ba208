"""NCCL's rules on gloo CPU ranks (runtime/device.py's check mode, on in every distributed test):
our collectives refuse host tensors and dtypes NCCL lacks, and the Megatron-LM step report and
the planning loader's broadcast pass. The checks live in device_worker.py."""
from __future__ import annotations

from pathlib import Path

from dist_harness import checks_as_tests

results, test_checks, test_every_check_reported = checks_as_tests(Path(__file__).with_name("device_worker.py"),
                                                                    nprocs=2)
