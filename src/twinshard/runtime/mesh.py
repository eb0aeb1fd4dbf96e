"""A data x context parallel mesh: ``dp`` replicas, each a rows x cols CP grid.

``make_dp_mesh(dp, rows, cols)`` builds (once per world and shape) a torch ``DeviceMesh`` of shape
``(dp, rows, cols)`` with ``mesh_dim_names=("dp", "rows", "cols")``; world rank
``(d * rows + r) * cols + c`` is replica ``d``'s grid position ``(r, c)``. Each replica is a
sub-world (``twinshard.runtime.scope``) whose grid is a :class:`ProcessGrid` on the 2-D slice
``mesh["rows", "cols"]``: its own row and column groups, its own DeviceMesh for the DTensors.
Inside ``with dpm.replica():`` the pair twins run on the replica exactly as on a world of
``rows * cols`` ranks (their ``group=None`` collectives, agreements and point-to-point peers are
the replica's). ``dpm.dp_group`` links the ranks holding the same grid position in every replica
(the data-parallel gradient reduction runs over it). Any shape, ``dp = 1`` and ``1 x 1`` included.

Collectives: building issues one ``agree_scalars`` over the world (every rank must ask for the
same shape: a rank with another ``dp`` raises on every rank instead of building mismatched
groups), the DeviceMesh's group creation and one ``new_group`` per replica, on every rank in the
same order. Memory: the groups only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from twinshard.runtime.agree import agree_scalars
from twinshard.runtime.grid import ProcessGrid, register_grid
from twinshard.runtime.scope import SubWorld, current_scope, sub_world
from twinshard.runtime.world import on_shutdown, require_world

__all__ = ["DPCPMesh", "make_dp_mesh", "split_sizes"]

NAMES = ("dp", "rows", "cols")


def split_sizes(total: int, parts: int) -> tuple[int, ...]:
    """Contiguous split of ``total`` items over ``parts``: the first ``total % parts`` get one more
    (``split_sizes(5, 2) == (3, 2)``). Raises when a part would be empty."""
    total, parts = int(total), int(parts)
    if parts < 1:
        raise ValueError(f"cannot split over {parts} parts")
    if total < parts:
        raise ValueError(
            f"a batch of {total} structures cannot be split over dp = {parts} replicas (each replica "
            f"needs at least one): use dp <= {total} or a larger batch"
        )
    q, r = divmod(total, parts)
    return tuple(q + (i < r) for i in range(parts))


class DPCPMesh:
    """``dp`` replicas of a ``rows x cols`` CP grid over the world (module docstring).

    Attributes: ``shape`` ``(dp, rows, cols)``, ``mesh`` (the 3-D DeviceMesh), ``dp_index`` (this
    rank's replica), ``dp_group`` (this grid position in every replica), ``replica_world`` (the
    sub-world of this rank's replica), ``grid`` (the replica's ProcessGrid; its ``rank`` and
    coordinates are within the replica), ``world_ranks`` (global ranks of each replica).
    """

    def __init__(self, dp: int, rows: int, cols: int):
        world = require_world("DPCPMesh")
        if current_scope() is not None:
            raise ValueError("a dp x cp mesh is built over the whole world, not inside a sub-world")
        shape = (int(dp), int(rows), int(cols))
        agree_scalars({"dp_rows_cols": shape}, "DPCPMesh")
        if any(s < 1 for s in shape):
            raise ValueError(f"dp, rows and cols must be positive, got {shape}")
        if shape[0] * shape[1] * shape[2] != world.size:
            raise ValueError(
                f"dp x rows x cols = {'x'.join(map(str, shape))} needs {shape[0] * shape[1] * shape[2]} "
                f"ranks but the world has {world.size}"
            )
        self.shape = shape
        self.mesh: DeviceMesh = init_device_mesh(world.device.type, shape, mesh_dim_names=NAMES)
        per = shape[1] * shape[2]
        self.world_ranks = tuple(tuple(range(d * per, (d + 1) * per)) for d in range(shape[0]))
        self.dp_index = world.rank // per
        self.dp_group = self.mesh.get_group("dp")
        mine = None
        for d, ranks in enumerate(self.world_ranks):  # every rank creates every group, in order
            group = dist.new_group(list(ranks)) if shape[0] > 1 else dist.group.WORLD
            if d == self.dp_index:
                mine = group
        self.replica_world = SubWorld(f"dp{shape}[{self.dp_index}]", self.world_ranks[self.dp_index], mine)
        with sub_world(self.replica_world):
            self.grid = ProcessGrid(shape[1:], mesh=self.mesh["rows", "cols"])
            register_grid(self.grid)

    @property
    def dp(self) -> int:
        return self.shape[0]

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1] * self.shape[2]

    @contextmanager
    def replica(self) -> Iterator[ProcessGrid]:
        """Run the block on this rank's replica (a sub-world); yields its grid."""
        with sub_world(self.replica_world):
            yield self.grid

    def __repr__(self) -> str:
        return f"DPCPMesh({'x'.join(map(str, self.shape))}, replica={self.dp_index}, grid={self.grid})"


_MESHES: dict[tuple[int, int, int], DPCPMesh] = {}


def make_dp_mesh(dp: int, rows: int, cols: int) -> DPCPMesh:
    """The (cached) ``(dp, rows, cols)`` mesh on the current world (collective the first time)."""
    key = (int(dp), int(rows), int(cols))
    require_world("make_dp_mesh")
    if current_scope() is None:  # every call: a rank asking for another shape fails on every rank
        agree_scalars({"dp_rows_cols": key}, "make_dp_mesh")
    if key not in _MESHES:
        _MESHES[key] = DPCPMesh(*key)
    return _MESHES[key]


@on_shutdown
def _clear() -> None:
    _MESHES.clear()
