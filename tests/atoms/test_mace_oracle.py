"""MACE models as users build them, checked against mace-torch's own ASE calculator.

The oracle is ``MACECalculator`` (``mace_native``: mace's neighbour list, ``AtomicData``, its
dtype casts), never twinshard's serial path, so an error shared by twinshard's serial and
distributed paths cannot hide. Models are built with mace-torch's own classes and random weights
(offline), saved with ``torch.save`` and loaded in each worker as a user loads them.

- The radius graph: a model sees the edges ``r < r_max`` only. The Verlet list is built with
  ``r_max + skin`` and kept until an atom moved ``skin / 2``; its skin edges must never reach
  the model. ``RealAgnosticResidualNonLinearInteractionBlock`` has edge features that are not zero
  at ``r_max``, so a skin edge changes its energy by percents (checked here, so the test has
  teeth): serial (a ``VerletList``), halo and graph storage at 1, 2 and 4 ranks, and MD against
  ASE's own ``VelocityVerlet`` driving mace's calculator.
- Every interaction block mace-torch offers, at 2 ranks with a skin, equals mace's calculator.
"""

import ase.md.verlet
import mace.modules  # noqa: F401 - the mace extra must be installed (CI installs it)
import numpy as np
import pytest
import torch
import torch.distributed as dist
from ase import units

import twinshard.atoms as ta
from twinshard.atoms.data import structures
from twinshard.atoms.data.neighbors import VerletList, neighbor_list, within_cutoff
from twinshard.atoms.data.system import System
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.graph_storage import GraphSharded
from twinshard.atoms.parallel.plain_inputs import evaluate_plain
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials.mace import MaceAdapter, build_mace, load_mace, mace_calculator, mace_native
from twinshard.testing import (
    assert_parity,
    assert_replicated,
    assert_shards_cover,
    by_id,
    rows_of,
    run_on_world,
)

NONLINEAR = "RealAgnosticResidualNonLinearInteractionBlock"
BLOCKS = sorted(mace.modules.interaction_classes)
GRIDS = {1: (1, 1, 1), 2: (2, 1, 1), 4: (2, 2, 1)}
R_MAX = 4.0
_MODELS: dict[str, torch.nn.Module] = {}


def make_system() -> System:
    s = structures.fcc_argon(repeat=2, rattle=0.25, seed=1)  # 32 atoms, 10.5 A box; shells 3.7, 5.3 A
    numbers = torch.tensor([1, 6, 8, 29])[
        torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(3)) % 4
    ]
    ids = torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(7)) + 500
    return System(positions=s.positions, numbers=numbers, cell=s.cell, pbc=s.pbc, ids=ids)


def make_cluster() -> System:
    """An open cluster (no cell, no periodicity): the 60 atoms of a rattled fcc block nearest its
    centre (~15 A across: two domains of more than the ghost width along each cut axis)."""
    s = structures.fcc_argon(repeat=3, rattle=0.25, seed=2)
    keep = torch.argsort((s.positions - s.positions.mean(0)).norm(dim=1))[:60]
    numbers = torch.tensor([1, 6, 8, 29])[torch.arange(60) % 4]
    return System(positions=s.positions[keep], numbers=numbers, ids=torch.arange(60) * 3 + 7)


SYSTEMS = {"box": make_system, "cluster": make_cluster}


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("mace_blocks")
    paths = {}
    for block in BLOCKS:
        paths[block] = str(root / f"{block}.model")
        torch.save(build_mace(interaction=block, r_max=R_MAX, seed=4), paths[block])
    return paths


def _model(path: str) -> torch.nn.Module:
    if path not in _MODELS:  # one load per worker process
        _MODELS[path] = load_mace(path)
    return _MODELS[path]


def _oracle(path: str, structure: str = "box") -> dict[str, torch.Tensor]:
    return mace_native(_model(path), SYSTEMS[structure]().to_ase())


