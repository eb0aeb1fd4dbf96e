"""Triangle multiplication: serial reference against naive loops, CP twin against serial."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from twinshard.pair.reference.triangle import (
    TriangleMultiplication,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
    triangle_contract,
)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    # AF3 "final"/"gating" inits are zero; random values make every term matter.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5 + 0.1)


def _naive_trimul(mod: TriangleMultiplication, z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Triple loop over (i, j, k) straight from AF3 Alg. 12/13, no einsum, no chunk."""
    B, N, _, c = z.shape
    h = mod.hidden
    ln_in, ln_out = mod.norm_in, mod.norm_out

    def ln(v, mod_ln):
        mu = v.mean(-1, keepdim=True)
        var = ((v - mu) ** 2).mean(-1, keepdim=True)
        return (v - mu) / torch.sqrt(var + mod_ln.eps) * mod_ln.weight + mod_ln.bias

    out = torch.zeros_like(z)
    for bb in range(B):
        x = ln(z[bb], ln_in)
        p = x @ mod.p_in.weight.T
        g = torch.sigmoid(x @ mod.g_in.weight.T)
        ab = p * g * mask[bb][..., None]
        a, b = ab[..., :h], ab[..., h:]
        o = torch.zeros(N, N, h, dtype=z.dtype)
        for i in range(N):
            for j in range(N):
                for k in range(N):
                    if mod.direction == "outgoing":
                        o[i, j] += a[i, k] * b[j, k]
                    else:
                        o[i, j] += a[k, i] * b[k, j]
        out[bb] = (ln(o, ln_out) @ mod.p_out.weight.T) * torch.sigmoid(x @ mod.g_out.weight.T)
    return out


@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
def test_trimul_matches_naive_loops(direction):
    torch.manual_seed(0)
    mod = TriangleMultiplication(6, direction, hidden=4).double()
    _randomise(mod, 1)
    z = torch.randn(2, 5, 5, 6, dtype=torch.float64)
    mask = (torch.rand(2, 5, 5) > 0.3).double()
    assert_close(mod(z, mask), _naive_trimul(mod, z, mask))


def test_trimul_parameter_names_and_order():
    names = [n for n, _ in TriangleMultiplicationOutgoing(8).named_parameters()]
    assert names == [
        "norm_in.weight",
        "norm_in.bias",
        "p_in.weight",
        "g_in.weight",
        "norm_out.weight",
        "norm_out.bias",
        "p_out.weight",
        "g_out.weight",
    ]
    mod = TriangleMultiplicationIncoming(8, hidden=3)
    assert mod.p_in.weight.shape == (6, 8) and mod.p_out.weight.shape == (8, 3)


def test_incoming_contraction_is_outgoing_of_transpose():
    # Alg. 13's contraction is Alg. 12's on transposed operands (the CP twin relies on it).
    torch.manual_seed(2)
    a, b = torch.randn(2, 2, 7, 7, 3, dtype=torch.float64)
    expect = triangle_contract(a.transpose(1, 2), b.transpose(1, 2), "outgoing")
    assert_close(triangle_contract(a, b, "incoming"), expect)


def test_trimul_masked_rows_do_not_contribute():
    torch.manual_seed(4)
    mod = TriangleMultiplicationOutgoing(4).double()
    _randomise(mod, 5)
    z = torch.randn(1, 6, 6, 4, dtype=torch.float64)
    mask = torch.ones(1, 6, 6, dtype=torch.float64)
    mask[:, :, 5] = 0  # column k = 5 dropped: changing z there must not move any output with j != 5
    base = mod(z, mask)
    z2 = z.clone()
    z2[:, :, 5] += torch.randn(6, 4, dtype=torch.float64)
    other = mod(z2, mask)
    assert_close(other[:, :, :5], base[:, :, :5])
    assert not torch.allclose(other[:, :, 5], base[:, :, 5])


def test_fp64_stays_fp64_and_fp32_accumulates():
    mod = TriangleMultiplicationOutgoing(4).double()
    _randomise(mod, 6)
    z = torch.randn(1, 3, 3, 4, dtype=torch.float64)
    a, _, _ = mod.project_in(z, None)
    assert a.dtype == torch.float64 and mod(z).dtype == torch.float64
    mod16 = TriangleMultiplicationOutgoing(4).to(torch.bfloat16)
    a16, _, _ = mod16.project_in(z.to(torch.bfloat16), None)
    assert a16.dtype == torch.float32 and mod16(z.to(torch.bfloat16)).dtype == torch.bfloat16


def test_shape_errors():
    with pytest.raises(ValueError, match="pair tensor"):
        TriangleMultiplicationOutgoing(4)(torch.randn(1, 3, 4, 4))
    with pytest.raises(ValueError, match="mask"):
        TriangleMultiplicationOutgoing(4)(torch.randn(1, 3, 3, 4), torch.ones(1, 3, 2))
    with pytest.raises(ValueError, match="direction"):
        TriangleMultiplication(4, "sideways")
