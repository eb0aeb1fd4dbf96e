"""Periodic axes with one rank along them stay periodic in the block: their images are edge
shifts, not halo rows.

At P=1 a fully periodic system's block has no halo rows and its edges are the serial list's
(receiver id, sender id, lattice shift); on a (2, 1, 1) grid the halo is the ghost shell along x
only (no image along y or z, strictly fewer rows than with every image as a halo row, as the
partition did before: the ``no_wrap`` run below), and the plain MPNN through the dispatch, the
Graph-contract MPNN and the analytic LJ path equal the serial models to fp64 round-off.
Negative control: the dispatch inputs dropping the edges' own lattice shift fail parity.
"""

import pytest
import torch
import torch.distributed as dist
from _planted import planted

from twinshard.atoms.data import structures
from twinshard.atoms.data.system import System
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.partition import SpatialPartition
from twinshard.atoms.parallel.plain_inputs import evaluate_plain
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials import LennardJones, MessagePassingPotential, evaluate
from twinshard.atoms.potentials.mpnn_plain import PlainMessagePassing
from twinshard.testing import assert_parity, assert_shards_cover, by_id, rows_of, run_on_world

SKIN = 0.5
KW = dict(species=(18, 36), cutoff=4.0, n_features=8, n_basis=6, n_layers=2, seed=3)


def make_system():
    s = structures.fcc_argon(repeat=3, rattle=0.25, seed=1)  # 108 atoms, 15.8 A periodic cube
    numbers = s.numbers.clone()
    numbers[::5] = 36
    # unwrapped positions: some atoms sit a cell away, so frames and shifts both matter
    pos = s.positions + torch.tensor([1.0, -1.0, 1.0], dtype=s.positions.dtype) * 15.78 * (
        torch.arange(s.n_atoms)[:, None] % 7 == 0
    )
    ids = torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(7)) + 1000
    return System(positions=pos, numbers=numbers, cell=s.cell, pbc=s.pbc, ids=ids)


def _lj():
    return LennardJones({18: (0.0104, 3.405), 36: (0.014, 3.65)}, cutoff=4.0)


def _rank(grid, wrap=True, plant=None):
    with pytest.MonkeyPatch.context() as mp, planted(plant):
        if not wrap:  # every periodic image a halo row, as before wrap axes existed
            mp.setattr(SpatialPartition, "wrap_axes", lambda self: (False, False, False))
        system = make_system() if dist.get_rank() == 0 else None
        sh = ShardedSystem.scatter(system, cutoff=KW["cutoff"], skin=SKIN, grid=grid)
        plain = DistributedPotential(PlainMessagePassing(**KW), mode="dispatch").compute(sh)
        hooks = DistributedPotential(MessagePassingPotential(**KW)).compute(sh)
        lj = DistributedPotential(_lj()).compute(sh)  # the analytic path (half list, owner rule)
        plan = sh.plan
        return {
            "ids": sh.ids,
            "n_halo": sh.n_halo,
            "wrap": plan.wrap,
            "halo_ids": plan.halo_ids,
            "halo_shift": plan.halo_shift.cpu(),
            "n_edges": sh.edges.n_edges,
            **{
                f"{k}_{f}": getattr(r, f)
                for k, r in (("plain", plain), ("hooks", hooks), ("lj", lj))
                for f in ("energy", "per_atom", "forces", "stress")
            },
        }


def _serial():
    s = make_system()
    out = {"system": s}
    for k, ref in (
        ("plain", evaluate_plain(PlainMessagePassing(**KW), s)),
        ("hooks", evaluate(MessagePassingPotential(**KW), s)),
        ("lj", evaluate(_lj(), s, analytic=False)),
    ):
        out[k] = ref
    return out


def _assert_parity(res, s, where, kinds=("plain", "hooks", "lj")):
    system, gid = s["system"], str(len(res))
    for k in kinds:
        ref = s[k]
        assert_parity(res[0][f"{k}_energy"], ref.energy, grid=gid, what=f"{k} energy {where}")
        assert_parity(res[0][f"{k}_stress"], ref.stress, grid=gid, what=f"{k} stress {where}")
        for f in ("per_atom", "forces"):
            full = getattr(ref, f)
            if len(res) > 1:
                pieces = [(r[f"{k}_{f}"], rows_of(r["ids"], system.ids)) for r in res]
                assert_shards_cover(pieces, full, f"{k} {f} {where}", disjoint=True)
            assert_parity(by_id(res, f"{k}_{f}", system.ids), full, grid=gid, what=f"{k} {f} {where}")


