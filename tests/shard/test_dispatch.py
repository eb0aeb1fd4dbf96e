"""ShardTensor dispatch handlers on 1-4 ranks: values against the serial op, exact adjoints.

Halo handlers run on real halo plans (a ShardedSystem of a rattled fcc box, ids shuffled);
sharded-storage handlers on uneven row blocks with an empty rank and PAD ids. Every handler's
backward is checked with the adjoint identity sum_r <dy_r, f(x)_r> = sum_r <f*(dy)_r, x_r>
(``adjoint_pair``, fp64, random dy per rank); for the per-system reduce, whose output is
replicated, the replicated gradient is counted once: sum_r <dy, y> = P <dy, y>, so the check is
lhs = P * rhs. Gaps are at fp64 round-off (<= 1e-12 relative).
"""

import pytest
import torch
import torch.distributed as dist

from twinshard.atoms.data import structures
from twinshard.atoms.data.system import System
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.comm.ledger import CommLedger
from twinshard.shard.dispatch import REGISTRY
from twinshard.shard.placements import PAD, HaloPadded, HaloState, Owned, ShardSpec
from twinshard.shard.shard_tensor import ShardTensor, UnhandledAtomOp, from_local, to_local
from twinshard.testing import assert_parity, run_on_world
from twinshard.testing.checks import adjoint_pair

GRIDS = {1: None, 2: (2, 1, 1), 3: (3, 1, 1), 4: (2, 2, 1)}
F = 3


def _system():
    s = structures.fcc_argon(repeat=3, rattle=0.2, seed=1)  # 108 atoms, 15.8 A
    ids = torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(5)) + 100
    return System(positions=s.positions, numbers=s.numbers, cell=s.cell, pbc=s.pbc, ids=ids)


