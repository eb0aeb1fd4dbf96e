"""Molecular dynamics: the time loop, engines, thermo log, trajectory and checkpoints.

The integrators (velocity Verlet, Langevin BAOAB, keyed by global atom id so a distributed
trajectory equals the serial one for any rank count) live in :mod:`twinshard.atoms.dynamics.integrators`
and are re-exported here.

:func:`simulate` is the time loop, written against the small :class:`Engine`
protocol (state tensors, force evaluation, a global sum, gathering a frame);
:class:`SerialEngine` is the single-process engine, and the distributed driver
supplies its own.

Units are ASE's (eV, Angstrom, amu); ``dt`` is given in femtoseconds, friction
in 1/fs, temperature in K. Positions are never wrapped during a run (neighbour
shifts follow the unwrapped coordinates); wrap on output if needed.

Restart: :func:`simulate` can write a checkpoint every K steps (the whole system
gathered on rank 0, written atomically by :func:`save_checkpoint`) and continue a
run from one (``start_step``, ``heat``): step ``s`` always draws the noise of step
``s``, so an interrupted and resumed run, at any rank count, equals the
uninterrupted one to round-off; before step 1 rank 0 checks the output paths, and a restart cuts
the torn tails and the post-checkpoint frames/rows of the trajectory and thermo log
(:mod:`twinshard.atoms.dynamics.md_files`). A checkpoint holds positions, velocities, ids,
numbers, masses, cell, pbc and extra per-atom arrays (not ``info``), the step,
the integrator's state (its settings and a Nose-Hoover chain's variables), the RNG position (seed,
stream, next step) plus the bath heat so far, what produced it (the potential's and the
structure's identity, :mod:`twinshard.atoms.dynamics.provenance`) and a SHA-256 checksum of all that; it
loads with ``torch.load(weights_only=True)`` (:func:`load_checkpoint`, which refuses a payload
that does not match its checksum).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from ase import units

from twinshard.atoms.data.neighbors import VerletList
from twinshard.atoms.data.system import System
from twinshard.atoms.dynamics import sanity
from twinshard.atoms.dynamics.integrators import (  # re-exported: md.py held them before
    LANGEVIN_STREAM,
    VELOCITY_STREAM,
    IsotropicMTK,
    Langevin,
    NoseHooverChain,
    VelocityVerlet,
    kinetic_dof,
    kinetic_energy,
    maxwell_boltzmann,
    remove_momentum,
)
from twinshard.atoms.dynamics.md_files import NPT_COLUMNS, THERMO_COLUMNS, prepare_outputs
from twinshard.atoms.dynamics.provenance import check_payload, payload_checksum, structure_identity
from twinshard.runtime.errors import short_reason
from twinshard.runtime.files import atomic_write

__all__ = [
    "LANGEVIN_STREAM",
    "VELOCITY_STREAM",
    "VelocityVerlet",
    "Langevin",
    "NoseHooverChain",
    "IsotropicMTK",
    "maxwell_boltzmann",
    "kinetic_energy",
    "kinetic_dof",
    "remove_momentum",
    "Engine",
    "SerialEngine",
    "ThermoLog",
    "simulate",
    "save_checkpoint",
    "load_checkpoint",
    "checkpoint_state",
    "CHECKPOINT_FORMAT",
    "check_restart",
    "dynamic_values",
    "load_dynamic_values",
]


class Engine(Protocol):
    """What :func:`simulate` needs; serial and distributed engines implement it.

    ``positions``, ``velocities``, ``masses``, ``ids`` are the local atoms'
    tensors (all atoms serially, the owned atoms of this rank distributed).
    """

    positions: torch.Tensor
    velocities: torch.Tensor
    masses: torch.Tensor
    ids: torch.Tensor
    rank: int
    n_ranks: int
    n_atoms: int  # global

    def set_state(self, positions: torch.Tensor, velocities: torch.Tensor, moved: bool) -> None:
        """Store the integrated state; ``moved``: positions changed (distributed: then a
        collective update that may migrate atoms between ranks and reorder the rows). Raises
        :class:`~twinshard.atoms.dynamics.sanity.Diverged` on every rank if a position is non-finite or
        jumped beyond ``cutoff + skin`` (:func:`~twinshard.atoms.dynamics.sanity.check_positions`)."""

    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(total potential energy, forces on the local atoms in the local order)."""

    def reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over ranks, same shape (identity serially)."""

    def gather(self) -> System | None:
        """The whole system on rank 0 (ordered by id), ``None`` elsewhere."""


class SerialEngine:
    """All atoms in one process; a Verlet list with ``skin`` for the edges. ``reference=True``
    evaluates through the model's own path where it has one (``evaluate_reference``: MACE's
    calculator; the oracle of ``--check-serial``), not twinshard's serial path."""

    rank = 0
    n_ranks = 1

    def __init__(
        self, potential: torch.nn.Module, system: System, skin: float = 1.0, reference: bool = False
    ) -> None:
        self.potential = potential
        self.reference = reference
        self.system = system.clone()
        self.verlet = VerletList(float(potential.cutoff), skin)
        self._ref = self.system.positions.detach().clone()  # the storages' "last build"
        self.n_atoms = system.n_atoms

    positions = property(lambda self: self.system.positions)
    velocities = property(lambda self: self.system.velocities)
    masses = property(lambda self: self.system.masses)
    ids = property(lambda self: self.system.ids)

    @property
    def rebuilds(self) -> int:
        return self.verlet.n_builds

    need_virial = False  # set by a barostat's bind: compute() then also returns the virial
    virial: torch.Tensor | None = None  # of the last compute() (with need_virial)
    cell = property(lambda self: self.system.cell)
    pbc = property(lambda self: self.system.pbc)

    def set_cell(self, cell: torch.Tensor) -> None:
        """A barostat's new cell; the Verlet list rebuilds on the next compute (a changed cell
        forces a rebuild)."""
        self.system.cell = cell.to(dtype=self.system.cell.dtype, device=self.system.cell.device)

    def set_state(self, positions: torch.Tensor, velocities: torch.Tensor, moved: bool) -> None:
        if moved:  # the storages' check and reference: reset once an atom moved skin / 2
            limit = self.verlet.cutoff + self.verlet.skin
            row = sanity.position_report(positions, self._ref, self.system.ids, limit)
            if sanity.check_positions(row[None], limit) > 0.5 * self.verlet.skin:
                self._ref = positions.detach().clone()
        self.system.positions = positions
        self.system.velocities = velocities

    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        from twinshard.atoms.parallel.plain_inputs import (  # either contract
            evaluate_reference,
            evaluate_serial,
        )

        stress = self.need_virial
        if self.reference:
            res = evaluate_reference(self.potential, self.system, compute_stress=stress)
        else:
            res = evaluate_serial(self.potential, self.system, self.verlet, compute_stress=stress)
        self.virial = res.virial if stress else None
        return res.energy, res.forces

    def reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather(self) -> System:
        return self.system.clone()


