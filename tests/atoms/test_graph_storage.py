"""Graph-parallel storage (atoms.graph_storage.GraphSharded): plain models, unmodified, through the
dispatch, against serial; halo storage in the same world for comparison.

- The plain message-passing model at 1, 2, 3 and 4 ranks: halo and graph storage both equal serial
  (fp64 round-off budget of ``assert_parity``): energy, stress, per-atom energies, forces, the
  backward of a random grad_output on the per-atom energies (positions and every parameter). Owned
  rows are strict, disjoint, covering pieces of the serial tensors (``assert_shards_cover``).
- A batch of three systems of different sizes (periodic, open, a 3-atom periodic one with fewer
  atoms than ranks) at 3 and 4 ranks: per-system energies, virials, stresses and forces against
  each system evaluated serially; the gather back to rank 0 returns the batch unchanged; the
  3-atom system alone at 4 ranks leaves one rank with no atoms.
- MACE (mace-torch, random weights, 2 interactions, L = 1, 4 species, periodic) at 2 and 4 ranks
  against mace's own pipeline (the issue's bounds, then ``assert_parity``); at 4 ranks also a
  batch with an open cluster.
- ``twinshard validate --storage graph --json``.
- Bad input raises on every rank: ranks holding different batches, a non-source rank passing one,
  negative atom ids, an edge id out of range on one rank.
- Negative controls: ``sharded_gather`` / ``per_system_reduce`` disabled raise ``UnhandledAtomOp``
  naming the op; replaced by a local-only version (what a missing communication would compute),
  the parity check fails with its message; ``replicated_grads`` disabled (the displacement's
  per-rank partial gradients never all-reduced), the stress parity fails.
"""

import json

import pytest
import torch
import torch.distributed as dist

from twinshard.atoms.data import structures
from twinshard.atoms.data.system import System
from twinshard.atoms.dynamics.api import run_md
from twinshard.atoms.dynamics.driver import MDConfig, potential_from_config
from twinshard.atoms.dynamics.md import SerialEngine, VelocityVerlet, maxwell_boltzmann, simulate
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.graph_storage import GraphSharded, OwnedFirst, balanced_counts, graph_inputs
from twinshard.atoms.parallel.plain_inputs import evaluate_plain, system_inputs
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials.mace import MaceAdapter, build_mace, mace_native
from twinshard.atoms.potentials.mpnn_plain import PlainMessagePassing
from twinshard.cli import main
from twinshard.rng import normal
from twinshard.shard import dispatch as D
from twinshard.shard import registry as R
from twinshard.shard.shard_tensor import UnhandledAtomOp, to_local
from twinshard.testing import (
    assert_grads_finite_nonzero,
    assert_parity,
    assert_random_grad_output,
    assert_replicated,
    assert_shards_cover,
    by_id,
    rows_of,
    run_on_world,
)

SKIN = 0.5
# halo storage: spatial grids; 3 ranks do not fit along the 10.5 A box, so index blocks with halos
HALO = {1: {}, 2: {"grid": (2, 1, 1)}, 3: {"partition": "block"}, 4: {"grid": (2, 2, 1)}}
KW = dict(species=(18, 36), cutoff=4.0, n_features=8, n_basis=6, n_layers=2, seed=3)


def make_model():
    return PlainMessagePassing(**KW)


def make_system(species=(18, 36), seed=7):
    s = structures.fcc_argon(repeat=2, rattle=0.25, seed=1)  # 32 atoms, 10.5 A periodic box
    zs = torch.tensor(species)
    numbers = zs[torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(3)) % len(zs)]
    ids = torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(seed)) + 1000
    return System(positions=s.positions, numbers=numbers, cell=s.cell, pbc=s.pbc, ids=ids)


def make_open(species=(18, 36)):
    """12 atoms, open boundaries (no cell)."""
    s = structures.fcc_argon(repeat=2, rattle=0.3, seed=4)
    zs = torch.tensor(species)
    return System(positions=s.positions[:12] + 20.0, numbers=zs[torch.arange(12) % len(zs)])


