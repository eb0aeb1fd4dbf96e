"""Integrators: velocity Verlet (NVE), Langevin BAOAB and Nose-Hoover chains (NVT), the isotropic
MTK barostat with Nose-Hoover chains (NPT), Maxwell-Boltzmann velocities.

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

Net momentum (``zero_momentum``, an integrator setting, default off): with it, the run starts by
removing the centre-of-mass velocity from every atom (:func:`remove_momentum`, ASE's
``Stationary(atoms, preserve_temperature=False)``: one global sum, so every rank removes the same
velocity) and the kinetic degrees of freedom are counted as ``3N - 3``
(:func:`kinetic_dof`; ASE's temperature with a ``FixCom`` constraint): in the thermo log's
temperature and in a Nose-Hoover chain's (and MTK's) ``N_dof``. Off (the default) keeps ``3N`` and the
velocities as given, the convention of ASE's ``NoseHooverChainNVT`` / ``IsotropicMTKNPT``, which
the parity tests against ASE and every existing trajectory follow. A restart must match it (it is
in :meth:`state` when on).
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
    "IsotropicMTK",
    "Langevin",
    "NoseHooverChain",
    "VelocityVerlet",
    "kinetic_energy",
    "maxwell_boltzmann",
    "kinetic_dof",
    "remove_momentum",
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


def kinetic_dof(n_atoms: int, zero_momentum: bool = False) -> int:
    """The kinetic degrees of freedom of ``n_atoms``: ``3N - 3`` when the net momentum is removed
    (and conserved), else ``3N`` (at least 1 for a non-empty system)."""
    n = 3 * int(n_atoms)
    return max(n - 3, 1 if n else 0) if zero_momentum else n


def remove_momentum(velocities: torch.Tensor, masses: torch.Tensor, reduce_sum: Any = None) -> torch.Tensor:
    """``v - sum(m v) / sum(m)``: the velocities with zero total momentum (ASE's
    ``Stationary(preserve_temperature=False)``). ``velocities``/``masses`` are this rank's atoms
    (``Shard(0)``; all atoms serially); ``reduce_sum`` sums over the ranks (one all-reduce of 4
    numbers, fp64; identity serially), so every rank subtracts the same centre-of-mass velocity.
    Out: the same placement as ``velocities``."""
    local = torch.cat([(masses[:, None] * velocities).sum(0), masses.sum().reshape(1)]).to(torch.float64)
    total = local if reduce_sum is None else reduce_sum(local)
    v_com = (total[:3] / total[3]) if float(total[3]) > 0 else torch.zeros_like(total[:3])
    return velocities - v_com.to(velocities)


class VelocityVerlet:
    """NVE velocity Verlet. ``first``: half kick + drift; ``second``: half kick.

    Args:
        dt: time step in fs.
    """

    thermostat = False
    dynamic: tuple[str, ...] = ()  # state() entries that change during a run (none here)
    zero_momentum = False  # a setting (module docstring): set on the object, recorded in state()

    def _settings(self) -> dict[str, Any]:
        """Settings common to every integrator (in :meth:`state` only when not the default, so
        the checkpoints of runs without them are unchanged)."""
        return {"zero_momentum": True} if self.zero_momentum else {}

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
        return {"kind": "nve", "dt_fs": self.dt_fs, **self._settings()}


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
            **self._settings(),
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
    temperature; ``3N - 3`` with ``zero_momentum``, see the module docstring). The chain (``eta``, ``p_eta``: Python floats) is replicated: every rank
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
        self.n_dof = kinetic_dof(engine.n_atoms, self.zero_momentum)

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

    def _half_step(
        self, velocities: torch.Tensor, masses: torch.Tensor, mv2: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """exp(iL_NHC dt/2) on the velocities; returns them and minus the chain's energy change.
        ``mv2``: the global sum of m v^2 when the caller has it (else one ``reduce_sum``); that of
        the result is left in ``_mv2``."""
        if self.n_dof == 0:
            # unbound: a serial caller's atoms are all atoms
            self.n_dof = kinetic_dof(velocities.shape[0], self.zero_momentum)
        before = NoseHooverChain.energy(self)
        mv2 = self._twice_kinetic(velocities, masses) if mv2 is None else mv2
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
        self._mv2 = mv2
        heat = before - NoseHooverChain.energy(self) if self._rank == 0 else 0.0
        return velocities * scale, torch.tensor(heat, dtype=velocities.dtype, device=velocities.device)

    def half_step(self, velocities: torch.Tensor, masses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """exp(iL_NHC dt/2) on the velocities (one ``reduce_sum``): the scaled velocities and the
        heat (rank 0). A barostat that brings its own step composes the chain from this."""
        return self._half_step(velocities, masses)

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
            **self._settings(),
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


def exprel(x: float) -> float:
    """``(exp(x) - 1) / x``, 1 at 0 (without the cancellation of the naive formula)."""
    return math.expm1(x) / x if x != 0.0 else 1.0


class IsotropicMTK(NoseHooverChain):
    """NPT: the isotropic Martyna-Tobias-Klein barostat with Nose-Hoover chains on the particles
    and on the barostat (Martyna, Tobias and Klein, J. Chem. Phys. 101, 4177 (1994); the
    factorisation of Tuckerman, Alejandre, Lopez-Rendon, Jochim and Martyna, J. Phys. A 39, 5629
    (2006)), as in ASE's ``IsotropicMTKNPT`` (the same operator order, masses and variables, so the
    two trajectories agree to round-off: an outside oracle step by step, not only in the mean).

    Why MTK and not stochastic cell rescaling (Bernetti and Bussi, 2020): MTK is deterministic,
    time-reversible and has a conserved extended energy, so a distributed run can be checked
    against the serial run *and* against an outside implementation (ASE's) at round-off every step;
    a stochastic barostat could only be checked against an outside code statistically. It samples
    the isothermal-isobaric ensemble exactly (the ``1 + 1/N`` terms of MTK, which plain
    Hoover/Melchionna barostats lack).

    Variables: ``eps = ln(V / V0) / 3`` and its momentum ``p_eps`` (barostat mass
    ``W = (3N + 3) kT pdamp^2``), the barostat's chain ``xi``, ``p_xi`` (masses ``9 kT pdamp^2``,
    then ``kT pdamp^2``), the particles' chain ``eta``, ``p_eta`` (as :class:`NoseHooverChain`),
    and the reference cell ``cell0`` (the cell at the start of the first run): the cell is
    ``cell0 exp(eps)``, so a restart recomputes it bit for bit. One step is
    ``NHC_baro(dt/2) NHC(dt/2) P_eps(dt/2) P(dt/2) Q(dt) Q_eps(dt) | forces |
    P(dt/2) P_eps(dt/2) NHC(dt/2) NHC_baro(dt/2)`` with
    ``Q: x <- x e^a + v dt exprel(a)``, ``a = dt p_eps / W``,
    ``P: v <- v e^-b + (dt/2) F/m exprel(-b)``, ``b = (1 + 1/N) (dt/2) p_eps / W``,
    ``P_eps: p_eps += (dt/2) [tr(virial) + (1 + 1/N) sum m v^2 - 3 V P_ext]``.

    Under decomposition: every rank holds the same scalars (``eps``, ``p_eps``, the two chains,
    ``cell0``) and updates them from the same agreed values: the virial, all-reduced by the
    distributed potential with the energy (no extra collective), and the global ``sum m v^2``: one
    ``reduce_sum`` of a scalar per half-step (the first half-step's chain tracks it under its
    scaling, the second half-step's chain reuses the one ``P_eps`` needed), so the same two
    all-reduces per step as the NVT chain. The cell goes to the engine with ``set_cell`` on every
    rank (replicated arithmetic, no communication); the positions and velocities of each rank's
    owned atoms are scaled by the same factors. The engine's partition follows the cell at once;
    its halo plan and neighbour lists are rebuilt (and atoms migrate) only when the skin no longer
    covers the strain and the non-affine motion since the last build
    (:meth:`~twinshard.atoms.parallel.sharded.ShardedSystem.update`).

    Conserved: ``E_pot + E_kin + E_chain + E_baro_chain + p_eps^2 / (2W) + P_ext V``; each
    half-step returns minus the change of the non-particle terms as heat (rank 0 only).
    The thermo log gets ``volume`` (A^3) and ``pressure`` (bar, the instantaneous
    ``(tr(virial) + 2 E_kin) / (3V)``).

    Needs a cell periodic along all three axes (raised by :meth:`bind` on every rank).

    Args:
        dt: time step in fs.
        temperature: bath temperature in K.
        pressure: external pressure in bar.
        tdamp: thermostat time scale in fs (default ``100 dt``).
        pdamp: barostat time scale in fs (default ``1000 dt``).
        chain, pchain: thermostat and barostat chain lengths (default 3).
        tloop, ploop: their sub-steps per half-step (default 1).
    """

    barostat = True
    dynamic = ("eta", "p_eta", "xi", "p_xi", "eps", "p_eps", "cell0")

    def __init__(
        self,
        dt: float = 2.0,
        temperature: float = 300.0,
        pressure: float = 1.01325,
        tdamp: float | None = None,
        pdamp: float | None = None,
        chain: int = 3,
        pchain: int = 3,
        tloop: int = 1,
        ploop: int = 1,
    ) -> None:
        super().__init__(dt, temperature, tdamp, chain, tloop, sy=3)
        pdamp = 1000.0 * self.dt_fs if pdamp is None else float(pdamp)
        if not (pdamp > 0 and math.isfinite(pdamp)):
            raise ValueError(f"the pressure coupling time pdamp must be > 0 fs, got {pdamp}")
        if not math.isfinite(float(pressure)):
            raise ValueError(f"pressure must be a finite number of bar, got {pressure}")
        if not self.temperature > 0:
            raise ValueError(f"an MTK barostat needs a temperature > 0 K, got {temperature}")
        if int(pchain) < 1 or int(ploop) < 1:
            raise ValueError(f"pchain and ploop must be >= 1, got {pchain}, {ploop}")
        self.pressure_bar, self.pdamp_fs = float(pressure), pdamp
        self.pchain, self.ploop = int(pchain), int(ploop)
        self.p_ext = self.pressure_bar * units.bar  # eV / A^3
        self.xi = [0.0] * self.pchain
        self.p_xi = [0.0] * self.pchain
        self.eps = [0.0]
        self.p_eps = [0.0]
        self.cell0 = [0.0] * 9  # zeros: not set yet (bind takes the engine's cell)
        self._engine: Any = None
        self._mv2 = 0.0  # the global sum m v^2 after the last thermostat half-step

    # ---------------------------------------------------------------- setup
    def bind(self, engine: Any) -> None:
        super().bind(engine)
        pbc = [bool(p) for p in torch.as_tensor(engine.pbc).tolist()]
        if not all(pbc):
            raise ValueError(
                f"a barostat needs a cell periodic along all three axes, got pbc={pbc}: run NVT/NVE "
                "(no --pressure) for a slab, wire or molecule"
            )
        if not getattr(engine, "cell_can_change", True):
            raise ValueError(
                f"a barostat changes the cell, which this engine ({type(engine).__name__}) cannot"
            )
        if not any(self.cell0):  # a fresh run: the reference cell is the start cell
            self.cell0 = [float(c) for c in engine.cell.detach().double().cpu().reshape(9).tolist()]
        if abs(float(torch.linalg.det(self._cell0()))) == 0.0:
            raise ValueError("a barostat needs a cell with a volume (its lattice vectors are coplanar)")
        self._engine = engine
        engine.need_virial = True

    def _cell0(self) -> torch.Tensor:
        return torch.tensor(self.cell0, dtype=torch.float64).reshape(3, 3)

    def cell(self) -> torch.Tensor:
        """``cell0 exp(eps)`` (fp64, CPU): the same bits on every rank and after a restart."""
        return self._cell0() * math.exp(self.eps[0])

    def volume(self) -> float:
        return abs(float(torch.linalg.det(self._cell0()))) * math.exp(3.0 * self.eps[0])

    @property
    def W(self) -> float:  # noqa: N802 (the paper's name)
        return (self.n_dof + 3) * self.kT * (self.pdamp_fs * units.fs) ** 2

    def _baro_masses(self) -> list[float]:
        r = self.kT * (self.pdamp_fs * units.fs) ** 2
        return [9.0 * r] + [r] * (self.pchain - 1)

    def energy(self) -> float:
        """Everything of the extended energy but the particles' (eV): both chains, the barostat's
        kinetic energy and ``P_ext V``."""
        r = self._baro_masses()
        baro = sum(p * p / (2.0 * rk) for p, rk in zip(self.p_xi, r)) + self.kT * sum(self.xi)
        pe = self.p_eps[0]
        return super().energy() + baro + pe * pe / (2.0 * self.W) + self.p_ext * self.volume()

    # ---------------------------------------------------------------- operators
    def _baro_chain(self) -> None:
        """exp(iL_NHC-baro dt/2) on p_eps (replicated scalars only)."""
        r, m, xi, p = self._baro_masses(), self.pchain, self.xi, self.p_xi
        w = self.W

        def kick(j: int, d: float) -> None:
            g = self.p_eps[0] ** 2 / w - self.kT if j == 0 else p[j - 1] * p[j - 1] / r[j - 1] - self.kT
            if j < m - 1:
                p[j] *= math.exp(-0.25 * d * p[j + 1] / r[j + 1])
            p[j] += 0.5 * d * g
            if j < m - 1:
                p[j] *= math.exp(-0.25 * d * p[j + 1] / r[j + 1])

        for _ in range(self.ploop):
            for wt in SUZUKI_YOSHIDA[3]:
                d = wt * 0.5 * self.dt / self.ploop
                for j in range(m - 1, -1, -1):
                    kick(j, d)
                xi[:] = [x + d * pk / rk for x, pk, rk in zip(xi, p, r)]
                self.p_eps[0] *= math.exp(-d * p[0] / r[0])
                for j in range(m):
                    kick(j, d)

    def _thermostat(
        self, velocities: torch.Tensor, masses: torch.Tensor, mv2: float | None = None
    ) -> torch.Tensor:
        """The particles' chain (``mv2``: the global sum m v^2 of ``velocities`` if known); leaves
        that of the result (tracked under the chain's scaling) in ``_mv2``."""
        v, _ = self._half_step(velocities, masses, mv2)
        return v

    def _virial_trace(self) -> float:
        vir = self._engine.virial
        if vir is None:
            raise RuntimeError("the engine returned no virial: a barostat needs compute_stress")
        return float(torch.diagonal(vir.detach()).sum())

    def _p_cell(self) -> None:
        g = self._virial_trace() + (1.0 + 3.0 / self.n_dof) * self._mv2 - 3.0 * self.volume() * self.p_ext
        self.p_eps[0] += 0.5 * self.dt * g

    def _velocity_kick(self, v: torch.Tensor, forces: torch.Tensor, masses: torch.Tensor) -> torch.Tensor:
        b = (1.0 + 3.0 / self.n_dof) * 0.5 * self.dt * self.p_eps[0] / self.W
        return v * math.exp(-b) + (0.5 * self.dt * exprel(-b)) * forces / masses[:, None]

    def first(
        self,
        positions: torch.Tensor,
        velocities: torch.Tensor,
        forces: torch.Tensor,
        masses: torch.Tensor,
        ids: torch.Tensor,
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        before = self.energy()
        self._baro_chain()
        v = self._thermostat(velocities, masses)
        self._p_cell()
        v = self._velocity_kick(v, forces, masses)
        a = self.dt * self.p_eps[0] / self.W
        x = positions * math.exp(a) + (self.dt * exprel(a)) * v
        self.eps[0] += a
        self._engine.set_cell(self.cell().to(positions.dtype))  # every rank, the same cell
        heat = before - self.energy() if self._rank == 0 else 0.0
        return x, v, torch.tensor(heat, dtype=v.dtype, device=v.device)

    def second(
        self,
        velocities: torch.Tensor,
        forces: torch.Tensor,
        masses: torch.Tensor,
        ids: torch.Tensor,
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        before = self.energy()
        v = self._velocity_kick(velocities, forces, masses)
        self._mv2 = self._twice_kinetic(v, masses)  # the one collective of this half-step
        self._p_cell()
        v = self._thermostat(v, masses, self._mv2)  # the chain reuses that global sum
        self._baro_chain()
        heat = before - self.energy() if self._rank == 0 else 0.0
        return v, torch.tensor(heat, dtype=v.dtype, device=v.device)

    def state(self) -> dict[str, Any]:
        return {
            **super().state(),
            "kind": "npt-mtk",
            "pressure_bar": self.pressure_bar,
            "pdamp_fs": self.pdamp_fs,
            "pchain": self.pchain,
            "ploop": self.ploop,
            "xi": list(self.xi),
            "p_xi": list(self.p_xi),
            "eps": list(self.eps),
            "p_eps": list(self.p_eps),
            "cell0": list(self.cell0),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        want = {"eta": self.chain, "p_eta": self.chain, "xi": self.pchain, "p_xi": self.pchain}
        want.update(eps=1, p_eps=1, cell0=9)
        for name in self.dynamic:
            values = [float(v) for v in state.get(name, ())]
            if len(values) != want[name]:
                raise ValueError(
                    f"the checkpoint holds no MTK barostat state ({name}: {len(values)} values, "
                    f"expected {want[name]}): it was not written by this integrator"
                )
            setattr(self, name, values)
