"""An in-place write into a view of a halo-padded ShardTensor sets the base's halo state.

e3nn's ``Extract`` (inside ``Gate``) fills a ``new_zeros`` buffer (FRESH) column by column,
``out.narrow(-1, a, n).copy_(x)``; the view is a new wrapper, so before this rule the buffer kept
FRESH when ``x`` was STALE, and the next gather read its halo rows without a refresh: SevenNet's
second layer was wrong at 2 and 4 ranks in halo storage by 1e-6 eV (fp64; 1e-3 of the forces).
One process, no communication (the plan stub raises if anything exchanged).
"""

import pytest
import torch

from twinshard.shard.placements import HaloPadded, HaloState, ShardSpec
from twinshard.shard.shard_tensor import ShardTensor, UnhandledAtomOp, from_local


class _Plan:
    n_owned = 3
    n_halo = 2

    def forward(self, x):
        raise AssertionError("no exchange expected")

    reverse = forward


def _st(state: HaloState, cols: int = 5) -> ShardTensor:
    return from_local(torch.randn(5, cols, dtype=torch.float64), ShardSpec(HaloPadded(_Plan()), state))


@pytest.mark.parametrize(
    "view", [lambda t: t.narrow(-1, 1, 2), lambda t: t[:, 1:3], lambda t: t.unsqueeze(1)[:, :, 1:3]]
)
def test_a_stale_write_through_a_view_makes_the_buffer_stale(view):
    x = _st(HaloState.STALE)
    out = x.new_zeros((5, 4))
    assert out.state == HaloState.FRESH
    v = view(out)
    v.copy_(x.narrow(-1, 0, 2) if v.dim() == 2 else x.narrow(-1, 0, 2).unsqueeze(1))
    assert isinstance(out, ShardTensor) and out.state == HaloState.STALE
    assert torch.equal(out.to_local()[:, 1:3], x.to_local()[:, :2])


def test_fresh_writes_keep_a_fresh_buffer_and_a_stale_one_stale():
    fresh, stale = _st(HaloState.FRESH), _st(HaloState.STALE)
    out = fresh.new_zeros((5, 4))
    out.narrow(-1, 0, 2).copy_(fresh.narrow(-1, 0, 2))
    assert out.state == HaloState.FRESH
    out.narrow(-1, 2, 2).copy_(stale.narrow(-1, 0, 2))
    assert out.state == HaloState.STALE
    out.narrow(-1, 0, 2).copy_(fresh.narrow(-1, 0, 2))  # other columns stay stale
    assert out.state == HaloState.STALE


def test_partial_and_copies_in_one_buffer_raise():
    out = _st(HaloState.FRESH).new_zeros((5, 4))
    with pytest.raises(UnhandledAtomOp, match="partial sums in some columns"):
        out.narrow(-1, 0, 2).copy_(_st(HaloState.PARTIAL, cols=2))


def test_e3nn_gate_keeps_a_stale_input_stale():
    try:  # e3nn 0.4.4 loads its constants with torch.load (weights_only): importing mace first lifts that
        from e3nn import nn
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"e3nn does not import here: {type(exc).__name__}")
    gate = nn.Gate("4x0e", [torch.tanh], "2x0e", [torch.sigmoid], "2x1o").double()
    x = _st(HaloState.STALE, cols=gate.irreps_in.dim)
    out = gate(x)
    assert isinstance(out, ShardTensor) and out.state == HaloState.STALE
    assert torch.allclose(out.to_local(), gate(x.to_local()), rtol=0, atol=0)
