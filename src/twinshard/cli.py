"""``twinshard``: demo, molecular dynamics, benchmarks.

twinshard demo                     the main job: every family on 4 local ranks vs serial
twinshard md [STRUCTURE] ...       distributed MD (see ``twinshard md --help``)
twinshard bench pair|atoms|migrate|harness  benchmarks that print JSON (last stdout line)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from typing import Any

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="twinshard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run every family on local ranks against serial (embedded defaults)")
    demo.add_argument("--ranks", type=int, default=4)
    demo.set_defaults(func=run_demo)
    from twinshard.atoms.md_cli import add_md_parser
    from twinshard.bench import atoms as bench_atoms
    from twinshard.bench import migrate as bench_migrate
    from twinshard.bench import pair as bench_pair

    add_md_parser(sub)
    from twinshard.bench import trunk as bench_trunk

    bench_trunk.add_parser(sub)
    from twinshard.selftest import add_parser as add_selftest_parser

    add_selftest_parser(sub)
    from twinshard.atoms.parallel.validate import add_parser as add_validate_parser

    add_validate_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks (JSON on the last stdout line)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    bench_atoms.add_parser(bsub)
    bench_migrate.add_migrate_parser(bsub)
    bench_pair.add_parser(bsub)
    h = bsub.add_parser("harness", help="time a trivial function through the parity harness")
    h.add_argument("--ranks", type=int, default=4)
    h.add_argument("--repeat", type=int, default=10)
    h.set_defaults(func=run_bench_harness)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; under torchrun every rank runs it inside ``rank_guard``, so a failure on
    one rank ends every rank with an error naming it (see ``twinshard.runtime.watchdog``)."""
    from twinshard.runtime import RankFailure, get_world
    from twinshard.runtime.watchdog import Stopped, rank_guard

    args = build_parser().parse_args(argv)
    joined = get_world() is None  # a world this call joins (torchrun) is ended here, not an enclosing one
    code = 0
    try:
        with rank_guard():
            result = args.func(args)
        if isinstance(result, dict) and (result.get("selftest") == "failed" or result.get("passed") is False):
            code = 1  # a parity check failed (selftest, validate): the table / JSON above names it
    except (ValueError, FileNotFoundError) as exc:
        print(f"twinshard: error: {exc}", file=sys.stderr)
        code = 2
    except RankFailure as exc:  # the origin's own error line; the traceback only on request
        if os.environ.get("TWINSHARD_DEBUG"):
            _end_world(1)
            raise
        message = exc.message() or "(no message)"
        where = f" in step {exc.step!r}" if exc.step else ""
        # one write: ranks share the launcher's stderr, and a line written in pieces interleaves
        sys.stderr.write(
            f"\ntwinshard: error on rank {exc.rank}{where}: {message}{_reporter(exc.rank)}\n"
            "(set TWINSHARD_DEBUG=1 for the full traceback)\n"
        )
        sys.stderr.flush()
        code = 1
    except (KeyboardInterrupt, Stopped, ConnectionError, EOFError) as exc:  # one line, no traceback
        if os.environ.get("TWINSHARD_DEBUG"):
            _end_world(1)
            raise
        code = _stopped(exc)
    except BaseException:
        _end_world(1)
        raise
    return _end_world(code) if joined else code


def _stopped(exc: BaseException) -> int:
    """Say in one line that a signal or a dying local rank ended the command, after stopping the
    local ranks; the exit code (128 + signal number for a signal, as a shell reports it)."""
    import signal

    from twinshard.runtime import stop_local_ranks

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the cleanup
    had_ranks = stop_local_ranks()
    ranks = "; the local ranks were stopped" if had_ranks else ""
    if isinstance(exc, KeyboardInterrupt):
        what, code = "stopped by SIGINT (Ctrl-C)", 128 + signal.SIGINT
    elif isinstance(exc, (ConnectionError, EOFError)):
        what, code = f"a local rank process died (its connection broke: {type(exc).__name__})", 1
    else:  # watchdog.Stopped: SIGTERM under rank_guard
        what, code = str(exc).replace("stopped by signal", "stopped by"), 128 + signal.SIGTERM
    sys.stderr.write(f"\ntwinshard: {what}{ranks}\n")
    sys.stderr.flush()
    return code


def _reporter(origin: int) -> str:
    from twinshard.runtime import get_world

    world = get_world()
    return f" (reported by rank {world.rank})" if world is not None and world.rank != origin else ""


def _end_world(code: int) -> int:
    """End the world this process joined under torchrun: destroy the process group before the
    interpreter exits (a live gloo group torn down by interpreter finalization can abort with
    "terminate called without an active exception"); after a failure, end the process at once
    (its peers wake when its sockets close; a teardown could wait on a broken group)."""
    from twinshard.runtime import get_world, in_torchrun, shutdown_world

    if get_world() is None or not in_torchrun():
        return code
    if code != 0:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    shutdown_world()
    return code


if __name__ == "__main__":
    sys.exit(main())
