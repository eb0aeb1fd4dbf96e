"""The particles section of ``twinshard demo``: short distributed MD runs against serial.

:func:`demo_rows` is called on every rank of the demo world (4 ranks). Each
row runs :func:`twinshard.atoms.dynamics.driver.md_rank` with ``check_serial`` on a
small periodic liquid and reports the worst difference from the serial twin;
the rank-0 figures are broadcast so every rank returns the same rows.
"""

from __future__ import annotations

from typing import Any

import torch

from twinshard.atoms.dynamics.driver import MDConfig, md_rank

__all__ = ["demo_rows"]

_CASES = (
    ("atoms: LJ NVE 50 steps (energy, forces, stress, positions)", "lj", "none", 50),
    ("atoms: LJ Langevin 50 steps (noise keyed by atom id)", "lj", "langevin", 50),
    ("atoms: MPNN 2 layers, halo refreshed per layer, 10 steps", "mpnn", "none", 10),
)


def demo_rows() -> list[dict[str, Any]]:
    """Rows {"what", "grid", "max_abs_error", "bytes_per_rank"}; collective (every rank)."""
    from twinshard.comm import primitives as prim

    rows = []
    for what, potential, thermostat, steps in _CASES:
        cfg = MDConfig(
            structure="random_packing",
            atoms=250,
            potential=potential,
            cutoff=5.0,
            skin=0.6,
            temperature=200.0,
            dt=4.0,
            steps=steps,
            thermostat=thermostat,
            friction=0.05,
            seed=3,
            check_serial=True,
            thermo_every=steps,
        )
        r = md_rank(cfg)
        figures = torch.zeros(6, dtype=torch.float64)
        if "ranks" in r:
            errors = [
                r["max_force_error"],
                r["max_stress_error"] or 0.0,
                r["max_position_error"],
                r["energy_rel_error"] * abs(r["energy"]),
            ]
            grid = r["rank_grid"]
            figures = torch.tensor(
                [max(errors), max(r["comm_bytes_per_step_per_rank"]), r["migrations"], *grid],
                dtype=torch.float64,
            )
        figures = prim.broadcast(figures, 0, None, op="demo")
        err, nbytes, migrations = figures[:3].tolist()
        grid = "x".join(str(int(g)) for g in figures[3:].tolist())
        rows.append(
            {
                "what": f"{what}, {int(migrations)} migrations",
                "grid": grid,
                "max_abs_error": err,
                "bytes_per_rank": nbytes,
            }
        )
    return rows
