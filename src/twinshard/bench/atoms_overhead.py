"""``twinshard bench atoms --mode overhead``: what twinshard adds to a message-passing model.

One run, one system (fcc argon, rattled), one set of weights; every leg is timed in every
repeat, side by side (after a warm-up, three evaluations for MACE; the order rotates from repeat to repeat, so a
drift of the machine's load spreads over all legs):

- ``hooks``: :class:`~twinshard.atoms.potentials.mpnn.MessagePassingPotential` (the Graph
  contract: ``graph.refresh`` before each layer) through ``DistributedPotential(mode="hooks")``;
- ``dispatch``: :class:`~twinshard.atoms.potentials.mpnn_plain.PlainMessagePassing` (plain
  PyTorch, no twinshard call) unmodified through ``DistributedPotential(mode="dispatch")``, with
  the hooks model's ``state_dict`` loaded strict (same names, same weights);
- ``graph``: the same plain model through graph-parallel storage
  (:class:`~twinshard.atoms.parallel.graph_storage.GraphSharded`, ``graph_compute``): the summary's
  ``graph_over_dispatch_P{P}`` is graph storage's time over halo storage's;
- at P = 1 only, ``plain``: the plain model on plain tensors
  (:func:`~twinshard.atoms.parallel.plain_inputs.evaluate_plain`: no ShardTensor, no halo, no
  communication), and ``serial``: the hooks model through the serial evaluator
  (:func:`~twinshard.atoms.potentials.evaluate`, the identity refresh).

``--potential mace``: the ``dispatch``, ``graph`` and ``plain`` legs (MACE has no refresh-hook twin).
Forces and energies (as an MD step) unless ``--stress``. Note that with ``--stress`` the two
message-passing models differ in how they strain: the plain model displaces positions and edge
shifts per atom and per edge (as MACE does), the hooks path strains the block once.

Per P and leg: the max over ranks of the per-rank median wall time, the same for CPU time
(``time.process_time``: less sensitive to other processes on a loaded machine), the tensor peak
of one evaluation per rank, and parity against the serial plain model (energy relative error,
max force error, max virial error with ``--stress``). The summary holds the ratios
``dispatch_over_hooks_P{P}`` (target <= 1.10) and at P = 1 ``hooks_over_plain_P1``,
``dispatch_over_plain_P1`` (target <= 1.05) and ``hooks_over_serial_P1`` (each also as
``..._cpu_P{P}``). At P = 1 a block has no halo rows (periodic images are edge shifts), so the
dispatch hands the model plain tensors (``plain_inputs.block_inputs``): the P = 1 legs differ by
the block set-up only, and the dispatch's own per-op cost shows at P >= 2 against ``hooks``.
"""

from __future__ import annotations

import argparse
from typing import Any

from twinshard.bench.atoms_eval import bench_system, mace_model, median, parse_ranks, run_parity, warmups
from twinshard.runtime import COLLECTIVE_TIMEOUT, shared_pool

__all__ = ["overhead_rank", "reference_rank", "run_overhead"]

DISPATCH_TARGET = 1.10
P1_TARGET = 1.05
# legs that disagree beyond fp64 round-off do not compute the same thing: their times are not
# comparable (a relative error, against the largest force or the energy)
AGREEMENT = 1e-11


def _models(opts: dict[str, Any]) -> tuple[Any, Any]:
    """``(hooks model or None, plain model)`` with the same weights."""
    if opts["potential"] == "mace":
        from twinshard.atoms.potentials.mace import MaceAdapter

        return None, MaceAdapter(mace_model(opts.get("model")))
    if opts["potential"] != "mpnn":
        raise ValueError("--mode overhead measures message-passing models: --potential mpnn or mace")
    from twinshard.atoms.potentials import MessagePassingPotential
    from twinshard.atoms.potentials.mpnn_plain import PlainMessagePassing

    hooks = MessagePassingPotential(species=[18], seed=int(opts["seed"]))
    plain = PlainMessagePassing(
        species=hooks.species,
        cutoff=hooks.cutoff,
        n_features=hooks.embedding.shape[1],
        n_basis=hooks.n_basis,
        n_layers=hooks.n_layers,
        seed=int(opts["seed"]) + 1,  # another draw: the weights below must come from load_state_dict
        energy_scale=hooks.energy_scale,
        avg_neighbors=hooks.avg_neighbors,
    )
    plain.load_state_dict(hooks.state_dict(), strict=True)
    return hooks, plain


def _species(opts: dict[str, Any], plain: Any) -> list[int] | None:
    return list(plain.species) if opts["potential"] == "mace" else None


def reference_rank(opts: dict[str, Any]) -> dict[str, Any]:
    """One process: the serial plain model (the parity reference)."""
    from twinshard.atoms.parallel.plain_inputs import evaluate_plain

    _, plain = _models(opts)
    system = bench_system(opts, 1, _species(opts, plain))
    res = evaluate_plain(plain, system, bool(opts["stress"]))
    return {"ids": system.ids, "energy": res.energy, "forces": res.forces, "virial": res.virial}