@dataclass
class ThermoLog:
    """Rows of (step, time_fs, potential, kinetic, temperature, conserved), eV and K; with a
    barostat (``columns=NPT_COLUMNS``) also volume (A^3) and pressure (bar). The temperature is
    ``2 E_kin / (n_dof kB)``, ``n_dof`` the kinetic degrees of freedom (``3N``, or ``3N - 3`` with
    the net momentum removed: :func:`~twinshard.atoms.dynamics.integrators.kinetic_dof`).

    ``resumed``: the file belongs to a restarted run (prepared by
    :func:`~twinshard.atoms.dynamics.md_files.repair_thermo`): :meth:`add` appends to it."""

    n_atoms: int
    rows: list[dict[str, float]] = field(default_factory=list)
    path: str | os.PathLike | None = None
    resumed: bool = False
    columns: tuple[str, ...] = THERMO_COLUMNS
    n_dof: int | None = None  # kinetic degrees of freedom of the temperature (default 3 n_atoms)

    COLUMNS = THERMO_COLUMNS
    NPT_COLUMNS = NPT_COLUMNS

    def add(
        self,
        step: int,
        time_fs: float,
        potential: float,
        kinetic: float,
        conserved: float,
        write: bool = True,
        extra: dict[str, float] | None = None,
    ) -> dict[str, float]:
        dof = 3 * self.n_atoms if self.n_dof is None else self.n_dof
        temp = 2.0 * kinetic / (dof * units.kB) if dof else 0.0
        row = {
            "step": step,
            "time_fs": time_fs,
            "potential": potential,
            "kinetic": kinetic,
            "temperature": temp,
            "conserved": conserved,
            **(extra or {}),
        }
        self.rows.append(row)
        if self.path is not None and write:
            new = len(self.rows) == 1 and not self.resumed
            new = new or not os.path.exists(self.path)
            with open(self.path, "w" if new else "a") as f:
                if new:
                    f.write("# " + " ".join(self.columns) + "\n")
                f.write(" ".join(f"{row[c]:.12g}" for c in self.columns) + "\n")
        return row

    def column(self, name: str) -> list[float]:
        return [r[name] for r in self.rows]

    def to_json(self) -> str:
        return json.dumps(self.rows)


