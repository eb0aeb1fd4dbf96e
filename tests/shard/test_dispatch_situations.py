"""Dispatch situations the other dispatch tests never create, at 2 and 3 ranks (uneven blocks).

Each result is checked against the serial op on the full tensor (fp64, ``assert_parity`` at
round-off), gradients with the adjoint identity and a random ``dy`` per rank (``adjoint_pair``).
Halo storage is a ShardedSystem of a rattled fcc box (ids shuffled); sharded storage is uneven
``Owned(counts)`` blocks with an empty rank. Per-atom values are keyed by global id (a table), so
the serial reference is the same op on the table's rows.

1. ``halo_correction`` where exactly ONE rank's index hits a halo row (the others only owned
   rows): inside ``lazy_halo()`` the agreed flag makes every rank run the reverse exchange
   (ledger), and the owned rows, then the refreshed rows, equal the serial scatter; outside too.
2. A STALE tensor gathered (its refresh kept on it), written in place (through the wrapper, its
   local rows, a view of its owned rows, an add of another ShardTensor), gathered again: every
   gather equals the serial one, and a refresh is reused only while nothing was written (ledger).
   A refresh kept from a ``no_grad`` gather is not reused by a gather that needs the gradient.
3. Gathers and scatters along a FEATURE dim of a halo-padded tensor (``index_select(1, ...)``,
   ``gather(1, ...)``, ``x[:, cols]``, ``index_add_(1, ...)``, ``scatter_add_(1, ...)``): no handler
   claims them (the handlers' contract is dim 0); the default path runs them on the local rows
   with no exchange, the rows stay the atoms and the halo state follows the inputs, so a dim-0
   gather after them equals the serial one.
4. One index tensor against sharded targets of different counts, a halo-padded target, and back:
   every gather and scatter equals the serial one (a kept routing is not reused for another
   placement).
5. The optional arguments and forms of the scatters: ``alpha`` (in place, ``Tensor.index_add``,
   ``torch.index_add``, keyword arguments) and ``scatter_add``'s forms, in ``halo_correction`` (also
   lazy), ``sharded_scatter``, ``per_system_reduce`` and ``plain_rows_reduce``: exact. ``out=`` is
   refused on every rank (``UnhandledAtomOp`` naming the ``.out`` overload), never ignored.
6. A PARTIAL target of ``halo_correction`` stays PARTIAL (its halo partial sums kept): exact.
"""

import pytest
import torch
import torch.distributed as dist

from twinshard.atoms.data import structures
from twinshard.atoms.data.system import System
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.comm.ledger import CommLedger
from twinshard.shard import dispatch as D
from twinshard.shard.placements import PAD, HaloPadded, HaloState, Owned, ShardSpec
from twinshard.shard.shard_tensor import ShardTensor, UnhandledAtomOp, from_local, to_local
from twinshard.testing import assert_parity, run_on_world
from twinshard.testing.checks import adjoint_pair

GRIDS = {2: (2, 1, 1), 3: (3, 1, 1)}
F = 3
JUNK = 1e6  # a STALE tensor's halo rows: a gather that read them unrefreshed is off by ~1e6
ALPHA = -0.5
NRANKS = [2, 3]


def _system():
    s = structures.fcc_argon(repeat=3, rattle=0.2, seed=1)  # 108 atoms, 15.8 A
    ids = torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(5)) + 100
    return System(positions=s.positions, numbers=s.numbers, cell=s.cell, pbc=s.pbc, ids=ids)


