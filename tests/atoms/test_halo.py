"""Halo exchange with real communication: adjointness, completeness, dtypes, ledger."""

import pytest
import torch
import torch.distributed as dist

from twinshard.atoms import structures
from twinshard.atoms.neighbors import neighbor_list
from twinshard.atoms.sharded import ShardedSystem
from twinshard.comm import CommLedger
from twinshard.tensors.rng import normal
from twinshard.testing import assert_parity, run_on_world


def _system(name):
    if name == "fcc":  # 21 A periodic cube
        return structures.fcc_argon(repeat=4, rattle=0.3, seed=1)
    if name == "tiny":  # 10.5 A cube, ghost width 6.5: many images of each atom
        return structures.fcc_argon(repeat=2, rattle=0.3, seed=2)
    if name == "long":  # 42 x 10.5 x 10.5: four slabs along x
        return structures.fcc_argon(repeat=(8, 2, 2), rattle=0.3, seed=3)
    if name == "triclinic":
        return structures.triclinic_argon(repeat=(7, 6, 6), rattle=0.3, seed=4)
    raise ValueError(name)


def _keyed(ids, width, stream, dtype=torch.float64):
    """Random rows keyed by global id (and a per-halo-row key), the same for any rank count."""
    cols = torch.arange(width)
    return normal(11, stream, ids[:, None].to(torch.int64), cols[None, :]).to(dtype)


def _rank_adjoint(name, grid, cutoff=6.0, skin=0.5):
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
        "gx_vs_r": float((gx - rdy).abs().max()) if gx.numel() else 0.0,
        "gdy_vs_f": float((gdy - fdx).abs().max()) if gdy.numel() else 0.0,
        "n_halo": plan.n_halo,
        "peers": plan.peers,
        "rolled": float((torch.roll(rdy, 1, 0) * x).sum()),
    }


@pytest.mark.parametrize(
    "name,nranks,grid",
    [("tiny", 1, None), ("fcc", 2, (2, 1, 1)), ("triclinic", 3, (3, 1, 1)), ("long", 4, (4, 1, 1))],
)
def test_forward_reverse_are_adjoint(name, nranks, grid):
    res = run_on_world(_rank_adjoint, nranks, name, grid)
    lhs, rhs, lhs2, rhs2 = res[0]["sums"].unbind()
    assert all(r["n_halo"] > 0 for r in res)
    assert_parity(lhs, rhs, what=f"<dy, F x> = <R dy, x> {name} P={nranks}", checks=["adjoint"])
    assert_parity(lhs2, rhs2, what=f"<dx, R dy> = <F dx, dy> {name} P={nranks}", checks=["adjoint"])
    for r in res:
        assert r["gx_vs_r"] == 0.0 and r["gdy_vs_f"] == 0.0  # backward of one is the other


def test_adjoint_check_catches_a_misrouted_reverse():
    # Negative control: the reverse with its rows shifted by one breaks the identity.
    res = run_on_world(_rank_adjoint, 2, "fcc", (2, 1, 1))
    rolled = torch.tensor(sum(r["rolled"] for r in res), dtype=torch.float64)
    with pytest.raises(AssertionError):
        assert_parity(rolled, res[0]["sums"][0], what="negative control: misrouted reverse")


def test_halo_peers_are_neighbours_only():
    res = run_on_world(_rank_adjoint, 4, "long", (4, 1, 1))
    for r, out in enumerate(res):
        # one rank along y and z: each rank borders itself, and its two x neighbours
        assert out["peers"] == sorted({r, (r - 1) % 4, (r + 1) % 4})


def _rank_edges(name, grid, cutoff):
    s = _system(name) if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(s, cutoff=cutoff, skin=0.5, grid=grid)
    g = sh.block_graph()
    r = g.edge_vectors().norm(dim=1)
    inside = r < cutoff
    ids = torch.cat([sh.ids, sh.plan.halo_ids])
    rows = torch.stack([ids[g.receivers[inside]], ids[g.senders[inside]]], 1)
    return rows, r[inside]


@pytest.mark.parametrize("name,nranks,grid", [("tiny", 1, None), ("triclinic", 4, (2, 2, 1))])
def test_block_edges_equal_serial_edges(name, nranks, grid):
    """The padded blocks hold every serial edge of their owned atoms exactly once."""
    cutoff = 6.0
    s = _system(name)
    e = neighbor_list(s.positions, cutoff, s.cell, s.pbc)
    d = e.vectors(s.positions).norm(dim=1)
    serial = sorted(
        zip(s.ids[e.receivers].tolist(), s.ids[e.senders].tolist(), torch.round(d, decimals=9).tolist())
    )
    res = run_on_world(_rank_edges, nranks, name, grid, cutoff)
    dist_edges = []
    for rows, r in res:
        dist_edges += list(zip(rows[:, 0].tolist(), rows[:, 1].tolist(), torch.round(r, decimals=9).tolist()))
    assert len(dist_edges) == len(serial)
    assert sorted(dist_edges) == serial
    if name == "tiny":  # several images of one neighbour: repeated (i, j) pairs
        pairs = [(a, b) for a, b, _ in serial]
        assert len(set(pairs)) < len(pairs)


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
        assert set(summary["ops"]) == {"halo_forward", "halo_forward:backward"}
        assert self_rows > 0  # bordering itself along y and z: local copies, not on the wire
        # ghost shell of a 10.5 A cube slab grown by w = 6.5 A on every side, at fcc density
        side, w, rho = 42.08 / 4, 6.5, 4 / 5.26**3
        estimate = ((side + 2 * w) ** 3 - side**3) * rho
        assert 0.8 * estimate < n_halo <= 1.25 * estimate