def _rank(path: str, nranks: int, storage: str, skin: float, structure: str = "box") -> dict:
    model = _model(path)
    system = SYSTEMS[structure]() if dist.get_rank() == 0 else None
    if storage == "graph":
        sh = GraphSharded.scatter(system, cutoff=R_MAX, skin=skin)
    else:
        sh = ShardedSystem.scatter(system, cutoff=R_MAX, skin=skin, grid=GRIDS[nranks])
    res = DistributedPotential(MaceAdapter(model), mode="dispatch").compute(sh)
    return {
        "ids": sh.ids,
        "energy": res.energy,
        "per_atom": res.per_atom,
        "forces": res.forces,
        "stress": res.stress,
    }


def _check(res: list[dict], ref: dict, where: str, grid: str, structure: str = "box") -> None:
    system = SYSTEMS[structure]()
    assert_replicated([r["energy"] for r in res], f"energy {where}")
    assert_replicated([r["stress"] for r in res], f"stress {where}")
    if len(res) > 1:
        pieces = [(r["forces"], rows_of(r["ids"], system.ids)) for r in res]
        assert_shards_cover(pieces, ref["forces"], f"forces {where}", disjoint=True)
    assert_parity(res[0]["energy"], ref["energy"][0], grid=grid, what=f"energy {where}")
    assert_parity(
        by_id(res, "per_atom", system.ids), ref["node_energy"], grid=grid, what=f"node energy {where}"
    )
    assert_parity(by_id(res, "forces", system.ids), ref["forces"], grid=grid, what=f"forces {where}")
    if "stress" not in ref:  # no cell volume (an open cluster): no stress, as mace's calculator
        assert all(r["stress"] is None for r in res), f"stress {where}: an open system has none"
        return
    assert_parity(res[0]["stress"], ref["stress"], grid=grid, what=f"stress {where}")


def test_skin_edges_would_change_the_nonlinear_block(model_files):
    """The test below has teeth: the Verlet list holds edges beyond r_max, and handing them to the
    non-linear block changes its energy by far more than round-off."""
    system, path = make_system(), model_files[NONLINEAR]
    verlet = VerletList(R_MAX, 1.0)
    edges, _ = verlet.update(system.positions, system.cell, system.pbc)
    inside = within_cutoff(system.positions, edges.senders, edges.receivers, edges.shifts, R_MAX)
    assert 0 < int((~inside).sum()) < edges.n_edges, "the skin must hold edges beyond r_max"
    model = MaceAdapter(_model(path))
    exact = evaluate_plain(model, system, edges=verlet)  # the radius graph (skin edges dropped)
    data = {
        "positions": system.positions.clone().requires_grad_(True),
        "numbers": system.numbers,
        "senders": edges.senders,
        "receivers": edges.receivers,
        "shifts": edges.shifts,
        "batch": torch.zeros(system.n_atoms, dtype=torch.int64),
        "cell": system.cell[None],
    }
    skinned = model(data, compute_forces=True)  # the Verlet list as it is: the bug
    ref = _oracle(path)
    assert_parity(
        exact.energy, ref["energy"][0], what="serial VerletList (skin 1.0) vs MACECalculator: energy"
    )
    assert_parity(exact.forces, ref["forces"], what="serial VerletList (skin 1.0) vs MACECalculator: forces")
    assert_parity(exact.stress, ref["stress"], what="serial VerletList (skin 1.0) vs MACECalculator: stress")
    rel = float((skinned["energy"][0] - ref["energy"][0]).abs() / ref["energy"][0].abs())
    assert rel > 1e-3, f"a skin edge should change the non-linear block's energy, got {rel:.2e}"


@pytest.mark.parametrize("storage", ["halo", "graph"])
@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_radius_graph_exact_with_skin(model_files, storage, nranks):
    """Skin 1.0 (the MD default): the model still sees exactly r < r_max, in both storages."""
    path = model_files[NONLINEAR]
    res = run_on_world(_rank, nranks, path, nranks, storage, 1.0)
    _check(res, _oracle(path), f"MACE non-linear block, {storage} storage, skin 1.0, P={nranks}", str(nranks))


