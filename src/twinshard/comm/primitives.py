"""Raw collectives and point-to-point moves on plain tensors (no autograd).

These are the building blocks of the autograd ops in ``twinshard.comm.ops``
and of hand-written ``autograd.Function``s (Cannon/SUMMA schedules, halos),
which call them on local tensors in forward and backward. Every function:
- makes its send buffers contiguous and gives them one dtype (``wire``),
- accumulates sums in ``reduce_dtype(x.dtype)`` (>= fp32; fp64 stays fp64)
  and casts the result back,
- records calls and bytes in the active CommLedger,
- is a no-op (a copy at most) on a group of one rank.
Group arguments are process groups (None = the world, or the sub-world of an active
``twinshard.runtime.scope.sub_world``); ``src``/indices are positions within the group, ``peer``
ranks in point-to-point calls are world ranks (sub-world ranks inside a sub-world, translated
to global ones here).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from twinshard.comm import amp
from twinshard.comm.ledger import record
from twinshard.comm.placement import check_payload
from twinshard.runtime.scope import default_group, scope_rank, to_global
from twinshard.runtime.world import get_world

Group = dist.ProcessGroup | None

# torch 2.13 renamed the tensor-form collectives; older releases (>= 2.9) have the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums are carried in: at least fp32, fp64 kept."""
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else dtype