def test_p1_periodic_block_has_no_halo_and_equals_serial():
    s = _serial()
    (r,) = run_on_world(_rank, 1, None)
    assert r["wrap"] == (True, True, True)
    assert r["n_halo"] == 0, "P=1, fully periodic: every image is an edge shift, no halo row"
    assert float(s["plain"].stress.abs().max()) > 0 and float(s["lj"].forces.abs().max()) > 1e-3
    _assert_parity([r], s, "P=1 (no halo)")


def test_one_rank_axes_hold_no_images_and_equal_serial():
    s = _serial()
    res = run_on_world(_rank, 2, (2, 1, 1))
    old = run_on_world(_rank, 2, (2, 1, 1), False)
    n = s["system"].n_atoms
    for r, o in zip(res, old):
        assert r["wrap"] == (False, True, True) and o["wrap"] == (False, False, False)
        assert 0 < r["n_halo"] < o["n_halo"] and r["n_edges"] == o["n_edges"]
        # no image along y or z: each halo atom at most once per x image
        key = torch.cat([r["halo_ids"][:, None], r["halo_shift"][:, :1]], 1)
        assert torch.unique(key, dim=0).shape[0] == r["n_halo"]
        # the ghost shell along x only: two slabs w = cutoff + skin thick, a cell's cross-section
        estimate = 2 * (KW["cutoff"] + SKIN) / 15.78 * n
        assert 0.8 * estimate < r["n_halo"] <= 1.25 * estimate, (r["n_halo"], estimate)
    _assert_parity(res, s, "P=2 grid (2,1,1)")
    _assert_parity(old, s, "P=2 grid (2,1,1), images as halo rows")


def _rank_shift_cache(grid):
    system = make_system() if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(system, cutoff=KW["cutoff"], skin=SKIN, grid=grid)
    f64, dev = torch.float64, sh.device

    def recomputed(dtype=f64):
        sh._shifts = None  # the cache's own slot: what a cold call returns
        return sh.edge_shifts(dtype, dev)

    first = sh.edge_shifts(f64, dev)
    fresh = first.clone()
    out = {"reused": sh.edge_shifts(f64, dev) is first, "nonzero": bool(fresh.abs().max() > 1.0)}
    first.add_(1.0)  # a model writing into its input in place
    got = sh.edge_shifts(f64, dev)
    out["after_inplace"] = got is not first and torch.equal(got, fresh)
    got.requires_grad_(True)  # ... or making it a leaf of its graph
    again = sh.edge_shifts(f64, dev)
    out["after_requires_grad"] = again is not got and not again.requires_grad and torch.equal(again, fresh)
    cell = sh.cell.clone()
    sh.cell = cell * 1.01  # a barostat step: same edges, another cell
    scaled = sh.edge_shifts(f64, dev)
    out["after_cell"] = not torch.equal(scaled, fresh) and torch.equal(scaled, recomputed())
    sh.cell = cell
    before = sh.edge_shifts(f64, dev)
    sh.edges = None  # a neighbour-list rebuild: a new list object
    rebuilt = sh.edge_shifts(f64, dev)
    out["after_rebuild"] = rebuilt is not before and torch.equal(rebuilt, fresh)
    single = sh.edge_shifts(torch.float32, dev)  # the float64 shifts are kept: not handed back
    out["other_dtype"] = single.dtype == torch.float32 and torch.equal(single, recomputed(torch.float32))
    return out


def test_edge_shifts_are_reused_until_their_inputs_change():
    """The dispatch's edge shifts are computed once per edge list, plan and cell, and computed
    anew when any of them, or the tensor itself, changed."""
    for r, out in enumerate(run_on_world(_rank_shift_cache, 2, (2, 1, 1))):
        assert all(out.values()), f"rank {r}: {out}"


def test_negative_control_dropped_wrap_shift_fails_parity():
    s = _serial()
    res = run_on_world(_rank, 1, None, True, "block_inputs_drops_wrap_shift")
    with pytest.raises(
        AssertionError, match=r"parity of plain forces P=1, wrap shift dropped on grid 1 fails"
    ):
        assert_parity(
            by_id(res, "plain_forces", s["system"].ids),
            s["plain"].forces,
            grid="1",
            what="plain forces P=1, wrap shift dropped",
        )
