"""Feature distribution: any N and S on any grid, masks over padding, lossless collect."""

from __future__ import annotations

import pytest
import torch

from twinshard.pair.features import (
    MSA_MASK,
    PAIR_MASK,
    TOKEN_MASK,
    PairLayout,
    collect,
    collect_tensor,
    distribute,
    shard_tensor,
)
from twinshard.runtime import RankFailure
from twinshard.tensors.dtensor import MSA, PAIR, SAMPLE, SINGLE, local_block
from twinshard.testing import grid_id, random_grad_output, run_on_grid


def _features(n: int, s: int, with_masks: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n * 100 + s)
    b = 2
    f = {
        "z": torch.randn(b, n, n, 3, generator=g, dtype=torch.float64),
        "s": torch.randn(b, n, 4, generator=g, dtype=torch.float64),
        "msa": torch.randint(0, 33, (b, s, n), generator=g),
        "has_deletion": torch.rand(b, s, n, generator=g) > 0.5,  # bool travels as uint8
        "residue_index": torch.arange(n).expand(b, n).clone(),
        "num_tokens": torch.tensor([n, n]),
        "my_pair": torch.randn(b, n, n, generator=g, dtype=torch.float64),
    }
    if with_masks:
        tok = (torch.rand(b, n, generator=g) > 0.3).double()
        f[TOKEN_MASK] = tok
        f[PAIR_MASK] = (torch.rand(b, n, n, generator=g) > 0.2).double() * tok[:, :, None]
    return f


_PL = {"single": SINGLE, "pair": PAIR, "msa": MSA, "sample": SAMPLE}


def _rank_roundtrip(grid, n, s, src, with_masks):
    f = _features(n, s, with_masks)
    given = f if src is None or grid.rank == src else None
    d = distribute(given, grid, src=src, kinds={"my_pair": "pair"})
    lay = d.layout
    back = collect(d)
    out = {"keys": sorted(back), "added": lay.added, "n_padded": lay.n_padded, "s_padded": lay.s_padded}
    out["equal"] = {k: bool(torch.equal(back[k], f[k])) and back[k].dtype == f[k].dtype for k in f}
    # The masks, in full (padding included), and this rank's tiles of z.
    full = {k: local_block(lay.pad(f[k], lay.kinds[k]), grid, _PL[lay.kinds[k]]) for k in f}
    out["tiles_match"] = {k: bool(torch.equal(d[k].to_local(), full[k])) for k in f}
    out["placements"] = {k: tuple(d[k].placements) for k in d}
    out["masks"] = {
        k: collect_tensor(
            d[k],
            PairLayout(lay.grid_shape, lay.n_padded, lay.n_padded, lay.s_padded, lay.s_padded),
            lay.kinds[k],
        )
        for k in (TOKEN_MASK, PAIR_MASK, MSA_MASK)
    }
    out["z_tile"] = d["z"].to_local()
    return out


CASES = [((1, 1), 5, 3), ((2, 3), 7, 5), ((3, 3), 7, 4), ((2, 2), 13, 2)]


