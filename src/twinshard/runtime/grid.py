"""Process grids: 1-D (particles, axis "domain") and 2-D (pairs, axes "rows" x "cols").

Any shape whose product is the world size works, 1 x 1 included. A grid wraps a
torch DeviceMesh (so DTensors can live on it) and exposes, per axis, the
subgroup of ranks that share every other coordinate with this rank. Grids are
cached per world and shape: building one issues ``new_group`` calls that every
rank makes in the same order, so call ``make_grid`` with replicated shapes.

Inside a sub-world (``twinshard.runtime.scope``; a replica of a data x context parallel mesh,
``twinshard.runtime.mesh``) a grid spans the sub-world: ``rank``, ``coords_of``, ``rank_of`` are
sub-world ranks, its ``mesh`` is a slice of the enclosing DeviceMesh, and ``make_grid`` returns
only the grids registered for that sub-world (new groups cannot be created by one sub-world alone).
"""

from __future__ import annotations

import math

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from twinshard.runtime.scope import current_scope, scope_rank
from twinshard.runtime.world import on_shutdown, require_world

_GRIDS: dict[tuple, ProcessGrid] = {}


class ProcessGrid:
    """A rank grid over the current world.

    Attributes: ``shape``, ``names``, ``rank`` (in the world, or in the active sub-world),
    ``coords`` (this rank's index along each axis), ``mesh`` (DeviceMesh). Rank order is
    row-major: rank = r * cols + c. ``mesh``: a DeviceMesh of this shape over the (sub-)world's
    ranks in order, e.g. a slice of a larger mesh (default: built over the world).
    """

    def __init__(
        self, shape: tuple[int, ...], names: tuple[str, ...] | None = None, mesh: DeviceMesh | None = None
    ):
        world = require_world("ProcessGrid")
        scope = current_scope()
        size = world.size if scope is None else scope.size
        shape = tuple(int(s) for s in shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"grid shape must be positive integers, got {shape}")
        if math.prod(shape) != size:
            where = "world" if scope is None else f"sub-world {scope.name}"
            raise ValueError(
                f"grid {'x'.join(map(str, shape))} needs {math.prod(shape)} ranks but the {where} has "
                f"{size}: choose a shape whose product is the {where} size"
            )
        if scope is not None and mesh is None:
            raise ValueError(
                f"a grid inside sub-world {scope.name} needs its DeviceMesh (a slice of the enclosing "
                "mesh): build it with twinshard.runtime.mesh.make_dp_mesh, not make_grid"
            )
        if names is None:
            names = (
                ("domain",)
                if len(shape) == 1
                else ("rows", "cols")
                if len(shape) == 2
                else tuple(f"axis{i}" for i in range(len(shape)))
            )
        if len(names) != len(shape):
            raise ValueError(f"{len(names)} axis names for a {len(shape)}-D grid")
        self.shape = shape
        self.names = tuple(names)
        self.rank = scope_rank()
        self.size = size
        self.coords = self.coords_of(self.rank)
        if mesh is None:
            mesh = init_device_mesh(world.device.type, shape, mesh_dim_names=self.names)
        elif tuple(mesh.shape) != shape or tuple(mesh.mesh_dim_names or ()) != self.names:
            raise ValueError(
                f"mesh {tuple(mesh.shape)} {mesh.mesh_dim_names} does not match grid {shape} {self.names}"
            )
        self.mesh: DeviceMesh = mesh

    # -- geometry ---------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1] if self.ndim > 1 else 1

    def axis(self, axis: int | str) -> int:
        """Axis index from an index or a name ("rows", "cols", "domain")."""
        return self.names.index(axis) if isinstance(axis, str) else int(axis)

    def coords_of(self, rank: int) -> tuple[int, ...]:
        out = []
        for s in reversed(self.shape):
            out.append(rank % s)
            rank //= s
        return tuple(reversed(out))

    def rank_of(self, coords: tuple[int, ...] | list[int]) -> int:
        """Global rank at ``coords`` (each coordinate taken modulo its axis: grids are rings)."""
        rank = 0
        for c, s in zip(coords, self.shape):
            rank = rank * s + (int(c) % s)
        return rank

    def axis_ranks(self, axis: int | str) -> list[int]:
        """Global ranks along ``axis`` through this rank, in axis order."""
        a = self.axis(axis)
        out = []
        for i in range(self.shape[a]):
            c = list(self.coords)
            c[a] = i
            out.append(self.rank_of(c))
        return out

    def group(self, axis: int | str) -> dist.ProcessGroup:
        """Subgroup of the ranks along ``axis`` through this rank (e.g. "cols": my grid row)."""
        return self.mesh.get_group(self.names[self.axis(axis)])

    @property
    def row_group(self) -> dist.ProcessGroup:
        """Ranks in this rank's grid row (they differ in the column coordinate)."""
        return self.group(self.ndim - 1)

    @property
    def col_group(self) -> dist.ProcessGroup:
        """Ranks in this rank's grid column (they differ in the row coordinate)."""
        return self.group(0)

    def __repr__(self) -> str:
        return f"ProcessGrid({'x'.join(map(str, self.shape))}, rank={self.rank}, coords={self.coords})"


def make_grid(shape: tuple[int, ...] | int, names: tuple[str, ...] | None = None) -> ProcessGrid:
    """The (cached) grid of this shape on the current world (or sub-world: its registered grids)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    scope = current_scope()
    key = (shape, names) if scope is None else (scope.name, shape, names)
    if key not in _GRIDS:
        _GRIDS[key] = ProcessGrid(shape, names)
    return _GRIDS[key]


def register_grid(grid: ProcessGrid, names: tuple[str, ...] | None = None) -> None:
    """Make ``grid`` what ``make_grid(grid.shape, names)`` returns in the current (sub-)world."""
    scope = current_scope()
    key = (grid.shape, names) if scope is None else (scope.name, grid.shape, names)
    _GRIDS[key] = grid


@on_shutdown  # a later world must not reuse groups of this one
def clear_grid_cache() -> None:
    _GRIDS.clear()
