"""Sub-worlds: a set of ranks that code written for "the world" runs on unchanged.

A data x context parallel run splits the world into ``dp`` replicas, each a rows x cols CP grid.
The pair twins were written for a grid spanning the world: a group argument of ``None`` means
"every rank of the grid", point-to-point peers and ``src`` ranks are grid ranks, control scalars
are agreed over the world. Inside ``with sub_world(sw):`` those meanings are the sub-world's:

- ``default_group()`` (what ``group=None`` means in ``twinshard.comm.primitives``,
  ``agree_scalars``, ``raise_together``) is the sub-world's process group;
- ``scope_rank()`` / ``scope_size()`` are this rank's index in the sub-world and its size; the
  point-to-point moves translate sub-world ranks to global ones (``to_global``);
- ``make_grid`` returns the sub-world's grids (registered when the sub-world was built).

The scope is process-wide (not thread-local), so the autograd engine's device threads see it
during backward; one process belongs to one sub-world at a time. Outside any scope every function
here is the identity on the world: ``default_group() is None``, ``scope_rank() == dist.get_rank()``.
Entering issues no collective.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["SubWorld", "current_scope", "default_group", "scope_rank", "scope_size", "sub_world", "to_global"]


@dataclass(frozen=True, eq=False)
class SubWorld:
    """Global ranks ``ranks`` (in sub-world order) and their process group; ``name`` keys caches."""

    name: str
    ranks: tuple[int, ...]
    group: dist.ProcessGroup

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's index in the sub-world (raises when it is not a member)."""
        me = dist.get_rank()
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not in sub-world {self.name} (ranks {list(self.ranks)})")
        return self.ranks.index(me)


_SCOPE: SubWorld | None = None


def current_scope() -> SubWorld | None:
    return _SCOPE


@contextmanager
def sub_world(sw: SubWorld | None) -> Iterator[SubWorld | None]:
    """Run the block with ``sw`` as the world (``None``: the whole world); nests, restores."""
    global _SCOPE
    if sw is not None:
        _ = sw.rank  # a member, or a clear error before any collective
    saved, _SCOPE = _SCOPE, sw
    try:
        yield sw
    finally:
        _SCOPE = saved


def default_group() -> dist.ProcessGroup | None:
    """What ``group=None`` means here: the sub-world's group, or ``None`` (the world)."""
    return None if _SCOPE is None else _SCOPE.group


def scope_rank() -> int:
    return dist.get_rank() if _SCOPE is None else _SCOPE.rank


def scope_size() -> int:
    return dist.get_world_size() if _SCOPE is None else _SCOPE.size


def to_global(rank: int) -> int:
    """The global rank of sub-world rank ``rank`` (the identity outside a scope)."""
    return int(rank) if _SCOPE is None else _SCOPE.ranks[int(rank)]
