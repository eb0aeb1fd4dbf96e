"""Feature distribution: any N and S on any grid, masks over padding, lossless collect."""

from __future__ import annotations

import pytest
import torch

from twinshard.comm import primitives as P
from twinshard.pair.features import (
    MSA_MASK,
    PAIR_MASK,
    TOKEN_MASK,
    PairLayout,
    collect,
    collect_grad,
    collect_tensor,
    distribute,
    layout_kind,
    layout_of,
    padding_keep,
    real_part,
    shard_tensor,
    with_layout,
)
from twinshard.pair.tiling import MSA, PAIR, SAMPLE, SINGLE, from_local, local_block
from twinshard.runtime import RankFailure
from twinshard.testing import assert_parity, grid_id, random_grad_output, run_on_grid
from twinshard.testing.checks import assert_shards_cover


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
    out = {"keys": sorted(back), "added": lay.added, "padded": lay.padded, "s_padded": lay.s_padded}
    out["equal"] = {k: bool(torch.equal(back[k], f[k])) and back[k].dtype == f[k].dtype for k in f}
    # The masks, in full (padding included), and this rank's tiles of z.
    full = {k: local_block(lay.pad(f[k], lay.kinds[k]), grid, _PL[lay.kinds[k]]) for k in f}
    out["tiles_match"] = {k: bool(torch.equal(d[k].to_local(), full[k])) for k in f}
    out["placements"] = {k: tuple(d[k].placements) for k in d}
    out["masks"] = {
        k: collect_tensor(
            d[k],
            PairLayout(lay.grid_shape, max(lay.padded), lay.padded, lay.s_padded, lay.s_padded),
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
    (nr, nc), sp = results[0]["padded"], results[0]["s_padded"]
    assert (nr, nc) == tuple(-(-n // k) * k for k in shape) and sp % shape[0] == 0
    if shape != (1, 1):  # the tiles differ between ranks: sharding is active
        assert not torch.equal(results[0]["z_tile"], results[-1]["z_tile"])
    tok = torch.zeros(2, max(nr, nc), dtype=torch.float64)
    tok[:, :n] = f[TOKEN_MASK] if with_masks else 1.0
    if with_masks:
        pair = torch.zeros(2, nr, nc, dtype=torch.float64)
        pair[:, :n, :n] = f[PAIR_MASK]
    else:
        pair = tok[:, :nr, None] * tok[:, None, :nc]
    seq = torch.zeros(sp, dtype=torch.float64)
    seq[:s] = 1
    msa = seq[None, :, None] * tok[:, None, :nc]
    tok = tok[:, :nr]
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


# -- the layout travels with the tensors; gradients are never dropped ---------------------------


def _rank_layout(grid, n, s):
    f = _features(n, s, False)
    d = distribute(f, grid, kinds={"my_pair": "pair"})
    out = {"attached": {k: (layout_of(v) == d.layout, layout_kind(v)) for k, v in d.items()}}
    z = d["z"]
    out["plain_op_drops"] = layout_of(z + z) is None  # why with_layout exists
    back = with_layout(z + 1.0, z)  # padding zeroed, layout back
    keep = padding_keep(back, d.layout, "pair")
    local = back.to_local()
    out["pad_zero"] = keep is None or bool(
        (local.masked_select(~keep[..., None].expand(local.shape)) == 0).all()
    )
    out["z_piece"] = real_part(d["z"])
    out["m_piece"] = real_part(d["msa"])
    try:
        with_layout(d["s"], d.layout, "pair")
        out["wrong_kind"] = None
    except ValueError as e:
        out["wrong_kind"] = str(e)
    return out


def test_layout_attached_to_every_distributed_tensor_and_real_part_covers():
    shape, n, s = (2, 3), 13, 5
    results = run_on_grid(_rank_layout, shape, n, s)
    f = _features(n, s, False)
    for res in results:
        assert all(same for same, _ in res["attached"].values()), res["attached"]
        assert res["attached"]["z"][1] == "pair" and res["attached"]["msa"][1] == "msa"
        assert res["attached"][TOKEN_MASK][1] == "single"
        assert res["plain_op_drops"] and res["pad_zero"]
        assert res["wrong_kind"] is not None and "placements" in res["wrong_kind"]
    assert_shards_cover([r["z_piece"] for r in results], f["z"], "z")
    msa_pieces = [(local.double(), index) for local, index in (r["m_piece"] for r in results)]
    assert_shards_cover(msa_pieces, f["msa"].double(), "msa")  # token ids: compared as floats


def _rank_src_grad(grid):
    f = _features(5, 2, False)
    f["z"].requires_grad_(True)
    distribute(f if grid.rank == 0 else None, grid, src=0)


def test_distribute_from_src_raises_on_every_rank_when_inputs_require_grad():
    with pytest.raises(RankFailure, match=r"distribute\(src=0\) scatters data without autograd") as info:
        run_on_grid(_rank_src_grad, (2, 2))
    assert info.value.step == "pair.features.distribute" and not info.value.stuck


def _rank_partial_grads(grid, n, collector):
    """Each rank's gradient of its own copy covers its own tile; the collector sums them."""
    g = torch.Generator().manual_seed(5)
    f = {
        k: torch.randn(2, *sh, generator=g, dtype=torch.float64).requires_grad_(True)
        for k, sh in (("z", (n, n, 3)), ("s", (n, 4)), ("m", (3, n, 2)))
    }
    d = distribute(f, grid)
    outs = [collect_tensor(d[k]) ** 2 for k in ("z", "s", "m")]  # non-linear: grad = 2 x dy
    torch.autograd.backward(outs, [random_grad_output(o, seed=i) for i, o in enumerate(outs)])
    kinds = {"z": "pair", "s": "single", "m": "msa"}
    if collector == "world_sum":  # planted: sum over every rank, also along replicated axes
        return {k: P.all_reduce(f[k].grad) for k in f}
    return {k: collect_grad(f[k].grad, kinds[k], grid) for k in f}


def _check_partial_grads(shape, n, results):
    g = torch.Generator().manual_seed(5)
    f = {
        k: torch.randn(2, *sh, generator=g, dtype=torch.float64)
        for k, sh in (("z", (n, n, 3)), ("s", (n, 4)), ("m", (3, n, 2)))
    }
    for i, k in enumerate(("z", "s", "m")):
        want = 2 * f[k] * random_grad_output(f[k], seed=i)
        for r, res in enumerate(results):
            assert_parity(res[k], want, what=f"collect_grad of {k} (rank {r})", grid=grid_id(shape))


@pytest.mark.parametrize("shape,n", [((2, 3), 13), ((3, 3), 7)], ids=["2x3", "3x3"])
def test_collect_grad_sums_per_tile_partial_gradients(shape, n):
    _check_partial_grads(shape, n, run_on_grid(_rank_partial_grads, shape, n, "collect_grad"))


def test_negative_control_gradient_summed_over_replicated_axis():
    """Summing the single representation's gradient over the whole grid counts it once per grid
    column (3 x on 2x3): caught."""
    results = run_on_grid(_rank_partial_grads, (2, 3), 13, "world_sum")
    with pytest.raises(AssertionError, match=r"parity of collect_grad of s \(rank 0\) on grid 2x3 fails"):
        _check_partial_grads((2, 3), 13, results)


def _rank_zero_padding_adjoint(grid, n):
    """with_layout's zeroing: its adjoint masks a gradient that is non-zero on the padding, and
    passes one that is zero there on as it is (no copy: the hook sees the caller's tensor)."""
    lay = PairLayout.for_sizes(n, grid)
    shape = (1, lay.padded[0] // grid.rows, lay.padded[1] // grid.cols, 2)
    gen = torch.Generator().manual_seed(7 + grid.rank)
    x = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    y = with_layout(from_local(x, grid, PAIR), lay, "pair")
    keep = padding_keep(y, lay, "pair")
    if keep is None:  # a tile without padding: nothing to mask
        return None
    keep = keep.unsqueeze(-1)
    junk = torch.randn(shape, generator=gen, dtype=torch.float64)  # non-zero on the padding too
    clean = junk * keep  # zero on the padding
    seen = []
    x.register_hook(lambda g: seen.append(g))
    y.to_local().backward(junk, retain_graph=True)
    masked = torch.equal(x.grad, junk * keep) and bool(junk[~keep.expand(shape)].ne(0).all())
    x.grad = None
    y.to_local().backward(clean)
    return masked, seen[-1].data_ptr() == clean.data_ptr() and torch.equal(x.grad, clean)


def test_zero_padding_adjoint_masks_only_when_needed():
    # 2x3, N = 7: z is 8 x 9; the tiles of grid row 1 and of grid column 2 hold padding
    ranks = run_on_grid(_rank_zero_padding_adjoint, (2, 3), 7)
    assert [r is None for r in ranks] == [True, True, False, False, False, False]
    for rank, (masked, passed) in enumerate(ranks[2:], start=2):
        assert masked, f"rank {rank}: a gradient non-zero on the padding reached x unmasked"
        assert passed, f"rank {rank}: a gradient zero on the padding was copied or changed"
