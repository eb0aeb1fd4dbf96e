"""ShardedSystem: scatter/gather round trips, migration invariants, errors on every rank."""

import ase
import numpy as np
import pytest
import torch
import torch.distributed as dist
from _planted import planted

from twinshard.atoms.data import structures
from twinshard.atoms.data.system import System
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials import LennardJones, evaluate
from twinshard.rng import normal
from twinshard.runtime import RankFailure
from twinshard.testing import assert_parity, assert_replicated, assert_shards_cover, rows_of, run_on_world

CUTOFF, SKIN = 6.0, 0.5


def _system(dtype=torch.float64):
    s = structures.triclinic_argon(repeat=(7, 6, 6), rattle=0.3, seed=5, dtype=dtype)
    n = s.n_atoms
    g = torch.Generator().manual_seed(3)
    return System(
        positions=s.positions,
        numbers=s.numbers,
        cell=s.cell,
        pbc=s.pbc,
        velocities=torch.randn(n, 3, generator=g, dtype=dtype),
        ids=torch.randperm(n, generator=g) * 3 + 11,  # unique, not 0..n-1
        arrays={
            "charges": torch.randn(n, generator=g, dtype=dtype),
            "tags": torch.arange(n) % 4,
            "dipole": torch.randn(n, 2, generator=g, dtype=dtype),
            "fixed": torch.arange(n) % 3 == 0,
        },
        info={"name": "test", "temperature": 300.0},
    )


def _same_system(a, b):
    order_a, order_b = torch.argsort(a.ids), torch.argsort(b.ids)
    assert torch.equal(a.ids[order_a], b.ids[order_b])
    for k in ("positions", "velocities", "masses", "numbers"):
        assert torch.equal(getattr(a, k)[order_a], getattr(b, k)[order_b]), k
    assert sorted(a.arrays) == sorted(b.arrays)
    for k in a.arrays:
        assert a.arrays[k].dtype == b.arrays[k].dtype
        assert torch.equal(a.arrays[k][order_a], b.arrays[k][order_b]), k
    assert torch.equal(a.cell, b.cell) and torch.equal(a.pbc, b.pbc)
    assert a.info == b.info


def _rank_roundtrip(src, partition, dtype):
    s = _system(dtype) if dist.get_rank() == src else None
    sh = ShardedSystem.scatter(s, src=src, cutoff=CUTOFF, skin=SKIN, partition=partition)
    gathered = sh.gather(dst=src)
    everywhere = sh.gather_all()
    loc = sh.local()
    inside = True
    if partition == "spatial":
        inside = bool((sh.partition.owner_of(sh.partition.fractional(sh.positions)) == sh.rank).all())
    return {
        "ids": sh.ids,
        "sorted": bool((sh.ids[1:] > sh.ids[:-1]).all()),
        "gathered": gathered,
        "all": everywhere,
        "local_n": loc.n_atoms,
        "inside": inside,
        "n_total": sh.n_total,
        "dtype": sh.dtype,
        "cell": sh.cell,
    }


@pytest.mark.parametrize(
    "nranks,src,partition,dtype",
    [
        (1, 0, "spatial", torch.float64),
        (3, 2, "spatial", torch.float64),
        (4, 0, "spatial", torch.float32),
        (3, 1, "block", torch.float64),
    ],
)
def test_scatter_gather_roundtrip(nranks, src, partition, dtype):
    full = _system(dtype)
    res = run_on_world(_rank_roundtrip, nranks, src, partition, dtype)
    for r, out in enumerate(res):
        assert out["sorted"] and out["inside"] and out["dtype"] == dtype
        assert out["n_total"] == full.n_atoms and out["local_n"] == out["ids"].numel()
        _same_system(out["all"], full)
        assert (out["gathered"] is None) == (r != src)
    _same_system(res[src]["gathered"], full)
    assert_replicated([out["cell"] for out in res], "cell")
    pieces = [(o["ids"], rows_of(o["ids"], full.ids)) for o in res]
    assert_shards_cover(pieces, full.ids, "owned ids", disjoint=True)
    ids = torch.cat([out["ids"] for out in res])
    assert ids.numel() == full.n_atoms and torch.unique(ids).numel() == full.n_atoms


def _displacement(ids, step, scale):
    return normal(21, step, ids[:, None].to(torch.int64), torch.arange(3)[None, :]) * scale


def _rank_migrate(rounds, scale, drift, plant=None):
    with planted(plant):
        return _migrate(rounds, scale, drift, gather=plant is None)


