"""2-D periodic cells (slabs): ``pbc = (True, True, False)`` with a zero third lattice vector, as
``ase.build.fcc111(..., vacuum=None)`` makes and ASE and MACE accept.

- A rattled 2-layer fcc(111) slab (32 atoms, four species) with MACE (mace-torch, unmodified,
  random weights): the serial twinshard path, halo storage (skin 0) at 1, 2 and 4 ranks (spatial
  grids cut the two periodic axes only) and graph storage at 2 and 4 ranks equal mace-torch's own
  calculator ``MACECalculator(models=model, default_dtype="float64")``: energy, per-atom energies,
  forces (``assert_parity``'s fp64 round-off gate). Stress: a slab has no 3-D volume, so it is None
  (NaN in a batch), as for an open cluster; the virial (``-dE/d strain``) is defined and equals
  mace's: its calculator divides that virial by the volume of a cell it pads along z with a vector
  of arbitrary length (``(max |x| + 1) * 5 * r_max``, mace.data.neighborhood), so ``-stress x V_pad``
  is the oracle. A batch of the slab and a periodic box in graph storage: per-system energies,
  the box's stress, the slab's NaN stress row.
- The neighbour list of the slab equals ASE's; ``System`` round-trips through ASE and its scaled
  positions are ASE's (missing rows completed by unit normals); the spatial partition never cuts
  the open axis when it need not.
- Degenerate cells still raise, saying what and how to fix: a zero vector along a periodic axis,
  parallel periodic vectors (``System``, the neighbour list, the partition, and
  ``ShardedSystem.scatter`` on every rank).
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from twinshard.atoms.data.cells import complete_cell
from twinshard.atoms.data.neighbors import neighbor_list
from twinshard.atoms.data.system import System
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.graph_storage import GraphSharded
from twinshard.atoms.parallel.partition import PartitionError, SpatialPartition
from twinshard.atoms.parallel.plain_inputs import evaluate_plain
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials.mace import MaceAdapter, build_mace, mace_calculator, mace_native
from twinshard.runtime.errors import RankFailure
from twinshard.testing import (
    assert_parity,
    assert_replicated,
    assert_shards_cover,
    by_id,
    rows_of,
    run_on_world,
)

_MODELS: dict[str, nn.Module] = {}
SPECIES = (1, 6, 8, 29)
GRIDS = {1: (1, 1, 1), 2: (2, 1, 1), 4: (2, 2, 1)}


def _model():
    if "m" not in _MODELS:  # built once per worker process (seeded: the same weights everywhere)
        _MODELS["m"] = build_mace()
    return _MODELS["m"]


def slab_atoms():
    """A 4x4x2 fcc(111) Cu slab, rattled, species drawn from the model's; cell[2] = 0."""
    import ase.build

    a = ase.build.fcc111("Cu", size=(4, 4, 2), vacuum=None, periodic=False)
    a.pbc = (True, True, False)
    rng = np.random.default_rng(5)
    a.positions += rng.normal(0.0, 0.15, a.positions.shape)
    a.numbers = np.array(SPECIES)[rng.permutation(len(a)) % len(SPECIES)]
    a.arrays["ids"] = rng.permutation(len(a)) + 100
    del a.arrays["tags"]
    return a


def make_slab():
    return System.from_ase(slab_atoms())


