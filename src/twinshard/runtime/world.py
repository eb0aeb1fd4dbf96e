"""The process world: join torchrun's, or attach one built by a local launcher.

One world per process. ``init_world()`` joins a world that ``torchrun`` set up
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); ``twinshard.runtime.pool``
spawns local ranks and attaches them with ``attach_world``. Backend:
``cpu:gloo,cuda:nccl`` when CUDA is available (one group serves CUDA payloads over
NCCL and CPU ones, object collectives included, over gloo), gloo otherwise; the
world's ``device`` (CUDA or CPU) is where per-atom data and collective payloads
live. Every collective times out after ``timeout`` seconds (default 60).
"""

from __future__ import annotations

import atexit
import os
import re
import socket
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Imported before any world exists, on purpose: this module's functions take
# ``group=group.WORLD`` as a default argument, evaluated at import. Imported later (the
# torch profiler does so on entry), they would capture the live default group for the
# life of the process; destroy_process_group could then not free it, and gloo's threads
# would be torn down in interpreter finalization ("terminate called without an active
# exception", SIGABRT at exit).
import torch.distributed.nn.functional  # noqa: F401

from twinshard.runtime.errors import RankFailure, WorldError

DEFAULT_TIMEOUT = 60.0
# A command's collective that waits this long is a hang, not a slow rank (rank 0 reading a
# large structure while the others wait in a broadcast stays well under it).
COLLECTIVE_TIMEOUT = 300.0


@dataclass(frozen=True)
class World:
    """This process's view of the world: rank, size, backend, device, timeout."""

    rank: int
    size: int
    backend: str
    device: torch.device
    timeout: float

    @property
    def group(self) -> dist.ProcessGroup:
        return dist.group.WORLD


_WORLD: World | None = None


