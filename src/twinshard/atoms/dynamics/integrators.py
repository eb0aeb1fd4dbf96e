"""Integrators: velocity Verlet (NVE), Langevin BAOAB and Nose-Hoover chains (NVT),
Maxwell-Boltzmann velocities.

They act on plain per-atom tensors of *a set of atoms given by their global ids* (positions,
velocities, forces, masses, ids): the serial run passes all atoms, a distributed run passes each
rank's owned atoms, and the arithmetic per atom is identical. Random draws come from
:mod:`twinshard.rng` keyed by ``(seed, stream, global atom id, step, component)``, so a
distributed trajectory equals the serial one exactly, for any rank count and any migration
history. Units are ASE's; ``dt`` in fs, friction in 1/fs, temperature in K. The time loop that
drives them is :func:`twinshard.atoms.dynamics.md.simulate`, which first calls ``bind(engine)``: an
integrator that needs a global value (the Nose-Hoover chain: the total kinetic energy) takes the
engine's ``reduce_sum`` and ``rank`` there. An integrator's ``state()`` holds its settings (a
restart must match them) and, named in ``dynamic``, the variables it carries from step to step
(stored in checkpoints, restored by ``load_state``).
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
    "NoseHooverChain",
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
    dynamic: tuple[str, ...] = ()  # state() entries that change during a run (none here)

    def __init__(self, dt: float = 2.0) -> None:
        if not dt > 0:
            raise ValueError(f"dt must be positive (fs), got {dt}")
        self.dt_fs = float(dt)
        self.dt = float(dt) * units.fs

    def bind(self, engine: Any) -> None:
        """Called by :func:`~twinshard.atoms.dynamics.md.simulate` before the first step (nothing here)."""

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore the ``dynamic`` entries of a :meth:`state` (nothing here)."""

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


def _serial_sum(x: torch.Tensor) -> torch.Tensor:
    return x


# Suzuki-Yoshida weights of the thermostat propagator (Yoshida, Phys. Lett. A 150, 262 (1990)):
# 1 (second order), 3 (fourth order, ASE's), 5 (Suzuki's fourth-order fractal, MTTK's n_sy = 5)
_W3 = 1.0 / (2.0 - 2.0 ** (1.0 / 3.0))
_W5 = 1.0 / (4.0 - 4.0 ** (1.0 / 3.0))
SUZUKI_YOSHIDA = {
    1: (1.0,),
    3: (_W3, 1.0 - 2.0 * _W3, _W3),
    5: (_W5, _W5, 1.0 - 4.0 * _W5, _W5, _W5),
}


