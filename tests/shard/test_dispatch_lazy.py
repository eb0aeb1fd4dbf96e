"""``halo_correction`` inside ``lazy_halo()`` (how ``DistributedPotential(mode="dispatch")`` runs a
model): the result is STALE, its owned rows hold every rank's contributions, a gather after it
refreshes the halo to the owners' totals, and the backward is the exact adjoint; with an index
that hits no halo row on any rank the exchanges are skipped (ledger). Negative control: a
planted agreement that never sees halo rows drops their contributions, and parity says so.
"""

import pytest
import torch
import torch.distributed as dist

from twinshard.atoms.data import structures
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.comm import CommLedger
from twinshard.comm.adjoint import adjoint_pair
from twinshard.shard import dispatch as D
from twinshard.shard import halo_handlers as H
from twinshard.shard.placements import HaloPadded, HaloState, ShardSpec
from twinshard.shard.shard_tensor import ShardTensor, to_local
from twinshard.testing import assert_parity, run_on_world

GRIDS = {1: None, 2: (2, 1, 1), 4: (2, 2, 1)}
F = 3


def _rank(planted=False):
    s = structures.fcc_argon(repeat=3, rattle=0.2, seed=1) if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(s, cutoff=3.0, skin=0.5, grid=GRIDS[dist.get_world_size()])
    n, nh = sh.n_owned, sh.n_halo
    ids = torch.cat([sh.ids, sh.plan.halo_ids])
    spec = ShardSpec(HaloPadded(sh.plan), HaloState.FRESH)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    idx = torch.randint(0, n + nh, (2 * (n + nh),), generator=gen)  # hits halo rows
    src = torch.randn(len(idx), F, generator=gen, dtype=torch.float64)
    own_idx = torch.randint(0, n, (n,), generator=gen)  # owned rows only (a block's receivers)
    zeros = ShardTensor.wrap(torch.zeros(n + nh, F, dtype=torch.float64), spec)
    original = H._hits_halo
    if planted:  # planted bug: the agreement never sees a halo row, so the reverse is skipped
        H._hits_halo = lambda index, n_owned, group: False
    try:
        with D.lazy_halo():
            acc = torch.zeros_like(zeros).index_add_(0, idx, src)
            state = acc.state
            regathered = acc.index_select(0, torch.arange(n + nh))  # refresh: owners' totals
            adj = adjoint_pair(
                lambda t: to_local(torch.zeros_like(zeros).index_add(0, idx, t).index_select(0, idx)),
                src,
                seed=20 + dist.get_rank(),
            )
            with CommLedger() as ledger:
                owned_only = torch.zeros_like(zeros).index_add_(0, own_idx, src[:n])
    finally:
        H._hits_halo = original
    return {
        "ids": ids,
        "n": n,
        "idx_ids": ids[idx],
        "src": src,
        "own_ids": ids[own_idx],
        "state": state,
        "acc": to_local(acc).detach(),
        "regathered": to_local(regathered).detach(),
        "adj": adj,
        "owned_only": to_local(owned_only).detach(),
        "owned_only_state": owned_only.state,
        "ops": sorted(ledger.ops),
    }


def _check(res, nranks):
    total, own_total = {}, {}
    for r in res:
        for i, v in zip(r["idx_ids"].tolist(), r["src"]):
            total[i] = total.get(i, 0) + v
        for i, v in zip(r["own_ids"].tolist(), r["src"][: r["n"]]):
            own_total[i] = own_total.get(i, 0) + v
    zero = torch.zeros(F, dtype=torch.float64)
    for r in res:
        n, ids = r["n"], r["ids"]
        want = torch.stack([total.get(i, zero) for i in ids.tolist()])
        assert r["state"] == HaloState.STALE and r["owned_only_state"] == HaloState.STALE
        assert_parity(r["acc"][:n], want[:n], what="lazy halo_correction: owned rows", grid=str(nranks))
        assert_parity(r["regathered"], want, what="lazy halo_correction, then a gather", grid=str(nranks))
        want_own = torch.stack([own_total.get(i, zero) for i in ids.tolist()])
        assert_parity(r["owned_only"][:n], want_own[:n], what="lazy, owned-only index", grid=str(nranks))
        lhs, rhs = r["adj"]
        assert abs(lhs - rhs) <= 1e-12 * max(abs(lhs), abs(rhs)), f"adjoint P={nranks}: {lhs} vs {rhs}"
        assert not any(op.startswith("halo") and "vote" not in op for op in r["ops"]), r["ops"]


@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_lazy_halo_correction(nranks):
    res = run_on_world(_rank, nranks)
    if nranks > 1:
        assert all(0 < r["n"] < len(r["ids"]) for r in res)  # halo rows exist: the case is real
    _check(res, nranks)


def test_lazy_halo_correction_catches_a_skipped_reverse():
    """Negative control: halo rows' contributions dropped (the reverse skipped) fail parity."""
    res = run_on_world(_rank, 2, True)
    with pytest.raises(AssertionError, match="lazy halo_correction: owned rows"):
        _check(res, 2)
