"""Integrators, RNG keying, thermo log and trajectory output (serial)."""

import pytest
import torch
from ase import units

from twinshard.atoms.data.io import read_trajectory
from twinshard.atoms.data.structures import fcc_argon
from twinshard.atoms.dynamics.md import (
    Langevin,
    SerialEngine,
    VelocityVerlet,
    maxwell_boltzmann,
    simulate,
)
from twinshard.atoms.potentials import LennardJones
from twinshard.testing import assert_parity


def _system(seed=1, temperature=60.0):
    s = fcc_argon(2, rattle=0.05, seed=seed)  # 32 atoms
    s.velocities = maxwell_boltzmann(s.masses, s.ids, temperature, seed=seed)
    return s


def _column(out, name):
    return torch.tensor(out["thermo"].column(name), dtype=torch.float64)


def test_nve_conserves_energy_with_second_order_error():
    s = _system()
    lj = LennardJones(cutoff=6.0)
    err = {}
    for dt in (8.0, 4.0):
        out = simulate(SerialEngine(lj, s, skin=1.0), VelocityVerlet(dt), int(200 / dt))
        c = _column(out, "conserved")
        err[dt] = float((c - c[0]).abs().max())
        kin = _column(out, "kinetic")
        assert err[dt] < 0.01 * float(kin.mean())
    # halving dt divides the energy error by ~4 (velocity Verlet is second order)
    assert 3.0 < err[8.0] / err[4.0] < 5.0, err


def test_langevin_thermalises_and_keeps_conserved_quantity():
    s = _system(temperature=20.0)
    out = simulate(SerialEngine(LennardJones(cutoff=6.0), s), Langevin(4.0, 80.0, 0.1, seed=3), 100)
    temp = _column(out, "temperature")
    # 32 atoms: T fluctuates ~sqrt(2/96) = 14% per sample; the mean over 70 correlated samples
    # (relaxation time 1/gamma = 10 fs = 2.5 steps) is within 20% of the bath; it starts at 20 K
    assert abs(float(temp[30:].mean()) - 80.0) < 16.0
    c = _column(out, "conserved")
    pot, kin = _column(out, "potential"), _column(out, "kinetic")
    e = pot + kin
    # the thermostat moved the energy by far more than the conserved quantity drifted
    assert float((c - c[0]).abs().max()) < 0.02 * float((e - e[0]).abs().max())


def test_langevin_noise_is_keyed_by_atom_id_and_step():
    s = _system()
    forces = torch.randn(s.n_atoms, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 0.01
    integ = Langevin(2.0, 100.0, 0.1, seed=7)
    x, v, heat = integ.first(s.positions, s.velocities, forces, s.masses, s.ids, step=5)
    # any subset of the atoms, in any order (one rank's owned atoms after migrations),
    # gets exactly the same numbers as the serial step
    part = torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(2))[:13]
    xp, vp, heat_p = integ.first(
        s.positions[part], s.velocities[part], forces[part], s.masses[part], s.ids[part], step=5
    )
    assert torch.equal(xp, x[part]) and torch.equal(vp, v[part])
    rest = torch.tensor(sorted(set(range(s.n_atoms)) - set(part.tolist())))
    _, _, heat_r = integ.first(
        s.positions[rest], s.velocities[rest], forces[rest], s.masses[rest], s.ids[rest], step=5
    )
    assert_parity(heat_p + heat_r, heat, what="Langevin heat summed over two disjoint atom subsets")
    # the noise depends on the step, the seed and the id (not on the row)
    _, v6, _ = integ.first(s.positions, s.velocities, forces, s.masses, s.ids, step=6)
    _, vs, _ = Langevin(2.0, 100.0, 0.1, seed=8).first(
        s.positions, s.velocities, forces, s.masses, s.ids, step=5
    )
    assert not torch.equal(v6, v) and not torch.equal(vs, v)
    ids2 = s.ids.flip(0)
    _, vi, _ = integ.first(s.positions, s.velocities, forces, s.masses, ids2, step=5)
    assert not torch.equal(vi, v)


def test_maxwell_boltzmann_keyed_and_scaled():
    masses = torch.full((3000,), 39.948, dtype=torch.float64)
    ids = torch.arange(3000) * 3 + 11
    v = maxwell_boltzmann(masses, ids, 120.0, seed=4)
    assert torch.equal(maxwell_boltzmann(masses[5:9], ids[5:9], 120.0, seed=4), v[5:9])
    temp = float((masses[:, None] * v**2).sum() / (3 * 3000 * units.kB))
    assert abs(temp - 120.0) < 120.0 * 4 * (2 / 9000) ** 0.5  # 4 sigma of the sample mean
    with pytest.raises(ValueError, match="temperature"):
        maxwell_boltzmann(masses, ids, -1.0)


def test_thermo_log_trajectory_and_progress(tmp_path, capsys):
    s = _system()
    s.ids = s.ids + 1000
    thermo, traj = tmp_path / "thermo.txt", tmp_path / "traj.extxyz"
    out = simulate(
        SerialEngine(LennardJones(cutoff=6.0), s),
        VelocityVerlet(4.0),
        6,
        thermo_every=2,
        thermo_path=thermo,
        trajectory=traj,
        trajectory_every=3,
        progress=True,
    )
    assert [r["step"] for r in out["thermo"].rows] == [0, 2, 4, 6]
    lines = thermo.read_text().splitlines()
    assert lines[0].split()[1:] == ["step", "time_fs", "potential", "kinetic", "temperature", "conserved"]
    assert len(lines) == 5 and float(lines[-1].split()[1]) == pytest.approx(24.0)
    frames = read_trajectory(traj)
    assert len(frames) == 3  # steps 0, 3, 6
    assert torch.equal(frames[-1].ids, s.ids)
    assert "md" in capsys.readouterr().err  # tqdm bar on rank 0
    with pytest.raises(ValueError, match="dt"):
        VelocityVerlet(0.0)
