"""``twinshard bench migrate``: the migration soak.

A hot Langevin liquid (LJ) on ``--ranks`` local ranks, with small domains and a
small skin so atoms change owner often, runs in chunks until ``--migrations``
atoms have migrated; after every chunk one all_gather of the owned ids checks
that no atom was lost or duplicated. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from twinshard.runtime import reports, run_ranks

__all__ = ["add_migrate_parser", "run_migrate", "soak_rank"]


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

    from twinshard.atoms.data.structures import random_packing
    from twinshard.atoms.dynamics.md import Langevin, maxwell_boltzmann, simulate
    from twinshard.atoms.dynamics.run import DistributedEngine
    from twinshard.atoms.parallel.evaluate import place
    from twinshard.atoms.potentials import LennardJones
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
    sharded, dp = place(system, pot, skin=float(opts["skin"]))
    expected = torch.arange(sharded.n_total, dtype=torch.int64)  # random_packing's ids
    engine = DistributedEngine(sharded, dp)
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
    res = run_ranks(soak_rank, int(args.ranks), opts, option="--ranks", deadline=float(args.timeout))[0]
    if not reports():  # another rank of the torchrun world reports
        return res
    if not args.json:
        print(
            f"{res['migrations']} migrations in {res['steps']} steps on {res['ranks']} ranks "
            f"({res['seconds']:.0f} s); ids conserved at all {res['id_checks']} checks",
            flush=True,
        )
    print(json.dumps(res))
    return res
