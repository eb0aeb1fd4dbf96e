"""Integrators: velocity Verlet (NVE) and Langevin BAOAB (NVT), Maxwell-Boltzmann velocities.

They act on plain per-atom tensors of *a set of atoms given by their global ids* (positions,
velocities, forces, masses, ids): the serial run passes all atoms, a distributed run passes each
rank's owned atoms, and the arithmetic per atom is identical. Random draws come from
:mod:`twinshard.rng` keyed by ``(seed, stream, global atom id, step, component)``, so a
distributed trajectory equals the serial one exactly, for any rank count and any migration
history. Units are ASE's; ``dt`` in fs, friction in 1/fs, temperature in K. The time loop that
drives them is :func:`twinshard.atoms.md.simulate`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from ase import units

from twinshard import rng

__all__ = [
    "LANGEVIN_STREAM",
    "VELOCITY_STREAM",
    "Langevin",
    "VelocityVerlet",
    "kinetic_energy",
    "maxwell_boltzmann",
]

LANGEVIN_STREAM = 0x4C414E47  # "LANG": Langevin noise stream of the counter-based RNG
VELOCITY_STREAM = 0x56454C30  # "VEL0": initial Maxwell-Boltzmann velocities


def _keys(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    comp = torch.arange(3, dtype=torch.int64, device=ids.device)
    return ids.to(torch.int64)[:, None], comp[None, :]


def kinetic_energy(velocities: torch.Tensor, masses: torch.Tensor) -> torch.Tensor:
    """Sum of 1/2 m v^2 over the given atoms (a local partial sum when distributed)."""
    return 0.5 * (masses[:, None] * velocities * velocities).sum()


def maxwell_boltzmann(
    masses: torch.Tensor, ids: torch.Tensor, temperature: float, seed: int = 0
) -> torch.Tensor:
    """Velocities ``sqrt(kB T / m) * N(0, 1)`` keyed by (seed, global id, component).

    The same atom gets the same velocity on any rank. No centre-of-mass
    correction (that would need a global sum; the driver can subtract one).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 K, got {temperature}")
    ida, comp = _keys(ids)
    xi = rng.normal(seed, VELOCITY_STREAM, ida, comp, dtype=masses.dtype, device=masses.device)
    return torch.sqrt(units.kB * temperature / masses)[:, None] * xi


class VelocityVerlet:
    """NVE velocity Verlet. ``first``: half kick + drift; ``second``: half kick.

    Args:
        dt: time step in fs.
    """

    thermostat = False

    def __init__(self, dt: float = 2.0) -> None:
        if not dt > 0:
            raise ValueError(f"dt must be positive (fs), got {dt}")
        self.dt_fs = float(dt)
        self.dt = float(dt) * units.fs

    def first(
        self,
        positions: torch.Tensor,
        velocities: torch.Tensor,
        forces: torch.Tensor,
        masses: torch.Tensor,
        ids: torch.Tensor,
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns new positions, velocities and the heat exchanged (always 0 here)."""
        v = velocities + (0.5 * self.dt) * forces / masses[:, None]
        x = positions + self.dt * v
        return x, v, torch.zeros((), dtype=velocities.dtype, device=velocities.device)

    def second(
        self,
        velocities: torch.Tensor,
        forces: torch.Tensor,
        masses: torch.Tensor,
        ids: torch.Tensor,
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        v = velocities + (0.5 * self.dt) * forces / masses[:, None]
        return v, torch.zeros((), dtype=velocities.dtype, device=velocities.device)

    def state(self) -> dict[str, Any]:
        """The settings a restart must match (plain values, stored in checkpoints)."""
        return {"kind": "nve", "dt_fs": self.dt_fs}


class Langevin(VelocityVerlet):
    """Langevin dynamics, BAOAB splitting (Leimkuhler and Matthews, 2013).

    ``first`` = B (half kick), A (half drift), O (exact Ornstein-Uhlenbeck
    step), A (half drift); ``second`` = B. The O step's noise for atom ``id``
    at ``step`` and component ``c`` is ``normal(seed, LANGEVIN_STREAM, id,
    step, c)``; the kinetic energy it adds is returned as heat, so the
    conserved quantity ``E_pot + E_kin - sum(heat)`` is flat up to the
    integrator error.

    Args:
        dt: time step in fs.
        temperature: bath temperature in K.
        friction: collision rate gamma in 1/fs.
        seed: noise seed.
    """

    thermostat = True

    def __init__(
        self, dt: float = 2.0, temperature: float = 300.0, friction: float = 0.01, seed: int = 0
    ) -> None:
        super().__init__(dt)
        if temperature < 0 or friction < 0:
            raise ValueError("temperature and friction must be >= 0")
        self.temperature = float(temperature)
        self.friction = float(friction)
        self.seed = int(seed)
        self.c1 = math.exp(-self.friction * self.dt_fs)
        self.c2 = math.sqrt(1.0 - self.c1 * self.c1)

    def first(
        self,
        positions: torch.Tensor,
        velocities: torch.Tensor,
        forces: torch.Tensor,
        masses: torch.Tensor,
        ids: torch.Tensor,
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m = masses[:, None]
        v = velocities + (0.5 * self.dt) * forces / m
        x = positions + (0.5 * self.dt) * v
        ida, comp = _keys(ids)
        xi = rng.normal(self.seed, LANGEVIN_STREAM, ida, int(step), comp, dtype=v.dtype, device=v.device)
        sigma = torch.sqrt(units.kB * self.temperature / m)
        v_new = self.c1 * v + self.c2 * sigma * xi
        heat = kinetic_energy(v_new, masses) - kinetic_energy(v, masses)
        x = x + (0.5 * self.dt) * v_new
        return x, v_new, heat

    def state(self) -> dict[str, Any]:
        return {
            "kind": "langevin",
            "dt_fs": self.dt_fs,
            "temperature": self.temperature,
            "friction": self.friction,
            "seed": self.seed,
        }
