"""Worlds, grids, launch and fail-together."""

import time

import pytest
import torch
import torch.distributed as dist

from twinshard.runtime import (
    RankFailure,
    WorldError,
    agree_step,
    check_all,
    get_world,
    launch,
    make_grid,
    require_world,
)
from twinshard.testing import run_on_grid, run_on_world


def test_entry_point_without_world_raises_clearly():
    assert get_world() is None
    with pytest.raises(WorldError, match="no world is initialised.*launch"):
        require_world("my_entry")
    with pytest.raises(WorldError, match="ProcessGrid"):
        make_grid((1, 1))


def _grid_facts(grid):
    x = torch.tensor([float(grid.rank)])
    row_sum = x.clone()
    dist.all_reduce(row_sum, group=grid.row_group)
    col_sum = x.clone()
    dist.all_reduce(col_sum, group=grid.col_group)
    return grid.coords, grid.rank_of(grid.coords), grid.axis_ranks("cols"), row_sum.item(), col_sum.item()


@pytest.mark.grids((1, 1), (1, 3), (2, 3), (3, 2))
def test_grid_coordinates_and_subgroups(grid):
    rows, cols = grid
    for rank, (coords, back, row_ranks, row_sum, col_sum) in enumerate(run_on_grid(_grid_facts, grid)):
        assert coords == (rank // cols, rank % cols) and back == rank
        assert row_ranks == [coords[0] * cols + c for c in range(cols)]
        assert row_sum == sum(row_ranks)
        assert col_sum == sum(r * cols + coords[1] for r in range(rows))


def _bad_grid():
    make_grid((2, 2))


def test_grid_larger_than_world_is_a_clear_error_on_every_rank():
    with pytest.raises(RankFailure, match="grid 2x2 needs 4 ranks but the world has 3"):
        run_on_world(_bad_grid, 3)


def _rank_and_threads(offset):
    return dist.get_rank() + offset, torch.get_num_threads()


def test_launch_fresh_ranks():
    assert launch(_rank_and_threads, 2, 10) == [(10, 1), (11, 1)]


def _agreed_failure():
    with agree_step("validate input"):
        if dist.get_rank() == 2:
            raise ValueError("coordinates contain NaN")
    dist.barrier()


def test_fail_together_every_rank_raises_the_same_error():
    t = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 2 failed in step 'validate input'") as info:
        run_on_world(_agreed_failure, 4)
    assert "coordinates contain NaN" in str(info.value) and not info.value.stuck
    assert time.monotonic() - t < 10  # agreed, not timed out


def _check_all_fails():
    check_all(dist.get_rank() != 0, "box too small on rank 0")


def test_check_all():
    with pytest.raises(RankFailure, match="box too small on rank 0"):
        run_on_world(_check_all_fails, 3)


def _skips_collective():
    if dist.get_rank() != 1:
        dist.barrier()


def test_deadlock_fails_within_timeout_and_names_ranks():
    t = time.monotonic()
    with pytest.raises(RankFailure, match=r"ranks \[1\] finished normally") as info:
        run_on_world(_skips_collective, 3, timeout=3)
    assert time.monotonic() - t < 3 + 10
    err = info.value
    assert set(err.failures) | set(err.stuck) == {0, 2} and err.finished == (1,)
    assert "ranks [1] finished normally" in str(err)


def _busy_rank():
    if dist.get_rank() == 0:
        time.sleep(60)


def test_stuck_rank_is_named_and_stopped():
    with pytest.raises(
        RankFailure, match=r"no result from ranks \[0\] within the job.s time limit of 2 s"
    ) as info:
        run_on_world(_busy_rank, 2, timeout=2)
    assert info.value.finished == (1,)
    assert run_on_world(_rank_and_threads, 2, 0) == [(0, 1), (1, 1)]  # the pool recovers


def _profiled_collective_keeps_no_group():
    import sys

    import torch.distributed.nn.functional as dnn

    from twinshard.memory import peak_memory_during

    pg = dist.group.WORLD
    before = sys.getrefcount(pg)
    x = torch.ones(3)
    peak_memory_during(lambda: dist.all_reduce(x), torch.device("cpu"))
    held = [
        name
        for name, fn in vars(dnn).items()
        if callable(fn)
        and any(isinstance(d, dist.ProcessGroup) for d in (getattr(fn, "__defaults__", None) or ()))
    ]
    return sys.getrefcount(pg) - before, held


def test_profiling_a_collective_leaves_the_group_destroyable():
    """The torch profiler imports torch.distributed.nn.functional on entry; imported while a world
    lives, its ``group=group.WORLD`` defaults would hold the default group for the life of the
    process, so destroy_process_group could not free it and gloo aborted at interpreter exit
    ("terminate called without an active exception"). runtime.world imports it before any world."""
    for extra, held in run_on_world(_profiled_collective_keeps_no_group, 2):
        assert held == [], f"torch.distributed.nn.functional defaults hold a process group: {held}"
        assert extra == 0, f"a profiled collective left {extra} references to the default process group"


def test_jobs_travel_by_value_where_pickle_cannot_import_them():
    scale = 10

    def nested(x):  # a closure: no importable name, so cloudpickle sends it by value
        return (get_world().rank + x) * scale

    assert run_on_world(nested, 2, 1) == [10, 20]
    assert run_on_world(lambda: get_world().size, 2) == [2, 2]
    import threading

    with pytest.raises(TypeError, match="job for the local ranks cannot be pickled.*no open files, locks"):
        run_on_world(nested, 2, threading.Lock())
