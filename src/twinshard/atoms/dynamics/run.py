"""The one rank body of distributed MD: :func:`run_rank`. ``twinshard md``
(:func:`twinshard.atoms.dynamics.driver.md_rank`: its figures and ``--check-serial``) and
:func:`twinshard.atoms.run_md` (:mod:`twinshard.atoms.dynamics.api`: its :class:`MDResult`) are
thin layers over it; the options both take are :class:`MDOptions`.

Every rank, in order:

1. one fail-together step: the options are checked, rank 0 loads the start structure (or the
   checkpoint of ``restart``: the integrator's settings, a structure given beside it and the step
   count are checked), and prepares the output files (writable paths, stale temporaries, torn
   tails);
2. rank 0's species and restart state (start step, bath heat, the thermostat's variables) are
   broadcast; the potential is built from the species where a factory was given, and in a second
   fail-together step its provenance is checked against the checkpoint's;
3. the system is scattered to its storage and the distributed potential built
   (:func:`twinshard.atoms.parallel.evaluate.place`: one storage factory, one model contract);
4. :func:`~twinshard.atoms.dynamics.md.simulate` runs the steps (checkpoints, trajectory and
   thermo written by rank 0);
5. the final configuration is evaluated with stress, its forces gathered by id, and the system
   gathered on rank 0.

Collectives: step 1's agreement, two broadcasts (species mask, restart state), step 2's
agreement, the storage's scatter, the MD loop's (see :mod:`twinshard.atoms.dynamics.driver`), one
final evaluation, two all_gathers (ids, forces) and the final gather. With ``measure`` the first
force evaluation is profiled for its peak tensor memory, the resident peak (VmHWM) is taken over
the loop and the ledger counts its bytes; with ``check_serial`` rank 0 keeps the start system and
every rank gathers the start forces by id (the serial twin's inputs).

Placements: rank 0 holds the start system (loaded or from the checkpoint) until the scatter; then
every rank holds its owned atoms (halo storage: and their halo rows; graph storage: the replicated
geometry) through the run; at the end the forces by id are replicated (``N x 3`` per rank) and the
final system is gathered on rank 0. Memory per rank: the storage's (``~N / P`` owned atoms plus
the ghost shell in halo storage), rank 0 the whole system only at the start and the end (and
through the run with ``check_serial``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from twinshard.atoms.data.system import System
from twinshard.atoms.dynamics.md import (
    ThermoLog,
    VelocityVerlet,
    check_restart,
    dynamic_values,
    load_checkpoint,
    load_dynamic_values,
    simulate,
)
from twinshard.atoms.dynamics.md_files import prepare_outputs
from twinshard.atoms.dynamics.provenance import check_potential, check_structure, potential_provenance
from twinshard.atoms.dynamics.sanity import MAX_FORCE, MAX_TEMPERATURE, bound
from twinshard.atoms.parallel.storage import STORAGES
from twinshard.memory import storage_bytes

__all__ = [
    "CLI",
    "PYTHON",
    "DistributedEngine",
    "MDOptions",
    "MDResult",
    "MDRun",
    "Spelling",
    "npt_figures",
    "run_rank",
    "tensor_bytes",
]


@dataclass(frozen=True)
class Spelling:
    """How the caller names its options, for the errors and notices one of its users reads."""

    who: str  # the entry point, leading a notice line
    step: str  # the entry point in the fail-together steps' names
    steps: str
    outputs: tuple[str, str, str]  # the checkpoint, trajectory and thermo paths
    same: str  # what to repeat so the restart uses the checkpoint's potential
    override: str  # the option that accepts another potential


CLI = Spelling(
    "twinshard md",
    "md",
    "--steps",
    ("--checkpoint", "--trajectory", "--thermo"),
    "--potential/--cutoff/--epsilon/--sigma/--lj/--no-shift/--model options",
    "--allow-changed-potential",
)
PYTHON = Spelling(
    "twinshard.atoms.run_md",
    "run_md",
    "steps",
    ("checkpoint=", "trajectory=", "thermo="),
    "potential (class, cutoff, parameters)",
    "allow_changed_potential=True",
)


@dataclass
class MDOptions:
    """The options of a distributed MD run besides the structure, the potential and the integrator
    (picklable, the same on every rank). ``twinshard md``'s ``MDConfig`` extends it."""

    steps: int = 100
    skin: float = 1.0
    partition: str = "spatial"
    balance: float | None = None
    storage: str = "halo"
    trajectory: str | None = None
    trajectory_every: int = 10
    thermo: str | None = None
    thermo_every: int = 10
    checkpoint: str | None = None
    checkpoint_every: int = 0
    restart: str | None = None
    allow_changed_potential: bool = False
    progress: bool = False
    max_temperature: float = MAX_TEMPERATURE
    max_force: float = MAX_FORCE
    dtype: torch.dtype | None = None  # the state's dtype after a restart (None: the checkpoint's)
    measure: bool = False  # profile the first evaluation, the resident peak and the ledger bytes
    check_serial: bool = False  # keep what the serial twin needs (rank 0's start system, forces)


