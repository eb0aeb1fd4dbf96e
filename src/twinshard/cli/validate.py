"""``twinshard validate``: serial against distributed on one system, and the first op that
diverged (the tracer: :mod:`twinshard.atoms.parallel.validate`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from twinshard.atoms.parallel.validate import ValidateConfig, run_validate

__all__ = ["add_parser"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "validate",
        help="serial vs distributed (dispatch) on one system: per-output errors, first diverging op",
    )
    p.add_argument("--potential", choices=("mpnn", "mace"), default="mpnn")
    p.add_argument("--model", default=None, help="a saved model (MACE: saved by mace-torch)")
    p.add_argument("--structure", default=None, help="a structure file (default: an embedded periodic box)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument(
        "--storage",
        choices=("halo", "graph"),
        default="halo",
        help="halo: spatial domains with halos; graph: atoms split by index, geometry replicated",
    )
    p.add_argument(
        "--skin", type=float, default=0.5, help="Verlet skin in Angstrom (never changes the model's graph)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds the distributed run may take before its ranks are stopped",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON line")
    p.set_defaults(func=_main)
    return p


def _main(args: argparse.Namespace) -> dict[str, Any] | None:
    cfg = ValidateConfig(
        args.potential,
        args.model,
        args.structure,
        args.ranks,
        args.storage,
        skin=args.skin,
        timeout=args.timeout,
    )
    report = run_validate(cfg)
    if report is None:  # another rank of the world reports
        return None
    if args.json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"  {k:20s} {v}")
    if not report["passed"]:
        div = report["first_divergence"]
        where = "" if div is None else f": first diverging op {div['op']} (handler {div['handler']})"
        print(f"twinshard validate: beyond tolerance{where}", file=sys.stderr)
    return report
