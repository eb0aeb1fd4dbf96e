"""Placements of per-particle tensors, and the spatial rank grid as a DeviceMesh.

One vocabulary for both verticals: a particle tensor's dim 0 is the *atom
dimension* (rows); its placement says what a rank's local rows are.

============== ========================== ===========================================
placement      local rows                 DTensor equivalent
============== ========================== ===========================================
``Owned()``    this rank's owned atoms    ``Shard(0)`` with uneven counts
               (with ``counts``: global
               rows in contiguous blocks)
``HaloPadded`` ``[owned | halo]``: owned  none: the halo rows are copies of rows
               rows, then copies of       other ranks own, kept by a halo plan
               neighbours' rows
``PerSystem()`` one row per system,       ``Replicate()``
               identical on every rank
============== ========================== ===========================================

The halo state of a halo-padded tensor (:class:`HaloState`): ``FRESH`` (each
halo row equals its owner's current row), ``STALE`` (the owned rows changed
since; the halo rows are unknown) or ``PARTIAL`` (rows hold partial sums that
must go back to their owners). Owned and per-system tensors are always FRESH.

A halo plan is anything with the :class:`HaloExchange` protocol (the atoms
package's ``HaloPlan`` is one); this package never imports ``atoms``.

``Owned(counts)`` is the sharded storage without halo (graph-parallel): rank
``r`` holds global rows ``offsets[r] : offsets[r + 1]`` (``counts`` replicated,
uneven, possibly zero), and indices into such a tensor are global row ids, with
:data:`PAD` (``-1``) a padding sentinel that selects nothing.

:func:`spatial_mesh` is the rank grid of a spatial partition (``(gx, gy, gz)``
ranks along the cell axes, row-major as the partitioner numbers them) as a
torch ``DeviceMesh`` with dims ``("x", "y", "z")``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from twinshard.runtime.world import on_shutdown

__all__ = [
    "PAD",
    "HaloExchange",
    "HaloPadded",
    "HaloState",
    "Owned",
    "PerSystem",
    "ShardSpec",
    "spatial_mesh",
]

PAD = -1
"""Padding sentinel of a global row id: gathers a zero row, scatters nothing."""


@runtime_checkable
class HaloExchange(Protocol):
    """What the halo handlers need of a halo plan (``twinshard.atoms.parallel.halo.HaloPlan`` fits).

    ``forward(owned [n_owned, ...]) -> halo [n_halo, ...]`` copies owners' rows into the
    halo; ``reverse(halo [n_halo, ...]) -> owned [n_owned, ...]`` sums halo rows onto their
    owners. Both are collective, differentiable, and each other's adjoint."""

    n_owned: int

    @property
    def n_halo(self) -> int: ...

    def forward(self, x: torch.Tensor) -> torch.Tensor: ...

    def reverse(self, y: torch.Tensor) -> torch.Tensor: ...


class HaloState(enum.Enum):
    FRESH = "fresh"
    STALE = "stale"
    PARTIAL = "partial"


@dataclass(frozen=True)
class Owned:
    """Owned rows, ``Shard(0)`` uneven. ``counts`` (every rank's row count, replicated) makes
    the rows global: rank r holds rows ``sum(counts[:r]) : sum(counts[:r+1])``."""

    counts: tuple[int, ...] | None = None

    per_atom = True

    def dtensor(self) -> Shard:
        return Shard(0)

    @property
    def offsets(self) -> list[int]:
        assert self.counts is not None
        out = [0]
        for c in self.counts:
            out.append(out[-1] + int(c))
        return out

    def __repr__(self) -> str:
        return "Owned()" if self.counts is None else f"Owned(counts={list(self.counts)})"


