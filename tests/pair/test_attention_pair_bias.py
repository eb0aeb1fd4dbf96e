"""CP attention with pair bias (single track) against the serial reference.

What each test proves:
- ``test_cp_attention_pair_bias_matches_serial``: output, the gradients of ``s`` and ``z`` and
  every parameter gradient equal serial (fp64, round-off gate) on 1x1, 2x2, 3x3, 1x2, 2x3 grids,
  even and uneven N, with a random token mask (one sample fully masked where B = 2: the
  reference's no-mask-bias rule) and with ``mask=None`` on padded input; padding stays zero.
- ``test_cp_attention_pair_bias_with_k_in``: keys and values from a separate ``k_in``; its
  gradient equals serial too (2x3, 3x3, uneven N).
- ``test_cp_attention_pair_bias_fp32``: the same in fp32 under a derived budget (``FP32_WHY``).
- ``test_negative_controls_fail_parity``: planted from the test, a merge without the common
  row maximum (each rank shifts by its own maximum) and a replicated output gradient that is
  not shared out (every rank of a row back-propagates all of it) each fail with the message
  named.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from twinshard.pair.features import (
    PairLayout,
    collect_grad,
    collect_tensor,
    layout_of,
    padding_keep,
    real_part,
    shard_tensor,
)
from twinshard.pair.layers import CPAttentionPairBias
from twinshard.pair.layers import attention as cp_apb
from twinshard.pair.reference.attention import AttentionPairBias
from twinshard.testing import (
    TwinResult,
    assert_parity,
    assert_replicated,
    check_twin,
    grid_id,
    parameter_signature,
    perturb_zero_parameters,
    random_grad_output,
    random_mask,
    run_on_grid,
    serial_reference,
    synthetic,
)

CS, CZ, HEADS = 8, 6, 2
# The pair-bias LayerNorm's bias adds a per-head constant to every logit of a softmax row, which
# the softmax cancels: its gradient is zero in exact arithmetic, round-off noise in both runs
# (as in test_reference_pairformer). It is checked against zero at the scale of the gradients.
ANALYTIC_ZERO = "proj_z.0.bias"
_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def _serial(dtype: torch.dtype = torch.float64) -> AttentionPairBias:
    torch.manual_seed(17)
    m = AttentionPairBias(CS, CZ, HEADS).double()
    perturb_zero_parameters(m)  # proj_o ("final") starts at zero
    with torch.no_grad():  # LayerNorm at (1, 0), proj_q bias at 0: move off them
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m.to(dtype)


def _twin(serial: AttentionPairBias) -> CPAttentionPairBias:
    twin = CPAttentionPairBias(CS, CZ, HEADS).to(next(serial.parameters()).dtype)
    twin.load_state_dict(serial.state_dict())
    return twin


def _inputs(b: int, n: int, dtype: torch.dtype):
    s = synthetic(b, n, CS, seed=3, dtype=dtype)
    z = synthetic(b, n, n, CZ, seed=4, dtype=dtype)
    mask = random_mask(b, n, seed=8, keep=0.7).to(dtype)
    mask[0, 0] = 1  # sample 0 keeps at least one key
    if b > 1:
        mask[1] = 0  # a fully masked sample: no mask bias at all (the reference's rule)
    return s, z, mask


def _k_in(b: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return synthetic(b, n, CS, seed=5, dtype=dtype)


def _padding_is_zero(y) -> bool:
    keep = padding_keep(y, layout_of(y), "single")
    if keep is None:
        return True
    local = y.to_local()
    return bool((local.masked_select(~keep.view(keep.shape + (1,)).expand(local.shape)) == 0).all())


_MERGE, _SHARE = cp_apb._merge_partials, cp_apb._ShareGrad


def _merge_own_max(logits, v, grid):
    """Planted: each rank shifts its partial softmax by its own maximum, not the row's."""
    m = logits.detach().amax(dim=-1, keepdim=True)
    p = torch.exp(logits - m)
    acc = torch.einsum("bhij,bjhd->bihd", p, v)
    return cp_apb.comm.all_reduce(p.sum(-1), grid.row_group), cp_apb.comm.all_reduce(acc, grid.row_group)


