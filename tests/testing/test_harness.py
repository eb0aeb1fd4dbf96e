"""The harness passes a correct twin on every grid shape and fails each planted bug."""

import pytest

from twinshard.runtime import RankFailure
from twinshard.testing import check_twin, grid_id, run_on_grid
from twinshard.testing.evidence import LINES
from twinshard.testing.example import run_example_twin, serial_example


@pytest.mark.grids((1, 1), (2, 2), (1, 3), (2, 3), (3, 3))
def test_example_twin_matches_serial(grid):
    n = 7  # uneven on every grid here; on 3x3 one block has a single row
    ranks = run_on_grid(run_example_twin, grid, n=n)
    before = len(LINES)
    evs = check_twin(what="pair MLP", grid=grid_id(grid), ranks=ranks, **serial_example(n=n))
    assert len(evs) == 1 + 1 + 4 and len(LINES) == before + len(evs)
    assert ("sharded" in evs[0].checks) == (grid != (1, 1))


def _check(grid, bug=None, zero=False, uniform=False, n=7):
    ranks = run_on_grid(run_example_twin, grid, n=n, bug=bug, zero_param=zero)
    check_twin(
        what="pair MLP",
        grid=grid_id(grid),
        ranks=ranks,
        **serial_example(n=n, zero_param=zero, uniform_grad=uniform),
    )


# Negative controls: each planted bug must make the harness fail with the right message.
def test_negative_missing_gradient_all_reduce():
    with pytest.raises(
        AssertionError, match=r"parameter gradients\[linear_1.weight\] is not replicated.*missing all-reduce"
    ):
        _check((2, 2), bug="missing_grad_reduce")


def test_negative_missing_gradient_all_reduce_on_a_row():
    # on 1 x 2 the per-rank gradients differ too; the parity of a single rank's copy would fail as well
    with pytest.raises(AssertionError, match="not replicated"):
        _check((1, 2), bug="missing_grad_reduce")


def test_negative_transposed_tile():
    with pytest.raises(AssertionError, match=r"parity of pair MLP output on grid 2x2 fails"):
        _check((2, 2), bug="transposed_tile", n=8)  # square tiles: the bug keeps shapes


def test_negative_uniform_grad_output():
    with pytest.raises(AssertionError, match=r"grad_output is uniform \(as from .sum\(\).backward\(\)\)"):
        _check((2, 2), uniform=True)


def test_negative_all_zero_parameter():
    with pytest.raises(
        AssertionError, match=r"parameter linear_2.weight is all zeros.*perturb_zero_parameters"
    ):
        _check((2, 2), zero=True)


def test_negative_sharded_tensor_identical_on_every_rank():
    with pytest.raises(
        AssertionError, match=r"pair MLP: z is not sharded: every one of the 4 ranks holds the same"
    ):
        _check((2, 2), bug="replicated_input")


def test_negative_rank_raises_before_a_collective():
    with pytest.raises(RankFailure, match=r"rank 1 failed") as info:
        _check((2, 2), bug="raise_on_rank_1")
    assert "planted failure on rank 1" in str(info.value)
    assert info.value.rank == 1