def make_small():
    """3 atoms in a 5 A periodic cube (each sees its own images)."""
    x = torch.tensor([[0.3, 0.2, 0.1], [2.6, 2.4, 0.4], [1.1, 3.5, 2.9]], dtype=torch.float64)
    cell = 5.0 * torch.eye(3, dtype=torch.float64)
    return System(positions=x, numbers=torch.tensor([36, 18, 18]), cell=cell, pbc=True)


def _go(ids):
    return normal(5, 1, ids.to(torch.int64))


def _go_forces(ids):
    return normal(6, 2, ids[:, None].to(torch.int64), torch.arange(3)[None, :])


# ---------------------------------------------------------------------- planted local-only handlers
def _local_only(name):
    """The handler ``name`` replaced by the op on local rows (no communication)."""
    if name == "sharded_gather":

        def run(f, a, k):  # rank-relative ids < n_owned are the own rows; any other row reads 0
            c = D.parse_index_call(f, a, k)
            loc, idx = to_local(c.target), R.plain_index(c.index)
            ok = (idx >= 0) & (idx < loc.shape[0])
            rows = loc.index_select(0, torch.where(ok, idx, torch.zeros_like(idx)))
            return torch.where(ok.reshape(ok.shape + (1,) * (rows.dim() - 1)), rows, torch.zeros_like(rows))

    elif name == "per_system_reduce":

        def run(f, a, k):  # this rank's partial sums, never all-reduced
            c = D.parse_index_call(f, a, k)
            z = torch.zeros(c.target.shape, dtype=c.source.dtype)
            part = R.local_scatter(c, z, R.plain_index(c.index), to_local(c.source))
            return c.target.add_(part) if c.inplace else c.target + part

    else:
        raise ValueError(name)
    pred = next(h.predicate for h in D._shipped() if h.name == name)
    return D.REGISTRY.installed(D.Handler(name, pred, run), first=False)


def _results(store, res):
    return {
        "ids": store.ids,
        "energy": res.energy,
        "per_atom": res.per_atom,
        "forces": res.forces,
        "stress": res.stress,
    }


def _rank_mpnn(nranks, plant=None, halo=True):
    model = make_model()
    system = make_system() if dist.get_rank() == 0 else None
    dp = DistributedPotential(model, mode="dispatch")
    out = {}
    if halo:
        sh = ShardedSystem.scatter(system, cutoff=model.cutoff, skin=SKIN, **HALO[nranks])
        out["halo"] = _results(sh, dp.compute(sh))
    g = GraphSharded.scatter(system, cutoff=model.cutoff, skin=SKIN)
    if plant == "replicated_grads":  # the displacement's partial gradients never all-reduced
        ctx = D.REGISTRY.disabled(plant)
    else:
        ctx = _local_only(plant) if plant else D.REGISTRY.disabled()
    with ctx:
        out["graph"] = _results(g, dp.compute(g))
        x = g.positions.detach().requires_grad_(True)
        per_atom = dp.per_atom_energies(g, x)
        params = list(model.parameters())
        grads = torch.autograd.grad(per_atom, [x, *params], _go(g.ids).to(per_atom.dtype))
    if nranks == 2 and plant is None:  # a force loss: double backward through the dispatch (training)
        r2 = dp.compute(g, compute_stress=False, create_graph=True)
        g2 = torch.autograd.grad((_go_forces(g.ids) * r2.forces).sum(), params, allow_unused=True)
        out["graph"]["force_loss"] = {
            n: (torch.zeros_like(p) if gr is None else gr) for (n, p), gr in zip(model.named_parameters(), g2)
        }
    out["graph"].update(
        counts=g.counts(),
        edges=int(g.senders.shape[0]),
        grad_x=grads[0],
        grad_params={n: gr for (n, _), gr in zip(model.named_parameters(), grads[1:])},
    )
    return out