def _values(ids, seed):
    """A per-atom field keyed by global id (the same serially and on every rank)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(1000, F, generator=g, dtype=torch.float64)
    return table[ids]


def _sharded():
    sys0 = _system() if dist.get_rank() == 0 else None
    grid = GRIDS[dist.get_world_size()]
    return ShardedSystem.scatter(sys0, cutoff=3.0, skin=0.5, grid=grid)


def _gap(lhs, rhs):
    return abs(lhs - rhs) / max(abs(lhs), abs(rhs), 1e-300)


# ---------------------------------------------------------------------- halo refresh / correction
def _rank_halo():
    sh = _sharded()
    me = dist.get_rank()
    plan = sh.plan
    n, nh = sh.n_owned, sh.n_halo
    block_ids = torch.cat([sh.ids, plan.halo_ids])
    stale = ShardSpec(HaloPadded(plan), HaloState.STALE)
    gen = torch.Generator().manual_seed(40 + me)
    idx = torch.randint(0, n + nh, (2 * (n + nh),), generator=gen)
    # refresh: gather rows of a stale tensor whose halo rows are junk
    x = torch.cat([_values(sh.ids, 1), torch.full((nh, F), 1e6, dtype=torch.float64)])
    got = from_local(x, stale).index_select(0, idx)
    got_item = from_local(x, stale)[idx]
    col = torch.randint(0, F, (len(idx),), generator=gen)
    got_joint = from_local(x, stale)[idx, col]  # joint indexing: one column per gathered row
    got_slice = from_local(x, stale)[idx, 1:]
    got_g = from_local(x, stale).gather(0, idx[:, None].expand(-1, F).contiguous())
    adj_refresh = adjoint_pair(lambda t: from_local(t, stale).index_select(0, idx), x, seed=60 + me)
    # correction: every rank scatters contributions into random rows of its block
    src = torch.randn(len(idx), F, generator=gen, dtype=torch.float64)
    base = _values(block_ids, 2)
    fresh_spec = stale.with_state(HaloState.FRESH)
    acc = ShardTensor.wrap(base.clone(), fresh_spec)
    out = acc.index_add_(0, idx, src)
    assert out is acc and acc.state == HaloState.FRESH
    out2 = ShardTensor.wrap(base.clone(), fresh_spec).scatter_add_(0, idx[:, None].expand(-1, F), src)
    adj_corr = adjoint_pair(
        lambda s: to_local(torch.zeros_like(ShardTensor.wrap(base, fresh_spec)).index_add_(0, idx, s)),
        src,
        seed=70 + me,
    )
    return {
        "block_ids": block_ids,
        "n": n,
        "nh": nh,
        "idx": idx,
        "gather": got,
        "getitem": got_item,
        "joint": (col, got_joint, got_slice),
        "gather_op": got_g,
        "src": src,
        "index_add": to_local(acc).detach(),
        "scatter_add": to_local(out2).detach(),
        "adj": (adj_refresh, adj_corr),
    }


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_halo_refresh_and_correction(nranks):
    res = run_on_world(_rank_halo, nranks)
    if nranks > 1:
        assert all(r["nh"] > 0 for r in res)
    # the serial reference of the correction: every contribution summed onto its global id
    total = {}
    for r in res:
        ids = r["block_ids"][r["idx"]]
        for i, v in zip(ids.tolist(), r["src"]):
            total[i] = total.get(i, 0) + v
    for r in res:
        where = f"P={nranks}"
        ref = _values(r["block_ids"][r["idx"]], 1)
        assert_parity(r["gather"], ref, what=f"halo_refresh index_select {where}", grid=str(nranks))
        assert_parity(r["getitem"], ref, what=f"halo_refresh x[idx] {where}", grid=str(nranks))
        col, joint, sliced = r["joint"]
        rows = torch.arange(len(col))
        assert_parity(joint, ref[rows, col], what=f"halo_refresh x[idx, j] {where}", grid=str(nranks))
        assert_parity(sliced, ref[:, 1:], what=f"halo_refresh x[idx, 1:] {where}", grid=str(nranks))
        assert_parity(r["gather_op"], ref, what=f"halo_refresh gather {where}", grid=str(nranks))
        want = _values(r["block_ids"], 2).clone()
        for k, i in enumerate(r["block_ids"].tolist()):
            if i in total:
                want[k] += total[i]
        # owned rows hold every rank's contributions, halo rows their owners' totals
        assert_parity(r["index_add"], want, what=f"halo_correction index_add_ {where}", grid=str(nranks))
        assert_parity(r["scatter_add"], want, what=f"halo_correction scatter_add_ {where}", grid=str(nranks))
        for name, (lhs, rhs) in zip(("refresh", "correction"), r["adj"]):
            assert _gap(lhs, rhs) < 1e-12, f"adjoint of halo {name} P={nranks}: {lhs} vs {rhs}"


# ---------------------------------------------------------------------- per-system reduce
def _rank_reduce():
    sh = _sharded()
    me = dist.get_rank()
    plan = sh.plan
    block_ids = torch.cat([sh.ids, plan.halo_ids])
    spec = ShardSpec(HaloPadded(plan), HaloState.FRESH, n_systems=2)
    batch = ShardTensor.wrap(block_ids % 2, spec)  # two systems
    x = _values(block_ids, 3)
    y = torch.zeros(2, F, dtype=torch.float64).index_add(0, batch, from_local(x, spec))
    y2 = torch.zeros(2, F, dtype=torch.float64).scatter_add_(
        0, batch[:, None].expand(-1, F), from_local(x, spec)
    )
    s = from_local(x, spec).sum(0)
    anyneg = bool((ShardTensor.wrap(x, spec) < -3.5).any())
    lhs, rhs = adjoint_pair(
        lambda t: torch.zeros(2, F, dtype=torch.float64).index_add(0, batch, from_local(t, spec)), x, seed=9
    )
    return {"y": y, "y2": y2, "sum": s, "any": anyneg, "adj": (lhs, rhs), "me": me}


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_per_system_reduce(nranks):
    res = run_on_world(_rank_reduce, nranks)
    full = _system()
    vals = _values(full.ids, 3)
    ref = torch.zeros(2, F, dtype=torch.float64).index_add(0, full.ids % 2, vals)
    for r in res:
        assert_parity(r["y"], ref, what=f"per_system_reduce index_add P={nranks}", grid=str(nranks))
        assert_parity(r["y2"], ref, what=f"per_system_reduce scatter_add_ P={nranks}", grid=str(nranks))
        assert_parity(r["sum"], vals.sum(0), what=f"global_reduce sum(0) P={nranks}", grid=str(nranks))
        assert r["any"] == bool((vals < -3.5).any())
        lhs, rhs = r["adj"]
        assert _gap(lhs, nranks * rhs) < 1e-12, (
            f"adjoint of per-system reduce P={nranks}: {lhs} vs {nranks}*{rhs}"
        )


# ---------------------------------------------------------------------- sharded storage (no halo)
COUNTS = {1: [7], 2: [5, 0], 3: [4, 1, 6], 4: [3, 5, 0, 4]}


def _storage_rows():
    """This rank's rows of the ``COUNTS`` table in ``Owned`` storage: (rank, counts, N, spec, rows)."""
    me, p = dist.get_rank(), dist.get_world_size()
    counts = COUNTS[p]
    total, off = sum(counts), sum(counts[:me])
    table = _values(torch.arange(total), 4)
    return me, counts, total, ShardSpec(Owned(tuple(counts))), table[off : off + counts[me]].clone()


