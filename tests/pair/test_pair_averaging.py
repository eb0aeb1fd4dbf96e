"""Pair-weighted averaging: serial reference against naive loops, CP twin against serial.

What each test proves:
- ``test_pwa_matches_naive_loops``: the reference equals AF3 Alg. 10 written as loops (per head,
  per sequence, per token), masked entries excluded, a fully masked row averaged over all j
  with the raw logits (Boltz's function in exact arithmetic).
- ``test_pwa_names_and_init``: Boltz-2's names in Boltz-2's order, ``proj_o`` zero.
- ``test_cp_pwa_matches_serial``: the twin's output, the gradients of ``m`` and ``z`` and every
  parameter gradient equal serial (fp64, round-off gate) on 1x1, 2x2, 2x3, 3x2 and 3x3, MSA
  depth 1 and deeper than the grid rows, uneven N and S, a random pair mask with fully masked
  rows, and without a mask (the padding from the layout).
- ``test_cp_pwa_negative_controls``: a softmax normaliser summed over the wrong axis (i, not j),
  and one not summed over the grid row, each fail parity.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from twinshard.pair.features import PairLayout, collect_grad, collect_tensor, real_part, shard_tensor
from twinshard.pair.layers import pair_averaging as cp_pwa
from twinshard.pair.layers.pair_averaging import CPPairWeightedAveraging
from twinshard.pair.reference.pair_averaging import PairWeightedAveraging
from twinshard.testing import (
    TwinResult,
    assert_parity,
    check_twin,
    grid_id,
    parameter_signature,
    random_grad_output,
    random_mask,
    randomize_parameters,
    run_on_grid,
    serial_reference,
    synthetic,
)

CM, CZ, CH, H = 5, 4, 3, 2
F64 = torch.float64
# norm_z's bias shifts every logit of a softmax row by one constant per head: zero gradient in
# exact arithmetic, round-off on both sides (checked against zero at the gradients' scale)
ANALYTIC_ZERO = "norm_z.bias"


def test_pwa_matches_naive_loops():
    mod = PairWeightedAveraging(CM, CZ, CH, H).double()
    randomize_parameters(mod, 3)
    B, S, N = 2, 3, 5
    m = torch.randn(B, S, N, CM, dtype=F64)
    z = torch.randn(B, N, N, CZ, dtype=F64)
    mask = (torch.rand(B, N, N) > 0.3).double()
    mask[0, 2] = 0  # a fully masked row
    ln = torch.nn.functional.layer_norm
    out = torch.empty(B, S, N, CM, dtype=F64)
    for bb in range(B):
        x = ln(m[bb], (CM,), mod.norm_m.weight, mod.norm_m.bias)
        v = (x @ mod.proj_m.weight.T).view(S, N, H, CH)
        g = torch.sigmoid(x @ mod.proj_g.weight.T)
        b = ln(z[bb], (CZ,), mod.norm_z.weight, mod.norm_z.bias) @ mod.proj_z.weight.T  # [N, N, H]
        o = torch.zeros(S, N, H, CH, dtype=F64)
        for h in range(H):
            for i in range(N):
                keep = mask[bb, i] > 0 if mask[bb, i].any() else torch.ones(N, dtype=torch.bool)
                w = torch.softmax(b[i, keep, h], dim=0)
                for s in range(S):
                    o[s, i, h] = (w[:, None] * v[s, keep, h]).sum(0)
        out[bb] = (g * o.reshape(S, N, H * CH)) @ mod.proj_o.weight.T
    assert_close(mod(m, z, mask), out, rtol=1e-12, atol=1e-12)


def test_pwa_names_and_init():
    mod = PairWeightedAveraging(8, 4, 32, 8)
    assert [n for n, _ in mod.named_parameters()] == [
        "norm_m.weight",
        "norm_m.bias",
        "norm_z.weight",
        "norm_z.bias",
        "proj_m.weight",
        "proj_g.weight",
        "proj_z.weight",
        "proj_o.weight",
    ]
    assert torch.count_nonzero(mod.proj_o.weight) == 0
    assert (mod.c_m, mod.c_z, mod.c_h, mod.num_heads, mod.inf) == (8, 4, 32, 8, 1e6)


# -- CP twin against serial ---------------------------------------------------------------------


def _serial() -> PairWeightedAveraging:
    mod = PairWeightedAveraging(CM, CZ, CH, H).double()
    randomize_parameters(mod, 21)
    return mod


def _inputs(b, s, n):
    m = synthetic(b, s, n, CM, seed=3)
    z = synthetic(b, n, n, CZ, seed=4)
    mask = random_mask(b, n, n, seed=5, keep=0.7)
    mask[0, 1] = 0  # a fully masked row
    return m, z, mask


def _wrong_axis(b, grid):  # planted: the normaliser summed over i (rows), not over j
    shift = b.detach().amax(dim=(1, 2), keepdim=True)
    p = torch.exp(b - shift)
    return p / p.sum(dim=1, keepdim=True)


def _local_norm(b, grid):  # planted: the normaliser of the local key block only (no all-reduce)
    shift = b.detach().amax(dim=2, keepdim=True)
    p = torch.exp(b - shift)
    return p / p.sum(dim=2, keepdim=True)


PLANTS = {"wrong_axis": _wrong_axis, "local_norm": _local_norm}


def _rank(grid, b, s, n, masked=True, plant=None):
    saved = cp_pwa.row_softmax
    if plant is not None:
        cp_pwa.row_softmax = PLANTS[plant]
    try:
        layout = PairLayout.for_sizes(n, grid, n_seqs=s)
        twin = CPPairWeightedAveraging(CM, CZ, CH, H).double()
        twin.load_state_dict(_serial().state_dict(), strict=True)
        m, z, mask = _inputs(b, s, n)
        m.requires_grad_(True)
        z.requires_grad_(True)
        md, zd = shard_tensor(m, "msa", grid, layout), shard_tensor(z, "pair", grid, layout)
        out = twin(md, zd, shard_tensor(mask, "pair", grid, layout) if masked else None)
        full = collect_tensor(out)
        full.backward(random_grad_output(full, seed=6))
        shards = {"z": real_part(zd)}
        if s >= grid.rows:  # else some grid rows hold padded sequences only
            shards["m"] = real_part(md)
        return TwinResult(
            out=full.detach(),
            grads_in={"m": collect_grad(m.grad, "msa", grid), "z": collect_grad(z.grad, "pair", grid)},
            param_grads={k: p.grad for k, p in twin.named_parameters()},
            shards=shards,
            params=parameter_signature(twin),
        )
    finally:
        cp_pwa.row_softmax = saved


def _check(grid, b, s, n, ranks, masked=True, what=None):
    serial = _serial()
    m, z, mask = _inputs(b, s, n)
    mk = mask if masked else None
    ref = serial_reference(serial, lambda m, z: serial(m, z, mk), {"m": m, "z": z}, 6)
    what = what or f"pwa S={s} N={n} B={b} mask={masked}"
    zero = ref["serial_param_grads"].pop(ANALYTIC_ZERO)
    scale = max(float(t.abs().max()) for t in ref["serial_param_grads"].values())
    twin_zero = [r.param_grads.pop(ANALYTIC_ZERO) for r in ranks]
    check_twin(what=what, grid=grid_id(grid), ranks=ranks, **ref)
    eps = torch.finfo(F64).eps
    k0 = 2 * eps + 16 * 4096**0.5 * eps
    for side, g in (("distributed", twin_zero[0]), ("serial", zero)):
        assert_parity(
            g,
            torch.zeros_like(g),
            what=f"{what} {side} grad {ANALYTIC_ZERO}",
            grid=grid_id(grid),
            rtol=0.0,
            atol=k0 * scale,
            why=f"analytically zero: round-off of cancelling terms, {k0:.2g} x max|grad| {scale:.3g}",
        )


# (grid, S, N, B, masked): S = 1, S < rows, S > rows; N even and uneven
CASES = [
    ((1, 1), 3, 5, 2, True),
    ((2, 2), 5, 7, 1, True),
    ((2, 2), 1, 6, 1, True),
    ((2, 3), 5, 9, 1, True),
    ((3, 2), 5, 8, 1, True),
    ((2, 3), 3, 7, 1, False),
    ((3, 3), 5, 7, 1, True),
]


@pytest.mark.parametrize(
    "grid,s,n,b,masked",
    CASES,
    ids=[f"{grid_id(g)}-S{s}-N{n}-{'mask' if k else 'layout'}" for g, s, n, _, k in CASES],
)
def test_cp_pwa_matches_serial(grid, s, n, b, masked):
    _check(grid, b, s, n, run_on_grid(_rank, grid, b, s, n, masked), masked)


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_cp_pwa_negative_controls(plant):
    grid, s, n = (2, 2), 3, 6
    ranks = run_on_grid(_rank, grid, 1, s, n, True, plant)
    with pytest.raises(AssertionError, match="pwa planted"):
        _check(grid, 1, s, n, ranks, what=f"pwa planted {plant}")
