"""``twinshard selftest``: the parity checks a person runs first on a new machine (GPU or CPU).

Runs, on ``--ranks`` local ranks (4: the pair and comm checks use a 2 x 2 grid) or on the
world torchrun launched, the demo sections against their serial twins: the adjoint identity
of every comm op, halo MD (LJ and message passing, NVE and Langevin) against the serial run,
triangle multiplication (outgoing, incoming) and outer product mean forward + backward. Each
row's worst absolute error is gated by the fp64 round-off budget
(``twinshard.testing.checks.tolerance`` at unit scale: the demo inputs are O(1)). Prints a
table, or one JSON line with ``--json``; exit status 0 only when every check passes.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from twinshard.cli.demo import DEMO_SECTIONS


def selftest_rows() -> list[dict[str, Any]]:
    """Every section's rows (collective: every rank of a 4-rank world calls it)."""
    import importlib

    from twinshard.testing.checks import tolerance

    rows: list[dict[str, Any]] = []
    for name in DEMO_SECTIONS:
        for r in importlib.import_module(name).demo_rows():
            tol = tolerance(torch.float64, 1.0)
            rows.append({**r, "tolerance": tol.atol, "passed": bool(r["max_abs_error"] <= tol.atol)})
    return rows


def run_selftest(args: argparse.Namespace) -> dict[str, Any]:
    from twinshard.runtime import choose_backend, get_world, reports, run_ranks

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to torch here; use --device cpu")
    if args.ranks != 4:
        raise ValueError(
            f"--ranks must be 4 (the pair and comm checks run on a 2 x 2 grid), got {args.ranks}"
        )
    backend = "gloo" if args.device == "cpu" else choose_backend()
    t = time.perf_counter()
    results = run_ranks(selftest_rows, args.ranks, backend=backend, option="--ranks")
    world = get_world()  # rows are replicated: in a world every rank reports its own pass or fail
    rows = results[world.rank if world is not None else 0]
    ranks, device = args.ranks, (str(world.device) if world is not None else args.device)
    out = {
        "selftest": "passed" if all(r["passed"] for r in rows) else "failed",
        "device": device,
        "ranks": ranks,
        "checks": len(rows),
        "failed": [r["what"] for r in rows if not r["passed"]],
        "worst_error": max(r["max_abs_error"] for r in rows),
        "seconds": time.perf_counter() - t,
        "rows": rows,
    }
    if not reports():
        return out
    if args.json:
        print(json.dumps(out))
    else:
        for r in rows:
            print(
                f"{'ok  ' if r['passed'] else 'FAIL'} {r['what']:<70} {r['grid']:>6} {r['max_abs_error']:.2e}"
            )
        print(
            f"selftest {out['selftest']}: {len(rows)} checks on {ranks} ranks ({device}), {out['seconds']:.1f} s"
        )
    return out


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("selftest", help="parity checks to run first on a new machine (exit 0 = all pass)")
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    p.set_defaults(func=run_selftest)
    return p
