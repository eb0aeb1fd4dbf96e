"""Moving pieces of tiled operands between the ranks of a pair grid (the contractions' transport).

An operand is stored tiled like a pair tensor (:class:`Tiled`: the local tile and the global
(rows, cols)); :class:`_Fetch` delivers to every rank the (rows, cols) range it wants of
several operands with one sparse point-to-point exchange per operand. Used by the Cannon and
SUMMA schedules of :mod:`twinshard.pair.layers.contraction` and by the stationary-gradient
schedules of :mod:`twinshard.pair.layers.stationary`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from twinshard.comm import primitives as P
from twinshard.pair.tiling import block_range
from twinshard.runtime.grid import ProcessGrid

__all__ = ["Range", "Tiled"]

Range = tuple[int, int]


def _inter(a: Range, b: Range) -> Range | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True)
class Tiled:
    """A stored matrix operand: its local tile and global (rows, cols) on the grid."""

    tile: torch.Tensor
    rows: int
    cols: int

    def owned(self, grid: ProcessGrid, rank: int) -> tuple[Range, Range]:
        r, c = grid.coords_of(rank)
        return block_range(self.rows, grid.rows, r), block_range(self.cols, grid.cols, c)


class _Fetch:
    """Pieces of several stored operands moved by sparse exchanges (one per operand, at most one
    message per peer each), posted at construction and collected by :meth:`wait` /
    :meth:`wait_pieces`.

    ``wants[i][rank]`` is the (rows, cols) range of operand i, in stored orientation, that
    ``rank`` needs; a range may reach past the operand's extent (a pair tensor padded
    separately along each axis, see ``twinshard.pair.tiling``): what lies beyond is zero. Every rank derives every peer's wants from replicated metadata, so all
    agree on who sends what without a handshake. A piece this rank holds itself never travels
    (a view of its tile); a piece wanted by several peers (a SUMMA row or column broadcast) is
    made contiguous once and that buffer goes to each of them; a piece arrives in its own buffer
    (nothing is concatenated or assembled unless :meth:`wait` is asked for whole tiles).
    """

    def __init__(
        self,
        grid: ProcessGrid,
        ops: Sequence[Tiled],
        wants: Sequence[Callable[[int], tuple[Range, Range]]],
        op: str,
    ):
        me = grid.rank
        self.ops, self.mine = ops, [w(me) for w in wants]
        dtype = ops[0].tile.dtype
        self._local: list[list[tuple[Range, Range, torch.Tensor]]] = []
        self._recv: list[list[tuple[Range, Range]]] = []
        self._pending = []
        for i, (x, want) in enumerate(zip(ops, wants)):
            (r0, r1), (c0, c1) = x.owned(grid, me)
            sends: list[tuple[int, torch.Tensor]] = []
            flat: dict[tuple[Range, Range], torch.Tensor] = {}
            local = []
            for peer in range(grid.size):
                pr, pc = want(peer)
                ir, ic = _inter((r0, r1), pr), _inter((c0, c1), pc)
                if not (ir and ic):
                    continue
                piece = x.tile[:, ir[0] - r0 : ir[1] - r0, ic[0] - c0 : ic[1] - c0]
                if peer == me:
                    local.append((ir, ic, piece))
                    continue
                if (ir, ic) not in flat:
                    flat[(ir, ic)] = piece.to(dtype).contiguous().view(-1)
                sends.append((peer, flat[(ir, ic)]))
            recv, recvs = [], []
            for peer in range(grid.size):
                if peer == me:
                    continue
                orr, oc = x.owned(grid, peer)
                ir, ic = _inter(orr, self.mine[i][0]), _inter(oc, self.mine[i][1])
                if ir and ic:
                    recv.append((ir, ic))
                    recvs.append((peer, (self._numel(i, ir, ic),)))
            self._local.append(local)
            self._recv.append(recv)
            self._pending.append(P.exchange(sends, recvs, dtype=dtype, op=op, async_op=True))

    def _numel(self, i: int, ir: Range, ic: Range) -> int:
        t = self.ops[i].tile
        n = (ir[1] - ir[0]) * (ic[1] - ic[0]) * t.shape[0]
        for s in t.shape[3:]:
            n *= s
        return n

    def wait_pieces(self) -> list[list[tuple[int, int, torch.Tensor]]]:
        """Per operand: ``(row offset, col offset, piece)`` within the wanted range, covering the
        part of it inside the operand (possibly no piece at all)."""
        outs = []
        for i, (x, pending) in enumerate(zip(self.ops, self._pending)):
            (r0, _), (c0, _) = self.mine[i]
            t = x.tile
            pieces = [(ir[0] - r0, ic[0] - c0, p) for ir, ic, p in self._local[i]]
            for (ir, ic), buf in zip(self._recv[i], pending.wait()):
                shape = (t.shape[0], ir[1] - ir[0], ic[1] - ic[0]) + tuple(t.shape[3:])
                pieces.append((ir[0] - r0, ic[0] - c0, buf.view(shape)))
            outs.append(pieces)
        self._pending = []
        return outs

    def wait(self) -> list[torch.Tensor]:
        """Per operand: the whole wanted range as one tensor (a piece as received or held when
        it is the whole range, else the pieces copied into a new tile, zero where the range
        reaches past the operand)."""
        outs = []
        for (x, ((r0, r1), (c0, c1))), pieces in zip(zip(self.ops, self.mine), self.wait_pieces()):
            held = sum(p.shape[1] * p.shape[2] for _, _, p in pieces)
            whole = held == (r1 - r0) * (c1 - c0)
            if whole and len(pieces) == 1:
                outs.append(pieces[0][2])
                continue
            t = x.tile
            shape = (t.shape[0], r1 - r0, c1 - c0) + tuple(t.shape[3:])
            out = t.new_empty(shape) if whole else t.new_zeros(shape)
            for ro, co, p in pieces:
                out[:, ro : ro + p.shape[1], co : co + p.shape[2]].copy_(p)
            outs.append(out)
        return outs
