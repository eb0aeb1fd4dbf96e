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
Times are from a shared CPU machine: compare ratios, not absolute seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

from twinshard.atoms.driver import COLLECTIVE_TIMEOUT, MDConfig, md_rank
from twinshard.runtime import shared_pool

__all__ = ["add_migrate_parser", "add_parser", "plot", "run", "run_migrate", "soak_rank"]

MEMORY_TARGET = 0.4
HALO_TARGET = 1.25


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``atoms`` under ``twinshard bench``."""
    p = subparsers.add_parser("atoms", help="distributed MD (MPNN) at P = 1, 2, 4 against serial")
    p.add_argument("--atoms", type=int, default=32768, help="at least this many atoms (fcc argon)")
    p.add_argument("--structure", default="fcc_argon", help="embedded structure name or file")
    p.add_argument("--potential", choices=("lj", "mpnn"), default="mpnn")
    p.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts")
    p.add_argument("--steps", type=int, default=3, help="MD steps per run")
    p.add_argument("--dt", type=float, default=2.0)
    p.add_argument("--temperature", type=float, default=60.0)
    p.add_argument("--skin", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one P may take in all")
    p.add_argument("--plot", default=None, help="write a PNG of memory and halo size against P")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
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
    with tempfile.TemporaryDirectory(prefix="twinshard-bench-atoms-") as tmp:
        cache = os.path.join(tmp, "serial.pt")
        runs = []
        for p in ranks:
            cfg = MDConfig(
                structure=args.structure,
                atoms=args.atoms,
                potential=args.potential,
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


def plot(result: dict[str, Any], path: str) -> None:
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


# ----------------------------------------------------------------------------- migration soak


def add_migrate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``migrate`` under ``twinshard bench``: the migration soak."""
    p = subparsers.add_parser(
        "migrate",
        help="soak: a hot Langevin run on P ranks until N migrations; no atom lost or duplicated",
        description="Run a hot Langevin liquid on --ranks local ranks (small domains, small skin, so "
        "atoms migrate often) in chunks of --chunk steps until at least --migrations atoms have "
        "changed owner, checking after every chunk that the global ids are exactly the starting "
        "ones (none lost, none duplicated). Prints one JSON line.",
    )
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--migrations", type=int, default=10_000, help="stop once this many have happened")
    p.add_argument("--atoms", type=int, default=4000)
    p.add_argument("--temperature", type=float, default=5000.0, help="K (hot: fast atoms)")
    p.add_argument("--friction", type=float, default=0.05, help="1/fs")
    p.add_argument("--dt", type=float, default=5.0, help="fs")
    p.add_argument("--cutoff", type=float, default=5.0)
    p.add_argument("--skin", type=float, default=0.6, help="small: frequent rebuilds and migrations")
    p.add_argument("--chunk", type=int, default=250, help="steps between id checks")
    p.add_argument("--max-steps", type=int, default=200_000, help="give up (and fail) after this many")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.set_defaults(func=run_migrate)
    return p


def soak_rank(opts: dict[str, Any]) -> dict[str, Any]:
    """Every rank: scatter a hot liquid, run Langevin chunks until ``opts["migrations"]``.

    After each chunk one all_gather of the owned ids checks that their union is
    the starting id set exactly once (a lost or duplicated atom raises on every
    rank, since every rank checks the same gathered ids).
    """
    import time

    import torch

    from twinshard.atoms.distributed import DistributedPotential
    from twinshard.atoms.driver import DistributedEngine
    from twinshard.atoms.md import Langevin, maxwell_boltzmann, simulate
    from twinshard.atoms.potentials import LennardJones
    from twinshard.atoms.sharded import ShardedSystem
    from twinshard.atoms.structures import random_packing
    from twinshard.comm import primitives as prim
    from twinshard.runtime import require_world

    world = require_world("twinshard bench migrate")
    system = None
    if world.rank == 0:
        system = random_packing(int(opts["atoms"]), seed=int(opts["seed"]))
        system.velocities = maxwell_boltzmann(
            system.masses, system.ids, opts["temperature"], seed=opts["seed"]
        )
    pot = LennardJones(cutoff=float(opts["cutoff"]))
    sharded = ShardedSystem.scatter(system, 0, cutoff=pot.cutoff, skin=float(opts["skin"]))
    expected = torch.arange(sharded.n_total, dtype=torch.int64)  # random_packing's ids
    engine = DistributedEngine(sharded, DistributedPotential(pot))
    integ = Langevin(opts["dt"], opts["temperature"], opts["friction"], seed=int(opts["seed"]))
    step, checks, heat = 0, 0, 0.0
    t0 = time.perf_counter()
    while sharded.migrations < opts["migrations"]:  # replicated count: every rank decides alike
        if step >= opts["max_steps"]:
            raise RuntimeError(
                f"only {sharded.migrations} migrations after {step} steps (target {opts['migrations']}); "
                "raise the temperature or --max-steps"
            )
        end = step + int(opts["chunk"])
        out = simulate(engine, integ, end, thermo_every=int(opts["chunk"]), start_step=step, heat=heat)
        step, heat = end, out["heat"]
        ids = prim.all_gather(sharded.ids.contiguous(), 0, None, sharded.counts(), op="soak")
        got = torch.sort(ids).values
        if not torch.equal(got, expected):
            lost = sorted(set(expected.tolist()) - set(got.tolist()))[:10]
            dup = torch.unique(got, return_counts=True)
            raise AssertionError(
                f"after step {step}: {expected.numel() - torch.unique(got).numel()} atoms lost "
                f"(first {lost}), duplicated ids {dup[0][dup[1] > 1][:10].tolist()}"
            )
        checks += 1
    seconds = time.perf_counter() - t0
    owned = prim.all_gather(torch.tensor([sharded.n_owned]), 0, None, op="soak").tolist()
    return {
        "bench": "migrate",
        "ranks": world.size,
        "atoms": sharded.n_total,
        "rank_grid": list(getattr(sharded.partition, "grid", [])),
        "steps": step,
        "migrations": int(sharded.migrations),
        "rebuilds": int(sharded.builds),
        "id_checks": checks,
        "atoms_conserved": True,  # every check passed (a failure raises above)
        "owned_atoms_per_rank": owned,
        "final_temperature": out["thermo"].rows[-1]["temperature"],
        "temperature": opts["temperature"],
        "seconds": seconds,
        "migrations_per_second": sharded.migrations / seconds if seconds > 0 else None,
    }


def run_migrate(args: argparse.Namespace) -> dict[str, Any]:
    """``twinshard bench migrate``: the soak on local ranks; prints the JSON line."""
    if args.ranks < 2:
        raise ValueError("the migration soak needs --ranks >= 2 (one rank never migrates)")
    opts = {
        k: getattr(args, k)
        for k in (
            "migrations",
            "atoms",
            "temperature",
            "friction",
            "dt",
            "cutoff",
            "skin",
            "chunk",
            "max_steps",
            "seed",
        )
    }
    res = shared_pool().run(
        soak_rank,
        int(args.ranks),
        opts,
        timeout=min(float(args.timeout), COLLECTIVE_TIMEOUT),
        deadline=float(args.timeout),
    )[0]
    if not args.json:
        print(
            f"{res['migrations']} migrations in {res['steps']} steps on {res['ranks']} ranks "
            f"({res['seconds']:.0f} s); ids conserved at all {res['id_checks']} checks",
            flush=True,
        )
    print(json.dumps(res))
    return res
