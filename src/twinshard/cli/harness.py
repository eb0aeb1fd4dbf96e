"""``twinshard bench harness``: the cost of one trivial job through the worker pool (or one round
on the torchrun world)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

__all__ = ["add_parser", "run_bench_harness"]


def _trivial(x: int) -> int:
    return x


def run_bench_harness(args: argparse.Namespace) -> dict[str, Any]:
    """Median time of a trivial function on N ranks through the reused worker pool (in a torchrun
    world: one round of running it on every rank and gathering the results)."""
    from twinshard.runtime import reports, run_ranks

    t = time.perf_counter()
    run_ranks(_trivial, args.ranks, 1, option="--ranks")
    first = time.perf_counter() - t
    times = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        run_ranks(_trivial, args.ranks, 1, option="--ranks")
        times.append(time.perf_counter() - t)
    out = {
        "bench": "harness",
        "ranks": args.ranks,
        "first_call_seconds": first,
        "median_seconds": statistics.median(times),
        "repeat": args.repeat,
    }
    if reports():
        print(json.dumps(out))
    return out


def add_parser(bsub: Any) -> argparse.ArgumentParser:
    h = bsub.add_parser("harness", help="time a trivial function through the parity harness")
    h.add_argument("--ranks", type=int, default=4)
    h.add_argument("--repeat", type=int, default=10)
    h.set_defaults(func=run_bench_harness)
    return h