def _serial_mpnn():
    model, system = make_model(), make_system()
    ref = evaluate_plain(model, system)
    data = system_inputs(system, model.cutoff)
    x = system.positions.detach().requires_grad_(True)
    data["positions"] = x
    per_atom = model(data, compute_forces=False)["node_energy"]
    params = list(model.parameters())
    grads = torch.autograd.grad(per_atom, [x, *params], _go(system.ids))
    names = [n for n, _ in model.named_parameters()]
    data["positions"] = system.positions.detach().clone().requires_grad_(True)
    f = model(data, compute_forces=True, training=True)["forces"]
    g2 = torch.autograd.grad((_go_forces(system.ids) * f).sum(), params, allow_unused=True)
    force_loss = {n: (torch.zeros_like(p) if g is None else g) for n, p, g in zip(names, params, g2)}
    return system, ref, grads[0], dict(zip(names, grads[1:])), force_loss


@pytest.fixture(scope="module")
def serial_mpnn():
    return _serial_mpnn()


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_plain_mpnn_halo_and_graph_storage_equal_serial(serial_mpnn, nranks):
    system, ref, grad_x, grad_params, force_loss = serial_mpnn
    res = run_on_world(_rank_mpnn, nranks, nranks)
    gid = str(nranks)
    assert float(ref.forces.abs().max()) > 1e-3 and float(ref.stress.abs().max()) > 0
    for storage in ("halo", "graph"):
        rs = [r[storage] for r in res]
        where = f"plain mpnn, {storage} storage, P={nranks}"
        assert_replicated([r["energy"] for r in rs], f"energy {where}")
        assert_replicated([r["stress"] for r in rs], f"stress {where}")
        assert_parity(rs[0]["energy"], ref.energy, grid=gid, what=f"energy {where}")
        assert_parity(rs[0]["stress"], ref.stress, grid=gid, what=f"stress {where}")
        keys = [("per_atom", ref.per_atom), ("forces", ref.forces)]
        if storage == "graph":
            keys.append(("grad_x", grad_x))
        for key, full in keys:
            pieces = [(r[key], rows_of(r["ids"], system.ids)) for r in rs]
            assert_shards_cover(pieces, full, f"{key} {where}", disjoint=True)
            assert_parity(by_id(rs, key, system.ids), full, grid=gid, what=f"{key} {where}")
    gs = [r["graph"] for r in res]
    assert gs[0]["counts"] == list(balanced_counts(system.n_atoms, nranks))
    assert all(r["edges"] > 0 for r in gs)
    assert_random_grad_output(gs[0]["grad_x"])
    assert_replicated([r["grad_params"] for r in gs], f"parameter gradients graph P={nranks}")
    assert_grads_finite_nonzero(gs[0]["grad_params"], f"graph P={nranks}")
    for n, g in grad_params.items():
        assert_parity(gs[0]["grad_params"][n], g, grid=gid, what=f"d<g, per-atom E>/d{n} graph P={nranks}")
    if nranks == 2:
        assert_replicated([r["force_loss"] for r in gs], "force-loss gradients graph P=2")
        for n, g in force_loss.items():
            assert_parity(gs[0]["force_loss"][n], g, grid=gid, what=f"d<g, F>/d{n} graph P=2")


def test_rank_relative_ids():
    """OwnedFirst: on rank 1 of blocks (3, 2, 4) ids 0..1 are its own rows (global 3, 4), the others
    wrap around; PAD and ids out of range are left for the dispatch (zero row / error)."""
    ids = torch.tensor([0, 1, 2, 5, 8, 9, -1, -3, 12])
    got = OwnedFirst((3, 2, 4)).to_global(ids, 1)
    assert got.tolist() == [3, 4, 5, 8, 2, 9, -1, -3, 12]
    assert balanced_counts(10, 4) == (3, 3, 2, 2) and balanced_counts(3, 4) == (1, 1, 1, 0)


