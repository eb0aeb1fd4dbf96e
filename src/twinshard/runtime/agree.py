"""Fail together: when one rank finds an error, every rank raises it.

A rank that raises on its own leaves its peers blocked in the next collective
until the timeout. Code that can fail before a collective (input checks,
parsing, planning) runs inside ``agree_step`` or ends with ``raise_together``:
all ranks exchange their status (one small all-gather) and, if any failed,
every rank raises the same RankFailure naming the failing ranks with their
tracebacks. The body of a step must not itself issue collectives. ``agree_scalars``
checks that control-flow values are identical on every rank before any rank uses them.
``group=None`` is the world, or the active sub-world (``twinshard.runtime.scope``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from twinshard.runtime.errors import RankFailure
from twinshard.runtime.scope import default_group
from twinshard.runtime.world import format_exception, require_world


def raise_together(
    exc: BaseException | None, group: dist.ProcessGroup | None = None, step: str | None = None
) -> None:
    """Exchange status over ``group``; raise RankFailure on every rank if any rank passed an error."""
    world = require_world("raise_together")
    group = default_group() if group is None else group  # None: the world or the active sub-world
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


_MISSING = object()
_LONG = 120  # characters: a longer value is shown where it first differs (or cut)


def _shown(value: Any) -> str:
    text = "<missing>" if value is _MISSING else repr(value)
    return text if len(text) <= _LONG else f"{text[: _LONG - 20]}...{text[-12:]} ({len(text)} chars)"


def _first_difference(values: list[Any]) -> tuple[str, list[Any]]:
    """Distinct long values that are sequences of one length (nested): the index path of their
    first differing element (``"[0][5]"``) and the elements there; ``("", values)`` otherwise."""
    path = ""
    while (
        all(isinstance(v, (tuple, list)) for v in values)
        and len({len(v) for v in values}) == 1
        and max(len(repr(v)) for v in values) > _LONG
    ):
        i = next((i for i in range(len(values[0])) if len({repr(v[i]) for v in values}) > 1), None)
        if i is None:
            break
        path, values = f"{path}[{i}]", [v[i] for v in values]
    return path, values


def agree_scalars(values: Mapping[str, Any], what: str, group: dist.ProcessGroup | None = None) -> None:
    """Check that control-flow scalars (number of layers, recycles, seed, ...) are identical on
    every rank of ``group`` before any rank uses them; raise the same ``ValueError`` on every
    rank if they differ, naming each scalar that differs with its values and the ranks holding
    each (``'seed': 11 on ranks [0, 1, 2], 12 on ranks [3]``; a long sequence at its first
    differing element: ``'checksum' at [7]: ...``). One all-gather of Python objects; a no-op
    without a process group of more than one rank."""
    if not dist.is_initialized():
        return
    group = default_group() if group is None else group  # None: the world or the active sub-world
    if dist.get_world_size(group) == 1:
        return
    mine = sorted((str(k), v) for k, v in values.items())
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    # by repr: exact for numbers (shortest round-trip), and a NaN on every rank agrees
    # (NaN != NaN would report identical values as differing)
    if all(repr(v) == repr(every[0]) for v in every):
        return
    tables = [dict(v) for v in every]
    parts = []
    for key in sorted(set().union(*tables)):
        held: dict[str, tuple[Any, list[int]]] = {}  # full repr -> (value, ranks), by first rank
        for r, table in enumerate(tables):
            value = table.get(key, _MISSING)
            held.setdefault("<missing>" if value is _MISSING else repr(value), (value, []))[1].append(r)
        if len(held) > 1:
            path, shown = _first_difference([v for v, _ in held.values()])
            at = f" at {path}" if path else ""
            ranks = ", ".join(f"{_shown(v)} on ranks {rs}" for v, (_, rs) in zip(shown, held.values()))
            parts.append(f"{key!r}{at}: {ranks}")
    raise ValueError(
        f"{what}: control-flow scalars differ across ranks ({'; '.join(parts)}); every rank must pass "
        "the same values"
    )
