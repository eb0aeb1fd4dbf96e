"""``twinshard``: demo, molecular dynamics, benchmarks.

twinshard demo                     the main job: every family on 4 local ranks vs serial
twinshard md [STRUCTURE] ...       distributed MD (see ``twinshard md --help``)
twinshard predict [--grid RxC]     Boltz-2 inference on a grid: structures + confidence files
twinshard bench pair|atoms|migrate|balance|batch|harness  benchmarks that print JSON (last stdout line)
"""

from __future__ import annotations

import argparse
import os
import sys

from twinshard.cli.demo import DEMO_SECTIONS, run_demo  # noqa: F401  (re-exported)

# One module per command (demo, md, predict, selftest, validate, harness; trunk and the benchmarks'
# parsers in twinshard.bench); main runs one inside the rank guard.


def build_parser() -> argparse.ArgumentParser:
    from twinshard.bench import atoms as bench_atoms
    from twinshard.bench import balance as bench_balance
    from twinshard.bench import batch_md as bench_batch
    from twinshard.bench import migrate as bench_migrate
    from twinshard.bench import pair as bench_pair
    from twinshard.bench import trunk as bench_trunk
    from twinshard.cli import demo, harness, md, predict, selftest, validate

    parser = argparse.ArgumentParser(
        prog="twinshard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_parser(sub)
    md.add_md_parser(sub)
    bench_trunk.add_parser(sub)
    predict.add_parser(sub)
    selftest.add_parser(sub)
    validate.add_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks (JSON on the last stdout line)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    bench_atoms.add_parser(bsub)
    bench_migrate.add_migrate_parser(bsub)
    bench_balance.add_balance_parser(bsub)
    bench_batch.add_batch_parser(bsub)
    bench_pair.add_parser(bsub)
    harness.add_parser(bsub)
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
