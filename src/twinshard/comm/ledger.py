"""The communication ledger: calls and bytes per op, per rank.

Inside ``with CommLedger() as ledger:`` every twinshard comm op on this rank
records one call and the bytes it put on and took off the wire (in the dtype
actually sent, padding included). Backward passes record under
``"<op>:backward"``. Each rank holds its own ledger; tests and benchmarks
return ``ledger.summary()`` from every rank.

Byte conventions (group of n ranks, B = bytes of the buffer on the wire):
- all_reduce: sent = recv = 2 * (n - 1) * B // n (a ring reduce-scatter + all-gather);
- all_gather: the local (padded) block goes to n - 1 peers, n - 1 blocks come back;
- reduce_scatter: n - 1 blocks of the (padded) output size go out and come in;
- all_to_all: rows sent to / received from other ranks (the own block stays local);
- broadcast: the source sends B to each of n - 1 peers; every other rank receives B;
- point-to-point ops (ring shift, transpose, permute, exchange): exactly what goes to
  and comes from other ranks; a rank sending to itself copies and records nothing.
A group of one rank issues no collective and records nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self)

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
        """JSON-ready: totals and per-op {calls, bytes_sent, bytes_recv}."""
        return {
            "calls": self.calls,
            "bytes_sent": self.bytes_sent,
            "bytes_recv": self.bytes_recv,
            "ops": {k: vars(v).copy() for k, v in sorted(self.ops.items())},
        }


def record(op: str, sent: int, recv: int) -> None:
    """Record one call of ``op`` in every active ledger of this process."""
    for ledger in _ACTIVE:
        ledger.record(op, sent, recv)