# ---------------------------------------------------------------------- a batch of systems
def _batch():
    systems = [make_system(), make_open(), make_small()]
    for k, s in enumerate(systems):  # per-system values a charged MLIP reads: replicated, [S]
        s.info.update(charge=k - 1.0, spin=0.5 * k, label=f"system {k}")
    return systems


def _rank_batch(nranks):
    model = make_model()
    me = dist.get_rank()
    dp = DistributedPotential(model, mode="dispatch")
    g = GraphSharded.scatter(_batch() if me == 0 else None, cutoff=model.cutoff, skin=SKIN)
    r = dp.compute(g)
    small = GraphSharded.scatter(make_small() if me == 0 else None, cutoff=model.cutoff, skin=SKIN)
    rs = dp.compute(small)
    return {
        "counts": g.counts(),
        "energies": r.energy,
        "virials": r.virial,
        "stresses": r.stress,
        "forces": r.forces,
        "back": g.gather_systems(0),
        "values": {k: graph_inputs(g)[k] for k in ("charge", "spin")},
        "small": {"counts": small.counts(), "energy": rs.energy, "forces": rs.forces, "stress": rs.stress},
    }


@pytest.mark.parametrize("nranks", [3, 4])
def test_batch_of_systems_equals_each_serial(nranks):
    systems = _batch()
    model = make_model()
    refs = [evaluate_plain(model, s) for s in systems]
    res = run_on_world(_rank_batch, nranks, nranks)
    gid = str(nranks)
    sizes = [s.n_atoms for s in systems]
    assert res[0]["counts"] == list(balanced_counts(sum(sizes), nranks))
    for key in ("energies", "virials"):
        assert_replicated([r[key] for r in res], f"batch {key} P={nranks}")
    forces = torch.cat([r["forces"] for r in res]).split(sizes)
    for k, (s, ref) in enumerate(zip(systems, refs)):
        where = f"batch system {k} ({s.n_atoms} atoms) P={nranks}"
        assert_parity(res[0]["energies"][k], ref.energy, grid=gid, what=f"energy {where}")
        assert_parity(res[0]["virials"][k], ref.virial, grid=gid, what=f"virial {where}")
        assert_parity(forces[k], ref.forces, grid=gid, what=f"forces {where}")
        if ref.stress is None:  # the open cluster: no volume, no stress
            assert bool(torch.isnan(res[0]["stresses"][k]).all())
        else:
            assert_parity(res[0]["stresses"][k], ref.stress, grid=gid, what=f"stress {where}")
    for s, back in zip(systems, res[0]["back"]):  # gathered back in the caller's order
        for f in ("positions", "numbers", "ids", "cell"):
            assert torch.equal(getattr(back, f), getattr(s, f).to(getattr(back, f).dtype)), f
    assert all(r["back"] is None for r in res[1:])
    assert [b.info for b in res[0]["back"]] == [s.info for s in systems]
    for key in ("charge", "spin"):  # replicated per-system values, in the serial dict's form
        assert_replicated([r["values"][key] for r in res], f"batch {key} P={nranks}")
        serial = torch.cat([system_inputs(s, 1.0)[key] for s in systems])
        assert torch.equal(res[0]["values"][key], serial), (key, res[0]["values"][key], serial)
    small, ref = res[0]["small"], refs[2]
    # 3 atoms: one atom per rank at P=3; at P=4 one rank holds none and still takes part
    assert small["counts"] == list(balanced_counts(3, nranks)) and (0 in small["counts"]) == (nranks == 4)
    assert_parity(small["energy"], ref.energy, grid=gid, what=f"energy 3 atoms P={nranks}")
    assert_parity(small["stress"], ref.stress, grid=gid, what=f"stress 3 atoms P={nranks}")
    assert_parity(torch.cat([r["small"]["forces"] for r in res]), ref.forces, grid=gid, what="forces 3 atoms")


# ---------------------------------------------------------------------- MACE
_MACE: dict[str, torch.nn.Module] = {}
MACE_SPECIES = (1, 6, 8, 29)


