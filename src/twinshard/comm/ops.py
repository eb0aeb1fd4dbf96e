"""Autograd-aware communication ops: each backward is the exact adjoint of its forward.

For per-rank inputs x_r and outputs y_r = f(x)_r, every op satisfies
sum_r <dy_r, f(x)_r> = sum_r <f*(dy)_r, x_r> (tested in fp64 at several world and
grid sizes). Adjoint pairs: all_reduce <-> all_reduce, all_gather <-> reduce_scatter,
all_to_all <-> the reverse all_to_all, broadcast <-> reduce to the source,
sync_grad (identity, for replicated parameters) <-> all_reduce, ring shift by k <->
shift by -k, permutation <-> its inverse, exchange <-> the reverse exchange,
transpose_tiles (any 2-D grid) <-> itself.
Gradient sums run in >= fp32 (fp64 stays fp64) and are cast back to the input dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from twinshard.comm import primitives as P
from twinshard.comm.amp import autocast_rule
from twinshard.runtime.grid import ProcessGrid
from twinshard.runtime.scope import scope_rank
from twinshard.runtime.world import get_world

Group = P.Group


@autocast_rule()
class _AllReduce(torch.autograd.Function):
    """Dtype path: the sum travels and accumulates in reduce_dtype(x) (>= fp32), the result in x's
    dtype; backward the same on the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return P.all_reduce(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return P.all_reduce(g, ctx.group, op="all_reduce:backward"), None


@autocast_rule()
class _SyncGrad(torch.autograd.Function):
    """Dtype path: forward a view (no cast); backward the gradient summed in reduce_dtype (>=
    fp32), returned in its own dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return P.all_reduce(g, ctx.group, op="sync_grad:backward"), None


@autocast_rule()
class _AllGather(torch.autograd.Function):
    """Dtype path: blocks travel in x's dtype (one dtype on every rank: the callers' inputs);
    backward reduce-scatter in reduce_dtype (>= fp32)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Group, sizes: list[int] | None):
        ctx.dim, ctx.group = dim, group
        n = P.group_size(group)
        ctx.sizes = [x.shape[dim]] * n if sizes is None else list(sizes)
        return P.all_gather(x, dim, group, ctx.sizes)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return P.reduce_scatter(g, ctx.dim, ctx.group, ctx.sizes, op="all_gather:backward"), None, None, None


@autocast_rule()
class _ReduceScatter(torch.autograd.Function):
    """Dtype path: the sum travels in reduce_dtype(x) (>= fp32), the result in x's dtype; backward
    all-gathers the gradient in its dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Group, sizes: list[int] | None):
        ctx.dim, ctx.group = dim, group
        n = P.group_size(group)
        ctx.sizes = [x.shape[dim] // n] * n if sizes is None else list(sizes)
        return P.reduce_scatter(x, dim, group, sizes)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return P.all_gather(g, ctx.dim, ctx.group, ctx.sizes, op="reduce_scatter:backward"), None, None, None


@autocast_rule()
class _AllToAll(torch.autograd.Function):
    """Dtype path: rows travel in x's dtype; backward in the gradient's dtype. No arithmetic."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: Group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return P.all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return P.all_to_all(g, ctx.recv, ctx.send, ctx.group, op="all_to_all:backward"), None, None, None


@autocast_rule()
class _Broadcast(torch.autograd.Function):
    """Dtype path: the buffer travels in x's dtype; backward reduces in reduce_dtype (>= fp32)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, src: int, group: Group):
        ctx.src, ctx.group = src, group
        return P.broadcast(x, src, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return P.reduce(g, ctx.src, ctx.group, op="broadcast:backward"), None, None


@autocast_rule()
class _Exchange(torch.autograd.Function):
    """Dtype path: every message in ``dtype``, agreed over the world by ``exchange`` (the vote
    carries it) before anything is sent; backward in the same wire dtype, each gradient cast
    back to its send buffer's dtype."""

    @staticmethod
    def forward(
        ctx,
        send_peers: list[int],
        recv_peers: list[int],
        recv_shapes: list[tuple[int, ...]],
        op: str,
        dtype: torch.dtype,
        token_shape: tuple[int, ...] | None,
        anchor: torch.Tensor,
        *tensors: torch.Tensor,
    ):
        ctx.send_peers, ctx.recv_peers, ctx.op, ctx.dtype = send_peers, recv_peers, op, dtype
        ctx.send_shapes = [tuple(t.shape) for t in tensors]
        ctx.send_dtypes = [t.dtype for t in tensors]
        out = P.exchange(
            list(zip(send_peers, tensors)), list(zip(recv_peers, recv_shapes)), dtype=dtype, op=op
        )
        if token_shape is not None:  # a rank that only sends: an empty output carries the node
            out = [anchor.new_zeros(token_shape, dtype=dtype)]
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        grads = grads[: len(ctx.recv_peers)]  # the token of a send-only rank has no gradient to send
        back = P.exchange(
            list(zip(ctx.recv_peers, grads)),
            list(zip(ctx.send_peers, ctx.send_shapes)),
            dtype=ctx.dtype,
            op=ctx.op + ":backward",
        )
        back = [g.to(dt) for g, dt in zip(back, ctx.send_dtypes)]
        return (None, None, None, None, None, None, None, *back)


