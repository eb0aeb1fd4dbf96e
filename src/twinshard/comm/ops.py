"""Autograd-aware communication ops: each backward is the exact adjoint of its forward.

For per-rank inputs x_r and outputs y_r = f(x)_r, every op satisfies
sum_r <dy_r, f(x)_r> = sum_r <f*(dy)_r, x_r> (tested in fp64 at several world and
grid sizes). Adjoint pairs: all_reduce <-> all_reduce, all_gather <-> reduce_scatter,
all_to_all <-> the reverse all_to_all, broadcast <-> reduce to the source,
sync_grad (identity, for replicated parameters) <-> all_reduce, ring shift by k <->
shift by -k, permutation <-> its inverse, exchange <-> the reverse exchange.
Gradient sums run in >= fp32 (fp64 stays fp64) and are cast back to the input dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from twinshard.comm import primitives as P
from twinshard.runtime.grid import ProcessGrid

Group = P.Group


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return P.all_reduce(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return P.all_reduce(g, ctx.group, op="all_reduce:backward"), None


class _SyncGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return P.all_reduce(g, ctx.group, op="sync_grad:backward"), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Group, sizes: list[int] | None):
        ctx.dim, ctx.group = dim, group
        n = P.group_size(group)
        ctx.sizes = [x.shape[dim]] * n if sizes is None else list(sizes)
        return P.all_gather(x, dim, group, ctx.sizes)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return P.reduce_scatter(g, ctx.dim, ctx.group, ctx.sizes, op="all_gather:backward"), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Group, sizes: list[int] | None):
        ctx.dim, ctx.group = dim, group
        n = P.group_size(group)
        ctx.sizes = [x.shape[dim] // n] * n if sizes is None else list(sizes)
        return P.reduce_scatter(x, dim, group, sizes)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return P.all_gather(g, ctx.dim, ctx.group, ctx.sizes, op="reduce_scatter:backward"), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: Group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return P.all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return P.all_to_all(g, ctx.recv, ctx.send, ctx.group, op="all_to_all:backward"), None, None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, src: int, group: Group):
        ctx.src, ctx.group = src, group
        return P.broadcast(x, src, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return P.reduce(g, ctx.src, ctx.group, op="broadcast:backward"), None, None


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        send_peers: list[int],
        recv_peers: list[int],
        recv_shapes: list[tuple[int, ...]],
        op: str,
        *tensors: torch.Tensor,
    ):
        ctx.send_peers, ctx.recv_peers, ctx.op = send_peers, recv_peers, op
        ctx.send_shapes = [tuple(t.shape) for t in tensors]
        dtype = tensors[0].dtype if tensors else torch.float64
        ctx.dtype = dtype
        out = P.exchange(
            list(zip(send_peers, tensors)), list(zip(recv_peers, recv_shapes)), dtype=dtype, op=op
        )
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        back = P.exchange(
            list(zip(ctx.recv_peers, grads)),
            list(zip(ctx.send_peers, ctx.send_shapes)),
            dtype=ctx.dtype,
            op=ctx.op + ":backward",
        )
        return (None, None, None, None, *back)


def all_reduce(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Sum over ``group``. Backward: all-reduce of the gradient (each rank's output feeds the loss)."""
    return _AllReduce.apply(x, group)


def sync_grad(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Identity on a value replicated over ``group``; backward all-reduces its gradient.

    Apply it where a replicated parameter enters sharded compute: each rank's partial gradient
    is summed, so the parameter gradient comes back complete and replicated."""
    return _SyncGrad.apply(x, group)


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
) -> list[torch.Tensor]:
    """Sparse point-to-point with global peer ranks (see primitives.exchange). Backward: every
    received gradient goes back to its sender, which gets it as the gradient of what it sent."""
    out = _Exchange.apply(
        [p for p, _ in sends], [p for p, _ in recvs], [tuple(s) for _, s in recvs], op, *[t for _, t in sends]
    )
    return list(out)


def permute(
    x: torch.Tensor, dst: int, src: int, recv_shape: Sequence[int] | None = None, op: str = "permute"
) -> torch.Tensor:
    """Send ``x`` to global rank ``dst`` and receive a block from ``src`` (every rank takes part in
    one permutation of blocks). Backward: the inverse permutation."""
    shape = tuple(x.shape) if recv_shape is None else tuple(recv_shape)
    if dst == src == dist.get_rank():
        if shape != tuple(x.shape):
            raise ValueError(f"permute to self: block {tuple(x.shape)} but recv_shape {shape}")
        return x.clone()
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
            "use permute() with the tile map of a rectangular grid"
        )
    r, c = grid.coords
    peer = grid.rank_of((c, r))
    return permute(x, peer, peer, recv_shape, op="grid_transpose")
