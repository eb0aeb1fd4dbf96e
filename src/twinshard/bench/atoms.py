"""``twinshard bench atoms``: distributed MD with the message-passing potential at P = 1, 2, 4.

For each rank count P the benchmark runs ``twinshard md`` (rank function
:func:`twinshard.atoms.dynamics.driver.md_rank`) on the same system — by default fcc
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

The evaluation section (:mod:`twinshard.bench.atoms_eval`; ``--mode both``, the default, puts it under
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

from twinshard.atoms.dynamics.driver import MDConfig, md_rank
from twinshard.bench.atoms_eval import (
    bench_system,
    mace_species,
    parse_ranks,
    run_evaluation,
    write_structure,
)
from twinshard.runtime import get_world, in_torchrun, reports, run_ranks

__all__ = ["add_parser", "plot", "run"]

MEMORY_TARGET = 0.4
HALO_TARGET = 1.25
# default --atoms by potential: MACE (random weights, CPU) is ~100x slower per atom than LJ
DEFAULT_ATOMS = {"lj": 32768, "mpnn": 32768, "mace": 2048}


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


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every P (spawning local ranks through the shared pool) and print the JSON line."""
    ranks = parse_ranks(args.ranks)
    if getattr(args, "atoms", None) is None:
        args.atoms = DEFAULT_ATOMS[args.potential]
    if getattr(args, "model", None) is not None and args.potential != "mace":
        raise ValueError("--model is an option of --potential mace")
    mode = getattr(args, "mode", "both")
    if mode != "md" and (get_world() is not None or in_torchrun()):
        raise ValueError(
            f"bench atoms --mode {mode} times a serial run on one local rank beside each P, which a "
            "torchrun world cannot host: use --mode md --ranks <the world's size> under torchrun, "
            "or run it without torchrun (it spawns its own local ranks)"
        )
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
            write_structure(structure, bench_system(vars(args), 1, mace_species(args.model)))
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
            r = run_ranks(md_rank, p, cfg, option="--ranks", deadline=float(args.timeout))[0]
            if not reports():
                continue
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
    if not reports():  # another rank of the torchrun world reports
        return {}
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
    halo_ratio = max(  # None when no run splits an axis (P = 1 imports nothing)
        (
            max(r["halo_atoms_per_rank"]) / r["ghost_shell_estimate"]
            for r in runs
            if r["ghost_shell_estimate"] > 0
        ),
        default=None,
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
        "halo_target_met": None if halo_ratio is None else halo_ratio <= HALO_TARGET,
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
