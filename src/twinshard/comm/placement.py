"""Placement check: every payload of a twinshard collective lies on the expected device.

On a GPU world (``cpu:gloo,cuda:nccl``) a payload left on the CPU still moves (over gloo)
but silently round-trips through the host; per-atom data and collective payloads belong
on ``world.device``. Inside ``with check_placement():`` every primitive in
``twinshard.comm.primitives`` checks each tensor it sends or receives into and raises
:class:`PlacementError` naming the op, the tensor and both devices. The expected device
is the world's unless ``device=`` overrides it (tests use this to check the GPU path
without a GPU, and as a negative control). Outside the context nothing is checked.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["PlacementError", "check_placement", "check_payload", "expected_device"]

_ACTIVE: list[torch.device | None] = []


class PlacementError(RuntimeError):
    """A collective payload is not on the device the world works on."""


def expected_device() -> torch.device | None:
    """The device payloads must be on now (None when no check is active)."""
    if not _ACTIVE:
        return None
    dev = _ACTIVE[-1]
    if dev is None:
        from twinshard.runtime.world import get_world

        world = get_world()
        return world.device if world is not None else torch.device("cpu")
    return dev


@contextmanager
def check_placement(device: torch.device | str | None = None) -> Iterator[None]:
    """Check every collective payload on this rank against ``device`` (default: ``world.device``)."""
    _ACTIVE.append(None if device is None else torch.device(device))
    try:
        yield
    finally:
        _ACTIVE.pop()


def _same(actual: torch.device, expected: torch.device) -> bool:
    # "cuda" (no index) stands for the current CUDA device; "cuda:1" must match exactly
    return actual.type == expected.type and (expected.index is None or actual.index == expected.index)


def check_payload(op: str, *tensors: torch.Tensor) -> None:
    """Raise PlacementError if a check is active and a tensor is off the expected device."""
    expected = expected_device()
    if expected is None:
        return
    for t in tensors:
        if not _same(t.device, expected):
            raise PlacementError(
                f"comm {op}: a payload of shape {tuple(t.shape)} ({t.dtype}) is on {t.device}, but the "
                f"world works on {expected}: create it with device=world.device (or move it there) "
                "before the collective"
            )
