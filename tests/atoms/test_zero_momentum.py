"""Net momentum removal at the start (issue 22): ``zero_momentum`` (run_md, ``--zero-momentum``, an
integrator setting recorded in checkpoints; default off, so every existing trajectory and the parity
tests against ASE's thermostats keep their ``3N``). With it the run starts with zero total momentum
(the centre-of-mass velocity subtracted: ASE's ``Stationary(preserve_temperature=False)``, the
oracle) and counts ``3N - 3`` kinetic degrees of freedom (ASE's temperature with ``FixCom``; a
Nose-Hoover chain's ``N_dof``). Serial and distributed agree at round-off at 1, 2 and 3 ranks.
Negative control (tools/mutations.py ``momentum_removed_one_rank``): the momentum removed from rank
0's atoms only fails the parity and the zero-momentum check."""

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
from ase import units

from twinshard.atoms import run_md
from twinshard.atoms.data.structures import fcc_argon
from twinshard.atoms.dynamics.driver import DistributedEngine
from twinshard.atoms.dynamics.md import (
    NoseHooverChain,
    SerialEngine,
    ThermoLog,
    check_restart,
    checkpoint_state,
    kinetic_dof,
    maxwell_boltzmann,
    remove_momentum,
    simulate,
)
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials import LennardJones
from twinshard.testing import assert_parity, assert_shards_cover, rows_of, run_on_world

CUTOFF, SKIN, STEPS = 4.5, 0.5, 30  # ghost width 5.0 < 15.8 / 3: three slabs fit
COLUMNS = ThermoLog.COLUMNS


def _start():
    s = fcc_argon(3, rattle=0.05, seed=1)  # 108 atoms
    s.velocities = maxwell_boltzmann(s.masses, s.ids, 120.0, seed=4)
    return s


def _integ():
    integ = NoseHooverChain(4.0, 90.0, tdamp=40.0)
    integ.zero_momentum = True
    return integ


def _momentum(v, m):
    return (m[:, None] * v).sum(0)


def test_remove_momentum_equals_ase_stationary_and_dof():
    from ase.constraints import FixCom
    from ase.md.velocitydistribution import Stationary

    s = _start()
    atoms = s.to_ase()
    Stationary(atoms, preserve_temperature=False)
    v = remove_momentum(s.velocities, s.masses)
    want = torch.from_numpy(atoms.get_velocities())
    assert_parity(v, want, what="remove_momentum vs ASE Stationary", grid="serial")
    p_before = float(_momentum(s.velocities, s.masses).abs().max())
    assert float(_momentum(v, s.masses).abs().max()) < 1e-12 * p_before and p_before > 1e-3
    # the temperature of 3N - 3 degrees of freedom: ASE's with the centre of mass fixed
    atoms.set_constraint(FixCom())
    log = ThermoLog(s.n_atoms, n_dof=kinetic_dof(s.n_atoms, True))
    k = float(0.5 * (s.masses[:, None] * v * v).sum())
    row = log.add(0, 0.0, 0.0, k, k)
    assert row["temperature"] == pytest.approx(atoms.get_temperature(), rel=1e-13)
    assert kinetic_dof(108) == 324 and kinetic_dof(108, True) == 321 and kinetic_dof(1, True) == 1
    # the chain's N_dof follows the setting; the default keeps 3N (ASE's NoseHooverChainNVT)
    assert NoseHooverChain(4.0, 90.0).state().get("zero_momentum") is None
    eng = SerialEngine(LennardJones(cutoff=CUTOFF), s, skin=SKIN)
    integ = _integ()
    integ.bind(eng)
    assert integ.n_dof == 321 and integ.state()["zero_momentum"] is True


_SERIAL = []


def _table(log):
    return torch.tensor([[row[c] for c in COLUMNS] for row in log.rows], dtype=torch.float64)


def _serial():
    if not _SERIAL:
        engine = SerialEngine(LennardJones(cutoff=CUTOFF), _start(), skin=SKIN)
        out = simulate(engine, _integ(), STEPS)
        _SERIAL.append((_table(out["thermo"]), engine.system))
    return _SERIAL[0]