def _mace():
    if "m" not in _MACE:  # built once per worker process (seeded: the same weights everywhere)
        _MACE["m"] = build_mace()
    return _MACE["m"]


def _rank_mace(nranks):
    model = _mace()
    me = dist.get_rank()
    dp = DistributedPotential(MaceAdapter(model), mode="dispatch")
    g = GraphSharded.scatter(
        make_system(MACE_SPECIES) if me == 0 else None, cutoff=float(model.r_max), skin=SKIN
    )
    out = _results(g, dp.compute(g))
    if nranks == 4:
        batch = [make_system(MACE_SPECIES), make_open(MACE_SPECIES)]
        gb = GraphSharded.scatter(batch if me == 0 else None, cutoff=float(model.r_max), skin=SKIN)
        rb = dp.compute(gb)
        out["batch"] = {"energies": rb.energy, "forces": rb.forces, "stresses": rb.stress}
    return out


@pytest.mark.parametrize("nranks", [2, 4])
def test_mace_unmodified_through_graph_storage(nranks):
    system = make_system(MACE_SPECIES)
    ref = mace_native(_mace(), system.to_ase())
    res = run_on_world(_rank_mace, nranks, nranks)
    where, gid = f"MACE graph storage P={nranks}", str(nranks)
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
    assert_parity(f, ref["forces"], grid=gid, what=f"forces {where}")
    assert_parity(s, ref["stress"], grid=gid, what=f"stress {where}")
    if nranks == 4:
        batch = [system, make_open(MACE_SPECIES)]
        refs = [mace_native(_mace(), b.to_ase(), compute_stress=False) for b in batch]
        forces = torch.cat([r["batch"]["forces"] for r in res]).split([b.n_atoms for b in batch])
        for k, rk in enumerate(refs):
            w = f"MACE batch system {k} P=4"
            assert_parity(res[0]["batch"]["energies"][k], rk["energy"][0], grid=gid, what=f"energy {w}")
            assert_parity(forces[k], rk["forces"], grid=gid, what=f"forces {w}")
        assert_parity(
            res[0]["batch"]["stresses"][0], ref["stress"], grid=gid, what="stress MACE batch system 0 P=4"
        )
        assert bool(torch.isnan(res[0]["batch"]["stresses"][1]).all())  # the open cluster: no volume


