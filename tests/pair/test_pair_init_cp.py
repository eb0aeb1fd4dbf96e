"""CP pair initialisation (``CPPairInit`` and its parts) against the serial ``PairInit``.

What each test proves:
- ``test_column_block_moves``: ``column_block`` gives every rank the rows of its column block of a
  single tensor (dim 1) and of a template tensor (dim 2), zero beyond Nr, on 2x3 and 3x2 grids;
  its adjoint returns each piece's gradient to its owner.
- ``test_cp_pair_init_matches_serial``: ``s_init`` and ``z_init`` (outer sum, relative positions
  with Boltz-2's released options fix_sym_check and cyclic_pos_enc, a numbering gap beyond r_max,
  token bonds, bond types, contact conditioning) equal serial on 1x1, 2x2, 2x3, 3x2 with uneven N,
  forward and backward: the gradient of ``s_inputs`` and every parameter gradient by name (the
  frozen Fourier projection stays without gradient); padding of the outputs exactly zero.
- ``test_cp_pair_init_without_bond_types``: the same without ``token_bonds_type`` (2x2).
"""

from __future__ import annotations

import pytest
import torch

from twinshard.pair.features import (
    collect_grad,
    collect_tensor,
    distribute,
    padding_keep,
    real_part,
    shard_tensor,
)
from twinshard.pair.layers.moves import column_block
from twinshard.pair.layers.pair_init import CPPairInit
from twinshard.pair.reference.pair_init import PairInit
from twinshard.testing import (
    TwinResult,
    check_twin,
    grid_id,
    parameter_signature,
    random_grad_output,
    randomize_parameters,
    run_on_grid,
    serial_reference,
    synthetic,
)
from twinshard.testing.pair_features import token_pair_features

CS, CZ = 5, 4
OPTS = {"fix_sym_check": True, "cyclic_pos_enc": True}


def _rank_moves(grid, n):
    from twinshard.pair.layout import PairLayout

    layout = PairLayout.for_sizes(n, grid)
    nr, nc = layout.padded
    x = torch.arange(2 * n * 3, dtype=torch.float64).view(2, n, 3).requires_grad_(True)
    xd = shard_tensor(x, "single", grid, layout)
    col = column_block(xd.to_local(), grid, layout.padded, "test:moves")
    col.backward(torch.ones_like(col))
    t = torch.arange(2 * 3 * n, dtype=torch.float64).view(2, 3, n)
    td = shard_tensor(t, "template", grid, layout)
    tcol = column_block(td.to_local(), grid, layout.padded, "test:moves", token_dim=2, differentiable=False)
    return col.detach(), tcol, x.grad


@pytest.mark.parametrize("grid,n", [((2, 3), 7), ((3, 2), 7)], ids=["2x3-N7", "3x2-N7"])
def test_column_block_moves(grid, n):
    rows, cols = grid
    res = run_on_grid(_rank_moves, grid, n)
    x = torch.arange(2 * n * 3, dtype=torch.float64).view(2, n, 3)
    t = torch.arange(2 * 3 * n, dtype=torch.float64).view(2, 3, n)
    nc = -(-n // cols) * cols
    xp = torch.nn.functional.pad(x, (0, 0, 0, nc - n))
    tp = torch.nn.functional.pad(t, (0, nc - n))
    nj = nc // cols
    grad = torch.zeros_like(x)
    for rank, (col, tcol, g) in enumerate(res):
        c = rank % cols
        assert torch.equal(col, xp[:, c * nj : (c + 1) * nj]), f"rank {rank}: wrong column block"
        assert torch.equal(tcol, tp[:, :, c * nj : (c + 1) * nj]), f"rank {rank}: wrong template block"
        grad += g
    # every real row is read by one rank of each grid row whose column block holds it: rows times
    assert torch.equal(grad, torch.full_like(x, float(rows))), "the move's adjoint lost or duplicated rows"


def _serial(bond_types: bool) -> PairInit:
    torch.manual_seed(5)
    m = PairInit(CS, CZ, bond_type_feature=bond_types, **OPTS).double()
    randomize_parameters(m, seed=21)
    return m


def _inputs(b: int, n: int):
    feats = token_pair_features(b, n, seed=3)
    feats["contact_threshold"] = feats["contact_threshold"].double()
    return feats, synthetic(b, n, CS, seed=4)


def _padding_zero(x, kind):
    keep = padding_keep(x, x._twinshard_layout[0], kind)
    if keep is None:
        return True
    loc = x.to_local()
    keep = keep.view(tuple(keep.shape) + (1,) * (loc.ndim - keep.ndim)).expand(loc.shape)
    return bool((loc.masked_select(~keep) == 0).all())


def _rank_pair_init(grid, b, n, bond_types):
    serial = _serial(bond_types)
    twin = CPPairInit(CS, CZ, bond_type_feature=bond_types, **OPTS).double()
    twin.load_state_dict(serial.state_dict())
    feats, s = _inputs(b, n)
    fd = distribute(feats, grid)
    s = s.requires_grad_(True)
    sd = shard_tensor(s, "single", grid, fd.layout)
    s_init, z_init = twin(sd, fd)
    full = torch.cat([collect_tensor(s_init).reshape(-1), collect_tensor(z_init).reshape(-1)])
    full.backward(random_grad_output(full, seed=6))
    pad_zero = _padding_zero(s_init, "single") and _padding_zero(z_init, "pair")
    return TwinResult(
        out=full.detach(),
        grads_in={"s_inputs": collect_grad(s.grad, "single", grid)},
        param_grads={k: p.grad for k, p in twin.named_parameters() if p.requires_grad},
        shards={"contact_threshold": real_part(fd["contact_threshold"])}
        | ({"s_inputs": real_part(sd)} if grid.rows > 1 else {}),
        params=parameter_signature(twin),
    ), pad_zero


def _check(grid, b, n, bond_types, ranks):
    serial = _serial(bond_types)
    feats, s = _inputs(b, n)

    def fwd(s_inputs):
        a, z = serial(s_inputs, feats)
        return torch.cat([a.reshape(-1), z.reshape(-1)])

    ref = serial_reference(serial, fwd, {"s_inputs": s}, grad_seed=6)
    frozen = [k for k, p in serial.named_parameters() if not p.requires_grad]
    assert frozen == [
        "contact_conditioning.fourier_embedding.proj.weight",
        "contact_conditioning.fourier_embedding.proj.bias",
    ]
    ref["serial_param_grads"] = {k: g for k, g in ref["serial_param_grads"].items() if k not in frozen}
    ref["serial_inputs"] = ref["serial_inputs"] | {"contact_threshold": feats["contact_threshold"]}
    check_twin(
        what=f"pair init N={n} B={b} bond_types={bond_types}",
        grid=grid_id(grid),
        ranks=[r for r, _ in ranks],
        **ref,
    )
    assert all(p for _, p in ranks), "padding of s_init or z_init is not zero"


CASES = [((1, 1), 7, 2), ((2, 2), 7, 2), ((2, 3), 8, 1), ((3, 2), 7, 2)]


@pytest.mark.parametrize("grid,n,b", CASES, ids=[f"{grid_id(g)}-N{n}" for g, n, _ in CASES])
def test_cp_pair_init_matches_serial(grid, n, b):
    ranks = run_on_grid(_rank_pair_init, grid, b, n, True)
    _check(grid, b, n, True, ranks)


def test_cp_pair_init_without_bond_types():
    ranks = run_on_grid(_rank_pair_init, (2, 2), 2, 7, False)
    _check((2, 2), 2, 7, False, ranks)