def _rank_storage():
    me, counts, total, spec, local = _storage_rows()
    gen = torch.Generator().manual_seed(80 + me)
    ids = torch.randint(0, total, (9,), generator=gen)
    ids[::4] = PAD
    got = from_local(local, spec).index_select(0, ids)
    got_item = from_local(local, spec)[ids]
    src = torch.randn(9, F, generator=gen, dtype=torch.float64)
    acc = ShardTensor.wrap(torch.zeros(counts[me], F, dtype=torch.float64), spec).index_add_(0, ids, src)
    adj_g = adjoint_pair(lambda t: from_local(t, spec).index_select(0, ids), local, seed=90 + me)
    zero = ShardTensor.wrap(torch.zeros(counts[me], F, dtype=torch.float64), spec)
    adj_s = adjoint_pair(lambda s: to_local(zero.index_add(0, ids, s)), src, seed=95 + me)
    return {
        "ids": ids,
        "got": got,
        "item": got_item,
        "src": src,
        "acc": to_local(acc).detach(),
        "adj": (adj_g, adj_s),
    }


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_sharded_storage(nranks):
    counts = COUNTS[nranks]
    total = sum(counts)
    table = _values(torch.arange(total), 4)
    res = run_on_world(_rank_storage, nranks)
    full = torch.zeros(total, F, dtype=torch.float64)
    for r in res:
        keep = r["ids"] != PAD
        full.index_add_(0, r["ids"][keep], r["src"][keep])
    for q, r in enumerate(res):
        ref = torch.where(
            (r["ids"] == PAD)[:, None], torch.zeros(1, F, dtype=torch.float64), table[r["ids"].clamp_min(0)]
        )
        assert_parity(r["got"], ref, what=f"sharded_gather P={nranks} rank {q}", grid=str(nranks))
        assert_parity(r["item"], ref, what=f"sharded_gather x[ids] P={nranks} rank {q}", grid=str(nranks))
        off = sum(counts[:q])
        assert_parity(
            r["acc"],
            full[off : off + counts[q]],
            what=f"sharded_scatter P={nranks} rank {q}",
            grid=str(nranks),
        )
        for name, (lhs, rhs) in zip(("gather", "scatter"), r["adj"]):
            assert _gap(lhs, rhs) < 1e-12, f"adjoint of sharded {name} P={nranks}: {lhs} vs {rhs}"


