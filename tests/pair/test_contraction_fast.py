"""Fast paths of the pair contractions against their plain references.

- the batched-matmul kernels (``"bmm"``: channel-first per-channel products; ``"outer"``: the
  outer product in the channels) against the einsum kernel, forward and backward, on 1x1, 2x2
  and rectangular grids (fp64, round-off gate);
- the narrow wire dtype: bf16 operands travel in bf16 (ledger bytes halved against the fp32
  wire), the products accumulate in fp32 and the result is the fp32 sum rounded once.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from twinshard.comm import CommLedger
from twinshard.pair.layers.contraction import Contraction, grid_contract
from twinshard.pair.layers.outer_product import OPM_SPEC
from twinshard.pair.layers.triangle import TRIMUL_SPECS
from twinshard.pair.tiling import MSA, PAIR, local_block
from twinshard.runtime import make_grid
from twinshard.testing import assert_parity, run_on_grid


def _full(shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _run(spec: Contraction, kind: str, n: int, s: int, ch: int, grid_shape, seed: int):
    grid = make_grid(grid_shape)
    place = MSA if kind == "msa" else PAIR
    rows = s if kind == "msa" else n
    x = local_block(_full((1, rows, n, ch), seed), grid, place).requires_grad_(True)
    y = local_block(_full((1, rows, n, ch), seed + 1), grid, place).requires_grad_(True)
    out = grid_contract(x, y, grid, spec, (rows, n), (rows, n))
    gz = _full(out.shape, seed + 2)  # same on every rank: a per-tile value, compared per rank
    out.backward(gz)
    return out.detach(), x.grad, y.grad


def _fast_vs_einsum(grid, grid_shape):
    errs = []
    specs = ((TRIMUL_SPECS["outgoing"], "pair"), (TRIMUL_SPECS["incoming"], "pair"), (OPM_SPEC, "msa"))
    for spec, kind in specs:
        plain = dataclasses.replace(spec, kernel="einsum")
        fast = _run(spec, kind, 12, 6, 3, grid_shape, 5)
        ref = _run(plain, kind, 12, 6, 3, grid_shape, 5)
        for f, r in zip(fast, ref):
            assert f.dtype == r.dtype and f.shape == r.shape
            errs.append(((f - r).abs().max() / r.abs().max()).item())
    return max(errs)


@pytest.mark.parametrize("grid_shape", [(1, 1), (2, 2), (2, 3), (3, 2)], ids=lambda g: f"{g[0]}x{g[1]}")
def test_batched_matmul_kernels_match_einsum(grid_shape):
    per_rank = run_on_grid(_fast_vs_einsum, grid_shape, grid_shape)
    assert max(per_rank) < 1e-13, per_rank


def _wire(grid, _):
    n, ch = 16, 4
    spec = TRIMUL_SPECS["outgoing"]
    # bf16 activations upcast for the sum, as the triangle twin's project_in makes them
    full_a = _full((1, n, n, ch), 11, torch.bfloat16).float()
    full_b = _full((1, n, n, ch), 12, torch.bfloat16).float()
    full_g = _full((1, n, n, ch), 13, torch.bfloat16)
    res = {}
    for wire in (None, torch.bfloat16):
        a = local_block(full_a, grid, PAIR).requires_grad_(True)
        b = local_block(full_b, grid, PAIR).requires_grad_(True)
        fwd, bwd = CommLedger(), CommLedger()
        with fwd:
            o = grid_contract(a, b, grid, spec, (n, n), (n, n), wire_dtype=wire, out_dtype=wire)
        g = local_block(full_g, grid, PAIR).to(o.dtype)
        with bwd:
            o.backward(g)
        res[wire] = (o.detach(), a.grad, b.grad, fwd.summary()["bytes_sent"], bwd.summary()["bytes_sent"])
    # the plain fp32 reference: the sum in fp32, rounded once to bf16
    ref = torch.einsum("bikd,bjkd->bijd", full_a, full_b)
    ref_tile = local_block(ref, grid, PAIR)
    ga = torch.einsum("bijd,bjkd->bikd", full_g.float(), full_b)
    return res, ref_tile, local_block(ga, grid, PAIR)


def test_bf16_wire_halves_bytes_and_rounds_once():
    per_rank = run_on_grid(_wire, (2, 2), (2, 2))
    for res, ref, ga in per_rank:
        o32, ga32, _, f32, b32 = res[None]
        o16, ga16, _, f16, b16 = res[torch.bfloat16]
        assert o16.dtype == torch.bfloat16 and ga16.dtype == torch.float32
        assert f16 * 2 == f32 and b16 * 2 == b32  # activations and their gradient travel in bf16
        # fp32 accumulation, one rounding: equal to the rounded fp32 sum up to a rounding-boundary
        # tie broken by the summation order (at most one bf16 ulp, rarely)
        want = ref.to(torch.bfloat16)
        diff = (o16.float() - want.float()).abs()
        ulp = want.float().abs() * 2.0**-7
        assert (diff <= ulp).all()
        assert (diff == 0).float().mean() > 0.99
        # a bf16 accumulation would be far off; fp32 results equal the fp32 ones at round-off
        n = 16  # the contraction length: the N tokens of _wire
        assert_parity(o32, ref, what="bf16-wire trimul, fp32 run: output", grid="2x2", reduction=n)
        assert_parity(ga16, ga, what="bf16-wire trimul: fp32 gradient of a", grid="2x2", reduction=n)


def _mismatched(grid, k_gap: int):
    """``grid_matmul`` of X [6, 6 + k_gap] (k along columns) by Y [6, 6] (k along rows)."""
    from twinshard.pair.layers.contraction import Tiled, grid_matmul

    R, C = grid.shape
    x = torch.zeros(1, 6 // R, (6 + k_gap) // C, 1, dtype=torch.float64)
    y = torch.zeros(1, 6 // R, 6 // C, 1, dtype=torch.float64)
    try:
        grid_matmul(grid, Tiled(x, 6, 6 + k_gap), False, Tiled(y, 6, 6), False, "bmkd,bknd->bmnd", "t")
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("grid_shape,gap", [((2, 2), 2), ((1, 3), 3)], ids=["2x2-gap2", "1x3-gap3"])
def test_contraction_extents_beyond_the_padding_raise(grid_shape, gap):
    """k's two extents may differ by per-axis padding only (< max(rows, cols), 0 on a square
    grid): a larger gap is a caller's error and raises on every rank, never truncates k."""
    msgs = run_on_grid(_mismatched, grid_shape, gap)
    assert all(m is not None and "by more than the per-axis padding" in m for m in msgs), msgs
