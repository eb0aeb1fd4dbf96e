"""Serial references: Linear inits, LayerNorm precision, SwiGLU transition, dropout masks."""

import pytest
import torch
import torch.nn.functional as F

from twinshard.pair.reference import Dropout, LayerNorm, Linear, Transition, dropout_mask

# Tighter than the fp64 defaults on purpose: an fp32 detour inside a reference
# would show up as ~1e-7 relative error, which the defaults could let through.
EXACT64 = dict(rtol=1e-13, atol=1e-13)


def test_linear_inits():
    torch.manual_seed(0)
    fan_in = 400
    w = Linear(fan_in, 300, init="default").weight.detach()
    assert abs(float(w.var()) * fan_in - 1.0) < 0.05
    assert float(w.abs().max()) <= 2.0 / 0.8796 / fan_in**0.5 + 1e-6  # truncated at 2 sigma
    w = Linear(fan_in, 300, init="relu").weight.detach()
    assert abs(float(w.var()) * fan_in - 2.0) < 0.1
    final = Linear(8, 5, init="final")
    assert not final.weight.any() and not final.bias.any()
    gate = Linear(8, 5, init="gating")
    assert not gate.weight.any() and torch.equal(gate.bias, torch.ones(5))
    assert Linear(8, 5, bias=False).bias is None
    with pytest.raises(ValueError, match="unknown init"):
        Linear(3, 3, init="xavier")


def test_linear_fp64_matches_formula():
    lin = Linear(6, 4).double()
    with torch.no_grad():
        lin.bias.normal_()
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias, **EXACT64)
    assert [n for n, _ in lin.named_parameters()] == ["weight", "bias"]


def test_layernorm_fp64_stays_fp64():
    ln = LayerNorm(7).double()
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    x = 1e3 + torch.randn(3, 5, 7, dtype=torch.float64)  # large mean: fp32 would lose digits
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    ref = (x - mean) / torch.sqrt(var + 1e-5) * ln.weight + ln.bias
    out = ln(x)
    assert out.dtype == torch.float64
    # Cancellation against the mean 1e3 costs fp64 ~1e-13 * 1e3 relative; an fp32
    # detour would cost ~6e-5, so 1e-9 separates the two by four orders.
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


def test_layernorm_low_precision_computes_in_fp32():
    ln = LayerNorm(16)
    x = torch.randn(4, 16).to(torch.bfloat16)
    out = ln(x)
    assert out.dtype == torch.bfloat16
    ref = F.layer_norm(x.float(), (16,), ln.weight, ln.bias, 1e-5).to(torch.bfloat16)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_transition_names_init_and_formula():
    torch.manual_seed(1)
    t = Transition(6).double()
    names = [n for n, _ in t.named_parameters()]
    assert names == ["norm.weight", "norm.bias", "fc1.weight", "fc2.weight", "fc3.weight"]
    assert t.fc1.weight.shape == (24, 6) and t.fc3.weight.shape == (6, 24)
    x = torch.randn(2, 5, 4, 6, dtype=torch.float64)
    assert not t(x).any()  # final init: a fresh transition adds nothing
    with torch.no_grad():
        t.fc3.weight.normal_()
        t.norm.weight.normal_()
        t.norm.bias.normal_()
    mean = x.mean(-1, keepdim=True)
    xn = (x - mean) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
    xn = xn * t.norm.weight + t.norm.bias
    a, b = xn @ t.fc1.weight.T, xn @ t.fc2.weight.T
    ref = (a * torch.sigmoid(a) * b) @ t.fc3.weight.T  # Alg. 11: swish(a) * b
    torch.testing.assert_close(t(x), ref, **EXACT64)
    assert Transition(4, hidden=10, out_dim=3).fc3.weight.shape == (3, 10)


def test_transition_gradcheck():
    torch.manual_seed(2)
    t = Transition(3, expansion=2).double()
    with torch.no_grad():
        t.fc3.weight.normal_()
    x = torch.randn(2, 2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(t, (x,))


@pytest.mark.parametrize("columnwise", [False, True])
def test_dropout_mask_shared_along_one_axis(columnwise):
    p = 0.25
    shape = (2, 9, 11, 16)
    m = dropout_mask(shape, p, seed=3, stream=1, columnwise=columnwise)
    assert m.shape == ((2, 9, 1, 16) if columnwise else (2, 1, 11, 16))
    vals = set(torch.unique(m).tolist())
    assert vals == {0.0, 1.0 / (1.0 - p)}
    keep = float((m > 0).double().mean())
    assert abs(keep - (1 - p)) < 0.06
    # Independent along channels and positions: masks differ between channels.
    assert not torch.equal(m[..., 0], m[..., 1])
    x = torch.randn(shape, dtype=torch.float64)
    y = x * m
    spatial = 1 if columnwise else 2
    shared = 2 if columnwise else 1
    # The kept/dropped pattern of y is constant along the shared axis.
    z = (y != 0).movedim(shared, 0)
    assert all(torch.equal(z[0], z[k]) for k in range(1, z.shape[0]))
    assert m.shape[spatial] == shape[spatial]


def test_dropout_mask_keyed_by_global_index():
    full_r = dropout_mask((2, 10, 12, 5), 0.3, seed=5, stream=2)
    full_c = dropout_mask((2, 10, 12, 5), 0.3, seed=5, stream=2, columnwise=True)
    # A block at (row 4, col 6) draws the serial mask's slice: what a rank holding it draws.
    blk_r = dropout_mask((2, 3, 4, 5), 0.3, seed=5, stream=2, row_offset=4, col_offset=6)
    blk_c = dropout_mask((2, 3, 4, 5), 0.3, seed=5, stream=2, columnwise=True, row_offset=4, col_offset=6)
    torch.testing.assert_close(blk_r, full_r[:, :, 6:10], rtol=0, atol=0)
    torch.testing.assert_close(blk_c, full_c[:, 4:7], rtol=0, atol=0)
    assert not torch.equal(full_r, dropout_mask((2, 10, 12, 5), 0.3, seed=6, stream=2))
    assert not torch.equal(full_r, dropout_mask((2, 10, 12, 5), 0.3, seed=5, stream=3))


def test_dropout_module():
    d = Dropout(0.25, stream=4)
    x = torch.randn(1, 4, 6, 3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="needs seed"):
        d(x)
    y = d(x, seed=11)
    mask = dropout_mask(x.shape, 0.25, seed=11, stream=4)
    torch.testing.assert_close(y, x * mask, rtol=0, atol=0)
    g = torch.randn_like(x)
    y.backward(g)
    torch.testing.assert_close(x.grad, g * mask, rtol=0, atol=0)
    d.eval()
    assert d(x) is x
    assert Dropout(0.0)(x, seed=1) is x
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        Dropout(1.0)