@pytest.mark.parametrize(("storage", "nranks"), [("halo", 2), ("halo", 4), ("graph", 4)])
def test_open_cluster_equals_mace_calculator(model_files, storage, nranks):
    """An open cluster (no cell): domains cut its bounding box, no lattice shifts anywhere."""
    path = model_files[NONLINEAR]
    res = run_on_world(_rank, nranks, path, nranks, storage, 1.0, "cluster")
    where = f"MACE non-linear block, open cluster, {storage} storage, skin 1.0, P={nranks}"
    _check(res, _oracle(path, "cluster"), where, str(nranks), "cluster")


@pytest.mark.parametrize("block", BLOCKS)
def test_every_interaction_block_equals_mace_calculator(model_files, block):
    path = model_files[block]
    res = run_on_world(_rank, 2, path, 2, "halo", 0.5)
    _check(res, _oracle(path), f"MACE {block}, halo storage, skin 0.5, P=2", "2")


def test_md_equals_ase_verlet_with_mace_calculator(model_files):
    """NVE MD at 2 ranks with skin 1.0 (the lists are reused across steps while pairs cross
    r_max) equals ASE's VelocityVerlet driving mace's own calculator, step by step."""
    path, steps, dt = model_files[NONLINEAR], 6, 1.0
    model = _model(path)
    system = make_system()
    system.velocities = ta.maxwell_boltzmann(system.masses, system.ids, 600.0, seed=5)
    out = ta.run_md(system, model, ranks=2, steps=steps, dt=dt, skin=1.0, thermo_every=1)
    atoms = system.to_ase()  # positions, velocities (ASE units, as twinshard's), masses
    atoms.calc = mace_calculator(model)
    energies = [atoms.get_potential_energy()]
    dyn = ase.md.verlet.VelocityVerlet(atoms, timestep=dt * units.fs)
    for _ in range(steps):
        dyn.run(1)
        energies.append(atoms.get_potential_energy())
    order = torch.argsort(system.ids)
    ref_pos = torch.as_tensor(atoms.get_positions())[order]
    moved = float((ref_pos - system.positions[order]).abs().max())
    assert moved > 1e-3, f"the atoms must move (max {moved:.2e} A)"
    # pairs crossed r_max while the Verlet list built at step 0 was reused (no rebuild: the
    # atoms moved less than skin / 2), so the radius graph was re-cut from it at later steps
    end = system.clone()
    end.positions = torch.as_tensor(atoms.get_positions())
    n_start = neighbor_list(system.positions, R_MAX, system.cell, system.pbc).n_edges
    n_end = neighbor_list(end.positions, R_MAX, end.cell, end.pbc).n_edges
    assert n_start != n_end, "no pair crossed r_max during the run: the test cannot see a stale radius graph"
    assert moved < 0.5, "a rebuild happened: the reused list is not exercised"
    assert_parity(
        out.system.positions, ref_pos, grid="2", what="MD positions vs ASE VelocityVerlet + MACECalculator"
    )
    assert_parity(
        torch.tensor(out.thermo.column("potential"), dtype=torch.float64),
        torch.tensor(np.asarray(energies), dtype=torch.float64),
        grid="2",
        what="MD potential energy per step vs ASE VelocityVerlet + MACECalculator",
    )


# ---------------------------------------------------------------------- fp32 model files
def _fp32_budget(ref: torch.Tensor, terms: int) -> dict:
    """Both sides run the fp32 model on the same fp64 structure cast to fp32, with operations in
    another order (twinshard's edge shifts are fp64 products cast once, mace's are fp32 products;
    the sums over ranks are split differently): fp32 round-off of sums of ``terms`` terms,
    ``max|ref| x (2 + 16 sqrt(terms)) eps32`` (the harness's Higham bound, fp32)."""
    eps = torch.finfo(torch.float32).eps
    atol = float(ref.abs().max()) * (2 + 16 * terms**0.5) * eps
    return {"rtol": 0.0, "atol": atol, "why": f"fp32 model: (2 + 16 sqrt({terms})) eps32 x max|ref|"}


@pytest.fixture(scope="module")
def fp32_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mace_fp32") / "fp32.model")
    torch.save(build_mace(interaction=NONLINEAR, r_max=R_MAX, seed=4, dtype=torch.float32), path)
    return path