@pytest.mark.parametrize("src", [None, "last"], ids=["all-ranks", "from-last-rank"])
@pytest.mark.parametrize("shape,n,s", CASES, ids=[f"{grid_id(c[0])}-N{c[1]}-S{c[2]}" for c in CASES])
def test_roundtrip_and_masks(shape, n, s, src):
    with_masks = n % 2 == 1  # caller-given masks in some cases, added masks in the others
    src_rank = None if src is None else shape[0] * shape[1] - 1
    results = run_on_grid(_rank_roundtrip, shape, n, s, src_rank, with_masks)
    f = _features(n, s, with_masks)
    np_, sp = results[0]["n_padded"], results[0]["s_padded"]
    assert np_ % shape[0] == 0 and np_ % shape[1] == 0 and np_ >= n and sp % shape[0] == 0
    if shape != (1, 1):  # the tiles differ between ranks: sharding is active
        assert not torch.equal(results[0]["z_tile"], results[-1]["z_tile"])
    tok = torch.zeros(2, np_, dtype=torch.float64)
    tok[:, :n] = f[TOKEN_MASK] if with_masks else 1.0
    if with_masks:
        pair = torch.zeros(2, np_, np_, dtype=torch.float64)
        pair[:, :n, :n] = f[PAIR_MASK]
    else:
        pair = tok[:, :, None] * tok[:, None, :]
    seq = torch.zeros(sp, dtype=torch.float64)
    seq[:s] = 1
    msa = seq[None, :, None] * tok[:, None, :]
    for res in results:
        assert res["keys"] == sorted(f), "collect returns exactly the caller's keys"
        assert all(res["equal"].values()), res["equal"]
        assert all(res["tiles_match"].values()), res["tiles_match"]
        assert set(res["added"]) == {MSA_MASK} | (set() if with_masks else {TOKEN_MASK, PAIR_MASK})
        assert res["placements"]["z"] == PAIR and res["placements"]["s"] == SINGLE
        assert res["placements"]["msa"] == MSA and res["placements"]["num_tokens"] == SAMPLE
        assert res["placements"][PAIR_MASK] == PAIR and res["placements"][MSA_MASK] == MSA
        torch.testing.assert_close(res["masks"][TOKEN_MASK], tok, rtol=0, atol=0)
        torch.testing.assert_close(res["masks"][PAIR_MASK], pair, rtol=0, atol=0)
        torch.testing.assert_close(res["masks"][MSA_MASK], msa, rtol=0, atol=0)


def _rank_collect_adjoint(grid, n):
    """collect's backward hands each rank its own tile of the (replicated) gradient."""
    lay = PairLayout.for_sizes(n, grid)
    x = torch.randn(1, n, n, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    s = torch.randn(1, n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    xd = shard_tensor(x, "pair", grid, lay).detach().requires_grad_(True)
    sd = shard_tensor(s, "single", grid, lay).detach().requires_grad_(True)
    gx, gs = random_grad_output(x, seed=3), random_grad_output(s, seed=4)
    torch.autograd.backward([collect_tensor(xd, lay, "pair"), collect_tensor(sd, lay, "single")], [gx, gs])
    want_x = local_block(lay.pad(gx, "pair"), grid, PAIR)
    want_s = local_block(lay.pad(gs, "single"), grid, SINGLE)
    return bool(torch.equal(xd.grad.to_local(), want_x)), bool(torch.equal(sd.grad.to_local(), want_s))


@pytest.mark.parametrize("shape,n", [((2, 3), 7), ((3, 3), 7)], ids=["2x3", "3x3"])
def test_collect_adjoint_slices_replicated_gradient(shape, n):
    assert all(ok == (True, True) for ok in run_on_grid(_rank_collect_adjoint, shape, n))


def _rank_bad(grid, case):
    f = _features(5, 2, False)
    src = None
    if case == "unknown":
        f["mystery"] = torch.zeros(2, 5)
    elif case == "n_mismatch":
        f["s"] = torch.zeros(2, 6, 4)
    elif case == "src_without_data":
        src, f = 0, None
    elif case == "unknown_from_src":
        src = grid.size - 1
        f["mystery"] = torch.zeros(2, 5)
        f = f if grid.rank == src else None
    elif case == "ranks_disagree":
        f["z"] = f["z"][:, :, :, : 1 + grid.rank % 2]
    elif case == "tiny":
        f = {"z": torch.zeros(1, 2, 2, 1)}
    distribute(f, grid, src=src, kinds={"my_pair": "pair"})


@pytest.mark.parametrize(
    "case,shape,match",
    [
        ("unknown", (2, 2), "'mystery' is not in twinshard.pair.features.PLACEMENT_TABLE"),
        ("n_mismatch", (2, 2), "disagree on the token count"),
        ("src_without_data", (2, 2), "must pass the features"),
        ("unknown_from_src", (2, 3), "mystery"),
        ("ranks_disagree", (1, 2), r"ranks \[1\] differ from rank 0"),
        ("tiny", (3, 3), "use a smaller grid"),
    ],
)
def test_bad_input_fails_on_every_rank(case, shape, match):
    with pytest.raises(RankFailure, match=match) as info:
        run_on_grid(_rank_bad, shape, case)
    # Every rank raised in the agreed step (no rank was left stuck in a collective).
    assert info.value.step == "pair.features.distribute"
    assert not info.value.stuck
