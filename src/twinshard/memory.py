"""Memory measurement shared by the benchmarks and the MD driver: tensor peak and resident peak.

Two figures, both reported by every benchmark JSON:

- **tensor peak** (``peak_memory_during(fn, device)``): the peak of tensor bytes
  allocated above the starting level while ``fn`` ran. On CUDA from the caching
  allocator's statistics; on CPU from the profiler's allocator events (a running
  sum of allocations and frees). The CPU path reads a private profiler API
  (``prof.profiler.kineto_results``): if that API is missing, or a sentinel
  allocation made inside the window is not seen in its events, it raises
  :class:`MemoryMeasurementError` instead of returning a figure that looks fine.
- **resident peak** (:class:`RssWindow`): the process's peak resident set size
  (``VmHWM`` from ``/proc/self/status``), reset at the start of the window by
  writing ``"5"`` to ``/proc/self/clear_refs`` where the kernel permits it, so it
  covers memory outside torch tensors too (neighbour lists, communication
  buffers, the Python heap, the torch libraries themselves). ``reset`` says
  whether the reset worked; if not, the figure is the process's lifetime peak
  (an upper bound of the window's). Without ``/proc`` (not Linux) it falls back
  to ``getrusage``'s ``ru_maxrss`` (never reset).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "MemoryMeasurementError",
    "RssWindow",
    "SavedBytes",
    "peak_memory_during",
    "read_status_bytes",
    "storage_bytes",
]


class MemoryMeasurementError(RuntimeError):
    """A memory figure cannot be measured on this platform/torch build (never reported as 0)."""


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


# A sentinel allocated inside the CPU window proves the profiler records allocations; an odd
# size keeps it apart from the measured function's own tensors.
_SENTINEL_BYTES = 4099


def peak_memory_during(fn: Callable[[], Any], device: torch.device) -> tuple[Any, int]:
    """(result of ``fn()``, peak tensor bytes allocated above the start while it ran).

    Raises MemoryMeasurementError when the CPU profiler cannot report allocations.
    """
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
        sentinel = torch.empty(_SENTINEL_BYTES, dtype=torch.uint8, device=device)
        del sentinel
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
    except (AttributeError, RuntimeError) as exc:
        raise MemoryMeasurementError(
            f"cannot measure the CPU tensor peak: torch {torch.__version__}'s profiler no longer "
            f"exposes allocator events through prof.profiler.kineto_results ({exc!r}); "
            "twinshard.memory needs updating for this torch version"
        ) from exc
    if _SENTINEL_BYTES not in {b for _, b in events}:
        raise MemoryMeasurementError(
            f"cannot measure the CPU tensor peak: the profiler (torch {torch.__version__}) recorded "
            f"{len(events)} allocator events but not a {_SENTINEL_BYTES}-byte sentinel allocated "
            "inside the window, so its figure would be wrong"
        )
    cur = peak = 0
    for _, b in events:
        cur += b
        peak = max(peak, cur)
    return out, int(peak)


def read_status_bytes(*keys: str) -> dict[str, int]:
    """``VmRSS``/``VmHWM``/... of this process from ``/proc/self/status``, in bytes."""
    found: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in keys:
                value, unit = rest.split()[:2]
                assert unit == "kB", line  # the kernel always reports kB
                found[name] = int(value) * 1024
    missing = set(keys) - set(found)
    if missing:
        raise MemoryMeasurementError(f"/proc/self/status has no {sorted(missing)}")
    return found


@dataclass
class RssWindow:
    """Peak resident memory of this process over a window (``with RssWindow() as w: ...``).

    After the block: ``peak_bytes`` (VmHWM, the process's resident high-water
    mark over the window, absolute: libraries and everything else resident
    included), ``start_bytes`` (VmRSS when the window opened), ``reset``
    (whether the high-water mark was reset at the start; if not, ``peak_bytes``
    is the lifetime peak so far) and ``source``.
    """

    peak_bytes: int = 0
    start_bytes: int = 0
    reset: bool = False
    source: str = ""

    def __enter__(self) -> RssWindow:
        if os.path.exists("/proc/self/status"):
            self.source = "VmHWM (/proc/self/status)"
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # resets the peak RSS to the current RSS (Linux >= 4.0)
                ok = True
            except OSError:
                ok = False
            now = read_status_bytes("VmRSS", "VmHWM")
            self.start_bytes = now["VmRSS"]
            # a reset high-water mark starts at the current RSS (pages may come and go between the
            # two reads, hence the slack of a few pages)
            self.reset = ok and now["VmHWM"] <= now["VmRSS"] + 64 * 4096
        else:
            self.source = "ru_maxrss (getrusage; never reset)"
            self.start_bytes = self._maxrss()
            self.reset = False
        return self

    @staticmethod
    def _maxrss() -> int:
        import resource

        v = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(v if sys.platform == "darwin" else v * 1024)  # bytes on macOS, kB on Linux

    def __exit__(self, *exc: object) -> None:
        if self.source.startswith("VmHWM"):
            self.peak_bytes = read_status_bytes("VmHWM")["VmHWM"]
        else:
            self.peak_bytes = self._maxrss()

    def as_dict(self, prefix: str = "rss_") -> dict[str, Any]:
        return {
            f"{prefix}peak_bytes": self.peak_bytes,
            f"{prefix}start_bytes": self.start_bytes,
            f"{prefix}reset": self.reset,
            f"{prefix}source": self.source,
        }


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once): the
    one byte count of held tensors (saved for backward, neighbour lists, systems)."""
    return sum(nbytes for _, nbytes in {_storage_key(t) for t in tensors})


class SavedBytes:
    """Context manager: the storages autograd saves for backward while it is open
    (``saved_tensors_hooks``), each distinct storage counted once.

    ``with SavedBytes() as saved: out = forward()``; then ``saved.bytes`` (all of them) or
    ``saved.bytes_without(params)`` (leaving out, e.g., parameters every rank holds whole)."""

    def __init__(self) -> None:
        self.storages: dict[tuple[int, int], int] = {}
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        self.storages[key] = key[1]
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def bytes_without(self, tensors: Any) -> int:
        skip = {_storage_key(t) for t in tensors}
        return sum(b for k, b in self.storages.items() if k not in skip)