def test_fp32_model_serial_and_distributed_equal_its_calculator(fp32_file):
    """A saved fp32 model (as most published MACE models are) runs at the default fp64 state: the
    inputs are cast to the model's dtype at its boundary and the results come back fp64, as mace's
    calculator does; serial and at 2 ranks in both storages, against mace's fp32 calculator."""
    model = _model(fp32_file)
    assert next(model.parameters()).dtype == torch.float32
    system, ref = make_system(), _oracle(fp32_file)
    got = evaluate_plain(MaceAdapter(model), system, edges=VerletList(R_MAX, 1.0))
    assert got.energy.dtype == got.forces.dtype == got.stress.dtype == torch.float64
    for key, val in (("energy", got.energy), ("forces", got.forces), ("stress", got.stress)):
        exp = ref[key][0] if key == "energy" else ref[key]
        assert_parity(val, exp, what=f"fp32 MACE serial {key} vs MACECalculator", **_fp32_budget(exp, 4096))
    for storage in ("halo", "graph"):
        res = run_on_world(_rank, 2, fp32_file, 2, storage, 1.0)
        where = f"fp32 MACE {storage} storage P=2"
        assert all(r["forces"].dtype == torch.float64 for r in res)
        forces = by_id(res, "forces", system.ids)
        assert_parity(
            res[0]["energy"],
            ref["energy"][0],
            grid="2",
            what=f"{where}: energy",
            **_fp32_budget(ref["energy"], 4096),
        )
        assert_parity(
            forces, ref["forces"], grid="2", what=f"{where}: forces", **_fp32_budget(ref["forces"], 4096)
        )
        assert_parity(
            res[0]["stress"],
            ref["stress"],
            grid="2",
            what=f"{where}: stress",
            **_fp32_budget(ref["stress"], 4096),
        )


def test_fp32_model_md_keeps_an_fp64_state(fp32_file):
    """run_md with an fp32 model: the positions and velocities stay fp64 (only the model is fp32)."""
    system = make_system()
    out = ta.run_md(system, _model(fp32_file), ranks=2, steps=2, dt=1.0, skin=1.0, initial_temperature=300.0)
    assert out.system.positions.dtype == out.system.velocities.dtype == out.forces.dtype == torch.float64
    assert bool(torch.isfinite(out.forces).all()) and float(out.forces.abs().max()) > 0


def test_cli_check_serial_uses_the_model_calculator(model_files, tmp_path, capsys):
    """``twinshard md --check-serial`` with the non-linear block and skin 1.0: its serial side is
    mace's own calculator (SerialEngine(reference=True)), so the skin bug, shared by twinshard's
    serial and distributed paths, could not report 4e-16 again."""
    import argparse
    import json

    from twinshard.atoms.data.io import read, write
    from twinshard.cli.md import add_md_parser, run_md

    structure = tmp_path / "s.extxyz"
    write(structure, make_system())
    parser = argparse.ArgumentParser()
    add_md_parser(parser.add_subparsers())
    argv = ["md", str(structure), "--potential", "mace", "--model", model_files[NONLINEAR], "--ranks", "2"]
    argv += ["--steps", "3", "--dt", "1.0", "--skin", "1.0", "--check-serial", "--json"]
    r = run_md(parser.parse_args(argv))
    json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ref = mace_native(_model(model_files[NONLINEAR]), read(structure).to_ase())  # as written (extxyz)
    assert abs(r["energy"] - float(ref["energy"][0])) <= 1e-12 * abs(float(ref["energy"][0]))
    assert (
        r["energy_rel_error"] <= 1e-12 and r["max_force_error"] <= 1e-12 and r["max_position_error"] <= 1e-12
    )


# ---------------------------------------------------------------------- multi-head models
def _head_rank(path: str, head: str, storage: str) -> dict:
    model = _model(path)
    system = make_system() if dist.get_rank() == 0 else None
    if storage == "graph":
        sh = GraphSharded.scatter(system, cutoff=R_MAX, skin=1.0)
    else:
        sh = ShardedSystem.scatter(system, cutoff=R_MAX, skin=1.0, grid=GRIDS[2])
    res = DistributedPotential(MaceAdapter(model, head=head), mode="dispatch").compute(sh)
    return {
        "ids": sh.ids,
        "energy": res.energy,
        "per_atom": res.per_atom,
        "forces": res.forces,
        "stress": res.stress,
    }