# ---------------------------------------------------------------------- validate
def test_validate_graph_storage_cli_json(capsys):
    assert main(["validate", "--potential", "mpnn", "--ranks", "3", "--storage", "graph", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rep["passed"] and rep["storage"] == "graph" and rep["ranks"] == 3
    assert rep["max_force_error"] <= 1e-9 and rep["energy_rel_error"] <= 1e-10


# ---------------------------------------------------------------------- MD
def test_md_cli_graph_storage_equals_serial(capsys):
    """``twinshard md --storage graph`` (Langevin, a small skin so the replicated-geometry list is
    rebuilt mid-run) against the serial engine of ``--check-serial``."""
    argv = "md random_packing --atoms 40 --potential mpnn --cutoff 4.0 --storage graph --ranks 3 --skin 0.1"
    argv += " --temperature 300 --steps 12 --thermostat langevin --check-serial --json"
    assert main(argv.split()) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["storage"] == "graph" and r["ranks"] == 3 and r["atoms_conserved"]
    assert r["rebuilds"] > 1 and r["owned_atoms_per_rank"] == list(balanced_counts(40, 3))
    assert r["energy_rel_error"] <= 1e-12 and r["max_stress_error"] <= 1e-10
    assert r["max_force_error"] <= 1e-10 and r["max_position_error"] <= 1e-9


def test_run_md_api_graph_storage_equals_serial():
    """``run_md(..., storage="graph")`` (2 ranks, NVE from 200 K) against the serial engine."""
    system, model = make_system(), make_model()
    out = run_md(
        system, model, ranks=2, steps=6, storage="graph", skin=0.5, initial_temperature=200.0, seed=2
    )
    start = system.clone()
    start.velocities = maxwell_boltzmann(start.masses, start.ids, 200.0, seed=2)
    eng = SerialEngine(model, start, skin=0.5)
    simulate(eng, VelocityVerlet(2.0), 6)
    order = torch.argsort(eng.system.ids)  # run_md returns the system ordered by id
    for key in ("positions", "velocities"):
        want = getattr(eng.system, key)[order]
        assert_parity(getattr(out.system, key), want, what=f"run_md graph storage {key}", grid="2")
    assert_parity(out.forces, evaluate_plain(model, eng.system).forces[order], what="run_md forces", grid="2")


def test_md_graph_storage_refuses_a_graph_contract_potential():
    with pytest.raises(ValueError, match="--storage graph runs plain-PyTorch models"):
        potential_from_config(MDConfig(potential="lj", storage="graph"), [18])


# ---------------------------------------------------------------------- bad input
def _rank_bad(case):
    model = make_model()
    me = dist.get_rank()
    try:
        if case == "disagree":  # every rank holds a batch, rank 1's differs
            mine = [make_system(), make_small()]
            if me == 1:
                mine[1].positions[0, 0] += 0.1
            GraphSharded.scatter(mine, src=None, cutoff=model.cutoff)
        elif case == "not_src":  # rank 1 passes a batch to a scatter from rank 0
            GraphSharded.scatter(make_system() if me in (0, 1) else None, cutoff=model.cutoff)
        elif case == "ids":
            s = make_system()
            s.ids[3] = -4
            GraphSharded.scatter(s if me == 0 else None, cutoff=model.cutoff)
        elif case == "species":  # an atomic number the model has no parameters for, on rank 2's block only
            s = make_system()
            s.numbers[-1] = 29
            g = GraphSharded.scatter(s if me == 0 else None, cutoff=model.cutoff, skin=SKIN)
            DistributedPotential(model, mode="dispatch").compute(g)
        elif case == "edge":  # a sender id beyond the system on rank 1 only
            g = GraphSharded.scatter(make_system() if me == 0 else None, cutoff=model.cutoff, skin=SKIN)
            if me == 1:
                g.senders[0] = g.n_total + 5
            DistributedPotential(model, mode="dispatch").compute(g)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize(
    "case,msg",
    [
        ("disagree", "the ranks disagree"),
        ("not_src", "only rank 0 holds it"),
        ("ids", "ids must be non-negative"),
        ("edge", "out of range"),
        ("species", "no parameters for some atomic numbers"),
    ],
)
def test_bad_input_raises_on_every_rank(case, msg):
    for m in run_on_world(_rank_bad, 3, case):
        assert msg in m, m


# ---------------------------------------------------------------------- negative controls
def _rank_disabled(name):
    model = make_model()
    g = GraphSharded.scatter(make_system() if dist.get_rank() == 0 else None, cutoff=model.cutoff, skin=SKIN)
    try:
        with D.REGISTRY.disabled(name):
            DistributedPotential(model, mode="dispatch").compute(g)
    except UnhandledAtomOp as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    "name,op", [("sharded_gather", "aten.index_select"), ("per_system_reduce", "aten.index_add")]
)
def test_disabled_handler_raises_naming_the_op(name, op):
    for msg in run_on_world(_rank_disabled, 2, name):
        assert op in msg, msg


@pytest.mark.parametrize(
    "plant,what",
    [("sharded_gather", "forces"), ("per_system_reduce", "energy"), ("replicated_grads", "stress")],
)
def test_negative_control_local_only_handler_fails_parity(serial_mpnn, plant, what):
    system, ref = serial_mpnn[:2]
    res = [r["graph"] for r in run_on_world(_rank_mpnn, 2, 2, plant, False)]
    actual = res[0][what] if what in ("energy", "stress") else by_id(res, what, system.ids)
    with pytest.raises(AssertionError, match=f"parity of {what} with {plant} local-only .* fails"):
        assert_parity(actual, getattr(ref, what), what=f"{what} with {plant} local-only", grid="2")
