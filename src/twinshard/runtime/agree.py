"""Fail together: when one rank finds an error, every rank raises it.

A rank that raises on its own leaves its peers blocked in the next collective
until the timeout. Code that can fail before a collective (input checks,
parsing, planning) runs inside ``agree_step`` or ends with ``raise_together``:
all ranks exchange their status (one small all-gather) and, if any failed,
every rank raises the same RankFailure naming the failing ranks with their
tracebacks. The body of a step must not itself issue collectives.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from twinshard.runtime.errors import RankFailure
from twinshard.runtime.world import format_exception, require_world


def raise_together(
    exc: BaseException | None, group: dist.ProcessGroup | None = None, step: str | None = None
) -> None:
    """Exchange status over ``group``; raise RankFailure on every rank if any rank passed an error."""
    world = require_world("raise_together")
    mine = None if exc is None else format_exception(exc)
    size = dist.get_world_size(group)
    statuses: list[tuple[int, str | None] | None] = [None] * size
    dist.all_gather_object(statuses, (world.rank, mine), group=group)
    failures = {rank: tb for rank, tb in statuses if tb is not None}  # type: ignore[misc]
    if failures:
        err = RankFailure(failures, step=step)
        if exc is not None:
            raise err from exc
        raise err


def check_all(
    ok: bool, message: str, group: dist.ProcessGroup | None = None, error: type[Exception] = ValueError
) -> None:
    """Raise ``error(message)`` (wrapped in RankFailure) on every rank unless ``ok`` on all ranks."""
    raise_together(None if ok else error(message), group)


@contextmanager
def agree_step(name: str, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Run a local (collective-free) block; all ranks raise together if any rank raised in it."""
    try:
        yield
    except Exception as exc:
        raise_together(exc, group, step=name)
        raise  # unreachable: raise_together always raises when given an error
    raise_together(None, group, step=name)
