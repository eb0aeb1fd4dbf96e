"""The Python API: public names of twinshard.atoms, run_md from a plain session (local ranks) equal
to the serial run, one stress/virial convention everywhere, and the ASE calculator inside ASE's own
dynamics (VelocityVerlet, BFGS) against ASE's own Lennard-Jones calculator."""

import numpy as np
import pytest
import torch
from ase import units
from ase.calculators.lj import LennardJones as AseLJ
from ase.md.verlet import VelocityVerlet as AseVerlet
from ase.optimize import BFGS

import twinshard.atoms as ta
from twinshard.atoms.data.structures import random_packing
from twinshard.testing import assert_parity


def test_public_names_are_exported():
    assert ta.__all__ and len(set(ta.__all__)) == len(ta.__all__)
    from twinshard.atoms import api, calculator, distributed, md, potentials, sharded, system

    for name in ta.__all__:
        assert getattr(ta, name) is not None, name
    assert (
        ta.run_md is api.run_md and ta.System is system.System and ta.ShardedSystem is sharded.ShardedSystem
    )
    assert ta.LennardJones is potentials.LennardJones and ta.Langevin is md.Langevin
    assert ta.TwinshardCalculator is calculator.TwinshardCalculator
    assert ta.DistributedPotential is distributed.DistributedPotential


def _serial(system, potential, integ, steps, skin=1.0):
    engine = ta.SerialEngine(potential, system, skin=skin)
    out = ta.simulate(engine, integ, steps, thermo_every=10)
    return engine.system, out["thermo"], ta.evaluate(potential, engine.system)


@pytest.mark.parametrize("kind", ["lj-langevin-system", "mpnn-nve-atoms"])
def test_run_md_on_local_ranks_equals_serial(kind):
    system = random_packing(120, seed=2)
    if kind == "lj-langevin-system":
        pot = ta.LennardJones(cutoff=5.0)
        out = ta.run_md(
            system, pot, ranks=4, steps=30, thermostat="langevin", temperature=400.0, friction=0.05,
            seed=3, dt=4.0, initial_temperature=400.0, skin=0.6, thermo_every=10,
        )  # fmt: skip
        integ = ta.Langevin(4.0, 400.0, 0.05, seed=3)
        grid = "4"
    else:
        pot = ta.MessagePassingPotential(cutoff=4.5, energy_scale=0.01)
        atoms = system.to_ase(with_ids=False)
        out = ta.run_md(atoms, pot, ranks=2, steps=20, dt=2.0, initial_temperature=200.0, seed=3, skin=0.6)
        integ = ta.VelocityVerlet(2.0)
        grid = "2"
    start = system.clone()
    start.velocities = ta.maxwell_boltzmann(start.masses, start.ids, 400.0 if grid == "4" else 200.0, seed=3)
    ref_sys, ref_log, ref = _serial(start, pot, integ, out.steps, skin=0.6)
    assert out.ranks == int(grid) and out.system.n_atoms == 120 and torch.equal(out.system.ids, ref_sys.ids)
    for name in ("positions", "velocities"):
        assert_parity(
            getattr(out.system, name), getattr(ref_sys, name), what=f"run_md {kind} {name}", grid=grid
        )
    assert_parity(out.forces, ref.forces, what=f"run_md {kind} final forces", grid=grid)
    assert_parity(out.stress, ref.stress, what=f"run_md {kind} final stress", grid=grid)
    assert_parity(out.virial, ref.virial, what=f"run_md {kind} final virial", grid=grid)
    pot_col = torch.tensor(out.thermo.column("potential"), dtype=torch.float64)
    assert_parity(
        pot_col,
        torch.tensor(ref_log.column("potential"), dtype=torch.float64),
        what=f"run_md {kind} E_pot",
        grid=grid,
    )
    atoms = out.atoms  # ase view of the result, with forces and stress attached
    assert np.array_equal(atoms.get_forces(), out.forces.numpy())
    assert np.array_equal(atoms.positions, out.system.positions.numpy())


def test_stress_and_virial_share_one_convention():
    """virial = -dE/deps = -V stress; the virial equals sum over pairs r_ij (x) f_ij (its textbook
    definition), which fixes the sign independently of the strain derivative."""
    s = random_packing(60, seed=5)
    lj = ta.LennardJones(cutoff=5.0)
    res = ta.evaluate(lj, s)
    assert_parity(res.virial, -s.volume * res.stress, what="virial = -V stress (serial)")
    # pair sum: r_ij (x) f_ij with f_ij the force on i from j, r_ij = x_j - x_i (minimum image here)
    from twinshard.atoms.data.neighbors import neighbor_list

    e = neighbor_list(s.positions, lj.cutoff, s.cell, s.pbc)
    r = s.positions[e.senders] + e.shifts - s.positions[e.receivers]
    d = r.norm(dim=1)
    sig, eps = lj.sigma[0].detach(), lj.epsilon[0].detach()
    du = 4 * eps * (-12 * sig**12 / d**13 + 6 * sig**6 / d**7)  # dphi/dr
    f_on_i = (du / d)[:, None] * r  # = -dphi/dx_i
    w = -0.5 * (r[:, :, None] * f_on_i[:, None, :]).sum(0)  # each pair twice (both directions)
    assert_parity(res.virial, w, what="virial = -sum_pairs r_ij (x) f_ij", reduction=e.senders.numel())
    # an open box: a virial, no stress
    o = ta.System(positions=s.positions[:8], numbers=s.numbers[:8])
    ro = ta.evaluate(lj, o)
    assert ro.stress is None and ro.virial is not None and ro.virial.shape == (3, 3)
    # the distributed evaluator: both, replicated, equal to serial
    out = ta.run_md(s, lj, ranks=2, steps=0, skin=0.0)
    assert_parity(out.stress, res.stress, what="distributed stress", grid="2")
    assert_parity(out.virial, res.virial, what="distributed virial", grid="2")