def test_multi_head_model_each_head_equals_its_calculator(tmp_path):
    """A multi-head ScaleShiftMACE (the fine-tuned foundation-model layout): ``MaceAdapter(model,
    head=...)`` reads the head mace's calculator reads with ``head=...``, at 2 ranks in both
    storages; the heads differ (each has its own E0s, scale and shift)."""
    path = str(tmp_path / "heads.model")
    torch.save(build_mace(scale_shift=(1.7, -0.3), heads=["default", "pbe"], r_max=R_MAX, seed=4), path)
    energies = {}
    for head in ("default", "pbe"):
        ref = mace_native(_model(path), make_system().to_ase(), head=head)
        energies[head] = float(ref["energy"][0])
        for storage in ("halo", "graph"):
            res = run_on_world(_head_rank, 2, path, head, storage)
            _check(res, ref, f"multi-head MACE, head {head}, {storage} storage, P=2", "2")
    assert abs(energies["default"] - energies["pbe"]) > 1.0, energies
    with pytest.raises(ValueError, match=r"no head 'r2scan'; its heads are \['default', 'pbe'\]"):
        MaceAdapter(_model(path), head="r2scan")


# ---------------------------------------------------------------------- a batch of periodic systems
def make_batch() -> list[System]:
    """Two periodic systems with different cells: the cubic box and a rattled rhombohedral supercell."""
    tri = structures.triclinic_argon(3, rattle=0.2, seed=3)  # 27 atoms, 60-degree cell
    tri.numbers = torch.tensor([1, 6, 8, 29])[torch.arange(tri.n_atoms) % 4]
    return [make_system(), tri]


def _batch_rank(path: str) -> dict:
    systems = make_batch() if dist.get_rank() == 0 else None
    g = GraphSharded.scatter(systems, cutoff=R_MAX, skin=1.0)
    res = DistributedPotential(MaceAdapter(_model(path)), mode="dispatch").compute(g)
    return {"energy": res.energy, "per_atom": res.per_atom, "forces": res.forces, "stress": res.stress}


@pytest.mark.parametrize("nranks", [2, 4])
def test_batch_of_two_periodic_cells_equals_mace_calculator(model_files, nranks):
    """Graph storage of a batch whose systems have different cells (each edge's lattice vectors
    are its own system's): per-system energies and stresses, per-atom forces, each system equal
    to mace's calculator on that system alone; a rank's rows straddle the two systems."""
    path = model_files[NONLINEAR]
    systems = make_batch()
    refs = [mace_native(_model(path), s.to_ase()) for s in systems]
    res = run_on_world(_batch_rank, nranks, path)
    where = f"MACE batch of 2 periodic cells, graph storage P={nranks}"
    assert_replicated([r["energy"] for r in res], f"energy {where}")
    assert_replicated([r["stress"] for r in res], f"stress {where}")
    forces = torch.cat([r["forces"] for r in res])  # owned rows in rank order: the concatenation
    per_atom = torch.cat([r["per_atom"] for r in res])
    assert [r["forces"].shape[0] for r in res].count(0) == 0 and sum(r["forces"].shape[0] for r in res) == 59
    start = 0
    for k, (s, ref) in enumerate(zip(systems, refs)):
        rows = slice(start, start + s.n_atoms)
        start += s.n_atoms
        grid = str(nranks)
        assert_parity(res[0]["energy"][k], ref["energy"][0], grid=grid, what=f"system {k} energy, {where}")
        assert_parity(per_atom[rows], ref["node_energy"], grid=grid, what=f"system {k} node energy, {where}")
        assert_parity(forces[rows], ref["forces"], grid=grid, what=f"system {k} forces, {where}")
        assert_parity(res[0]["stress"][k], ref["stress"], grid=grid, what=f"system {k} stress, {where}")
