"""``twinshard bench atoms``: distributed MD with the message-passing potential at P = 1, 2, 4.

For each rank count P the benchmark runs ``twinshard md`` (rank function
:func:`twinshard.atoms.driver.md_rank`) on the same system — by default fcc
argon with at least 32,768 atoms and the message-passing potential — with
``--check-serial``; the serial twin runs once and is reused for every P. The
last stdout line is one JSON object whose ``runs`` list holds, per P, an
object with the keys of ``twinshard md --json`` (per-rank peak tensor memory and
peak resident memory,
halo atoms and the ghost-shell estimate, bytes per step, time per step, and
the parity errors against serial), plus a summary against the targets:

- per-rank peak memory at the largest P <= 0.4 x serial;
- halo atoms per rank <= 1.25 x the ghost-shell estimate.

``--plot FILE.png`` draws memory per rank and halo atoms per rank against P
beside the ideal curves (serial / P, and the ghost-shell estimate).

The evaluation section (``--mode both``, the default, puts it under
``"evaluation"``; ``--mode eval`` prints it alone) times force evaluations, not
MD: on fcc argon (rattled) it runs the serial evaluation with the analytic pair
path (LJ) and the autograd path back to back (time per evaluation as the median
of ``--repeats``, neighbour-list build time, tensor and resident peak), then per
P ``DistributedPotential.compute`` (max over ranks of the per-rank median, and
its parts: neighbour list, halo forward, pairs, halo reverse, all-reduce),
tensor/resident peaks per rank, halo atoms against the ghost-shell estimate
and parity against serial. ``--both-paths`` also times the autograd path at
every P; ``--weak`` keeps ``--atoms`` per rank (weak scaling: the serial twin
then runs at every size). For the message-passing model the P=1 ratio
``time_ratio_to_serial_P1`` is the overhead twinshard adds over the plain model.
Times are from a shared CPU machine: compare ratios, not absolute seconds.

``--potential mace [--model FILE]``: MACE (mace-torch, unmodified, through the ShardTensor
dispatch) on fcc argon (default 2,048 atoms) whose atoms get the model's species in a seeded
random order; without ``--model`` the small random-weight MACE of ``build_mace`` (nothing is
downloaded), with it a model saved by mace-torch (``load_mace``). MD and evaluation modes as
above.

``--mode overhead`` (:mod:`twinshard.bench.atoms_overhead`): the message-passing model through
refresh hooks, the same model in plain PyTorch through the dispatch, and at P = 1 the plain
model run plainly, side by side with the same weights: the dispatch overhead and what
twinshard adds at P = 1.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

from twinshard.atoms.driver import COLLECTIVE_TIMEOUT, MDConfig, md_rank
from twinshard.runtime import shared_pool

__all__ = ["add_parser", "plot", "run"]

MEMORY_TARGET = 0.4
HALO_TARGET = 1.25
# default --atoms by potential: MACE (random weights, CPU) is ~100x slower per atom than LJ
DEFAULT_ATOMS = {"lj": 32768, "mpnn": 32768, "mace": 2048}


def warmups(potential: str) -> int:
    """Untimed evaluations before timing: MACE's e3nn layers are TorchScript, whose profiling
    executor specialises them over the first calls (the second one is seconds long)."""
    return 3 if potential == "mace" else 1


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``atoms`` under ``twinshard bench``."""
    p = subparsers.add_parser("atoms", help="distributed MD (MPNN) at P = 1, 2, 4 against serial")
    p.add_argument(
        "--atoms",
        type=int,
        default=None,
        help=f"at least this many atoms (fcc argon; default {DEFAULT_ATOMS['mpnn']}, mace {DEFAULT_ATOMS['mace']})",
    )
    p.add_argument("--structure", default="fcc_argon", help="embedded structure name or file")
    p.add_argument("--potential", choices=("lj", "mpnn", "mace"), default="mpnn")
    p.add_argument(
        "--model",
        default=None,
        help="--potential mace: a model saved by mace-torch (default: a small random-weight MACE)",
    )
    p.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts")
    p.add_argument("--steps", type=int, default=3, help="MD steps per run")
    p.add_argument("--dt", type=float, default=2.0)
    p.add_argument("--temperature", type=float, default=60.0)
    p.add_argument("--skin", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one P may take in all")
    p.add_argument("--plot", default=None, help="write a PNG of time, memory and halo size against P")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.add_argument(
        "--mode",
        choices=("both", "eval", "md", "overhead"),
        default="both",
        help="eval: force evaluations only (per-part times, memory, parity); md: MD runs only; "
        "overhead: the same model and weights through refresh hooks, through the dispatch and "
        "(at P=1) plainly, timed side by side",
    )
    p.add_argument(
        "--stress", action="store_true", help="overhead: evaluate stress too (default: forces, as an MD step)"
    )
    p.add_argument("--weak", action="store_true", help="evaluation: --atoms per rank (weak scaling)")
    p.add_argument("--repeats", type=int, default=5, help="evaluation: timed evaluations (median)")
    p.add_argument("--kernel", choices=("torch", "compile"), default=None, help="LJ fast-path kernel")
    p.add_argument(
        "--both-paths",
        action="store_true",
        help="evaluation: also time the autograd path at every P (LJ; before/after in one run)",
    )
    p.set_defaults(func=run)
    return p


def _ranks(text: str) -> list[int]:
    try:
        ranks = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--ranks must be comma-separated integers, got {text!r}") from None
    if not ranks or min(ranks) < 1:
        raise ValueError(f"--ranks needs positive rank counts, got {text!r}")
    return ranks


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every P (spawning local ranks through the shared pool) and print the JSON line."""
    ranks = _ranks(args.ranks)
    if getattr(args, "atoms", None) is None:
        args.atoms = DEFAULT_ATOMS[args.potential]
    if getattr(args, "model", None) is not None and args.potential != "mace":
        raise ValueError("--model is an option of --potential mace")
    mode = getattr(args, "mode", "both")
    if mode == "overhead":
        from twinshard.bench.atoms_overhead import run_overhead

        result = run_overhead(args)
        print(json.dumps(result))
        return result
    evaluation = run_evaluation(args) if mode in ("both", "eval") else None
    if mode == "eval":
        assert evaluation is not None
        result = summarise_evaluation(evaluation, args)
        if args.plot:
            plot(result, args.plot)
            result["plot"] = args.plot
        print(json.dumps(result))
        return result
    with tempfile.TemporaryDirectory(prefix="twinshard-bench-atoms-") as tmp:
        cache = os.path.join(tmp, "serial.pt")
        runs = []
        structure = args.structure
        if args.potential == "mace":  # fcc argon with the model's species assigned, as a file
            structure = os.path.join(tmp, "mace-structure.extxyz")
            write_structure(structure, _bench_system(vars(args), 1, mace_species(args.model)))
        for p in ranks:
            cfg = MDConfig(
                structure=structure,
                atoms=args.atoms,
                potential=args.potential,
                model=getattr(args, "model", None),
                steps=args.steps,
                dt=args.dt,
                temperature=args.temperature,
                skin=args.skin,
                seed=args.seed,
                check_serial=True,
                thermo_every=max(1, args.steps),
                serial_cache=cache,
            )
            r = shared_pool().run(
                md_rank,
                p,
                cfg,
                timeout=min(float(args.timeout), COLLECTIVE_TIMEOUT),
                deadline=float(args.timeout),
            )[0]
            runs.append(r)
            if not args.json:
                print(
                    f"P={p}: peak/rank {max(r['peak_memory_bytes_per_rank']) / 2**20:.1f} MiB "
                    f"(serial {r['serial_peak_memory_bytes'] / 2**20:.1f}), resident peak/rank "
                    f"{max(r['peak_rss_bytes_per_rank']) / 2**20:.0f} MiB, halo/rank "
                    f"{max(r['halo_atoms_per_rank'])} (shell {r['ghost_shell_estimate']:.0f}), "
                    f"{max(r['comm_bytes_per_step_per_rank']) / 2**10:.1f} KiB/step, "
                    f"{r['seconds_per_step']:.3f} s/step (serial {r['serial_seconds_per_step']:.3f}), "
                    f"max |dF| {r['max_force_error']:.1e}, max |dx| {r['max_position_error']:.1e}",
                    flush=True,
                )
    result = summarise(runs, args)
    if evaluation is not None:
        result["evaluation"] = summarise_evaluation(evaluation, args)
    if args.plot:
        plot(result, args.plot)
        result["plot"] = args.plot
    print(json.dumps(result))
    return result


def summarise(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The JSON object: runs plus the figures the targets are stated in."""
    last = max(runs, key=lambda r: r["ranks"])
    memory_ratio = max(last["peak_memory_bytes_per_rank"]) / last["serial_peak_memory_bytes"]
    halo_ratio = max(
        max(r["halo_atoms_per_rank"]) / r["ghost_shell_estimate"]
        for r in runs
        if r["ghost_shell_estimate"] > 0
    )
    return {
        "bench": "atoms",
        "atoms": runs[0]["atoms"],
        "potential": args.potential,
        "steps": args.steps,
        "runs": runs,
        "max_ranks": last["ranks"],
        "memory_ratio_at_max_ranks": memory_ratio,
        "memory_target": MEMORY_TARGET,
        "memory_target_met": memory_ratio <= MEMORY_TARGET if last["ranks"] >= 4 else None,
        # resident peaks (VmHWM; absolute, torch libraries included) beside the tensor figures
        "peak_rss_bytes_at_max_ranks": max(last["peak_rss_bytes_per_rank"]),
        "serial_peak_rss_bytes": last["serial_peak_rss_bytes"],
        "rss_reset": all(all(r["rss_reset_per_rank"]) for r in runs),
        "halo_ratio_max": halo_ratio,
        "halo_target": HALO_TARGET,
        "halo_target_met": halo_ratio <= HALO_TARGET,
        "max_force_error": max(r["max_force_error"] for r in runs),
        "max_position_error": max(r["max_position_error"] for r in runs),
        "energy_rel_error": max(r["energy_rel_error"] for r in runs),
    }


def summarise_evaluation(ev: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The evaluation JSON: serial paths, runs per P, and the figures of issue 11's targets."""
    out: dict[str, Any] = {
        "bench": "atoms",
        "mode": "eval",
        "potential": args.potential,
        "weak_scaling": bool(args.weak),
        "atoms": ev["runs"][0]["atoms"] if ev["runs"] else args.atoms,
        **ev,
    }
    fast = [r for r in ev["runs"] if r["path"] == ("analytic" if args.potential == "lj" else "autograd")]
    for r in fast:
        out[f"time_ratio_to_serial_P{r['ranks']}"] = r["time_ratio_to_serial"]
        parts = r["parts_seconds_per_rank"]
        if parts["halo_reverse"][0] == parts["halo_reverse"][0]:  # analytic: parts were timed
            halo = [a + b for a, b in zip(parts["halo_forward"], parts["halo_reverse"])]
            out[f"halo_fraction_P{r['ranks']}"] = max(halo) / r["seconds_per_evaluation"]
    if ev["runs"]:
        out["max_force_error"] = max(r["max_force_error"] for r in ev["runs"])
        out["energy_rel_error"] = max(r["energy_rel_error"] for r in ev["runs"])
    return out


def plot(result: dict[str, Any], path: str) -> None:
    """Memory per rank and halo atoms per rank against P, beside the ideal curves; with an
    evaluation section (or an evaluation-only result) time and memory per evaluation too."""
    ev = result if result.get("mode") == "eval" else result.get("evaluation")
    if "runs" not in result or result.get("mode") == "eval":
        _plot_evaluation(ev, path)
        return
    if ev is not None:
        base, dot, ext = path.rpartition(".")
        _plot_evaluation(ev, f"{base}-evaluation.{ext}" if dot else path + "-evaluation")
        result["plot_evaluation"] = f"{base}-evaluation.{ext}" if dot else path + "-evaluation"
    _plot_md(result, path)


def _plot_evaluation(ev: dict[str, Any], path: str) -> None:
    """Time per evaluation (max over ranks) and peak tensor memory per rank against P."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    weak = ev.get("weak_scaling", False)
    for path_name, style in (("analytic", "o-"), ("autograd", "s:")):
        runs = sorted((r for r in ev["runs"] if r["path"] == path_name), key=lambda r: r["ranks"])
        if not runs:
            continue
        ps = [r["ranks"] for r in runs]
        ax1.plot(ps, [r["seconds_per_evaluation"] * 1e3 for r in runs], style, label=f"{path_name}")
        serial = runs[0]["serial_seconds"] * 1e3
        ideal = [serial if weak else serial / p for p in ps]
        ax1.plot(
            ps, ideal, "k--", lw=0.8, label=f"ideal ({path_name}): " + ("serial" if weak else "serial / P")
        )
        ax2.plot(ps, [max(r["peak_memory_bytes_per_rank"]) / 2**20 for r in runs], style, label=path_name)
        mem = runs[0]["serial_peak_memory_bytes"] / 2**20
        ax2.plot(ps, [mem if weak else mem / p for p in ps], "k--", lw=0.8)
    ax1.set_xlabel("ranks P")
    ax1.set_ylabel("ms per evaluation (max over ranks)")
    ax1.set_title(f"{ev['atoms']} atoms{' per rank' if weak else ''}, {ev['potential']}")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("ranks P")
    ax2.set_ylabel("peak tensor memory per rank (MiB)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_md(result: dict[str, Any], path: str) -> None:
    """Memory per rank and halo atoms per rank against P, beside the ideal curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(result["runs"], key=lambda r: r["ranks"])
    ps = [r["ranks"] for r in runs]
    serial = runs[0]["serial_peak_memory_bytes"] / 2**20
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(
        ps, [max(r["peak_memory_bytes_per_rank"]) / 2**20 for r in runs], "o-", label="peak per rank (max)"
    )
    ax1.plot(ps, [serial / p for p in ps], "k--", label="ideal: serial / P")
    ax1.plot(
        ps,
        [MEMORY_TARGET * serial if p >= 4 else float("nan") for p in ps],
        "rx",
        label=f"target at P>=4: {MEMORY_TARGET} x serial",
    )
    ax1.axhline(serial, color="gray", lw=0.8, label="serial")
    ax1.set_xlabel("ranks P")
    ax1.set_ylabel("tensor memory (MiB)")
    ax1.set_xticks(ps)
    ax1.legend(fontsize=8)
    ax1.set_title(f"{result['atoms']} atoms, {result['potential']}")
    ax2.plot(ps, [max(r["halo_atoms_per_rank"]) for r in runs], "o-", label="halo atoms (max rank)")
    ax2.plot(
        ps,
        [sum(r["halo_atoms_per_rank"]) / len(r["halo_atoms_per_rank"]) for r in runs],
        "s:",
        label="halo atoms (mean)",
    )
    ax2.plot(ps, [r["ghost_shell_estimate"] for r in runs], "k--", label="ghost-shell estimate")
    ax2.plot(ps, [r["atoms"] / r["ranks"] for r in runs], color="gray", lw=0.8, label="owned atoms N / P")
    ax2.set_xlabel("ranks P")
    ax2.set_ylabel("atoms per rank")
    ax2.set_xticks(ps)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- evaluation


def _bench_system(opts: dict[str, Any], nranks: int, species: list[int] | None = None) -> Any:
    """The benchmark system on the source rank: fcc argon (rattled so forces are not zero by
    symmetry), ``atoms`` in all, or ``atoms`` per rank in the weak-scaling mode; with ``species``
    (MACE: the model's atomic numbers) the atoms get those species in a seeded random order."""
    import torch

    from twinshard.atoms.structures import fcc_argon
    from twinshard.atoms.system import System

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
    from twinshard.atoms.io import write

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
    return _bench_system(opts, nranks, getattr(pot, "species", None) if opts["potential"] == "mace" else None)


def _median(xs: list[float]) -> float:
    import statistics

    return float(statistics.median(xs)) if xs else float("nan")


def serial_eval_rank(opts: dict[str, Any]) -> dict[str, Any]:
    """One process: the serial evaluation (``atoms.potentials.evaluate``), the analytic path and
    the autograd path (today's, the oracle) back to back: time per evaluation (median of
    ``repeats`` after one warm-up that builds the neighbour list), list build time, tensor
    peak and resident peak of one evaluation, and the results (the parity reference)."""
    import time

    from twinshard.atoms.neighbors import VerletList
    from twinshard.atoms.plain_inputs import evaluate_serial, is_plain
    from twinshard.atoms.potentials import evaluate, has_analytic
    from twinshard.tensors.memory import RssWindow, peak_memory_during

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
            "seconds": _median(times),
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

    from twinshard.atoms.distributed import DistributedPotential
    from twinshard.atoms.driver import ghost_shell_estimate
    from twinshard.atoms.plain_inputs import potential_mode
    from twinshard.atoms.sharded import ShardedSystem
    from twinshard.comm import primitives as prim
    from twinshard.runtime import require_world
    from twinshard.tensors.memory import RssWindow, peak_memory_during

    world = require_world("twinshard bench atoms (evaluation)")
    nranks = world.size
    pot = _eval_potential(opts)
    system = _eval_system(opts, nranks, pot) if world.rank == 0 else None
    sharded = ShardedSystem.scatter(system, 0, cutoff=float(pot.cutoff), skin=float(opts["skin"]))
    dp = DistributedPotential(pot, analytic=opts["analytic"], mode=potential_mode(pot))
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
            _median(times),
            float(peak),
            float(build_peak),
            float(rss.peak_bytes),
            float(sharded.n_halo),
            float(sharded.n_owned),
            nl_seconds,
        ]
        + [_median([p.get(k, float("nan")) for p in parts]) for k in _PARTS],
        dtype=torch.float64,
        device=device,
    )
    allstats = prim.all_gather(stats[None], 0, sharded.group, op="bench").cpu()
    ids = prim.all_gather(sharded.ids.contiguous(), 0, sharded.group, sharded.counts(), op="bench")
    forces = prim.all_gather(res.forces.contiguous(), 0, sharded.group, sharded.counts(), op="bench")
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


def _parity(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    import torch

    order = torch.argsort(run.pop("ids"))
    forces = run.pop("forces")[order]
    ref_f = ref["forces"][torch.argsort(ref["ids"])]
    virial = run.pop("virial")
    out = {
        "energy_rel_error": abs(run["energy"] - float(ref["energy"])) / abs(float(ref["energy"])),
        "max_force_error": float((forces - ref_f).abs().max()),
        "max_force": float(ref_f.abs().max()),
    }
    if virial is not None and ref["virial"] is not None:
        out["max_virial_error"] = float((virial - ref["virial"]).abs().max())
    return out


def run_evaluation(args: argparse.Namespace) -> dict[str, Any]:
    """The evaluation benchmark: serial (analytic and autograd, back to back) and every P."""
    ranks = _ranks(args.ranks)
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
            r.update(_parity(r, ref["reference"]))
            s = ref["paths"][r["path"]]
            r["serial_seconds"] = s["seconds"]
            r["time_ratio_to_serial"] = r["seconds_per_evaluation"] / s["seconds"]
            r["serial_peak_memory_bytes"] = s["peak_memory_bytes"]
            r["halo_ratio"] = max(r["halo_atoms_per_rank"]) / r["ghost_shell_estimate"]
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
