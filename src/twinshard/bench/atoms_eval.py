"""The evaluation section of ``twinshard bench atoms`` (``--mode eval|both``) and the benchmark
systems and potentials it shares with the MD and overhead modes (see :mod:`twinshard.bench.atoms`).

On fcc argon (rattled; MACE: the model's species assigned) the serial evaluation (analytic and
autograd paths back to back for LJ) and, per P, ``DistributedPotential.compute`` on local ranks:
time per evaluation (median after warm-up), parts, tensor and resident peaks per rank, halo atoms
against the ghost-shell estimate and parity against serial.
"""

from __future__ import annotations

import argparse
from typing import Any

from twinshard.runtime import COLLECTIVE_TIMEOUT, shared_pool

__all__ = ["bench_system", "eval_rank", "mace_model", "mace_species", "run_evaluation", "serial_eval_rank"]


def warmups(potential: str) -> int:
    """Untimed evaluations before timing: MACE's e3nn layers are TorchScript, whose profiling
    executor specialises them over the first calls (the second one is seconds long)."""
    return 3 if potential == "mace" else 1


def parse_ranks(text: str) -> list[int]:
    try:
        ranks = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--ranks must be comma-separated integers, got {text!r}") from None
    if not ranks or min(ranks) < 1:
        raise ValueError(f"--ranks needs positive rank counts, got {text!r}")
    return ranks


def bench_system(opts: dict[str, Any], nranks: int, species: list[int] | None = None) -> Any:
    """The benchmark system on the source rank: fcc argon (rattled so forces are not zero by
    symmetry), ``atoms`` in all, or ``atoms`` per rank in the weak-scaling mode; with ``species``
    (MACE: the model's atomic numbers) the atoms get those species in a seeded random order."""
    import torch

    from twinshard.atoms.data.structures import fcc_argon
    from twinshard.atoms.data.system import System

    n = int(opts["atoms"]) * (nranks if opts.get("weak") else 1)
    s = fcc_argon(n_atoms=n, rattle=0.05, seed=int(opts["seed"]))
    if not species:
        return s
    order = torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(int(opts["seed"]) + 3))
    numbers = torch.tensor(sorted(species), dtype=torch.int64)[order % len(species)]
    return System(positions=s.positions, numbers=numbers, cell=s.cell, pbc=s.pbc, info=s.info)


_MACE: dict[Any, Any] = {}


def mace_model(path: str | None) -> Any:
    """The MACE module of ``--model`` (``load_mace``) or the small random-weight default
    (``build_mace``: same seed, same weights on every rank); built once per process."""
    if path not in _MACE:
        from twinshard.atoms.potentials.mace import build_mace, load_mace

        _MACE[path] = load_mace(path) if path else build_mace()
    return _MACE[path]


def mace_species(path: str | None) -> list[int]:
    """The atomic numbers the MACE model has parameters for (the default's without building it)."""
    if path is None:
        from twinshard.atoms.potentials.mace import DEFAULT_SPECIES

        return sorted(DEFAULT_SPECIES)
    return sorted(int(z) for z in mace_model(path).atomic_numbers.tolist())


def write_structure(path: str, system: Any) -> None:
    from twinshard.atoms.data.io import write

    write(path, system)


def _eval_potential(opts: dict[str, Any]) -> Any:
    if opts["potential"] == "mace":
        from twinshard.atoms.potentials.mace import MaceAdapter

        return MaceAdapter(mace_model(opts.get("model")))
    from twinshard.atoms.potentials import make_potential

    kw: dict[str, Any] = {}
    if opts["potential"] == "lj" and opts.get("kernel"):
        kw["kernel"] = opts["kernel"]
    return make_potential(opts["potential"], species=[18], **kw)


def _eval_system(opts: dict[str, Any], nranks: int, pot: Any) -> Any:
    return bench_system(opts, nranks, getattr(pot, "species", None) if opts["potential"] == "mace" else None)


def median(xs: list[float]) -> float:
    import statistics

    return float(statistics.median(xs)) if xs else float("nan")


