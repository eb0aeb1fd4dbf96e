"""Distributed contraction of two tiled matrices on a rows x cols grid (Cannon / SUMMA).

The triangle multiplications and the outer product mean are all ``Z = op(X) op(Y)``
contracted over one token (or sequence) index k, per channel, with ``op`` the identity
or a transpose of the two leading matrix dims. Every operand is stored tiled like a pair
tensor: ``X[B, rows, cols, *ch]`` with ``rows`` split over the grid rows and ``cols`` over
the grid columns (equal tiles: sizes are padded, see ``twinshard.pair.tiling``).
The result ``Z[B, M, Nn, *ch]`` comes back in the same tiling. On a rectangular grid a pair
tensor is padded separately along each axis (``[Nr, Nc]``, see ``twinshard.pair.tiling``),
so the two extents of one token index can differ between operands and result: the caller
states the result's global shape, k runs over the shorter of the two operands' extents, and
whatever a range needs beyond an operand's extent is zero (it is padding, masked to zero in
the operands, so no real entry changes).

Schedules (chosen from the grid shape, a replicated value):

- **square q x q: Cannon.** Rank (r, c) multiplies ``X'[r, k] Y'[k, c]`` with
  ``k = (r + c + t) mod q`` at step t. One point-to-point move delivers the skewed first
  tiles (for a transposed operand the same move also performs the grid transpose: the
  tile comes from the mirrored rank and is transposed locally, never gathered). Then
  q - 1 ring shifts move X' one step left along the grid row and Y' one step up the
  grid column; each shift is posted before the local product and waited for after it,
  so sends overlap compute. Per rank, forward: at most ``2 q`` tiles received, i.e.
  ``~2 N^2 c / sqrt(P)`` elements for an N x N x c operand pair (the 2-D bound).
- **rectangular R x C: SUMMA over k-segments.** k is cut at every tile edge of either
  operand, and each piece further into segments no wider than ``SEGMENT_BUDGET`` allows; for
  each segment rank (r, c) fetches ``X'[rows block r, seg]`` and ``Y'[seg, cols block c]``
  from their owners (one sparse exchange per operand, prefetching the next segment while
  multiplying the current one). Pieces from different owners are multiplied where they
  land: each pair accumulates in place into its block of the output tile (no assembly);
  pieces this rank owns are views of its tile. Per rank: ``M K / R + K Nn / C`` elements
  received over the whole loop.

Memory per rank (transient, beyond the operands and the output tile): Cannon holds the
skewed tile of each operand (a view when it is this rank's own) plus, with the channel-first
``bmm`` kernel, one channel chunk in flight (``RING_CHUNKS``: the received chunk is copied
over the one just used), else one whole tile in flight; SUMMA holds one segment's pieces in
use, the next in flight and the copies it sends, each at most ``SEGMENT_BUDGET`` of the
output tile. Nothing of size N^2 (or N^2 / R) is ever held. With the channel-first ``bmm``
kernel the result is the accumulator itself seen channel-last (a view, not a copy), and the
backward receives ``dZ`` channel-first (the view's adjoint makes the one copy, and autograd
frees the channel-last ``dZ`` before the contraction's backward runs); with ``outer`` the
backward likewise receives ``dZ`` as its ``[B, (m c), (n d)]`` matrix (``_TileLayout``).
The backward of ``Z = X' Y'`` is two more contractions on the same grid with the same
schedules (``dX' = dZ Y'^T``, ``dY' = X'^T dZ``), each written back in the stored orientation of X and Y. When ``dZ``
has many more channels than X and Y (the outer product mean), the backward instead
keeps ``dZ`` in place and moves the operands and the partial gradients
(``Contraction.stationary_grad``; ring shifts on square grids, per-row fetch and
scatter on rectangular ones; in both the partials of one step travel while the next
step's product runs).

Tiles come from ``twinshard.pair.tiling.block_range`` (the project's one tiling rule);
the k-cuts of SUMMA from :func:`k_segments`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from twinshard.comm import primitives as P
from twinshard.comm.amp import autocast_rule
from twinshard.pair.layers.fetch import Range, Tiled, _Fetch
from twinshard.pair.layers.stationary import _cannon_stationary, _stationary_product, _summa_stationary
from twinshard.pair.tiling import block_range
from twinshard.runtime.grid import ProcessGrid

__all__ = ["Contraction", "Tiled", "grid_contract", "grid_matmul", "k_segments", "schedule_name"]


def schedule_name(shape: tuple[int, int]) -> str:
    """The schedule a rows x cols grid runs: "serial" (1 x 1), "cannon" or "summa"."""
    if shape[0] * shape[1] == 1:
        return "serial"
    return "cannon" if shape[0] == shape[1] else "summa"


def _orient(t: torch.Tensor, trans: bool) -> torch.Tensor:
    # Matrix dims are 1 and 2; a transpose is a view, the kernels read it as is (BLAS takes
    # transposed operands by stride, no copy).
    return t.transpose(1, 2) if trans else t


KERNELS = ("einsum", "bmm", "outer")


def _product(
    kernel: str, equation: str, xo: torch.Tensor, yo: torch.Tensor, acc: torch.Tensor | None, ct: torch.dtype
) -> torch.Tensor:
    """``acc += X' Y'`` for one block product on oriented tiles, accumulated in place in ``ct``.

    - ``"bmm"``: channel-first tiles ``[B*ch, m, k]``, ``[B*ch, k, n]`` (the channels are the
      batch of one contiguous batched matmul), result ``[B*ch, m, n]``;
    - ``"outer"``: channel-last ``X'[B, m, k, c]``, ``Y'[B, k, n, d]``, an outer product in the
      channels: ``[B, (m c), k] @ [B, k, (n d)]`` -> ``[B, m*c, n*d]`` (views of the stored
      tiles, no copy);
    - ``"einsum"``: ``equation`` on the oriented tiles (the readable general form).
    Operands in a narrower wire dtype (bf16) are upcast to ``ct`` here, per product.
    """
    if xo.dtype != ct:
        xo = xo.to(ct)
    if yo.dtype != ct:
        yo = yo.to(ct)
    if kernel == "einsum":
        part = torch.einsum(equation, xo, yo)
        return part if acc is None else acc.add_(part)
    if kernel == "outer":
        b, m, k, c = xo.shape
        xo = xo.permute(0, 1, 3, 2).reshape(b, m * c, k)
        yo = yo.reshape(b, k, -1)
    elif kernel != "bmm":
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return torch.bmm(xo, yo) if acc is None else acc.baddbmm_(xo, yo)


def grid_matmul(
    grid: ProcessGrid,
    x: Tiled,
    tx: bool,
    y: Tiled,
    ty: bool,
    equation: str,
    tag: str,
    kernel: str = "einsum",
    ct: torch.dtype | None = None,
    out: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Local tile of ``Z = op(X) op(Y)`` (see module docstring); ``equation`` is the einsum of
    one block product on oriented tiles ``X'[b, m, k, ...]`` and ``Y'[b, k, n, ...]``,
    ``kernel`` how it runs (:func:`_product`; the result is in that kernel's layout).
    Tiles travel in their own dtype; products accumulate in ``ct`` (default: >= fp32).
    ``out``: Z's global (rows, cols) when it differs from op(X)'s rows and op(Y)'s columns
    (separately padded token axes: rectangular grids only); k runs over the shorter extent."""
    m = x.cols if tx else x.rows
    kx = x.rows if tx else x.cols
    ky = y.cols if ty else y.rows
    n = y.rows if ty else y.cols
    if ct is None:
        ct = torch.promote_types(torch.promote_types(x.tile.dtype, y.tile.dtype), torch.float32)
    zm, zn = (m, n) if out is None else out
    # Extents of one token index may differ by their padding only: less than a grid side on a
    # rectangular grid, not at all on a square one. More is a caller's error, never truncated.
    slack = 0 if grid.rows == grid.cols else max(grid.rows, grid.cols) - 1
    if max(abs(kx - ky), abs(zm - m), abs(zn - n)) > slack:
        raise ValueError(
            f"contraction sizes differ ({m} x {kx} times {ky} x {n} into {zm} x {zn}) by more than "
            f"the per-axis padding of a {grid.rows}x{grid.cols} grid (twinshard.pair.tiling)"
        )
    if grid.size == 1:
        return _product(kernel, equation, _orient(x.tile, tx), _orient(y.tile, ty), None, ct)
    if grid.rows == grid.cols:
        return _cannon(grid, x, tx, y, ty, equation, tag, kernel, ct)
    return _summa(grid, x, tx, y, ty, equation, tag, zm, min(kx, ky), zn, kernel, ct)


