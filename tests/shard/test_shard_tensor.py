"""ShardTensor mechanics on one process: zero-copy wrapping, metadata through ops, autograd.

No communication here (owned placements and halo-padded ones whose ops stay local); the
handlers and their collectives are tested in test_dispatch.py.
"""

import pickle

import pytest
import torch

from twinshard.shard.dispatch import REGISTRY
from twinshard.shard.placements import HaloPadded, HaloState, Owned, PerSystem, ShardSpec
from twinshard.shard.shard_tensor import ShardTensor, UnhandledAtomOp, from_local, to_local


class _Plan:
    """A halo plan stub (the protocol's shape only; no op here exchanges)."""

    n_owned = 3
    n_halo = 2

    def forward(self, x):
        raise AssertionError("no exchange expected")

    reverse = forward


HALO = ShardSpec(HaloPadded(_Plan()), HaloState.FRESH, n_systems=2)


def test_wrap_is_zero_copy_and_keeps_metadata():
    local = torch.randn(5, 4, dtype=torch.float64)
    x = ShardTensor.wrap(local, HALO)
    assert to_local(x).data_ptr() == local.data_ptr()
    assert x.n_owned == 3 and x.n_systems == 2 and x.state == HaloState.FRESH
    x.add_(1.0)  # in place through the wrapper reaches the local rows
    assert torch.equal(to_local(x), local)
    assert isinstance(x, ShardTensor) and x.spec is not None


def test_like_allocators_keep_the_subclass_and_set_the_state():
    x = ShardTensor.wrap(torch.randn(5, 4, dtype=torch.float64), HALO)
    for f, state in (
        (torch.zeros_like, HaloState.FRESH),
        (torch.ones_like, HaloState.FRESH),
        (torch.empty_like, HaloState.STALE),
        (lambda t: t.new_zeros(t.shape), HaloState.FRESH),
        (lambda t: t.new_empty(t.shape), HaloState.STALE),
        (lambda t: torch.full_like(t, 2.0), HaloState.FRESH),
    ):
        y = f(x)
        assert isinstance(y, ShardTensor) and y.state == state and isinstance(y.placement, HaloPadded)
    assert type(x.new_zeros(7, 2)) is torch.Tensor  # another size: plain


def test_state_propagation_and_slices():
    x = ShardTensor.wrap(torch.randn(5, 4, dtype=torch.float64), HALO)
    w = torch.randn(4, 2, dtype=torch.float64)
    assert (torch.tanh(x @ w) + 1).state == HaloState.FRESH  # row-wise ops with replicated operands
    assert (x + torch.randn(5, 4, dtype=torch.float64)).state == HaloState.STALE  # plain per-atom rows
    assert x.sum(1).state == HaloState.FRESH and x[:, 0].shape == (5,)
    own = x[:3]
    assert isinstance(own, ShardTensor) and own.placement == Owned()
    assert type(x[1:3]) is torch.Tensor  # other local rows: plain
    y = x.clone()
    y.copy_(torch.randn(5, 4, dtype=torch.float64))
    assert y.state == HaloState.STALE
    y.zero_()
    assert y.state == HaloState.FRESH
    # a plain table gathered with a per-atom index has the index's rows
    numbers = ShardTensor.wrap(torch.tensor([0, 1, 1, 0, 1]), HALO)
    emb = torch.randn(2, 4)[numbers]
    assert isinstance(emb, ShardTensor) and emb.shape == (5, 4)
    per_sys = ShardTensor.wrap(torch.randn(2, 3), ShardSpec(PerSystem()))
    assert isinstance(per_sys * 2, ShardTensor) and (per_sys * 2).placement == PerSystem()
    assert per_sys.sum().dim() == 0  # reductions over systems are not atom reductions


def test_double_backward_matches_plain_tensors():
    """autograd.grad(create_graph=True) through the wrapper (as MACE's forces) and a loss on it."""
    x0 = torch.randn(5, 3, dtype=torch.float64)
    w0 = torch.randn(3, 4, dtype=torch.float64)

    def run(wrap):
        x = x0.clone().requires_grad_(True)
        w = w0.clone().requires_grad_(True)
        h = from_local(x, ShardSpec(Owned())) if wrap else x
        y = torch.tanh(h @ w) * h.pow(2).sum(1, keepdim=True)
        e = (to_local(y) ** 2).sum()
        (g,) = torch.autograd.grad(e, x, create_graph=True)
        (gw,) = torch.autograd.grad((g**2).sum(), w)
        return g.detach(), gw

    g1, gw1 = run(True)
    g2, gw2 = run(False)
    assert torch.equal(g1, g2) and torch.equal(gw1, gw2)


def _unhandled_reduce(x):
    with REGISTRY.disabled("per_system_reduce"):
        return torch.zeros(2, 4, dtype=torch.float64).index_add(0, torch.zeros(5, dtype=torch.int64), x)


@pytest.mark.parametrize(
    "op,name",
    [
        (lambda x: x.mean(0), "aten.mean"),
        (lambda x: x.max(0), "aten.max"),
        (lambda x: x.cumsum(0), "aten.cumsum"),
        (lambda x: x.t(), "aten.t"),
        (lambda x: x.reshape(4, 5), "aten.view"),  # splits atoms across rows (x.reshape(-1) is row-wise)
        (lambda x: torch.cat([x, x]), "aten.cat"),
        (lambda x: torch.randn(2, 5, dtype=torch.float64) @ x, "aten.mm"),
        (lambda x: x[0], "aten.select"),
        (lambda x: x.sort(0), "aten.sort"),
        (_unhandled_reduce, "aten.index_add"),
    ],
)
def test_unhandled_atom_dim_ops_raise(op, name):
    x = ShardTensor.wrap(torch.randn(5, 4, dtype=torch.float64), ShardSpec(Owned()))
    with pytest.raises(UnhandledAtomOp, match=name):
        op(x)


def test_does_not_pickle():
    x = ShardTensor.wrap(torch.randn(5, 4), HALO)
    with pytest.raises(TypeError, match="to_local"):
        pickle.dumps(x)
