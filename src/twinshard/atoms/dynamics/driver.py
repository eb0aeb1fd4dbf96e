"""The MD driver: ``twinshard md``, serial and distributed with one integrator (its command
line, parser and local-rank launch: :mod:`twinshard.cli.md`).

Distributed, every rank runs :func:`md_rank`: rank 0 loads the structure (an
embedded default or a file, inside a fail-together step), the system is
scattered with :class:`~twinshard.atoms.parallel.sharded.ShardedSystem`, forces come
from :class:`~twinshard.atoms.parallel.distributed.DistributedPotential`, and the
integrators of :mod:`twinshard.atoms.dynamics.md` step each rank's owned atoms;
``ShardedSystem.update`` migrates atoms and rebuilds halos when any atom moved
more than half the skin. Langevin noise is keyed by global atom id, so the
trajectory equals the serial one for any rank count. ``--storage graph`` uses
:class:`~twinshard.atoms.parallel.graph_storage.GraphSharded` instead (plain models: atoms
split by index, geometry replicated and re-replicated by one all_gather per step).

``--check-serial`` makes rank 0 also run the serial potential and trajectory
(:class:`~twinshard.atoms.dynamics.md.SerialEngine`, same integrator) from the same
start and report the differences.

Collectives per MD step (distributed): the potential's (halo forward exchange
of positions and one per message-passing layer, their reverse exchanges in
backward, one all_reduce of the energy), ``update``'s all_gather of the
largest displacement and the position sanity report (plus, on a rebuild, migration
all_to_alls and the halo plan; graph storage: the all_gather of the owned positions
instead), and one thermo all_reduce (kinetic energy, bath heat and each rank's largest
force) on logged steps; ``--thermostat nose-hoover`` adds two all_reduces of one scalar (the
global kinetic energy that drives the chain, :class:`~twinshard.atoms.dynamics.integrators.NoseHooverChain`)
per step. The sanity checks (:mod:`twinshard.atoms.dynamics.sanity`: non-finite or
runaway positions every step; non-finite energies or forces, ``--max-temperature`` and
``--max-force`` on logged steps) ride on those collectives and add none; every rank raises
the same error.

Figures (per rank, reported by rank 0):
- ``peak_memory_bytes_per_rank``: tensor bytes resident between steps (owned
  state, halo plan, neighbour list) plus the peak allocated during one force
  evaluation (forward + backward), from the profiler's allocator events on CPU
  (``max_memory_allocated`` on CUDA); it raises rather than report 0 when the
  profiler cannot measure. ``serial_peak_memory_bytes``: the same for the
  serial engine.
- ``peak_rss_bytes_per_rank``: the process's peak resident memory (VmHWM) from
  the first force evaluation to the end of the MD loop, reset at its start where
  the kernel permits (``rss_reset_per_rank`` says whether it did); absolute, so it
  includes the torch libraries and everything outside tensors (neighbour
  lists, communication buffers). ``serial_peak_rss_bytes``: rank 0's process
  over the serial reference run.
- ``comm_bytes_per_step_per_rank``: ledger ``max(bytes_sent, bytes_recv)`` over
  the MD loop divided by the steps; modelled bytes (``comm_bytes_model``).
- ``stress``/``virial`` (start) and ``final_stress``/``final_virial`` (end),
  3x3, sign convention of :mod:`twinshard.atoms.potentials.base`.

Restart: ``--checkpoint FILE --checkpoint-every K`` writes the gathered system,
the step, the integrator state (settings; a Nose-Hoover chain's variables), the RNG position
and the bath heat atomically on rank 0; ``--restart FILE`` continues from it, at any rank count,
up to ``--steps`` (which counts the whole run). Before step 1 rank 0 checks that the
``--checkpoint/--trajectory/--thermo`` paths are writable, removes the temporaries killed
writers left, and on a restart cuts torn tails (:mod:`twinshard.atoms.dynamics.md_files`; the result's
``file_repairs`` lists what it did). A checkpoint records the potential and the structure
(:mod:`twinshard.atoms.dynamics.provenance`); a restart with another potential (class, cutoff, LJ table,
weights, model file) refuses unless ``--allow-changed-potential`` (then the result's
``potential_notice`` says what changed), and a structure given with ``--restart`` must be the
checkpoint's (atom count, ids, species).
- ``ghost_shell_estimate``: halo atoms one rank must import if its
  subdomain is a slab (fractional widths ``1/g_a``) and the ghost width is
  ``w = cutoff + skin``: ``rho V [prod_a (1/g_a + 2 w / h_a) - 1/P]`` with
  ``h_a`` the cell heights (only split axes extend: along a periodic axis with one rank the
  block stays periodic and images are edge shifts, not halo rows; so it is 0 at P = 1).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from twinshard.atoms.data.system import System
from twinshard.atoms.dynamics.config import (  # re-exported: driver held them before
    DEFAULT_ATOMS,
    RESULT_KEYS,
    MDConfig,
    ghost_shell_estimate,
    lj_parameters,
    load_structure,
    make_integrator,
    potential_from_config,
)
from twinshard.atoms.dynamics.md import (
    SerialEngine,
    check_restart,
    dynamic_values,
    load_checkpoint,
    load_dynamic_values,
    simulate,
)
from twinshard.atoms.dynamics.md_files import prepare_outputs
from twinshard.atoms.dynamics.provenance import check_potential, check_structure, potential_provenance
from twinshard.atoms.dynamics.sanity import bound
from twinshard.atoms.parallel.plain_inputs import evaluate_reference, evaluate_serial, potential_mode
from twinshard.atoms.potentials.base import error_figures
from twinshard.memory import RssWindow, peak_memory_during, storage_bytes
from twinshard.runtime.world import COLLECTIVE_TIMEOUT  # noqa: F401  (moved to the runtime; re-exported)

__all__ = [
    "DEFAULT_ATOMS",
    "RESULT_KEYS",
    "MDConfig",
    "DistributedEngine",
    "ghost_shell_estimate",
    "load_structure",
    "lj_parameters",
    "make_integrator",
    "md_rank",
    "potential_from_config",
]

# ------------------------------------------------------------------------ measurement


def _tensor_bytes(*objs: Any) -> int:
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


# ------------------------------------------------------------------------ engines


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


# ------------------------------------------------------------------------ one rank


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


def _by_id(ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return rows[torch.argsort(ids)]


def md_rank(cfg: MDConfig) -> dict[str, Any]:
    """Run on every rank of the current world; rank 0 returns the full result dict.

    With ``cfg.restart`` the run continues from a checkpoint (any rank count: the
    whole system is scattered again) up to step ``cfg.steps``; with
    ``cfg.checkpoint`` it writes one every ``cfg.checkpoint_every`` steps and at the
    end (gathered on rank 0, atomic).
    """
    from twinshard.atoms.parallel.balance import imbalance
    from twinshard.atoms.parallel.distributed import DistributedPotential
    from twinshard.atoms.parallel.storage import scatter_storage
    from twinshard.comm import CommLedger
    from twinshard.comm import primitives as prim
    from twinshard.comm.ledger import BYTES_MODEL
    from twinshard.runtime import agree_step, require_world

    world = require_world("twinshard md")
    rank, nranks = world.rank, world.size
    system: System | None = None
    dev = world.device  # every collective payload and per-atom tensor lives here
    mask = torch.zeros(119, dtype=torch.int64, device=dev)
    notes: list[str] = []  # rank 0: what prepare_outputs removed or cut
    saved: dict[str, Any] | None = None  # rank 0: the checkpoint, for the provenance check
    resume: Any = None
    with agree_step("md: load the structure and check the options"):
        integ = make_integrator(cfg)  # option errors surface on every rank
        # [start step, bath heat so far, the thermostat's variables (their count is a setting)]
        resume = torch.zeros(2 + len(dynamic_values(integ)), dtype=torch.float64, device=dev)
        if cfg.steps < 0:
            raise ValueError(f"steps must be >= 0, got {cfg.steps}")
        if cfg.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every must be >= 0, got {cfg.checkpoint_every}")
        bounds = {k: bound(k, getattr(cfg, k)) for k in ("max_temperature", "max_force")}
        if rank == 0:
            if cfg.restart:
                saved = state = load_checkpoint(cfg.restart)
                check_restart(state, integ, repr(cfg.restart))
                if cfg.structure is not None or cfg.atoms is not None:  # a structure was named
                    check_structure(state, load_structure(cfg), repr(cfg.restart))
                if state["step"] > cfg.steps:
                    raise ValueError(
                        f"checkpoint {cfg.restart!r} is at step {state['step']} but --steps is "
                        f"{cfg.steps}: --steps counts the whole run, give a larger total"
                    )
                system = state["system"]
                integ.load_state(state["integrator"])  # the chain's variables, checked here
                resume[0], resume[1] = float(state["step"]), float(state["heat"])
                resume[2:] = torch.tensor(dynamic_values(integ), dtype=torch.float64)
            else:
                system = load_structure(cfg)
            mask[system.numbers.unique().to(dev)] = 1
            # the only writer checks its paths and repairs torn tails here, so errors reach every rank
            notes = prepare_outputs(int(resume[0]), cfg.checkpoint, cfg.trajectory, cfg.thermo)
    mask = prim.broadcast(mask, 0, None, op="md_setup")
    resume = prim.broadcast(resume, 0, None, op="md_setup")
    start_step, heat0 = int(resume[0]), float(resume[1])
    dyn0 = resume[2:].tolist()  # every rank's chain, and --check-serial's serial twin, start here
    load_dynamic_values(integ, dyn0)
    species = torch.nonzero(mask).flatten().tolist()
    provenance = changed = None
    with agree_step("md: build the potential"):
        potential = potential_from_config(cfg, species).to(dev)  # e.g. the LJ species table
        if rank == 0:  # it holds the checkpoint; the step raises a difference on every rank
            provenance = potential_provenance(potential, cfg.model)
            if saved is not None:
                changed = check_potential(
                    saved,
                    provenance,
                    repr(cfg.restart),
                    same="--potential/--cutoff/--epsilon/--sigma/--lj/--no-shift/--model options",
                    override="--allow-changed-potential",
                    allow=cfg.allow_changed_potential,
                )
    if changed:
        print(f"twinshard md: {changed}", file=sys.stderr, flush=True)
    sharded = scatter_storage(
        cfg.storage,
        system,
        0,
        cutoff=float(potential.cutoff),
        skin=cfg.skin,
        partition=cfg.partition,
        balance=cfg.balance,
    )
    dp = DistributedPotential(potential, mode=potential_mode(potential))  # MACE: through the dispatch
    halo0 = sharded.n_halo
    owned0 = sharded.n_owned
    shell = ghost_shell_estimate(
        sharded.n_total,
        sharded.cell,
        sharded.pbc,
        tuple(getattr(sharded.partition, "grid", (nranks, 1, 1))),
        sharded.cutoff + sharded.skin,
    )
    if cfg.storage == "graph":
        shell = None  # no halo: every rank holds the whole geometry
    device = sharded.positions.device

    rss = RssWindow().__enter__()  # resident peak: from the first force evaluation to the end of the loop
    # the start: parity figures and the per-rank tensor memory of one force evaluation
    res0, peak = peak_memory_during(lambda: dp.compute(sharded, compute_stress=True), device)
    resident = _tensor_bytes(sharded)
    start_ids = start_forces = None
    if cfg.check_serial:  # replicated option: every rank takes the same branch
        counts = sharded.counts()
        start_ids = prim.all_gather(sharded.ids.contiguous(), 0, None, counts, op="md_check")
        start_forces = prim.all_gather(res0.forces.contiguous(), 0, None, counts, op="md_check")
    all_ids = None
    if system is not None:
        all_ids = torch.sort(system.ids).values
        if not cfg.check_serial:
            system = None  # rank 0 keeps no whole-system copy through the run

    engine = DistributedEngine(sharded, dp)
    with CommLedger() as ledger:
        out = simulate(
            engine,
            integ,
            cfg.steps,
            thermo_every=max(1, cfg.thermo_every),
            thermo_path=cfg.thermo,
            trajectory=cfg.trajectory,
            trajectory_every=max(1, cfg.trajectory_every),
            progress=cfg.progress and rank == 0,
            start_step=start_step,
            heat=heat0,
            checkpoint=cfg.checkpoint,
            checkpoint_every=cfg.checkpoint_every,
            check_files=False,  # done above, inside the fail-together step
            provenance=provenance,
            **bounds,
        )
    rss.__exit__(None, None, None)
    steps = max(cfg.steps - start_step, 1)
    comm = max(ledger.bytes_sent, ledger.bytes_recv) / steps
    fin = dp.compute(sharded, compute_stress=True)  # final stress and virial (collective)
    final_ids = final_forces = None
    if cfg.json_arrays:
        counts = sharded.counts()
        final_ids = prim.all_gather(sharded.ids.contiguous(), 0, None, counts, op="md_arrays")
        final_forces = prim.all_gather(fin.forces.contiguous(), 0, None, counts, op="md_arrays")
    final = sharded.gather(0)
    stats = torch.tensor(
        [
            [
                float(halo0),
                comm,
                float(resident + peak),
                out["seconds"],
                float(sharded.n_owned),
                float(rss.peak_bytes),
                float(rss.start_bytes),
                float(rss.reset),
                float(owned0),
                float(sharded.n_halo),
            ]
        ],
        dtype=torch.float64,
        device=dev,
    )
    stats = prim.all_gather(stats, 0, None, op="md_stats").cpu()
    if rank != 0:
        return {"rank": rank}
    assert all_ids is not None and final is not None
    thermo = out["thermo"]

    def mat(t: torch.Tensor | None) -> list[list[float]] | None:
        return None if t is None else t.detach().cpu().double().tolist()

    result: dict[str, Any] = {
        "ranks": nranks,
        "atoms": sharded.n_total,
        "steps": cfg.steps,
        "start_step": start_step,
        "potential": cfg.potential,
        "storage": cfg.storage,
        "thermostat": cfg.thermostat,
        "structure": cfg.restart or cfg.structure or "fcc_argon",
        "restart": cfg.restart,
        "checkpoint": cfg.checkpoint,
        "file_repairs": notes,
        "potential_notice": changed,
        "energy_rel_error": None,
        "max_force_error": None,
        "max_stress_error": None,
        "max_position_error": None,
        "migrations": int(sharded.migrations),
        "rebuilds": int(sharded.builds),
        "halo_atoms_per_rank": [int(v) for v in stats[:, 0].tolist()],
        "owned_atoms_per_rank": [int(v) for v in stats[:, 4].tolist()],
        "owned_atoms_per_rank_start": [int(v) for v in stats[:, 8].tolist()],
        "halo_atoms_per_rank_final": [int(v) for v in stats[:, 9].tolist()],
        "imbalance_start": imbalance(stats[:, 8].to(torch.int64)),
        "imbalance_final": imbalance(stats[:, 4].to(torch.int64)),
        "balance": cfg.balance,
        "rebalances": int(getattr(sharded, "rebalances", 0)),
        "ghost_shell_estimate": shell,
        # a block partition has no rank grid (the shell estimate then assumes P slabs)
        "rank_grid": list(sharded.partition.grid) if hasattr(sharded.partition, "grid") else None,
        "comm_bytes_per_step_per_rank": stats[:, 1].tolist(),
        "comm_bytes_model": BYTES_MODEL,
        "peak_memory_bytes_per_rank": [int(v) for v in stats[:, 2].tolist()],
        "serial_peak_memory_bytes": None,
        "peak_rss_bytes_per_rank": [int(v) for v in stats[:, 5].tolist()],
        "rss_start_bytes_per_rank": [int(v) for v in stats[:, 6].tolist()],
        "rss_reset_per_rank": [bool(v) for v in stats[:, 7].tolist()],
        "rss_source": rss.source,
        "serial_peak_rss_bytes": None,
        "seconds_per_step": float(stats[:, 3].max()) / steps,
        "serial_seconds_per_step": None,
        "energy": float(res0.energy),
        "stress": mat(res0.stress),
        "virial": mat(res0.virial),
        "final_potential": thermo.rows[-1]["potential"],
        "final_temperature": thermo.rows[-1]["temperature"],
        "final_stress": mat(fin.stress),
        "final_virial": mat(fin.virial),
        "conserved_drift": thermo.rows[-1]["conserved"] - thermo.rows[0]["conserved"],
        "pressure": cfg.pressure,
        "barostat": cfg.barostat if cfg.pressure is not None else None,
        "coupling": cfg.coupling if cfg.pressure is not None else None,
        **npt_figures(thermo),
        "atoms_conserved": bool(torch.equal(final.ids, all_ids)),
        # the sanity bounds the run was checked against (null: no bound)
        **{k: v if v < float("inf") else None for k, v in bounds.items()},
    }
    if cfg.json_arrays:
        assert final_ids is not None and final_forces is not None
        result["final_ids"] = final.ids.tolist()
        result["final_positions"] = final.positions.double().tolist()
        result["final_velocities"] = final.velocities.double().tolist()
        result["final_forces"] = _by_id(final_ids, final_forces).double().tolist()
    if cfg.check_serial:
        assert system is not None and start_ids is not None and start_forces is not None
        result.update(
            _check_serial(
                cfg, potential, system, res0, start_ids, start_forces, final, start_step, heat0, dyn0
            )
        )
    return result


def _serial_reference(
    cfg: MDConfig,
    potential: Any,
    system: System,
    start_step: int = 0,
    heat: float = 0.0,
    dynamic: list[float] | None = None,
) -> dict[str, Any]:
    """Rank 0: serial start evaluation and trajectory (cached in ``cfg.serial_cache`` if set,
    so a benchmark over several rank counts runs the serial twin once)."""
    key = {
        k: v
        for k, v in vars(cfg).items()
        if k not in ("serial_cache", "progress", "thermo", "trajectory", "partition")
    }
    if cfg.serial_cache and os.path.exists(cfg.serial_cache):
        cached = torch.load(cfg.serial_cache, weights_only=False)
        if cached.get("key") == key:
            return cached
    # values from the model's own evaluation path (MACE: its calculator), memory from twinshard's
    # serial evaluation of the same model (the denominator of the per-rank memory ratio)
    engine = SerialEngine(potential, system, skin=cfg.skin, reference=True)
    with RssWindow() as rss:
        _, peak = peak_memory_during(
            lambda: evaluate_serial(potential, system, engine.verlet), system.positions.device
        )
        ref = evaluate_reference(potential, system)
        resident = _tensor_bytes(engine.system, engine.verlet.edges)
        integ = make_integrator(cfg)
        load_dynamic_values(integ, dynamic or [])
        run = simulate(
            engine,
            integ,
            cfg.steps,
            thermo_every=max(1, cfg.thermo_every),
            start_step=start_step,
            heat=heat,
            max_temperature=cfg.max_temperature,
            max_force=cfg.max_force,
        )
    out = {
        "key": key,
        "energy": ref.energy,
        "forces": _by_id(system.ids, ref.forces),
        "stress": ref.stress,
        "virial": ref.virial,
        "peak": int(resident + peak),
        "peak_rss": rss.peak_bytes,
        "final_positions": _by_id(engine.system.ids, engine.system.positions),
        "seconds_per_step": run["seconds"] / max(cfg.steps - start_step, 1),
        "final_potential": run["thermo"].rows[-1]["potential"],
    }
    if cfg.serial_cache:
        torch.save(out, cfg.serial_cache)
    return out


def _check_serial(
    cfg: MDConfig,
    potential: Any,
    system: System,
    res0: Any,
    start_ids: torch.Tensor,
    start_forces: torch.Tensor,
    final: System,
    start_step: int = 0,
    heat: float = 0.0,
    dynamic: list[float] | None = None,
) -> dict[str, Any]:
    """Rank 0: differences between the distributed run and its serial twin."""
    ref = _serial_reference(cfg, potential, system, start_step, heat, dynamic)
    figures = error_figures(
        res0.energy,
        _by_id(start_ids, start_forces),
        ref["energy"],
        ref["forces"],
        stress=res0.stress,
        ref_stress=ref["stress"],
        virial=res0.virial,
        ref_virial=ref["virial"],
    )
    return {
        **figures,
        "serial_peak_memory_bytes": ref["peak"],
        "serial_peak_rss_bytes": ref["peak_rss"],
        "max_position_error": float((final.positions - ref["final_positions"]).abs().max()),
        "serial_seconds_per_step": ref["seconds_per_step"],
        "serial_final_potential": ref["final_potential"],
    }


def result_keys() -> tuple[str, ...]:
    """The keys ``twinshard md --json`` always prints (the issue's contract)."""
    return RESULT_KEYS