# dtype codes of the audit's wire agreement (twinshard.comm.amp): one int64 per buffer
_CODES = (
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


def _group_ranks(group: Group) -> tuple[int, ...]:
    return tuple(global_rank(group, i) for i in range(group_size(group)))


def _audit_collective(op: str, dtype: torch.dtype, group: Group, kind: str) -> torch.dtype:
    """Audit mode only (else ``dtype``): record this rank's wire dtype and agree it over the group
    (one all-gather of one int64, outside the ledger); ranks that differ are noted as a mismatch
    and every rank then moves the buffer in the widest of the dtypes, so the world does not hang."""
    if not amp.audit_active():
        return dtype
    amp.record_wire(op, dtype, kind, _group_ranks(group))
    dev = get_world().device if get_world() is not None else torch.device("cpu")
    mine = torch.tensor([_CODES.index(dtype)], dtype=torch.int64, device=dev)
    every = torch.empty(group_size(group), dtype=torch.int64, device=dev)
    _all_gather_tensor(every, mine, group=group)
    kinds = [_CODES[int(c)] for c in every.tolist()]
    if len(set(kinds)) == 1:
        return dtype
    amp.note_mismatch(f"{op}: wire dtypes over ranks {_group_ranks(group)}: {[str(k) for k in kinds]}")
    wide = kinds[0]
    for k in kinds[1:]:
        wide = torch.promote_types(wide, k)
    return wide


def resolve(group: Group) -> Group:
    """``group``, or for ``None`` the active sub-world's group (``None``: the world)."""
    return default_group() if group is None else group


def group_size(group: Group) -> int:
    return dist.get_world_size(resolve(group))


def group_rank(group: Group) -> int:
    return dist.get_rank(resolve(group))


def global_rank(group: Group, index: int) -> int:
    group = resolve(group)
    return index if group is None else dist.get_global_rank(group, index)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _row_bytes(x: torch.Tensor) -> int:
    n = 1
    for s in x.shape[1:]:
        n *= s
    return n * x.element_size()


def _pad0(x: torch.Tensor, m: int) -> torch.Tensor:
    """Pad dim 0 to m rows with zeros (uneven blocks travel in equal buffers)."""
    if x.shape[0] == m:
        return x
    return torch.cat([x, x.new_zeros((m - x.shape[0],) + tuple(x.shape[1:]))])


def all_reduce(
    x: torch.Tensor, group: Group = None, op: str = "all_reduce", donate: bool = False
) -> torch.Tensor:
    """Sum of ``x`` over the group (x's dtype, summed in reduce_dtype): a new tensor, or with
    ``donate`` (the caller owns ``x`` and drops it) ``x`` itself when it is already contiguous in
    the reduce dtype, summed in place (one buffer fewer at the caller's peak)."""
    group = resolve(group)
    check_payload(op, x)
    n = group_size(group)
    if n == 1:
        return x if donate else x.clone()
    wire = _audit_collective(op, reduce_dtype(x.dtype), group, "all_reduce")
    buf = x.to(wire).contiguous()
    if not (donate and buf is x):
        buf = buf.clone() if buf is x else buf  # x.to / contiguous made a copy already otherwise
    dist.all_reduce(buf, group=group)
    b = 2 * (n - 1) * nbytes(buf) // n
    record(op, b, b)
    return buf.to(x.dtype)


def all_gather(
    x: torch.Tensor, dim: int, group: Group = None, sizes: Sequence[int] | None = None, op: str = "all_gather"
) -> torch.Tensor:
    """Concatenate every rank's block along ``dim``; ``sizes`` gives uneven block sizes."""
    group = resolve(group)
    check_payload(op, x)
    n = group_size(group)
    if n == 1:
        return x.clone()
    dim = dim % x.dim()
    sizes = [x.shape[dim]] * n if sizes is None else list(sizes)
    if len(sizes) != n or sizes[group_rank(group)] != x.shape[dim]:
        raise ValueError(
            f"all_gather: sizes {sizes} do not match a group of {n} with local block "
            f"{x.shape[dim]} along dim {dim}"
        )
    m = max(sizes)
    xt = _pad0(x.movedim(dim, 0), m).to(_audit_collective(op, x.dtype, group, "all_gather")).contiguous()
    out = xt.new_empty((n * m,) + tuple(xt.shape[1:]))
    _all_gather_tensor(out, xt, group=group)
    record(op, nbytes(xt) * (n - 1), nbytes(xt) * (n - 1))
    if all(s == m for s in sizes):  # no padding to drop: the gathered buffer is the result
        return out.movedim(0, dim).to(x.dtype)
    blocks = [out[i * m : i * m + s] for i, s in enumerate(sizes)]
    return torch.cat(blocks).movedim(0, dim).to(x.dtype)


def reduce_scatter(
    x: torch.Tensor,
    dim: int,
    group: Group = None,
    sizes: Sequence[int] | None = None,
    op: str = "reduce_scatter",
) -> torch.Tensor:
    """Sum over the group, then keep this rank's block along ``dim`` (``sizes``: uneven blocks)."""
    group = resolve(group)
    check_payload(op, x)
    n = group_size(group)
    if n == 1:
        return x.clone()
    dim = dim % x.dim()
    if sizes is None:
        if x.shape[dim] % n:
            raise ValueError(
                f"reduce_scatter: dim {dim} of size {x.shape[dim]} does not split evenly "
                f"over {n} ranks; pass sizes="
            )
        sizes = [x.shape[dim] // n] * n
    sizes = list(sizes)
    if len(sizes) != n or sum(sizes) != x.shape[dim]:
        raise ValueError(
            f"reduce_scatter: sizes {sizes} do not split dim {dim} of size {x.shape[dim]} over {n} ranks"
        )
    m = max(sizes)
    xt = x.movedim(dim, 0).to(_audit_collective(op, reduce_dtype(x.dtype), group, "reduce_scatter"))
    buf = torch.cat([_pad0(b, m) for b in torch.split(xt, sizes)]).contiguous()
    out = buf.new_empty((m,) + tuple(buf.shape[1:]))
    _reduce_scatter_tensor(out, buf, group=group)
    record(op, nbytes(out) * (n - 1), nbytes(out) * (n - 1))
    return out[: sizes[group_rank(group)]].movedim(0, dim).to(x.dtype)


def all_to_all(
    x: torch.Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: Group = None,
    op: str = "all_to_all",
) -> torch.Tensor:
    """Rows ``x[sum(send_splits[:j]) : ...]`` go to group rank j; blocks come back in rank order."""
    group = resolve(group)
    check_payload(op, x)
    n = group_size(group)
    send_splits, recv_splits = [int(s) for s in send_splits], [int(s) for s in recv_splits]
    if len(send_splits) != n or len(recv_splits) != n or sum(send_splits) != x.shape[0]:
        raise ValueError(
            f"all_to_all: send_splits {send_splits} / recv_splits {recv_splits} do not fit "
            f"a group of {n} and {x.shape[0]} rows"
        )
    if n == 1:
        return x.clone()
    xc = x.to(_audit_collective(op, x.dtype, group, "all_to_all")).contiguous()
    out = xc.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(
        out, xc, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group
    )
    me, row = group_rank(group), _row_bytes(xc)
    record(op, row * (sum(send_splits) - send_splits[me]), row * (sum(recv_splits) - recv_splits[me]))
    return out.to(x.dtype)


def broadcast(x: torch.Tensor, src: int = 0, group: Group = None, op: str = "broadcast") -> torch.Tensor:
    """``x`` of group rank ``src`` on every rank (others pass a tensor of the same shape and dtype)."""
    group = resolve(group)
    check_payload(op, x)
    n = group_size(group)
    if n == 1:
        return x.clone()
    buf = x.to(_audit_collective(op, x.dtype, group, "broadcast")).contiguous().clone()
    dist.broadcast(buf, src=global_rank(group, src), group=group)
    me = group_rank(group)
    record(op, nbytes(buf) * (n - 1) if me == src else 0, 0 if me == src else nbytes(buf))
    return buf.to(x.dtype)


def reduce(x: torch.Tensor, dst: int = 0, group: Group = None, op: str = "reduce") -> torch.Tensor:
    """Sum over the group on group rank ``dst`` (zeros elsewhere), summed in reduce_dtype."""
    group = resolve(group)
    check_payload(op, x)
    n = group_size(group)
    if n == 1:
        return x.clone()
    buf = x.to(_audit_collective(op, reduce_dtype(x.dtype), group, "reduce")).contiguous().clone()
    dist.reduce(buf, dst=global_rank(group, dst), group=group)
    me = group_rank(group)
    record(op, 0 if me == dst else nbytes(buf), nbytes(buf) * (n - 1) if me == dst else 0)
    return buf.to(x.dtype) if me == dst else torch.zeros_like(x)


class Pending:
    """Handle of point-to-point moves in flight; ``wait()`` returns the received tensors."""

    def __init__(self, works: list, received: list[torch.Tensor]):
        self._works, self.received = works, received

    def wait(self) -> list[torch.Tensor]:
        for w in self._works:
            w.wait()
        self._works = []
        return self.received


def exchange(
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, tuple[int, ...]]],
    dtype: torch.dtype | None = None,
    op: str = "exchange",
    async_op: bool = False,
) -> list[torch.Tensor] | Pending:
    """Sparse point-to-point: send each (peer, tensor), receive each (peer, shape) in ``dtype``.

    Peers are global ranks; at most one message per peer and direction. A message to oneself is a
    local copy. Sends to a lower rank are posted before receives from it and vice versa (by rank
    order, as every rank sees the same pairs), all non-blocking, so paired ranks never both block.
    Returns the received tensors in ``recvs`` order (or a Pending handle with ``async_op``).
    """
    me = scope_rank()
    if dtype is None:
        dtype = sends[0][1].dtype if sends else torch.float64
    # receive buffers live on the world's device (CUDA under NCCL), whatever the sends' device
    world = get_world()
    device = world.device if world else (sends[0][1].device if sends else torch.device("cpu"))
    check_payload(op, *(t for _, t in sends))
    send_peers = [p for p, _ in sends]
    recv_peers = [p for p, _ in recvs]
    if len(set(send_peers)) != len(send_peers) or len(set(recv_peers)) != len(recv_peers):
        raise ValueError("exchange: at most one message per peer and direction; concatenate first")
    self_send = {p: t for p, t in sends if p == me}
    received: list[torch.Tensor | None] = [None] * len(recvs)
    bufs = {p: t.to(dtype).contiguous() for p, t in sends if p != me}
    theirs = _audit_p2p(op, dtype, sorted(bufs), [p for p in recv_peers if p != me], device)
    ops = []
    peers = sorted(set(bufs) | {p for p in recv_peers if p != me})
    sent = got = 0
    for peer in peers:
        pair = []
        if peer in bufs:
            pair.append(dist.P2POp(dist.isend, bufs[peer], to_global(peer)))
            sent += nbytes(bufs[peer])
        for i, (p, shape) in enumerate(recvs):
            if p == peer:  # in the sender's dtype (an audit's mismatch: cast below)
                received[i] = torch.empty(shape, dtype=theirs.get(p, dtype), device=device)
                pair.append(dist.P2POp(dist.irecv, received[i], to_global(peer)))
                got += nbytes(received[i])
        ops.extend(pair if me < peer else pair[::-1])
    for i, (p, shape) in enumerate(recvs):
        if p == me:
            if me not in self_send:
                raise ValueError(f"exchange: rank {me} expects a message from itself but sends none")
            t = self_send[me].to(dtype)
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"exchange: self message of shape {tuple(t.shape)}, expected {tuple(shape)}")
            received[i] = t.clone()
    works = dist.batch_isend_irecv(ops) if ops else []
    if peers:
        record(op, sent, got)
    if theirs:  # audit mode: what a mismatched sender sent, in the dtype this rank expects
        pending = _Recast(works, received, dtype)
    else:
        pending = Pending(works, received)  # type: ignore[arg-type]
    return pending if async_op else pending.wait()


