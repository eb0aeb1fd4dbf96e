"""Tensor-memory measurement shared by the benchmarks and the MD driver.

``peak_memory_during(fn, device)`` returns ``fn()``'s result and the peak of tensor
bytes allocated above the starting level while it ran: on CUDA from the caching
allocator's statistics; on CPU from the profiler's allocator events (a running sum
of allocations and frees). The CPU path reads a private profiler API; if that moves,
the figure is ``None`` rather than a wrong number.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["peak_memory_during"]


@contextmanager
def _quiet_fd2() -> Iterator[None]:
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def peak_memory_during(fn: Callable[[], Any], device: torch.device) -> tuple[Any, int | None]:
    """(result of ``fn()``, peak bytes allocated above the start while it ran, or None)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        return out, int(torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_fd2():  # kineto prints start/stop markers straight to fd 2
        prof.__enter__()
    try:
        out = fn()
    finally:
        with _quiet_fd2():
            prof.__exit__(None, None, None)
    try:
        events = sorted(
            (e.start_ns(), e.nbytes())
            for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
        )
    except (AttributeError, RuntimeError):  # the private profiler API moved: no figure
        return out, None
    cur = peak = 0
    for _, b in events:
        cur += b
        peak = max(peak, cur)
    return out, int(peak)