def _migrate(rounds, scale, drift, gather=True):
    s = _system() if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(s, cutoff=CUTOFF, skin=SKIN, hysteresis=0.3)
    pot = LennardJones(cutoff=CUTOFF)
    dp = DistributedPotential(pot)
    log = []
    for step in range(rounds):
        # in place, as an integrator does; drift carries atoms out of the cell (unwrapped)
        sh.positions += _displacement(sh.ids, step, scale) + drift
        sh.velocities[:, 0] += 1.0
        rebuilt = sh.update()
        res = dp.compute(sh)
        frac = sh.partition.fractional(sh.positions)
        strict = sh.partition.owner_of(frac)
        near = sh.partition.owner_of(frac, current=torch.full_like(strict, sh.rank), hysteresis=0.3 + 1e-9)
        log.append(
            {
                "rebuilt": rebuilt,
                "migrations": sh.migrations,
                "energy": res.energy,
                "ids": sh.ids.clone(),
                "positions": sh.positions.clone(),
                "forces": res.forces,
                "owned_ok": bool((near == sh.rank).all()) if rebuilt else True,
                "left": int((strict != sh.rank).sum()),
            }
        )
    return log, (sh.gather_all() if gather else None), sh.builds  # a duplicated id fails to gather


def test_migration_keeps_every_atom_and_stays_exact():
    rounds, scale = 4, 0.1  # small random part: no close contacts, the drift migrates atoms
    drift = torch.tensor([0.9, -0.7, 0.5], dtype=torch.float64)
    res = run_on_world(_rank_migrate, 4, rounds, scale, drift)
    full = _system()
    ref = full.clone()
    pot = LennardJones(cutoff=CUTOFF)
    for step in range(rounds):
        ref.positions += _displacement(ref.ids, step, scale) + drift
        ref.velocities[:, 0] += 1.0
        serial = evaluate(pot, ref)
        logs = [r[0][step] for r in res]
        assert all(lg["rebuilt"] for lg in logs)  # every round moves atoms by more than skin/2
        assert all(lg["owned_ok"] for lg in logs)  # owners hold atoms within the hysteresis
        assert_replicated([lg["migrations"] for lg in logs], "migration count")
        _check_owners(logs, ref, f"after migration round {step}")
        assert_parity(logs[0]["energy"], serial.energy, what=f"LJ energy after migration round {step}")
        for key, full_t in (("positions", ref.positions), ("forces", serial.forces)):
            pieces = [(lg[key], rows_of(lg["ids"], ref.ids)) for lg in logs]
            assert_shards_cover(pieces, full_t, f"owned {key} after migration round {step}", disjoint=True)
        forces = torch.zeros_like(serial.forces)
        for lg in logs:
            forces[rows_of(lg["ids"], ref.ids)] = lg["forces"]
        assert_parity(forces, serial.forces, what=f"LJ forces after migration round {step}")
    assert res[0][0][-1]["migrations"] > 0
    # hysteresis at work: some atoms sit just outside their owner's slab
    assert sum(r[0][-1]["left"] for r in res) > 0
    for _, gathered, builds in res:
        _same_system(gathered, ref)  # positions unwrapped, exactly the serial ones
        assert builds == rounds + 1


def _check_owners(logs, ref, where):
    """Each global id is owned by exactly one rank (none lost, none duplicated)."""
    pieces = [(lg["ids"], rows_of(lg["ids"], ref.ids)) for lg in logs]
    assert_shards_cover(pieces, ref.ids, f"owned atom ids {where}", disjoint=True)


@pytest.mark.parametrize(
    "plant,match",
    [
        ("migrate_drop", r"owned atom ids after migration: .* 1 of 252 elements are held by no rank"),
        ("migrate_duplicate", r"owned atom ids after migration: 1 elements are held by more than one rank"),
    ],
)
def test_ownership_check_catches_a_lost_or_duplicated_atom(plant, match):
    drift = torch.tensor([0.9, -0.7, 0.5], dtype=torch.float64)
    res = run_on_world(_rank_migrate, 4, 1, 0.1, drift, plant)
    assert res[0][0][0]["migrations"] > 0
    with pytest.raises(AssertionError, match=match):
        _check_owners([r[0][0] for r in res], _system(), "after migration")


