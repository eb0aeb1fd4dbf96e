"""Outer product mean: serial reference against naive loops, CP twin against serial."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from twinshard.pair.reference.outer_product import OuterProductMean


def _randomise(module: torch.nn.Module, seed: int) -> None:
    # AF3 "final"/"gating" inits are zero; random values make every term matter.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5 + 0.1)


def test_opm_matches_naive_loops():
    torch.manual_seed(7)
    mod = OuterProductMean(5, 3, 4).double()
    _randomise(mod, 8)
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
    _randomise(mod, 9)
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