@dataclass
class MDResult:
    """What :func:`run_md` returns.

    ``system``: the final System (ordered by id; ``None`` on ranks other than 0
    under torchrun); ``thermo``: the thermo log (every rank); ``energy``,
    ``forces [n, 3]`` (rows of ``system``), ``stress`` and ``virial`` ``[3, 3]`` of
    the final configuration (sign convention of
    :mod:`twinshard.atoms.potentials.base`; ``stress`` is ``None`` without a cell
    volume); ``migrations`` and ``ranks`` of the run; ``info["file_repairs"]``: what rank 0
    removed or cut from the output files before step 1 (stale temporaries, torn tails; see
    :mod:`twinshard.atoms.dynamics.md_files`); ``info["max_temperature"]``, ``info["max_force"]``: the
    sanity bounds it was checked against (K, eV/A; ``None``: no bound);
    ``info["potential_notice"]``: on a restart with ``allow_changed_potential``, what changed
    (``None``: nothing).
    """

    system: System | None
    thermo: ThermoLog
    energy: float
    forces: torch.Tensor | None
    stress: torch.Tensor | None
    virial: torch.Tensor | None
    ranks: int
    migrations: int
    steps: int
    start_step: int = 0
    seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def atoms(self) -> Any:
        """The final system as an ``ase.Atoms`` (rank 0), with forces/stress attached."""
        if self.system is None:
            return None
        from ase.calculators.singlepoint import SinglePointCalculator

        atoms = self.system.to_ase()
        props: dict[str, Any] = {"energy": self.energy}
        if self.forces is not None:
            props["forces"] = self.forces.detach().cpu().double().numpy()
        if self.stress is not None:
            s = self.stress.detach().cpu().double()
            props["stress"] = [
                float(s[0, 0]),
                float(s[1, 1]),
                float(s[2, 2]),
                float(s[1, 2]),
                float(s[0, 2]),
                float(s[0, 1]),
            ]
        atoms.calc = SinglePointCalculator(atoms, **props)
        return atoms


@dataclass
class MDRun:
    """What :func:`run_rank` leaves on a rank (``rank 0`` marks what only rank 0 holds)."""

    potential: nn.Module
    integrator: VelocityVerlet
    sharded: Any  # the storage (twinshard.atoms.parallel.storage.Storage)
    distributed: Any  # its DistributedPotential
    start_step: int
    heat: float  # bath heat at the start step
    dynamic: list[float]  # the thermostat's variables at the start step
    bounds: dict[str, float]  # the sanity bounds checked (inf: none)
    out: dict[str, Any]  # simulate's (thermo log, seconds, heat)
    final_results: Any  # the final configuration's Results (with stress; this rank's rows)
    final_forces: torch.Tensor  # every atom's final force, ordered by id (replicated)
    final: System | None  # rank 0: the gathered final system
    owned_start: list[int]  # owned atoms per rank after the scatter
    halo_start: int  # this rank's halo rows after the scatter
    notes: list[str] = field(default_factory=list)  # rank 0: what prepare_outputs did
    notice: str | None = None  # what changed in the potential (allowed restarts)
    # measure / check_serial
    first: Any = None  # the start evaluation's Results (with stress)
    peak_bytes: int = 0  # resident tensors plus the first evaluation's tensor peak
    rss: Any = None  # the RssWindow over the loop
    comm_bytes: float = 0.0  # ledger max(sent, received) over the loop
    system: System | None = None  # rank 0, check_serial: the start system
    start_ids: torch.Tensor | None = None  # rank 0: the start system's ids, sorted
    start_forces: torch.Tensor | None = None  # check_serial: start forces ordered by id


