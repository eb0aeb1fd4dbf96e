"""MD on a batch of systems in one decomposed run: each system its own integrator, thermo log
and end step, equal to each system run alone.

The batch lives in graph storage (:class:`~twinshard.atoms.parallel.graph_storage.GraphSharded`:
the systems' rows concatenated and split by index into balanced blocks, so a rank's rows may belong
to several systems; one model evaluation gives every system's energy and forces). Per system:

- **integrator** (:class:`BatchIntegrator`): one ``VelocityVerlet`` / ``Langevin`` /
  ``NoseHooverChain`` object per system with its own settings (temperature, friction, seed,
  tdamp, chain, dt) and state, applied to that system's rows of this rank. Langevin noise is keyed
  by ``(the system's seed, stream, the atom's id in its system, step, component)``: exactly the
  keys of the system run alone, so its noise is the same draw at any rank count and in any batch.
  A Nose-Hoover chain is replicated per system on every rank (every rank updates every chain, also
  of systems it holds no row of) and driven by that system's global ``sum m v^2``: the ``[S]``
  vector of them is one all-reduce per thermostat half-step for the whole batch (two per step),
  not one per system;
- **barostat** (NPT: :class:`~twinshard.atoms.dynamics.integrators.IsotropicMTK` or
  :class:`~twinshard.atoms.dynamics.scr.StochasticCellRescaling`, per system with its own pressure,
  coupling and state): each system's barostat binds to a :class:`SystemView` of the batch (its
  cell ``cells[s]`` in the storage, its virial ``[s]`` of the batch evaluation, its size, a
  ``reduce_sum`` over the ranks), so the integrator is the single-system one, unchanged. Its
  scalars and cell are replicated: every rank runs every active barostat in the system order,
  also with no row of that system (empty rows), so each rank issues the same collectives (a
  barostat's own: per thermostat half-step one all-reduce of a scalar (MTK) or of the 9-number
  kinetic tensor (SCR), per system: not batched) and sets the same cell
  (:meth:`GraphSharded.set_cell <twinshard.atoms.parallel.graph_storage.GraphSharded.set_cell>`);
- **thermo**: one file per system (``thermo="out/thermo.{i}.log"``, or a list of paths), each in
  the format of a single-system run (:class:`~twinshard.atoms.dynamics.md.ThermoLog`): the rows of
  system ``i`` can be compared with (or restarted like) its run alone line by line, and the
  existing readers and torn-tail repair apply unchanged; a shared file with a ``system`` column
  would be a second format to read, repair and compare. The sums of a logged step (each system's
  kinetic energy and bath heat, and each rank's largest force per system) are one all-reduce;
- **end**: ``steps`` may differ per system. After its last step a system drops out: the batch
  is gathered on rank 0, the finished system's state kept there, and the others re-scattered
  (balanced blocks again, so the ranks share the remaining work); its Nose-Hoover chain and bath
  heat are kept. The step counter is the run's; system ``i`` integrates steps ``start_i + 1 ..
  steps_i``;
- **checkpoints**: one file per system in the single-system format
  (:func:`~twinshard.atoms.dynamics.md.checkpoint_state`), written every ``checkpoint_every`` steps
  and at the system's last step; ``restart`` takes the list back (each system continues from its
  own step; a single-system ``run_md(restart=...)`` can also continue one of them alone).

What is the same as a system run alone: its positions, velocities and thermo rows, to round-off
(the sums over ranks and over a batch's rows are ordered differently; nothing else differs: the
model sees each system's own radius graph, the per-system energies are separate sums).

Collectives per step (every rank, the same sequence): the storage's ``update`` (one all_gather of
the owned positions), the model's evaluation, two ``[S]`` all-reduces with a Nose-Hoover chain, one
thermo all-reduce on logged steps; at a drop-out, the gather of the batch and its re-scatter; with
barostats, the virials of the evaluation (the model's one all-reduce of ``[S, 3, 3]``) and each
barostat's own all-reduces (above).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from ase import units

from twinshard.atoms.data.system import System
from twinshard.atoms.dynamics import sanity
from twinshard.atoms.dynamics.integrators import (
    NoseHooverChain,
    VelocityVerlet,
    kinetic_dof,
    kinetic_energy,
    remove_momentum,
)
from twinshard.atoms.dynamics.md import ThermoLog, checkpoint_state, save_checkpoint

__all__ = ["BatchIntegrator", "SystemView", "per_system_paths", "simulate_batch"]

T = torch.Tensor


def per_system_paths(
    value: str | os.PathLike | Sequence[str | os.PathLike] | None, n: int, name: str
) -> list[str | None]:
    """One path per system: ``None``; a list of ``n`` paths (``None`` entries allowed); or a string
    holding ``{i}`` (the system's index in the batch), e.g. ``"thermo.{i}.log"``."""
    if value is None:
        return [None] * n
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} paths for a batch of {n} systems: give one per system")
        return [None if v is None else os.fspath(v) for v in value]
    text = os.fspath(value)
    if "{i}" not in text:
        raise ValueError(
            f"{name}={text!r}: a batch writes one file per system; give a path holding {{i}} (the "
            f"system's index, e.g. 'thermo.{{i}}.log') or a list of {n} paths"
        )
    return [text.replace("{i}", str(i)) for i in range(n)]