def simulate(
    engine: Engine,
    integrator: VelocityVerlet,
    steps: int,
    thermo_every: int = 1,
    thermo_path: str | os.PathLike | None = None,
    trajectory: str | os.PathLike | None = None,
    trajectory_every: int = 10,
    progress: bool = False,
    callback: Callable[[int, Engine], None] | None = None,
    start_step: int = 0,
    heat: float = 0.0,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 0,
    check_files: bool = True,
    max_temperature: float = sanity.MAX_TEMPERATURE,
    max_force: float = sanity.MAX_FORCE,
    provenance: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run MD from step ``start_step`` up to step ``steps``; every rank calls it with its engine.

    Step ``s`` (1-based) uses noise keys ``step = s``, so a run restarted at
    ``start_step`` (with the bath ``heat`` exchanged so far, both from
    :func:`load_checkpoint`, and an integrator that loaded its ``dynamic`` state from the
    checkpoint's ``"integrator"``) continues the uninterrupted run. Thermo rows
    are written every ``thermo_every`` steps (and at the start; a restart keeps the
    file's rows up to ``start_step`` and appends); a trajectory frame (extxyz,
    gathered on rank 0) every ``trajectory_every`` steps; a checkpoint (gathered on
    rank 0, written atomically) every ``checkpoint_every`` steps and at the last
    step, recording ``provenance`` (the potential's,
    :func:`~twinshard.atoms.dynamics.provenance.potential_provenance`; needed on rank 0 only). With
    ``check_files`` rank 0 first runs
    :func:`~twinshard.atoms.dynamics.md_files.prepare_outputs` (writable paths, stale temporaries, torn
    tails on a restart); a distributed driver runs it inside a fail-together step and passes
    False (an error raised on rank 0 alone would leave the other ranks waiting). The global
    sums (energies, heat) and gathers are issued on every rank at the same steps, so all ranks
    reach the same collectives; so are the integrator's own (a Nose-Hoover chain: one
    ``engine.reduce_sum`` of the kinetic energy per thermostat half-step, every step).

    Sanity (:mod:`twinshard.atoms.dynamics.sanity`): every step, ``engine.set_state`` raises
    :class:`~twinshard.atoms.dynamics.sanity.Diverged` on every rank for non-finite or runaway positions
    (here given the step); every logged step raises it for a non-finite energy or force, a
    temperature above ``max_temperature`` (K) or a force above ``max_force`` (eV/A) (0 or inf:
    no bound), from the thermo all_reduce, which also carries each rank's largest force.
    Returns ``{"thermo":
    ThermoLog, "seconds": float, "energy": final potential energy, "forces": final
    forces on the local atoms, "heat": bath heat of the whole run (global, eV),
    "step": last step}``.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if not 0 <= start_step <= steps:
        raise ValueError(
            f"the run restarts at step {start_step} but --steps is {steps}: steps counts the whole "
            "run, so give a total larger than the checkpoint's step"
        )
    if checkpoint is not None and checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
    max_temperature = sanity.bound("max_temperature", max_temperature)
    max_force = sanity.bound("max_force", max_force)
    getattr(integrator, "bind", lambda engine: None)(engine)  # e.g. the chain's global kinetic energy
    if check_files and engine.rank == 0:
        names = ("checkpoint=", "trajectory=", "thermo_path=")
        prepare_outputs(start_step, checkpoint, trajectory, thermo_path, names=names)
    npt = bool(getattr(integrator, "barostat", False))
    zero = bool(getattr(integrator, "zero_momentum", False))
    log = ThermoLog(
        engine.n_atoms,
        path=thermo_path if engine.rank == 0 else None,
        resumed=start_step > 0,
        columns=NPT_COLUMNS if npt else THERMO_COLUMNS,
        n_dof=kinetic_dof(engine.n_atoms, zero),
    )
    if zero and start_step == 0:  # the net momentum removed (one global sum; a restart keeps its own)
        v = remove_momentum(engine.velocities, engine.masses, engine.reduce_sum)
        engine.set_state(engine.positions, v, moved=False)  # every rank's atoms
    # Heat this rank's atoms exchanged with the bath so far; summed over ranks only when logged
    # (a sum of local sums), so a thermostat adds no collective to unlogged steps. A restart
    # carries the global sum so far on rank 0.
    heat_local = torch.full(
        (),
        float(heat) if engine.rank == 0 else 0.0,
        dtype=engine.positions.dtype,
        device=engine.positions.device,
    )

    def global_sums(forces: torch.Tensor) -> tuple[float, float, torch.Tensor]:
        # one collective for both sums and every rank's largest force (its own slot, zeros
        # elsewhere: the sum is an exact gather); fp64, so the atom ids in the slots are exact
        slots = torch.zeros(engine.n_ranks, 2, dtype=torch.float64, device=heat_local.device)
        slots[engine.rank] = sanity.force_report(forces, engine.ids)
        sums = torch.stack([kinetic_energy(engine.velocities, engine.masses), heat_local])
        out = engine.reduce_sum(torch.cat([sums.to(torch.float64), slots.flatten()]))
        k, h = out[:2].tolist()
        return k, h, out[2:].view(-1, 2)

    if npt and start_step == 0 and engine.rank == 0:
        # the extended energy's own start value (P_ext V0) counts as heat already drawn, so the
        # conserved column is the extended energy itself (ASE's get_conserved_energy)
        heat_local = heat_local - float(integrator.energy())
        heat = float(heat) - float(integrator.energy())
    last_heat = [float(heat)]

    def record(step: int, energy: torch.Tensor, forces: torch.Tensor, write: bool = True) -> None:
        k, h, fmax = global_sums(forces)
        last_heat[0] = h
        e = float(energy)
        extra = None
        if npt:  # the barostat's volume and the instantaneous pressure (agreed virial and K)
            vol = float(integrator.volume())
            vir = float(torch.diagonal(engine.virial.detach()).sum())
            extra = {"volume": vol, "pressure": (vir + 2.0 * k) / (3.0 * vol) / units.bar}
        row = log.add(step, step * integrator.dt_fs, e, k, e + k - h, write=write, extra=extra)
        try:  # every rank holds the same values here: all raise together
            sanity.check_thermo(row, fmax, max_temperature, max_force)
        except sanity.Diverged as exc:
            raise exc.at(step) from None

    def write_frame(step: int, energy: torch.Tensor) -> None:
        frame = engine.gather()  # a collective in a distributed run: every rank calls it
        if frame is not None and engine.rank == 0:
            from twinshard.atoms.data.io import write

            write(
                trajectory, frame, format="extxyz", append=step > 0, info={"step": step}, energy=float(energy)
            )

    def write_checkpoint(step: int, forces: torch.Tensor) -> None:
        _, h, _ = global_sums(forces)  # collective
        frame = engine.gather()  # collective
        if frame is not None and engine.rank == 0:
            save_checkpoint(checkpoint, checkpoint_state(frame, step, integrator, h, provenance))

    energy, forces = engine.compute()
    # a restart's first row was logged by the run that wrote the checkpoint: keep it in memory
    # (the drift figures start there) but do not write it twice
    record(start_step, energy, forces, write=start_step == 0)
    if trajectory is not None and start_step == 0:
        write_frame(0, energy)
    bar = None
    if progress and engine.rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=steps, initial=start_step, desc="md", unit="step")
    t0 = time.perf_counter()
    for step in range(start_step + 1, steps + 1):
        x, v, dheat = integrator.first(
            engine.positions, engine.velocities, forces, engine.masses, engine.ids, step
        )
        try:  # the positions are checked before they reach the neighbour list (every rank)
            engine.set_state(x, v, moved=True)
        except sanity.Diverged as exc:
            raise exc.at(step) from None
        energy, forces = engine.compute()
        v, dheat2 = integrator.second(engine.velocities, forces, engine.masses, engine.ids, step)
        engine.set_state(engine.positions, v, moved=False)
        heat_local = heat_local + (dheat + dheat2)
        if step % thermo_every == 0 or step == steps:
            record(step, energy, forces)
        if trajectory is not None and step % trajectory_every == 0:
            write_frame(step, energy)
        if checkpoint is not None and ((checkpoint_every and step % checkpoint_every == 0) or step == steps):
            write_checkpoint(step, forces)
        if callback is not None:
            callback(step, engine)
        if bar is not None:
            bar.update(1)
            if log.rows:
                bar.set_postfix(T=f"{log.rows[-1]['temperature']:.1f}K", refresh=False)
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return {
        "thermo": log,
        "seconds": seconds,
        "energy": float(energy),
        "forces": forces,
        "heat": last_heat[0],  # the last step is always logged
        "step": steps,
    }


