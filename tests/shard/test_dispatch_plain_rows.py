"""Plain per-row tensors under the dispatch (``plain_rows``, ``plain_rows_reduce``, ``stack_then_sum``
with plain operands) at 1, 2 and 4 ranks, in halo storage (a ShardedSystem of a rattled fcc box, ids
shuffled, skin 0) and in owned storage without halo (uneven ``Owned(counts)`` blocks, an empty rank).

A plain per-row tensor is what a model allocates from a per-atom count and fills from plain per-edge
values (mace's ZBL energy ``V_ZBL [n_local]``): owned rows are the values, halo rows unknown. The
tests plant junk (1e6) in its halo rows, so a handler that read them would be off by ~1e6:

- ``index_add`` / ``scatter_add_`` (2-D, expanded index, and mace's 1-D form) from a plain source
  with a per-atom system index into a per-system buffer equal the serial sums over atoms (halo rows
  dropped, one all-reduce); the adjoint identity holds with the replicated output counted once per
  rank (lhs = P * rhs, random dy), and the gradient of the halo rows is exactly zero;
- ``torch.stack([x, plain], 0).sum(0)``, ``torch.stack([x, plain], -1)`` and ``x + plain`` are STALE
  (halo storage) and a gather after them reads every row from its owner (the serial values); their
  adjoints hold (random dy per rank);
- refusals: the handler switched off -> ``UnhandledAtomOp`` naming the op; a source whose dim 0 does
  not line up on one rank -> the same ``ValueError`` on every rank (agreed in the reduce's own
  all-reduce, no hang); a plain operand contracted on the right of a matmul is not taken as per-row
  (the result stays FRESH).
"""

import pytest
import torch
import torch.distributed as dist

from twinshard.atoms.data import structures
from twinshard.atoms.data.system import System
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.shard.dispatch import REGISTRY, plain_rows
from twinshard.shard.placements import HaloPadded, HaloState, Owned, ShardSpec
from twinshard.shard.shard_tensor import ShardTensor, UnhandledAtomOp, from_local, to_local
from twinshard.testing import assert_parity, run_on_world
from twinshard.testing.checks import adjoint_pair

GRIDS = {1: None, 2: (2, 1, 1), 4: (2, 2, 1)}
COUNTS = {1: [7], 2: [5, 0], 4: [3, 5, 0, 4]}
F = 3
JUNK = 1e6


def _system():
    s = structures.fcc_argon(repeat=3, rattle=0.2, seed=1)  # 108 atoms, 15.8 A
    ids = torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(5)) + 100
    return System(positions=s.positions, numbers=s.numbers, cell=s.cell, pbc=s.pbc, ids=ids)


