"""``twinshard bench batch``: throughput of MD on a batch of systems in one run against the same
systems run one after another.

K systems of different sizes (random packings of ``--atoms MIN-MAX`` atoms, argon/krypton), the
plain message-passing model (graph storage), Langevin; for each ``--ranks`` value: the batch in one
``run_md([...])`` and each system alone (``run_md(atoms, storage="graph")``) one after another at the
same rank count. Reported: system-steps per second (systems x steps / seconds) of the MD loops
(``MDResult.seconds``: the slowest rank's loop, setup excluded) and of the wall time of the calls
(setup, scatter and the final evaluation included), and their ratios. One JSON line.

On a small shared CPU VM the times are noisy (other processes share the cores) and at tens of atoms
per system dominated by per-step overheads (collectives, Python): batching wins by paying them once
per step for all systems, the figure this measures; absolute times mean little here.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

__all__ = ["add_batch_parser", "run_batch_bench"]


def add_batch_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "batch",
        help="MD on a batch of systems in one run vs one after another: system-steps per second",
        description="K random packings of different sizes, plain MPNN, Langevin: the batch in one run "
        "against each system alone one after another, at each --ranks. One JSON line.",
    )
    p.add_argument("--systems", type=int, default=6, help="systems in the batch (default 6)")
    p.add_argument("--atoms", default="20-120", metavar="MIN-MAX", help="system sizes, evenly spread")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ranks", default="1,2", help="comma-separated rank counts (default 1,2)")
    p.add_argument("--cutoff", type=float, default=4.0)
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.set_defaults(func=run_batch_bench)
    return p


def _systems(k: int, lo: int, hi: int, seed: int) -> list[Any]:
    import torch

    from twinshard.atoms.data import structures

    out = []
    for i in range(k):
        n = lo + (hi - lo) * i // max(k - 1, 1)
        s = structures.build("random_packing", n_atoms=n, seed=seed + i)
        s.numbers = torch.tensor([18, 36])[torch.arange(n) % 2]
        out.append(s)
    return out


def run_batch_bench(args: argparse.Namespace) -> dict[str, Any]:
    from twinshard.atoms import run_md
    from twinshard.atoms.potentials.mpnn_plain import PlainMessagePassing
    from twinshard.runtime import reports

    lo, hi = (int(v) for v in str(args.atoms).split("-"))
    if args.systems < 1 or not 1 <= lo <= hi:
        raise ValueError(
            f"--systems >= 1 and --atoms MIN-MAX with 1 <= MIN <= MAX, got {args.systems}, {args.atoms}"
        )
    systems = _systems(args.systems, lo, hi, args.seed)
    model = PlainMessagePassing(species=(18, 36), cutoff=args.cutoff, n_features=args.features, n_layers=2)
    kw = dict(steps=args.steps, thermostat="langevin", temperature=100.0, initial_temperature=100.0)
    kw.update(seed=args.seed, thermo_every=max(args.steps, 1), skin=0.5, timeout=args.timeout)
    work = args.systems * args.steps
    rows = []
    for ranks in [int(r) for r in str(args.ranks).split(",")]:
        run_md(systems[:1], model, ranks=ranks, **{**kw, "steps": 1})  # start the ranks once (warm pool)
        t0 = time.perf_counter()
        outs = run_md(systems, model, ranks=ranks, **kw)
        batch_wall = time.perf_counter() - t0
        batch_loop = outs[0].seconds
        t0 = time.perf_counter()
        loops = [run_md(s, model, ranks=ranks, storage="graph", **kw).seconds for s in systems]
        serial_wall = time.perf_counter() - t0
        rows.append(
            {
                "ranks": ranks,
                "batched_loop_seconds": batch_loop,
                "one_after_another_loop_seconds": sum(loops),
                "batched_system_steps_per_second": work / batch_loop,
                "one_after_another_system_steps_per_second": work / sum(loops),
                "loop_speedup": sum(loops) / batch_loop,
                "batched_wall_seconds": batch_wall,
                "one_after_another_wall_seconds": serial_wall,
                "wall_speedup": serial_wall / batch_wall,
            }
        )
    result = {
        "benchmark": "batch_md",
        "systems": args.systems,
        "atoms_per_system": [s.n_atoms for s in systems],
        "steps": args.steps,
        "potential": f"PlainMessagePassing(features={args.features}, layers=2, cutoff={args.cutoff})",
        "thermostat": "langevin",
        "runs": rows,
        "note": "shared 2-core CPU VM: noisy times; per-step overheads dominate at these sizes",
    }
    if reports():
        if not args.json:
            for r in rows:
                print(
                    f"ranks {r['ranks']}: batched {r['batched_system_steps_per_second']:.1f} vs one after "
                    f"another {r['one_after_another_system_steps_per_second']:.1f} system-steps/s "
                    f"(loop x{r['loop_speedup']:.2f}, wall x{r['wall_speedup']:.2f})"
                )
        print(json.dumps(result))
    return result