def _cannon(
    grid: ProcessGrid,
    x: Tiled,
    tx: bool,
    y: Tiled,
    ty: bool,
    equation: str,
    tag: str,
    kernel: str = "einsum",
    ct: torch.dtype = torch.float64,
) -> torch.Tensor:
    q = grid.rows
    r, c = grid.coords

    # Skew: X'[r, k0] and Y'[k0, c] with k0 = r + c; a transposed operand's tile comes from
    # the mirrored rank (stored block (k0, r) resp. (c, k0)).
    def want_x(rank: int) -> tuple[Range, Range]:
        rr, cc = grid.coords_of(rank)
        k0 = (rr + cc) % q
        br, bc = (k0, rr) if tx else (rr, k0)
        return block_range(x.rows, q, br), block_range(x.cols, q, bc)

    def want_y(rank: int) -> tuple[Range, Range]:
        rr, cc = grid.coords_of(rank)
        k0 = (rr + cc) % q
        br, bc = (cc, k0) if ty else (k0, cc)
        return block_range(y.rows, q, br), block_range(y.cols, q, bc)

    xt, yt = _Fetch(grid, [x, y], [want_x, want_y], op=f"{tag}:skew").wait()
    left, right = grid.rank_of((r, c - 1)), grid.rank_of((r, c + 1))
    up, down = grid.rank_of((r - 1, c)), grid.rank_of((r + 1, c))
    if kernel == "bmm" and xt.shape[0] > 1:
        return _cannon_chunked(q, x, tx, y, ty, xt, yt, (left, right, up, down), equation, tag, ct)
    acc = None
    for t in range(q):
        pending = None
        if t < q - 1:
            # X' moves one step left along the row, Y' one step up the column; posted before
            # the local product so the transfer overlaps it.
            pending = P.exchange(
                [(left, xt), (up, yt)],
                [(right, tuple(xt.shape)), (down, tuple(yt.shape))],
                dtype=xt.dtype,
                op=f"{tag}:ring_shift",
                async_op=True,
            )
        acc = _product(kernel, equation, _orient(xt, tx), _orient(yt, ty), acc, ct)
        if pending is not None:
            xt, yt = pending.wait()
    assert acc is not None  # q >= 1 steps ran
    return acc


