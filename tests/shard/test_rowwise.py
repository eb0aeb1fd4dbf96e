"""Row-wise handlers (einsum / tensordot / x[arange(n), idx]) and row-block views on halo-padded
ShardTensors at 2 ranks: values equal the plain op on the local rows, the subclass and placement
are kept, the backward is the exact adjoint (``adjoint_pair``), and non-row-wise forms raise."""

import pytest
import torch
import torch.distributed as dist

from twinshard.atoms.data import structures
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.shard.placements import HaloPadded, HaloState, Owned, ShardSpec
from twinshard.shard.shard_tensor import ShardTensor, UnhandledAtomOp, from_local, to_local
from twinshard.testing import run_on_world
from twinshard.testing.checks import adjoint_pair


def _rank():
    s = structures.fcc_argon(repeat=3, rattle=0.2, seed=1) if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(s, cutoff=3.0, skin=0.5, grid=(2, 1, 1))
    spec = ShardSpec(HaloPadded(sh.plan), HaloState.FRESH, sh.group)
    n = sh.n_owned + sh.n_halo
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(n, 4, 3, generator=g, dtype=torch.float64)
    attrs = torch.randn(n, 5, generator=g, dtype=torch.float64)
    w = torch.randn(5, 6, 4, generator=g, dtype=torch.float64)
    m = torch.randn(3, 7, generator=g, dtype=torch.float64)
    col = torch.randint(0, 3, (n,), generator=g)
    me = dist.get_rank()
    checks = {}
    # values and placement
    y = torch.einsum("ae,epc,aci->api", from_local(attrs, spec), w, from_local(x, spec))
    checks["einsum"] = isinstance(y, ShardTensor) and torch.allclose(
        to_local(y), torch.einsum("ae,epc,aci->api", attrs, w, x), rtol=0, atol=0
    )
    t = torch.tensordot(from_local(x, spec), m, dims=([2], [0]))
    checks["tensordot"] = isinstance(t, ShardTensor) and torch.equal(
        to_local(t), torch.tensordot(x, m, dims=([2], [0]))
    )
    p = from_local(x[:, 0, :], spec)[torch.arange(n), ShardTensor.wrap(col, spec)]
    checks["pick"] = isinstance(p, ShardTensor) and torch.equal(
        to_local(p), x[torch.arange(n), 0, col][:, None].squeeze(1)
    )
    v = from_local(x, spec).reshape(-1, 3)
    checks["row_block"] = (
        isinstance(v, ShardTensor) and v.spec.row_block == 4 and v.reshape(n, 12).spec.row_block == 1
    )
    # adjoints (linear in the tested argument)
    adj = {
        "einsum": adjoint_pair(
            lambda z: to_local(
                torch.einsum("ae,epc,aci->api", from_local(attrs, spec), w, from_local(z, spec))
            ),
            x,
            seed=10 + me,
        ),
        "tensordot": adjoint_pair(
            lambda z: to_local(torch.tensordot(from_local(z, spec), m, dims=([2], [0]))), x, seed=20 + me
        ),
        "pick": adjoint_pair(
            lambda z: to_local(from_local(z, spec)[torch.arange(n), ShardTensor.wrap(col, spec)]),
            x[:, 0, :].contiguous(),
            seed=30 + me,
        ),
        "row_block": adjoint_pair(
            lambda z: to_local(from_local(z, spec).reshape(-1, 3) @ m), x, seed=40 + me
        ),
    }
    # non-row-wise forms raise
    raised = {}
    for name, fn in {
        "einsum over atoms": lambda: torch.einsum("aci,aci->ci", from_local(x, spec), from_local(x, spec)),
        "tensordot contracting atoms": lambda: torch.tensordot(from_local(x, spec), x, dims=([0], [0])),
        "view splitting atoms": lambda: from_local(x, spec).reshape(3, -1),
        "sum of a row-block view": lambda: from_local(x, spec).reshape(-1, 3).sum(0),
    }.items():
        try:
            fn()
            raised[name] = False
        except UnhandledAtomOp:
            raised[name] = True
    return checks, adj, raised


def test_rowwise_handlers_values_adjoints_and_refusals():
    for checks, adj, raised in run_on_world(_rank, 2):
        assert all(checks.values()), checks
        for name, (lhs, rhs) in adj.items():
            assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), (name, lhs, rhs)
        assert all(raised.values()), raised


def test_owned_rows_row_block_in_repr():
    x = ShardTensor.wrap(torch.randn(5, 4, dtype=torch.float64), ShardSpec(Owned()))
    assert "rows/atom=2" in repr(x.reshape(10, 2).spec)
    with pytest.raises(UnhandledAtomOp, match="aten.sum"):
        x.reshape(-1).sum()