@dataclass
class _Start:
    """What every rank agreed before the scatter (``rank 0``: only rank 0 holds it)."""

    integrator: VelocityVerlet
    potential: nn.Module
    system: System | None  # rank 0: the start (or checkpoint) system
    start_step: int
    heat: float
    dynamic: list[float]
    bounds: dict[str, float]
    notes: list[str]  # rank 0
    notice: str | None
    provenance: dict[str, Any] | None  # rank 0: written into the checkpoints


def run_rank(
    opts: MDOptions,
    integrator: VelocityVerlet | Callable[[], VelocityVerlet],
    potential: nn.Module | Callable[[list[int]], nn.Module],
    load: Callable[[], System],
    *,
    named: bool = True,
    model_file: str | None = None,
    spelling: Spelling = PYTHON,
) -> MDRun:
    """Every rank of the current world: one distributed MD run (module docstring).

    ``integrator``: the integrator, or a builder called inside the first fail-together step (its
    option errors then reach every rank); ``potential``: a module, or a builder called on every
    rank with the atomic numbers of rank 0's structure; ``load``: rank 0's start structure (called
    for a fresh run, and on a restart to check a structure given beside the checkpoint when
    ``named``); ``model_file``: the file the potential came from (its digest goes into the
    checkpoints' provenance)."""
    from twinshard.atoms.parallel.evaluate import place, rows_by_id
    from twinshard.comm import CommLedger
    from twinshard.memory import RssWindow, peak_memory_during

    st = _start(opts, integrator, potential, load, named, model_file, spelling)
    sharded, dp = place(
        st.system,
        st.potential,
        storage=opts.storage,
        skin=opts.skin,
        partition=opts.partition,
        balance=opts.balance,
    )
    run = MDRun(
        potential=st.potential,
        integrator=st.integrator,
        sharded=sharded,
        distributed=dp,
        start_step=st.start_step,
        heat=st.heat,
        dynamic=st.dynamic,
        bounds=st.bounds,
        out={},
        final_results=None,
        final_forces=torch.empty(0),
        final=None,
        owned_start=sharded.counts(),
        halo_start=sharded.n_halo,
        notes=st.notes,
        notice=st.notice,
    )
    if opts.measure:  # resident peak: from the first force evaluation to the end of the loop
        run.rss = RssWindow().__enter__()
        run.first, peak = peak_memory_during(lambda: dp.compute(sharded, compute_stress=True), sharded.device)
        run.peak_bytes = tensor_bytes(sharded) + int(peak)
    if opts.check_serial:  # replicated option: every rank takes the same branch
        if run.first is None:
            run.first = dp.compute(sharded, compute_stress=True)
        _, run.start_forces = rows_by_id(sharded, run.first.forces, op="md_check")
        run.system = st.system  # rank 0 keeps the whole start system only for the serial twin
    if st.system is not None:
        run.start_ids = torch.sort(st.system.ids).values
    st.system = None  # rank 0 keeps no whole-system copy through the run (but for check_serial)
    ledger = CommLedger() if opts.measure else contextlib.nullcontext()
    with ledger:
        run.out = simulate(
            DistributedEngine(sharded, dp),
            st.integrator,
            opts.steps,
            thermo_every=max(1, opts.thermo_every),
            thermo_path=opts.thermo,
            trajectory=opts.trajectory,
            trajectory_every=max(1, opts.trajectory_every),
            progress=opts.progress and sharded.rank == 0,
            start_step=st.start_step,
            heat=st.heat,
            checkpoint=opts.checkpoint,
            checkpoint_every=opts.checkpoint_every,
            check_files=False,  # done in the first fail-together step
            provenance=st.provenance,
            **st.bounds,
        )
    if opts.measure:
        run.rss.__exit__(None, None, None)
        assert isinstance(ledger, CommLedger)
        run.comm_bytes = max(ledger.bytes_sent, ledger.bytes_recv) / max(opts.steps - st.start_step, 1)
    run.final_results = dp.compute(sharded, compute_stress=True)  # final stress and virial
    _, run.final_forces = rows_by_id(sharded, run.final_results.forces, op="md_final")
    run.final = sharded.gather(0)
    return run


