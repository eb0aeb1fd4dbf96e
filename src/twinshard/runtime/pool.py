"""Local rank processes: a reusable worker pool, and ``launch`` built on it.

Spawning a rank costs seconds (Python + torch import), so a ``WorkerPool``
keeps its processes and reuses them: a job on n ranks runs on workers 0..n-1,
which (re)build their world only when n, the backend or the timeout changed.
Jobs and results travel pickled by value over pipes; functions must be
importable (module level) and the parent's ``sys.path`` is replayed in the
worker first, so test modules import there as they do in the parent.

Failure handling: when a rank raises, the other ranks get ``FAILURE_GRACE``
seconds to report (fail-together steps make them raise promptly), then any
still running are stopped and one RankFailure names the failing rank, carries
its traceback and lists the stuck ranks. A job with no result after its
timeout stops the ranks that have not answered and names them. Stopped
workers are replaced on the next job.
"""

from __future__ import annotations

import atexit
import os
import pickle
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from twinshard.runtime.errors import RankFailure
from twinshard.runtime.world import (
    COLLECTIVE_TIMEOUT,
    DEFAULT_TIMEOUT,
    attach_world,
    failure_payload,
    free_port,
    get_world,
    in_torchrun,
    init_world,
    raise_failures,
    set_threads,
    shutdown_world,
)

FAILURE_GRACE = 3.0
SPAWN_TIMEOUT = 300.0


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this worker when the launching process dies (even by SIGKILL),
    so a worker blocked in a collective is never left behind as an orphan."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except Exception:  # not fatal: the pipe's EOF still ends an idle worker
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _worker(index: int, conn: Connection, port: int, threads: int | None, parent: int | None = None) -> None:
    if parent is not None:
        _die_with_parent(parent)
    set_threads(threads)
    os.environ.setdefault("TWINSHARD_WORKER", str(index))
    store = None
    key = None
    conn.send_bytes(b"ready")  # torch is imported: the parent may start the job clock
    while True:
        try:
            msg = conn.recv_bytes()
        except EOFError:
            return
        path, job = pickle.loads(msg)
        for p in reversed(path):
            if p not in sys.path:
                sys.path.insert(0, p)
        try:
            jid, world_key, fn, args, kwargs = pickle.loads(job)
            gen, size, backend, timeout = world_key
            if key != world_key:
                if get_world() is not None:
                    shutdown_world()
                if store is None:
                    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
                attach_world(
                    index,
                    size,
                    store=dist.PrefixStore(f"world{gen}", store),
                    backend=backend,
                    timeout=timeout,
                )
                key = world_key
            out = (jid, True, fn(*args, **kwargs))
        except BaseException as exc:  # every failure goes back to the parent, never swallowed
            key = None  # a failed rank may have left its world broken: rebuild it next time
            out = (jid if "jid" in locals() else -1, False, failure_payload(exc))
        try:
            data = pickle.dumps(out)
        except Exception as exc:
            data = pickle.dumps((out[0], False, f"result of rank {index} is not picklable: {exc!r}"))
        try:
            conn.send_bytes(data)
        except OSError:  # the parent is gone (it stopped waiting, or exited): nothing to report to
            return


class WorkerPool:
    """Reusable local rank processes (spawned lazily, replaced when stopped)."""

    def __init__(self, threads: int | None = 1):
        self.threads = threads
        self._ctx = mp.get_context("spawn")
        self._port = free_port()
        self._store = dist.TCPStore(
            "127.0.0.1", self._port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._gen = 0
        self._world: tuple | None = None
        self._jid = 0

    def _ensure(self, n: int) -> None:
        started = []
        for i in range(n):
            if i < len(self._procs) and self._procs[i].is_alive():
                continue
            parent, child = self._ctx.Pipe()
            p = self._ctx.Process(
                target=_worker, args=(i, child, self._port, self.threads, os.getpid()), daemon=True
            )
            p.start()
            child.close()
            started.append((i, parent))
            if i < len(self._procs):
                self._procs[i], self._conns[i] = p, parent
                self._world = None  # a replaced worker joins no old world
            else:
                self._procs.append(p)
                self._conns.append(parent)
        for i, conn in started:  # spawning is slow on a loaded machine: not part of a job's timeout
            if not conn.poll(SPAWN_TIMEOUT) or conn.recv_bytes() != b"ready":
                raise RuntimeError(f"worker {i} did not start within {SPAWN_TIMEOUT:.0f} s")

    def _stop(self, i: int) -> None:
        self._procs[i].kill()
        self._procs[i].join()
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
        self._ensure(nprocs)
        if self._world is None or self._world[1:] != (nprocs, backend, timeout):
            self._gen += 1
            self._world = (self._gen, nprocs, backend, timeout)
        self._jid += 1
        job = pickle.dumps((self._jid, self._world, fn, args, kwargs))
        msg = pickle.dumps((list(sys.path), job))
        for i in range(nprocs):
            self._conns[i].send_bytes(msg)
        outs, failures, silent = self._collect(nprocs, timeout if deadline is None else deadline)
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
                    payload = f"rank {i} process died (exit code {self._procs[i].exitcode})"
                    self._world = None
                if jid not in (self._jid, -1):
                    continue  # a late answer to an earlier job
                del pending[conn]
                if ok:
                    outs[i] = payload
                else:
                    failures[i] = payload
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
        return outs, failures, set(pending.values())

    def close(self) -> None:
        for c in self._conns:
            c.close()
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
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

    Returns the per-rank results (index = rank). ``fn`` must be importable and its results
    picklable. A failing rank makes this raise RankFailure naming it, with its traceback; a
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


__all__ = ["FAILURE_GRACE", "RankFailure", "WorkerPool", "launch", "reports", "run_ranks", "shared_pool"]
