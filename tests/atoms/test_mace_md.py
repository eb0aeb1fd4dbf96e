"""MACE (mace-torch, unmodified) in MD, the ASE calculator, and ScaleShiftMACE through the dispatch.

- ``run_md(system, <MACE module>, ranks=2)`` equals serial MD (``SerialEngine`` over the plain
  contract, ``evaluate_plain``) at round-off: positions, velocities, potential energies per step,
  final forces and stress.
- ``twinshard md --potential mace --model FILE --check-serial`` (a model saved with ``torch.save``,
  read by mace's loader) at 2 ranks; without ``--model`` the embedded random-weight MACE; a
  species the model does not know is a clear error on every rank.
- ``TwinshardCalculator(<MACE module>)`` serial and inside a 2-rank world equals mace's own result.
- ``ScaleShiftMACE`` (the class of real saved models) at 2 and 4 ranks equals serial mace: its
  ``torch.sum(torch.stack(node_es_list, dim=0), dim=0)`` runs through the ``stack_then_sum``
  handler (values, adjoint, and the stack/cat forms that must still raise).
"""

import argparse
import json

import mace.modules  # noqa: F401 - the mace extra must be installed (CI installs it)
import pytest
import torch
import torch.distributed as dist

import twinshard.atoms as ta
from twinshard.atoms.data import structures
from twinshard.atoms.data.io import write
from twinshard.atoms.data.system import System
from twinshard.atoms.parallel.plain_inputs import evaluate_plain
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials.mace import MaceAdapter, build_mace, build_scaleshift_mace, mace_native
from twinshard.cli.md import add_md_parser, run_md
from twinshard.shard.placements import HaloPadded, HaloState, ShardSpec
from twinshard.shard.rowwise import StackedRows
from twinshard.shard.shard_tensor import ShardTensor, UnhandledAtomOp, from_local, to_local
from twinshard.testing import assert_parity, run_on_world
from twinshard.testing.checks import adjoint_pair

SKIN = 0.5


def make_system() -> System:
    s = structures.fcc_argon(repeat=2, rattle=0.25, seed=1)  # 32 atoms, periodic
    numbers = torch.tensor([1, 6, 8, 29])[
        torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(3)) % 4
    ]
    ids = torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(7)) + 500
    return System(positions=s.positions, numbers=numbers, cell=s.cell, pbc=s.pbc, ids=ids)


@pytest.fixture(scope="module")
def model():
    return build_mace()


# ---------------------------------------------------------------------- MD: run_md and the CLI
def test_run_md_with_mace_module_equals_serial(model):
    system, steps, dt, temp = make_system(), 4, 0.5, 300.0
    out = ta.run_md(
        system, model, ranks=2, steps=steps, dt=dt, initial_temperature=temp, seed=2, skin=SKIN,
        thermo_every=1,
    )  # fmt: skip
    start = system.clone()
    start.velocities = ta.maxwell_boltzmann(start.masses, start.ids, temp, seed=2)
    pot = MaceAdapter(model)
    engine = ta.SerialEngine(pot, start, skin=SKIN)
    ref_log = ta.simulate(engine, ta.VelocityVerlet(dt), steps, thermo_every=1)["thermo"]
    ref_sys = engine.system
    order = torch.argsort(ref_sys.ids)
    ref = evaluate_plain(pot, ref_sys)
    assert out.ranks == 2 and torch.equal(out.system.ids, ref_sys.ids[order])
    moved = (out.system.positions - start.positions[torch.argsort(start.ids)]).abs().max()
    assert float(moved) > 1e-4  # the atoms did move
    for name in ("positions", "velocities"):
        got, exp = getattr(out.system, name), getattr(ref_sys, name)[order]
        assert_parity(got, exp, what=f"run_md MACE {name}", grid="2")
    e_pot = torch.tensor(out.thermo.column("potential"), dtype=torch.float64)
    assert e_pot.numel() == steps + 1
    assert_parity(
        e_pot,
        torch.tensor(ref_log.column("potential"), dtype=torch.float64),
        what="run_md MACE E_pot",
        grid="2",
    )
    assert_parity(out.forces, ref.forces[order], what="run_md MACE final forces", grid="2")
    assert_parity(out.stress, ref.stress, what="run_md MACE final stress", grid="2")


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_md_parser(parser.add_subparsers())
    return parser.parse_args(["md"] + argv)