def _values(ids, seed):
    """A per-atom field keyed by global id (the same serially and on every rank)."""
    table = torch.randn(1000, F, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return table[ids]


def _adjoint_rows(f, x, seed):
    """``adjoint_pair`` for a plain per-row input: on the default path (``x + plain``, a stack
    along another dim) autograd hands the plain input the gradient of the per-atom rows, a
    ShardTensor; its local rows (halo rows included, where ``x`` holds junk) are the adjoint's."""
    x = x.detach().clone().requires_grad_(True)
    y = f(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)
    (gx,) = torch.autograd.grad(y, x, dy)
    sums = torch.stack([(dy * y).sum(), (to_local(gx) * x.detach()).sum()]).detach()
    dist.all_reduce(sums)
    return float(sums[0]), float(sums[1])


def _refusals(batch, x, src, me, nranks):
    out = {}
    zeros = torch.zeros(2, F, dtype=torch.float64)
    try:
        with REGISTRY.disabled("plain_rows_reduce"):
            zeros.index_add(0, batch, src)
        out["reduce_off"] = "no error"
    except UnhandledAtomOp as exc:
        out["reduce_off"] = str(exc)
    try:
        with REGISTRY.disabled("stack_then_sum"):
            torch.stack([x, src], 0)
        out["stack_off"] = "no error"
    except UnhandledAtomOp as exc:
        out["stack_off"] = str(exc)
    try:  # the last rank's source has a row too many: every rank raises the same error
        bad = torch.zeros(src.shape[0] + 1, F, dtype=src.dtype)
        zeros.index_add(0, batch, bad if me == nranks - 1 else src)
        out["misaligned"] = "no error"
    except ValueError as exc:
        out["misaligned"] = str(exc)
    # a plain tensor with as many rows as the block, contracted on the right: not per-row
    w = torch.randn(x.shape[0], 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    sq = from_local(torch.ones(x.shape[0], x.shape[0], dtype=torch.float64), x.spec)
    out["matmul_state"] = (sq @ w).state
    return out


def _checks(batch, x, src, n, idx, idx_ids, me):
    """Every rank: the reduces, the stacks and their adjoints; ``src`` is plain per-row, ``n`` the
    owned rows, ``idx`` a gather index (``idx_ids``: the global ids of the rows it reads)."""
    zeros = torch.zeros(2, F, dtype=torch.float64)
    res = {
        "index_add": zeros.index_add(0, batch, src),
        "scatter_add": zeros.clone().scatter_add_(0, batch[:, None].expand(-1, F), src),
        # mace's scatter_sum(src, batch, dim=-1, dim_size=2) on a 1-D source
        "scatter_1d": torch.zeros(2, dtype=torch.float64).scatter_add_(
            0, batch.expand_as(src[:, 0]), src[:, 0]
        ),
        "adj_reduce": adjoint_pair(lambda t: zeros.index_add(0, batch, t), src, seed=9),
    }
    s = src.clone().requires_grad_(True)
    dy = torch.randn(2, F, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    (g,) = torch.autograd.grad(zeros.index_add(0, batch, s), s, dy)
    res["grad_rows"] = (g[:n], dy[to_local(batch)[:n]], g[n:])
    # stacks and a pointwise op mixing the per-atom x with the plain src, then a gather
    stacked = torch.stack([x, src], 0).sum(0)
    last = torch.stack([x, src], -1).sum(-1)
    added = x + src
    res["states"] = (type(stacked).__name__, stacked.state, last.state, added.state)
    res["gathers"] = [t.index_select(0, idx) for t in (stacked, last, added)]
    res["want"] = _values(idx_ids, 1) + _values(idx_ids, 2)
    z = from_local(torch.zeros_like(to_local(x)), x.spec)
    res["adj_stack"] = adjoint_pair(
        lambda t: to_local(torch.stack([z, t], 0).sum(0).index_select(0, idx)), src, seed=20 + me
    )
    res["adj_stack_last"] = _adjoint_rows(
        lambda t: to_local(torch.stack([z, t], -1).index_select(0, idx)), src, seed=30 + me
    )
    res["adj_add"] = _adjoint_rows(lambda t: to_local((z + t).index_select(0, idx)), src, seed=35 + me)
    return res


def _rank_halo():
    me, nranks = dist.get_rank(), dist.get_world_size()
    sys0 = _system() if me == 0 else None
    sh = ShardedSystem.scatter(sys0, cutoff=3.0, skin=0.0, grid=GRIDS[nranks])
    plan = sh.plan
    n, nh = sh.n_owned, sh.n_halo
    block_ids = torch.cat([sh.ids, plan.halo_ids])
    fresh = ShardSpec(HaloPadded(plan), HaloState.FRESH, sh.group, n_systems=2)
    batch = ShardTensor.wrap(block_ids % 2, fresh)
    src = torch.cat([_values(sh.ids, 1), torch.full((nh, F), JUNK, dtype=torch.float64)])  # plain
    x = from_local(_values(block_ids, 2), fresh)
    idx = torch.randint(0, n + nh, (2 * (n + nh),), generator=torch.Generator().manual_seed(40 + me))
    res = _checks(batch, x, src, n, idx, block_ids[idx], me)
    res["nh"] = nh
    res["plain_rows_state"] = plain_rows(src, x).state
    res.update(_refusals(batch, x, src, me, nranks))
    return res


def _rank_owned():
    me, nranks = dist.get_rank(), dist.get_world_size()
    counts = COUNTS[nranks]
    lo = sum(counts[:me])
    rows = torch.arange(lo, lo + counts[me])  # global rows; the field is keyed by row
    spec = ShardSpec(Owned(tuple(counts)), n_systems=2)
    batch = ShardTensor.wrap(rows % 2, spec)
    src = _values(rows, 1)
    x = from_local(_values(rows, 2), spec)
    # global row ids (this storage's index): rows other ranks own come through sharded_gather
    idx = torch.randint(0, sum(counts), (6,), generator=torch.Generator().manual_seed(50 + me))
    res = _checks(batch, x, src, counts[me], idx, idx, me)
    res.update(_refusals(batch, x, src, me, nranks))
    return res


@pytest.mark.parametrize("storage", ["halo", "owned"])
@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_plain_per_row_tensors(storage, nranks):
    res = run_on_world(_rank_halo if storage == "halo" else _rank_owned, nranks)
    where, gid = f"{storage} P={nranks}", str(nranks)
    if storage == "halo":
        full = _system().ids
        assert all(r["nh"] > 0 for r in res) == (nranks > 1)
    else:
        full = torch.arange(sum(COUNTS[nranks]))
    vals = _values(full, 1)
    ref = torch.zeros(2, F, dtype=torch.float64).index_add(0, full % 2, vals)
    for me, r in enumerate(res):
        assert_parity(r["index_add"], ref, what=f"plain_rows_reduce index_add {where}", grid=gid)
        assert_parity(r["scatter_add"], ref, what=f"plain_rows_reduce scatter_add_ {where}", grid=gid)
        assert_parity(
            r["scatter_1d"], ref[:, 0], what=f"plain_rows_reduce 1-D scatter_add_ {where}", grid=gid
        )
        lhs, rhs = r["adj_reduce"]
        assert abs(lhs - nranks * rhs) <= 1e-12 * max(abs(lhs), 1.0), (where, lhs, nranks * rhs)
        got, want, halo = r["grad_rows"]
        assert torch.equal(got, want) and torch.equal(halo, torch.zeros_like(halo)), where
        stale = HaloState.STALE if storage == "halo" else HaloState.FRESH
        assert r["states"] == ("ShardTensor", stale, stale, stale), (where, r["states"])
        if storage == "halo":
            assert r["plain_rows_state"] == HaloState.STALE
        for name, got in zip(("stack(0).sum(0)", "stack(-1).sum(-1)", "x + plain"), r["gathers"]):
            assert_parity(got, r["want"], what=f"gather after {name} with plain rows {where}", grid=gid)
        for name in ("adj_stack", "adj_stack_last", "adj_add"):
            lhs, rhs = r[name]
            assert abs(lhs - rhs) <= 1e-12 * max(abs(lhs), 1.0), (where, name, lhs, rhs)
        assert "aten.index_add" in r["reduce_off"] and "no dispatch handler" in r["reduce_off"], r[
            "reduce_off"
        ]
        assert "aten.stack" in r["stack_off"] and "no dispatch handler" in r["stack_off"], r["stack_off"]
        assert "not on 1 rank(s)" in r["misaligned"], (me, r["misaligned"])
        assert ("here the source has shape" in r["misaligned"]) == (me == nranks - 1), r["misaligned"]
        assert r["matmul_state"] == HaloState.FRESH


def test_plain_rows_refuses_a_tensor_that_does_not_line_up():
    x = ShardTensor.wrap(torch.zeros(4, 2), ShardSpec(Owned()))
    with pytest.raises(ValueError, match="local rows"):
        plain_rows(torch.zeros(5, 2), x)
    with pytest.raises(ValueError, match="local rows"):
        plain_rows(x, x)