def _table(seed, cols=F):
    """Per-atom values keyed by global id (the same serially and on every rank)."""
    return torch.randn(1000, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _halo():
    """(rank, n_owned, n_halo, block ids [owned | halo], STALE spec) of this rank's halo block."""
    s = _system() if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(s, cutoff=3.0, skin=0.5, grid=GRIDS[dist.get_world_size()])
    spec = ShardSpec(HaloPadded(sh.plan), HaloState.STALE)
    return dist.get_rank(), sh.n_owned, sh.n_halo, torch.cat([sh.ids, sh.plan.halo_ids]), spec


def _stale_rows(values, n, nh):
    """Owned rows = the values, halo rows junk (a STALE tensor's local rows)."""
    return torch.cat([values[:n], torch.full((nh,) + tuple(values.shape[1:]), JUNK, dtype=values.dtype)])


def _calls(ledger, op):
    st = ledger.ops.get(op)
    return 0 if st is None else st.calls


def _serial_add(base, contributions, alpha=1.0):
    """The serial scatter: ``base`` (a table keyed by id) plus every rank's (ids, src), in order."""
    out = base.clone()
    for gids, src in contributions:
        out.index_add_(0, gids, src, alpha=alpha)
    return out


def _gap(lhs, rhs):
    return abs(lhs - rhs) / max(abs(lhs), abs(rhs), 1e-300)


def _check_adjoint(adj, what, factor=1):
    lhs, rhs = adj
    assert _gap(lhs, factor * rhs) < 1e-12, f"adjoint of {what}: {lhs} vs {factor}*{rhs}"


# ---------------------------------------------------------------------- 1. one rank hits the halo
def _rank_one_hit():
    me, n, nh, ids, stale = _halo()
    fresh = stale.with_state(HaloState.FRESH)
    gen = torch.Generator().manual_seed(100 + me)
    idx = torch.randint(0, n, (2 * n,), generator=gen)  # owned rows only (a block's receivers)
    if me == 0:  # ... but rank 0 also scatters into three of its halo rows
        idx[::11][:3] = n + torch.randint(0, nh, (3,), generator=gen)
    src = torch.randn(len(idx), F, generator=gen, dtype=torch.float64)
    base = _table(2)[ids]  # FRESH: the halo rows are copies of the owners' rows
    every = torch.arange(n + nh)
    out = {"ids": ids, "n": n, "gids": ids[idx], "src": src, "hits": bool((idx >= n).any())}
    with D.lazy_halo():
        with CommLedger() as ledger:
            acc = ShardTensor.wrap(base.clone(), fresh).index_add_(0, idx, src)
        out["lazy_reverse_calls"] = _calls(ledger, "halo_reverse")
        out["lazy_state"] = acc.state
        out["lazy_owned"] = to_local(acc)[:n].clone()
        out["lazy_refreshed"] = acc.index_select(0, every)
        sadd = ShardTensor.wrap(base.clone(), fresh).scatter_add_(0, idx[:, None].expand(-1, F), src)
        out["lazy_scatter_refreshed"] = sadd[every]
        zero = ShardTensor.wrap(torch.zeros(n + nh, F, dtype=torch.float64), fresh)
        out["lazy_adj"] = adjoint_pair(
            lambda s: zero.index_add(0, idx, s).index_select(0, every), src, seed=110 + me
        )
    eager = ShardTensor.wrap(base.clone(), fresh).index_add_(0, idx, src)
    out["eager_state"] = eager.state
    out["eager"] = to_local(eager).clone()
    out["eager_adj"] = adjoint_pair(lambda s: to_local(zero.index_add(0, idx, s)), src, seed=120 + me)
    return out


@pytest.mark.parametrize("nranks", NRANKS)
def test_halo_correction_with_one_rank_hitting_the_halo(nranks):
    res = run_on_world(_rank_one_hit, nranks)
    assert [r["hits"] for r in res] == [True] + [False] * (nranks - 1), "the situation is not real"
    want = _serial_add(_table(2), [(r["gids"], r["src"]) for r in res])
    g = str(nranks)
    for q, r in enumerate(res):
        ids, n = r["ids"], r["n"]
        assert r["lazy_state"] == HaloState.STALE and r["eager_state"] == HaloState.FRESH
        where = f"P={nranks} rank {q}"
        assert_parity(r["lazy_owned"], want[ids[:n]], what=f"lazy one-rank hit: owned rows {where}", grid=g)
        assert_parity(r["lazy_refreshed"], want[ids], what=f"lazy one-rank hit, refreshed {where}", grid=g)
        assert_parity(
            r["lazy_scatter_refreshed"], want[ids], what=f"lazy one-rank hit scatter_add_ {where}", grid=g
        )
        assert_parity(r["eager"], want[ids], what=f"eager one-rank hit {where}", grid=g)
        _check_adjoint(r["lazy_adj"], f"lazy one-rank hit P={nranks}")
        _check_adjoint(r["eager_adj"], f"eager one-rank hit P={nranks}")
        # the agreed flag: every rank ran the reverse exchange, those that hit no halo row too
        assert r["lazy_reverse_calls"] == 1, f"rank {q} skipped the agreed reverse exchange"


# ---------------------------------------------------------------------- 2. gather, write, gather
def _rank_rewrite():
    me, n, nh, ids, stale = _halo()
    gen = torch.Generator().manual_seed(200 + me)
    idx = torch.randint(0, n + nh, (2 * (n + nh),), generator=gen)  # halo rows included
    x = ShardTensor.wrap(_stale_rows(_table(1)[ids], n, nh), stale)
    got, forwards, states = [], [], []

    def gather(how="index_select"):
        with CommLedger() as ledger:
            if how == "index_select":
                y = x.index_select(0, idx)
            elif how == "getitem":
                y = x[idx]
            else:
                y = x.gather(0, idx[:, None].expand(-1, F))
        got.append(y)
        forwards.append(_calls(ledger, "halo_forward"))
        states.append(x.state)

    gather()
    gather("getitem")  # nothing written: the kept refresh serves it
    x.mul_(2)  # in place through the wrapper
    gather()
    to_local(x)[:n] += _table(3)[ids[:n]]  # through its local rows (a plain view)
    gather("getitem")
    x[:n] += _table(4)[ids[:n]]  # through a view of its owned rows (an Owned ShardTensor)
    gather("gather")
    x.add_(ShardTensor.wrap(_stale_rows(_table(5)[ids], n, nh), stale))  # another STALE tensor
    gather()

    # a refresh kept from a no_grad gather has no graph: a gather with grad must not reuse it
    def f(t):
        xt = from_local(t, stale)
        with torch.no_grad():
            xt.index_select(0, idx)
        return xt.index_select(0, idx)

    adj = adjoint_pair(f, _stale_rows(_table(1)[ids], n, nh), seed=210 + me)
    return {"ids": ids, "gids": ids[idx], "got": got, "forwards": forwards, "states": states, "adj": adj}


@pytest.mark.parametrize("nranks", NRANKS)
def test_gather_write_in_place_gather_again(nranks):
    res = run_on_world(_rank_rewrite, nranks)
    v = _table(1)
    serial = [v, v]
    v = 2 * v
    serial.append(v)
    v = v + _table(3)
    serial.append(v)
    v = v + _table(4)
    serial.append(v)
    v = v + _table(5)
    serial.append(v)
    for q, r in enumerate(res):
        assert all(s == HaloState.STALE for s in r["states"]), r["states"]
        for k, (got, want) in enumerate(zip(r["got"], serial)):
            assert_parity(
                got,
                want[r["gids"]],
                what=f"gather {k} after in-place writes, P={nranks} rank {q}",
                grid=str(nranks),
            )
        assert r["forwards"] == [1, 0, 1, 1, 1, 1], f"rank {q}: refreshes per gather {r['forwards']}"
        _check_adjoint(r["adj"], f"gather with grad after a no_grad gather P={nranks}")


# ---------------------------------------------------------------------- 3. feature-dim ops
COLS = [2, 0, 2]


def _per_row_index(ids, seed, k, high):
    """A per-atom integer index along dim 1, keyed by id (its halo rows are the owners')."""
    return torch.randint(0, high, (1000, k), generator=torch.Generator().manual_seed(seed))[ids]


def _rank_features():
    me, n, nh, ids, stale = _halo()
    fresh = stale.with_state(HaloState.FRESH)
    gen = torch.Generator().manual_seed(300 + me)
    idx = torch.randint(0, n + nh, (2 * (n + nh),), generator=gen)
    cols = torch.tensor(COLS)
    x = ShardTensor.wrap(_table(1, 4)[ids], fresh)
    per_row = ShardTensor.wrap(_per_row_index(ids, 7, 2, 4), fresh)
    src = _table(8, len(COLS))[ids]
    out = {"ids": ids, "gids": ids[idx]}
    with CommLedger() as ledger:
        ys = {
            "index_select": x.index_select(1, cols),
            "gather": x.gather(1, per_row),
            "getitem": x[:, cols],
            "index_add_": ShardTensor.wrap(_table(1, 4)[ids], fresh).index_add_(
                1, cols, ShardTensor.wrap(src, fresh), alpha=ALPHA
            ),
            "scatter_add_": ShardTensor.wrap(_table(1, 4)[ids], fresh).scatter_add_(
                1, per_row, ShardTensor.wrap(_table(9, 2)[ids], fresh)
            ),
        }
    out["exchanges"] = sorted(k for k in ledger.ops if k.startswith("halo"))
    out["fresh"] = {k: (type(y).__name__, y.state, to_local(y).clone()) for k, y in ys.items()}
    out["fresh_then_gather"] = {k: y.index_select(0, idx) for k, y in ys.items()}
    # STALE inputs of a feature-dim scatter: the result is STALE, a dim-0 gather refreshes it
    stale_target = ShardTensor.wrap(_stale_rows(_table(1, 4)[ids], n, nh), stale)
    a = stale_target.index_add_(1, cols, ShardTensor.wrap(src, fresh), alpha=ALPHA)
    b = ShardTensor.wrap(_table(1, 4)[ids], fresh).index_add_(
        1, cols, ShardTensor.wrap(_stale_rows(src, n, nh), stale), alpha=ALPHA
    )
    out["stale"] = {k: (t.state, t.index_select(0, idx)) for k, t in (("target", a), ("source", b))}
    # gradients: row-wise local ops, no exchange; the adjoint identity on the local rows
    out["adj"] = adjoint_pair(
        lambda t: to_local(from_local(t, fresh).index_select(1, cols)), to_local(x), seed=310
    )
    return out


def _feature_serial():
    t = _table(1, 4)
    per_row = _per_row_index(torch.arange(1000), 7, 2, 4)
    cols = torch.tensor(COLS)
    return {
        "index_select": t.index_select(1, cols),
        "gather": t.gather(1, per_row),
        "getitem": t[:, cols],
        "index_add_": t.clone().index_add_(1, cols, _table(8, len(COLS)), alpha=ALPHA),
        "scatter_add_": t.clone().scatter_add_(1, per_row, _table(9, 2)),
    }


@pytest.mark.parametrize("nranks", NRANKS)
def test_feature_dim_gathers_and_scatters(nranks):
    res = run_on_world(_rank_features, nranks)
    serial = _feature_serial()
    g = str(nranks)
    for q, r in enumerate(res):
        ids, gids = r["ids"], r["gids"]
        assert r["exchanges"] == [], f"rank {q}: a feature-dim op exchanged halos: {r['exchanges']}"
        for k, (kind, state, local) in r["fresh"].items():
            assert kind == "ShardTensor" and state == HaloState.FRESH, (k, kind, state)
            assert_parity(local, serial[k][ids], what=f"feature-dim {k} P={nranks} rank {q}", grid=g)
            assert_parity(
                r["fresh_then_gather"][k], serial[k][gids], what=f"{k}, then a gather, rank {q}", grid=g
            )
        for k, (state, gathered) in r["stale"].items():
            assert state == HaloState.STALE, f"feature-dim index_add_ with a STALE {k}: {state}"
            assert_parity(gathered, serial["index_add_"][gids], what=f"STALE {k}, then a gather", grid=g)
        _check_adjoint(r["adj"], f"feature-dim index_select P={nranks}")


def _rank_stale_table():
    me, n, nh, ids, stale = _halo()
    fresh = stale.with_state(HaloState.FRESH)
    idx = torch.randint(0, n + nh, (2 * (n + nh),), generator=torch.Generator().manual_seed(320 + me))
    x = ShardTensor.wrap(_stale_rows(_table(1, 4)[ids], n, nh), stale)
    per_row = ShardTensor.wrap(_per_row_index(ids, 7, 2, 4), fresh)
    ys = {"index_select": x.index_select(1, torch.tensor(COLS)), "gather": x.gather(1, per_row)}
    ys["getitem"] = x[:, torch.tensor(COLS)]
    return {"gids": ids[idx], "got": {k: (y.state, y.index_select(0, idx)) for k, y in ys.items()}}


@pytest.mark.parametrize("nranks", NRANKS)
def test_feature_dim_gather_of_a_stale_table_stays_stale(nranks):
    res = run_on_world(_rank_stale_table, nranks)
    serial = _feature_serial()
    for q, r in enumerate(res):
        for k, (state, gathered) in r["got"].items():
            assert_parity(
                gathered,
                serial[k][r["gids"]],
                what=f"STALE {k} along dim 1, then a gather, rank {q}",
                grid=str(nranks),
            )
            assert state == HaloState.STALE, (k, state)


# ---------------------------------------------------------------------- 4. one index, many targets
COUNTS_A = {2: (5, 2), 3: (4, 1, 6)}
COUNTS_B = {2: (1, 6), 3: (0, 7, 4)}  # the same totals, other blocks (an empty rank)


def _owned(counts, table):
    me = dist.get_rank()
    off = sum(counts[:me])
    return table[off : off + counts[me]].clone(), ShardSpec(Owned(tuple(counts)))


def _rank_reuse():
    me, n, nh, ids, stale = _halo()
    p = dist.get_world_size()
    total = sum(COUNTS_A[p])
    gen = torch.Generator().manual_seed(400 + me)
    index = torch.randint(0, total, (9,), generator=gen)  # the ONE index tensor (rows < n + nh)
    padded = index.clone()
    padded[::4] = PAD
    src = torch.randn(9, F, generator=gen, dtype=torch.float64)
    la, sa = _owned(COUNTS_A[p], _table(11)[:total])
    lb, sb = _owned(COUNTS_B[p], _table(12)[:total])
    xa, xb = from_local(la, sa), from_local(lb, sb)
    xh = ShardTensor.wrap(_stale_rows(_table(13)[ids], n, nh), stale)
    za = ShardTensor.wrap(torch.zeros_like(la), sa)
    zb = ShardTensor.wrap(torch.zeros_like(lb), sb)
    gathers = [
        ("A", xa.index_select(0, index)),
        ("H", xh.index_select(0, index)),
        ("B", xb[index]),
        ("A", xa[index]),
        ("B", xb.index_select(0, index)),
        ("A", xa.index_select(0, padded)),
        ("B", xb.index_select(0, padded)),
        ("A", xa.index_select(0, padded)),
    ]
    scatters = [
        ("A", to_local(za.index_add(0, index, src))),
        ("B", to_local(zb.index_add(0, index, src))),
        ("A", to_local(za.index_add(0, index, src))),
        ("B", to_local(zb.index_add(0, padded, src))),
        ("A", to_local(za.index_add(0, padded, src))),
    ]
    adj = adjoint_pair(lambda t: from_local(t, sb).index_select(0, index), lb, seed=410 + me)
    return {"index": index, "padded": padded, "src": src, "ids": ids, "g": gathers, "s": scatters, "adj": adj}


@pytest.mark.parametrize("nranks", NRANKS)
def test_one_index_against_targets_of_other_placements(nranks):
    res = run_on_world(_rank_reuse, nranks)
    total = sum(COUNTS_A[nranks])
    tables = {"A": _table(11)[:total], "B": _table(12)[:total]}
    g = str(nranks)
    for q, r in enumerate(res):
        for k, (which, got) in enumerate(r["g"]):
            ix = r["index"] if k < 5 else r["padded"]
            if which == "H":
                want = _table(13)[r["ids"][ix]]
            else:
                want = torch.where((ix == PAD)[:, None], 0.0, tables[which][ix.clamp_min(0)])
            assert_parity(got, want, what=f"gather {k} from {which}, P={nranks} rank {q}", grid=g)
        _check_adjoint(r["adj"], f"gather from B after A P={nranks}")
    for k in range(5):
        which = res[0]["s"][k][0]
        counts = COUNTS_A[nranks] if which == "A" else COUNTS_B[nranks]
        full = torch.zeros(total, F, dtype=torch.float64)
        for r in res:
            ix = r["index"] if k < 3 else r["padded"]
            keep = ix != PAD
            full.index_add_(0, ix[keep], r["src"][keep])
        for q, r in enumerate(res):
            off = sum(counts[:q])
            assert_parity(
                r["s"][k][1], full[off : off + counts[q]], what=f"scatter {k} into {which}, rank {q}", grid=g
            )


# ---------------------------------------------------------------------- 5. optional arguments
def _refused(f):
    try:
        f()
    except UnhandledAtomOp as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - reported, not swallowed: the test names it
        return f"unexpected {type(exc).__name__}: {exc}"
    return "no error"


def _rank_optional():
    me, n, nh, ids, stale = _halo()
    fresh = stale.with_state(HaloState.FRESH)
    p = dist.get_world_size()
    gen = torch.Generator().manual_seed(500 + me)
    idx = torch.randint(0, n + nh, (2 * (n + nh),), generator=gen)
    idx2 = idx[:, None].expand(-1, F)
    src = torch.randn(len(idx), F, generator=gen, dtype=torch.float64)
    base = _table(2)[ids]

    def tgt():
        return ShardTensor.wrap(base.clone(), fresh)

    halo = {
        "index_add_ alpha": tgt().index_add_(0, idx, src, alpha=ALPHA),
        "Tensor.index_add alpha": tgt().index_add(0, idx, src, alpha=ALPHA),
        "torch.index_add alpha": torch.index_add(tgt(), 0, idx, src, alpha=ALPHA),
        "kwargs": tgt().index_add_(dim=0, index=idx, source=src, alpha=ALPHA),
        "torch.scatter_add": torch.scatter_add(tgt(), 0, idx2, src),
        "Tensor.scatter_add": tgt().scatter_add(0, idx2, src),
        "scatter_add_ kwargs": tgt().scatter_add_(dim=0, index=idx2, src=src),
    }
    with D.lazy_halo():
        halo["lazy torch.index_add alpha"] = torch.index_add(tgt(), 0, idx, src, alpha=ALPHA)
        halo["lazy index_add_ alpha"] = tgt().index_add_(0, idx, src, alpha=ALPHA)
    every = torch.arange(n + nh)
    halo = {k: v.index_select(0, every) for k, v in halo.items()}  # refreshed where lazy
    halo_adj = adjoint_pair(
        lambda s: to_local(
            torch.index_add(ShardTensor.wrap(torch.zeros_like(base), fresh), 0, idx, s, alpha=ALPHA)
        ),
        src,
        seed=510 + me,
    )
    # sharded storage
    total = sum(COUNTS_A[p])
    gids = torch.randint(0, total, (7,), generator=gen)
    gsrc = torch.randn(7, F, generator=gen, dtype=torch.float64)
    la, sa = _owned(COUNTS_A[p], _table(11)[:total])

    def za():
        return ShardTensor.wrap(torch.zeros_like(la), sa)

    sharded = {
        "index_add_ alpha": za().index_add_(0, gids, gsrc, alpha=ALPHA),
        "Tensor.index_add alpha": za().index_add(0, gids, gsrc, alpha=ALPHA),
        "torch.index_add alpha": torch.index_add(za(), 0, gids, gsrc, alpha=ALPHA),
        "kwargs": za().index_add_(dim=0, index=gids, source=gsrc, alpha=ALPHA),
        "torch.scatter_add": torch.scatter_add(za(), 0, gids[:, None].expand(-1, F), gsrc),
    }
    sharded = {k: to_local(v).clone() for k, v in sharded.items()}
    sharded_adj = adjoint_pair(
        lambda s: to_local(za().index_add(0, gids, s, alpha=ALPHA)), gsrc, seed=520 + me
    )
    # per-system reduce (per-atom source) and plain_rows_reduce (plain per-row source)
    spec = ShardSpec(HaloPadded(stale.plan), HaloState.FRESH, n_systems=2)
    batch = ShardTensor.wrap(ids % 2, spec)
    vals = _table(3)[ids]
    xs = ShardTensor.wrap(vals, spec)
    plain = _stale_rows(vals, n, nh)  # a plain per-row source: owned rows the values, halo junk
    zeros = torch.zeros(2, F, dtype=torch.float64)
    reduce = {
        "per_system Tensor.index_add alpha": zeros.index_add(0, batch, xs, alpha=ALPHA),
        "per_system torch.index_add alpha": torch.index_add(zeros, 0, batch, xs, alpha=ALPHA),
        "per_system index_add_ alpha": zeros.clone().index_add_(0, batch, xs, alpha=ALPHA),
        "per_system kwargs": zeros.index_add(dim=0, index=batch, source=xs, alpha=ALPHA),
        "plain_rows Tensor.index_add alpha": zeros.index_add(0, batch, plain, alpha=ALPHA),
        "plain_rows torch.index_add alpha": torch.index_add(zeros, 0, batch, plain, alpha=ALPHA),
        "plain_rows index_add_ alpha": zeros.clone().index_add_(0, batch, plain, alpha=ALPHA),
    }
    reduce_adj = adjoint_pair(
        lambda t: torch.index_add(zeros, 0, batch, from_local(t, spec), alpha=ALPHA), vals, seed=9
    )
    # out=: no handler writes the buffer; every rank must raise, none may leave it unwritten
    xst = ShardTensor.wrap(_stale_rows(base, n, nh), stale)
    buf = torch.zeros(len(idx), F, dtype=torch.float64)
    blk = torch.zeros(n + nh, F, dtype=torch.float64)
    xa = from_local(la, sa)
    refusals = {  # (the out= overload the default path names, the call)
        "halo_refresh": ("index_select", lambda: torch.index_select(xst, 0, idx, out=buf)),
        "halo_refresh gather": ("gather", lambda: torch.gather(xst, 0, idx2, out=buf)),
        "halo_correction": ("index_add", lambda: torch.index_add(tgt(), 0, idx, src, alpha=ALPHA, out=blk)),
        "halo_correction scatter_add": (
            "scatter_add",
            lambda: torch.scatter_add(tgt(), 0, idx2, src, out=blk),
        ),
        "sharded_gather": ("index_select", lambda: torch.index_select(xa, 0, gids, out=buf[:7])),
        "sharded_scatter": (
            "index_add",
            lambda: torch.index_add(za(), 0, gids, gsrc, out=torch.zeros_like(la)),
        ),
        "per_system_reduce": ("index_add", lambda: torch.index_add(zeros, 0, batch, xs, out=zeros.clone())),
        "plain_rows_reduce": (
            "index_add",
            lambda: torch.index_add(zeros, 0, batch, plain, out=zeros.clone()),
        ),
    }
    refused = {k: (op, _refused(f)) for k, (op, f) in refusals.items()}
    return {
        "ids": ids,
        "gids": ids[idx],
        "src": src,
        "halo": halo,
        "sharded_ids": gids,
        "sharded_src": gsrc,
        "sharded": sharded,
        "reduce": reduce,
        "adj": (halo_adj, sharded_adj),
        "reduce_adj": reduce_adj,
        "refused": refused,
    }


@pytest.mark.parametrize("nranks", NRANKS)
def test_optional_arguments_exact_or_refused(nranks):
    res = run_on_world(_rank_optional, nranks)
    g = str(nranks)
    contributions = [(r["gids"], r["src"]) for r in res]
    with_alpha = _serial_add(_table(2), contributions, ALPHA)
    plain_sum = _serial_add(_table(2), contributions)
    total = sum(COUNTS_A[nranks])
    sharded_alpha = _serial_add(
        torch.zeros(total, F, dtype=torch.float64), [(r["sharded_ids"], r["sharded_src"]) for r in res], ALPHA
    )
    sharded_plain = sharded_alpha / ALPHA
    full = _system()
    per_system = torch.zeros(2, F, dtype=torch.float64).index_add(
        0, full.ids % 2, _table(3)[full.ids], alpha=ALPHA
    )
    for q, r in enumerate(res):
        for k, got in r["halo"].items():
            want = plain_sum if "scatter_add" in k else with_alpha
            assert_parity(got, want[r["ids"]], what=f"halo_correction {k}, P={nranks} rank {q}", grid=g)
        off = sum(COUNTS_A[nranks][:q])
        rows = slice(off, off + COUNTS_A[nranks][q])
        for k, got in r["sharded"].items():
            want = sharded_plain if "scatter_add" in k else sharded_alpha
            assert_parity(got, want[rows], what=f"sharded_scatter {k}, P={nranks} rank {q}", grid=g)
        for k, got in r["reduce"].items():
            assert_parity(got, per_system, what=f"{k}, P={nranks} rank {q}", grid=g)
        for name, adj in zip(("halo_correction", "sharded_scatter"), r["adj"]):
            _check_adjoint(adj, f"{name} alpha P={nranks}")
        _check_adjoint(r["reduce_adj"], f"per_system_reduce alpha P={nranks}", factor=nranks)
        for k, (op, msg) in r["refused"].items():
            assert f"aten.{op}.out" in msg and "no dispatch handler" in msg, f"out= in {k}, rank {q}: {msg}"


# ---------------------------------------------------------------------- 6. a PARTIAL target
def _rank_partial():
    me, n, nh, ids, stale = _halo()
    partial = stale.with_state(HaloState.PARTIAL)
    gen = torch.Generator().manual_seed(600 + me)
    rows = torch.randn(n + nh, F, generator=gen, dtype=torch.float64)  # partial sums, halo included
    idx = torch.randint(0, n + nh, (2 * (n + nh),), generator=gen)
    src = torch.randn(len(idx), F, generator=gen, dtype=torch.float64)
    every = torch.arange(n + nh)
    with CommLedger() as ledger:
        got = {
            "index_add_": ShardTensor.wrap(rows.clone(), partial).index_add_(0, idx, src),
            "Tensor.index_add alpha": ShardTensor.wrap(rows, partial).index_add(0, idx, src, alpha=ALPHA),
            "scatter_add": ShardTensor.wrap(rows, partial).scatter_add(0, idx[:, None].expand(-1, F), src),
        }
        with D.lazy_halo():
            got["lazy index_add"] = ShardTensor.wrap(rows, partial).index_add(0, idx, src)
            got["lazy index_add_"] = ShardTensor.wrap(rows.clone(), partial).index_add_(0, idx, src)
    exchanged = sorted(k for k in ledger.ops if k.startswith("halo"))
    states = {k: v.state for k, v in got.items()}
    refreshed = {k: v.index_select(0, every) for k, v in got.items()}
    zero = ShardTensor.wrap(torch.zeros(n + nh, F, dtype=torch.float64), partial)
    adj = adjoint_pair(lambda s: zero.index_add(0, idx, s).index_select(0, every), src, seed=610 + me)
    return {
        "ids": ids,
        "rows": rows,
        "gids": ids[idx],
        "src": src,
        "exchanged": exchanged,
        "states": states,
        "got": refreshed,
        "adj": adj,
    }


@pytest.mark.parametrize("nranks", NRANKS)
def test_halo_correction_into_a_partial_target(nranks):
    res = run_on_world(_rank_partial, nranks)
    value = torch.zeros(1000, F, dtype=torch.float64)
    for r in res:  # a PARTIAL tensor's value: the sum of every rank's rows of an id
        value.index_add_(0, r["ids"], r["rows"])
    contributions = [(r["gids"], r["src"]) for r in res]
    want = {1.0: _serial_add(value, contributions), ALPHA: _serial_add(value, contributions, ALPHA)}
    for q, r in enumerate(res):
        for k, got in r["got"].items():
            assert r["states"][k] == HaloState.PARTIAL, (k, r["states"][k])
            w = want[ALPHA if "alpha" in k else 1.0]
            assert_parity(got, w[r["ids"]], what=f"PARTIAL target {k}, P={nranks} rank {q}", grid=str(nranks))
        _check_adjoint(r["adj"], f"PARTIAL target P={nranks}")
        assert r["exchanged"] == [], f"rank {q}: a scatter into a PARTIAL target exchanged {r['exchanged']}"
