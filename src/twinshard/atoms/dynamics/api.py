"""One call for distributed MD with a potential you built: :func:`run_md`.

::

    import ase.build
    from twinshard.atoms import LennardJones, run_md

    atoms = ase.build.bulk("Ar", "fcc", a=5.26, cubic=True).repeat(6)
    out = run_md(atoms, LennardJones(cutoff=8.5), ranks=4, steps=200,
                 thermostat="langevin", temperature=60.0, trajectory="traj.extxyz")
    print(out.thermo.rows[-1], out.system.n_atoms, out.stress)

Where it runs:

- from a plain Python session or script: ``ranks`` local processes (the shared
  worker pool of :mod:`twinshard.runtime`, kept for the next call). The
  potential and the system travel cloudpickled to every rank: a potential class
  defined in a script, on standard input or in a notebook cell goes by value.
  The workers never import the caller's ``__main__``, so a script needs no
  ``if __name__ == "__main__":`` guard;
- under ``torchrun`` (or inside any initialised twinshard world): on the
  launched world; every rank calls ``run_md`` with the same arguments and rank
  0's system is used (``ranks`` is ignored).

Distributed like ``twinshard md``: the system is scattered by
:class:`~twinshard.atoms.parallel.sharded.ShardedSystem` (spatial domains, halos,
migration), forces come from
:class:`~twinshard.atoms.parallel.distributed.DistributedPotential`, and the integrators
of :mod:`twinshard.atoms.dynamics.md` step each rank's owned atoms; the trajectory equals
the serial one to round-off for any rank count (Langevin noise keyed by atom
id and step). Memory per rank: the owned atoms and their halo during the run;
the final system is gathered on rank 0 only.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import nn

from twinshard.atoms.data.io import as_system
from twinshard.atoms.data.system import System
from twinshard.atoms.dynamics.ensembles import THERMOSTATS, integrator_for
from twinshard.atoms.dynamics.md import (
    VelocityVerlet,
    maxwell_boltzmann,
)
from twinshard.atoms.dynamics.run import (  # MDResult: re-exported
    PYTHON,
    MDOptions,
    MDResult,
    npt_figures,
    run_rank,
)
from twinshard.atoms.dynamics.sanity import MAX_FORCE, MAX_TEMPERATURE, bound

__all__ = ["MDResult", "run_md"]


def _integrator(thermostat: str | VelocityVerlet, pressure: float | None = None, **kw: Any) -> VelocityVerlet:
    """``run_md``'s integrator: one given as an object, or :func:`integrator_for` by name."""
    if isinstance(thermostat, VelocityVerlet):
        if pressure is not None:
            raise ValueError(
                "give pressure= with a thermostat name, or a barostat integrator (IsotropicMTK, "
                "StochasticCellRescaling) alone"
            )
        return thermostat
    if thermostat not in THERMOSTATS + ("nve",):
        raise ValueError(
            "thermostat must be 'none', 'langevin', 'nose-hoover' or an integrator (VelocityVerlet, "
            f"Langevin, NoseHooverChain), got {thermostat!r}"
        )
    return integrator_for(thermostat, pressure=pressure, **kw)