def _rank_small_moves():
    s = _system() if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(s, cutoff=CUTOFF, skin=SKIN)
    before = sh.ids.clone()
    sh.positions += 0.2 * SKIN * torch.sign(_displacement(sh.ids, 0, 1.0))  # |d| = 0.17 < skin/2
    rebuilt = sh.update()
    return rebuilt, sh.migrations, torch.equal(before, sh.ids), sh.builds


def test_no_rebuild_below_half_skin():
    for rebuilt, migrations, same, builds in run_on_world(_rank_small_moves, 2):
        assert not rebuilt and migrations == 0 and same and builds == 1


# ------------------------------------------------------------------- errors on every rank
def _rank_scatter_error(kind, path):
    source = None
    if dist.get_rank() == 0:
        if kind == "nan":
            atoms = ase.Atoms(
                "Ar4", positions=[[0, 0, 0], [1, 1, 1], [np.nan, 0, 0], [2, 2, 2]], cell=[9, 9, 9], pbc=True
            )
            source = atoms
        elif kind == "small":
            source = structures.fcc_argon(repeat=2)  # 10.5 A: no 2-rank cut leaves 6.5 A slabs
        elif kind == "mass":
            source = ase.Atoms("ArX", positions=[[0, 0, 0], [3, 3, 3]], cell=[12, 12, 12], pbc=True)
        elif kind == "file":
            source = path
        elif kind == "none":
            source = None
    try:
        ShardedSystem.scatter(source, cutoff=CUTOFF, skin=SKIN)
    except RankFailure as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    "kind,nranks,phrase",
    [
        ("nan", 2, "NaN"),
        ("small", 4, "too small for 4 ranks"),
        ("mass", 2, "missing mass"),
        ("file", 3, "cannot read structure file"),
        ("none", 2, "passed None"),
    ],
)
def test_bad_input_fails_on_every_rank(kind, nranks, phrase, tmp_path):
    path = tmp_path / "broken.xyz"
    path.write_text("3\nnot an extxyz comment line\nAr 0 0\n")
    msgs = run_on_world(_rank_scatter_error, nranks, kind, str(path), timeout=60)
    assert len(msgs) == nranks
    for r, m in enumerate(msgs):
        assert phrase in m, f"rank {r}: {m}"
        assert "rank 0" in m  # names the failing rank


def _rank_nan_during_md():
    s = _system() if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(s, cutoff=CUTOFF, skin=SKIN)
    if sh.rank == 1:
        sh.positions[0, 1] = float("nan")
    try:
        sh.update()
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_nan_positions_during_md_fail_on_every_rank():
    for m in run_on_world(_rank_nan_during_md, 3):
        assert "non-finite positions (rank 1: 1 atom, id " in m, m


# ------------------------------------------------------------------- adversarial occupancy
def _sparse_system():
    """Atoms fill the first third of a long periodic box: some slabs hold few or no atoms."""
    f = structures.fcc_argon(repeat=3, rattle=0.2, seed=1)
    cell = f.cell.clone()
    cell[0, 0] *= 3
    return System(positions=f.positions, numbers=f.numbers, cell=cell, pbc=True)


def _rank_sparse():
    pot = LennardJones(cutoff=CUTOFF)
    sh = ShardedSystem.scatter(
        _sparse_system() if dist.get_rank() == 0 else None, cutoff=CUTOFF, skin=SKIN, grid=(4, 1, 1)
    )
    dp = DistributedPotential(pot)
    first = dp.compute(sh)
    n_first = sh.n_owned
    sh.positions += torch.tensor([2.0, 0.3, -0.2], dtype=torch.float64)  # every atom crosses > skin/2
    sh.update()
    second = dp.compute(sh)
    return n_first, first.energy, second.energy, sh.n_owned, sh.gather_all().n_atoms


def test_empty_and_tiny_shards():
    s = _sparse_system()
    pot = LennardJones(cutoff=CUTOFF)
    e1 = evaluate(pot, s).energy
    s.positions += torch.tensor([2.0, 0.3, -0.2], dtype=torch.float64)
    e2 = evaluate(pot, s).energy
    res = run_on_world(_rank_sparse, 4)
    assert min(r[0] for r in res) == 0  # one rank owns nothing, and still takes part
    assert sorted(r[0] for r in res)[1] <= 20  # and one owns only a few atoms
    for _, a, b, _, total in res:
        assert total == s.n_atoms
        assert_parity(a, e1, what="LJ energy with an empty shard")
        assert_parity(b, e2, what="LJ energy with an empty shard after migration")