def choose_backend() -> str:
    """``cpu:gloo,cuda:nccl`` when CUDA is usable (both devices served), gloo otherwise."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def uses_cuda(backend: str) -> bool:
    """Whether a backend string (``nccl``, ``cpu:gloo,cuda:nccl``, ...) puts the world on CUDA."""
    return "nccl" in backend


def set_threads(threads: int | None) -> None:
    """Intra-op threads of this rank process (one by default: ranks share cores)."""
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def attach_world(
    rank: int,
    size: int,
    *,
    store: dist.Store | None = None,
    backend: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    local_rank: int | None = None,
) -> World:
    """Initialise the default process group for this rank and record the world."""
    global _WORLD
    if _WORLD is not None or dist.is_initialized():
        raise WorldError("a world is already initialised in this process; call shutdown_world() first")
    backend = backend or choose_backend()
    device = torch.device("cpu")
    if uses_cuda(backend):
        device = torch.device(
            "cuda", local_rank if local_rank is not None else rank % torch.cuda.device_count()
        )
        torch.cuda.set_device(device)
    kwargs: dict[str, Any] = dict(
        backend=backend, rank=rank, world_size=size, timeout=timedelta(seconds=timeout)
    )
    if store is not None:
        kwargs["store"] = store
    dist.init_process_group(**kwargs)
    _WORLD = World(rank=rank, size=size, backend=backend, device=device, timeout=timeout)
    return _WORLD


def init_world(
    backend: str | None = None, timeout: float = DEFAULT_TIMEOUT, threads: int | None = None
) -> World:
    """Join the world that torchrun (or any env:// launcher) set up, or return the current one."""
    if _WORLD is not None:
        return _WORLD
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise WorldError(
            f"init_world() needs the torchrun environment, but {', '.join(missing)} is not set: "
            "start the program with `torchrun --nproc-per-node=P ...`, or spawn local ranks with "
            "twinshard.runtime.launch(fn, nprocs)"
        )
    set_threads(threads)
    world = attach_world(
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        backend=backend,
        timeout=timeout,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )
    # A script that never calls shutdown_world() would leave the group to interpreter
    # finalization, where gloo's threads can be torn down in the wrong order ("terminate called
    # without an active exception", SIGABRT): destroy it at exit, before finalization.
    atexit.register(_shutdown_at_exit)
    _record_process(world.rank)
    return world


# Store key of a rank's process ("<host> <pid>"): a rank whose collective broke names a silent
# peer on its own host as the failed one only if that process is gone (twinshard.runtime.watchdog).
PROCESS_KEY = "twinshard/process/"


def _record_process(rank: int) -> None:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        _get_default_store().set(f"{PROCESS_KEY}{rank}", f"{socket.gethostname()} {os.getpid()}")
    except Exception:  # no store to write to: a failure is then named without this hint
        pass


def process_gone(record: str) -> bool:
    """Whether the process of a ``PROCESS_KEY`` record (``"<host> <pid>"``) has ended; False when
    it runs on another host (unknown there)."""
    host, _, pid = record.partition(" ")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    if not os.path.isdir("/proc"):  # no procfs (macOS): the signal-0 probe
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # exited, not yet reaped
    except OSError:
        return True


def _shutdown_at_exit() -> None:
    if _WORLD is not None:
        shutdown_world()


def in_torchrun() -> bool:
    """True when this process was started by torchrun (the env:// variables are set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def get_world() -> World | None:
    """The current world, or None."""
    return _WORLD


def require_world(what: str) -> World:
    """The current world; a clear WorldError when there is none."""
    if _WORLD is None:
        raise WorldError(
            f"{what} is a distributed entry point and no world is initialised in this process: run it "
            "inside twinshard.runtime.launch(fn, nprocs), under torchrun after "
            "twinshard.runtime.init_world(), or in a twinshard.testing run_on_world/run_on_grid call"
        )
    return _WORLD


_ON_SHUTDOWN: list[Any] = []


def on_shutdown(fn: Any) -> Any:
    """Register ``fn()`` to run when the world shuts down (caches of objects bound to its
    process groups clear themselves there; a later world must not reuse them)."""
    _ON_SHUTDOWN.append(fn)
    return fn


def shutdown_world() -> None:
    """Destroy the default process group (and the grids and meshes cached on it)."""
    global _WORLD
    for fn in _ON_SHUTDOWN:  # the grid and mesh caches among them
        fn()
    if dist.is_initialized():
        dist.destroy_process_group()
    _WORLD = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def format_exception(exc: BaseException) -> str:
    """``exc``'s traceback as text (its causes and notes included), as a rank reports it. An
    exception without a message of its own (an empty ``str``, or a TorchScript error that lost
    the text of a Python exception raised inside scripted code) gets a last line saying so: its
    type, its ``repr``, the first cause with a message, and how to see the lost text."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    note = empty_message_note(exc)
    return text if note is None else text.rstrip("\n") + "\n" + note + "\n"


_BARE_LINE = re.compile(r"^\s*[\w.]+:\s*$")  # "RuntimeError:" and nothing after it


def no_message(exc: BaseException) -> bool:
    """Has ``exc`` no message of its own: an empty ``str``, or a TorchScript error whose last
    line names an error type and nothing else (``RuntimeError:``)?"""
    text = str(exc).rstrip()
    return not text or ("TorchScript" in text and bool(_BARE_LINE.match(text.splitlines()[-1])))


def empty_message_note(exc: BaseException) -> str | None:
    """The line :func:`format_exception` adds for an exception without a message (None if it has one)."""
    if not no_message(exc):
        return None
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
    script = "TorchScript" in str(exc)
    lines = [
        f"(twinshard: this {kind} has no message of its own" + ("" if script else f"; repr: {exc!r:.300}")
    ]
    seen, cause = {id(exc)}, exc.__cause__ or exc.__context__
    while cause is not None and id(cause) not in seen and no_message(cause):
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    if cause is not None and id(cause) not in seen:
        first = str(cause).strip().splitlines()[0][:300]
        lines.append(f"; its cause: {type(cause).__qualname__}: {first}")
    if script:
        lines.append(
            "; it was raised inside TorchScript code, which drops the text of a Python exception "
            "raised there (a tensor subclass's __torch_dispatch__, a Python kernel of a custom op): "
            "the TorchScript traceback above shows where; run with PYTORCH_JIT=0 (scripting off) to "
            "see the Python error itself"
        )
    return "".join(lines) + ")"


def failure_payload(exc: BaseException) -> str | RankFailure:
    """What a rank reports: the agreed RankFailure itself (it names the origin), else its traceback."""
    return exc if isinstance(exc, RankFailure) else format_exception(exc)


def raise_failures(
    failures: dict[int, str | RankFailure], stuck: tuple[int, ...], finished: tuple[int, ...] = ()
) -> None:
    """Raise one RankFailure for a failed run: an agreed failure if any rank reported one, else the
    failures in arrival order (the first to arrive is the origin; the others are usually broken
    collectives caused by it)."""
    for payload in failures.values():
        if isinstance(payload, RankFailure):
            raise RankFailure(payload.failures, stuck=stuck, step=payload.step)
    raise RankFailure({r: str(tb) for r, tb in failures.items()}, stuck=stuck, finished=finished)