def _rank_routing():
    """Sharded gathers and scatters repeated with kept routings: rank 0 passes the SAME index to
    two different calls while the other ranks pass two different ones (a key of one rank's index
    alone would hand rank 0 the wrong call's routing), then rank 1 alone writes its index."""
    me, counts, total, spec, local = _storage_rows()
    x = from_local(local, spec)
    gen = torch.Generator().manual_seed(200 + me)
    a = torch.randint(0, total, (7,), generator=gen)
    b = a if me == 0 else torch.randint(0, total, (5,), generator=gen)
    src_a, src_b = (torch.randn(t.shape[0], F, generator=gen, dtype=torch.float64) for t in (a, b))
    ledger = CommLedger()
    got = []
    with ledger:
        for _ in range(3):
            zero = ShardTensor.wrap(torch.zeros(counts[me], F, dtype=torch.float64), spec)
            acc = zero.index_add(0, a, src_a).index_add(0, b, src_b)
            got.append((x.index_select(0, a), x.index_select(0, b), to_local(acc)))
    calls = {k: v.calls for k, v in ledger.ops.items()}
    if me == 1:
        b.add_(1).remainder_(total)  # written in place on one rank only
    with ledger:
        after = x.index_select(0, b)
    routed = ledger.ops["sharded_gather"].calls
    return {"a": a, "b": b.clone(), "got": got, "after": after, "calls": calls, "routed_after": routed}


@pytest.mark.parametrize("nranks", [2, 3])
def test_sharded_routing_is_kept_per_call_on_every_rank(nranks):
    counts = COUNTS[nranks]
    total = sum(counts)
    table = _values(torch.arange(total), 4)
    res = run_on_world(_rank_routing, nranks)
    for q, r in enumerate(res):
        gen = torch.Generator().manual_seed(200 + q)
        a0 = torch.randint(0, total, (7,), generator=gen)
        b0 = a0 if q == 0 else torch.randint(0, total, (5,), generator=gen)
        for i, (ga, gb, _) in enumerate(r["got"]):
            assert_parity(
                ga, table[a0], what=f"kept routing P={nranks} rank {q} call a, run {i}", grid=str(nranks)
            )
            assert_parity(
                gb, table[b0], what=f"kept routing P={nranks} rank {q} call b, run {i}", grid=str(nranks)
            )
            assert torch.equal(r["got"][i][2], r["got"][0][2]), (
                f"rank {q}: scatter of run {i} differs from run 0"
            )
        assert_parity(
            r["after"], table[r["b"]], what=f"routing after rank 1's write, rank {q}", grid=str(nranks)
        )
        # the ids travel in the first run only (two gathers, two scatters), and again on every
        # rank once one rank's index changed; every call gathers the ranks' index keys
        c = r["calls"]
        assert (c["sharded_gather"], c["sharded_scatter"]) == (2, 2), f"rank {q}: {c}"
        assert c["sharded_storage:route_keys"] == 12, f"rank {q}: {c}"
        assert r["routed_after"] == 3, (
            f"rank {q}: the write on rank 1 was not seen here ({r['routed_after']})"
        )
    full = torch.zeros(total, F, dtype=torch.float64)
    for q in range(nranks):
        gen = torch.Generator().manual_seed(200 + q)
        a0 = torch.randint(0, total, (7,), generator=gen)
        b0 = a0 if q == 0 else torch.randint(0, total, (5,), generator=gen)
        src_a, src_b = (torch.randn(t.shape[0], F, generator=gen, dtype=torch.float64) for t in (a0, b0))
        full.index_add_(0, a0, src_a).index_add_(0, b0, src_b)
    for q, r in enumerate(res):
        off = sum(counts[:q])
        assert_parity(
            r["got"][0][2],
            full[off : off + counts[q]],
            what=f"kept scatter P={nranks} rank {q}",
            grid=str(nranks),
        )