def overhead_rank(opts: dict[str, Any]) -> dict[str, Any]:
    """Every rank: the legs of the module docstring on one scattered system, timed side by side.

    Collectives: those of ``DistributedPotential.compute`` per distributed leg and evaluation,
    one barrier before each timed evaluation, and all_gathers of the statistics, ids and
    forces at the end. Memory per rank: one evaluation's autograd graph at a time."""
    import time

    import torch
    import torch.distributed as dist

    from twinshard.atoms.data.neighbors import VerletList
    from twinshard.atoms.dynamics.driver import ghost_shell_estimate
    from twinshard.atoms.parallel.distributed import DistributedPotential
    from twinshard.atoms.parallel.evaluate import place, rows_by_id
    from twinshard.atoms.parallel.plain_inputs import evaluate_plain
    from twinshard.atoms.potentials import evaluate
    from twinshard.comm import primitives as prim
    from twinshard.memory import peak_memory_during
    from twinshard.runtime import require_world

    world = require_world("twinshard bench atoms --mode overhead")
    nranks = world.size
    hooks, plain = _models(opts)
    system = bench_system(opts, 1, _species(opts, plain)) if world.rank == 0 else None
    skin, stress = float(opts["skin"]), bool(opts["stress"])
    sharded, dp_dispatch = place(system, plain, skin=skin, mode="dispatch")
    legs: dict[str, Any] = {}
    if hooks is not None:  # the same storage, the Graph contract's halo refreshes
        dp_hooks = DistributedPotential(hooks, mode="hooks")
        legs["hooks"] = lambda: dp_hooks.compute(sharded, compute_stress=stress)
    legs["dispatch"] = lambda: dp_dispatch.compute(sharded, compute_stress=stress)
    graph, dp_graph = place(system, plain, storage="graph", skin=skin)
    legs["graph"] = lambda: dp_graph.compute(graph, compute_stress=stress)
    if nranks == 1:
        assert system is not None
        v_plain = VerletList(plain.cutoff, skin)
        legs["plain"] = lambda: evaluate_plain(plain, system, stress, v_plain)
        if hooks is not None:
            v_serial = VerletList(hooks.cutoff, skin)
            legs["serial"] = lambda: evaluate(hooks, system, v_serial, compute_stress=stress)
    names = list(legs)
    device = sharded.positions.device
    for _ in range(warmups(opts["potential"])):
        results = {k: legs[k]() for k in names}  # warm-up: neighbour lists, caches, TorchScript
    peaks = {k: peak_memory_during(legs[k], device)[1] for k in names}
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    for r in range(int(opts["repeats"])):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier(sharded.group)  # start together: the max over ranks is one evaluation's time
            t0, c0 = time.perf_counter(), time.process_time()
            legs[k]()
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    row = [float(sharded.n_halo), float(sharded.n_owned)]
    for k in names:
        row += [median(wall[k]), median(cpu[k]), float(peaks[k]), min(wall[k], default=0.0)]
        row += [min(cpu[k], default=0.0)]
    stats = prim.all_gather(
        torch.tensor([row], dtype=torch.float64, device=device), 0, sharded.group, op="bench"
    )
    by_id = {  # (ids, forces) of each distributed leg, in id order
        k: rows_by_id(graph if k == "graph" else sharded, results[k].forces, op="bench")
        for k in names
        if k in ("hooks", "dispatch", "graph")
    }
    if world.rank != 0:
        return {}
    stats = stats.cpu()
    grid = tuple(getattr(sharded.partition, "grid", (nranks, 1, 1)))
    out: dict[str, Any] = {
        "ranks": nranks,
        "atoms": sharded.n_total,
        "rank_grid": list(grid),
        "halo_atoms_per_rank": [int(v) for v in stats[:, 0].tolist()],
        "owned_atoms_per_rank": [int(v) for v in stats[:, 1].tolist()],
        "ghost_shell_estimate": ghost_shell_estimate(
            sharded.n_total, sharded.cell, sharded.pbc, grid, sharded.cutoff + sharded.skin
        ),
        "legs": {},
    }
    for i, k in enumerate(names):
        c = 2 + 5 * i
        res = results[k]
        leg = {
            "seconds_per_evaluation": float(stats[:, c].max()),
            "seconds_per_rank": stats[:, c].tolist(),
            "cpu_seconds_per_evaluation": float(stats[:, c + 1].max()),
            "cpu_seconds_per_rank": stats[:, c + 1].tolist(),
            "peak_memory_bytes_per_rank": [int(v) for v in stats[:, c + 2].tolist()],
            # the fastest repeat (max over ranks): less sensitive than the median to load spikes
            "min_seconds_per_evaluation": float(stats[:, c + 3].max()),
            "min_cpu_seconds_per_evaluation": float(stats[:, c + 4].max()),
            "seconds_all_rank0": wall[k],
            "energy": float(res.energy),
            "virial": res.virial,
            "ids": by_id[k][0] if k in by_id else system.ids,  # type: ignore[union-attr]
            "forces": by_id[k][1] if k in by_id else res.forces,
        }
        out["legs"][k] = leg
    if nranks == 1:
        p = results["plain"]
        out["reference"] = {"ids": system.ids, "energy": p.energy, "forces": p.forces, "virial": p.virial}  # type: ignore[union-attr]
    return out


