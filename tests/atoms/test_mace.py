"""MACE from mace-torch, unmodified, under halo decomposition through the ShardTensor dispatch.

A small random-weight MACE (two residual interactions, ``8x0e + 8x1o`` hidden features, four
species, fp64) built offline; the oracle is serial MACE through mace-torch's own data pipeline
(its neighbour list, ``AtomicData``, its forward with ``compute_force`` / ``compute_stress``).
Distributed, ``DistributedPotential(MaceAdapter(model), mode="dispatch")`` hands MACE its data
dict as ShardTensors; MACE's modules (its e3nn layers compiled with TorchScript, its
``scatter_sum``, ``torch.autograd.grad`` for forces and the displacement stress) run unchanged.
Targets: energy relative error <= 1e-10, forces and stress max abs error <= 1e-9 at 2 and 4
ranks (the parity harness's fp64 round-off gate is tighter still, with evidence lines).
"""

import os

import mace.modules  # noqa: F401 - the mace extra must be installed (CI installs it)
import pytest
import torch
import torch.distributed as dist

from twinshard.atoms.data import structures
from twinshard.atoms.data.system import System
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.plain_inputs import evaluate_plain, system_inputs
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials.mace import MaceAdapter, build_mace, load_mace, mace_native
from twinshard.testing import (
    assert_parity,
    assert_replicated,
    assert_shards_cover,
    by_id,
    rows_of,
    run_on_world,
)

GRIDS = {1: (1, 1, 1), 2: (2, 1, 1), 4: (2, 2, 1)}
SKIN = 0.5
_MODELS: dict[str, torch.nn.Module] = {}


def make_system():
    s = structures.fcc_argon(repeat=2, rattle=0.25, seed=1)  # 32 atoms, 10.5 A periodic box
    numbers = torch.tensor([1, 6, 8, 29])[
        torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(3)) % 4
    ]
    ids = torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(7)) + 500
    return System(positions=s.positions, numbers=numbers, cell=s.cell, pbc=s.pbc, ids=ids)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mace") / "mace.model")
    torch.save(build_mace(), path)  # saved as mace-torch saves its models (the whole module)
    return path


def _model(path):
    if path not in _MODELS:  # one load per worker process
        _MODELS[path] = load_mace(path)
    return _MODELS[path]


@pytest.fixture(scope="module")
def serial(model_file):
    system = make_system()
    return system, mace_native(_model(model_file), system.to_ase())


def test_adapter_is_mace(serial, model_file):
    """twinshard's neighbour list and input dict through MaceAdapter equal mace's own pipeline."""
    system, ref = serial
    assert float(ref["forces"].abs().max()) > 1e-4 and float(ref["stress"].abs().max()) > 0
    got = evaluate_plain(MaceAdapter(_model(model_file)), system)
    assert_parity(got.energy, ref["energy"][0], what="MACE adapter vs mace pipeline: energy")
    assert_parity(got.per_atom, ref["node_energy"], what="MACE adapter vs mace pipeline: node energy")
    assert_parity(got.forces, ref["forces"], what="MACE adapter vs mace pipeline: forces")
    assert_parity(got.stress, ref["stress"], what="MACE adapter vs mace pipeline: stress")


def _rank(path, nranks):
    model = _model(path)
    system = make_system() if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(system, cutoff=float(model.r_max), skin=SKIN, grid=GRIDS[nranks])
    res = DistributedPotential(MaceAdapter(model), mode="dispatch").compute(sh)
    return {
        "ids": sh.ids,
        "n_halo": sh.n_halo,
        "energy": res.energy,
        "per_atom": res.per_atom,
        "forces": res.forces,
        "stress": res.stress,
    }


