"""Handlers of storage without halo (``Owned(counts)``): ``sharded_gather`` and ``sharded_scatter``
with their routing and its cache; see :mod:`twinshard.shard.dispatch`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from twinshard.comm import primitives as prim
from twinshard.runtime.world import on_shutdown
from twinshard.shard.placements import PAD, Owned
from twinshard.shard.registry import (
    Handler,
    index_predicate,
    parse_index_call,
    plain_index,
)
from twinshard.shard.shard_tensor import ShardTensor, from_local, to_local

__all__ = ["ROUTES_KEPT"]


# ---------------------------------------------------------------------- sharded storage (no halo)
def _layout(x: ShardTensor) -> tuple[list[int], int, int]:
    pl: Owned = x._spec.placement  # type: ignore[assignment]
    offsets = pl.offsets
    me = prim.group_rank(x.group)
    if int(x._local.shape[0]) != int(pl.counts[me]):  # type: ignore[index]
        raise ValueError(f"sharded storage: rank {me} holds {x._local.shape[0]} rows, counts say {pl.counts}")
    return offsets, me, len(pl.counts)  # type: ignore[arg-type]


class _RowsAllToAll(torch.autograd.Function):
    """Uneven all-to-all of rows; backward: the reverse all-to-all, itself differentiable (a double
    backward, e.g. a force loss, differentiates through it again)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return prim.all_to_all(x.contiguous(), send, recv, group, op="sharded_storage:rows")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _RowsAllToAll.apply(g.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def _global_ids(x: ShardTensor, ids: torch.Tensor, me: int) -> torch.Tensor:
    """Global row ids of an index: a placement may address rows relative to the rank (its
    ``to_global``, e.g. the graph storage's, whose owned rows are ids ``0..n-1``)."""
    to_global = getattr(x._spec.placement, "to_global", None)
    return ids if to_global is None else to_global(ids, me)


_OUT_OF_RANGE, _NOT_CONSTANT = -1, -2  # counts a failing rank sends instead of its own


def _route(
    ids: torch.Tensor, offsets: list[int], x: ShardTensor, nranks: int, not_constant: bool = False
) -> tuple[Any, list, list]:
    """Owner of each global id and the agreed send/receive counts (one all-to-all of counts).
    A bad index raises on EVERY rank: the rank that holds it sends negative counts in the same
    all-to-all (-1: ids out of range; -2: ``not_constant``, a scatter index expanded along the
    feature dims that is not constant along them), so no rank is left waiting in the next one."""
    total = offsets[-1]
    dev = x._local.device
    bad = [] if not_constant or not ids.numel() else ids[(ids < 0) | (ids >= total)][:5].tolist()
    if bad or not_constant:
        code = _NOT_CONSTANT if not_constant else _OUT_OF_RANGE
        owner, send = None, torch.full((nranks,), code, dtype=torch.int64, device=dev)
    else:
        bounds = torch.tensor(offsets[1:], dtype=ids.dtype, device=ids.device)
        owner = torch.searchsorted(bounds, ids, right=True)
        send = torch.bincount(owner, minlength=nranks).to(torch.int64).to(dev)
    recv = prim.all_to_all(send, [1] * nranks, [1] * nranks, x.group, op="sharded_storage")
    if bad or not_constant or bool((recv < 0).any()):
        varying = sorted(set(torch.nonzero(recv == _NOT_CONSTANT).flatten().tolist()))
        if varying:
            raise NotImplementedError(
                f"sharded scatter_add: the index must be constant along the feature dims (an index "
                f"expanded from a 1-D one), not on rank(s) {varying}: scatter with index_add_ and the "
                "1-D index, or expand a 1-D index"
            )
        who = sorted(set(torch.nonzero(recv == _OUT_OF_RANGE).flatten().tolist()))
        mine = f"; here: {bad}" if bad else ""
        raise IndexError(
            f"sharded storage: global row ids out of range [0, {total}) (PAD is {PAD}) on rank(s) {who}{mine}"
        )
    return owner, send.tolist(), recv.tolist()


# The routing of a sharded gather or scatter (which ids each rank sends where) depends on every
# rank's index, the placement and the group's shape only, and a model gathers with the same edge
# index at every layer and evaluation. So it is kept, keyed by the call's index on EVERY rank (one
# all-gather of each rank's index key: storage address, offset, shape, stride, version) and reused
# when every rank holds it. A kept entry holds its index storage, so an address in a key cannot
# be reused by another tensor while the entry lives; a write to the index (its version) or
# another index on any rank is a new key. Ranks insert and evict on the same calls (the keys are
# gathered), so their caches agree.
_ROUTES: dict[tuple, tuple] = {}
ROUTES_KEPT = 4  # a model routes with 2-3 edge tensors; a stale entry holds its index's memory
_KINDS = {"gather": 1, "scatter": 2}
_KEY_DIMS = 4  # indices of more dims are not kept (routed at every call)
on_shutdown(_ROUTES.clear)  # device tensors of a finished world's runs


def _index_key(kind: str, index: torch.Tensor) -> list[int]:
    if index.dim() > _KEY_DIMS:
        return [0] * (5 + 2 * _KEY_DIMS)
    pad = [-1] * (_KEY_DIMS - index.dim())
    return [
        _KINDS[kind],
        index.untyped_storage().data_ptr(),
        index.storage_offset(),
        index._version,
        index.dim(),
        *index.shape,
        *pad,
        *index.stride(),
        *pad,
    ]


def _routing(kind: str, index: torch.Tensor, x: ShardTensor, build: Callable[[], tuple]) -> tuple:
    """``build()``'s routing of this call, or the kept one (collective on more than one rank: one
    all-gather of every rank's index key, 13 int64 per rank, before any routing collective)."""
    n, me = prim.group_size(x.group), prim.group_rank(x.group)
    mine = _index_key(kind, index)
    if n == 1:
        key, keys = (tuple(mine), 1, 0), [mine]
    else:
        row = torch.tensor(mine, dtype=torch.int64, device=x._local.device)
        every = prim.all_gather(row[None], 0, x.group, op="sharded_storage:route_keys")
        keys = every.tolist()
        key = (tuple(v for k in keys for v in k), n, me)
    got = _ROUTES.get(key)
    if got is not None and got[1] == x._spec.placement:
        return got[2]
    routing = build()
    if all(k[0] != 0 for k in keys):  # every rank's index can be keyed: every rank keeps it
        while len(_ROUTES) >= ROUTES_KEPT:
            _ROUTES.pop(next(iter(_ROUTES)))
        _ROUTES[key] = (index.untyped_storage(), x._spec.placement, routing)
    return routing


def _all_local(s: list[int], r: list[int], me: int, x: ShardTensor) -> bool:
    """Whether no rank sends or receives a row in this routing (every index names rows its own
    rank owns: the receivers of graph storage, whose edges all have owned receivers). Agreed: one
    all-reduce of one flag when the routing is built (then kept with it), so every rank takes the
    same path and either all of them or none enter the rows' all-to-all."""
    off = sum(v for j, v in enumerate(s) if j != me) + sum(v for j, v in enumerate(r) if j != me)
    if prim.group_size(x.group) == 1:
        return True
    flag = torch.tensor([float(off > 0)], dtype=torch.float64, device=x._local.device)
    return float(prim.all_reduce(flag, x.group, op="sharded_storage")[0]) == 0.0


def _sharded_pred(kind: str) -> Callable[[Any, tuple, dict], bool]:
    base = index_predicate(kind, Owned)

    def pred(func: Any, args: tuple, kwargs: dict) -> bool:
        if not base(func, args, kwargs):
            return False
        c = parse_index_call(func, args, kwargs)
        return c is not None and c.target._spec.placement.counts is not None

    return pred


def _run_sharded_gather(func: Any, args: tuple, kwargs: dict) -> Any:
    c = parse_index_call(func, args, kwargs)
    assert c is not None and c.name != "gather", "sharded storage gathers with index_select or x[ids]"
    x: ShardTensor = c.target
    offsets, me, nranks = _layout(x)
    gidx = plain_index(c.index)
    dev = x._local.device

    def route() -> tuple[torch.Tensor, list[int], list[int], torch.Tensor, bool, torch.Tensor | None]:
        flat = gidx.reshape(-1).to(torch.int64)
        valid = flat != PAD
        uniq, inverse = torch.unique(_global_ids(x, flat[valid], me), sorted=True, return_inverse=True)
        _, s, r = _route(uniq, offsets, x, nranks)
        wanted = prim.all_to_all(uniq.to(dev), s, r, x.group, op="sharded_gather")  # ids others need
        pos = torch.full((flat.numel(),), uniq.numel(), dtype=torch.int64, device=dev)
        pos[valid] = inverse
        pad = not bool(valid.all())
        mine = wanted - offsets[me]
        # every rank reads only its own rows (agreed): one local index_select of the same rows
        # (the same values and, in backward, the same index_add order), no copy through the
        # all-to-all; with PAD ids the general path
        direct = mine.index_select(0, pos) if _all_local(s, r, me, x) and not pad else None
        return mine, s, r, pos, pad, direct

    mine, s, r, pos, pad, direct = _routing("gather", gidx, x, route)
    if direct is not None:
        out = to_local(x).index_select(0, direct).reshape(tuple(gidx.shape) + tuple(x._local.shape[1:]))
        return out[(slice(None),) * gidx.dim() + c.rest] if c.rest else out
    rows = to_local(x).index_select(0, mine)
    got = _RowsAllToAll.apply(rows, r, s, x.group) if nranks > 1 else rows  # rows back, in uniq order
    if pad:  # PAD ids read the zero row after the fetched ones
        got = torch.cat([got, got.new_zeros((1,) + tuple(got.shape[1:]))])
    out = got.index_select(0, pos).reshape(tuple(gidx.shape) + tuple(got.shape[1:]))
    if c.rest:
        out = out[(slice(None),) * gidx.dim() + c.rest]
    return out


def _run_sharded_scatter(func: Any, args: tuple, kwargs: dict) -> Any:
    c = parse_index_call(func, args, kwargs)
    assert c is not None
    x: ShardTensor = c.target
    offsets, me, nranks = _layout(x)
    given = plain_index(c.index)
    src = to_local(c.source)
    dev = x._local.device

    def route() -> tuple[torch.Tensor, list[int], list[int], torch.Tensor, bool]:
        index, varying = given, False
        if index.dim() > 1:  # scatter_add with an index expanded along the feature dims
            # an expand()ed index (stride 0 along them) is constant by construction
            if any(st != 0 for st in index.stride()[1:]):
                first = index[(slice(None),) + (slice(0, 1),) * (index.dim() - 1)]
                varying = not bool((index == first).all())
            index = index.reshape(index.shape[0], -1)[:, 0]
        index = index.to(torch.int64)
        keep = torch.nonzero(index != PAD).flatten()
        ids = _global_ids(x, index[keep], me)
        owner, s, r = _route(ids, offsets, x, nranks, not_constant=varying)  # raises on every rank
        order = torch.sort(owner, stable=True).indices
        ids_in = prim.all_to_all(ids[order].to(dev), s, r, x.group, op="sharded_scatter")
        picked = keep[order]
        # every rank adds into its own rows only (agreed) and no entry is PAD: the values are the
        # source rows in order, added locally (the same index_add), without the copies
        whole = _all_local(s, r, me, x) and picked.numel() == index.shape[0]
        return picked, s, r, ids_in - offsets[me], whole

    picked, s, r, rows_in, whole = _routing("scatter", given, x, route)
    vals = src if whole else src.index_select(0, picked)
    if c.alpha != 1:
        vals = vals * c.alpha
    vals_in = _RowsAllToAll.apply(vals, s, r, x.group) if nranks > 1 and not whole else vals
    local = to_local(x)
    contrib = torch.zeros_like(local).index_add(0, rows_in, vals_in.to(local.dtype))
    full = from_local(contrib, x._spec)
    if c.inplace:
        return x.add_(full)
    return x + full


def handlers() -> list[Handler]:
    """This family's handlers, in match order."""
    return [
        Handler("sharded_gather", _sharded_pred("gather"), _run_sharded_gather, "fetch rows owned elsewhere"),
        Handler("sharded_scatter", _sharded_pred("scatter"), _run_sharded_scatter, "ship rows to owners"),
    ]