def _start(
    opts: MDOptions,
    integrator: VelocityVerlet | Callable[[], VelocityVerlet],
    potential: nn.Module | Callable[[list[int]], nn.Module],
    load: Callable[[], System],
    named: bool,
    model_file: str | None,
    spelling: Spelling,
) -> _Start:
    """Steps 1 and 2 of the module docstring: two fail-together steps and two broadcasts."""
    from twinshard.comm import primitives as prim
    from twinshard.runtime import agree_step, require_world

    world = require_world(spelling.who)
    rank, dev = world.rank, world.device  # every collective payload and per-atom tensor lives here
    mask = torch.zeros(119, dtype=torch.int64, device=dev)
    system: System | None = None
    saved: dict[str, Any] | None = None  # rank 0: the checkpoint, for the provenance check
    notes: list[str] = []
    resume: Any = None
    with agree_step(f"{spelling.step}: load the structure and check the options"):
        integ = integrator if isinstance(integrator, VelocityVerlet) else integrator()
        # [start step, bath heat so far, the thermostat's variables (their count is a setting)]
        resume = torch.zeros(2 + len(dynamic_values(integ)), dtype=torch.float64, device=dev)
        if opts.steps < 0:
            raise ValueError(f"{spelling.steps} must be >= 0, got {opts.steps}")
        if opts.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {opts.checkpoint_every}")
        if opts.storage not in STORAGES:
            raise ValueError(f"storage must be one of {STORAGES}, got {opts.storage!r}")
        bounds = {k: bound(k, getattr(opts, k)) for k in ("max_temperature", "max_force")}
        if rank == 0:
            if opts.restart:
                saved = _resume_from(opts, integ, load if named else None, spelling, resume)
                system = saved["system"] if opts.dtype is None else saved["system"].to(dtype=opts.dtype)
            else:
                system = load()
            mask[system.numbers.unique().to(dev)] = 1
            # the only writer checks its paths and repairs torn tails here, so errors reach every rank
            paths = (opts.checkpoint, opts.trajectory, opts.thermo)
            notes = prepare_outputs(int(resume[0]), *paths, names=spelling.outputs)
    mask = prim.broadcast(mask, 0, None, op="md_setup")
    resume = prim.broadcast(resume, 0, None, op="md_setup")
    dyn0 = resume[2:].tolist()  # every rank's chain, and a serial twin, start here
    load_dynamic_values(integ, dyn0)
    species = torch.nonzero(mask).flatten().tolist()
    provenance = changed = None
    with agree_step(f"{spelling.step}: build the potential"):
        if not isinstance(potential, nn.Module):
            potential = potential(species)  # replicated: the species are agreed
        potential = potential.to(dev)  # where it runs; its provenance is read there too
        if rank == 0:  # it holds the checkpoint; the step raises a difference on every rank
            provenance = potential_provenance(potential, model_file)
            if saved is not None:
                changed = check_potential(
                    saved,
                    provenance,
                    repr(opts.restart),
                    same=spelling.same,
                    override=spelling.override,
                    allow=opts.allow_changed_potential,
                )
    if changed:
        print(f"{spelling.who}: {changed}", file=sys.stderr, flush=True)
    return _Start(
        integ, potential, system, int(resume[0]), float(resume[1]), dyn0, bounds, notes, changed, provenance
    )


def _resume_from(
    opts: MDOptions,
    integ: VelocityVerlet,
    named: Callable[[], System] | None,
    spelling: Spelling,
    resume: torch.Tensor,
) -> dict[str, Any]:
    """Rank 0: the checkpoint of ``opts.restart``, checked (the integrator's settings, a structure
    given beside it, the step count); the integrator loads its chain's variables and ``resume``
    gets ``[step, heat, variables]``."""
    state = load_checkpoint(opts.restart)
    check_restart(state, integ, repr(opts.restart))
    if named is not None:
        check_structure(state, named(), repr(opts.restart))
    if state["step"] > opts.steps:
        raise ValueError(
            f"checkpoint {opts.restart!r} is at step {state['step']} but {spelling.steps} "
            f"is {opts.steps}: {spelling.steps} counts the whole run, give a larger total"
        )
    integ.load_state(state["integrator"])  # the chain's variables, checked here
    resume[0], resume[1] = float(state["step"]), float(state["heat"])
    resume[2:] = torch.tensor(dynamic_values(integ), dtype=torch.float64)
    return state