@dataclass(frozen=True)
class HaloPadded:
    """``[owned | halo]`` rows; ``plan`` moves rows between owners and halo copies."""

    plan: HaloExchange = field(compare=False)

    per_atom = True

    @property
    def n_owned(self) -> int:
        return int(self.plan.n_owned)

    @property
    def n_halo(self) -> int:
        return int(self.plan.n_halo)

    def dtensor(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"HaloPadded(owned={self.n_owned}, halo={self.n_halo})"


@dataclass(frozen=True)
class PerSystem:
    """One row per system, replicated on every rank."""

    per_atom = False

    def dtensor(self) -> Replicate:
        return Replicate()

    def __repr__(self) -> str:
        return "PerSystem()"


Placement = Owned | HaloPadded | PerSystem


@dataclass(frozen=True)
class ShardSpec:
    """The metadata a :class:`~twinshard.shard.shard_tensor.ShardTensor` carries.

    ``placement``; ``state`` (halo state; FRESH for non-halo placements); ``group`` (process
    group, ``None`` = world); ``n_systems`` (systems on this rank's batch); ``row_block`` (local
    rows per atom: a row-wise view ``[n, a, b] -> [n * a, b]``, as e3nn's compiled tensor products
    make, has ``row_block = a`` with each atom's rows contiguous; no dispatch handler matches such a
    tensor, so an op over its atom dimension raises)."""

    placement: Owned | HaloPadded | PerSystem
    state: HaloState = HaloState.FRESH
    group: dist.ProcessGroup | None = field(default=None, compare=False)
    n_systems: int = 1
    row_block: int = 1

    @property
    def per_atom(self) -> bool:
        return bool(self.placement.per_atom)

    @property
    def halo(self) -> bool:
        return isinstance(self.placement, HaloPadded)

    @property
    def plan(self) -> HaloExchange | None:
        return self.placement.plan if isinstance(self.placement, HaloPadded) else None

    @property
    def n_owned(self) -> int | None:
        return self.placement.n_owned if isinstance(self.placement, HaloPadded) else None

    def with_state(self, state: HaloState) -> ShardSpec:
        if not self.halo:
            state = HaloState.FRESH
        return ShardSpec(self.placement, state, self.group, self.n_systems, self.row_block)

    def with_row_block(self, row_block: int) -> ShardSpec:
        return ShardSpec(self.placement, self.state, self.group, self.n_systems, int(row_block))

    def owned(self) -> ShardSpec:
        """The spec of the owned rows of this tensor (a halo-padded one sliced to ``[:n_owned]``)."""
        return ShardSpec(Owned(), HaloState.FRESH, self.group, self.n_systems, self.row_block)

    def __repr__(self) -> str:
        st = f", {self.state.value}" if self.halo else ""
        rb = f", rows/atom={self.row_block}" if self.row_block != 1 else ""
        return f"ShardSpec({self.placement!r}{st}, systems={self.n_systems}{rb})"


_MESHES: dict[tuple[int, int, int], DeviceMesh] = {}
on_shutdown(_MESHES.clear)  # a mesh holds its world's groups: never reuse it in a later world


def spatial_mesh(grid: tuple[int, int, int], device_type: str | None = None) -> DeviceMesh:
    """The spatial partition's rank grid ``(gx, gy, gz)`` as a DeviceMesh (dims x, y, z).

    Rank ``(i, j, k)`` is ``(i * gy + j) * gz + k`` (row-major, as
    ``SpatialPartition`` numbers its slabs). Collective the first time for a grid (it creates
    the per-axis subgroups, on every rank in the same order); cached afterwards."""
    grid = tuple(int(g) for g in grid)  # type: ignore[assignment]
    if len(grid) != 3 or any(g < 1 for g in grid):
        raise ValueError(f"a spatial rank grid is three positive integers, got {grid}")
    size = dist.get_world_size()
    if grid[0] * grid[1] * grid[2] != size:
        raise ValueError(f"grid {grid} needs {grid[0] * grid[1] * grid[2]} ranks, the world has {size}")
    if grid not in _MESHES:
        if device_type is None:
            from twinshard.runtime.world import require_world

            device_type = require_world("spatial_mesh").device.type
        ranks = torch.arange(size).reshape(grid)
        _MESHES[grid] = DeviceMesh(device_type, ranks, mesh_dim_names=("x", "y", "z"))
    return _MESHES[grid]