def run_md(
    system: System | Any | None,
    potential: nn.Module,
    *,
    ranks: int = 4,
    steps: int = 100,
    thermostat: str | VelocityVerlet = "none",
    dt: float = 2.0,
    temperature: float = 300.0,
    friction: float = 0.01,
    tdamp: float | None = None,
    chain: int = 3,
    pressure: float | None = None,
    barostat: str = "mtk",
    pdamp: float | None = None,
    pchain: int = 3,
    coupling: str = "iso",
    compressibility: float = 4.5e-5,
    seed: int = 0,
    initial_temperature: float | None = None,
    zero_momentum: bool | list[bool] = False,
    skin: float = 1.0,
    partition: str = "spatial",
    balance: float | None = None,
    storage: str | None = None,
    trajectory: str | os.PathLike | None = None,
    trajectory_every: int = 10,
    thermo: str | os.PathLike | None = None,
    thermo_every: int = 10,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 0,
    restart: str | os.PathLike | list | None = None,
    allow_changed_potential: bool = False,
    dtype: torch.dtype = torch.float64,
    progress: bool = False,
    timeout: float = 3600.0,
    max_temperature: float = MAX_TEMPERATURE,
    max_force: float = MAX_FORCE,
) -> MDResult | list[MDResult]:
    """Run distributed MD of ``system`` with ``potential`` and return the final state.

    A list of systems runs as one batch in graph storage and returns one :class:`MDResult` per
    system, each equal to that system run alone (:mod:`twinshard.atoms.dynamics.batch_api`):
    ``steps``, ``thermostat``, ``temperature``, ``friction``, ``seed``, ``tdamp``, ``chain``,
    ``dt`` and ``initial_temperature`` may then be lists (one value per system; a system with fewer
    steps drops out while the others continue), ``thermo`` / ``trajectory`` / ``checkpoint`` a path
    holding ``{i}`` (the system's index) or a list of paths (one file per system, each in the
    single-system format), ``restart`` the list of checkpoints a batch wrote.

    Args:
        system: a :class:`System` or an ``ase.Atoms`` (``None`` with ``restart``); or a list of
            them (a batch; ``None`` with ``restart`` a list).
        potential: any module following the potential contract
            (:mod:`twinshard.atoms.potentials.base`): ``LennardJones(...)``,
            ``MessagePassingPotential(...)``, your own; or a plain dict-contract model
            (:mod:`twinshard.atoms.parallel.plain_inputs`), e.g. a mace-torch ``MACE`` /
            ``ScaleShiftMACE`` module (wrapped in ``MaceAdapter``), run unmodified
            through the ShardTensor dispatch.
        ranks: local ranks to spawn (ignored inside a world, e.g. under torchrun).
        steps: the step the run ends at (a restarted run continues up to it).
        thermostat: ``"none"`` (NVE velocity Verlet), ``"langevin"`` (BAOAB at
            ``temperature`` K with ``friction`` 1/fs and noise ``seed``),
            ``"nose-hoover"`` (a Nose-Hoover chain of ``chain`` thermostats at ``temperature``
            K with time scale ``tdamp`` fs, default 100 ``dt``), or an integrator object
            (``VelocityVerlet(dt)``, ``Langevin(...)``, ``NoseHooverChain(...)``,
            ``IsotropicMTK(...)``).
        pressure: NPT at this pressure (bar): ``barostat="mtk"`` (isotropic Martyna-Tobias-Klein,
            :class:`~twinshard.atoms.dynamics.integrators.IsotropicMTK`, with ``thermostat=
            "nose-hoover"``), time scale ``pdamp`` fs (default 1000 ``dt``), a barostat chain of
            ``pchain``; or ``barostat="scr"``: stochastic cell rescaling (Bernetti-Bussi,
            :class:`~twinshard.atoms.dynamics.scr.StochasticCellRescaling`) with any ``thermostat``
            (``"none"``, ``"langevin"``: OBABO, ``"nose-hoover"``), ``coupling`` ``"iso"``,
            ``"aniso"`` or ``"tri"``, relaxation ``pdamp`` fs and ``compressibility`` (1/bar), its
            noise keyed by ``seed`` and the step; the thermo rows get ``volume`` and ``pressure``
            (``conserved``: the effective energy), ``info`` gets ``final_volume`` and
            ``mean_pressure``.
        dt: time step in fs.
        initial_temperature: if given, velocities are drawn from Maxwell-Boltzmann
            at this temperature (keyed by atom id and ``seed``); otherwise the
            system's velocities (ASE momenta) are kept.
        zero_momentum: remove the net momentum at the start (the centre-of-mass velocity
            subtracted from every atom, ASE's ``Stationary(preserve_temperature=False)``; one
            global sum) and count the kinetic degrees of freedom as ``3N - 3`` (the thermo
            temperature, a Nose-Hoover chain's and MTK's ``N_dof``). Default off: the velocities
            as given and ``3N`` (ASE's thermostats' convention). A setting of the integrator
            (``integ.zero_momentum``), recorded in checkpoints: a restart must match it.
        skin: Verlet skin (A); ``partition``: ``"spatial"`` or ``"block"``.
        balance: load balance of the spatial partition (halo storage): a threshold on max / mean
            owned atoms per rank (>= 1, e.g. 1.1). At the start and at every neighbour-list
            rebuild where it is exceeded, the cut planes move to balance the counts and atoms
            migrate (:mod:`twinshard.atoms.parallel.balance`); ``info`` gets
            ``owned_atoms_per_rank`` (start and final) and ``rebalances``. ``None``: equal slabs
            (the grid is still chosen where the atoms are).
        storage: ``"halo"`` (spatial domains with halos) or ``"graph"`` (plain models: atoms split
            by index, geometry replicated; :mod:`twinshard.atoms.parallel.graph_storage`).
        trajectory, trajectory_every: extxyz frames gathered on rank 0.
        thermo, thermo_every: the thermo log file (written by rank 0).
        checkpoint, checkpoint_every, restart: restart files (see :mod:`twinshard.atoms.dynamics.md`). A
            checkpoint records the potential (class, cutoff, LJ table, a digest of its
            state_dict) and the structure (:mod:`twinshard.atoms.dynamics.provenance`): a restart with
            another potential raises a ValueError naming what differs, unless
            ``allow_changed_potential``; a ``system`` given with ``restart`` must be the
            checkpoint's structure (atom count, ids, species).
        dtype: float dtype of the run (fp64 default).
        timeout: seconds the whole run may take with local ranks.
        max_temperature, max_force: sanity bounds (K, eV/A; 0 or inf: none), checked on every
            logged step (:mod:`twinshard.atoms.dynamics.sanity`); a run that exceeds one, or whose
            positions, energies or forces become non-finite, raises
            :class:`~twinshard.atoms.dynamics.sanity.Diverged` (a ValueError; in a RankFailure from local
            ranks) naming the step.

    Returns:
        :class:`MDResult`.
    """
    from twinshard.atoms.parallel.plain_inputs import as_potential
    from twinshard.runtime import get_world, in_torchrun, init_world, shared_pool

    if isinstance(system, (list, tuple)) or (system is None and isinstance(restart, (list, tuple))):
        from twinshard.atoms.dynamics.batch_api import check_batch, run_md_batch

        potential = as_potential(potential)
        check_batch(system, potential)
        opts = dict(
            ranks=ranks,
            steps=steps,
            thermostat=thermostat,
            dt=dt,
            temperature=temperature,
            friction=friction,
            tdamp=tdamp,
            chain=chain,
            pressure=pressure,
            barostat=barostat,
            pdamp=pdamp,
            pchain=pchain,
            coupling=coupling,
            compressibility=compressibility,
            seed=seed,
            initial_temperature=initial_temperature,
            zero_momentum=zero_momentum,
            skin=skin,
            storage=storage,
            trajectory=trajectory,
            trajectory_every=max(1, int(trajectory_every)),
            thermo=thermo,
            thermo_every=max(1, int(thermo_every)),
            checkpoint=checkpoint,
            checkpoint_every=int(checkpoint_every),
            restart=restart,
            allow_changed_potential=bool(allow_changed_potential),
            dtype=dtype,
            timeout=timeout,
            max_temperature=bound("max_temperature", max_temperature),
            max_force=bound("max_force", max_force),
        )
        if balance is not None or partition != "spatial":
            raise ValueError("a batch runs in graph storage, split by index: no partition= or balance=")

        return run_md_batch(system, potential, opts, _integrator)
    storage = storage or "halo"
    if system is None and restart is None:
        raise ValueError("give a system (System or ase.Atoms), or restart=checkpoint file")
    potential = as_potential(potential)  # a bare MACE module: behind MaceAdapter
    if not hasattr(potential, "cutoff"):
        raise TypeError("potential must have a float `cutoff` and forward(graph) -> per-atom energies")
    if system is not None:
        system = as_system(system, dtype, what="run_md's system")
    if system is not None and hasattr(potential, "check_species"):  # every rank has the system here
        potential.check_species(system.numbers.unique().tolist())
    integ = _integrator(
        thermostat,
        pressure,
        dt=dt,
        temperature=temperature,
        friction=friction,
        seed=seed,
        tdamp=tdamp,
        chain=chain,
        barostat=barostat,
        pdamp=pdamp,
        pchain=pchain,
        coupling=coupling,
        compressibility=compressibility,
    )
    if zero_momentum:
        integ.zero_momentum = True  # a setting of the integrator (its state, the checkpoint)
    if balance is not None:
        if storage != "halo" or partition != "spatial":
            raise ValueError(
                "balance= moves the cut planes of the spatial partition: it runs with storage='halo', "
                "partition='spatial' (graph storage and the block partition are balanced by index)"
            )
        if not (float(balance) >= 1.0 and math.isfinite(float(balance))):
            raise ValueError(
                f"balance is a threshold on max/mean owned atoms, >= 1 (e.g. 1.1); got {balance}"
            )
    opts = MDOptions(
        steps=int(steps),
        skin=float(skin),
        partition=partition,
        balance=None if balance is None else float(balance),
        storage=storage,
        trajectory=None if trajectory is None else os.fspath(trajectory),
        trajectory_every=max(1, int(trajectory_every)),
        thermo=None if thermo is None else os.fspath(thermo),
        thermo_every=max(1, int(thermo_every)),
        checkpoint=None if checkpoint is None else os.fspath(checkpoint),
        checkpoint_every=int(checkpoint_every),
        restart=None if restart is None else os.fspath(restart),
        allow_changed_potential=bool(allow_changed_potential),
        progress=bool(progress),
        max_temperature=bound("max_temperature", max_temperature),
        max_force=bound("max_force", max_force),
        dtype=dtype,
    )
    start = {"initial_temperature": initial_temperature, "seed": int(seed)}
    world = get_world()
    if world is None and in_torchrun():
        world = init_world()
    if world is not None:
        return _md_rank(system, potential, integ, opts, start)
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    from twinshard.runtime.world import COLLECTIVE_TIMEOUT

    outs = shared_pool().run(
        _md_rank,
        int(ranks),
        system,
        potential,
        integ,
        opts,
        start,
        timeout=min(float(timeout), COLLECTIVE_TIMEOUT),
        deadline=float(timeout),
    )
    return outs[0]


