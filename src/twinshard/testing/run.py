"""Run a function on every rank of a world or grid from the test process.

Workers come from the process-wide ``shared_pool`` and are reused across
tests, so after the first call a small job costs milliseconds. ``fn`` travels
cloudpickled (a module-level function by reference; a nested one, a lambda or
one defined in ``__main__`` by value) and returns picklable values (tensors
included).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from twinshard.runtime.grid import ProcessGrid, make_grid
from twinshard.runtime.pool import shared_pool
from twinshard.runtime.world import DEFAULT_TIMEOUT


def run_on_world(
    fn: Callable[..., Any], nprocs: int, *args: Any, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any
) -> list[Any]:
    """``fn(*args, **kwargs)`` on ranks 0..nprocs-1; the list of their results (index = rank)."""
    return shared_pool().run(fn, nprocs, *args, timeout=timeout, **kwargs)


def _on_grid(fn: Callable[..., Any], shape: tuple[int, ...], args: tuple, kwargs: dict) -> Any:
    return fn(make_grid(shape), *args, **kwargs)


def run_on_grid(
    fn: Callable[..., Any],
    shape: tuple[int, ...],
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    **kwargs: Any,
) -> list[Any]:
    """``fn(grid, *args, **kwargs)`` on every rank of a grid of ``shape`` (row-major ranks)."""
    shape = tuple(shape)
    return run_on_world(_on_grid, math.prod(shape), fn, shape, args, kwargs, timeout=timeout)


def grid_id(shape: tuple[int, ...] | ProcessGrid) -> str:
    """'2x3' for a shape or grid."""
    shape = shape.shape if isinstance(shape, ProcessGrid) else shape
    return "x".join(str(s) for s in shape)