def tensor_bytes(*objs: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``objs`` (3 levels deep)."""
    found: list[torch.Tensor] = []

    def visit(o: Any, depth: int) -> None:
        if torch.is_tensor(o):
            found.append(o)
            return
        if depth == 0 or isinstance(o, (str, bytes, int, float, bool)) or o is None:
            return
        if isinstance(o, dict):
            items = list(o.values())
        elif isinstance(o, (list, tuple)):
            items = list(o)
        elif hasattr(o, "__dict__"):
            items = [v for v in vars(o).values() if not isinstance(v, torch.nn.Module)]
        else:
            return
        for v in items:
            visit(v, depth - 1)

    for o in objs:
        visit(o, 3)
    return storage_bytes(found)


class DistributedEngine:
    """The :class:`~twinshard.atoms.dynamics.md.Engine` of one rank: owned atoms of a ShardedSystem.

    ``set_state(moved=True)`` calls ``sharded.update()`` (collective; may
    migrate atoms and reorder rows), ``compute`` the distributed potential
    (collective), ``reduce_sum`` one all_reduce, ``gather`` the whole system on
    rank 0 (collective).
    """

    def __init__(self, sharded: Any, potential: Any) -> None:
        self.sharded = sharded
        self.potential = potential
        self.rank = sharded.rank
        self.n_ranks = sharded.nranks
        self.n_atoms = sharded.n_total

    positions = property(lambda self: self.sharded.positions)
    velocities = property(lambda self: self.sharded.velocities)
    masses = property(lambda self: self.sharded.masses)
    ids = property(lambda self: self.sharded.ids)
    cell = property(lambda self: self.sharded.cell)
    pbc = property(lambda self: self.sharded.pbc)
    need_virial = False  # set by a barostat's bind: compute() then also returns the virial
    virial: torch.Tensor | None = None  # of the last compute(), all-reduced by the potential
    cell_can_change = property(lambda self: hasattr(self.sharded, "set_cell"))

    def set_cell(self, cell: torch.Tensor) -> None:
        """A barostat's new cell, the same on every rank (no communication); the storage follows it
        (halo: the partition; graph: the edges' Cartesian shifts), and the next
        ``set_state(moved=True)`` rebuilds the neighbour lists (halo: and the plan) when the skin no
        longer covers the strain (the rule of both storages' ``update``)."""
        if not hasattr(self.sharded, "set_cell"):
            raise ValueError(f"a barostat changes the cell, which {type(self.sharded).__name__} cannot")
        self.sharded.set_cell(cell)

    def set_state(self, positions: torch.Tensor, velocities: torch.Tensor, moved: bool) -> None:
        self.sharded.positions = positions.contiguous()
        self.sharded.velocities = velocities.contiguous()
        if moved:
            self.sharded.update()

    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        res = self.potential.compute(self.sharded, compute_stress=self.need_virial)
        self.virial = res.virial if self.need_virial else None  # replicated (all-reduced)
        return res.energy, res.forces

    def reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        from twinshard.comm import primitives as prim

        y = x.reshape(-1).to(prim.reduce_dtype(x.dtype)).contiguous()
        return prim.all_reduce(y, self.sharded.group, op="thermo").to(x.dtype).reshape(x.shape)

    def gather(self) -> System | None:
        return self.sharded.gather(0)


def npt_figures(thermo: Any) -> dict[str, float | None]:
    """``final_volume`` (A^3) and ``mean_pressure`` (bar, over the logged rows after the start; a
    restarted run: its own rows) of a barostat's run; ``None`` without one."""
    rows = thermo.rows
    if not rows or "volume" not in rows[-1]:
        return {"final_volume": None, "mean_pressure": None}
    later = rows[1:] or rows
    return {
        "final_volume": rows[-1]["volume"],
        "mean_pressure": sum(r["pressure"] for r in later) / len(later),
    }
