"""The harness passes a correct twin on every grid shape and fails each planted bug.

The bugs are planted here, in subclasses of the worked example's twin and in rank functions of
this module (the workers import it by name), never through switches in the library."""

import pytest
import torch.nn.functional as F

from twinshard.runtime import ProcessGrid, RankFailure
from twinshard.testing import TwinResult, check_twin, grid_id, run_on_grid
from twinshard.testing.evidence import LINES
from twinshard.testing.example import TiledPairMLP, run_example_twin, serial_example


@pytest.mark.grids((1, 1), (2, 2), (1, 3), (2, 3), (3, 3))
def test_example_twin_matches_serial(grid):
    ranks = run_on_grid(run_example_twin, grid)  # N = 13: padded on every grid here
    before = len(LINES)
    evs = check_twin(what="pair MLP", grid=grid_id(grid), ranks=ranks, **serial_example())
    assert len(evs) == 1 + 1 + 4 and len(LINES) == before + len(evs)
    assert ("sharded" in evs[0].checks) == (grid != (1, 1))


class _NoGradReduce(TiledPairMLP):
    """Planted: replicated parameters used without sync_grad (their gradients never summed)."""

    def forward(self, z):
        h = F.gelu(self.linear_1(z))
        return z + self.linear_2(h)


class _TransposedTile(TiledPairMLP):
    """Planted: the output tile comes back transposed."""

    def forward(self, z):
        return super().forward(z).transpose(0, 1)


def _replicated_rank(grid: ProcessGrid) -> TwinResult:
    """Planted: every rank runs the serial module on the whole input and calls it its shard."""
    res = run_example_twin(grid)
    everything = (slice(None),)
    ser = serial_example()
    res.shards = {"z": (ser["serial_inputs"]["z"], everything), "out": (ser["serial_out"], everything)}
    return res


def _raising_rank(grid: ProcessGrid) -> TwinResult:
    if grid.rank == 1:
        raise ValueError("planted failure on rank 1 before the first collective")
    return run_example_twin(grid)


def _check(grid, rank_fn=run_example_twin, zero=False, uniform=False, **kw):
    ranks = run_on_grid(rank_fn, grid, **kw)
    check_twin(
        what="pair MLP",
        grid=grid_id(grid),
        ranks=ranks,
        **serial_example(zero_param=zero, uniform_grad=uniform),
    )


# Negative controls: each planted bug must make the harness fail with the right message.
def test_negative_missing_gradient_all_reduce():
    with pytest.raises(
        AssertionError, match=r"parameter gradients\[linear_1.weight\] is not replicated.*missing all-reduce"
    ):
        _check((2, 2), twin=_NoGradReduce)


def test_negative_missing_gradient_all_reduce_on_a_row():
    # on 1 x 2 the per-rank gradients differ too; the parity of a single rank's copy would fail as well
    with pytest.raises(AssertionError, match="not replicated"):
        _check((1, 2), twin=_NoGradReduce)


def test_negative_transposed_tile():
    # caught first by the sharding evidence: the returned output tile is not the serial output there
    with pytest.raises(
        AssertionError, match=r"pair MLP: out: rank 0's piece differs from the full tensor at its index"
    ):
        _check((2, 2), twin=_TransposedTile, n=12)  # square tiles: the bug keeps shapes


def test_negative_uniform_grad_output():
    with pytest.raises(AssertionError, match=r"grad_output is uniform \(as from .sum\(\).backward\(\)\)"):
        _check((2, 2), uniform=True)


def test_negative_all_zero_parameter():
    with pytest.raises(
        AssertionError, match=r"parameter linear_2.weight is all zeros.*perturb_zero_parameters"
    ):
        _check((2, 2), zero=True, zero_param=True)


def test_negative_sharded_tensor_identical_on_every_rank():
    with pytest.raises(
        AssertionError,
        match=r"pair MLP: (out|z) is not sharded: rank 0 holds \d+ elements, as many as the full",
    ):
        _check((2, 2), rank_fn=_replicated_rank)


def test_negative_rank_raises_before_a_collective():
    with pytest.raises(RankFailure, match=r"rank 1 failed") as info:
        _check((2, 2), rank_fn=_raising_rank)
    assert "planted failure on rank 1" in str(info.value)
    assert info.value.rank == 1