def serial_eval_rank(opts: dict[str, Any]) -> dict[str, Any]:
    """One process: the serial evaluation (``atoms.potentials.evaluate``), the analytic path and
    the autograd path (today's, the oracle) back to back: time per evaluation (median of
    ``repeats`` after one warm-up that builds the neighbour list), list build time, tensor
    peak and resident peak of one evaluation, and the results (the parity reference)."""
    import time

    from twinshard.atoms.data.neighbors import VerletList
    from twinshard.atoms.parallel.plain_inputs import evaluate_serial, is_plain
    from twinshard.atoms.potentials import evaluate, has_analytic
    from twinshard.memory import RssWindow, peak_memory_during

    pot = _eval_potential(opts)
    system = _eval_system(opts, int(opts["serial_of"]), pot)

    def evaluate_one(verlet: Any, fast: bool) -> Any:
        if is_plain(pot):  # MACE: the plain contract (no analytic path)
            return evaluate_serial(pot, system, verlet)
        return evaluate(pot, system, verlet, analytic=fast)

    paths = ["analytic", "autograd"] if has_analytic(pot) else ["autograd"]
    out: dict[str, Any] = {"atoms": system.n_atoms, "paths": {}}
    for path in paths:
        fast = path == "analytic"
        verlet = VerletList(pot.cutoff, float(opts["skin"]))
        for _ in range(warmups(opts["potential"])):
            res = evaluate_one(verlet, fast)  # warm-up: builds the list
        times = []
        for _ in range(int(opts["repeats"])):
            t0 = time.perf_counter()
            res = evaluate_one(verlet, fast)
            times.append(time.perf_counter() - t0)
        with RssWindow() as rss:
            res, peak = peak_memory_during(
                lambda v=verlet, a=fast: evaluate_one(v, a), system.positions.device
            )
        out["paths"][path] = {
            "seconds": median(times),
            "seconds_all": times,
            "neighbor_list_seconds": verlet.build_seconds,
            "pairs_listed": verlet.edges.n_edges,
            "peak_memory_bytes": peak,
            "peak_rss_bytes": rss.peak_bytes,
            "rss_reset": rss.reset,
        }
        if path == paths[0]:
            out["reference"] = {
                "ids": system.ids,
                "energy": res.energy,
                "forces": res.forces,
                "virial": res.virial,
            }
    return out


def eval_rank(opts: dict[str, Any]) -> dict[str, Any]:
    """Every rank: scatter, then time ``DistributedPotential.compute`` (max over ranks of the
    per-rank median), with its parts (LJ: neighbour list, halo forward, pairs, halo reverse),
    tensor and resident peaks per rank, halo atoms against the ghost-shell estimate."""
    import time

    import torch
    import torch.distributed as dist

    from twinshard.atoms.dynamics.driver import ghost_shell_estimate
    from twinshard.atoms.parallel.evaluate import place, rows_by_id
    from twinshard.comm import primitives as prim
    from twinshard.memory import RssWindow, peak_memory_during
    from twinshard.runtime import require_world

    world = require_world("twinshard bench atoms (evaluation)")
    nranks = world.size
    pot = _eval_potential(opts)
    system = _eval_system(opts, nranks, pot) if world.rank == 0 else None
    sharded, dp = place(system, pot, skin=float(opts["skin"]), analytic=opts["analytic"])
    device = sharded.positions.device
    with RssWindow() as rss:
        _, build_peak = peak_memory_during(lambda: dp.compute(sharded), device)  # builds the list
        for _ in range(warmups(opts["potential"]) - 1):
            dp.compute(sharded)
        nl_seconds = sharded.neighbor_seconds
        times, parts = [], []
        for _ in range(int(opts["repeats"])):
            dist.barrier(sharded.group)  # start together: the max over ranks is one step's time
            t0 = time.perf_counter()
            res = dp.compute(sharded)
            times.append(time.perf_counter() - t0)
            parts.append(dict(dp.timings))
        res, peak = peak_memory_during(lambda: dp.compute(sharded), device)
    stats = torch.tensor(
        [
            median(times),
            float(peak),
            float(build_peak),
            float(rss.peak_bytes),
            float(sharded.n_halo),
            float(sharded.n_owned),
            nl_seconds,
        ]
        + [median([p.get(k, float("nan")) for p in parts]) for k in _PARTS],
        dtype=torch.float64,
        device=device,
    )
    allstats = prim.all_gather(stats[None], 0, sharded.group, op="bench").cpu()
    ids, forces = rows_by_id(sharded, res.forces, op="bench")
    if world.rank != 0:
        return {}
    grid = tuple(getattr(sharded.partition, "grid", (nranks, 1, 1)))
    col = {k: allstats[:, c].tolist() for c, k in enumerate(_STATS + _PARTS)}
    return {
        "ranks": nranks,
        "atoms": sharded.n_total,
        "rank_grid": list(grid),
        "path": "analytic" if dp.analytic else "autograd",
        "seconds_per_evaluation": max(col["seconds"]),
        "seconds_per_rank": col["seconds"],
        "parts_seconds_per_rank": {k: col[k] for k in _PARTS},
        "neighbor_list_seconds_per_rank": col["neighbor_list_build"],
        "peak_memory_bytes_per_rank": [int(v) for v in col["peak"]],
        "build_peak_memory_bytes_per_rank": [int(v) for v in col["build_peak"]],
        "peak_rss_bytes_per_rank": [int(v) for v in col["rss"]],
        "rss_reset": bool(rss.reset),
        "halo_atoms_per_rank": [int(v) for v in col["halo"]],
        "owned_atoms_per_rank": [int(v) for v in col["owned"]],
        "ghost_shell_estimate": ghost_shell_estimate(
            sharded.n_total, sharded.cell, sharded.pbc, grid, sharded.cutoff + sharded.skin
        ),
        "energy": float(res.energy),
        "virial": res.virial,
        "ids": ids,
        "forces": forces,
    }


