"""``twinshard demo``: the main job, every family on local ranks (or the torchrun world) against
its serial twin, as a table."""

from __future__ import annotations

import argparse
import importlib
import time
from typing import Any

__all__ = ["DEMO_SECTIONS", "add_parser", "run_demo"]

# Demo sections: modules with ``demo_rows()``, each called on every rank of the demo world.
DEMO_SECTIONS = ("twinshard.comm.adjoint", "twinshard.atoms.demo", "twinshard.pair.demo")


def _demo_rank(sections: tuple[str, ...]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name in sections:
        rows += importlib.import_module(name).demo_rows()
    return rows


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    from twinshard.runtime import get_world, reports, run_ranks

    t = time.perf_counter()
    rows = run_ranks(_demo_rank, args.ranks, DEMO_SECTIONS, option="--ranks")[0]
    wall = time.perf_counter() - t
    if not reports():
        return {"rows": rows}
    width = max(len(r["what"]) for r in rows)
    world = get_world()
    where = f"{args.ranks} local ranks" if world is None else f"{world.size} ranks ({world.backend})"
    print(f"twinshard demo: {where}, fp64, every result against its serial twin\n")
    print(f"{'what ran':<{width}}  {'grid':>5}  {'max abs err':>11}  {'bytes/rank':>10}")
    for r in rows:
        print(
            f"{r['what']:<{width}}  {r['grid']:>5}  {r['max_abs_error']:>11.2e}  {int(r['bytes_per_rank']):>10d}"
        )
    worst = max(r["max_abs_error"] for r in rows)
    print(f"\n{len(rows)} checks, worst error {worst:.2e}, {wall:.1f} s")
    return {"rows": rows, "worst_error": worst, "seconds": wall}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    demo = sub.add_parser("demo", help="run every family on local ranks against serial (embedded defaults)")
    demo.add_argument("--ranks", type=int, default=4)
    demo.set_defaults(func=run_demo)
    return demo