class _NoShare(torch.autograd.Function):
    """Planted: the replicated output gradient is back-propagated whole on every rank of a row."""

    @staticmethod
    def forward(ctx, x, index, parts):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


@contextlib.contextmanager
def planted(bug):
    saved = (cp_apb._merge_partials, cp_apb._ShareGrad)
    if bug == "own_max":
        cp_apb._merge_partials = _merge_own_max
    elif bug == "no_share":
        cp_apb._ShareGrad = _NoShare
    elif bug is not None:
        raise ValueError(f"unknown planted bug {bug!r}")
    try:
        yield
    finally:
        cp_apb._merge_partials, cp_apb._ShareGrad = saved


def _rank_apb(grid, modes, b, n, dtype_name="float64", bug=None):
    dtype = _DTYPES[dtype_name]
    layout = PairLayout.for_sizes(n, grid)
    results, pad_zero = {}, {}
    with planted(bug):
        for mode in modes:
            twin = _twin(_serial(dtype))
            s, z, mask = _inputs(b, n, dtype)
            s.requires_grad_(True)
            z.requires_grad_(True)
            sd = shard_tensor(s, "single", grid, layout)
            zd = shard_tensor(z, "pair", grid, layout)
            md = shard_tensor(mask, "single", grid, layout) if mode in ("mask", "k_in") else None
            if mode == "k_in":  # keys from another single representation
                kin = _k_in(b, n, dtype).requires_grad_(True)
                out = twin(sd, zd, md, shard_tensor(kin, "single", grid, layout))
            else:
                out = twin(sd, zd, md)
            full = collect_tensor(out)
            full.backward(random_grad_output(full, seed=6))
            pad_zero[mode] = _padding_is_zero(out)
            results[mode] = TwinResult(
                out=full.detach(),
                grads_in={"s": collect_grad(s.grad, "single", grid), "z": collect_grad(z.grad, "pair", grid)}
                | ({"k_in": collect_grad(kin.grad, "single", grid)} if mode == "k_in" else {}),
                param_grads={k: p.grad for k, p in twin.named_parameters()},
                # on one grid row the single track is replicated by contract: z is the evidence there
                shards={"z": real_part(zd)}
                | ({"s": real_part(sd), "out": real_part(out)} if grid.rows > 1 else {}),
                params=parameter_signature(twin),
            )
    return results, pad_zero


FP32_WHY = (
    "fp32: the harness round-off formula 2 eps + 16 sqrt(n) eps (eps = 1.2e-7, sums in fp32) with "
    "n = B N^2, the longest sum behind any compared value (proj_z's weight gradient over every "
    "pair entry), times the largest reference magnitude over output and gradients"
)


