"""The worked example follows the library's padding policy: equal tiles, padding inert, cut back."""

import pytest

from twinshard.pair.tiling import padded_tokens
from twinshard.testing import check_twin, grid_id, run_on_grid, synthetic
from twinshard.testing.example import run_example_twin, serial_example, tile_of


def _rank_tile_shape(grid, n):
    return tuple(tile_of(synthetic(n, n, 4, seed=1), grid).shape)


@pytest.mark.parametrize("shape,n", [((2, 3), 13), ((3, 3), 7), ((2, 2), 13)], ids=["2x3", "3x3", "2x2"])
def test_example_pads_to_equal_tiles_and_matches_serial(shape, n):
    tiles = run_on_grid(_rank_tile_shape, shape, n)
    nr, nc = padded_tokens(n, shape)
    assert set(tiles) == {(nr // shape[0], nc // shape[1], 4)}  # one tile shape on every rank
    ranks = run_on_grid(run_example_twin, shape, n=n)
    evs = check_twin(what=f"pair MLP N={n}", grid=grid_id(shape), ranks=ranks, **serial_example(n=n))
    assert "sharded" in evs[0].checks and ranks[0].out.shape == (n, n, 4)  # padding cut back
