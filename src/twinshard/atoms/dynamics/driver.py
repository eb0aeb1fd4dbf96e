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
from dataclasses import replace
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
from twinshard.atoms.dynamics.md import SerialEngine, load_dynamic_values, simulate
from twinshard.atoms.dynamics.run import (  # DistributedEngine, npt_figures: re-exported (held here before)
    CLI,
    DistributedEngine,
    MDRun,
    npt_figures,
    run_rank,
    tensor_bytes,
)
from twinshard.atoms.parallel.plain_inputs import evaluate_reference, evaluate_serial
from twinshard.atoms.potentials.base import error_figures
from twinshard.memory import RssWindow, peak_memory_during
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
    "npt_figures",
    "potential_from_config",
]

# ------------------------------------------------------------------------ one rank


def _by_id(ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return rows[torch.argsort(ids)]


def md_rank(cfg: MDConfig) -> dict[str, Any]:
    """Run on every rank of the current world; rank 0 returns the full result dict.

    The run is :func:`twinshard.atoms.dynamics.run.run_rank` (the rank body ``run_md`` shares),
    with its figures measured and, with ``cfg.check_serial``, the serial twin's differences. With
    ``cfg.restart`` the run continues from a checkpoint (any rank count: the whole system is
    scattered again) up to step ``cfg.steps``; with ``cfg.checkpoint`` it writes one every
    ``cfg.checkpoint_every`` steps and at the end (gathered on rank 0, atomic).
    """
    from twinshard.atoms.parallel.balance import imbalance
    from twinshard.comm import primitives as prim
    from twinshard.comm.ledger import BYTES_MODEL
    from twinshard.runtime import require_world

    world = require_world("twinshard md")
    rank, nranks = world.rank, world.size
    run = run_rank(
        replace(cfg, measure=True),  # MDConfig is an MDOptions
        lambda: make_integrator(cfg),  # option errors surface on every rank
        lambda species: potential_from_config(cfg, species),  # e.g. the LJ species table
        lambda: load_structure(cfg),
        named=cfg.structure is not None or cfg.atoms is not None,
        model_file=cfg.model,
        spelling=CLI,
    )
    sharded, res0, fin, out = run.sharded, run.first, run.final_results, run.out
    shell = None  # graph storage: no halo, every rank holds the whole geometry
    if cfg.storage != "graph":
        grid = tuple(getattr(sharded.partition, "grid", (nranks, 1, 1)))
        shell = ghost_shell_estimate(
            sharded.n_total, sharded.cell, sharded.pbc, grid, sharded.cutoff + sharded.skin
        )
    steps = max(cfg.steps - run.start_step, 1)
    stats = torch.tensor(
        [
            [
                float(run.halo_start),
                run.comm_bytes,
                float(run.peak_bytes),
                out["seconds"],
                float(sharded.n_owned),
                float(run.rss.peak_bytes),
                float(run.rss.start_bytes),
                float(run.rss.reset),
                float(run.owned_start[rank]),
                float(sharded.n_halo),
            ]
        ],
        dtype=torch.float64,
        device=world.device,
    )
    stats = prim.all_gather(stats, 0, None, op="md_stats").cpu()
    if rank != 0:
        return {"rank": rank}
    final = run.final
    assert final is not None
    thermo = out["thermo"]

    def mat(t: torch.Tensor | None) -> list[list[float]] | None:
        return None if t is None else t.detach().cpu().double().tolist()

    result: dict[str, Any] = {
        "ranks": nranks,
        "atoms": sharded.n_total,
        "steps": cfg.steps,
        "start_step": run.start_step,
        "potential": cfg.potential,
        "storage": cfg.storage,
        "thermostat": cfg.thermostat,
        "structure": cfg.restart or cfg.structure or "fcc_argon",
        "restart": cfg.restart,
        "checkpoint": cfg.checkpoint,
        "file_repairs": run.notes,
        "potential_notice": run.notice,
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
        "rss_source": run.rss.source,
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
        "atoms_conserved": bool(torch.equal(final.ids, run.start_ids)),
        # the sanity bounds the run was checked against (null: no bound)
        **{k: v if v < float("inf") else None for k, v in run.bounds.items()},
    }
    if cfg.json_arrays:
        result["final_ids"] = final.ids.tolist()
        result["final_positions"] = final.positions.double().tolist()
        result["final_velocities"] = final.velocities.double().tolist()
        result["final_forces"] = run.final_forces.double().tolist()
    if cfg.check_serial:
        assert run.system is not None and run.start_forces is not None
        result.update(_check_serial(cfg, run))
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
        resident = tensor_bytes(engine.system, engine.verlet.edges)
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


def _check_serial(cfg: MDConfig, run: MDRun) -> dict[str, Any]:
    """Rank 0: differences between the distributed run and its serial twin."""
    assert run.system is not None and run.final is not None
    res0 = run.first
    ref = _serial_reference(cfg, run.potential, run.system, run.start_step, run.heat, run.dynamic)
    figures = error_figures(
        res0.energy,
        run.start_forces,
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
        "max_position_error": float((run.final.positions - ref["final_positions"]).abs().max()),
        "serial_seconds_per_step": ref["seconds_per_step"],
        "serial_final_potential": ref["final_potential"],
    }


def result_keys() -> tuple[str, ...]:
    """The keys ``twinshard md --json`` always prints (the issue's contract)."""
    return RESULT_KEYS
