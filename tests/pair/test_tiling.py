"""DTensor boundary helpers: padding policy, tiles, from_local, placement checks."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from twinshard.pair.tiling import (
    MSA,
    PAIR,
    SINGLE,
    block_range,
    check_placements,
    from_local,
    local_block,
    local_offsets,
    pad_dim,
    pad_multiple,
    padded_sequences,
    padded_tokens,
    padding_mask,
    reduction_axes,
    unpad,
)
from twinshard.testing import grid_id, run_on_grid


@pytest.mark.parametrize(
    "n,shape,want",
    [
        (7, (1, 1), (7, 7)),
        (13, (2, 2), (14, 14)),
        (7, (3, 3), (9, 9)),
        (7, (2, 3), (8, 9)),
        (25, (2, 3), (26, 27)),
        (6, (2, 3), (6, 6)),
        (5, (1, 2), (5, 6)),
    ],
)
def test_padded_tokens_per_grid_axis(n, shape, want):
    """N is padded to a multiple of rows along grid rows and of cols along grid columns (not to
    a multiple of lcm(rows, cols) on both): the least a 2-D block tiling can hold."""
    got = padded_tokens(n, shape)
    assert got == want
    for size, parts in zip(got, shape):
        assert size % parts == 0 and 0 <= size - n < parts


def test_padding_helpers():
    assert padded_sequences(5, (2, 3)) == 6 and padded_sequences(4, (2, 3)) == 4
    assert pad_multiple(1, 4) == 4
    with pytest.raises(ValueError, match=r"sizes must be positive, got n=0, multiple=4"):
        pad_multiple(0, 4)
    m = padding_mask(3, 5)
    assert m.tolist() == [1, 1, 1, 0, 0] and m.dtype == torch.float64
    x = torch.randn(2, 3, 3, 4, dtype=torch.float64, requires_grad=True)
    y = pad_dim(pad_dim(x, 1, 5), 2, 5)
    assert y.shape == (2, 5, 5, 4) and not y[:, 3:].any() and not y[:, :, 3:].any()
    assert torch.equal(unpad(y, {1: 3, 2: 3}), x)
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(x.grad, g[:, :3, :3])  # the adjoint of padding is the slice
    assert pad_dim(x, 1, 3) is x
    with pytest.raises(ValueError, match="cannot pad"):
        pad_dim(x, 1, 2)
    assert block_range(12, 3, 2) == (8, 12)
    with pytest.raises(ValueError, match="pad it first"):
        block_range(13, 2, 0)
    assert reduction_axes(PAIR) == (0, 1) and reduction_axes(SINGLE) == (0,)
    assert reduction_axes((Replicate(), Replicate())) == ()


def _rank_tiles(grid):
    """Tiles, offsets and DTensor metadata of a pair, single and MSA tensor on this rank."""
    r, c = grid.coords
    R, C = grid.shape
    n = pad_multiple(7, R * C)  # square and divisible on both axes
    z = torch.arange(2 * n * n * 3, dtype=torch.float64).view(2, n, n, 3)
    s = torch.arange(2 * n * 4, dtype=torch.float64).view(2, n, 4)
    m = torch.arange(1 * 2 * R * n * 2, dtype=torch.float64).view(1, 2 * R, n, 2)
    out = {}
    for name, full, pl in (("z", z, PAIR), ("s", s, SINGLE), ("m", m, MSA)):
        loc = local_block(full, grid, pl)
        d = from_local(loc, grid, pl)  # global shape inferred from equal tiles
        d2 = from_local(loc, grid, pl, global_shape=full.shape)
        off = local_offsets(full.shape, grid, pl)
        ok = torch.equal(d.full_tensor(), full) and d2.shape == full.shape
        out[name] = (tuple(d.shape), d.stride(), off, ok, tuple(loc.shape))
    errs = {}
    zl = local_block(z, grid, PAIR)
    for key, fn in {
        "wrong_global": lambda: from_local(zl, grid, PAIR, global_shape=(2, n + 1, n, 3)),
        "plain": lambda: check_placements(zl, PAIR, "z"),
        "wrong_pl": lambda: check_placements(from_local(zl, grid, PAIR), SINGLE, "z"),
        "partial": lambda: from_local(zl, grid, (Partial(), Shard(2))),
        "twice": lambda: from_local(zl, grid, (Shard(1), Shard(1))),
        "ndim": lambda: check_placements(from_local(zl, grid, PAIR), PAIR, "z", ndim=3),
    }.items():
        try:
            fn()
            errs[key] = None
        except (TypeError, ValueError) as e:
            errs[key] = f"{type(e).__name__}: {e}"
    ok = check_placements(from_local(zl, grid, PAIR), PAIR, "z", grid=grid)
    out["check_ok"] = isinstance(ok, DTensor)
    out["errs"] = errs
    out["coords"] = (r, c, R, C, n)
    return out


@pytest.mark.parametrize("shape", [(1, 1), (2, 3), (3, 3)], ids=grid_id)
def test_tiles_and_checks_on_grid(shape):
    for res in run_on_grid(_rank_tiles, shape):
        r, c, R, C, n = res["coords"]
        assert res["z"][0] == (2, n, n, 3) and res["z"][1] == (n * n * 3, n * 3, 3, 1)
        assert res["z"][2] == (0, r * n // R, c * n // C, 0) and res["z"][4] == (2, n // R, n // C, 3)
        assert res["s"][2] == (0, r * n // R, 0) and res["s"][4] == (2, n // R, 4)
        assert res["m"][2] == (0, r * 2, c * n // C, 0)
        assert all(res[k][3] for k in ("z", "s", "m"))
        assert res["check_ok"]
        e = res["errs"]
        assert "tiles must be equal" in e["wrong_global"]
        assert e["plain"].startswith("TypeError") and "must be a DTensor" in e["plain"]
        assert "needs (Shard(dim=1), Replicate())" in e["wrong_pl"]
        assert "Partial placements are not accepted" in e["partial"]
        assert "sharded over two mesh axes" in e["twice"]
        assert "must have 3 dims" in e["ndim"]
