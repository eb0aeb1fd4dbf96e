"""Fail loudly on every rank of a torchrun world: ``rank_guard``.

Under torchrun every rank is its own program. A rank that raises outside an agreement step
exits; its peers, blocked in a collective with it, see only a broken connection (gloo:
"Connection closed by peer") or torchrun's SIGTERM, and say nothing of why. ``rank_guard``
wraps one rank's work (``twinshard.cli.main`` wraps every entry point in it) and announces a
failure through the c10d store of the world (the TCPStore torchrun started):

- an error of this rank's own: it records its traceback (``twinshard/failure/<rank>``) and
  claims the origin (``twinshard/origin``, compare-and-set: the first rank wins), then raises
  RankFailure naming itself;
- a broken collective, a store error, SIGTERM or SIGINT (a peer failed, or the launcher stops
  the world): it records itself as broken (``twinshard/broken/<rank>``), waits up to
  ``grace`` seconds for the origin's record and raises RankFailure naming the origin with its
  traceback. When no rank records an error (one was killed by a signal, or crashed in native
  code), a silent rank whose process is gone is named (each rank records its host and pid at
  ``init_world``; a peer on the same host checks ``/proc``), else the ranks that recorded
  nothing once every other rank has;
- an agreed RankFailure (every rank raised it together) passes through unchanged.

Peers blocked in a gloo collective wake when the failed rank's process exits (its sockets
close), so the failed rank exits at once after reporting (``twinshard.cli`` ends the process
with ``os._exit`` after a failure in a torchrun world: no teardown that could block on a
broken group). Outside a world of several ranks the guard changes nothing.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from twinshard.runtime.errors import RankFailure
from twinshard.runtime.world import PROCESS_KEY, format_exception, get_world, process_gone

__all__ = ["Stopped", "is_comm_error", "rank_guard", "resolve_failure"]

PREFIX = "twinshard/"
# Messages of a collective or store broken by a peer that went away (gloo, NCCL, c10d store).
COMM_ERROR_MARKS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "Socket Timeout",
    "Timed out",
    "timed out",
    "NCCL communicator was aborted",
)


# Seconds a broken rank still waits once every rank but one has recorded (the last one may be
# an origin still writing its record).
SETTLE = 1.0


class Stopped(Exception):
    """This rank was stopped by a signal (the launcher stops every rank when one fails)."""


def is_comm_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective or store broken by a peer (not an error of this rank's own)."""
    if isinstance(exc, (Stopped, KeyboardInterrupt, dist.DistError)):
        return True
    text = str(exc)
    return any(mark in text for mark in COMM_ERROR_MARKS)


def _store() -> dist.Store | None:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None


def _read(store: dist.Store, key: str) -> str | None:
    if not store.check([PREFIX + key]):
        return None
    return store.get(PREFIX + key).decode(errors="replace")


def _silent_note(rank: int, also: list[int], gone: bool) -> str:
    more = f" (ranks {also} also recorded nothing)" if also else ""
    how = "its process is gone" if gone else "it recorded nothing"
    return (
        f"rank {rank} stopped without reporting an error{more}: {how}; it was killed by a signal "
        "(SIGKILL, out of memory) or crashed in native code, and the collectives of its peers broke"
    )


def _gone(store: dist.Store, ranks: list[int]) -> list[int]:
    """The ranks among ``ranks`` whose process is known to have ended (same host only)."""
    out = []
    for r in ranks:
        record = store.get(f"{PROCESS_KEY}{r}").decode() if store.check([f"{PROCESS_KEY}{r}"]) else ""
        if record and process_gone(record):
            out.append(r)
    return out


def resolve_failure(exc: BaseException, grace: float = 10.0) -> BaseException:
    """The RankFailure this rank raises for ``exc`` (recorded in the world's store; see module doc)."""
    world = get_world()
    if isinstance(exc, RankFailure) or world is None or world.size == 1:
        return exc
    me, mine = world.rank, format_exception(exc)
    store = _store()
    if store is None:
        return RankFailure({me: mine})
    try:
        if not is_comm_error(exc):
            store.set(f"{PREFIX}failure/{me}", mine)
            origin = int(store.compare_set(f"{PREFIX}origin", "", str(me)).decode())
            if origin == me:
                return RankFailure({me: mine})
            return RankFailure({origin: _read(store, f"failure/{origin}") or "(no traceback)", me: mine})
        store.set(f"{PREFIX}broken/{me}", mine)
        deadline = time.monotonic() + grace
        settle = None  # when one rank alone had recorded nothing: give it a moment to record
        while True:
            origin_s = _read(store, "origin")
            if origin_s is not None and int(origin_s) != me:
                origin = int(origin_s)
                return RankFailure({origin: _read(store, f"failure/{origin}") or "(no traceback)", me: mine})
            silent = [
                r
                for r in range(world.size)
                if not store.check([f"{PREFIX}failure/{r}"]) and not store.check([f"{PREFIX}broken/{r}"])
            ]
            # A silent rank whose process is gone failed; one still alive may only be blocked in a
            # collective that has not broken yet (every peer must name the same rank).
            gone = _gone(store, silent)
            if gone:
                return RankFailure({gone[0]: _silent_note(gone[0], gone[1:], True), me: mine})
            now = time.monotonic()
            if len(silent) == 1:
                settle = settle if settle is not None else now + SETTLE
            if (settle is not None and now >= settle) or now >= deadline:
                break
            time.sleep(0.1)
        if silent:
            return RankFailure({silent[0]: _silent_note(silent[0], silent[1:], False), me: mine})
        return RankFailure({me: mine})
    except Exception:  # the store is gone too (it lived in a process that exited)
        return RankFailure({me: mine})


def _raise_stopped(signum: int, frame: object) -> None:
    signal.signal(signum, signal.SIG_IGN)  # once: the guard is reporting now
    raise Stopped(f"stopped by signal {signal.Signals(signum).name}")


@contextmanager
def rank_guard(grace: float | None = None) -> Iterator[None]:
    """Run one rank's work; on failure raise a RankFailure that names the failing rank on every rank.

    ``grace``: seconds a rank whose collective broke waits for the origin's record (default
    ``min(10, world timeout)``). SIGTERM is turned into an exception while the guard is active
    (main thread only), so a rank that its launcher stops still reports who failed.
    """
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _raise_stopped) if main else None
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, (SystemExit, GeneratorExit)):
            raise
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        world = get_world()
        wait = grace if grace is not None else min(10.0, world.timeout if world is not None else 10.0)
        err = resolve_failure(exc, wait)
        if err is exc:
            raise
        raise err from exc
    finally:
        if main:
            signal.signal(signal.SIGTERM, old if old is not None else signal.SIG_DFL)