def test_cli_md_mace_saved_model_check_serial(tmp_path, model, capsys):
    structure, path = tmp_path / "mace_system.extxyz", tmp_path / "mace.model"
    write(structure, make_system())
    torch.save(model, path)  # as mace-torch saves its models (the whole module)
    argv = [str(structure), "--potential", "mace", "--model", str(path), "--ranks", "2", "--steps", "3"]
    argv += ["--dt", "0.5", "--skin", str(SKIN), "--check-serial", "--json", "--json-arrays"]
    r = run_md(_parse(argv))
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["potential"] == "mace"
    assert r["ranks"] == 2 and r["atoms"] == 32 and r["atoms_conserved"]
    assert r["energy_rel_error"] <= 1e-10 and r["max_force_error"] <= 1e-9 and r["max_stress_error"] <= 1e-9
    assert r["max_position_error"] <= 1e-9
    ref = mace_native(model, make_system().to_ase())
    assert abs(r["energy"] - float(ref["energy"][0])) <= 1e-10 * abs(float(ref["energy"][0]))


def test_cli_md_mace_default_model_and_species_error(tmp_path, capsys):
    structure = tmp_path / "mace_system.extxyz"
    write(structure, make_system())
    argv = [str(structure), "--potential", "mace", "--ranks", "2", "--steps", "1", "--skin", str(SKIN)]
    r = run_md(_parse(argv + ["--json"]))  # no --model: the embedded random-weight MACE
    ref = mace_native(build_mace(), make_system().to_ase())
    assert abs(r["energy"] - float(ref["energy"][0])) <= 1e-10 * abs(float(ref["energy"][0]))
    # the embedded default structure (argon) on the embedded default model: the random MACE is
    # built for its default species and the structure's
    r = run_md(_parse(["--atoms", "32", "--potential", "mace", "--ranks", "2", "--steps", "1", "--json"]))
    from twinshard.atoms.dynamics.driver import MDConfig, load_structure

    argon = load_structure(MDConfig(atoms=32, potential="mace"))
    ref = mace_native(build_mace(species=(1, 6, 8, 18, 29)), argon.to_ase())
    assert abs(r["energy"] - float(ref["energy"][0])) <= 1e-10 * abs(float(ref["energy"][0]))
    # argon is not one of a saved model's species: a clear error, raised on every rank together
    path = tmp_path / "hcocu.model"
    torch.save(build_mace(), path)
    with pytest.raises(Exception, match=r"no parameters for atomic numbers \[18\]"):
        run_md(
            _parse(
                ["--atoms", "32", "--potential", "mace", "--model", str(path), "--ranks", "2", "--steps", "1"]
            )
        )
    with pytest.raises(Exception, match="--model is an option of --potential mace"):
        run_md(_parse(["--atoms", "32", "--model", "x.model", "--steps", "1"]))


# ---------------------------------------------------------------------- the ASE calculator
def _calc_rank(model):
    atoms = make_system().to_ase()
    atoms.calc = ta.TwinshardCalculator(model)
    return atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress(voigt=False)


def test_ase_calculator_with_mace_serial_and_distributed(model):
    ref = mace_native(model, make_system().to_ase())
    serial = _calc_rank(model)
    results = [("serial", serial)] + [
        (f"P=2 rank {i}", o) for i, o in enumerate(run_on_world(_calc_rank, 2, model))
    ]
    for where, (energy, forces, stress) in results:
        grid = "-" if where == "serial" else "2"
        what = f"ASE calculator MACE {where}"
        assert_parity(
            torch.tensor(energy, dtype=torch.float64), ref["energy"][0], what=f"energy, {what}", grid=grid
        )
        assert_parity(torch.from_numpy(forces), ref["forces"], what=f"forces, {what}", grid=grid)
        assert_parity(torch.from_numpy(stress), ref["stress"], what=f"stress, {what}", grid=grid)
    other = make_system().to_ase()
    other.numbers[0] = 18
    other.calc = ta.TwinshardCalculator(model)
    with pytest.raises(ValueError, match=r"no parameters for atomic numbers \[18\]"):
        other.get_potential_energy()


# ---------------------------------------------------------------------- ScaleShiftMACE
def _scaleshift_rank(grid):
    model = build_scaleshift_mace()
    system = make_system() if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(system, cutoff=float(model.r_max), skin=SKIN, grid=grid)
    res = ta.DistributedPotential(MaceAdapter(model), mode="dispatch").compute(sh)
    return {
        "ids": sh.ids,
        "n_halo": sh.n_halo,
        "energy": res.energy,
        "forces": res.forces,
        "stress": res.stress,
    }