@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_mace_unmodified_through_dispatch(serial, model_file, nranks):
    """At P = 1 the block has no halo rows and MACE runs on plain tensors (no dispatch)."""
    system, ref = serial
    res = run_on_world(_rank, nranks, model_file, nranks)
    where, gid = f"MACE via dispatch P={nranks}", str(nranks)
    assert all((r["n_halo"] > 0) == (nranks > 1) for r in res)
    assert_replicated([r["energy"] for r in res], f"energy {where}")
    assert_replicated([r["stress"] for r in res], f"stress {where}")
    for key, full in (("per_atom", ref["node_energy"]), ("forces", ref["forces"])):
        pieces = [(r[key], rows_of(r["ids"], system.ids)) for r in res]
        assert_shards_cover(pieces, full, f"{key} {where}", disjoint=True)
    e, f, s = res[0]["energy"], by_id(res, "forces", system.ids), res[0]["stress"]
    # the bounds, then the harness's (tighter) round-off gate with its evidence line
    assert float((e - ref["energy"][0]).abs() / ref["energy"][0].abs()) <= 1e-10
    assert float((f - ref["forces"]).abs().max()) <= 1e-9
    assert float((s - ref["stress"]).abs().max()) <= 1e-9
    assert_parity(e, ref["energy"][0], grid=gid, what=f"energy {where}")
    assert_parity(
        by_id(res, "per_atom", system.ids), ref["node_energy"], grid=gid, what=f"node energy {where}"
    )
    assert_parity(f, ref["forces"], grid=gid, what=f"forces {where}")
    assert_parity(s, ref["stress"], grid=gid, what=f"stress {where}")


def test_saved_model_round_trip(model_file, serial):
    """A model saved with torch.save and read back by mace's loader semantics gives the same energy."""
    system, ref = serial
    again = load_mace(model_file)
    assert type(again).__name__ == "MACE" and os.path.getsize(model_file) > 0
    out = mace_native(again, system.to_ase())
    assert torch.equal(out["energy"], ref["energy"])


def test_adapter_batch_of_systems_is_mace(serial, model_file):
    """Two systems of different sizes in one call (a periodic cell and an open cluster): each
    system's energy, node energies, forces and the periodic one's stress equal mace's pipeline
    (the cluster's stress row is NaN: it has no volume)."""
    periodic, ref_p = serial
    cluster = System(positions=periodic.positions[:11] * 0.9, numbers=periodic.numbers[:11])
    model = _model(model_file)
    ref_c = mace_native(model, cluster.to_ase(), compute_stress=False)
    parts = [system_inputs(s, float(model.r_max)) for s in (periodic, cluster)]
    offset = periodic.n_atoms
    data = {
        "positions": torch.cat([p["positions"] for p in parts]).requires_grad_(True),
        "numbers": torch.cat([p["numbers"] for p in parts]),
        "senders": torch.cat([parts[0]["senders"], parts[1]["senders"] + offset]),
        "receivers": torch.cat([parts[0]["receivers"], parts[1]["receivers"] + offset]),
        "shifts": torch.cat([p["shifts"] for p in parts]),
        "batch": torch.cat([p["batch"] + k for k, p in enumerate(parts)]),
        "cell": torch.cat([p["cell"] for p in parts]),
    }
    assert int(parts[1]["senders"].numel()) > 0 and float(parts[0]["shifts"].abs().max()) > 0
    out = MaceAdapter(model)(data, compute_forces=True, compute_stress=True)
    what = "MACE adapter, batch of 2 systems"
    assert_parity(out["energy"][0], ref_p["energy"][0], what=f"{what}: periodic energy")
    assert_parity(out["energy"][1], ref_c["energy"][0], what=f"{what}: cluster energy")
    assert_parity(out["node_energy"][:offset], ref_p["node_energy"], what=f"{what}: periodic node energy")
    assert_parity(out["node_energy"][offset:], ref_c["node_energy"], what=f"{what}: cluster node energy")
    assert_parity(out["forces"][:offset], ref_p["forces"], what=f"{what}: periodic forces")
    assert_parity(out["forces"][offset:], ref_c["forces"], what=f"{what}: cluster forces")
    assert_parity(out["stress"][0], ref_p["stress"], what=f"{what}: periodic stress")
    assert bool(out["stress"][1].isnan().all()), "an open cluster has no volume: its stress is undefined"


def _unknown_species_rank(path):
    model = _model(path)
    system = None
    if dist.get_rank() == 0:
        system = make_system()
        system.numbers[0] = 18  # argon: this model has no parameters for it
    sh = ShardedSystem.scatter(system, cutoff=float(model.r_max), skin=SKIN, grid=GRIDS[2])
    DistributedPotential(MaceAdapter(model), mode="dispatch").compute(sh)


def test_unknown_species_raises_on_every_rank(model_file):
    """An atomic number MACE has no parameters for raises the same error on every rank (the ranks
    agree on the block's species before the first gather), never a hang on the ranks without it."""
    with pytest.raises(
        Exception,
        match=r"(?s)check the block's species.*also ranks \[1\].*no parameters for atomic numbers \[18\]",
    ):
        run_on_world(_unknown_species_rank, 2, model_file)