# ------------------------------------------------------------------------ checkpoints

CHECKPOINT_FORMAT = "twinshard.md.checkpoint"
CHECKPOINT_VERSION = 2  # 2: provenance and checksum; version 1 still loads, unchecked


def checkpoint_state(
    system: System,
    step: int,
    integrator: VelocityVerlet,
    heat: float,
    potential: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The checkpoint of ``system`` (the whole system, ordered by id) after ``step``.

    Plain values and tensors only, so it loads with ``torch.load(weights_only=True)``.
    The RNG is counter-based (keyed by seed, stream, atom id, step, component): its
    position is the next step to draw. ``"provenance"`` holds ``potential`` (the record of
    :func:`~twinshard.atoms.dynamics.provenance.potential_provenance`, or None: unknown) and the
    structure's identity; :func:`save_checkpoint` adds the checksum.
    """
    integ = integrator.state()
    return {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "step": int(step),
        "time_fs": float(step * integrator.dt_fs),
        "heat": float(heat),
        "integrator": integ,
        "rng": {
            "generator": "twinshard.rng (counter-based)",
            "seed": int(integ.get("seed", 0)),
            "stream": LANGEVIN_STREAM,
            "next_step": int(step) + 1,
        },
        "provenance": {"potential": potential, "structure": structure_identity(system)},
        "system": {
            "positions": system.positions.detach().cpu(),
            "velocities": system.velocities.detach().cpu(),
            "ids": system.ids.cpu(),
            "numbers": system.numbers.cpu(),
            "masses": system.masses.detach().cpu(),
            "cell": system.cell.detach().cpu(),
            "pbc": system.pbc.cpu(),
            "arrays": {k: v.detach().cpu() for k, v in system.arrays.items()},
        },
    }


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (:func:`~twinshard.runtime.atomic_write`: a
    fsynced temporary in the same directory, renamed over ``path``). A process killed at any
    point leaves either the previous file or the new one, never a torn one (a killed writer
    may leave its ``.tmp`` file, which loading ignores and the next run removes). The state is
    stored with ``"checksum"``: the SHA-256 of everything else
    (:func:`~twinshard.atoms.dynamics.provenance.payload_checksum`)."""
    state = {**state, "checksum": payload_checksum(state)}
    atomic_write(path, lambda f: torch.save(state, f))


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint (``torch.load(weights_only=True)``); ``"system"`` becomes a System.

    Raises ValueError naming the file if it is missing, not a twinshard MD checkpoint, or
    corrupted (its payload does not match its checksum). A version-1 checkpoint (no checksum,
    no provenance) loads with a one-line notice on stderr that neither can be checked.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path!r} does not exist; give the file written by --checkpoint")
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # torn/foreign files raise many types: one clear error
        raise ValueError(
            f"checkpoint {path!r} cannot be read ({short_reason(exc)}): it is torn or no twinshard "
            "checkpoint; give the file written by --checkpoint"
        ) from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path!r} is not a twinshard MD checkpoint (written by twinshard md --checkpoint)")
    if state.get("version") not in (1, CHECKPOINT_VERSION):
        raise ValueError(
            f"checkpoint {path!r} has version {state.get('version')}, expected {CHECKPOINT_VERSION}"
        )
    check_payload(state, repr(path))
    f = state["system"]
    state = dict(state)
    state["system"] = System(
        positions=f["positions"],
        numbers=f["numbers"],
        cell=f["cell"],
        pbc=f["pbc"],
        masses=f["masses"],
        velocities=f["velocities"],
        ids=f["ids"],
        arrays=dict(f["arrays"]),
    )
    return state