def _argon_cluster(n=4):
    import ase.build

    atoms = ase.build.bulk("Ar", "fcc", a=5.3, cubic=True).repeat((n, n, n))
    rng = np.random.default_rng(0)
    atoms.positions += rng.normal(scale=0.1, size=atoms.positions.shape)
    return atoms


def test_calculator_inside_ase_dynamics_matches_ase_lj():
    eps, sig, rc = 0.0104, 3.405, 8.0
    ours = _argon_cluster(3)
    ref = ours.copy()
    ours.calc = ta.TwinshardCalculator(ta.LennardJones({18: (eps, sig)}, cutoff=rc))
    ref.calc = AseLJ(epsilon=eps, sigma=sig, rc=rc, smooth=False)
    for a in (ours, ref):
        a.set_momenta(np.zeros_like(a.positions))
        AseVerlet(a, timestep=5 * units.fs).run(10)
    assert_parity(
        torch.tensor(ours.positions), torch.tensor(ref.positions), what="ASE VelocityVerlet, 10 steps"
    )
    assert_parity(
        torch.tensor(ours.get_forces()), torch.tensor(ref.get_forces()), what="ASE VelocityVerlet forces"
    )
    assert_parity(torch.tensor(ours.get_stress()), torch.tensor(ref.get_stress()), what="ASE stress (Voigt)")
    for a in (ours, ref):
        BFGS(a, logfile=None).run(fmax=1e-3, steps=8)
    assert_parity(torch.tensor(ours.positions), torch.tensor(ref.positions), what="ASE BFGS, 8 steps")
    e = [torch.tensor(a.get_potential_energy(), dtype=torch.float64) for a in (ours, ref)]
    assert_parity(e[0], e[1], what="ASE BFGS energy")


_TORCHRUN_SCRIPT = """
import json
import numpy as np
import torch
import torch.distributed as dist
from ase import units
from ase.md.verlet import VelocityVerlet
from ase.optimize import BFGS
import twinshard.atoms as ta
from twinshard.runtime import init_world

world = init_world()
import ase.build
atoms = ase.build.bulk("Ar", "fcc", a=5.3, cubic=True).repeat((3, 3, 3))
atoms.positions += np.random.default_rng(0).normal(scale=0.1, size=atoms.positions.shape)
lj = ta.LennardJones(cutoff=6.0)
dist_atoms, serial_atoms = atoms.copy(), atoms.copy()
dist_atoms.calc = ta.TwinshardCalculator(lj)  # a world of 2 ranks: distributed by default
serial_atoms.calc = ta.TwinshardCalculator(lj, distributed=False)
out = {}
for name, a in (("dist", dist_atoms), ("serial", serial_atoms)):
    a.set_momenta(np.zeros_like(a.positions))
    VelocityVerlet(a, timestep=5 * units.fs).run(6)
    out[name + "_verlet"] = a.positions.tolist()
    BFGS(a, logfile=None).run(fmax=1e-3, steps=5)
    out[name + "_bfgs"] = a.positions.tolist()
    out[name + "_stress"] = a.get_stress().tolist()
res = ta.run_md(atoms, lj, steps=8, thermostat="langevin", temperature=100.0, seed=1, initial_temperature=100.0)
out["run_md_ranks"] = res.ranks
if world.rank == 0:
    out["run_md_positions"] = res.system.positions.tolist()
    print("RESULT " + json.dumps(out), flush=True)
else:
    assert res.system is None and len(res.thermo.rows) == 2
"""


def test_calculator_in_ase_dynamics_and_run_md_under_torchrun(tmp_path):
    import json
    import os
    import shutil
    import subprocess
    import sys

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    script = tmp_path / "script.py"
    script.write_text(_TORCHRUN_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]  # the group is destroyed at exit
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1  # rank 0 only
    out = json.loads(lines[0][7:])
    for what in ("verlet", "bfgs", "stress"):
        a, b = (torch.tensor(out[f"{k}_{what}"], dtype=torch.float64) for k in ("dist", "serial"))
        assert_parity(a, b, what=f"ASE {what} with the distributed calculator (torchrun)", grid="2")
    # run_md used the launched world (2 ranks) and equals the serial Langevin run
    assert out["run_md_ranks"] == 2
    import ase.build

    atoms = ase.build.bulk("Ar", "fcc", a=5.3, cubic=True).repeat((3, 3, 3))
    atoms.positions += np.random.default_rng(0).normal(scale=0.1, size=atoms.positions.shape)
    start = ta.System.from_ase(atoms)
    start.velocities = ta.maxwell_boltzmann(start.masses, start.ids, 100.0, seed=1)
    ref, _, _ = _serial(start, ta.LennardJones(cutoff=6.0), ta.Langevin(2.0, 100.0, 0.01, seed=1), 8)
    got = torch.tensor(out["run_md_positions"], dtype=torch.float64)
    assert_parity(got, ref.positions, what="run_md under torchrun positions", grid="2")
