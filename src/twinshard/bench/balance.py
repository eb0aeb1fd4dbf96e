"""``twinshard bench balance``: load balance of the spatial partition on inhomogeneous systems.

For each system (an argon slab with 50% vacuum, a droplet in a box, a cluster in one corner; LJ)
and each rank count, two Langevin MD runs from the same start: equal slabs on the automatic grid
(``balance=None``; the grid already weighs where the atoms are) and balanced cut planes
(``balance=THRESHOLD``). Reported per run: the grid, owned atoms per rank and max / mean at the
start and at the end, halo atoms per rank, rebalances, and seconds per MD step (the slowest
rank's loop time / steps). The box-only grid of the old automatic choice (equal slabs, grid by
surface alone) is reported beside them as ``box_only``: owned atoms per rank and max / mean,
from the partition alone (no run). Prints one JSON line; ``--plot FILE.png`` draws max / mean
and step time per system.

On a small shared CPU machine the step times are noisy and at a few hundred atoms dominated by
per-step overheads: the owned-atom figures are the result, the times a sanity check.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from twinshard.runtime import reports, run_ranks

__all__ = ["add_balance_parser", "run_balance", "balance_rank"]

SYSTEMS = ("slab", "droplet", "corner")


def add_balance_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``balance`` under ``twinshard bench``."""
    p = subparsers.add_parser(
        "balance",
        help="load balance: owned atoms per rank and step time, equal slabs vs balanced cut planes",
        description="Langevin LJ MD on inhomogeneous argon systems (a slab with 50%% vacuum, a droplet, "
        "a cluster in a corner) at each --ranks, with equal slabs and with --balance THRESHOLD: owned "
        "atoms per rank, max/mean at start and end, rebalances, seconds per step. One JSON line.",
    )
    p.add_argument("--ranks", default="2,4", help="comma-separated rank counts (default 2,4)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {','.join(SYSTEMS)}")
    p.add_argument("--atoms", type=int, default=400, help="about this many atoms per system")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--balance", type=float, default=1.05, metavar="THRESHOLD", help="max/mean threshold")
    p.add_argument("--cutoff", type=float, default=6.0)
    p.add_argument("--skin", type=float, default=0.5)
    p.add_argument("--temperature", type=float, default=60.0, help="K (Langevin)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, metavar="FILE.png")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.set_defaults(func=run_balance)
    return p


def _system(name: str, atoms: int, seed: int) -> Any:
    from twinshard.atoms.data import structures

    build = {
        "slab": structures.argon_slab,
        "droplet": structures.argon_droplet,
        "corner": structures.argon_corner,
    }
    if name not in build:
        raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
    return build[name](n_atoms=atoms, seed=seed)


def balance_rank(opts: dict[str, Any]) -> dict[str, Any]:
    """Every rank: scatter the system (rank 0 builds it), run Langevin MD, report the counts."""
    import time

    import torch

    from twinshard.atoms.dynamics.md import Langevin, maxwell_boltzmann, simulate
    from twinshard.atoms.dynamics.run import DistributedEngine
    from twinshard.atoms.parallel.balance import imbalance
    from twinshard.atoms.parallel.evaluate import place
    from twinshard.atoms.potentials import LennardJones
    from twinshard.comm import primitives as prim
    from twinshard.runtime import require_world

    world = require_world("twinshard bench balance")
    system = None
    if world.rank == 0:
        system = _system(opts["system"], int(opts["atoms"]), int(opts["seed"]))
        system.velocities = maxwell_boltzmann(
            system.masses, system.ids, opts["temperature"], seed=opts["seed"]
        )
    pot = LennardJones(cutoff=float(opts["cutoff"]))
    sh, dp = place(system, pot, skin=float(opts["skin"]), balance=opts["balance"])
    start = sh.counts()
    engine = DistributedEngine(sh, dp)
    integ = Langevin(2.0, float(opts["temperature"]), 0.01, seed=int(opts["seed"]))
    t0 = time.perf_counter()
    simulate(engine, integ, int(opts["steps"]), thermo_every=int(opts["steps"]))
    seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    slowest = float(prim.all_gather(seconds, 0, None, op="bench").max())
    halo = prim.all_gather(torch.tensor([sh.n_halo]), 0, None, op="bench").tolist()
    final = sh.counts()
    return {
        "grid": list(sh.partition.grid),
        "owned_start": start,
        "owned_final": final,
        "imbalance_start": imbalance(start),
        "imbalance_final": imbalance(final),
        "halo_final": halo,
        "rebalances": int(sh.rebalances),
        "migrations": int(sh.migrations),
        "seconds_per_step": slowest / max(1, int(opts["steps"])),
    }


def _box_only(name: str, atoms: int, seed: int, nranks: int, width: float) -> dict[str, Any]:
    """The old automatic choice: equal slabs on the grid of least surface, from the box alone."""
    import torch

    from twinshard.atoms.parallel.balance import imbalance
    from twinshard.atoms.parallel.partition import SpatialPartition

    s = _system(name, atoms, seed)
    part = SpatialPartition.build(s.cell, tuple(bool(p) for p in s.pbc.tolist()), nranks, width)
    owned = torch.bincount(part.owner_of(part.fractional(s.positions)), minlength=nranks).tolist()
    return {"grid": list(part.grid), "owned": owned, "imbalance": imbalance(owned)}


def run_balance(args: argparse.Namespace) -> dict[str, Any]:
    """``twinshard bench balance``: every system x rank count, equal slabs then balanced."""
    ranks = [int(r) for r in str(args.ranks).split(",") if r]
    names = [n for n in str(args.systems).split(",") if n]
    rows = []
    for name in names:
        for p in ranks:
            base = {
                "system": name,
                "atoms": int(args.atoms),
                "seed": int(args.seed),
                "temperature": float(args.temperature),
                "cutoff": float(args.cutoff),
                "skin": float(args.skin),
                "steps": int(args.steps),
            }
            row: dict[str, Any] = {"system": name, "ranks": p}
            row["n_atoms"] = _system(name, int(args.atoms), int(args.seed)).n_atoms
            row["box_only"] = _box_only(name, int(args.atoms), int(args.seed), p, args.cutoff + args.skin)
            for key, bal in (("equal_slabs", None), ("balanced", float(args.balance))):
                out = run_ranks(
                    balance_rank, p, {**base, "balance": bal}, option="--ranks", deadline=args.timeout
                )
                row[key] = out[0]
            rows.append(row)
            if reports() and not args.json:
                e, b = row["equal_slabs"], row["balanced"]
                print(
                    f"{name:8s} P={p}: box-only {row['box_only']['owned']} ({row['box_only']['imbalance']:.2f}); "
                    f"equal slabs {e['grid']} {e['owned_final']} ({e['imbalance_final']:.2f}, "
                    f"{1e3 * e['seconds_per_step']:.1f} ms/step); balanced {b['grid']} {b['owned_final']} "
                    f"({b['imbalance_final']:.2f}, {1e3 * b['seconds_per_step']:.1f} ms/step, "
                    f"{b['rebalances']} rebalances)",
                    flush=True,
                )
    result = {
        "bench": "balance",
        "balance": float(args.balance),
        "steps": int(args.steps),
        "cutoff": float(args.cutoff),
        "skin": float(args.skin),
        "note": "step times on a shared 2-core CPU VM are noisy; owned atoms per rank are the result",
        "rows": rows,
    }
    if not reports():
        return result
    if args.plot:
        _plot(rows, args.plot)
        result["plot"] = args.plot
    print(json.dumps(result))
    return result


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['system']}\nP={r['ranks']}" for r in rows]
    x = range(len(rows))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    w = 0.27
    a1.bar([i - w for i in x], [r["box_only"]["imbalance"] for r in rows], w, label="box-only grid (before)")
    a1.bar(list(x), [r["equal_slabs"]["imbalance_final"] for r in rows], w, label="weighed grid, equal slabs")
    a1.bar([i + w for i in x], [r["balanced"]["imbalance_final"] for r in rows], w, label="balanced cuts")
    a1.set_ylabel("max / mean owned atoms")
    a1.axhline(1.0, color="k", lw=0.5)
    a2.bar(
        [i - w / 2 for i in x],
        [1e3 * r["equal_slabs"]["seconds_per_step"] for r in rows],
        w,
        label="equal slabs",
    )
    a2.bar(
        [i + w / 2 for i in x], [1e3 * r["balanced"]["seconds_per_step"] for r in rows], w, label="balanced"
    )
    a2.set_ylabel("ms per MD step (slowest rank; noisy 2-core VM)")
    for ax in (a1, a2):
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
