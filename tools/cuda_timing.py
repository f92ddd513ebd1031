"""Shared by the kernel-tuning tools: the median device time of a call, by CUDA events."""

from __future__ import annotations

import statistics

import torch


def timed(fn, reps: int = 7) -> float:
    """Median over ``reps`` runs of ``fn()`` of the CUDA-event time around it (ms), each run
    starting on an idle device."""
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)
