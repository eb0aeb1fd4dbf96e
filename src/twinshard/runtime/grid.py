"""Process grids: 1-D (particles, axis "domain") and 2-D (pairs, axes "rows" x "cols").

Any shape whose product is the world size works, 1 x 1 included. A grid wraps a
torch DeviceMesh (so DTensors can live on it) and exposes, per axis, the
subgroup of ranks that share every other coordinate with this rank. Grids are
cached per world and shape: building one issues ``new_group`` calls that every
rank makes in the same order, so call ``make_grid`` with replicated shapes.
"""

from __future__ import annotations

import math

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from twinshard.runtime.world import require_world

_GRIDS: dict[tuple, ProcessGrid] = {}


class ProcessGrid:
    """A rank grid over the current world.

    Attributes: ``shape``, ``names``, ``rank`` (global), ``coords`` (this rank's index along
    each axis), ``mesh`` (DeviceMesh). Rank order is row-major: rank = r * cols + c.
    """

    def __init__(self, shape: tuple[int, ...], names: tuple[str, ...] | None = None):
        world = require_world("ProcessGrid")
        shape = tuple(int(s) for s in shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"grid shape must be positive integers, got {shape}")
        if math.prod(shape) != world.size:
            raise ValueError(
                f"grid {'x'.join(map(str, shape))} needs {math.prod(shape)} ranks but the world has "
                f"{world.size}: choose a shape whose product is the world size"
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
        self.rank = world.rank
        self.size = world.size
        self.coords = self.coords_of(world.rank)
        self.mesh: DeviceMesh = init_device_mesh(world.device.type, shape, mesh_dim_names=self.names)

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
    """The (cached) grid of this shape on the current world."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    key = (shape, names)
    if key not in _GRIDS:
        _GRIDS[key] = ProcessGrid(shape, names)
    return _GRIDS[key]


def clear_grid_cache() -> None:
    _GRIDS.clear()