_STATS = ("seconds", "peak", "build_peak", "rss", "halo", "owned", "neighbor_list_build")
_PARTS = ("neighbor_list", "halo_forward", "pairs", "halo_reverse", "all_reduce")


def run_parity(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """A run's errors against the serial reference (its arrays popped: ids, forces, virial), and
    the largest reference force (the scale of the force error)."""
    import torch

    from twinshard.atoms.potentials.base import error_figures

    forces = run.pop("forces")[torch.argsort(run.pop("ids"))]
    ref_f = ref["forces"][torch.argsort(ref["ids"])]
    figures = error_figures(
        run["energy"], forces, ref["energy"], ref_f, virial=run.pop("virial"), ref_virial=ref["virial"]
    )
    out = {k: v for k, v in figures.items() if v is not None and k != "max_stress_error"}
    return {**out, "max_force": float(ref_f.abs().max())}


def run_evaluation(args: argparse.Namespace) -> dict[str, Any]:
    """The evaluation benchmark: serial (analytic and autograd, back to back) and every P."""
    ranks = parse_ranks(args.ranks)
    base = {
        "atoms": args.atoms,
        "weak": bool(args.weak),
        "potential": args.potential,
        "model": getattr(args, "model", None),
        "kernel": getattr(args, "kernel", None),
        "skin": args.skin,
        "seed": args.seed,
        "repeats": args.repeats,
    }
    pool = shared_pool()
    timeout = min(float(args.timeout), COLLECTIVE_TIMEOUT)
    serial = {}
    for p in sorted(set(ranks)) if args.weak else [1]:
        serial[p] = pool.run(serial_eval_rank, 1, {**base, "serial_of": p}, timeout=timeout)[0]
    runs = []
    for p in ranks:
        ref = serial[p if args.weak else 1]
        for analytic in [True, False] if "analytic" in ref["paths"] and args.both_paths else [None]:
            r = pool.run(eval_rank, p, {**base, "analytic": analytic}, timeout=timeout)[0]
            r.update(run_parity(r, ref["reference"]))
            s = ref["paths"][r["path"]]
            r["serial_seconds"] = s["seconds"]
            r["time_ratio_to_serial"] = r["seconds_per_evaluation"] / s["seconds"]
            r["serial_peak_memory_bytes"] = s["peak_memory_bytes"]
            shell = r["ghost_shell_estimate"]  # 0 at P = 1: nothing to import
            r["halo_ratio"] = max(r["halo_atoms_per_rank"]) / shell if shell > 0 else None
            runs.append(r)
            if not args.json:
                parts = ", ".join(
                    f"{k} {max(v) * 1e3:.1f}" for k, v in r["parts_seconds_per_rank"].items() if v[0] == v[0]
                )
                print(
                    f"P={p} {r['path']}: {r['seconds_per_evaluation'] * 1e3:.1f} ms/eval "
                    f"(serial {s['seconds'] * 1e3:.1f}; parts ms: {parts}), peak/rank "
                    f"{max(r['peak_memory_bytes_per_rank']) / 2**20:.1f} MiB, halo/rank "
                    f"{max(r['halo_atoms_per_rank'])} (shell {r['ghost_shell_estimate']:.0f}), "
                    f"max |dF| {r['max_force_error']:.1e}",
                    flush=True,
                )
    for s in serial.values():
        s.pop("reference")
    first = serial[min(serial)]["paths"]
    out: dict[str, Any] = {"serial": {str(k): v for k, v in serial.items()}, "runs": runs}
    if "analytic" in first:
        a, g = first["analytic"], first["autograd"]
        out["serial_speedup_analytic_over_autograd"] = g["seconds"] / a["seconds"]
        out["serial_memory_ratio_autograd_over_analytic"] = g["peak_memory_bytes"] / max(
            a["peak_memory_bytes"], 1
        )
    return out