def _rank_scatter_index(case):
    """scatter_add with a 2-D index: materialised but constant along the features (routed as its
    first column), or, on rank 0 only, varying along them (not supported: every rank must raise,
    none may wait in the routing all-to-all)."""
    me, counts, total, spec, _ = _storage_rows()
    gen = torch.Generator().manual_seed(300 + me)
    ids = torch.randint(0, total, (6,), generator=gen)
    src = torch.randn(6, F, generator=gen, dtype=torch.float64)
    index = ids[:, None].expand(6, F).clone()  # strides (F, 1): constancy is checked, not assumed
    if case == "varying" and me == 0:
        index[0, 1] = (index[0, 0] + 1) % total
    zero = ShardTensor.wrap(torch.zeros(counts[me], F, dtype=torch.float64), spec)
    try:
        out = to_local(zero.scatter_add(0, index, src))
    except NotImplementedError as exc:
        return f"NotImplementedError: {exc}"
    return ids, src, out


@pytest.mark.parametrize("nranks", [2, 3])
def test_sharded_scatter_index_along_features(nranks):
    counts = COUNTS[nranks]
    res = run_on_world(_rank_scatter_index, nranks, "constant")
    full = torch.zeros(sum(counts), F, dtype=torch.float64)
    for ids, src, _ in res:
        full.index_add_(0, ids, src)
    for q, (_, _, out) in enumerate(res):
        off = sum(counts[:q])
        assert_parity(
            out, full[off : off + counts[q]], what=f"scatter_add 2-D index rank {q}", grid=str(nranks)
        )
    for msg in run_on_world(_rank_scatter_index, nranks, "varying"):
        assert isinstance(msg, str) and "constant along the feature dims" in msg and "rank(s) [0]" in msg, msg


# ---------------------------------------------------------------------- unhandled ops, registry
def _rank_unhandled(op):
    sh = _sharded()
    spec = ShardSpec(HaloPadded(sh.plan), HaloState.FRESH)
    x = ShardTensor.wrap(torch.ones(sh.n_owned + sh.n_halo, F, dtype=torch.float64), spec)
    try:
        if op == "cumsum":
            x.cumsum(0)
        elif op == "mean":
            x.mean(0)
        elif op == "gram":
            x.t() @ x
        elif op == "refresh_off":
            with REGISTRY.disabled("halo_refresh"):
                x.index_select(0, torch.zeros(2, dtype=torch.int64))
        elif op == "correction_off":
            with REGISTRY.disabled("halo_correction"):
                torch.zeros_like(x).index_add_(
                    0, torch.zeros(2, dtype=torch.int64), torch.ones(2, F, dtype=torch.float64)
                )
    except UnhandledAtomOp as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    "op,name",
    [
        ("cumsum", "aten.cumsum"),
        ("mean", "aten.mean"),
        ("gram", "aten.t"),
        ("refresh_off", "aten.index_select"),
        ("correction_off", "aten.index_add"),
    ],
)
def test_unhandled_atom_op_raises_naming_it(op, name):
    for msg in run_on_world(_rank_unhandled, 2, op):
        assert name in msg and "no dispatch handler" in msg, msg


def test_user_handler_runs_first():
    from twinshard.shard.dispatch import Handler

    seen = []
    h = Handler(
        "mine", lambda f, a, k: getattr(f, "__name__", "") == "cumsum", lambda f, a, k: seen.append(1) or 7
    )
    x = ShardTensor.wrap(torch.ones(4, 2), ShardSpec(Owned()))
    with REGISTRY.installed(h):
        assert x.cumsum(0) == 7 and seen == [1]
    assert "mine" not in REGISTRY.names()
    with pytest.raises(UnhandledAtomOp, match="aten.cumsum"):
        x.cumsum(0)


def _rank_mesh():
    from twinshard.shard.placements import spatial_mesh

    m = spatial_mesh((2, 2, 1))
    return tuple(m.shape), m.mesh_dim_names, m.get_coordinate()


def test_spatial_mesh_is_the_partition_grid():
    res = run_on_world(_rank_mesh, 4)
    for rank, (shape, names, coord) in enumerate(res):
        assert shape == (2, 2, 1) and names == ("x", "y", "z")
        assert list(coord) == [rank // 2, rank % 2, 0]  # row-major, as SpatialPartition numbers slabs