# dtype codes for the agreement of a receive-only rank with its senders (one int per rank)
_DTYPES = (
    torch.float64,
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.complex128,
    torch.complex64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


_NO_SEND, _UNCARRIED, _MIXED = -1, -2, -3  # vote codes besides an index into _DTYPES


def _dtype_code(dtype: torch.dtype | Sequence[torch.dtype] | None) -> int:
    if dtype is None:
        return _NO_SEND
    kinds = {dtype} if isinstance(dtype, torch.dtype) else set(dtype)
    if not kinds:
        return _NO_SEND
    if len(kinds) > 1:
        return _MIXED
    (one,) = kinds
    return _DTYPES.index(one) if one in _DTYPES else _UNCARRIED


def agree_requires_grad(
    local: bool | None,
    what: str,
    group: Group = None,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
) -> tuple[bool, torch.dtype | None]:
    """Replicated decision: does a point-to-point exchange take the autograd path?

    A rank that differentiates through an exchange posts the reverse exchange in its backward;
    a peer that took the plain path never posts its half, and the backward hangs. So the choice
    cannot come from a rank-local ``requires_grad``: every rank votes and all take the same one.

    Args:
        local: this rank's vote: True (its input requires grad and grad mode is on), False (it
            does not), None (no input here, e.g. a rank that only receives: it follows the others,
            provided grad mode is on).
        what: names the exchange in the error.
        dtype: the payload dtype this rank sends, or the dtypes of its send buffers (None or
            empty: it sends nothing); the ranks that send must agree on one, and a rank that
            only receives learns it here.

    Returns ``(differentiable, dtype)``, identical on every rank of ``group``.
    Raises ValueError with the same message on every rank when some ranks differentiate and
    others cannot (input detached, or grad mode off), when senders' dtypes differ, when a rank's
    own send buffers have several dtypes, or when a rank sends a dtype outside ``_DTYPES``.
    Collective: one all_gather of two int64 per rank (ledger op ``<what>:grad_agree``); none on
    a group of one rank.
    """
    if local is None:
        vote = 2 if torch.is_grad_enabled() else 0
    else:
        vote = 1 if (local and torch.is_grad_enabled()) else 0
    code = _dtype_code(dtype)
    if P.group_size(group) == 1:
        codes, differentiable = [code], vote == 1
    else:
        world = get_world()
        device = world.device if world is not None else torch.device("cpu")
        mine = torch.tensor([[vote, code]], dtype=torch.int64, device=device)
        votes = P.all_gather(mine, 0, group, op=f"{what}:grad_agree").cpu()
        want = [r for r, v in enumerate(votes[:, 0].tolist()) if v == 1]
        cannot = [r for r, v in enumerate(votes[:, 0].tolist()) if v == 0]
        if want and cannot:
            raise ValueError(
                f"{what}: the input requires grad on ranks {want} but not on ranks {cannot} (detached, "
                "or grad mode off): every rank must take the same autograd path through a collective "
                "exchange, else the backward hangs; detach on every rank or on none"
            )
        codes, differentiable = votes[:, 1].tolist(), bool(want)
    ranks_of = {c: [r for r, k in enumerate(codes) if k == c] for c in sorted(set(codes))}
    if _UNCARRIED in ranks_of:
        raise ValueError(
            f"{what}: ranks {ranks_of[_UNCARRIED]} send a dtype the exchange does not carry; cast the "
            f"send buffers to one of {[str(d) for d in _DTYPES]}"
        )
    if _MIXED in ranks_of:
        raise ValueError(
            f"{what}: the send buffers of ranks {ranks_of[_MIXED]} have several dtypes; cast them to "
            "one dtype, or pass dtype= (the wire dtype) on every rank"
        )
    sent = {c: rs for c, rs in ranks_of.items() if c >= 0}
    if len(sent) > 1:
        which = "; ".join(f"{_DTYPES[c]} on ranks {rs}" for c, rs in sent.items())
        raise ValueError(
            f"{what}: ranks send different dtypes ({which}); the wire dtype must be one dtype on "
            "every rank: cast the send buffers to one dtype, or pass the same dtype= on every rank"
        )
    return differentiable, (_DTYPES[next(iter(sent))] if sent else None)


def all_reduce(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Sum over ``group``. Backward: all-reduce of the gradient (each rank's output feeds the loss)."""
    return _AllReduce.apply(x, group)


def sync_grad(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Identity on a value replicated over ``group``; backward all-reduces its gradient.

    Apply it where a replicated parameter enters sharded compute: each rank's partial gradient
    is summed, so the parameter gradient comes back complete and replicated."""
    return _SyncGrad.apply(x, group)


@autocast_rule()
class _SyncParams(torch.autograd.Function):
    """Views of one dtype bucket of parameters; backward: their gradients flattened into one
    buffer, all-reduced once (the forward copies nothing: a flat copy of the parameters per
    call was saved for backward by every layer that used it, one replica per rank).

    Dtype path: forward views (no cast); backward one flat gradient per parameter dtype bucket,
    summed in reduce_dtype (>= fp32: a bf16 parameter's gradient is reduced in fp32).
    """

    @staticmethod
    def forward(ctx, group: Group, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        flat = torch.cat([g.reshape(-1) for g in grads])  # unused parameters: zeros (materialised)
        flat = P.all_reduce(flat, ctx.group, op="sync_grad:backward", donate=True)  # ours: in place
        return (None, *(p.view_as(g) for p, g in zip(flat.split([g.numel() for g in grads]), grads)))


def sync_params(params: Sequence[torch.Tensor], group: Group = None) -> list[torch.Tensor]:
    """Replicated parameters as sharded compute uses them: the one replicated-gradient utility.

    Forward: the same values (views of the parameters, no copy). Backward: each rank's partial
    gradients are summed over ``group``, so ``param.grad`` comes back complete and identical on
    every rank, with no step after backward. Parameters are bucketed by dtype (buckets in a fixed
    order on every rank) and each bucket's gradients are flattened into one vector, so a backward
    issues one all-reduce per dtype (``sync_grad:backward``), not one per parameter. Placements:
    in and out replicated. Memory: nothing in forward; one flat gradient buffer per dtype, in
    backward only. On a group of one rank: the parameters unchanged.
    """
    params = list(params)
    if P.group_size(group) == 1 or not params:
        return params
    out: list[torch.Tensor | None] = [None] * len(params)
    buckets: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(params):
        buckets.setdefault(p.dtype, []).append(i)
    for _, idx in sorted(buckets.items(), key=lambda kv: str(kv[0])):  # same order on all ranks
        views = _SyncParams.apply(group, *(params[i] for i in idx))
        for i, v in zip(idx, views if isinstance(views, tuple) else (views,)):
            out[i] = v
    return out  # type: ignore[return-value]


def all_gather(
    x: torch.Tensor, dim: int, group: Group = None, sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """Concatenate blocks along ``dim`` (uneven with ``sizes``). Backward: reduce-scatter."""
    return _AllGather.apply(x, dim, group, None if sizes is None else list(sizes))


def reduce_scatter(
    x: torch.Tensor, dim: int, group: Group = None, sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """Sum over ``group`` and keep this rank's block along ``dim``. Backward: all-gather."""
    return _ReduceScatter.apply(x, dim, group, None if sizes is None else list(sizes))


def all_to_all(
    x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group: Group = None
) -> torch.Tensor:
    """Uneven all-to-all along dim 0. Backward: the reverse all-to-all."""
    return _AllToAll.apply(x, list(send_splits), list(recv_splits), group)


def broadcast(x: torch.Tensor, src: int = 0, group: Group = None) -> torch.Tensor:
    """``x`` of group rank ``src`` everywhere. Backward: gradients summed onto ``src`` (zeros elsewhere)."""
    return _Broadcast.apply(x, src, group)


def exchange(
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, tuple[int, ...]]],
    op: str = "exchange",
    dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Sparse point-to-point with global peer ranks (see primitives.exchange). Collective: every
    rank of the world calls it (a rank with no message passes empty lists).

    Returns the received tensors in ``recvs`` order; a rank that sends but receives nothing gets
    one zero-row tensor (``(0, *sends[0].shape[1:])``) instead, so that it too has an output
    attached to the exchange: use it in the loss (e.g. ``torch.cat``) so its backward runs.

    Autograd: whether the exchange is differentiable is one replicated decision (see
    ``agree_requires_grad``: one all_gather of a vote per call), so a rank that only sends, and
    one that only receives, build the autograd node too and run their half of the adjoint.
    Backward: every received gradient goes back to its sender, which gets it as the gradient of
    what it sent (the reverse exchange). ``dtype``: the wire dtype (default: the sends' dtype,
    agreed with the senders on a rank that only receives). Every sender must send one dtype (DESIGN
    rule 4): send buffers of several dtypes on a rank, senders of different dtypes, or a dtype
    the exchange does not carry raise the same ValueError on every rank (the vote carries the
    dtype), before anything is sent; pass ``dtype=`` (the same on every rank) to cast on the wire."""
    tensors = [t for _, t in sends]
    local = any(t.requires_grad for t in tensors) if tensors else None
    own = dtype if dtype is not None else [t.dtype for t in tensors]  # several: raises on every rank
    grad, agreed = agree_requires_grad(local, op, None, own)
    wire = agreed if agreed is not None else torch.float64  # nobody sends: the dtype is moot
    send_peers, recv_peers = [p for p, _ in sends], [p for p, _ in recvs]
    shapes = [tuple(s) for _, s in recvs]
    if not grad:
        got = P.exchange(list(zip(send_peers, tensors)), list(zip(recv_peers, shapes)), dtype=wire, op=op)
        if not recvs and tensors:
            return [tensors[0].new_zeros((0,) + tuple(tensors[0].shape[1:]), dtype=wire)]
        return list(got)  # type: ignore[arg-type]
    if not sends and not recvs:
        return []  # no message either way: nothing to differentiate on this rank
    token = (0,) + tuple(tensors[0].shape[1:]) if not recvs else None
    world = get_world()
    device = tensors[0].device if tensors else (world.device if world is not None else None)
    # a differentiable leaf makes every output require grad, on a rank that only receives too
    anchor = torch.zeros(0, dtype=wire, device=device, requires_grad=True)
    out = _Exchange.apply(send_peers, recv_peers, shapes, op, wire, token, anchor, *tensors)
    return list(out)


def permute(
    x: torch.Tensor, dst: int, src: int, recv_shape: Sequence[int] | None = None, op: str = "permute"
) -> torch.Tensor:
    """Send ``x`` to global rank ``dst`` and receive a block from ``src`` (every rank takes part in
    one permutation of blocks). Backward: the inverse permutation."""
    shape = tuple(x.shape) if recv_shape is None else tuple(recv_shape)
    if dst == src == scope_rank() and shape != tuple(x.shape):
        raise ValueError(f"permute to self: block {tuple(x.shape)} but recv_shape {shape}")
    # a block that stays is a local copy inside the exchange, which every rank must call
    return exchange([(dst, x)], [(src, shape)], op=op)[0]


def ring_shift(
    x: torch.Tensor, grid: ProcessGrid, axis: int | str, k: int = 1, recv_shape: Sequence[int] | None = None
) -> torch.Tensor:
    """Move this rank's block k steps along grid ``axis`` (a ring): the block from coordinate c - k
    arrives. Backward: shift by -k."""
    ranks = grid.axis_ranks(axis)
    i = ranks.index(grid.rank)
    n = len(ranks)
    return permute(x, ranks[(i + k) % n], ranks[(i - k) % n], recv_shape, op="ring_shift")


def grid_transpose(
    x: torch.Tensor, grid: ProcessGrid, recv_shape: Sequence[int] | None = None
) -> torch.Tensor:
    """Tile (r, c) <-> tile (c, r) on a square 2-D grid (diagonal tiles stay). Backward: itself."""
    if grid.ndim != 2 or grid.rows != grid.cols:
        raise ValueError(
            f"grid_transpose needs a square 2-D grid, got {'x'.join(map(str, grid.shape))}; "
            "use transpose_tiles() (any grid shape), or permute() with a tile map"
        )
    r, c = grid.coords
    peer = grid.rank_of((c, r))
    return permute(x, peer, peer, recv_shape, op="grid_transpose")


def _interval(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def _transpose_moves(grid: ProcessGrid, nr: int, nc: int) -> tuple[list, list]:
    """Pieces of one tile transposition on a rows x cols grid (replicated metadata only).

    The matrix is Nr x Nc with Nr = nr * rows, Nc = nc * cols; rank (r, c) stores ``X[I_r, J_c]``
    (I: row blocks of nr, J: column blocks of nc) and must end with ``X^T[I_r, J_c] =
    X[J_c, I_r]^T`` where X has those entries (intersections of blocks: indices beyond X's
    extent are not sent). Returns ``sends = [(peer, rows, cols)]`` (ranges within my stored tile)
    and ``recvs = [(peer, rows, cols)]`` (ranges of the peer's stored tile, in global
    indices, that land transposed in my output tile); one piece per peer and direction.
    """
    r, c = grid.coords
    mine_i, mine_j = (r * nr, (r + 1) * nr), (c * nc, (c + 1) * nc)
    sends, recvs = [], []
    for peer in range(grid.size):
        pr, pc = grid.coords_of(peer)
        peer_i, peer_j = (pr * nr, (pr + 1) * nr), (pc * nc, (pc + 1) * nc)
        rows, cols = _interval(mine_i, peer_j), _interval(mine_j, peer_i)
        if rows and cols:  # the peer's output needs X[rows, cols] from my tile
            sends.append((peer, rows, cols))
        rows, cols = _interval(peer_i, mine_j), _interval(peer_j, mine_i)
        if rows and cols:  # my output needs X[rows, cols] from the peer's tile
            recvs.append((peer, rows, cols))
    return sends, recvs


def transpose_tiles_local(x: torch.Tensor, grid: ProcessGrid, op: str = "transpose_tiles") -> torch.Tensor:
    """The move of :func:`transpose_tiles` on plain tensors (no autograd; for use inside
    hand-written autograd Functions, or on masks)."""
    if grid.ndim != 2 or x.dim() < 3:
        raise ValueError(
            f"transpose_tiles needs a 2-D grid and a tile [B, n_r, n_c, ...], got {tuple(x.shape)}"
        )
    nr, nc = x.shape[1], x.shape[2]
    sends, recvs = _transpose_moves(grid, nr, nc)
    r, c = grid.coords
    rest = tuple(x.shape[3:])
    send_list = [
        (p, x[:, i0 - r * nr : i1 - r * nr, j0 - c * nc : j1 - c * nc].contiguous())
        for p, (i0, i1), (j0, j1) in sends
    ]
    recv_list = [(p, (x.shape[0], i1 - i0, j1 - j0) + rest) for p, (i0, i1), (j0, j1) in recvs]
    got = P.exchange(send_list, recv_list, dtype=x.dtype, op=op)
    square = nr * grid.rows == nc * grid.cols  # else the entries X lacks stay zero
    out = x.new_empty(x.shape) if square else x.new_zeros(x.shape)
    for (_, (i0, i1), (j0, j1)), piece in zip(recvs, got):
        # X[i0:i1, j0:j1] (i in my column block J_c, j in my row block I_r) lands transposed
        out[:, j0 - r * nr : j1 - r * nr, i0 - c * nc : i1 - c * nc] = piece.transpose(1, 2)
    return out


@autocast_rule()
class _TransposeTiles(torch.autograd.Function):
    """Dtype path: pieces travel in x's dtype (backward: the gradient's), no arithmetic."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, grid: ProcessGrid) -> torch.Tensor:
        ctx.grid = grid
        return transpose_tiles_local(x, grid)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return transpose_tiles_local(g.contiguous(), ctx.grid, op="transpose_tiles:backward"), None


def transpose_tiles(x: torch.Tensor, grid: ProcessGrid) -> torch.Tensor:
    """This rank's tile of ``X^T`` from its tile of ``X`` (dims 1 and 2 of ``x[B, n_r, n_c, ...]``
    are the matrix dims; ``X`` is Nr x Nc with Nr = n_r * rows, Nc = n_c * cols), on ANY 2-D grid.

    The result has ``x``'s shape, Nr x Nc: ``Y[i, j] = X[j, i]`` where ``j < Nr`` and ``i < Nc``,
    zero elsewhere (a pair tensor padded separately along each axis: the entries only one
    orientation has are padding). This map is its own adjoint.

    On a square grid this is ``grid_transpose`` plus the local transpose: one tile from the
    mirrored rank. On a rectangular grid the tile of ``X^T`` at (r, c) is made of pieces of
    several stored tiles (the row blocks I and column blocks J have different sizes): one
    point-to-point exchange, one message per peer, each piece an intersection of blocks, so
    every rank sends and receives exactly one tile's worth of elements. The result is the
    same tile shape as ``x``. Backward: the same move (a transposition is its own inverse,
    and the adjoint of a permutation of elements is its inverse)."""
    return _TransposeTiles.apply(x, grid)