RING_CHUNKS = 4  # channel chunks per ring step (bmm kernel): in flight 1/4 of a tile per operand


def _chunks(n: int, parts: int) -> list[Range]:
    parts = max(1, min(parts, n))
    return [(n * i // parts, n * (i + 1) // parts) for i in range(parts)]


def _cannon_chunked(
    q: int,
    x: Tiled,
    tx: bool,
    y: Tiled,
    ty: bool,
    xt: torch.Tensor,
    yt: torch.Tensor,
    peers: tuple[int, int, int, int],
    equation: str,
    tag: str,
    ct: torch.dtype,
) -> torch.Tensor:
    """Cannon's ring on channel-first tiles ``[B*d, m, k]`` moved in channel chunks (dim 0,
    contiguous): chunk j is posted, multiplied while in flight, and its arrival copied over the
    chunk just used, so a rank holds one tile per operand plus one chunk in flight (not two
    tiles). Tiles still viewing the stored operand (the skew kept them local) are never
    written: the first shift then receives into a new tile."""
    left, right, up, down = peers
    acc = None
    bounds = _chunks(xt.shape[0], RING_CHUNKS)
    for t in range(q):
        if t == q - 1:
            acc = _product("bmm", equation, _orient(xt, tx), _orient(yt, ty), acc, ct)
            break
        cur = []
        stored = {x.tile.untyped_storage().data_ptr(), y.tile.untyped_storage().data_ptr()}
        for tile in (xt, yt):
            cur.append(torch.empty_like(tile) if tile.untyped_storage().data_ptr() in stored else tile)
        for a, b in bounds:
            pending = P.exchange(
                [(left, xt[a:b]), (up, yt[a:b])],
                [(right, tuple(xt[a:b].shape)), (down, tuple(yt[a:b].shape))],
                dtype=xt.dtype,
                op=f"{tag}:ring_shift",
                async_op=True,
            )
            if acc is None:  # zeros: every product accumulates in place (0 + p is exact)
                m, n = xt.shape[2] if tx else xt.shape[1], yt.shape[1] if ty else yt.shape[2]
                acc = torch.zeros((xt.shape[0], m, n), dtype=ct, device=xt.device)
            _product("bmm", equation, _orient(xt[a:b], tx), _orient(yt[a:b], ty), acc[a:b], ct)
            nx, ny = pending.wait()
            cur[0][a:b].copy_(nx)
            cur[1][a:b].copy_(ny)
            del nx, ny
        xt, yt = cur
    assert acc is not None  # q >= 1 steps ran
    return acc


def k_segments(k: int, bx: int, by: int) -> list[Range]:
    """The k-segments of SUMMA: ``[0, k)`` cut at every tile edge of X (tiles ``bx`` wide along
    k) and of Y (``by`` wide), so each segment lies in one tile of each operand."""
    edges = sorted({0, k} | set(range(bx, k, bx)) | set(range(by, k, by)))
    return list(zip(edges[:-1], edges[1:]))


# A SUMMA segment's pieces hold at most this fraction of the output tile: 0.5 gave a lower peak
# (1.07 vs 1.13 x serial / P, trimul 2x3, N=24) but ~20% more time (more, thinner products).
SEGMENT_BUDGET = 1.0


def _segment_width(kernel: str, xt: torch.Tensor, yt: torch.Tensor, m: int, n: int) -> int:
    """Widest k-segment whose X' (m x w) and Y' (w x n) pieces hold at most ``SEGMENT_BUDGET``
    of the output tile's elements (the acc: channel-wise for bmm/einsum, the channel outer
    product for ``"outer"``)."""
    ex = xt.numel() // (xt.shape[1] * xt.shape[2])  # elements per token pair of each operand
    ey = yt.numel() // (yt.shape[1] * yt.shape[2])
    acc = m * n * (ex * ey // xt.shape[0] if kernel == "outer" else max(ex, ey))
    return max(1, int(SEGMENT_BUDGET * acc) // (m * ex + n * ey))


def _summa(
    grid: ProcessGrid,
    x: Tiled,
    tx: bool,
    y: Tiled,
    ty: bool,
    equation: str,
    tag: str,
    m: int,
    k: int,
    n: int,
    kernel: str = "einsum",
    ct: torch.dtype = torch.float64,
) -> torch.Tensor:
    R, C = grid.rows, grid.cols
    m_loc, n_loc = m // R, n // C
    # k is tiled by R (stored rows) or C (stored cols) in each operand; cut at every edge, then
    # finer so that one segment's pieces (held twice: in use and in flight) stay small.
    width = _segment_width(kernel, x.tile, y.tile, m_loc, n_loc)
    bx = x.tile.shape[1] if tx else x.tile.shape[2]  # k-width of a stored tile of X, of Y
    by = y.tile.shape[2] if ty else y.tile.shape[1]
    cuts = k_segments(k, bx, by)
    segs = [(a, min(a + width, hi)) for lo, hi in cuts for a in range(lo, hi, width)]

    def wants(seg: Range) -> list[Callable[[int], tuple[Range, Range]]]:
        def want_x(rank: int) -> tuple[Range, Range]:
            rows = block_range(m, R, grid.coords_of(rank)[0])
            return (seg, rows) if tx else (rows, seg)

        def want_y(rank: int) -> tuple[Range, Range]:
            cols = block_range(n, C, grid.coords_of(rank)[1])
            return (cols, seg) if ty else (seg, cols)

        return [want_x, want_y]

    acc = None
    fetch = _Fetch(grid, [x, y], wants(segs[0]), op=f"{tag}:summa_fetch")
    for i in range(len(segs)):
        xs, ys = fetch.wait_pieces()
        if i + 1 < len(segs):
            fetch = _Fetch(grid, [x, y], wants(segs[i + 1]), op=f"{tag}:summa_fetch")
        # X' arrives in pieces along m, Y' along n (pieces of different tiles): each pair of
        # pieces accumulates into its block of the output tile, nothing is assembled.
        for xr, xc, xp in xs:
            mo = xc if tx else xr
            xo = _orient(xp, tx)
            for yr, yc, yp in ys:
                no = yr if ty else yc
                yo = _orient(yp, ty)
                if acc is None:
                    acc = _new_acc(kernel, equation, xo, yo, m_loc, n_loc, ct)
                rs, cs = acc.shape[1] // m_loc, acc.shape[2] // n_loc  # acc entries per token
                view = acc[:, mo * rs : (mo + xo.shape[1]) * rs, no * cs : (no + yo.shape[2]) * cs]
                _product(kernel, equation, xo, yo, view, ct)
        del xs, ys  # the segment's pieces go before the next arrives
        xp = yp = xo = yo = None
    if acc is None:  # this tile lies wholly beyond an operand's extent (padding only): zeros
        acc = _new_acc(kernel, equation, _orient(x.tile, tx), _orient(y.tile, ty), m_loc, n_loc, ct)
    return acc


def _new_acc(
    kernel: str, equation: str, xo: torch.Tensor, yo: torch.Tensor, m: int, n: int, ct: torch.dtype
) -> torch.Tensor:
    """A zero output tile for ``m`` x ``n`` tokens in ``kernel``'s layout (shape taken from one
    block product's: ``_product`` on one token of each operand, so that nothing tile-sized is
    made besides the tile: this runs at the backward's memory peak)."""
    one = _product(kernel, equation, xo[:, :1, :1], yo[:, :1, :1], None, ct)
    rs, cs = one.shape[1], one.shape[2]  # acc entries per token
    return one.new_zeros((one.shape[0], m * rs, n * cs) + tuple(one.shape[3:]))


@dataclass(frozen=True)
class Contraction:
    """A contraction ``Z = op(X) op(Y)`` and the einsums of its two backward contractions.

    ``forward``: block product on oriented ``X'[b,m,k,..]``, ``Y'[b,k,n,..]``.
    ``grad_x``: block product giving ``dX`` in X's stored orientation from oriented operands
    ``(dZ, Y)`` when X is not transposed, ``(Y, dZ^T)`` when it is.
    ``grad_y``: likewise for ``dY``: ``(X^T, dZ)`` or ``(dZ^T, X)``.
    ``stationary_grad``: keep ``dZ`` in place in backward and move the operands and the
    partial gradients instead (:func:`_cannon_stationary`, :func:`_summa_stationary`); for
    ``Z`` with more channels than ``X`` and ``Y`` (the outer product mean's c_hidden^2),
    this moves operand-sized tiles only. Only for ``tx=True, ty=False``.
    ``kernel``: how the block products run (the einsums stay the specification):
    ``"bmm"`` for a per-channel product (``bmkd,bknd->bmnd``): the operands are laid out
    channel-first once per call (``[B*d, rows, cols]``, contiguous), every ring step is one
    batched matmul accumulated in place, and the result is returned as a channel-last view;
    ``"outer"`` for the outer product in the channels (``bmkc,bknd->bmncd``, with
    ``stationary_grad``): ``[B, (m c), k] @ [B, k, (n d)]`` on
    views of the stored tiles; ``"einsum"``: the equations as written.
    """

    tx: bool
    ty: bool
    forward: str
    grad_x: str
    grad_y: str
    tag: str
    stationary_grad: bool = False
    kernel: str = "einsum"


def _channel_first(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, r, c, d]`` -> contiguous ``[B*d, r, c]`` in ``dtype`` (one fused copy and cast)."""
    b, r, c, d = t.shape
    out = torch.empty((b, d, r, c), dtype=dtype, device=t.device)
    out.copy_(t.permute(0, 3, 1, 2))
    return out.view(b * d, r, c)


def _channel_last(t: torch.Tensor, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B*d, r, c]`` -> ``[B, r, c, d]`` in ``dtype``: a view of ``t`` (a copy only to cast).

    Channel-last by strides, not by a copy: a copy is one more tile-sized transient.
    Consumers take any strides (token-local ops copy if they must)."""
    bd, r, c = t.shape
    return t.to(dtype).view(batch, bd // batch, r, c).permute(0, 2, 3, 1)


@autocast_rule()
class _TileLayout(torch.autograd.Function):
    """The contraction's result in its kernel's layout as the output tile ``[B, m, n, ...]``.

    ``"bmm"``: ``[B*d, m, n]`` seen channel-last (a view). ``"outer"``: ``[B, m*c, n*d]`` copied
    to a contiguous ``[B, m, n, c, d]`` (the layer reshapes it to ``c*d`` channels). The adjoint
    lays the incoming gradient out in the kernel's layout (contiguous), in a node of its own, so
    autograd frees the tile-layout gradient before the contraction's backward runs (done inside
    that backward, the conversion held both: one tile more at the backward's peak).

    Dtype path: a view or one layout copy in the input's dtype (backward: the gradient's); no
    arithmetic, no communication.
    """

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, kernel: str, batch: int, c: int, d: int) -> torch.Tensor:
        ctx.kernel = kernel
        if kernel == "bmm":
            return _channel_last(z, batch, z.dtype)
        m, n = z.shape[1] // c, z.shape[2] // d  # output tile: tokens over rows x cols
        out = torch.empty((batch, m, n, c, d), dtype=z.dtype, device=z.device)
        out.copy_(z.view(batch, m, c, n, d).permute(0, 1, 3, 2, 4))
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        if ctx.kernel == "bmm":
            return _channel_first(g, g.dtype), None, None, None, None
        b, m, n, c, d = g.shape  # dZ[B, I, J, c, d] as the matrix [B, (I c), (J d)]
        dz = torch.empty((b, m, c, n, d), dtype=g.dtype, device=g.device)
        dz.copy_(g.permute(0, 1, 3, 2, 4))
        return dz.view(b, m * c, n * d), None, None, None, None


@autocast_rule("compute")
class _GridContract(torch.autograd.Function):
    """Dtype path (cast="compute": Boltz's ``.float()`` before the triangle-multiplication and
    outer-product einsums, autocast off): the accumulation dtype ``ct = promote(x, y, fp32)``;
    operand tiles are laid out, saved and sent in ``wire`` (the caller's explicit argument: the
    activation dtype when a narrower one holds the values exactly, else x's dtype), upcast to
    ``ct`` per block product; every product accumulates in ``ct``; the result is rounded once to
    ``out_dtype``. Backward: the gradient travels in its own dtype (``out_dtype``), the two
    gradient contractions accumulate in ``ct`` and are cast once to the input dtypes."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        y: torch.Tensor,
        grid: ProcessGrid,
        spec: Contraction,
        xshape: tuple[int, int],
        yshape: tuple[int, int],
        zshape: tuple[int, int],
        wire: torch.dtype,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        ct = torch.promote_types(torch.promote_types(x.dtype, y.dtype), torch.float32)
        ctx.grid, ctx.spec, ctx.xshape, ctx.yshape, ctx.zshape = grid, spec, xshape, yshape, zshape
        ctx.ct, ctx.in_dtypes, ctx.batch = ct, (x.dtype, y.dtype), x.shape[0]
        ctx.channels = (x.shape[-1], y.shape[-1])
        if spec.kernel == "bmm":  # laid out once per call: channels as the batch of a bmm
            xw, yw = _channel_first(x, wire), _channel_first(y, wire)
        else:
            xw, yw = x.to(wire).contiguous(), y.to(wire).contiguous()
        ctx.save_for_backward(xw, yw)
        z = grid_matmul(
            grid,
            Tiled(xw, *xshape),
            spec.tx,
            Tiled(yw, *yshape),
            spec.ty,
            spec.forward,
            spec.tag,
            spec.kernel,
            ct,
            zshape,
        )
        return z.to(out_dtype)  # bmm / outer: in the kernel's layout (grid_contract's _TileLayout)

    @staticmethod
    def backward(ctx: Any, gz: torch.Tensor):
        x, y = ctx.saved_tensors
        grid, spec, ct = ctx.grid, ctx.spec, ctx.ct
        tx, ty = spec.tx, spec.ty
        X, Y = Tiled(x, *ctx.xshape), Tiled(y, *ctx.yshape)
        mz, nz = ctx.zshape
        tag = f"{spec.tag}:backward"
        gx = gy = None
        none = (None,) * 7
        if spec.stationary_grad:
            if not (tx and not ty):
                raise ValueError("stationary_grad is implemented for tx=True, ty=False only")
            # outer: dZ arrives as the matrix [B, (I c), (J d)] (_TileLayout's adjoint)
            dz = gz.to(ct).contiguous()
            if grid.size == 1:
                fn = None
            else:
                fn = _cannon_stationary if grid.rows == grid.cols else _summa_stationary
            for idx, (which, w, eq) in enumerate((("x", y, spec.grad_x), ("y", x, spec.grad_y))):
                if not ctx.needs_input_grad[idx]:
                    continue
                nch = ctx.channels[idx]
                if fn is None:
                    g = _stationary_product(spec.kernel, eq, which, w, dz, None, ct, nch)
                else:
                    g = fn(grid, dz, w, which, eq, tag, spec.kernel, ct, nch, ctx.zshape)
                g = g.to(ctx.in_dtypes[idx])
                gx, gy = (g, gy) if idx == 0 else (gx, g)
            return (gx, gy, *none)
        # bmm: gz arrives channel-first and contiguous (_TileLayout's adjoint), in its own dtype
        # (the wire dtype when narrower)
        Z = Tiled(gz.contiguous(), mz, nz)

        def back(t: torch.Tensor, idx: int) -> torch.Tensor:
            if spec.kernel == "bmm":
                return _channel_last(t, ctx.batch, ctx.in_dtypes[idx])
            return t.to(ctx.in_dtypes[idx])

        args = (tag, spec.kernel, ct)
        if ctx.needs_input_grad[0]:
            # dX' = dZ Y'^T; stored X = X' (tx False) or X'^T = Y' dZ^T (tx True).
            if not tx:
                gx = grid_matmul(grid, Z, False, Y, not ty, spec.grad_x, *args, out=ctx.xshape)
            else:
                gx = grid_matmul(grid, Y, ty, Z, True, spec.grad_x, *args, out=ctx.xshape)
            gx = back(gx, 0)
        if ctx.needs_input_grad[1]:
            # dY' = X'^T dZ; stored Y = Y' (ty False) or Y'^T = dZ^T X' (ty True).
            if not ty:
                gy = grid_matmul(grid, X, not tx, Z, False, spec.grad_y, *args, out=ctx.yshape)
            else:
                gy = grid_matmul(grid, Z, True, X, tx, spec.grad_y, *args, out=ctx.yshape)
            gy = back(gy, 1)
        return (gx, gy, *none)


def grid_contract(
    x: torch.Tensor,
    y: torch.Tensor,
    grid: ProcessGrid,
    spec: Contraction,
    xshape: tuple[int, int],
    yshape: tuple[int, int],
    wire_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
    zshape: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Differentiable local tile of ``op(X) op(Y)``; ``xshape``/``yshape`` are the global
    (rows, cols) of the stored operands (padded, divisible by the grid), ``zshape`` the
    result's (default: op(X)'s rows by op(Y)'s columns; see :func:`grid_matmul`'s ``out``).

    ``wire_dtype`` (default: x's dtype): the dtype the operand tiles are stored, saved and sent
    in; a caller passes a narrower one (bf16) only when x and y hold values exact in it (e.g.
    bf16 activations upcast for the contraction), so the narrowing is exact. Products always
    accumulate in ``promote_types(x.dtype, float32)``. ``out_dtype`` (default: that
    accumulation dtype): the result is rounded once to it; its gradient then travels in it too.
    """
    for name, t, (rows, cols) in (("X", x, xshape), ("Y", y, yshape)):
        if (
            rows % grid.rows
            or cols % grid.cols
            or t.shape[1] * grid.rows != rows
            or t.shape[2] * grid.cols != cols
        ):
            raise ValueError(
                f"operand {name}: tile {tuple(t.shape)} does not tile a {rows} x "
                f"{cols} matrix on a {grid.rows}x{grid.cols} grid"
            )
    if spec.kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {spec.kernel!r}")
    if spec.kernel == "outer" and not spec.stationary_grad:
        raise ValueError("the 'outer' kernel runs its backward with stationary_grad=True only")
    if zshape is None:
        zshape = (xshape[1] if spec.tx else xshape[0], yshape[0] if spec.ty else yshape[1])
    if zshape[0] % grid.rows or zshape[1] % grid.cols:
        raise ValueError(f"result {tuple(zshape)} does not tile on a {grid.rows}x{grid.cols} grid")
    ct = torch.promote_types(torch.promote_types(x.dtype, y.dtype), torch.float32)
    wire = x.dtype if wire_dtype is None else wire_dtype
    out = ct if out_dtype is None else out_dtype
    z = _GridContract.apply(x, y, grid, spec, tuple(xshape), tuple(yshape), tuple(zshape), wire, out)
    if spec.kernel in ("bmm", "outer"):
        return _TileLayout.apply(z, spec.kernel, x.shape[0], x.shape[-1], y.shape[-1])
    return z
