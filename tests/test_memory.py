"""tensors.memory: the CPU tensor peak is measured or the call fails loudly; the resident peak
(VmHWM) is reset at the start of a window where the kernel permits, and says whether it was."""

import os

import numpy as np
import pytest
import torch

from twinshard import memory
from twinshard.memory import MemoryMeasurementError, RssWindow, peak_memory_during

MB = 2**20


def test_cpu_tensor_peak_sees_a_known_allocation():
    def fn():
        a = torch.ones(2 * MB, dtype=torch.float64)  # 16 MiB, freed before the next one
        del a
        b = torch.ones(MB, dtype=torch.float64)
        return float(b[0])

    out, peak = peak_memory_during(fn, torch.device("cpu"))
    assert out == 1.0
    assert 16 * MB <= peak < 16 * MB + MB  # the larger of the two live sets, plus small temporaries


def test_cpu_tensor_peak_fails_loudly_when_the_profiler_api_is_gone(monkeypatch):
    """Planted: the private allocator-event API disappears (as a torch upgrade could do)."""

    class NoKineto(torch.profiler.profile):
        def __exit__(self, *exc):
            out = super().__exit__(*exc)
            self.profiler = object()  # no kineto_results any more
            return out

    monkeypatch.setattr(torch.profiler, "profile", NoKineto)
    with pytest.raises(MemoryMeasurementError, match="no longer exposes allocator events"):
        peak_memory_during(lambda: torch.ones(1000), torch.device("cpu"))


def test_cpu_tensor_peak_fails_loudly_when_allocations_are_not_recorded(monkeypatch):
    """Planted: the profiler still answers but records no allocator events (would read as 0)."""

    class NoMemory(torch.profiler.profile):
        def __init__(self, *args, **kwargs):
            kwargs["profile_memory"] = False
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(torch.profiler, "profile", NoMemory)
    with pytest.raises(MemoryMeasurementError, match="not a 4099-byte sentinel"):
        peak_memory_during(lambda: torch.ones(1000), torch.device("cpu"))


def _clear_refs_writable():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="VmHWM needs Linux /proc")
def test_resident_peak_window_is_reset_and_sees_non_tensor_memory():
    with RssWindow() as big:
        buf = np.ones(96 * MB // 8)  # 96 MiB outside torch: a tensor profiler would not see it
        buf.sum()
    del buf
    assert big.source.startswith("VmHWM")
    assert big.peak_bytes - big.start_bytes >= 90 * MB
    assert big.reset == _clear_refs_writable()
    with RssWindow() as small:
        torch.ones(10)
    if small.reset:  # the second window does not inherit the first one's high-water mark
        assert small.peak_bytes < big.peak_bytes - 60 * MB
    else:  # without a reset the figure is the lifetime peak, and the JSON says so
        assert small.peak_bytes >= big.peak_bytes
    d = small.as_dict()
    assert set(d) == {"rss_peak_bytes", "rss_start_bytes", "rss_reset", "rss_source"}


def test_resident_peak_reports_a_refused_reset(monkeypatch):
    """Planted: a kernel that refuses the write to clear_refs; the window says reset=False."""
    real_open = open

    def refusing_open(path, *args, **kwargs):
        if str(path) == "/proc/self/clear_refs":
            raise PermissionError("not permitted")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", refusing_open)
    if not os.path.exists("/proc/self/status"):
        pytest.skip("VmHWM needs Linux /proc")
    with RssWindow() as w:
        pass
    assert w.reset is False and w.peak_bytes >= w.start_bytes > 0
    assert memory.read_status_bytes("VmHWM")["VmHWM"] > 0


def test_saved_and_storage_bytes_count_each_storage_once():
    from twinshard.memory import SavedBytes, storage_bytes

    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    assert storage_bytes([x, x[:2], x.t()]) == x.nbytes  # views share one storage
    with SavedBytes() as saved:
        y = (x @ w).tanh()  # saves x, w and tanh's output
    assert saved.bytes == x.nbytes + w.nbytes + y.nbytes
    assert saved.bytes_without([w]) == x.nbytes + y.nbytes
