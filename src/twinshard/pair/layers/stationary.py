"""Gradients of ``Z = X^T Y`` with ``dZ`` kept in place (the outer product mean's backward).

When ``dZ`` has many more channels than ``X`` and ``Y`` (the outer product mean: c_hidden^2
against c_hidden), its backward moves the operand tiles and the partial gradients instead of
``dZ``: :func:`_cannon_stationary` on square grids, :func:`_summa_stationary` on rectangular
ones (``Contraction.stationary_grad`` in :mod:`twinshard.pair.layers.contraction`). In both,
the partials of one step travel while the next step's product runs.
"""

from __future__ import annotations

from typing import Any

import torch

from twinshard.comm import primitives as P
from twinshard.pair.layers.fetch import Range, Tiled, _Fetch, _inter
from twinshard.pair.tiling import block_range
from twinshard.runtime.grid import ProcessGrid

__all__: list[str] = []


def _merge_partial(received: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """The partial gradient that travelled round the ring plus this step's contribution (in
    place in the received buffer)."""
    return received.add_(part)


def _stationary_product(
    kernel: str,
    equation: str,
    which: str,
    wt: torch.Tensor,
    dz: torch.Tensor,
    acc: torch.Tensor | None,
    ct: torch.dtype,
    nch: int,
) -> torch.Tensor:
    """One block of a stationary-dZ gradient, accumulated in place: ``W dZ^T`` (``which="x"``)
    or ``W dZ`` (``"y"``) for an operand tile ``W[B, kb, n, ch]``. With ``kernel="outer"``,
    ``dz`` is the matrix form ``[B, I*c, J*d]`` (laid out once per backward) and the result a
    ``[B, kb, n, nch]`` view of one batched matmul; else ``dz`` is the ``[B, I, J, c, d]`` tile
    and ``equation`` the einsum."""
    if wt.dtype != ct:
        wt = wt.to(ct)
    if kernel == "outer":
        wf = wt.reshape(wt.shape[0], wt.shape[1], -1)
        rhs = dz.transpose(1, 2) if which == "x" else dz
        if acc is None:
            return torch.bmm(wf, rhs).view(wt.shape[0], wt.shape[1], -1, nch)
        acc.view(acc.shape[0], acc.shape[1], -1).baddbmm_(wf, rhs)
        return acc
    part = torch.einsum(equation, wt, dz.transpose(1, 2) if which == "x" else dz)
    return part if acc is None else acc.add_(part)


def _cannon_stationary(
    grid: ProcessGrid,
    dz: torch.Tensor,
    w: torch.Tensor,
    which: str,
    equation: str,
    tag: str,
    kernel: str = "einsum",
    ct: torch.dtype = torch.float64,
    nch: int = 0,
    zshape: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Gradient of ``Z = X^T Y`` (X, Y stored [K, N] like MSA tiles) with dZ kept in place
    (``zshape``, dZ's global shape, is N x N on a square grid and not needed).

    Rank (r, c) holds ``dZ[I_r, J_c]`` and at step t works on k-block ``k = r + c + t``:
    - ``which="x"``: ``dX[k, I_r] += sum_j Y[k, J_c] dZ[I_r, J_c]^T``; Y's tiles move up the
      grid column (Cannon's Y skew and shift), the partial dX moves left along the row;
    - ``which="y"``: ``dY[k, J_c] += sum_i X[k, I_r] dZ[I_r, J_c]``; X's tiles move left
      along the row (Cannon's transposing X skew and shift), the partial dY moves up.
    After q steps every partial holds all q contributions; one permutation delivers it to
    its owner. Per rank: 1 skew + (q - 1) operand shifts + (q - 1) partial shifts + 1
    delivery, each one K x N / P tile with X's channels; dZ never moves.
    """
    q = grid.rows
    r, c = grid.coords
    rows, cols = w.shape[1] * q, w.shape[2] * q

    def want(rank: int) -> tuple[Range, Range]:
        rr, cc = grid.coords_of(rank)
        br, bc = ((rr + cc) % q, cc) if which == "x" else ((rr + cc) % q, rr)
        return block_range(rows, q, br), block_range(cols, q, bc)

    (wt,) = _Fetch(grid, [Tiled(w, rows, cols)], [want], op=f"{tag}:skew").wait()
    if which == "x":  # operand up the column, partial left along the row
        w_to, w_from = grid.rank_of((r - 1, c)), grid.rank_of((r + 1, c))
        p_to, p_from = grid.rank_of((r, c - 1)), grid.rank_of((r, c + 1))
        deliver_to, deliver_from = grid.rank_of((r + c - 1, r)), grid.rank_of((c, r - c + 1))
    else:  # operand left along the row, partial up the column
        w_to, w_from = grid.rank_of((r, c - 1)), grid.rank_of((r, c + 1))
        p_to, p_from = grid.rank_of((r - 1, c)), grid.rank_of((r + 1, c))
        deliver_to, deliver_from = grid.rank_of((r + c - 1, c)), grid.rank_of((r - c + 1, c))

    def shift_operand(wt: torch.Tensor) -> Any:
        return P.exchange(
            [(w_to, wt)], [(w_from, tuple(wt.shape))], dtype=wt.dtype, op=f"{tag}:ring_shift", async_op=True
        )

    # Step t: the partial of step t - 1 travels while this step multiplies (c_t = W_t dZ in a
    # buffer of its own), then c_t is added to the partial received; the next operand tile
    # travels during the same product.
    pend_w = shift_operand(wt) if q > 1 else None
    acc = _stationary_product(kernel, equation, which, wt, dz, None, ct, nch)
    for t in range(1, q):
        pend_p = P.exchange(
            [(p_to, acc)],
            [(p_from, tuple(acc.shape))],
            dtype=acc.dtype,
            op=f"{tag}:partial_shift",
            async_op=True,
        )
        (wt,) = pend_w.wait()
        pend_w = shift_operand(wt) if t < q - 1 else None
        part = _stationary_product(kernel, equation, which, wt, dz, None, ct, nch)
        (got,) = pend_p.wait()
        acc = _merge_partial(got, part)
        del part
    (out,) = P.exchange(
        [(deliver_to, acc)], [(deliver_from, tuple(acc.shape))], dtype=acc.dtype, op=f"{tag}:deliver"
    )
    return out


def _summa_stationary(
    grid: ProcessGrid,
    dz: torch.Tensor,
    w: torch.Tensor,
    which: str,
    equation: str,
    tag: str,
    kernel: str = "einsum",
    ct: torch.dtype = torch.float64,
    nch: int = 0,
    zshape: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The rectangular-grid form of :func:`_cannon_stationary` (same contractions, dZ in place).

    ``zshape``: dZ's global (rows, cols), ``(Nr, N)`` for operands stored [K, N] (default N x N);
    Nr may differ from N (token axes padded separately): tokens beyond either are padding, so
    the pieces of a partial beyond N are dropped and operand columns beyond N read as zero.

    For each k-block (grid row k of the stored [K, N] operands): fetch the operand piece this
    rank's dZ tile multiplies (``Y[k, J_c]``, one tile from rank (k, c); or ``X[k, I_r]``,
    pieces from grid row k), form the partial gradient, and send it to the rank(s) of grid
    row k owning those columns, which sum what they receive in a fixed order. Per rank over
    the loop: ``K N / R`` (or ``K N / C``) operand elements in and the same order of partial
    elements out, with X's channels; dZ never moves.
    """
    R, C = grid.rows, grid.cols
    r, c = grid.coords
    kb, nb = w.shape[1], w.shape[2]  # stored tile: K / R rows, N / C cols
    K, N = kb * R, nb * C
    Nr = N if zshape is None else zshape[0]
    nr = Nr // R  # dZ rows block (tokens over grid rows)
    out = None
    mine_cols = block_range(N, C, c)

    def fetch(k: int) -> _Fetch:
        def want(rank: int) -> tuple[Range, Range]:
            rr, cc = grid.coords_of(rank)
            return block_range(K, R, k), (block_range(N, C, cc) if which == "x" else block_range(Nr, R, rr))

        return _Fetch(grid, [Tiled(w, K, N)], [want], op=f"{tag}:summa_fetch")

    def add_received(pending: Any, recvs: list[tuple[int, Range]]) -> None:
        for (_, hit), piece in zip(recvs, pending.wait()):
            out[:, :, hit[0] - mine_cols[0] : hit[1] - mine_cols[0]] += piece

    # The next k-block's operand and this block's partials travel while the next block multiplies;
    # received partials are summed in k order, so the sum is the one of a blocking loop.
    nxt, scatter = fetch(0), None
    for k in range(R):
        (wk,) = nxt.wait()
        if k + 1 < R:
            nxt = fetch(k + 1)
        part = _stationary_product(kernel, equation, which, wk, dz, None, ct, nch)
        del wk
        if which == "x":  # partial dX[k, I_r]: to the owners (k, c') of the columns of I_r
            sends = []
            for c2 in range(C):
                hit = _inter(block_range(Nr, R, r), block_range(N, C, c2))
                if hit:
                    piece = part[:, :, hit[0] - r * nr : hit[1] - r * nr]
                    sends.append((grid.rank_of((k, c2)), piece.contiguous()))
            recvs = []
            if r == k:
                for r2 in range(R):
                    hit = _inter(block_range(Nr, R, r2), mine_cols)
                    if hit:
                        for c2 in range(C):
                            recvs.append((grid.rank_of((r2, c2)), hit))
        else:  # partial dY[k, J_c]: to the owner (k, c), summed over the grid column
            sends = [(grid.rank_of((k, c)), part)]
            recvs = [(grid.rank_of((r2, c)), mine_cols) for r2 in range(R)] if r == k else []
        if out is None:  # the gradient tile: X's (or Y's) stored tile with the partial's channels
            out = part.new_zeros(w.shape[:3] + part.shape[3:])
        if scatter is not None:
            add_received(*scatter)
        shapes = [(p, out.shape[:2] + (h[1] - h[0],) + out.shape[3:]) for p, h in recvs]
        pending = P.exchange(sends, shapes, dtype=out.dtype, op=f"{tag}:partial_scatter", async_op=True)
        scatter = (pending, recvs)
        del part, sends
    add_received(*scatter)
    assert out is not None  # R >= 1 iterations ran
    return out
