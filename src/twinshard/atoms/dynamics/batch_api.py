"""``run_md([atoms1, atoms2, ...], potential, ...)``: MD on a batch of systems in one decomposed run
(:mod:`twinshard.atoms.dynamics.batch`), one :class:`~twinshard.atoms.dynamics.api.MDResult` per
system, each equal to that system run alone to round-off.

Per-system options: ``steps``, ``thermostat`` (a name, or one integrator object per system),
``temperature``, ``friction``, ``seed``, ``tdamp``, ``chain``, ``initial_temperature``, and for NPT
``pressure`` (bar; ``None``: no barostat for that system), ``barostat``, ``pdamp``, ``pchain``,
``coupling``, ``compressibility``: a value for every system or a list of one per system. Each
system with a pressure gets its own barostat (its state and cell; :mod:`twinshard.atoms.dynamics.batch`).
Files: ``thermo``, ``trajectory``, ``checkpoint`` a path
holding ``{i}`` (the system's index) or a list of paths; ``restart`` a list of the checkpoints a
batch wrote (one per system). The batch runs in graph storage: the potential is a plain-PyTorch
model (the dict contract: ``PlainMessagePassing``, MACE), one for the whole batch (one cutoff).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from twinshard.atoms.data.io import as_system
from twinshard.atoms.data.system import System
from twinshard.atoms.dynamics.batch import BatchIntegrator, per_system_paths, simulate_batch
from twinshard.atoms.dynamics.md import (
    VelocityVerlet,
    check_restart,
    dynamic_values,
    load_checkpoint,
    load_dynamic_values,
    maxwell_boltzmann,
)
from twinshard.atoms.dynamics.md_files import prepare_outputs
from twinshard.atoms.dynamics.provenance import check_potential, check_structure, potential_provenance

__all__ = ["per_system", "run_md_batch"]


def per_system(name: str, value: Any, n: int) -> list[Any]:
    """``value`` for each of ``n`` systems: a list of ``n`` values as given, anything else repeated."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(
                f"{name} has {len(value)} values for a batch of {n} systems: give one per system"
            )
        return list(value)
    return [value] * n


def check_batch(systems: Any, potential: Any) -> None:
    """What a batch must be, before any rank starts (the same arguments on every rank under torchrun:
    every rank raises)."""
    from twinshard.atoms.parallel.plain_inputs import is_plain

    if isinstance(systems, (list, tuple)) and not systems:
        raise ValueError("run_md got an empty list of systems: give at least one System or ase.Atoms")
    if isinstance(potential, (list, tuple)):
        raise ValueError(
            "a batch runs with one potential (one model, one cutoff) for every system; run systems that "
            "need different models or cutoffs as separate batches"
        )
    if not is_plain(potential):
        raise ValueError(
            f"a batch of systems runs in graph storage, which evaluates plain-PyTorch models (the dict "
            f"contract: PlainMessagePassing, MACE); {type(potential).__name__} follows the Graph contract: "
            "run its systems one at a time (run_md(atoms, ...))"
        )


