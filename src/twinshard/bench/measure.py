"""What every ``bench pair`` op and the trunk benches measure on a rank: :func:`measure` (saved
bytes, tensor and resident peaks, time of one forward + backward), :func:`rank_figures` (one
rank's row of figures) and the ``--grid`` parser."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from twinshard.memory import RssWindow, SavedBytes, peak_memory_during

__all__ = ["measure", "parse_grid", "rank_figures"]


def parse_grid(text: str) -> tuple[int, int]:
    try:
        r, c = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"grid must look like RxC (e.g. 2x2), got {text!r}") from None
    if r < 1 or c < 1:
        raise ValueError(f"grid sizes must be positive, got {text!r}")
    return r, c


def measure(
    forward: Callable[[], torch.Tensor],
    backward: Callable[[torch.Tensor], None],
    device: torch.device,
    params: Any = (),
) -> dict[str, Any]:
    """Saved-for-backward bytes (all, and without the storages of ``params``), peak bytes and
    wall time of ``backward(forward())``."""
    saved = SavedBytes()

    def step() -> None:
        with saved:
            out = forward()
        backward(out)

    t0 = time.perf_counter()
    with RssWindow() as rss:
        _, peak = peak_memory_during(step, device)
    return {
        "saved_bytes": saved.bytes,
        "saved_activation_bytes": saved.bytes_without(params),
        "peak_bytes": peak,
        "rss_peak_bytes": rss.peak_bytes,
        "rss_reset": rss.reset,
        "rss_source": rss.source,
        "seconds": time.perf_counter() - t0,
    }


def rank_figures(
    err_out: float,
    err_in: float,
    err_par: float,
    cpm: dict[str, Any],
    ser: dict[str, Any],
    f: dict[str, Any],
    b_: dict[str, Any],
    npad: tuple[int, int],
) -> dict[str, Any]:
    """One rank's figures for every ``bench pair`` op: parity errors, memory (tensor and resident
    peaks, saved bytes) and time from ``measure`` of the twin (``cpm``) and the serial module
    (``ser``), forward/backward ledger summaries (``f``, ``b_``), the padded token count."""
    return {
        "err_out": err_out,
        "err_in": err_in,
        "err_par": err_par,
        "saved": cpm["saved_bytes"],
        "saved_activations": cpm.get("saved_activation_bytes"),
        "peak": cpm["peak_bytes"],
        "seconds": cpm["seconds"],
        "serial_saved": ser["saved_bytes"],
        "serial_saved_activations": ser.get("saved_activation_bytes"),
        "serial_peak": ser["peak_bytes"],
        "rss_peak": cpm["rss_peak_bytes"],
        "rss_reset": cpm["rss_reset"],
        "rss_source": cpm["rss_source"],
        "serial_rss_peak": ser["rss_peak_bytes"],
        "serial_seconds": ser["seconds"],
        "comm_fwd": max(f["bytes_sent"], f["bytes_recv"]),
        "comm_fwd_sent": f["bytes_sent"],
        "comm_fwd_recv": f["bytes_recv"],
        "comm_bwd": max(b_["bytes_sent"], b_["bytes_recv"]),
        "ledger_forward": f,
        "ledger_backward": b_,
        "padded_tokens": list(npad),
    }
