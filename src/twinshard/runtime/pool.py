"""Local rank processes: a reusable worker pool, and ``launch`` built on it.

Spawning a rank costs seconds (Python + torch import), so a ``WorkerPool``
keeps its processes and reuses them: a job on n ranks runs on workers 0..n-1,
which (re)build their world only when n, the backend or the timeout changed.
Workers are fresh interpreters that never import the caller's ``__main__`` (see
``twinshard.runtime.worker``), so local ranks work from a script without an
``if __name__ == "__main__":`` guard, from standard input and from a notebook.
Jobs travel cloudpickled (what is defined in ``__main__`` goes by value, the
rest by reference), results pickled; the parent's ``sys.path`` is replayed in
the worker first, so test modules import there as they do in the parent.

Failure handling: when a rank raises, the other ranks get ``FAILURE_GRACE``
seconds to report (fail-together steps make them raise promptly), then any
still running are stopped and one RankFailure names the failing rank, carries
its traceback and lists the stuck ranks. A job with no result after its
timeout stops the ranks that have not answered and names them; an interrupt
(Ctrl-C, or SIGTERM under ``rank_guard``) while ranks start or run stops them
and propagates. Stopped workers are replaced on the next job.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import Any

import cloudpickle
import torch.distributed as dist

from twinshard.runtime import worker
from twinshard.runtime.errors import RankFailure, short_reason
from twinshard.runtime.world import (
    COLLECTIVE_TIMEOUT,
    DEFAULT_TIMEOUT,
    free_port,
    get_world,
    in_torchrun,
    init_world,
    raise_failures,
)

FAILURE_GRACE = 3.0
SPAWN_TIMEOUT = 300.0


def _died(code: int | None) -> str:
    """How a worker process ended, for a message: its exit code, or the signal that killed it."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