def run_md_batch(
    systems: Sequence[Any] | None, potential: torch.nn.Module, opts: dict[str, Any], make_integrator: Any
) -> list[Any]:
    """The batch form of :func:`~twinshard.atoms.dynamics.api.run_md` (called by it with its
    options; ``make_integrator(thermostat, dt=, temperature=, friction=, seed=, tdamp=, chain=,
    pressure=, barostat=, pdamp=, pchain=, coupling=, compressibility=)`` builds one system's
    integrator)."""
    from twinshard.runtime import get_world, in_torchrun, init_world, shared_pool

    restart = opts["restart"]
    if systems is None:
        if not isinstance(restart, (list, tuple)) or not restart:
            raise ValueError("give the systems, or restart= the list of checkpoints a batch wrote")
        n = len(restart)
    else:
        n = len(systems)
        if restart is not None and (not isinstance(restart, (list, tuple)) or len(restart) != n):
            raise ValueError(f"restart= a batch takes a list of {n} checkpoints, one per system")
    dtype = opts["dtype"]
    if systems is not None:
        systems = [as_system(s, dtype, what=f"run_md's system {i}") for i, s in enumerate(systems)]
        if hasattr(potential, "check_species"):
            potential.check_species(sorted({int(z) for s in systems for z in s.numbers.unique().tolist()}))
    if opts["storage"] not in (None, "graph"):
        raise ValueError(
            f"a batch of systems runs in graph storage (storage='graph' or None), got {opts['storage']!r}"
        )
    steps = [int(s) for s in per_system("steps", opts["steps"], n)]
    if any(s < 0 for s in steps):
        raise ValueError(f"steps must be >= 0 for every system, got {steps}")
    thermostat = per_system("thermostat", opts["thermostat"], n)
    names = ("temperature", "friction", "seed", "tdamp", "chain", "dt")
    names += ("pressure", "barostat", "pdamp", "pchain", "coupling", "compressibility")
    kw = {k: per_system(k, opts[k], n) for k in names}
    integs = []
    for i in range(n):
        if isinstance(thermostat[i], VelocityVerlet):
            integs.append(thermostat[i])
        else:
            integs.append(make_integrator(thermostat[i], **{k: v[i] for k, v in kw.items()}))
    for integ, zero in zip(integs, per_system("zero_momentum", opts["zero_momentum"], n)):
        if zero:
            integ.zero_momentum = True
    if len({id(i) for i in integs}) != n:
        raise ValueError(
            "give one integrator object per system (the same object twice would share its state)"
        )
    batch = BatchIntegrator(integs)
    files = {k: per_system_paths(opts[k], n, k) for k in ("thermo", "trajectory", "checkpoint")}
    init_t = per_system("initial_temperature", opts["initial_temperature"], n)
    args = {**opts, "steps": steps, "files": files, "initial_temperature": init_t, "seeds": kw["seed"]}
    world = get_world()
    if world is None and in_torchrun():
        world = init_world()
    if world is not None:
        return _batch_rank(systems, potential, batch, args)
    if opts["ranks"] < 1:
        raise ValueError(f"ranks must be >= 1, got {opts['ranks']}")
    from twinshard.runtime.world import COLLECTIVE_TIMEOUT

    timeout = float(opts["timeout"])
    outs = shared_pool().run(
        _batch_rank,
        int(opts["ranks"]),
        systems,
        potential,
        batch,
        args,
        timeout=min(timeout, COLLECTIVE_TIMEOUT),
        deadline=timeout,
    )
    return outs[0]


