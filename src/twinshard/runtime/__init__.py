"""Process worlds, grids, fail-together agreement and the atomic file writer."""

from twinshard.runtime.agree import agree_scalars, agree_step, check_all, raise_together
from twinshard.runtime.errors import RankFailure, WorldError
from twinshard.runtime.files import atomic_write
from twinshard.runtime.grid import ProcessGrid, make_grid
from twinshard.runtime.pool import WorkerPool, launch, reports, run_ranks, shared_pool, stop_local_ranks
from twinshard.runtime.world import (
    COLLECTIVE_TIMEOUT,
    DEFAULT_TIMEOUT,
    World,
    attach_world,
    choose_backend,
    get_world,
    in_torchrun,
    init_world,
    require_world,
    shutdown_world,
)

__all__ = [
    "COLLECTIVE_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "ProcessGrid",
    "RankFailure",
    "World",
    "WorldError",
    "agree_scalars",
    "agree_step",
    "atomic_write",
    "attach_world",
    "check_all",
    "choose_backend",
    "get_world",
    "in_torchrun",
    "init_world",
    "launch",
    "make_grid",
    "raise_together",
    "reports",
    "require_world",
    "run_ranks",
    "shared_pool",
    "shutdown_world",
    "stop_local_ranks",
    "WorkerPool",
]