def _rank_md():
    s = _start() if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(s, cutoff=CUTOFF, skin=SKIN)
    engine = DistributedEngine(sh, DistributedPotential(LennardJones(cutoff=CUTOFF)))
    out = simulate(engine, _integ(), STEPS)
    m = engine.reduce_sum(_momentum(sh.velocities, sh.masses))
    return {
        "thermo": _table(out["thermo"]),
        "ids": sh.ids,
        "positions": sh.positions,
        "velocities": sh.velocities,
        "momentum": m,
    }


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_zero_momentum_distributed_equals_serial(ranks):
    res = run_on_world(_rank_md, ranks)
    thermo, final = _serial()
    where, grid = f"zero momentum NHC P={ranks}, {STEPS} steps", str(ranks)
    for j, name in enumerate(COLUMNS):
        assert_parity(
            res[0]["thermo"][:, j], thermo[:, j], what=f"thermo {name} per step, {where}", grid=grid
        )
    for key in ("positions", "velocities"):
        pieces = [(r[key], rows_of(r["ids"], final.ids)) for r in res]
        assert_shards_cover(pieces, getattr(final, key), f"final owned {key} {where}", disjoint=ranks > 1)
    # the total momentum stays zero (removed at the start; NHC and velocity Verlet conserve it)
    p0 = float(_momentum(_start().velocities, _start().masses).abs().max())
    assert float(res[0]["momentum"].abs().max()) < 1e-10 * p0, res[0]["momentum"]
    assert float(_momentum(final.velocities, final.masses).abs().max()) < 1e-10 * p0
    # the temperature column counts 3N - 3: the kinetic energy over (3N - 3) kB / 2
    k, t = thermo[:, COLUMNS.index("kinetic")], thermo[:, COLUMNS.index("temperature")]
    assert torch.allclose(t, 2.0 * k / (321 * units.kB), rtol=1e-14, atol=0)


def test_run_md_and_cli_zero_momentum(tmp_path, capsys):
    """run_md(zero_momentum=True) on 2 ranks (Langevin draws at temperature, the momentum removed
    once at the start; the checkpoint records the setting and a restart without it is refused) and
    ``twinshard md --zero-momentum --check-serial``."""
    ck = tmp_path / "ck.pt"
    s = fcc_argon(3, rattle=0.05, seed=2)
    out = run_md(
        s,
        LennardJones(cutoff=5.0),
        ranks=2,
        steps=2,
        initial_temperature=80.0,
        zero_momentum=True,
        thermostat="nose-hoover",
        temperature=80.0,
        checkpoint=ck,
    )
    p = _momentum(out.system.velocities, out.system.masses)
    assert float(p.abs().max()) < 1e-12
    state = torch.load(ck, weights_only=True)
    assert state["integrator"]["zero_momentum"] is True
    with pytest.raises(ValueError, match="zero_momentum: checkpoint True, now None"):
        check_restart(state, NoseHooverChain(2.0, 80.0))
    assert "zero_momentum" not in checkpoint_state(s, 0, NoseHooverChain(2.0, 80.0), 0.0)["integrator"]
    from twinshard.cli import main

    argv = "md fcc_argon --atoms 108 --cutoff 5 --temperature 80 --thermostat nose-hoover --steps 10"
    argv += " --zero-momentum --check-serial --json --json-arrays --ranks 2"
    assert main(argv.split()) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["energy_rel_error"] <= 1e-12 and r["max_position_error"] <= 1e-10, r
    v, m = np.array(r["final_velocities"]), fcc_argon(3).masses.numpy()
    assert np.abs((m[:, None] * v).sum(0)).max() < 1e-12


def test_batch_zero_momentum_per_system():
    """A batch (graph storage, 3 ranks: each system split over two) with zero_momentum=[True, False]: system 0 starts with zero
    momentum and counts 3N - 3, system 1 keeps its drawn velocities and 3N; each equals its run
    alone."""
    from twinshard.atoms.data import structures
    from twinshard.atoms.potentials.mpnn_plain import PlainMessagePassing

    kw = dict(species=(18,), cutoff=4.0, n_features=8, n_basis=6, n_layers=2, seed=3)
    systems = [
        structures.fcc_argon(repeat=2, rattle=0.1, seed=1),
        structures.fcc_argon(repeat=2, rattle=0.2, seed=2),
    ]
    outs = run_md(
        systems,
        PlainMessagePassing(**kw),
        ranks=3,
        steps=5,
        thermostat="nose-hoover",
        temperature=100.0,
        initial_temperature=100.0,
        seed=[1, 2],
        zero_momentum=[True, False],
        thermo_every=1,
        skin=0.4,
    )
    for i, out in enumerate(outs):
        s = systems[i].clone()
        s.velocities = maxwell_boltzmann(s.masses, s.ids, 100.0, seed=i + 1)
        integ = NoseHooverChain(2.0, 100.0)
        integ.zero_momentum = i == 0
        eng = SerialEngine(PlainMessagePassing(**kw), s, skin=0.4)
        rows = simulate(eng, integ, 5)["thermo"].rows
        for key in ("positions", "velocities"):
            assert_parity(
                getattr(out.system, key), getattr(eng.system, key), what=f"batch {i} {key}", grid="2"
            )
        got = torch.tensor([r["temperature"] for r in out.thermo.rows], dtype=torch.float64)
        want = torch.tensor([r["temperature"] for r in rows], dtype=torch.float64)
        assert_parity(got, want, what=f"batch {i} temperature", grid="3")
        p = float(_momentum(out.system.velocities, out.system.masses).abs().max())
        assert (p < 1e-12) == (i == 0), (i, p)