class _Batch:
    """The run's current storage, the systems in it (``alive``: storage index -> system) and the
    virials of its last evaluation ``[S_alive, 3, 3]`` (replicated); replaced at a drop-out."""

    def __init__(self, reduce: Any) -> None:
        self.g: Any = None
        self.alive: list[int] = []
        self.virial: torch.Tensor | None = None
        self.reduce = reduce


class SystemView:
    """The engine a barostat of batch system ``s`` binds to (what
    :meth:`IsotropicMTK.bind <twinshard.atoms.dynamics.integrators.IsotropicMTK.bind>` and
    :meth:`StochasticCellRescaling.bind <twinshard.atoms.dynamics.scr.StochasticCellRescaling.bind>`
    read): replicated ``rank``, ``n_atoms`` (the system's), ``pbc``, ``cell`` (``cells[s]`` of the
    storage), ``virial`` (the system's of the last batch evaluation); ``set_cell`` sets the
    system's cell on this rank's storage (every rank calls it with the same cell; no
    communication); ``reduce_sum`` is one all-reduce over the ranks (collective: every rank calls
    it, rows of the system or not)."""

    need_virial = False

    def __init__(self, batch: _Batch, s: int, n_atoms: int, pbc: torch.Tensor, rank: int) -> None:
        self._batch, self.s = batch, int(s)
        self.n_atoms, self.pbc, self.rank = int(n_atoms), pbc, int(rank)

    def _at(self) -> int:
        return self._batch.alive.index(self.s)

    @property
    def cell(self) -> torch.Tensor:
        return self._batch.g.cells[self._at()]

    @property
    def virial(self) -> torch.Tensor | None:
        v = self._batch.virial
        return None if v is None else v[self._at()]

    def set_cell(self, cell: torch.Tensor) -> None:
        self._batch.g.set_cell(cell, system=self._at())

    def reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        return self._batch.reduce(x.reshape(-1)).to(x.dtype).reshape(x.shape)


