"""Moves of single-track rows between ranks: the column block of a tensor sharded over grid rows.

A ``single`` tensor ``s[B, Nr, ...]`` lives at ``(Shard(1), Replicate())``: rank (r, c) holds the
token rows ``I_r`` (Nr / R of them). A pair tile (r, c) also needs the tokens of its COLUMN block
``J_c`` (Nc / C of them): keys of the attention with pair bias, the column side of an outer sum
``a_i + b_j``, the ``j`` features of the relative position encoding or of the template pair
features. :func:`column_moves` schedules that move (rank (r, c) gets the rows ``J_c`` from ranks
(a, (r + c) mod C), ``a`` the grid rows whose block meets ``J_c``: the senders are spread over the
grid row so no rank serves a whole column), :func:`move_rows` performs it on plain tensors and
:class:`MoveRows` is its differentiable form.

Placements. In: this rank's tile of a single tensor, ``[B, Nr/R, ...]`` (tokens on dim 1).
Out: ``[B, Nc/C, ...]``, the rows ``J_c`` (rows beyond the single's Nr, which only the column
axis has, are zero). ``template`` tensors ``[B, T, Nr/R, ...]`` (tokens on dim 2) move with
:func:`column_block` ``(token_dim=2)``.

Collectives. Forward: one point-to-point exchange (``P.exchange`` through ``Packed``: one message
per peer), each rank sends at most its Nr/R rows to each receiver and receives Nc/C rows in all.
Backward (:class:`MoveRows`): the reverse exchange: each piece's gradient goes back to its sender,
which adds it into the gradient of its own rows. The gradient of a single tensor replicated along
the grid row is then a partial sum over the row: callers wrap the input in
``comm.sync_grad(x, grid.row_group)`` (one all-reduce along the row in backward), as every twin
that reads a replicated single tensor does.

Memory: nothing saved for backward but the move plan; the moved block is ``[B, Nc/C, ...]``.
"""

from __future__ import annotations

from typing import Any

import torch

from twinshard.comm.amp import autocast_rule
from twinshard.pair.layers.triangle_attention import Packed, assemble_rows
from twinshard.runtime.grid import ProcessGrid

__all__ = ["MoveRows", "Moves", "column_block", "column_moves", "move_rows"]

Moves = tuple[list[tuple[int, slice]], list[tuple[int, slice]], int]


def column_moves(grid: ProcessGrid, n: tuple[int, int]) -> Moves:
    """``(sends = [(receiver, rows of my single block)], recvs = [(sender, rows of my column
    block)], column block length)``: rank (r, c) gets the single rows ``J_c`` from ranks
    (a, (r + c) mod C). ``n``: the pair's (Nr, Nc); column rows beyond the single's Nr are
    padding (zero, never sent)."""
    R, C = grid.rows, grid.cols
    nI, nJ = n[0] // R, n[1] // C
    me = grid.rank
    sends, recvs = [], []
    for rank in range(grid.size):
        r, c = grid.coords_of(rank)
        for a in range(R):
            lo, hi = max(a * nI, c * nJ), min((a + 1) * nI, (c + 1) * nJ)
            if lo >= hi:
                continue
            sender = grid.rank_of((a, r + c))
            if rank == me:
                recvs.append((sender, slice(lo - c * nJ, hi - c * nJ)))
            if sender == me:
                sends.append((rank, slice(lo - a * nI, hi - a * nI)))
    return sends, recvs, nJ


def _wire(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype  # gloo moves no bools


def move_rows(x: torch.Tensor, moves: Moves, op: str) -> torch.Tensor:
    """The column block ``[B, Nc/C, ...]`` assembled from pieces of the single blocks (dim 1);
    rows no single block holds (beyond Nr) are zero. No autograd."""
    sends, recvs, length = moves
    rest = tuple(x.shape[2:])
    wire = _wire(x.dtype)
    got = Packed(
        [(p, x[:, rows].to(wire)) for p, rows in sends],
        [(p, (x.shape[0], rows.stop - rows.start) + rest) for p, rows in recvs],
        wire,
        op,
    ).wait()
    got = [g.to(x.dtype) for g in got]
    return assemble_rows(x, got, [rows for _, rows in recvs], (x.shape[0], length) + rest, 1)


@autocast_rule()
class MoveRows(torch.autograd.Function):
    """:func:`move_rows`; backward: each piece's gradient goes back to its sender, which adds it.

    Dtype path: pieces travel in x's dtype (bool as uint8); backward in the gradient's dtype,
    summed in it (one addend per row). No cast.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, moves: Moves, op: str = "moves:rows") -> torch.Tensor:
        ctx.moves, ctx.shape, ctx.op = moves, tuple(x.shape), op
        return move_rows(x, moves, op)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        sends, recvs, _ = ctx.moves
        g = g.contiguous()
        rest = ctx.shape[2:]
        pieces = [(p, g[:, rows]) for p, rows in recvs]  # my column block's rows
        got = Packed(
            pieces,
            [(p, (ctx.shape[0], rows.stop - rows.start) + rest) for p, rows in sends],
            g.dtype,
            f"{ctx.op}:backward",
        ).wait()
        gx = g.new_zeros(ctx.shape)
        for (_, rows), piece in zip(sends, got):
            gx[:, rows] += piece
        return gx, None, None


def column_block(
    x: torch.Tensor,
    grid: ProcessGrid,
    n: tuple[int, int],
    op: str,
    token_dim: int = 1,
    differentiable: bool = True,
) -> torch.Tensor:
    """This rank's column block of a tensor sharded over grid rows: ``x`` is the local tile with
    its tokens (``Nr/R``) on ``token_dim`` (1 for ``single``, 2 for ``template``); the result has
    the ``Nc/C`` tokens of column block c there instead. ``n = (Nr, Nc)`` of the pair layout.
    ``differentiable``: through :class:`MoveRows` (gradients go back to their owners, a partial
    sum over the grid row: see the module docstring), else a plain move of ``x.detach()``."""
    moves = column_moves(grid, n)
    y = x.movedim(token_dim, 1).contiguous() if token_dim != 1 else x.contiguous()
    y = MoveRows.apply(y, moves, op) if differentiable else move_rows(y.detach(), moves, op)
    return y.movedim(1, token_dim) if token_dim != 1 else y