def _check(grid, mode, b, n, ranks, dtype_name="float64"):
    dtype = _DTYPES[dtype_name]
    serial = _serial(dtype)
    s, z, mask = _inputs(b, n, dtype)
    if mode == "k_in":
        ref = serial_reference(
            serial,
            lambda s, z, k_in: serial(s, z, mask, k_in),
            {"s": s, "z": z, "k_in": _k_in(b, n, dtype)},
            6,
        )
    else:
        ref = serial_reference(
            serial, lambda s, z: serial(s, z, mask if mode == "mask" else None), {"s": s, "z": z}, grad_seed=6
        )
    results = [r[0][mode] for r in ranks]
    serial_zero = ref["serial_param_grads"].pop(ANALYTIC_ZERO)
    twin_zero = [r.param_grads[ANALYTIC_ZERO] for r in results]
    results = [
        dataclasses.replace(r, param_grads={k: v for k, v in r.param_grads.items() if k != ANALYTIC_ZERO})
        for r in results
    ]
    eps = torch.finfo(dtype).eps
    scale = max(
        float(t.abs().max())
        for t in [ref["serial_out"], *ref["serial_grads_in"].values(), *ref["serial_param_grads"].values()]
    )
    tol = {}
    if dtype == torch.float32:
        k = 2 * eps + 16 * (b * n * n) ** 0.5 * eps
        tol = {"rtol": 0.0, "atol": k * scale, "why": f"{FP32_WHY} = {k:.2g} x {scale:.3g}"}
    what = f"attn-pair-bias {mode} {dtype_name} N={n} B={b}"
    check_twin(what=what, grid=grid_id(grid), ranks=results, **tol, **ref)
    k0 = 2 * eps + 16 * 4096**0.5 * eps  # the harness's round-off factor (n = 4096)
    why0 = f"analytically zero: round-off of cancelling terms, {k0:.2g} x max|grad| {scale:.3g}"
    assert_replicated(twin_zero, f"{what}: param grad {ANALYTIC_ZERO}")
    for name, g in (("distributed", twin_zero[0]), ("serial", serial_zero)):
        assert_parity(
            g,
            torch.zeros_like(g),
            what=f"{what} {name} grad {ANALYTIC_ZERO}",
            grid=grid_id(grid),
            rtol=0.0,
            atol=k0 * scale,
            why=why0,
        )


CASES = [
    ((1, 1), 5, 2),
    ((2, 2), 6, 2),
    ((2, 2), 7, 1),
    ((3, 3), 6, 2),
    ((3, 3), 7, 1),
    ((1, 2), 4, 2),
    ((1, 2), 5, 1),
    ((2, 3), 6, 2),
    ((2, 3), 9, 1),
    ((3, 2), 7, 1),
]


@pytest.mark.parametrize("grid,n,b", CASES, ids=[f"{grid_id(g)}-N{n}" for g, n, _ in CASES])
def test_cp_attention_pair_bias_matches_serial(grid, n, b):
    ranks = run_on_grid(_rank_apb, grid, ("mask", "none"), b, n)
    for mode in ("mask", "none"):
        _check(grid, mode, b, n, ranks)
    for r, (_, pad_zero) in enumerate(ranks):
        assert all(pad_zero.values()), f"rank {r}: padding of the output is not zero: {pad_zero}"


@pytest.mark.parametrize("grid,n", [((2, 3), 9), ((3, 3), 7)], ids=["2x3-N9", "3x3-N7"])
def test_cp_attention_pair_bias_with_k_in(grid, n):
    """Keys and values from a separate ``k_in`` (Boltz's keyword): its gradient comes back too."""
    ranks = run_on_grid(_rank_apb, grid, ("k_in",), 2, n)
    _check(grid, "k_in", 2, n, ranks)


@pytest.mark.parametrize("grid,n", [((2, 3), 9), ((3, 3), 7)], ids=["2x3-N9", "3x3-N7"])
def test_cp_attention_pair_bias_fp32(grid, n):
    ranks = run_on_grid(_rank_apb, grid, ("mask",), 2, n, "float32")
    _check(grid, "mask", 2, n, ranks, "float32")


CONTROLS = [
    ("own_max", (2, 2), 6, r"attn-pair-bias mask float64 N=6 B=2: out: rank \d's piece differs"),
    ("no_share", (2, 3), 6, r"parity of attn-pair-bias mask float64 N=6 B=2 d/ds on grid 2x3 fails"),
]


@pytest.mark.parametrize("bug,grid,n,match", CONTROLS, ids=[c[0] for c in CONTROLS])
def test_negative_controls_fail_parity(bug, grid, n, match):
    ranks = run_on_grid(_rank_apb, grid, ("mask",), 2, n, "float64", bug)
    with pytest.raises(AssertionError, match=match):
        _check(grid, "mask", 2, n, ranks)