class BatchIntegrator:
    """One integrator per system (settings and state of each its own). ``first`` / ``second`` act
    on this rank's owned rows, given as per-system row slices; see the module docstring."""

    def __init__(self, integrators: Sequence[VelocityVerlet]) -> None:
        integrators = list(integrators)
        if not integrators:
            raise ValueError("a batch needs one integrator per system, got none")
        for integ in integrators:
            if not isinstance(integ, VelocityVerlet):
                raise TypeError(
                    f"a batch integrator holds VelocityVerlet/Langevin/NoseHooverChain, got {integ!r}"
                )
        self.integrators = integrators
        self.baro = [bool(getattr(i, "barostat", False)) for i in integrators]
        # the batched chains: a barostat (MTK is a chain too) runs its own step, chain included
        self.chained = [isinstance(i, NoseHooverChain) and not b for i, b in zip(integrators, self.baro)]

    def __len__(self) -> int:
        return len(self.integrators)

    def bind(self, sizes: Sequence[int], rank: int, views: Sequence[Any] | None = None) -> None:
        """Each chain's degrees of freedom (3 N of its own system) and the rank that counts its heat;
        each barostat bound to its system's :class:`SystemView` (``views[s]``)."""
        for s, (integ, n) in enumerate(zip(self.integrators, sizes)):
            if self.baro[s]:
                if views is None:
                    raise ValueError("a batch with barostats binds each to its system's view")
                integ.bind(views[s])
            elif isinstance(integ, NoseHooverChain):
                integ.n_dof, integ._rank = kinetic_dof(n, integ.zero_momentum), int(rank)

    def _mv2(self, v: torch.Tensor, m: torch.Tensor, rows: dict[int, slice], reduce: Any) -> list[float]:
        """Every system's global ``sum m v^2`` (one all-reduce of ``[S]``)."""
        loc = torch.zeros(len(self), dtype=torch.float64, device=v.device)
        for s, r in rows.items():
            loc[s] = 2.0 * kinetic_energy(v[r], m[r]).to(torch.float64)
        return reduce(loc).tolist()

    def _chains(self, v: T, m: T, rows: dict[int, slice], active: list[int], reduce: Any) -> tuple[T, T]:
        """A thermostat half-step of every active chain (on every rank; a rank without rows of a
        system still advances its chain). Returns the scaled velocities and per-system heat."""
        heat = torch.zeros(len(self), dtype=v.dtype, device=v.device)
        chained = [s for s in active if self.chained[s]]  # replicated: every rank the same list
        if not chained:
            return v, heat
        mv2 = self._mv2(v, m, rows, reduce)
        v = v.clone()
        for s in chained:
            chain = self.integrators[s]
            r = rows.get(s, slice(0, 0))  # no rows here: the chain still advances (replicated)
            v[r], heat[s] = chain._half_step(v[r], m[r], mv2[s])
        return v, heat

    def first(
        self,
        x: T,
        v: T,
        f: T,
        m: T,
        ids: T,
        rows: dict[int, slice],
        active: list[int],
        step: int,
        reduce: Any,
    ) -> tuple[T, T, T]:
        """Positions, velocities and per-system heat ``[S]`` (local partial sums) after the first half."""
        v, heat = self._chains(v, m, rows, active, reduce)
        x, v = x.clone(), v.clone()
        for s in active:
            r = rows.get(s)
            if self.baro[s]:  # every rank, rows here or not: its collectives and cell are everyone's
                r = slice(0, 0) if r is None else r
            if r is None:
                continue
            integ = self.integrators[s]
            if self.chained[s]:  # the chain's half-step is done: velocity Verlet's B and A
                xs, vs, h = VelocityVerlet.first(integ, x[r], v[r], f[r], m[r], ids[r], step)
            elif self.baro[s]:
                baro = self.integrators[s]  # this system's own barostat (its state and cell)
                xs, vs, h = baro.first(x[r], v[r], f[r], m[r], ids[r], step)
            else:
                xs, vs, h = integ.first(x[r], v[r], f[r], m[r], ids[r], step)
            x[r], v[r] = xs, vs
            heat[s] = heat[s] + h
        return x, v, heat

    def second(
        self, v: T, f: T, m: T, ids: T, rows: dict[int, slice], active: list[int], step: int, reduce: Any
    ) -> tuple[T, T]:
        """Velocities and per-system heat ``[S]`` after the second half."""
        v = v.clone()
        heat = torch.zeros(len(self), dtype=v.dtype, device=v.device)
        for s in active:
            r = rows.get(s)
            if self.baro[s]:  # every rank (see first)
                r = slice(0, 0) if r is None else r
            if r is None:
                continue
            integ = self.integrators[s]
            if self.chained[s]:
                vs, h = VelocityVerlet.second(integ, v[r], f[r], m[r], ids[r], step)
            else:
                vs, h = integ.second(v[r], f[r], m[r], ids[r], step)
            v[r] = vs
            heat[s] = heat[s] + h
        v, heat2 = self._chains(v, m, rows, active, reduce)
        return v, heat + heat2

    def energy(self, s: int) -> float:
        """System ``s``'s thermostat or barostat energy (a chain's, a barostat's; 0 otherwise)."""
        integ = self.integrators[s]
        return float(integ.energy()) if hasattr(integ, "energy") else 0.0