def _batch_rank(
    systems: list[System] | None, potential: Any, batch: BatchIntegrator, opts: dict
) -> list[Any]:
    """Every rank: set up (rank 0 reads checkpoints and checks the files), run, evaluate the final
    states once more (energies, forces, stresses), one MDResult per system (systems on rank 0)."""
    from twinshard.atoms.dynamics.run import MDResult, npt_figures
    from twinshard.atoms.parallel.evaluate import place
    from twinshard.comm import primitives as prim
    from twinshard.runtime import agree_step, require_world

    world = require_world("run_md on a batch")
    rank, dev = world.rank, world.device
    potential = potential.to(dev)
    n, steps, files = len(batch), opts["steps"], opts["files"]
    n_dyn = [len(dynamic_values(i)) for i in batch.integrators]
    resume = torch.zeros(2 * n + sum(n_dyn), dtype=torch.float64, device=dev)  # [steps, heats, chains]
    mine: list[System] | None = None
    notes: list[str] = []
    provenance = None
    changed: list[str] = []
    with agree_step("run_md (batch): check the inputs and files"):
        if rank == 0:
            provenance = potential_provenance(potential)
            mine = []
            for i, integ in enumerate(batch.integrators):
                path = opts["restart"][i] if opts["restart"] else None
                if path is not None:
                    state = load_checkpoint(path)
                    check_restart(state, integ, repr(path))
                    if systems is not None:
                        check_structure(state, systems[i], repr(path))
                    if state["step"] > steps[i]:
                        raise ValueError(
                            f"checkpoint {path!r} (system {i}) is at step {state['step']} but its steps is "
                            f"{steps[i]}: steps counts the whole run"
                        )
                    note = check_potential(
                        state,
                        provenance,
                        repr(path),
                        same="potential (class, cutoff, parameters)",
                        override="allow_changed_potential=True",
                        allow=opts["allow_changed_potential"],
                    )
                    if note:
                        changed.append(note)
                    integ.load_state(state["integrator"])
                    mine.append(state["system"].to(dtype=opts["dtype"]))
                    resume[i], resume[n + i] = float(state["step"]), float(state["heat"])
                else:
                    assert systems is not None
                    s = systems[i].clone()
                    t = opts["initial_temperature"][i]
                    if t is not None:
                        s.velocities = maxwell_boltzmann(
                            s.masses, s.ids, float(t), seed=int(opts["seeds"][i])
                        )
                    mine.append(s)
                start = int(resume[i])
                names = ("checkpoint=", "trajectory=", "thermo=")
                paths = (files["checkpoint"][i], files["trajectory"][i], files["thermo"][i])
                notes += prepare_outputs(start, *paths, names=names)
            resume[2 * n :] = torch.tensor(
                [v for integ in batch.integrators for v in dynamic_values(integ)], dtype=torch.float64
            )
    resume = prim.broadcast(resume, 0, None, op="md_setup")
    at = 2 * n
    for integ, k in zip(batch.integrators, n_dyn):  # every rank's chains start from rank 0's
        load_dynamic_values(integ, resume[at : at + k].tolist())
        at += k
    start = [int(v) for v in resume[:n].tolist()]
    out = simulate_batch(
        mine,
        potential,
        batch,
        steps,
        start_steps=start,
        heats=resume[n : 2 * n].tolist(),
        skin=float(opts["skin"]),
        thermo_every=int(opts["thermo_every"]),
        thermo_paths=files["thermo"],
        trajectories=files["trajectory"],
        trajectory_every=int(opts["trajectory_every"]),
        checkpoints=files["checkpoint"],
        checkpoint_every=int(opts["checkpoint_every"]),
        provenance=provenance,
        max_temperature=opts["max_temperature"],
        max_force=opts["max_force"],
    )
    # the final states, evaluated once more as one batch: energies, forces, virials, stresses
    g, dp = place(out["systems"], potential, storage="graph", skin=float(opts["skin"]))
    fin = dp.compute(g, compute_stress=True)
    forces = g.gather_rows(fin.forces, 0)
    energy = fin.energy.reshape(-1).tolist()
    virial = fin.virial.reshape(-1, 3, 3)
    stress = None if fin.stress is None else fin.stress.reshape(-1, 3, 3)
    results, at = [], 0
    for i in range(n):
        size = g.sizes[i]
        vol_ok = stress is not None and bool(torch.isfinite(stress[i]).all())
        results.append(
            MDResult(
                system=out["systems"][i] if rank == 0 else None,
                thermo=out["thermo"][i],
                energy=energy[i],
                forces=forces[at : at + size] if forces is not None else None,
                stress=stress[i] if vol_ok else None,
                virial=virial[i],
                ranks=world.size,
                migrations=0,
                steps=steps[i],
                start_step=start[i],
                seconds=out["seconds"],
                info={
                    "system": i,
                    "batch_size": n,
                    "dropouts": out["dropouts"],
                    "evaluations": out["evaluations"],
                    "owned_atoms_per_rank_start": out["owned_atoms_per_rank_start"],
                    "file_repairs": notes,
                    "potential_notice": "; ".join(changed) or None,
                    "storage": "graph",
                    **npt_figures(out["thermo"][i]),
                    **{
                        k: opts[k] if opts[k] < float("inf") else None
                        for k in ("max_temperature", "max_force")
                    },
                },
            )
        )
        at += size
    return results