def check_restart(state: dict[str, Any], integrator: VelocityVerlet, path: str = "the checkpoint") -> None:
    """Raise ValueError if ``integrator`` differs from the one that wrote ``state`` (a resumed
    run must integrate with the same settings to continue the same trajectory). The integrator's
    ``dynamic`` entries (a thermostat's variables) are not settings: the restart loads them."""
    saved, now = state["integrator"], integrator.state()
    keys = sorted((set(saved) | set(now)) - set(getattr(integrator, "dynamic", ())))
    diff = {k: (saved.get(k), now.get(k)) for k in keys if saved.get(k) != now.get(k)}
    if diff:
        text = ", ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in diff.items())
        raise ValueError(
            f"{path} was written with other integrator settings ({text}); restart with the same "
            "--thermostat/--dt/--temperature/--friction/--seed/--tdamp/--chain"
        )


def dynamic_values(integrator: VelocityVerlet) -> list[float]:
    """The integrator's ``dynamic`` state entries, flat: what a restart sends from rank 0 (which
    loaded them from the checkpoint) to every rank. The length follows from the settings, so every
    rank knows it (empty for velocity Verlet and Langevin)."""
    state = integrator.state()
    return [float(v) for k in getattr(integrator, "dynamic", ()) for v in state[k]]


def load_dynamic_values(integrator: VelocityVerlet, values: list[float]) -> None:
    """Inverse of :func:`dynamic_values`: load the flat values into the integrator."""
    own, at, state = integrator.state(), 0, {}
    for k in getattr(integrator, "dynamic", ()):
        state[k], at = values[at : at + len(own[k])], at + len(own[k])
    if state:
        integrator.load_state(state)