def make_box():
    """10 atoms in a periodic 7 A box (a batch partner with a volume)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.rand(10, 3, generator=gen, dtype=torch.float64) * 7.0
    return System(
        positions=x, numbers=torch.tensor(SPECIES)[torch.arange(10) % 4], cell=7.0 * torch.eye(3), pbc=True
    )


def _mace_calculator(atoms):
    """mace-torch's calculator: energy, per-atom energies, forces, and the virial it implies
    (its stress times the volume of the padded cell it divided by)."""
    from mace.data.neighborhood import get_neighborhood

    atoms = atoms.copy()
    atoms.calc = mace_calculator(_model())  # MACECalculator(models=copy, default_dtype="float64")
    stress = atoms.get_stress(voigt=False)  # mace's: its virial / det(its padded cell)
    pbc = tuple(bool(p) for p in atoms.pbc)
    padded = get_neighborhood(atoms.positions, float(_model().r_max), pbc, atoms.cell.array.copy())[3]
    t = lambda v: torch.as_tensor(np.asarray(v), dtype=torch.float64)  # noqa: E731
    return {
        "energy": t(atoms.get_potential_energy()),
        "per_atom": t(atoms.calc.results["energies"]),
        "forces": t(atoms.get_forces()),
        "virial": -t(stress) * abs(float(np.linalg.det(padded))),
        "padded_c": float(padded[2, 2]),
    }


@pytest.fixture(scope="module")
def oracle():
    slab = make_slab()
    return slab, _mace_calculator(slab.to_ase())


def test_slab_serial_equals_mace_calculator(oracle):
    slab, ref = oracle
    assert float(slab.cell[2].abs().max()) == 0.0 and slab.pbc.tolist() == [True, True, False]
    assert slab.volume == 0.0 and ref["padded_c"] > 100.0  # mace's padding: an arbitrary length
    got = evaluate_plain(MaceAdapter(_model()), slab)
    assert got.stress is None  # no 3-D volume
    assert float(ref["forces"].abs().max()) > 1e-3 and float(ref["virial"].abs().max()) > 1e-3
    what = "serial twinshard, slab (cell[2] = 0)"
    assert_parity(got.energy, ref["energy"], what=f"{what}: energy vs MACECalculator")
    assert_parity(got.per_atom, ref["per_atom"], what=f"{what}: per-atom energies vs MACECalculator")
    assert_parity(got.forces, ref["forces"], what=f"{what}: forces vs MACECalculator")
    assert_parity(got.virial, ref["virial"], what=f"{what}: virial vs MACECalculator stress x V_pad")


def _rank(storage, nranks):
    system = make_slab() if dist.get_rank() == 0 else None
    cutoff = float(_model().r_max)
    dp = DistributedPotential(MaceAdapter(_model()), mode="dispatch")
    if storage == "halo":
        sh = ShardedSystem.scatter(system, cutoff=cutoff, skin=0.0)
    else:
        sh = GraphSharded.scatter(system, cutoff=cutoff, skin=0.5)
    res = dp.compute(sh)
    out = {
        "ids": sh.ids,
        "grid": None if storage == "graph" else sh.partition.grid,
        "energy": res.energy,
        "per_atom": res.per_atom,
        "forces": res.forces,
        "virial": res.virial,
        "stress": res.stress,
    }
    if storage == "graph" and nranks == 2:  # a batch: the slab and a periodic box
        batch = [make_slab(), make_box()] if dist.get_rank() == 0 else None
        rb = dp.compute(GraphSharded.scatter(batch, cutoff=cutoff, skin=0.5))
        out["batch"] = {"energy": rb.energy, "virial": rb.virial, "stress": rb.stress}
    return out


@pytest.mark.parametrize(
    ("storage", "nranks"), [("halo", 1), ("halo", 2), ("halo", 4), ("graph", 2), ("graph", 4)]
)
def test_slab_distributed_equals_mace_calculator(oracle, storage, nranks):
    slab, ref = oracle
    res = run_on_world(_rank, nranks, storage, nranks)
    where, gid = f"MACE slab, {storage} storage, P={nranks}", str(nranks)
    if storage == "halo":
        assert res[0]["grid"] == GRIDS[nranks]  # the periodic axes are cut, never the open one
    assert all(r["stress"] is None for r in res)
    assert_replicated([r["energy"] for r in res], f"energy {where}")
    assert_replicated([r["virial"] for r in res], f"virial {where}")
    assert_parity(res[0]["energy"], ref["energy"], grid=gid, what=f"energy {where} vs MACECalculator")
    assert_parity(res[0]["virial"], ref["virial"], grid=gid, what=f"virial {where} vs MACECalculator")
    for key in ("per_atom", "forces"):
        pieces = [(r[key], rows_of(r["ids"], slab.ids)) for r in res]
        assert_shards_cover(pieces, ref[key], f"{key} {where}", disjoint=True)
        assert_parity(by_id(res, key, slab.ids), ref[key], grid=gid, what=f"{key} {where} vs MACECalculator")
    if "batch" in res[0]:
        b = res[0]["batch"]
        box = mace_native(_model(), make_box().to_ase())
        assert_parity(b["energy"][0], ref["energy"], grid=gid, what="batch [slab, box]: slab energy")
        assert_parity(b["energy"][1], box["energy"][0], grid=gid, what="batch [slab, box]: box energy")
        assert_parity(b["virial"][0], ref["virial"], grid=gid, what="batch [slab, box]: slab virial")
        assert_parity(b["stress"][1], box["stress"], grid=gid, what="batch [slab, box]: box stress")
        assert bool(b["stress"][0].isnan().all()), "a slab has no volume: its stress row is NaN"


# ---------------------------------------------------------------------- cells, lists, partitions
def test_slab_is_accepted_as_ase_accepts_it():
    from ase.neighborlist import neighbor_list as ase_neighbor_list

    atoms = slab_atoms()
    slab = System.from_ase(atoms)
    torch.testing.assert_close(
        slab.scaled_positions(), torch.as_tensor(atoms.get_scaled_positions(wrap=False))
    )
    torch.testing.assert_close(slab.wrapped(), torch.as_tensor(atoms.get_positions(wrap=True)))
    back = slab.to_ase()
    assert np.array_equal(back.cell.array, atoms.cell.array) and back.pbc.tolist() == [True, True, False]
    e = neighbor_list(slab.positions, 4.0, slab.cell, slab.pbc)
    i, j, s = ase_neighbor_list("ijS", atoms, 4.0)
    ours = sorted(zip(e.receivers.tolist(), e.senders.tolist(), map(tuple, e.cell_shifts.tolist())))
    assert ours == sorted(zip(i.tolist(), j.tolist(), map(tuple, s.tolist()))) and len(ours) > 100
    assert bool((e.cell_shifts[:, 2] == 0).all()) and bool(e.cell_shifts[:, :2].abs().sum() > 0)
    # the completed cell spans the atoms along the normal; the periodic rows are the slab's
    full, origin = complete_cell(slab.cell, slab.pbc, slab.positions)
    torch.testing.assert_close(full[:2], slab.cell[:2])
    z = slab.positions[:, 2]
    assert (
        abs(float(full[2, 2]) - float(z.max() - z.min())) < 1e-12 and abs(float(origin[2] - z.min())) < 1e-12
    )
    part = SpatialPartition.build(
        slab.cell, (True, True, False), 4, ghost_width=4.0, positions=slab.positions
    )
    assert part.grid == (2, 2, 1)
    with pytest.raises(PartitionError, match="axis 2 into slabs"):  # the open axis is 2 A thick
        SpatialPartition.build(
            slab.cell, (True, True, False), 2, ghost_width=4.0, grid=(1, 1, 2), positions=slab.positions
        )


BAD = {
    "zero periodic vector": (
        (True, True, True),
        lambda c: c,
        r"axes \[2\] are periodic but their lattice vectors \(cell\[2\]\) are zero.*set pbc\[2\] = False",
    ),
    "parallel periodic vectors": (
        (True, True, False),
        lambda c: torch.stack([c[0], 2.0 * c[0], c[2]]),
        r"lattice vectors of the periodic axes \[0, 1\] are linearly dependent",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_degenerate_periodic_cell_still_raises_saying_how_to_fix_it(case):
    pbc, edit, match = BAD[case]
    slab = make_slab()
    cell = edit(slab.cell)
    with pytest.raises(ValueError, match=match):
        System(positions=slab.positions, numbers=slab.numbers, cell=cell, pbc=pbc)
    with pytest.raises(ValueError, match=match):
        neighbor_list(slab.positions, 4.0, cell, pbc)
    with pytest.raises(PartitionError, match=match):
        SpatialPartition.build(cell, pbc, 2, ghost_width=4.0, positions=slab.positions)


def _scatter_bad():
    atoms = slab_atoms()
    atoms.pbc = True  # periodic along z with cell[2] = 0
    ShardedSystem.scatter(atoms if dist.get_rank() == 0 else None, cutoff=4.0, skin=0.0)


def test_scatter_of_a_degenerate_cell_raises_on_every_rank():
    with pytest.raises(RankFailure, match=r"(?s)scatter.*axes \[2\] are periodic but their lattice vectors"):
        run_on_world(_scatter_bad, 2)
