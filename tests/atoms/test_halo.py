"""Halo exchange with real communication: adjointness, completeness, dtypes, ledger."""

import pytest
import torch
import torch.distributed as dist
from _planted import planted

from twinshard.atoms.data import structures
from twinshard.atoms.data.neighbors import neighbor_list
from twinshard.atoms.data.system import System
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.comm import CommLedger
from twinshard.rng import normal
from twinshard.testing import assert_parity, run_on_world

GAS = 1500  # atoms: dense enough that a halo 3% thin misses some edge (see the control)


def _system(name):
    if name == "fcc":  # 21 A periodic cube
        return structures.fcc_argon(repeat=4, rattle=0.3, seed=1)
    if name == "tiny":  # 10.5 A cube, ghost width 6.5: many images of each atom
        return structures.fcc_argon(repeat=2, rattle=0.3, seed=2)
    if name == "long":  # 42 x 10.5 x 10.5: four slabs along x
        return structures.fcc_argon(repeat=(8, 2, 2), rattle=0.3, seed=3)
    if name == "triclinic":
        return structures.triclinic_argon(repeat=(7, 6, 6), rattle=0.3, seed=4)
    if name == "gas":  # uniform random positions in the triclinic cell: atoms at every distance
        t = structures.triclinic_argon(repeat=(7, 6, 6))
        frac = torch.rand(GAS, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        return System(positions=frac @ t.cell, numbers=torch.full((GAS,), 18), cell=t.cell, pbc=True)
    raise ValueError(name)


def _keyed(ids, width, stream, dtype=torch.float64):
    """Random rows keyed by global id (and a per-halo-row key), the same for any rank count."""
    cols = torch.arange(width)
    return normal(11, stream, ids[:, None].to(torch.int64), cols[None, :]).to(dtype)


def _rank_adjoint(name, grid, cutoff=6.0, skin=0.5, plant=None):
    with planted(plant):
        return _adjoint(name, grid, cutoff, skin)


def _adjoint(name, grid, cutoff, skin):
    s = _system(name) if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(s, cutoff=cutoff, skin=skin, grid=grid)
    plan = sh.plan
    x = _keyed(sh.ids, 4, 1).requires_grad_(True)
    halo_key = torch.arange(plan.n_halo) + 100000 * (dist.get_rank() + 1)
    dy = _keyed(halo_key, 4, 2)
    y = plan.forward(x)
    (gx,) = torch.autograd.grad(y, x, dy)  # autograd adjoint: must equal R(dy)
    rdy = plan.reverse(dy)
    # and the reverse's own backward is the forward exchange
    dyl = dy.clone().requires_grad_(True)
    dx = _keyed(sh.ids, 4, 3)
    (gdy,) = torch.autograd.grad(plan.reverse(dyl), dyl, dx)
    fdx = plan.forward(dx)
    sums = torch.tensor(
        [float((dy * y).sum()), float((rdy * x).sum()), float((dx * rdy).sum()), float((fdx * dy).sum())],
        dtype=torch.float64,
    )
    dist.all_reduce(sums)
    return {
        "sums": sums,
        "gx": gx,
        "rdy": rdy,
        "gdy": gdy,
        "fdx": fdx,
        "n_halo": plan.n_halo,
        "peers": plan.peers,
    }


def _check_adjoint(res, where):
    lhs, rhs, lhs2, rhs2 = res[0]["sums"].unbind()
    n = sum(4 * r["n_halo"] for r in res)  # the longest sum: every halo entry of every rank
    assert_parity(rhs, lhs, what=f"<R dy, x> = <dy, F x> {where}", reduction=n, checks=["adjoint"])
    assert_parity(rhs2, lhs2, what=f"<F dx, dy> = <dx, R dy> {where}", reduction=n, checks=["adjoint"])


@pytest.mark.parametrize(
    "name,nranks,grid",
    [("tiny", 1, None), ("fcc", 2, (2, 1, 1)), ("triclinic", 3, (3, 1, 1)), ("long", 4, (4, 1, 1))],
)
def test_forward_reverse_are_adjoint(name, nranks, grid):
    res = run_on_world(_rank_adjoint, nranks, name, grid)
    if nranks == 1:  # every axis has one rank: images are edge shifts, the block has no halo
        assert res[0]["n_halo"] == 0 and res[0]["peers"] == []
        return
    assert all(r["n_halo"] > 0 for r in res)
    _check_adjoint(res, f"{name} P={nranks}")
    for r, out in enumerate(res):  # the backward of one exchange is the other, on every rank
        assert_parity(out["gx"], out["rdy"], what=f"autograd of F = R, {name} P={nranks} rank {r}")
        assert_parity(out["gdy"], out["fdx"], what=f"autograd of R = F, {name} P={nranks} rank {r}")


@pytest.mark.parametrize(
    "plant,match",
    [
        # inside the exchange: each reverse message's rows shifted by one (wrong owner rows)
        ("halo_reverse_misrouted", r"parity of <R dy, x> = <dy, F x> fcc P=2 .* fails"),
        # the reverse sum accumulated in fp32 in an fp64 run: the round-off gate sees it
        ("halo_reverse_fp32", r"parity of <R dy, x> = <dy, F x> fcc P=2 .* fails"),
    ],
)
def test_adjoint_check_catches_planted_reverse_bugs(plant, match):
    res = run_on_world(_rank_adjoint, 2, "fcc", (2, 1, 1), 6.0, 0.5, plant)
    with pytest.raises(AssertionError, match=match):
        _check_adjoint(res, "fcc P=2")


def test_halo_peers_are_neighbours_only():
    res = run_on_world(_rank_adjoint, 4, "long", (4, 1, 1))
    for r, out in enumerate(res):
        # one rank along y and z: those images are edge shifts, so only the two x neighbours
        assert out["peers"] == sorted({(r - 1) % 4, (r + 1) % 4})


def _rank_block_edges(name, grid, cutoff, skin, plant=None):
    """(receiver id, sender id, lattice shift) of every edge of this rank's padded block."""
    with planted(plant):
        s = _system(name) if dist.get_rank() == 0 else None
        sh = ShardedSystem.scatter(s, cutoff=cutoff, skin=skin, grid=grid)
    e, plan = sh.edges, sh.plan
    ids = torch.cat([sh.ids, plan.halo_ids.to(sh.ids.device)]).cpu()
    # a block row sits at its atom's unwrapped position + shift @ cell: an edge i <- j spans the
    # lattice translation shift_j - shift_i plus the block list's own shift (wrap axes)
    shift = torch.cat([plan.owned_shift, plan.halo_shift]).cpu()
    snd, rcv = e.senders.cpu(), e.receivers.cpu()
    rel = shift[snd] - shift[rcv] + e.cell_shifts.cpu()
    keys = torch.cat([ids[rcv][:, None], ids[snd][:, None], rel], 1)
    return sh.ids.cpu(), keys


def _serial_edge_keys(name, width):
    s = _system(name)
    e = neighbor_list(s.positions, width, s.cell, s.pbc)
    return torch.cat([s.ids[e.receivers][:, None], s.ids[e.senders][:, None], e.cell_shifts], 1)


def _encode(keys):
    """One int64 per (receiver id, sender id, shift) row (ids < 2**20, |shift| <= 8)."""
    assert int(keys[:, :2].max()) < 2**20 and int(keys[:, 2:].abs().max()) <= 8
    k = keys[:, 0] * 2**20 + keys[:, 1]
    for a in range(2, 5):
        k = k * 17 + keys[:, a] + 8
    return k


def assert_block_edges(per_rank, serial, where):
    """On each rank the block's edges within cutoff + skin are exactly the serial edges of its
    owned atoms, by (receiver id, sender id, periodic shift), each once."""
    for r, (owned, keys) in enumerate(per_rank):
        mine = serial[torch.isin(serial[:, 0], owned)]
        got, want = _encode(keys), _encode(mine)
        if torch.unique(got).numel() != got.numel():
            raise AssertionError(
                f"{where}: rank {r}'s block holds {got.numel() - torch.unique(got).numel()} edges twice"
            )
        missing = mine[~torch.isin(want, got)]
        if missing.numel():
            raise AssertionError(
                f"{where}: rank {r}'s halo-padded block misses {missing.shape[0]} of the {mine.shape[0]} "
                f"serial edges within cutoff + skin of its owned atoms, e.g. (receiver id, sender id, "
                f"shift) {missing[:3].tolist()}: the halo is too thin"
            )
        extra = keys[~torch.isin(got, want)]
        if extra.numel():
            raise AssertionError(
                f"{where}: rank {r}'s block has {extra.shape[0]} edges the serial list lacks: {extra[:3].tolist()}"
            )
    n = sum(k.shape[0] for _, k in per_rank)
    assert n == serial.shape[0], f"{where}: {n} block edges in all, {serial.shape[0]} serial edges"


@pytest.mark.parametrize(
    "name,nranks,grid",
    [
        ("tiny", 1, None),  # a rank bordering itself: several images of one neighbour
        ("triclinic", 2, (2, 1, 1)),
        ("triclinic", 3, (3, 1, 1)),
        ("triclinic", 4, (2, 2, 1)),
        ("gas", 4, (2, 2, 1)),  # the control's system, intact
    ],
)
def test_halo_holds_exactly_the_serial_edges(name, nranks, grid):
    cutoff, skin = 6.0, 0.5
    serial = _serial_edge_keys(name, cutoff + skin)
    res = run_on_world(_rank_block_edges, nranks, name, grid, cutoff, skin)
    assert_block_edges(res, serial, f"{name} P={nranks} grid={grid}")
    if name == "tiny":  # several images of one neighbour: repeated (i, j) pairs
        pairs = [(a, b) for a, b, *_ in serial.tolist()]
        assert len(set(pairs)) < len(pairs)


def test_halo_invariant_catches_a_thin_halo():
    cutoff, skin = 6.0, 0.5
    serial = _serial_edge_keys("gas", cutoff + skin)
    res = run_on_world(_rank_block_edges, 4, "gas", (2, 2, 1), cutoff, skin, "thin_halo")
    with pytest.raises(AssertionError, match=r"block misses \d+ of the \d+ serial edges .* halo is too thin"):
        assert_block_edges(res, serial, "gas P=4, ghost shell 3% thin")


def _rank_grad_mismatch():
    s = _system("fcc") if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(s, cutoff=6.0, skin=0.5, grid=(3, 1, 1))
    x = sh.positions.clone().requires_grad_(sh.rank != 1)  # rank 1 forgot requires_grad
    try:
        sh.plan.padded_positions(x, sh.cell)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_halo_autograd_path_is_one_replicated_decision():
    for r, msg in enumerate(run_on_world(_rank_grad_mismatch, 3, timeout=30)):
        assert "halo_forward: the input requires grad on ranks [0, 2] but not on ranks [1]" in msg, (r, msg)


def _rank_dtypes():
    s = _system("fcc") if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(s, cutoff=6.0, skin=0.5, grid=(2, 1, 1))
    plan = sh.plan
    # integers in [100, 220]: exact in bf16, and their fp32 sums are exact, so an fp32
    # accumulation rounded once equals the fp64 sum rounded; a bf16 accumulation would round
    # the partial sums above 256 at every step
    key = torch.arange(plan.n_halo) + 7 * dist.get_rank()
    dy = 100 + torch.round(_keyed(key, 3, 5).abs() * 40).clamp(0, 120)
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        low = plan.reverse(dy.to(dt))
        ref = plan.reverse(dy.to(dt).to(torch.float64))
        out[str(dt)] = (low.dtype == dt, bool(torch.equal(low, ref.to(dt))))
    exact = plan.reverse(dy)
    out["bf16_naive_differs"] = bool((exact.to(torch.bfloat16).to(torch.float64) != exact).any())
    # fp64 positions stay fp64 through the exchange
    out["fp64"] = plan.padded_positions(sh.positions, sh.cell).dtype == torch.float64
    # several halo copies of one owned atom exist, so the accumulation order matters
    counts = torch.zeros(plan.n_owned, dtype=torch.int64)
    for q in plan.peers:
        counts.index_add_(0, plan.send_idx[q], torch.ones_like(plan.send_idx[q]))
    out["max_copies"] = int(counts.max())
    return out


def test_reverse_accumulates_in_at_least_fp32():
    for out in run_on_world(_rank_dtypes, 2):
        assert out["max_copies"] >= 2
        assert out["bf16_naive_differs"]  # some owner sums are not bf16 numbers: rounding matters
        assert out["fp64"]
        for dt in ("torch.float32", "torch.bfloat16"):
            same_dtype, exact = out[dt]
            assert same_dtype and exact, dt


def _rank_ledger():
    s = _system("long") if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(s, cutoff=6.0, skin=0.5, grid=(4, 1, 1))
    x = sh.positions.clone().requires_grad_(True)
    with CommLedger() as ledger:
        block = sh.plan.padded_positions(x, sh.cell)
        torch.autograd.grad(block, x, _keyed(torch.arange(block.shape[0]) + 1000 * sh.rank, 3, 9))
    self_rows = int(sh.plan.send_idx.get(sh.rank, torch.zeros(0)).numel())
    from_others = sh.plan.n_halo - int(sh.plan.recv_counts.get(sh.rank, 0))
    return ledger.summary(), sh.plan.n_sent, self_rows, from_others, sh.n_owned, sh.n_halo


def test_ledger_records_halo_bytes():
    for summary, n_sent, self_rows, from_others, _n_owned, n_halo in run_on_world(_rank_ledger, 4):
        op = summary["ops"]["halo_forward"]
        assert op["calls"] == 1
        assert op["bytes_sent"] == n_sent * 3 * 8 and n_sent > 0
        assert op["bytes_recv"] == from_others * 3 * 8
        back = summary["ops"]["halo_forward:backward"]  # the reverse exchange, mirrored bytes
        assert back["calls"] == 1
        assert back["bytes_sent"] == op["bytes_recv"] and back["bytes_recv"] == op["bytes_sent"]
        # plus the one vote on the autograd path (8 bytes per rank)
        assert set(summary["ops"]) == {"halo_forward", "halo_forward:backward", "halo_forward:grad_agree"}
        # one rank along y and z: their images are edge shifts, no local copies of own atoms
        assert self_rows == 0 and from_others == n_halo
        # ghost shell of a 10.5 A cube slab grown by w = 6.5 A along x only (y, z stay periodic
        # in the block), at fcc density; with images along y, z it was ~8x larger
        side, w, rho = 42.08 / 4, 6.5, 4 / 5.26**3
        estimate = 2 * w * side**2 * rho
        assert 0.8 * estimate < n_halo <= 1.25 * estimate, (n_halo, estimate)
