"""Wall time of work on a rank's device (CUDA events on a GPU, the host clock on CPU), and NVTX
ranges that show the plan's structure over the kernels in Nsight Systems.

Kernels run asynchronously from the host on a GPU: ``perf_counter`` around a forward times its
launches, not its work. A ``DeviceClock`` on a CUDA device records an event on the current stream
at each mark and reads the elapsed times only when asked (``seconds``), so a step synchronises
once, when its times are read, not at every operation. On CPU a mark is ``time.perf_counter()``
and nothing changes.
"""
from __future__ import annotations

import time

import torch


class DeviceClock:
    """Marks on one device's timeline; ``seconds(a, b)`` is the time from mark ``a`` to mark ``b``."""

    def __init__(self, device="cpu"):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def range_start(self, name: str):
        """Open an NVTX range named ``name`` on a GPU (None on CPU). Process-wide, not bound to the
        thread: a micro-batch's backward runs on autograd's device thread."""
        return torch.cuda.nvtx.range_start(name) if self.cuda else None

    @staticmethod
    def range_end(handle) -> None:
        if handle is not None:
            torch.cuda.nvtx.range_end(handle)

    def intervals(self, marks: list) -> list[float]:
        """Seconds between consecutive marks."""
        return [self.seconds(a, b) for a, b in zip(marks[:-1], marks[1:])]