def _md_rank(
    system: System | None,
    potential: nn.Module,
    integ: VelocityVerlet,
    opts: MDOptions,
    start: dict[str, Any],
) -> MDResult:
    """Every rank: :func:`twinshard.atoms.dynamics.run.run_rank` on rank 0's system (velocities
    drawn at ``start["initial_temperature"]`` when given), its final state as an :class:`MDResult`.

    Collectives: those of the rank body (the scatter, :func:`simulate` (see
    ``twinshard.atoms.dynamics.driver``), one final evaluation with stress, two all_gathers (ids,
    forces) and the final gather).
    """

    def load() -> System:  # rank 0
        assert system is not None
        mine = system.clone()
        if start["initial_temperature"] is not None:
            mine.velocities = maxwell_boltzmann(
                mine.masses, mine.ids, float(start["initial_temperature"]), seed=start["seed"]
            )
        return mine

    run = run_rank(opts, integ, potential, load, named=system is not None, spelling=PYTHON)
    sharded, fin, out = run.sharded, run.final_results, run.out
    return MDResult(
        system=run.final,
        thermo=out["thermo"],
        energy=float(fin.energy),
        forces=run.final_forces if sharded.rank == 0 else None,
        stress=fin.stress,
        virial=fin.virial,
        ranks=sharded.nranks,
        migrations=int(sharded.migrations),
        steps=opts.steps,
        start_step=run.start_step,
        seconds=out["seconds"],
        info={
            "file_repairs": run.notes,
            "potential_notice": run.notice,
            **npt_figures(out["thermo"]),
            "owned_atoms_per_rank_start": run.owned_start,
            "owned_atoms_per_rank": sharded.counts(),
            "rebalances": int(getattr(sharded, "rebalances", 0)),
            "rank_grid": _grid_of(sharded),
            **{k: v if v < float("inf") else None for k, v in run.bounds.items()},
        },
    )


def _grid_of(sharded: Any) -> list[int] | None:
    """The spatial rank grid, or None (block partition, graph storage)."""
    grid = getattr(getattr(sharded, "partition", None), "grid", None)
    return None if grid is None else [int(g) for g in grid]