class NoseHooverChain(VelocityVerlet):
    """Nose-Hoover chain NVT (Martyna, Klein and Tuckerman, J. Chem. Phys. 97, 2635 (1992)).

    One step is ``NHC(dt/2) B(dt/2) A(dt) B(dt/2) NHC(dt/2)``: velocity Verlet between two
    half-steps of the chain, each the Trotter factorised propagator with ``tloop`` sub-steps and
    Suzuki-Yoshida weights of Martyna, Tuckerman, Tobias and Klein, Mol. Phys. 87, 1117 (1996),
    as in ASE's ``NoseHooverChainNVT`` (the same operator order, so the trajectories agree to
    round-off). ``first`` = NHC, B, A; ``second`` = B, NHC.

    Thermostat masses ``Q_1 = N_dof kT tdamp^2``, ``Q_k = kT tdamp^2`` with ``N_dof = 3 N``
    (no 3 subtracted for the conserved momentum: ASE's convention, and the thermo log's
    temperature). The chain (``eta``, ``p_eta``: Python floats) is replicated: every rank
    updates it from the same global kinetic energy, so all ranks scale their velocities by the
    same factor and a distributed trajectory equals the serial one. The kinetic energy changes
    inside a half-step only by that scaling, so it is tracked as ``K * s^2``: one ``reduce_sum``
    per half-step, two all-reduces of one scalar per MD step. (The first could reuse the second
    of the previous step; recomputing keeps every step a function of the stored state alone, so a
    restart repeats the uninterrupted run's arithmetic.)

    The conserved quantity is the extended energy ``E_pot + E_kin + sum_k p_eta_k^2 / (2 Q_k)
    + N_dof kT eta_1 + kT sum_{k>1} eta_k``: each half-step returns minus the change of the
    chain's energy as heat (on rank 0 only, so the sum of the ranks' heat counts it once), and
    the thermo log's ``E_pot + E_kin - heat`` is that quantity. ``eta`` and ``p_eta`` are in
    :meth:`state` (a checkpoint restores them); a restart compares only the settings.

    Args:
        dt: time step in fs.
        temperature: bath temperature in K.
        tdamp: thermostat time scale in fs (default ``100 dt``).
        chain: number of thermostats in the chain (default 3).
        tloop: sub-steps per thermostat half-step (default 1).
        sy: Suzuki-Yoshida weights per sub-step, 1, 3 or 5 (default 3).
    """

    thermostat = True
    dynamic = ("eta", "p_eta")

    def __init__(
        self,
        dt: float = 2.0,
        temperature: float = 300.0,
        tdamp: float | None = None,
        chain: int = 3,
        tloop: int = 1,
        sy: int = 3,
    ) -> None:
        super().__init__(dt)
        tdamp = 100.0 * self.dt_fs if tdamp is None else float(tdamp)
        if temperature < 0 or not tdamp > 0:
            raise ValueError(f"temperature must be >= 0 K and tdamp > 0 fs, got {temperature}, {tdamp}")
        if int(chain) < 1 or int(tloop) < 1 or int(sy) not in SUZUKI_YOSHIDA:
            raise ValueError(f"chain and tloop must be >= 1 and sy 1, 3 or 5, got {chain}, {tloop}, {sy}")
        self.temperature, self.tdamp_fs = float(temperature), tdamp
        self.chain, self.tloop, self.sy = int(chain), int(tloop), int(sy)
        self.kT = units.kB * self.temperature
        self.eta = [0.0] * self.chain
        self.p_eta = [0.0] * self.chain
        self.n_dof = 0  # 3 N: set by bind (or, unbound, by the first half-step)
        self._reduce_sum: Any = _serial_sum  # until bound to an engine
        self._rank = 0

    def bind(self, engine: Any) -> None:
        self._reduce_sum, self._rank = engine.reduce_sum, int(engine.rank)
        self.n_dof = 3 * int(engine.n_atoms)

    def energy(self) -> float:
        """The chain's share of the extended energy (eV)."""
        q = self._masses()
        e = sum(p * p / (2.0 * qk) for p, qk in zip(self.p_eta, q))
        return e + self.n_dof * self.kT * self.eta[0] + self.kT * sum(self.eta[1:])

    def _masses(self) -> list[float]:
        q1 = self.kT * (self.tdamp_fs * units.fs) ** 2
        return [self.n_dof * q1] + [q1] * (self.chain - 1)

    def _twice_kinetic(self, velocities: torch.Tensor, masses: torch.Tensor) -> float:
        # the GLOBAL sum of m v^2: every rank drives the chain with the same number
        return float(self._reduce_sum(2.0 * kinetic_energy(velocities, masses)))

    def _half_step(self, velocities: torch.Tensor, masses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """exp(iL_NHC dt/2) on the velocities; returns them and minus the chain's energy change."""
        if self.n_dof == 0:
            self.n_dof = 3 * velocities.shape[0]  # unbound: a serial caller's atoms are all atoms
        before = self.energy()
        mv2 = self._twice_kinetic(velocities, masses)
        q, m, eta, p = self._masses(), self.chain, self.eta, self.p_eta
        g0 = self.n_dof * self.kT

        def kick(j: int, d: float) -> None:  # p_eta_j by d/2, between two scalings by p_eta_{j+1}
            g = mv2 - g0 if j == 0 else p[j - 1] * p[j - 1] / q[j - 1] - self.kT
            f = math.exp(-0.25 * d * p[j + 1] / q[j + 1]) if j < m - 1 else 1.0
            p[j] = (p[j] * f + 0.5 * d * g) * f

        scale = 1.0
        for _ in range(self.tloop):
            for w in SUZUKI_YOSHIDA[self.sy]:
                d = w * 0.5 * self.dt / self.tloop
                for j in range(m - 1, -1, -1):
                    kick(j, d)
                eta[:] = [e + d * pk / qk for e, pk, qk in zip(eta, p, q)]
                a = math.exp(-d * p[0] / q[0])
                scale, mv2 = scale * a, mv2 * a * a  # the kinetic energy scales with v
                for j in range(m):
                    kick(j, d)
        heat = before - self.energy() if self._rank == 0 else 0.0
        return velocities * scale, torch.tensor(heat, dtype=velocities.dtype, device=velocities.device)

    def first(
        self,
        positions: torch.Tensor,
        velocities: torch.Tensor,
        forces: torch.Tensor,
        masses: torch.Tensor,
        ids: torch.Tensor,
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        v, heat = self._half_step(velocities, masses)
        x, v, _ = super().first(positions, v, forces, masses, ids, step)
        return x, v, heat

    def second(
        self,
        velocities: torch.Tensor,
        forces: torch.Tensor,
        masses: torch.Tensor,
        ids: torch.Tensor,
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        v, _ = super().second(velocities, forces, masses, ids, step)
        return self._half_step(v, masses)

    def state(self) -> dict[str, Any]:
        return {
            "kind": "nose-hoover",
            "dt_fs": self.dt_fs,
            "temperature": self.temperature,
            "tdamp_fs": self.tdamp_fs,
            "chain": self.chain,
            "tloop": self.tloop,
            "sy": self.sy,
            "eta": list(self.eta),
            "p_eta": list(self.p_eta),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        for name in self.dynamic:
            values = [float(v) for v in state.get(name, ())]
            if len(values) != self.chain:
                raise ValueError(
                    f"the checkpoint holds no Nose-Hoover chain of length {self.chain} ({name}: "
                    f"{len(values)} values): it was not written by this thermostat"
                )
            setattr(self, name, values)