@pytest.mark.parametrize("nranks", [2, 4])
def test_scaleshift_mace_through_dispatch(nranks):
    model = build_scaleshift_mace()
    assert type(model).__name__ == "ScaleShiftMACE"
    system = make_system()
    ref = mace_native(model, system.to_ase())
    res = run_on_world(_scaleshift_rank, nranks, {2: (2, 1, 1), 4: (2, 2, 1)}[nranks])
    assert all(r["n_halo"] > 0 for r in res)
    pos = {int(i): k for k, i in enumerate(system.ids.tolist())}
    forces = torch.full((system.n_atoms, 3), float("nan"), dtype=torch.float64)
    for r in res:
        forces[torch.tensor([pos[int(i)] for i in r["ids"].tolist()])] = r["forces"]
    e, s = res[0]["energy"], res[0]["stress"]
    e_ref = ref["energy"][0]
    assert float((e - e_ref).abs() / e_ref.abs()) <= 1e-10
    assert float((forces - ref["forces"]).abs().max()) <= 1e-9
    assert float((s - ref["stress"]).abs().max()) <= 1e-9
    gid = str(nranks)
    assert_parity(e, e_ref, grid=gid, what="ScaleShiftMACE energy via dispatch")
    assert_parity(forces, ref["forces"], grid=gid, what="ScaleShiftMACE forces via dispatch")
    assert_parity(s, ref["stress"], grid=gid, what="ScaleShiftMACE stress via dispatch")


def _stack_rank():
    s = structures.fcc_argon(repeat=2, rattle=0.2, seed=1) if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(s, cutoff=3.0, skin=0.5, grid=(2, 1, 1))
    fresh = ShardSpec(HaloPadded(sh.plan), HaloState.FRESH, sh.group)
    n, me = sh.n_owned + sh.n_halo, dist.get_rank()
    g = torch.Generator().manual_seed(me)
    a, b, c = (torch.randn(n, 3, generator=g, dtype=torch.float64) for _ in range(3))
    st = torch.stack(
        [from_local(a, fresh), from_local(b, fresh), from_local(c, fresh.with_state(HaloState.STALE))]
    )
    y = torch.sum(st, dim=0)
    checks = {
        "stacked": isinstance(st, StackedRows) and tuple(st.shape) == (3, n, 3),
        "sum keeps the rows": isinstance(y, ShardTensor) and y.spec.placement == fresh.placement,
        "state combined": y.state == HaloState.STALE,
        "values": torch.equal(to_local(y), torch.stack([a, b, c]).sum(0)),
        "fresh stays fresh": torch.stack([from_local(a, fresh)] * 2).sum(0).state == HaloState.FRESH,
        # a plain operand with the block's rows is a plain per-row tensor (mace's ZBL energy): STALE
        "plain per-row operand": torch.stack([from_local(a, fresh), b]).sum(0).state == HaloState.STALE,
        "plain per-row values": torch.equal(to_local(torch.stack([from_local(a, fresh), b]).sum(0)), a + b),
    }
    adj = adjoint_pair(
        lambda z: to_local(torch.stack([from_local(z, fresh), from_local(z * 2.0, fresh)], dim=0).sum(dim=0)),
        a,
        seed=10 + me,
    )
    raised = {}
    owned = from_local(a[: sh.n_owned], fresh.owned())
    for name, fn in {
        "cat along atoms": lambda: torch.cat([from_local(a, fresh), from_local(b, fresh)], dim=0),
        "stack, other layouts": lambda: torch.stack([from_local(a, fresh), owned[:, None].expand(-1, 3)]),
        "stack with a plain tensor of other rows": lambda: torch.stack([from_local(a, fresh), b[1:]]),
        "stack of different shapes": lambda: torch.stack([from_local(a, fresh), from_local(a[:, :2], fresh)]),
        "stacked: index the new dim": lambda: torch.stack([from_local(a, fresh)] * 2)[0],
        "stacked: sum over atoms": lambda: torch.stack([from_local(a, fresh)] * 2).sum(dim=1),
        "stacked: sum of all": lambda: torch.stack([from_local(a, fresh)] * 2).sum(),
        "stacked: pointwise": lambda: torch.stack([from_local(a, fresh)] * 2) * 2.0,
        "partial state": lambda: torch.stack([from_local(a, fresh.with_state(HaloState.PARTIAL))] * 2),
    }.items():
        try:
            fn()
            raised[name] = False
        except UnhandledAtomOp:
            raised[name] = True
    return checks, adj, raised


def test_stack_then_sum_handler_values_adjoint_and_refusals():
    for checks, (lhs, rhs), raised in run_on_world(_stack_rank, 2):
        assert all(checks.values()), checks
        assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), (lhs, rhs)
        assert all(raised.values()), raised