def _rows(g: Any, alive: list[int]) -> dict[int, slice]:
    """This rank's owned rows of each batch system (original index -> contiguous slice)."""
    out: dict[int, slice] = {}
    b = g.batch.tolist()
    i = 0
    while i < len(b):
        j = i
        while j < len(b) and b[j] == b[i]:
            j += 1
        out[alive[b[i]]] = slice(i, j)
        i = j
    return out


def simulate_batch(
    systems: list[System] | None,
    potential: Any,
    integrator: BatchIntegrator,
    steps: Sequence[int],
    *,
    start_steps: Sequence[int] | None = None,
    heats: Sequence[float] | None = None,
    skin: float = 1.0,
    thermo_every: int = 1,
    thermo_paths: Sequence[str | None] | None = None,
    trajectories: Sequence[str | None] | None = None,
    trajectory_every: int = 10,
    checkpoints: Sequence[str | None] | None = None,
    checkpoint_every: int = 0,
    provenance: dict[str, Any] | None = None,
    max_temperature: float = sanity.MAX_TEMPERATURE,
    max_force: float = sanity.MAX_FORCE,
) -> dict[str, Any]:
    """Collective (every rank): run the batch (``systems`` on rank 0, ``None`` elsewhere) in graph
    storage with ``potential`` (a plain-contract model) up to ``steps[i]`` for system ``i``.

    ``integrator``, ``steps``, ``start_steps``, ``heats`` (restart: each system's step and bath heat,
    rank 0's values used), the paths and the options are the same on every rank. Returns (every
    rank) ``{"thermo": [ThermoLog per system] (rows on every rank, files written by rank 0),
    "systems": final Systems ordered by id (rank 0; None elsewhere), "seconds", "dropouts": [(last
    step, system)], "evaluations", "heat": [bath heat per system], "owned_atoms_per_rank_start"}``. Raises :class:`~twinshard.atoms.dynamics.sanity.Diverged` on every
    rank naming the step (and the system, for a thermo bound).
    """
    from twinshard.atoms.parallel.distributed import DistributedPotential
    from twinshard.atoms.parallel.graph_storage import GraphSharded
    from twinshard.comm import primitives as prim
    from twinshard.runtime import require_world

    world = require_world("run_md on a batch")
    rank, nranks, dev = world.rank, world.size, world.device
    n = len(integrator)
    steps = [int(s) for s in steps]
    start = [0] * n if start_steps is None else [int(s) for s in start_steps]
    thermo_paths = list(thermo_paths or [None] * n)
    trajectories = list(trajectories or [None] * n)
    checkpoints = list(checkpoints or [None] * n)
    max_temperature = sanity.bound("max_temperature", max_temperature)
    max_force = sanity.bound("max_force", max_force)
    dp = DistributedPotential(potential, mode="dispatch")
    cutoff = float(potential.cutoff)

    held: list[System] | None = [s.clone() for s in systems] if rank == 0 and systems is not None else None
    g = GraphSharded.scatter(held, 0, cutoff=cutoff, skin=skin)
    sizes, owned_start = list(g.sizes), g.counts()
    alive = list(range(n))  # storage index -> system index
    baro = integrator.baro

    def reduce(t: torch.Tensor) -> torch.Tensor:
        return prim.all_reduce(t.to(torch.float64).contiguous(), g.group, op="batch_md")

    batch = _Batch(reduce)
    batch.g, batch.alive = g, alive
    views = [SystemView(batch, i, sizes[i], g.pbcs[i], rank) for i in range(n)]
    integrator.bind(sizes, rank, views)
    final: dict[int, System] = {}  # rank 0: the systems that dropped out
    logs = [
        ThermoLog(
            sizes[i],
            path=thermo_paths[i] if rank == 0 else None,
            resumed=start[i] > 0,
            columns=ThermoLog.NPT_COLUMNS if baro[i] else ThermoLog.COLUMNS,
            n_dof=kinetic_dof(sizes[i], integrator.integrators[i].zero_momentum),
        )
        for i in range(n)
    ]
    zero = [integrator.integrators[i].zero_momentum and start[i] == 0 for i in range(n)]
    if any(zero):  # each such system's net momentum removed: one all-reduce of [S, 4] for all
        rows0 = _rows(g, alive)
        loc = torch.zeros(n, 4, dtype=torch.float64, device=dev)
        for s, r in rows0.items():
            loc[s, :3] = (g.masses[r, None] * g.velocities[r]).sum(0).to(torch.float64)
            loc[s, 3] = g.masses[r].sum().to(torch.float64)
        tot = reduce(loc)
        v0 = g.velocities.clone()
        for s, r in rows0.items():
            if zero[s]:  # remove_momentum with the agreed sums of its system
                v0[r] = remove_momentum(v0[r], g.masses[r], lambda _local, t=tot[s]: t)
        g.velocities = v0
    heat_local = torch.zeros(n, dtype=torch.float64, device=dev)
    if rank == 0 and heats is not None:
        heat_local += torch.tensor([float(h) for h in heats], dtype=torch.float64, device=dev)
    if rank == 0:  # a barostat's start value (P_ext V0 ...) counts as heat drawn (as simulate does)
        for i in range(n):
            if baro[i] and start[i] == 0:
                heat_local[i] -= integrator.energy(i)
    dropouts: list[tuple[int, int]] = []
    evaluations = 0

    def compute() -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal evaluations
        evaluations += 1
        stress = any(baro[s] for s in alive)  # replicated: the same on every rank
        res = dp.compute(g, compute_stress=stress)
        batch.virial = res.virial.reshape(-1, 3, 3) if stress else None
        return res.energy.reshape(-1), res.forces

    def record(at: dict[int, int], energy: torch.Tensor, forces: torch.Tensor, write: bool = True) -> None:
        """One all-reduce: the thermo rows of the systems in ``at`` (system -> its step)."""
        rows = _rows(g, alive)
        kin = torch.zeros(n, dtype=torch.float64, device=dev)
        slots = torch.zeros(nranks, n, 2, dtype=torch.float64, device=dev)
        for s, r in rows.items():
            kin[s] = kinetic_energy(g.velocities[r], g.masses[r]).to(torch.float64)
            slots[rank, s] = sanity.force_report(forces[r], g.ids[r])
        out = reduce(torch.cat([kin, heat_local, slots.flatten()]))
        k, h, fm = out[:n].tolist(), out[n : 2 * n].tolist(), out[2 * n :].view(nranks, n, 2)
        e = {alive[j]: float(energy[j]) for j in range(len(alive))}
        for s, step in sorted(at.items()):
            integ = integrator.integrators[s]
            extra = None
            if baro[s]:  # the barostat's volume and the instantaneous pressure (agreed virial and K)
                assert batch.virial is not None
                vol = float(integ.volume())
                vir = float(torch.diagonal(batch.virial[alive.index(s)]).sum())
                extra = {"volume": vol, "pressure": (vir + 2.0 * k[s]) / (3.0 * vol) / units.bar}
            row = logs[s].add(
                step, step * integ.dt_fs, e[s], k[s], e[s] + k[s] - h[s], write=write, extra=extra
            )
            try:  # every rank holds the same values: all raise together
                sanity.check_thermo(row, fm[:, s], max_temperature, max_force)
            except sanity.Diverged as exc:
                raise sanity.Diverged(f"system {s}: {exc.detail}", exc.fix).at(step) from None

    def global_heat() -> list[float]:
        return reduce(heat_local).tolist()

    def write_outputs(step: int, energy: torch.Tensor, frames: list[int], ckpts: list[int]) -> None:
        got = g.gather_systems(0)  # collective
        h = global_heat() if ckpts else None
        if rank != 0 or got is None:
            return
        from twinshard.atoms.data.io import write

        for s in frames:
            j = alive.index(s)
            fr = got[j].select(torch.argsort(got[j].ids))
            write(
                trajectories[s],
                fr,
                format="extxyz",
                append=step > 0,
                info={"step": step},
                energy=float(energy[j]),
            )
        for s in ckpts:
            j = alive.index(s)
            fr = got[j].select(torch.argsort(got[j].ids))
            state = checkpoint_state(fr, step, integrator.integrators[s], h[s], provenance)
            save_checkpoint(checkpoints[s], state)

    energy, forces = compute()
    # a restart's first row was written by the run that checkpointed it: kept in memory, not rewritten
    record({s: 0 for s in range(n) if start[s] == 0}, energy, forces)
    if any(start):
        record({s: start[s] for s in range(n) if start[s] > 0}, energy, forces, write=False)
    frames0 = [s for s in range(n) if trajectories[s] and start[s] == 0]
    if frames0:
        write_outputs(0, energy, frames0, [])
    t0 = time.perf_counter()
    last = max(steps) if steps else 0
    for step in range(min(start) + 1, last + 1):
        done = [s for s in alive if steps[s] < step]
        if done:  # drop out: keep the finished systems on rank 0, re-scatter the rest
            got = g.gather_systems(0)
            keep = [s for s in alive if s not in done]
            if rank == 0:
                assert got is not None
                for j, s in enumerate(alive):
                    if s in done:
                        final[s] = got[j].select(torch.argsort(got[j].ids))
            rest = [got[alive.index(s)] for s in keep] if rank == 0 and got is not None else None
            dropouts += [(step - 1, s) for s in done]
            alive = keep
            g = GraphSharded.scatter(rest, 0, cutoff=cutoff, skin=skin)
            batch.g, batch.alive = g, alive
            energy, forces = compute()
        active = [s for s in alive if start[s] < step]
        rows = _rows(g, alive)
        x, v, dh = integrator.first(
            g.positions, g.velocities, forces, g.masses, g.ids, rows, active, step, reduce
        )
        g.positions, g.velocities = x.contiguous(), v.contiguous()
        try:
            g.update()
        except sanity.Diverged as exc:
            raise exc.at(step) from None
        energy, forces = compute()
        v, dh2 = integrator.second(g.velocities, forces, g.masses, g.ids, rows, active, step, reduce)
        g.velocities = v.contiguous()
        heat_local = heat_local + (dh + dh2).to(torch.float64)
        logged = [s for s in active if step % thermo_every == 0 or step == steps[s]]
        if logged:
            record({s: step for s in logged}, energy, forces)
        frames = [s for s in active if trajectories[s] and step % trajectory_every == 0]
        ckpts = [
            s
            for s in active
            if checkpoints[s] and ((checkpoint_every and step % checkpoint_every == 0) or step == steps[s])
        ]
        if frames or ckpts:
            write_outputs(step, energy, frames, ckpts)
    seconds = time.perf_counter() - t0
    got = g.gather_systems(0)
    if rank == 0:
        assert got is not None
        for j, s in enumerate(alive):
            final[s] = got[j].select(torch.argsort(got[j].ids))
    return {
        "thermo": logs,
        "systems": [final[s] for s in range(n)] if rank == 0 else None,
        "seconds": seconds,
        "dropouts": dropouts,
        "evaluations": evaluations,
        "owned_atoms_per_rank_start": owned_start,
        "heat": global_heat(),
    }