class _Recast(Pending):
    def wait(self) -> list[torch.Tensor]:
        return [t.to(self._dtype) for t in super().wait()]

    def __init__(self, works: list, received: list[torch.Tensor], dtype: torch.dtype):
        super().__init__(works, received)
        self._dtype = dtype


def _audit_p2p(
    op: str, dtype: torch.dtype, send_peers: list[int], recv_peers: list[int], device: torch.device
) -> dict[int, torch.dtype]:
    """Audit mode only (else {}): record each message's dtype at both ends and tell each receiver
    the dtype its sender uses (one int64 message per message, outside the ledger); returns
    {sender: its dtype} for this rank's receives, a mismatch noted in the audit."""
    if not amp.audit_active():
        return {}
    for p in send_peers:
        amp.record_wire(op, dtype, "send", p)
    for p in recv_peers:
        amp.record_wire(op, dtype, "recv", p)
    me = scope_rank()  # peers are ranks of the active sub-world (the world outside one)
    code = torch.tensor([_CODES.index(dtype)], dtype=torch.int64, device=device)
    got = {p: torch.empty(1, dtype=torch.int64, device=device) for p in recv_peers}
    ops = []
    for peer in sorted(set(send_peers) | set(recv_peers)):
        pair = []
        if peer in send_peers:
            pair.append(dist.P2POp(dist.isend, code, to_global(peer)))
        if peer in got:
            pair.append(dist.P2POp(dist.irecv, got[peer], to_global(peer)))
        ops.extend(pair if me < peer else pair[::-1])
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()
    theirs = {p: _CODES[int(t.item())] for p, t in got.items()}
    for p, d in theirs.items():
        if d != dtype:
            amp.note_mismatch(f"{op}: rank {p} sends {d} to rank {me}, which expects {dtype}")
    return theirs or {-1: dtype}  # non-empty: the caller knows it is in audit mode


def shift(
    x: torch.Tensor,
    ranks: Sequence[int],
    k: int,
    recv_shape: tuple[int, ...] | None = None,
    op: str = "ring_shift",
    async_op: bool = False,
) -> torch.Tensor | Pending:
    """Ring shift along the ring ``ranks`` (global ranks in ring order, this rank among them):
    the block at ring position i moves to position i + k. Returns the block from i - k."""
    n = len(ranks)
    me = scope_rank()
    i = list(ranks).index(me)
    dst, src = ranks[(i + k) % n], ranks[(i - k) % n]
    shape = tuple(x.shape) if recv_shape is None else tuple(recv_shape)
    if dst == src == me and shape == tuple(x.shape):
        out = x.clone()
        return Pending([], [out]) if async_op else out
    res = exchange([(dst, x)], [(src, shape)], dtype=x.dtype, op=op, async_op=async_op)
    return res if async_op else res[0]  # type: ignore[index]
