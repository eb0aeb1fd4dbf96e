#!/usr/bin/env python
"""Stochastic cell rescaling against an outside code at the same state point: twinshard's
StochasticCellRescaling (serial engine, twinshard's LJ; each requested thermostat and coupling) vs
ASE's ``IsotropicMTKNPT`` driving ASE's own ``LennardJones`` calculator, on fcc argon (108 atoms by
default) at T and P. ASE has no stochastic cell rescaling, so the comparison is of the ensemble, not
of the trajectory: the mean volume and pressure after equilibration with their statistical errors
(block averages, 10 blocks), and the difference in units of the combined error. Prints one JSON
line; also each SCR run's effective-energy drift.

    python tools/scr_vs_ase.py [--steps 4000] [--equil 1000] [--runs langevin:iso,nose-hoover:aniso]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np


def block_mean(x: np.ndarray, blocks: int = 10) -> tuple[float, float]:
    n = len(x) // blocks * blocks
    b = x[:n].reshape(blocks, -1).mean(1)
    return float(x.mean()), float(b.std(ddof=1) / math.sqrt(blocks))


def z(x: tuple[float, float], y: tuple[float, float]) -> float:
    return abs(x[0] - y[0]) / math.sqrt(x[1] ** 2 + y[1] ** 2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--equil", type=int, default=1000)
    p.add_argument("--rep", type=int, default=3)
    p.add_argument("--temperature", type=float, default=60.0)
    p.add_argument("--pressure", type=float, default=1000.0)
    p.add_argument("--dt", type=float, default=5.0)
    p.add_argument("--tdamp", type=float, default=100.0)
    p.add_argument("--pdamp", type=float, default=1000.0, help="fs; MTK's and SCR's")
    p.add_argument("--compressibility", type=float, default=3e-4, help="SCR's beta_T, 1/bar")
    p.add_argument("--friction", type=float, default=0.01)
    p.add_argument("--cutoff", type=float, default=7.0)
    p.add_argument(
        "--runs",
        default="langevin:iso,nose-hoover:aniso,langevin:tri",
        help="thermostat:coupling,... (none: NPH-like, the particles are not thermostatted)",
    )
    a = p.parse_args()

    from ase import units
    from ase.calculators.lj import LennardJones as AseLJ
    from ase.md.nose_hoover_chain import IsotropicMTKNPT

    from twinshard.atoms.data.structures import fcc_argon
    from twinshard.atoms.dynamics.md import SerialEngine, maxwell_boltzmann, simulate
    from twinshard.atoms.dynamics.scr import StochasticCellRescaling
    from twinshard.atoms.potentials import LennardJones

    def start_velocities(s, seed):  # noqa: ANN001, ANN202
        v = maxwell_boltzmann(s.masses, s.ids, a.temperature, seed=seed)
        return v - (s.masses[:, None] * v).sum(0) / s.masses.sum()

    e = a.equil
    out: dict = {
        "atoms": 4 * a.rep**3,
        "steps": a.steps,
        "equilibration_steps": e,
        "dt_fs": a.dt,
        "temperature_K": a.temperature,
        "pressure_bar": a.pressure,
        "pdamp_fs": a.pdamp,
        "compressibility_per_bar": a.compressibility,
    }

    # the outside code: ASE's MTK with ASE's LJ
    atoms = fcc_argon(a.rep, rattle=0.0, seed=0).to_ase()
    s2 = fcc_argon(a.rep, rattle=0.0, seed=0)
    atoms.set_velocities(start_velocities(s2, 2).numpy())
    atoms.calc = AseLJ(epsilon=0.0104, sigma=3.405, rc=a.cutoff, smooth=False)
    md = IsotropicMTKNPT(
        atoms,
        timestep=a.dt * units.fs,
        temperature_K=a.temperature,
        pressure_au=a.pressure * units.bar,
        tdamp=a.tdamp * units.fs,
        pdamp=a.pdamp * units.fs,
    )
    av, ap = [], []
    t0 = time.perf_counter()
    for _ in range(a.steps):
        md.run(1)
        av.append(atoms.get_volume())
        ap.append(-np.trace(atoms.get_stress(voigt=False, include_ideal_gas=True)) / 3 / units.bar)
    out["seconds_ase"] = time.perf_counter() - t0
    ase_v, ase_p = block_mean(np.array(av[e:])), block_mean(np.array(ap[e:]))
    out["ase_mtk_mean_volume"], out["ase_mtk_mean_pressure_bar"] = ase_v, ase_p

    runs = []
    for k, spec in enumerate(a.runs.split(",")):
        thermostat, coupling = spec.split(":")
        s = fcc_argon(a.rep, rattle=0.0, seed=0)
        s.velocities = start_velocities(s, 1)
        integ = StochasticCellRescaling(
            a.dt,
            a.temperature,
            a.pressure,
            thermostat=thermostat,
            pdamp=a.pdamp,
            compressibility=a.compressibility,
            coupling=coupling,
            friction=a.friction,
            tdamp=a.tdamp,
            seed=11 + k,
        )
        t0 = time.perf_counter()
        log = simulate(SerialEngine(LennardJones(cutoff=a.cutoff), s, skin=1.0), integ, a.steps)["thermo"]
        vol, prs = np.array(log.column("volume")), np.array(log.column("pressure"))
        cons, temp = np.array(log.column("conserved")), np.array(log.column("temperature"))
        ours_v, ours_p = block_mean(vol[e + 1 :]), block_mean(prs[e + 1 :])
        runs.append(
            {
                "thermostat": thermostat,
                "coupling": coupling,
                "mean_volume": ours_v,
                "volume_diff_in_sigma": z(ours_v, ase_v),
                "volume_rel_diff": ours_v[0] / ase_v[0] - 1.0,
                "mean_pressure_bar": ours_p,
                "pressure_diff_in_sigma": z(ours_p, ase_p),
                "mean_temperature": float(temp[e + 1 :].mean()),
                "effective_energy_drift_eV": float(cons[-1] - cons[0]),
                "effective_energy_max_dev_eV": float(np.abs(cons - cons[0]).max()),
                "energy_range_eV": float(
                    np.ptp(np.array(log.column("potential")) + np.array(log.column("kinetic")))
                ),
                "seconds": time.perf_counter() - t0,
            }
        )
    out["scr"] = runs
    print(json.dumps(out))


if __name__ == "__main__":
    main()
