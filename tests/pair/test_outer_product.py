"""Outer product mean: serial reference against naive loops, CP twin against serial."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from twinshard.pair.features import PairLayout, collect_grad, collect_tensor, real_part, shard_tensor
from twinshard.pair.layers import contraction, stationary
from twinshard.pair.layers.outer_product import CPOuterProductMean
from twinshard.pair.reference.outer_product import OuterProductMean
from twinshard.testing import (
    TwinResult,
    check_twin,
    grid_id,
    parameter_signature,
    perturb_zero_parameters,
    random_grad_output,
    random_mask,
    randomize_parameters,
    run_on_grid,
    serial_reference,
    synthetic,
)


def test_opm_matches_naive_loops():
    torch.manual_seed(7)
    mod = OuterProductMean(5, 3, 4).double()
    randomize_parameters(mod, 8)
    B, S, N = 2, 4, 5
    m = torch.randn(B, S, N, 5, dtype=torch.float64)
    mask = (torch.rand(B, S, N) > 0.3).double()
    mask[0, :, 2] = 0  # token 2 absent in every sequence: count clamps to one
    out = torch.empty(B, N, N, 4, dtype=torch.float64)
    for bb in range(B):
        x = torch.nn.functional.layer_norm(m[bb], (5,), mod.norm.weight, mod.norm.bias)
        a = (x @ mod.proj_a.weight.T) * mask[bb][..., None]
        b = (x @ mod.proj_b.weight.T) * mask[bb][..., None]
        for i in range(N):
            for j in range(N):
                acc = torch.zeros(3, 3, dtype=torch.float64)
                cnt = 0.0
                for s in range(S):
                    acc += torch.outer(a[s, i], b[s, j])
                    cnt += float(mask[bb, s, i] * mask[bb, s, j])
                flat = (acc / max(cnt, 1.0)).reshape(9)
                out[bb, i, j] = flat @ mod.proj_o.weight.T + mod.proj_o.bias
    assert_close(mod(m, mask), out)


def test_opm_names_init_and_masked_sequences():
    mod = OuterProductMean(6, 2, 3)
    assert [n for n, _ in mod.named_parameters()] == [
        "norm.weight",
        "norm.bias",
        "proj_a.weight",
        "proj_b.weight",
        "proj_o.weight",
        "proj_o.bias",
    ]
    assert torch.count_nonzero(mod.proj_o.weight) == 0 and torch.count_nonzero(mod.proj_o.bias) == 0
    mod = mod.double()
    randomize_parameters(mod, 9)
    m = torch.randn(1, 3, 4, 6, dtype=torch.float64)
    mask = torch.ones(1, 3, 4, dtype=torch.float64)
    mask[:, 2] = 0  # a fully masked sequence changes nothing, whatever it holds
    m2 = m.clone()
    m2[:, 2] = torch.randn(4, 6, dtype=torch.float64)
    assert_close(mod(m, mask), mod(m2, mask))
    assert_close(mod(m, mask), mod(m[:, :2], mask[:, :2]))


def test_opm_shape_errors():
    with pytest.raises(ValueError, match="mask"):
        OuterProductMean(4, 2, 2)(torch.randn(1, 2, 3, 4), torch.ones(1, 3, 2))
    with pytest.raises(ValueError, match="MSA"):
        OuterProductMean(4, 2, 2)(torch.randn(2, 3, 5))


# -- CP twin against serial ---------------------------------------------------------------------

CM, H, CZ = 5, 3, 4  # MSA channels, hidden, pair channels


def _serial_opm() -> OuterProductMean:
    torch.manual_seed(31)
    m = OuterProductMean(CM, H, CZ).double()
    perturb_zero_parameters(m)  # proj_o starts at zero ("final" init)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def _inputs(b: int, s: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    m = synthetic(b, s, n, CM, seed=3)
    mask = random_mask(b, s, n, seed=8, keep=0.75)
    mask[:, :, -1] = 0  # the last token absent from every sequence: its pair counts clamp to one
    return m, mask


def _no_transpose(t, trans):
    return t  # planted bug: a mirrored tile used untransposed


def _drop_received_partial(received, part):
    return part  # planted bug: the partial that travelled the ring is dropped, not summed


def _rank_opm(grid, b, s, n, bug=None):
    saved = contraction._orient, stationary._merge_partial
    if bug == "transpose":  # test scope: restored below, even on error
        contraction._orient = _no_transpose
    elif bug == "partial":
        stationary._merge_partial = _drop_received_partial
    try:
        serial = _serial_opm()
        twin = CPOuterProductMean(CM, H, CZ).double()
        twin.load_state_dict(serial.state_dict())
        layout = PairLayout.for_sizes(n, grid, n_seqs=s)
        m, mask = _inputs(b, s, n)
        m.requires_grad_(True)
        md = shard_tensor(m, "msa", grid, layout)
        out = twin(md, shard_tensor(mask, "msa", grid, layout))
        full = collect_tensor(out)
        full.backward(random_grad_output(full, seed=4))
        return TwinResult(
            out=full.detach(),
            grads_in={"m": collect_grad(m.grad, "msa", grid)},  # each rank's m.grad: its tile
            param_grads={k: v.grad for k, v in twin.named_parameters()},
            shards={"m": real_part(md), "out": real_part(out)},
            params=parameter_signature(twin),
        )
    finally:
        contraction._orient, stationary._merge_partial = saved


def _check(grid, b, s, n, ranks):
    serial = _serial_opm()
    m, mask = _inputs(b, s, n)
    check_twin(
        what=f"opm S={s} N={n} B={b}",
        grid=grid_id(grid),
        ranks=ranks,
        **serial_reference(serial, lambda m: serial(m, mask), {"m": m}, grad_seed=4),
    )


# (grid, S, N, B): S and N divisible by the grid and not; no grid row or column left with
# padding only (every rank holds real data).
CASES = [
    ((1, 1), 3, 5, 1),
    ((2, 2), 4, 8, 2),
    ((2, 2), 5, 13, 1),
    ((3, 3), 7, 7, 1),
    ((1, 2), 3, 6, 1),
    ((2, 3), 5, 13, 1),
    ((3, 2), 5, 13, 1),
]


@pytest.mark.parametrize("grid,s,n,b", CASES, ids=[f"{grid_id(g)}-S{s}-N{n}" for g, s, n, _ in CASES])
def test_cp_opm_matches_serial(grid, s, n, b):
    _check(grid, b, s, n, run_on_grid(_rank_opm, grid, b, s, n))


def test_cp_opm_negative_control_transposed_tile():
    grid, s, n = (2, 2), 4, 4  # square MSA tiles, so the planted bug runs and must fail parity
    ranks = run_on_grid(_rank_opm, grid, 1, s, n, "transpose")
    with pytest.raises(AssertionError, match=r"opm S=4 N=4 B=1: out: rank \d's piece differs"):
        _check(grid, 1, s, n, ranks)


def test_cp_opm_negative_control_dropped_partial():
    # The backward's partial gradients travel while the next product runs (overlap); a partial
    # received and then dropped instead of summed must show in the MSA gradient.
    grid, s, n = (2, 2), 4, 4
    ranks = run_on_grid(_rank_opm, grid, 1, s, n, "partial")
    with pytest.raises(AssertionError, match=r"parity of opm S=4 N=4 B=1 d/dm on grid 2x2 fails"):
        _check(grid, 1, s, n, ranks)