def check_agreement(run: dict[str, Any], ref: dict[str, Any]) -> None:
    """Parity of every leg of one run against the serial plain model (arrays replaced by their
    errors); raises if a leg disagrees beyond round-off, naming it: then the legs do not run the
    same model and weights, and the ratios would compare different computations."""
    for name, leg in run["legs"].items():
        leg.update(run_parity(leg, ref))  # its arrays replaced by its errors
        force = leg["max_force_error"] / max(leg["max_force"], 1e-300)
        if max(leg["energy_rel_error"], force) > AGREEMENT:
            raise ValueError(
                f"bench atoms --mode overhead: at P={run['ranks']} the {name!r} leg disagrees with the "
                f"serial plain model (energy rel. error {leg['energy_rel_error']:.1e}, force error "
                f"{force:.1e} of the largest force; round-off is < {AGREEMENT:g}): the legs do not "
                "compute the same model with the same weights, so their times are not comparable"
            )


def run_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Every P of ``--ranks`` (local ranks through the shared pool); the JSON object."""
    ranks = parse_ranks(args.ranks)
    opts = {
        "potential": args.potential,
        "model": getattr(args, "model", None),
        "atoms": args.atoms,
        "seed": args.seed,
        "skin": args.skin,
        "repeats": args.repeats,
        "stress": bool(getattr(args, "stress", False)),
    }
    pool = shared_pool()
    timeout = min(float(args.timeout), COLLECTIVE_TIMEOUT)
    runs = [pool.run(overhead_rank, p, opts, timeout=timeout)[0] for p in ranks]
    one = [r for r in runs if r["ranks"] == 1]
    ref = one[0]["reference"] if one else pool.run(reference_rank, 1, opts, timeout=timeout)[0]
    out: dict[str, Any] = {
        "bench": "atoms",
        "mode": "overhead",
        "potential": args.potential,
        "model": opts["model"],
        "atoms": runs[0]["atoms"],
        "stress": opts["stress"],
        "repeats": int(args.repeats),
        "dispatch_target": DISPATCH_TARGET,
        "p1_target": P1_TARGET,
        "runs": runs,
    }
    for r in runs:
        r.pop("reference", None)
        legs, p = r["legs"], r["ranks"]
        check_agreement(r, ref)

        def ratio(a: str, b: str, key: str, legs: dict = legs) -> float | None:
            return legs[a][key] / legs[b][key] if a in legs and b in legs else None

        pairs = [("dispatch", "hooks"), ("graph", "dispatch")] + (
            [("hooks", "plain"), ("dispatch", "plain"), ("hooks", "serial")] if p == 1 else []
        )
        for a, b in pairs:
            for suffix, key in (
                ("", "seconds_per_evaluation"),
                ("_cpu", "cpu_seconds_per_evaluation"),
                ("_min_cpu", "min_cpu_seconds_per_evaluation"),
            ):
                v = ratio(a, b, key)
                if v is not None:
                    out[f"{a}_over_{b}{suffix}_P{p}"] = v
        if not args.json:
            times = ", ".join(f"{k} {v['seconds_per_evaluation'] * 1e3:.0f}" for k, v in legs.items())
            cpus = ", ".join(f"{k} {v['cpu_seconds_per_evaluation'] * 1e3:.0f}" for k, v in legs.items())
            worst = max(v["max_force_error"] for v in legs.values())
            print(f"P={p}: ms/eval {times} (cpu ms {cpus}); max |dF| {worst:.1e}", flush=True)
    every = [leg for r in runs for leg in r["legs"].values()]
    out["max_force_error"] = max(leg["max_force_error"] for leg in every)
    out["energy_rel_error"] = max(leg["energy_rel_error"] for leg in every)
    # wall time (the targets' figure) and CPU time (what a loaded machine distorts least)
    for suffix in ("", "_cpu"):
        d = [out[f"dispatch_over_hooks{suffix}_P{r['ranks']}"] for r in runs if "hooks" in r["legs"]]
        out[f"dispatch_target_met{suffix}"] = max(d) <= DISPATCH_TARGET if d else None
        p1 = [out.get(f"{a}_over_plain{suffix}_P1") for a in ("hooks", "dispatch")]
        p1 = [v for v in p1 if v is not None]
        out[f"p1_target_met{suffix}"] = max(p1) <= P1_TARGET if p1 else None
    return out
