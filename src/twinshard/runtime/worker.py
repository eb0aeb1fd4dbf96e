"""The rank process of a local ``WorkerPool``: its loop, and how it is started.

A worker is a fresh interpreter started as ``python -c BOOT`` (see ``command``), never a
multiprocessing spawn: spawn re-runs the parent's ``__main__`` in the child, which breaks a
script without an ``if __name__ == "__main__":`` guard (every worker would run the script
again), a script read from standard input (``FileNotFoundError: '<stdin>'``), and a
notebook. ``BOOT`` sets the parent's ``sys.path`` (as spawn does) and imports only this
module. Jobs arrive cloudpickled, so functions and classes defined in the parent's
``__main__`` travel by value.

Protocol on the connection (one socket of a ``multiprocessing.Pipe``, passed as a file
descriptor): the worker sends ``b"ready"`` once torch is imported, then per job receives
``pickle((sys.path, (job id, world key, cloudpickle((fn, args, kwargs)))))`` and answers ``pickle((job id, ok, result or failure))``. EOF on
the connection ends the worker; so does the death of its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
from datetime import timedelta
from multiprocessing.connection import Connection

import torch.distributed as dist

from twinshard.runtime.world import attach_world, failure_payload, get_world, set_threads, shutdown_world

BOOT = "import json, sys; sys.path[:] = json.loads(sys.argv[1]); from twinshard.runtime.worker import main; main()"


def command(fd: int, index: int, port: int, threads: int | None, parent: int) -> list[str]:
    """The command line of worker ``index`` talking on file descriptor ``fd``."""
    path = [os.fspath(p) for p in sys.path if isinstance(p, (str, os.PathLike))]  # spawn's sys.path
    return [
        sys.executable,
        "-c",
        BOOT,
        json.dumps(path),
        str(fd),
        str(index),
        str(port),
        str(threads),
        str(parent),
    ]


def main() -> None:
    """Entry point of ``BOOT``: ``argv[2:]`` = fd, index, port, threads ("None": unchanged), parent pid."""
    fd, index, port, threads, parent = sys.argv[2:7]
    # Ctrl-C in a terminal reaches the whole process group: the parent alone handles it (it
    # stops its ranks and says so in one line); a worker would print a KeyboardInterrupt each.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(
        int(index), Connection(int(fd)), int(port), None if threads == "None" else int(threads), int(parent)
    )


def die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this worker when the launching process dies (even by SIGKILL),
    so a worker blocked in a collective is never left behind as an orphan."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except Exception:  # not fatal: the connection's EOF still ends an idle worker
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def serve(index: int, conn: Connection, port: int, threads: int | None, parent: int | None = None) -> None:
    """Run jobs from ``conn`` until EOF (see the module doc for the protocol)."""
    if parent is not None:
        die_with_parent(parent)
    set_threads(threads)
    os.environ.setdefault("TWINSHARD_WORKER", str(index))
    store = None
    key = None
    conn.send_bytes(b"ready")  # torch is imported: the parent may start the job clock
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return
        path, (jid, world_key, call) = pickle.loads(msg)
        for p in reversed(path):
            if p not in sys.path:
                sys.path.insert(0, p)
        try:
            fn, args, kwargs = pickle.loads(call)  # cloudpickle's output loads with pickle
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
            out = (jid, False, failure_payload(exc))
        try:
            data = pickle.dumps(out)
        except Exception as exc:
            data = pickle.dumps((out[0], False, f"result of rank {index} is not picklable: {exc!r}"))
        try:
            conn.send_bytes(data)
        except OSError:  # the parent is gone (it stopped waiting, or exited): nothing to report to
            return
