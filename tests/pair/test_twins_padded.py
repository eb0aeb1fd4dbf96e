"""Every pair twin, called as a user who never heard of padding calls it, equals serial.

The inputs go through ``distribute`` (no masks, N and S padded to the grid) and every twin
runs with ``mask=None``: the padding mask comes from the layout the DTensors carry. Checked
in fp64 at round-off and in fp32 against the serial module in fp32 (output, input gradient,
every parameter gradient), on 2x2, 2x3 and 3x3 grids with padding on each, plus the residual
pattern ``z = z + layer(z)`` across two layers.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from twinshard.pair.features import (
    collect_grad,
    collect_tensor,
    distribute,
    layout_of,
    padding_keep,
    real_part,
    with_layout,
)
from twinshard.pair.layers import (
    CPDropout,
    CPLayerNorm,
    CPLinear,
    CPOuterProductMean,
    CPTransition,
    CPTriangleMultiplication,
    pointwise,
)
from twinshard.pair.layers import triangle as cp_triangle
from twinshard.pair.reference import (
    Dropout,
    LayerNorm,
    Linear,
    OuterProductMean,
    Transition,
    TriangleMultiplication,
)
from twinshard.runtime import RankFailure
from twinshard.testing import (
    TwinResult,
    check_twin,
    grid_id,
    parameter_signature,
    perturb_zero_parameters,
    random_grad_output,
    run_on_grid,
    serial_reference,
    synthetic,
)

C, H, CM, STEP = 4, 3, 5, 7  # pair channels, hidden, MSA channels, dropout seed
TWINS = ("linear", "layernorm", "transition", "dropout_row", "dropout_col", "trimul_out", "trimul_in", "opm")
_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def _serial(name: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(41)
    if name == "linear":
        m = Linear(C, C)
    elif name == "layernorm":
        m = LayerNorm(C)
    elif name == "transition":
        m = Transition(C, expansion=2)
    elif name.startswith("dropout"):
        m = Dropout(0.3, columnwise=name == "dropout_col", stream=name)
    elif name.startswith("trimul"):
        m = TriangleMultiplication(C, "outgoing" if name == "trimul_out" else "incoming", hidden=H)
    else:
        m = OuterProductMean(CM, H, C)
    m = m.double()
    perturb_zero_parameters(m)  # AF3 zero inits (final projections, gates) hide terms
    with torch.no_grad():  # LayerNorms start at (1, 0): move off it so every term matters
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m.to(dtype).train()


def _twin(name: str, serial: nn.Module) -> nn.Module:
    if name.startswith("dropout"):
        twin = CPDropout(serial.p, columnwise=serial.columnwise, stream=serial.stream)
    elif name.startswith("trimul"):
        twin = CPTriangleMultiplication(C, serial.direction, hidden=H)
    else:
        twin = {"linear": lambda: CPLinear(C, C), "layernorm": lambda: CPLayerNorm(C)}.get(
            name,
            lambda: CPTransition(C, expansion=2) if name == "transition" else CPOuterProductMean(CM, H, C),
        )()
    dtype = next(iter(serial.parameters()), torch.empty(0, dtype=torch.float64)).dtype
    twin = twin.to(dtype)
    twin.load_state_dict(serial.state_dict())
    return twin.train()


def _input(name: str, n: int, s: int, dtype: torch.dtype) -> tuple[str, str, torch.Tensor]:
    """(feature name, kind, full tensor): the MSA for the outer product mean, else a pair."""
    if name == "opm":
        return "m", "msa", synthetic(1, s, n, CM, seed=3, dtype=dtype)
    return "z", "pair", synthetic(1, n, n, C, seed=3, dtype=dtype)


def _call(module: nn.Module, name: str, x):
    return module(x, seed=STEP) if name.startswith("dropout") else module(x)


def _to_bf16_and_back(fn):
    def buggy(x, y, *args, **kwargs):
        if x.dtype == torch.float32:  # the fp64 path is untouched: only an fp32 test can see it
            x, y = x.to(torch.bfloat16).float(), y.to(torch.bfloat16).float()
        return fn(x, y, *args, **kwargs)

    return buggy


@contextlib.contextmanager
def _planted(bug):
    saved = cp_triangle.grid_contract
    if bug == "fp32_operands_in_bf16":  # planted: the contraction's operands rounded to bf16 in fp32
        cp_triangle.grid_contract = _to_bf16_and_back(saved)
    elif bug is not None:
        raise ValueError(bug)
    try:
        yield
    finally:
        cp_triangle.grid_contract = saved


def _padding_is_zero(y) -> bool:
    keep = padding_keep(y, layout_of(y), "pair")
    if keep is None:
        return True
    local = y.to_local()
    return bool((local.masked_select(~keep.view(keep.shape + (1,)).expand(local.shape)) == 0).all())


def _rank_twins(grid, names, n, s, dtype_name, bug=None):
    """Every rank: distribute the full input (the user path), run the twin with mask=None,
    gather, backpropagate a random grad_output; sum the per-tile input gradients."""
    dtype = _DTYPES[dtype_name]
    results, pad_zero = {}, {}
    with _planted(bug):
        for name in names:
            serial = _serial(name, dtype)
            twin = _twin(name, serial)
            key, kind, x = _input(name, n, s, dtype)
            x.requires_grad_(True)
            xd = distribute({key: x}, grid)[key]
            y = _call(twin, name, xd)
            full = collect_tensor(y)
            full.backward(random_grad_output(full, seed=9))
            pad_zero[name] = _padding_is_zero(y)
            results[name] = TwinResult(
                out=full.detach(),
                grads_in={key: collect_grad(x.grad, kind, grid)},
                param_grads={k: p.grad for k, p in twin.named_parameters()},
                shards={key: real_part(xd), "out": real_part(y)},
                params=parameter_signature(twin),
            )
    return results, pad_zero


def _reduction(name: str, n: int, s: int) -> int:
    """Longest sum behind any compared value: a parameter gradient sums over every position
    (B N^2 pair entries, B S N MSA entries); the contractions sum over N or S, channels over c."""
    return max(n * n, s * n if name == "opm" else 0, C * C)


# (grid, N, S): padding on every grid (13 -> 14 on 2x2, 18 on 2x3; 7 -> 9 on 3x3; S 5 -> 6,
# 6, 7 -> 9), one-token blocks on 2x3 and 3x3, and no rank holding padding only.
# padding on each grid; 2x3 and 3x2 pad the two token axes differently (14 x 15, 15 x 14)
GRIDS = [((2, 2), 13, 5), ((2, 3), 13, 5), ((3, 2), 13, 5), ((3, 3), 7, 7)]


def _check_all(grid, names, n, s, dtype_name, ranks, what=""):
    dtype = _DTYPES[dtype_name]
    for name in names:
        serial = _serial(name, dtype)
        key, _, x = _input(name, n, s, dtype)
        check_twin(
            what=f"{name} mask=None {dtype_name} N={n} S={s}{what}",
            grid=grid_id(grid),
            ranks=[r[0][name] for r in ranks],
            reduction=_reduction(name, n, s) if dtype == torch.float32 else None,
            **serial_reference(
                serial, lambda f=serial, nm=name, k=key, **kw: _call(f, nm, kw[k]), {key: x}, grad_seed=9
            ),
        )


@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
@pytest.mark.parametrize("grid,n,s", GRIDS, ids=[grid_id(g) for g, _, _ in GRIDS])
def test_every_twin_without_mask_on_padded_input_equals_serial(grid, n, s, dtype_name):
    """fp64: the round-off gate. fp32: the serial module in fp32 is the reference; the budget
    is the harness's round-off formula with n = the longest reduction (``_reduction``), stated
    in every evidence line."""
    ranks = run_on_grid(_rank_twins, grid, TWINS, n, s, dtype_name)
    _check_all(grid, TWINS, n, s, dtype_name, ranks)
    for r, (_, pad_zero) in enumerate(ranks):
        assert all(pad_zero.values()), f"rank {r}: a twin left non-zero padding: {pad_zero}"


def test_negative_control_fp32_only_bug():
    """A bug on the fp32 path only (the contraction's operands rounded to bf16) passes the fp64
    gate, since it never runs there, and fails the fp32 one."""
    grid, n, s, names = (2, 2), 13, 5, ("trimul_out",)
    _check_all(
        grid,
        names,
        n,
        s,
        "float64",
        run_on_grid(_rank_twins, grid, names, n, s, "float64", "fp32_operands_in_bf16"),
    )
    ranks = run_on_grid(_rank_twins, grid, names, n, s, "float32", "fp32_operands_in_bf16")
    with pytest.raises(
        AssertionError, match=r"trimul_out mask=None float32 N=13 S=5: out: rank \d's piece differs"
    ):
        _check_all(grid, names, n, s, "float32", ranks)


# -- the residual pattern across two layers ---------------------------------------------------


class _Stack(nn.Module):
    """Serial ``z = z + tri_out(z); z = z + tri_in(z)`` (an AF3 pair-stack fragment)."""

    def __init__(self, tri_out: nn.Module, tri_in: nn.Module):
        super().__init__()
        self.tri_out, self.tri_in = tri_out, tri_in

    def forward(self, z):
        z = z + self.tri_out(z)
        return z + self.tri_in(z)


def _stack(cp: bool) -> _Stack:
    serial = _Stack(_serial("trimul_out", torch.float64), _serial("trimul_in", torch.float64))
    if not cp:
        return serial
    return _Stack(_twin("trimul_out", serial.tri_out), _twin("trimul_in", serial.tri_in))


def _rank_residual(grid, n, mode):
    stack = _stack(cp=True)
    z = synthetic(1, n, n, C, seed=3).requires_grad_(True)
    zd = distribute({"z": z}, grid)["z"]
    if mode == "plain":  # z + layer(z) as a plain DTensor op: the sum carries no layout
        z1 = zd + stack.tri_out(zd)
        stack.tri_in(z1)  # must raise on every rank, not guess the padding
    z1 = with_layout(zd + stack.tri_out(zd), zd)  # the documented fix
    z2 = pointwise(lambda a, b: a + b, z1, stack.tri_in(z1))  # keeps z1's layout
    full = collect_tensor(z2)
    full.backward(random_grad_output(full, seed=9))
    return TwinResult(
        out=full.detach(),
        grads_in={"z": collect_grad(z.grad, "pair", grid)},
        param_grads={k: p.grad for k, p in stack.named_parameters()},
        shards={"z": real_part(zd), "out": real_part(z2)},
        params=parameter_signature(stack),
    )


@pytest.mark.parametrize("grid,n", [(g, n) for g, n, _ in GRIDS], ids=[grid_id(g) for g, _, _ in GRIDS])
def test_residual_across_two_layers_equals_serial(grid, n):
    ranks = run_on_grid(_rank_residual, grid, n, "with_layout")
    serial = _stack(cp=False)
    check_twin(
        what=f"z + trimul_out(z), then + trimul_in, mask=None N={n}",
        grid=grid_id(grid),
        ranks=ranks,
        **serial_reference(serial, serial, {"z": synthetic(1, n, n, C, seed=3)}, grad_seed=9),
    )


def test_plain_residual_without_layout_raises_on_every_rank():
    """``z + layer(z)`` drops the layout; the next mixing twin cannot tell padding from tokens
    and says so on every rank instead of answering wrongly."""
    with pytest.raises(RankFailure, match=r"carries no PairLayout and no mask was given") as info:
        run_on_grid(_rank_residual, (2, 2), 13, "plain")
    assert sorted(info.value.failures) == [0, 1, 2, 3]
    assert "with_layout(z + y, z)" in str(info.value)


def _rank_unsquare_without_layout(grid, n):
    """z padded per grid axis (not square), its layout and its mask's dropped by plain ops."""
    stack = _stack(cp=True)
    d = distribute({"z": synthetic(1, n, n, C, seed=3)}, grid)
    stack.tri_out(d["z"] + 0, mask=d["pair_mask"] * 1)


def test_unsquare_pair_without_layout_raises_on_every_rank():
    """On 2x3, N = 7 pads z to 8 x 9: with neither z nor its mask carrying the layout, a mixing
    twin cannot know which rows and columns are padding, and raises on every rank."""
    with pytest.raises(RankFailure, match=r"is not square; token axes padded apart") as info:
        run_on_grid(_rank_unsquare_without_layout, (2, 3), 7)
    assert sorted(info.value.failures) == [0, 1, 2, 3, 4, 5]
