"""The communication ledger: calls and *modelled* bytes per op, per rank.

Inside ``with CommLedger() as ledger:`` every twinshard comm op on this rank
records one call and the bytes it puts on and takes off the wire *according to
a model of the collective* (in the dtype actually sent, padding included): the
bytes are computed from the buffer sizes and the algorithm assumed below, not
measured on the network (gloo or NCCL may use another algorithm, e.g. a tree
all-reduce, and add headers). Backward passes record under ``"<op>:backward"``.
Each rank holds its own ledger; tests and benchmarks return
``ledger.summary()`` from every rank, whose byte keys say ``modelled``.

The ``torch.distributed`` object collectives (``broadcast_object_list``,
``all_gather_object``, ``gather_object``, ``scatter_object_list``,
``send_object_list``, ``recv_object_list``), which twinshard uses for
fail-together agreement (``runtime.agree``) and feature metadata
(``pair.features``), bypass ``twinshard.comm``: while any ledger is active they
are wrapped and recorded under their own names, with the bytes of their pickled
payloads (torch sends an int64 size per object, then the bytes, padded to the
largest object in the gathers).

Byte conventions (group of n ranks, B = bytes of the buffer on the wire):
- all_reduce: sent = recv = 2 * (n - 1) * B // n (a ring reduce-scatter + all-gather);
- all_gather: the local (padded) block goes to n - 1 peers, n - 1 blocks come back;
- reduce_scatter: n - 1 blocks of the (padded) output size go out and come in;
- all_to_all: rows sent to / received from other ranks (the own block stays local);
- broadcast: the source sends B to each of n - 1 peers; every other rank receives B;
- point-to-point ops (ring shift, transpose, permute, exchange): exactly what goes to
  and comes from other ranks; a rank sending to itself copies and records nothing.
- object collectives (P = pickled bytes of one object, M = the largest P):
  broadcast_object_list as a broadcast of 8 k + sum(P) for k objects;
  all_gather_object as an all_gather of 8 + M; gather_object: each non-destination
  rank sends 8 + its P, the destination receives n - 1 blocks of 8 + M;
  scatter_object_list: the source sends 8 + P to each peer; send/recv_object_list:
  8 k + sum(P) point to point.
A group of one rank issues no collective and records nothing.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

BYTES_MODEL = (
    "modelled from buffer sizes (all_reduce as a ring: 2 (n-1)/n x buffer; object collectives as "
    "pickled payloads), not measured on the wire"
)


@dataclass
class OpStats:
    calls: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0


_ACTIVE: list[CommLedger] = []


class CommLedger:
    """Per-rank record of communication calls and bytes, by op name."""

    def __init__(self) -> None:
        self.ops: dict[str, OpStats] = {}

    def __enter__(self) -> CommLedger:
        if not _ACTIVE:
            _wrap_object_collectives()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self)
        if not _ACTIVE:
            _unwrap_object_collectives()

    def record(self, op: str, sent: int, recv: int) -> None:
        st = self.ops.setdefault(op, OpStats())
        st.calls += 1
        st.bytes_sent += int(sent)
        st.bytes_recv += int(recv)

    @property
    def bytes_sent(self) -> int:
        return sum(s.bytes_sent for s in self.ops.values())

    @property
    def bytes_recv(self) -> int:
        return sum(s.bytes_recv for s in self.ops.values())

    @property
    def calls(self) -> int:
        return sum(s.calls for s in self.ops.values())

    def summary(self) -> dict[str, Any]:
        """JSON-ready: totals and per-op {calls, modelled_bytes_sent, modelled_bytes_recv}, and
        ``bytes_model`` (how the bytes are obtained). ``bytes_sent``/``bytes_recv`` repeat the
        modelled figures under their earlier names."""

        def op(v: OpStats) -> dict[str, int]:
            return {
                "calls": v.calls,
                "modelled_bytes_sent": v.bytes_sent,
                "modelled_bytes_recv": v.bytes_recv,
                "bytes_sent": v.bytes_sent,
                "bytes_recv": v.bytes_recv,
            }

        return {
            "bytes_model": BYTES_MODEL,
            "calls": self.calls,
            "modelled_bytes_sent": self.bytes_sent,
            "modelled_bytes_recv": self.bytes_recv,
            "bytes_sent": self.bytes_sent,
            "bytes_recv": self.bytes_recv,
            "ops": {k: op(v) for k, v in sorted(self.ops.items())},
        }


def record(op: str, sent: int, recv: int) -> None:
    """Record one call of ``op`` in every active ledger of this process."""
    for ledger in _ACTIVE:
        ledger.record(op, sent, recv)


# ------------------------------------------------------------------ object collectives

_OBJECT_OPS = (
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)
_ORIGINALS: dict[str, Callable[..., Any]] = {}
# position of the ``group`` argument in each signature (it may come positionally)
_GROUP_ARG = {
    "broadcast_object_list": 2,
    "all_gather_object": 2,
    "gather_object": 3,
    "scatter_object_list": 3,
    "send_object_list": 2,
    "recv_object_list": 2,
}


def _psize(obj: Any) -> int:
    return len(pickle.dumps(obj))


def _object_bytes(name: str, args: tuple, kw: dict[str, Any], n: int, me: int) -> tuple[int, int]:
    """(sent, recv) of one object collective, by the model in the module docstring."""

    def arg(i: int, key: str, default: Any = None) -> Any:
        return args[i] if len(args) > i else kw.get(key, default)

    if name == "broadcast_object_list":
        objs, src = arg(0, "object_list"), arg(1, "src", 0)
        b = 8 * len(objs) + sum(_psize(o) for o in objs)
        return (b * (n - 1), 0) if me == src else (0, b)
    if name == "all_gather_object":
        b = 8 + max(_psize(o) for o in arg(0, "object_list"))
        return b * (n - 1), b * (n - 1)
    if name == "gather_object":
        out, dst = arg(1, "object_gather_list"), arg(2, "dst", 0)
        if me == dst and out is not None:
            return 0, (8 + max(_psize(o) for o in out)) * (n - 1)
        return 8 + _psize(arg(0, "obj")), 0
    if name == "scatter_object_list":
        out, inp, src = (
            arg(0, "scatter_object_output_list"),
            arg(1, "scatter_object_input_list"),
            arg(2, "src", 0),
        )
        if me == src and inp is not None:
            return sum(8 + _psize(o) for i, o in enumerate(inp) if i != me), 0
        return 0, 8 + _psize(out[0])
    objs = arg(0, "object_list")
    b = 8 * len(objs) + sum(_psize(o) for o in objs)
    return (b, 0) if name == "send_object_list" else (0, b)


def _wrapped(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:
        out = fn(*args, **kw)  # the recv/gather lists are filled now: their sizes are known
        group = args[_GROUP_ARG[name]] if len(args) > _GROUP_ARG[name] else kw.get("group")
        n = dist.get_world_size(group)
        if _ACTIVE and n > 1:  # src/dst are global ranks in torch.distributed
            sent, recv = _object_bytes(name, args, kw, n, dist.get_rank())
            record(name, sent, recv)
        return out

    return call


def _wrap_object_collectives() -> None:
    for name in _OBJECT_OPS:
        fn = getattr(dist, name, None)
        if fn is not None and name not in _ORIGINALS:
            _ORIGINALS[name] = fn
            setattr(dist, name, _wrapped(name, fn))


def _unwrap_object_collectives() -> None:
    for name, fn in _ORIGINALS.items():
        setattr(dist, name, fn)
    _ORIGINALS.clear()