class WorkerPool:
    """Reusable local rank processes (started lazily, replaced when stopped)."""

    def __init__(self, threads: int | None = 1):
        self.threads = threads
        self._port = free_port()
        self._store = dist.TCPStore(
            "127.0.0.1", self._port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._gen = 0
        self._world: tuple | None = None
        self._jid = 0

    def _start(self, i: int) -> tuple[subprocess.Popen, Connection]:
        parent, child = Pipe()  # a socket pair: the child's end travels as a file descriptor
        try:
            fd = child.fileno()
            cmd = worker.command(fd, i, self._port, self.threads, os.getpid())
            # stdin: the parent's may be the script itself (``python - < script.py``)
            p = subprocess.Popen(cmd, pass_fds=(fd,), stdin=subprocess.DEVNULL)
        finally:
            child.close()
        return p, parent

    def _ensure(self, n: int) -> None:
        started: list[int] = []
        try:
            for i in range(n):
                if i < len(self._procs) and self._procs[i].poll() is None:
                    continue
                p, conn = self._start(i)
                started.append(i)
                if i < len(self._procs):
                    self._conns[i].close()  # the ended worker's end: no descriptor left behind
                    self._procs[i], self._conns[i] = p, conn
                    self._world = None  # a replaced worker joins no old world
                else:
                    self._procs.append(p)
                    self._conns.append(conn)
            for i in started:  # starting is slow on a loaded machine: not part of a job's timeout
                if not self._conns[i].poll(SPAWN_TIMEOUT):
                    raise RankFailure({i: f"rank {i} process did not start within {SPAWN_TIMEOUT:.0f} s"})
                try:
                    ready = self._conns[i].recv_bytes()
                except (EOFError, OSError):
                    raise RankFailure(
                        {i: f"rank {i} process died while starting ({self._end_of(i)})"}
                    ) from None
                if ready != b"ready":
                    raise RankFailure(
                        {i: f"rank {i} process sent {ready[:40]!r} instead of its ready signal"}
                    )
        except BaseException:  # a Ctrl-C, or one that failed: none half-started is left for the next job
            for i in started:
                self._stop(i)
            raise

    def _end_of(self, i: int) -> str:
        """How worker ``i``, whose connection broke, ended (a dying process may take a moment)."""
        try:
            return _died(self._procs[i].wait(timeout=5))
        except subprocess.TimeoutExpired:
            self._stop(i)
            return "its connection broke; stopped"

    def _stop(self, i: int) -> None:
        self._procs[i].kill()
        self._procs[i].wait()
        self._world = None

    def run(
        self,
        fn: Callable[..., Any],
        nprocs: int,
        *args: Any,
        backend: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        deadline: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on ranks 0..nprocs-1 of one world; return per-rank results.

        ``timeout``: seconds any one collective may wait; ``deadline``: seconds the whole job may
        take (default: ``timeout``), after which the ranks still running are named and stopped.
        """
        if nprocs < 1:
            raise ValueError(f"nprocs must be >= 1, got {nprocs}")
        try:  # by value what a worker cannot import (defined in __main__, nested), by reference the rest
            call = cloudpickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(
                f"the job for the local ranks cannot be pickled ({short_reason(exc)}): pass a function "
                "and arguments that pickle (no open files, locks, sockets or generators)"
            ) from exc
        self._ensure(nprocs)
        if self._world is None or self._world[1:] != (nprocs, backend, timeout):
            self._gen += 1
            self._world = (self._gen, nprocs, backend, timeout)
        self._jid += 1
        msg = pickle.dumps((list(sys.path), (self._jid, self._world, call)))
        try:
            for i in range(nprocs):
                try:
                    self._conns[i].send_bytes(msg)
                except OSError:  # it died since _ensure: _collect reports it
                    pass
            outs, failures, silent = self._collect(nprocs, timeout if deadline is None else deadline)
        except BaseException:  # a Ctrl-C or SIGTERM (watchdog.Stopped) while the ranks run: stop them
            for i in range(nprocs):
                self._stop(i)
            raise
        stuck = tuple(sorted(silent))
        for r in stuck:  # still running the job: unusable until replaced
            self._stop(r)
        if failures:
            self._world = None
            raise_failures(failures, stuck, tuple(sorted(outs)))
        return [outs[r] for r in range(nprocs)]

    def _collect(self, n: int, timeout: float) -> tuple[dict[int, Any], dict[int, Any], set[int]]:
        outs: dict[int, Any] = {}
        failures: dict[int, Any] = {}
        deadline = time.monotonic() + timeout + FAILURE_GRACE
        pending = {self._conns[i]: i for i in range(n)}
        while pending:
            now = time.monotonic()
            if now >= deadline:
                if not failures:
                    ranks = sorted(pending.values())
                    failures[ranks[0]] = (
                        f"no result from ranks {ranks} within the job's time limit of {timeout:g} s "
                        "(a command's --timeout): the job was still running (give a longer --timeout), "
                        "or it hung (a rank that never reached a collective its peers entered)"
                    )
                break
            for conn in wait(list(pending), timeout=min(0.5, deadline - now)):
                i = pending[conn]
                try:
                    jid, ok, payload = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    jid, ok = self._jid, False
                    payload = f"rank {i} process died ({self._end_of(i)})"
                    self._world = None
                if jid != self._jid:
                    continue  # a late answer to an earlier job
                del pending[conn]
                if ok:
                    outs[i] = payload
                else:
                    failures[i] = payload
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
        return outs, failures, set(pending.values())

    def close(self, grace: float = 2.0) -> None:
        """End every worker: an idle one exits on its connection's EOF; one still running after
        ``grace`` seconds is killed."""
        for c in self._conns:
            c.close()
        for p in self._procs:
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs, self._conns, self._world = [], [], None


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    deadline: float | None = None,
    threads: int | None = 1,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` fresh local ranks inside one world.

    Returns the per-rank results (index = rank). ``fn`` and its arguments travel cloudpickled
    (defined in ``__main__``: by value), its results pickled. A failing rank makes this raise RankFailure naming it, with its traceback; a
    collective waiting longer than ``timeout`` seconds fails its rank; a job still running after
    ``deadline`` seconds (default ``timeout``) is stopped, naming the ranks that never finished.
    """
    pool = WorkerPool(threads=threads)
    try:
        return pool.run(fn, nprocs, *args, backend=backend, timeout=timeout, deadline=deadline, **kwargs)
    finally:
        pool.close()


_SHARED: WorkerPool | None = None


def shared_pool() -> WorkerPool:
    """The process-wide pool that tests and benchmarks reuse (closed at exit)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = WorkerPool()
        atexit.register(_SHARED.close)
    return _SHARED


def stop_local_ranks() -> bool:
    """Stop the shared pool's workers now (a command interrupted by a signal); whether it had any.
    The pool stays usable: its next job starts new workers."""
    if _SHARED is None or not _SHARED._procs:
        return False
    _SHARED.close(grace=0.0)
    return True


def run_ranks(
    fn: Callable[..., Any],
    nranks: int,
    *args: Any,
    option: str | None = None,
    backend: str | None = None,
    timeout: float | None = None,
    deadline: float | None = None,
) -> list[Any]:
    """Every rank's result of ``fn(*args)``: the one way a command runs its rank body.

    In a world (one that torchrun launched, joined here with ``init_world``; or an enclosing
    one) every rank runs ``fn`` itself, so no local ranks are spawned, and the results are
    gathered on rank 0 with ``gather_object`` (bookkeeping outside every ledger): rank 0 gets
    every rank's result, another rank a list holding only its own (the others ``None``). ``option`` names the
    command-line option that sets ``nranks`` (``"--grid"``): a world of another size then
    raises on every rank (the same arguments, the same decision); without it ``nranks`` is
    ignored in a world (``--ranks`` of ``md``: torchrun sets the world). Outside a world, ``fn``
    runs on ``nranks`` local ranks of the shared pool. ``deadline``: seconds the whole job may
    take (local ranks; a command's ``--timeout``); ``timeout``: seconds any one collective may
    wait (default: the deadline, at most ``COLLECTIVE_TIMEOUT``; ``DEFAULT_TIMEOUT`` without one).
    """
    if timeout is None:
        timeout = DEFAULT_TIMEOUT if deadline is None else min(float(deadline), COLLECTIVE_TIMEOUT)
    world = get_world()
    if world is None and in_torchrun():
        world = init_world(backend=backend, timeout=timeout)
    if world is None:
        return shared_pool().run(fn, nranks, *args, backend=backend, timeout=timeout, deadline=deadline)
    if option is not None and nranks != world.size:
        raise ValueError(
            f"{option} asks for {nranks} ranks but this world has {world.size}: launch "
            f"{nranks} processes (torchrun --nproc-per-node={nranks}) or change {option}"
        )
    mine = fn(*args)
    results: list[Any] = [None] * world.size
    dist.gather_object(mine, results if world.rank == 0 else None, dst=0)
    results[world.rank] = mine
    return results


def reports() -> bool:
    """Whether this process prints a command's result: rank 0 of a world, or a process without one."""
    world = get_world()
    return world is None or world.rank == 0


__all__ = [
    "FAILURE_GRACE",
    "RankFailure",
    "WorkerPool",
    "launch",
    "reports",
    "run_ranks",
    "shared_pool",
    "stop_local_ranks",
]
