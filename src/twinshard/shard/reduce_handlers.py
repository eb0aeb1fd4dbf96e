"""Reducing handlers: ``per_system_reduce``, ``plain_rows_reduce`` (and :func:`plain_rows`, how a
plain per-row tensor is read) and ``global_reduce``; see :mod:`twinshard.shard.dispatch`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from twinshard.comm import primitives as prim
from twinshard.shard.placements import HaloState
from twinshard.shard.registry import (
    Handler,
    IndexCall,
    local_scatter,
    parse_index_call,
    plain_index,
)
from twinshard.shard.shard_tensor import ShardTensor, from_local, to_local

__all__ = ["owned_rows", "partial_to_replicate", "plain_rows"]


# ---------------------------------------------------------------------- per-system / global reduce
class _PartialToReplicate(torch.autograd.Function):
    """Forward: sum of per-rank partials (all-reduce). Backward: the identity (the replicated
    gradient, counted once, is every partial's gradient); its own backward all-reduces again."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return prim.all_reduce(x, group, op="per_system_reduce")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _ReplicateToPartial.apply(g, ctx.group), None


class _ReplicateToPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _PartialToReplicate.apply(g.contiguous(), ctx.group), None


def partial_to_replicate(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """All-reduce of per-rank partial sums into a replicated value; backward: identity."""
    return _PartialToReplicate.apply(x.contiguous(), group)


def owned_rows(x: Any) -> Any:
    """The local rows that count once: halo rows dropped (differentiable for a ShardTensor)."""
    if isinstance(x, ShardTensor):
        loc = to_local(x)
        return loc[: x.plan.n_owned] if x._spec.halo else loc
    return x


def _reduce_pred(func: Any, args: tuple, kwargs: dict) -> bool:
    c = parse_index_call(func, args, kwargs)
    if c is None or not c.scatter or c.dim != 0:
        return False
    tgt_per_atom = isinstance(c.target, ShardTensor) and c.target._spec.per_atom
    return not tgt_per_atom and isinstance(c.source, ShardTensor) and c.source._spec.per_atom


def _local_reduce(c: IndexCall, src: ShardTensor) -> torch.Tensor:
    """This rank's partial sums of the scatter ``c`` from the owned rows of ``src`` (halo rows
    dropped: each atom counts once), in the target's shape and the source's dtype."""
    n = src.plan.n_owned if src._spec.halo else src.shape[0]
    index = plain_index(c.index)[:n]
    zeros = torch.zeros(c.target.shape, dtype=src.dtype, device=src.device)
    return local_scatter(c, zeros, index, owned_rows(src))


def _add_into(c: IndexCall, total: torch.Tensor) -> Any:
    total = total.to(c.target.dtype)
    if c.inplace:
        return c.target.add_(total)
    return c.target + total


def _run_reduce(func: Any, args: tuple, kwargs: dict) -> Any:
    c = parse_index_call(func, args, kwargs)
    assert c is not None
    return _add_into(c, partial_to_replicate(_local_reduce(c, c.source), c.source.group))


# ---------------------------------------------------------------------- plain per-row tensors
def plain_rows(t: torch.Tensor, like: ShardTensor) -> ShardTensor:
    """A plain per-row tensor ``t`` (``t.shape[0] == like.shape[0]``: the local rows of a per-atom
    quantity computed from a per-atom count) as a ShardTensor of ``like``'s rows: STALE in halo
    storage (owned rows are the values, halo rows unknown), the owned rows otherwise; see the
    module docstring for when a plain tensor is read this way. Zero-copy and differentiable (the
    gradient comes back plain)."""
    if isinstance(t, ShardTensor) or not like._spec.per_atom or t.dim() == 0 or t.shape[0] != like.shape[0]:
        raise ValueError(
            f"plain_rows: a plain tensor with the {like.shape[0]} local rows of {like._spec!r}, "
            f"got {type(t).__name__} of shape {tuple(t.shape)}"
        )
    return from_local(t, like._spec.with_state(HaloState.STALE))


def _rows_reduce_pred(func: Any, args: tuple, kwargs: dict) -> bool:
    """Type facts only (the same on every rank): the row counts are checked in the run, agreed."""
    c = parse_index_call(func, args, kwargs)
    if c is None or not c.scatter or c.dim != 0:
        return False
    if isinstance(c.target, ShardTensor) and c.target._spec.per_atom:
        return False
    src = c.source
    return (
        isinstance(c.index, ShardTensor)
        and c.index._spec.per_atom
        and isinstance(src, torch.Tensor)
        and not isinstance(src, ShardTensor)
    )


def _run_rows_reduce(func: Any, args: tuple, kwargs: dict) -> Any:
    c = parse_index_call(func, args, kwargs)
    assert c is not None
    index: ShardTensor = c.index
    src: torch.Tensor = c.source
    ok = src.dim() > 0 and src.shape[0] == index.shape[0]
    if ok:
        partial = _local_reduce(c, plain_rows(src, index))
    else:  # this rank cannot line its source up: it says so in the all-reduce, zeros for the rest
        partial = torch.zeros(c.target.shape, dtype=src.dtype, device=src.device)
    # the row-count flag rides on the sums' all-reduce (one element more), so every rank learns it
    flat = torch.cat([partial.new_full((1,), 0 if ok else 1), partial.reshape(-1)])
    total = partial_to_replicate(flat, index.group)
    bad = int(total[0].detach())
    if bad:
        mine = (
            "" if ok else f"; here the source has shape {tuple(src.shape)}, the index {index.shape[0]} rows"
        )
        raise ValueError(
            f"{c.name} over atoms from a plain source with a per-atom index ({index._spec!r}): the "
            f"source's dim 0 must be the index's local rows (a plain per-row tensor), not on "
            f"{bad} rank(s){mine}"
        )
    return _add_into(c, total[1:].reshape(partial.shape))


_GLOBAL = {
    "sum": None,
    "any": dist.ReduceOp.MAX,
    "all": dist.ReduceOp.MIN,
    "amax": dist.ReduceOp.MAX,
    "amin": dist.ReduceOp.MIN,
}


def _global_args(func: Any, args: tuple, kwargs: dict) -> tuple[ShardTensor, Any] | None:
    name = getattr(func, "__name__", "")
    if name not in _GLOBAL or not args or not (isinstance(args[0], ShardTensor) and args[0]._spec.per_atom):
        return None
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if dim is None or (name == "sum" and isinstance(dim, int) and dim % args[0].dim() == 0):
        if kwargs.get("keepdim", False) or (len(args) > 2 and args[2] is True):
            return None
        return args[0], dim
    return None


def _run_global(func: Any, args: tuple, kwargs: dict) -> Any:
    x, dim = _global_args(func, args, kwargs)  # type: ignore[misc]
    name = func.__name__
    rows = owned_rows(x)
    if name == "sum":
        part = rows.sum() if dim is None else rows.sum(0)
        return partial_to_replicate(part, x.group)
    if x.requires_grad and torch.is_grad_enabled() and name in ("amax", "amin"):
        raise NotImplementedError(f"{name} over atoms of a ShardTensor is not differentiable here")
    r = rows.detach()
    if name in ("any", "all"):
        v = (r.any() if name == "any" else r.all()).to(torch.int64).reshape(1)
    else:
        if r.numel() == 0:
            raise ValueError(f"{name} over atoms: this rank holds no rows (use a masked sum instead)")
        v = (r.amax() if name == "amax" else r.amin()).reshape(1)
    if prim.group_size(x.group) > 1:
        v = v.contiguous().clone()
        dist.all_reduce(v, op=_GLOBAL[name], group=x.group)
    v = v[0]
    return v.to(torch.bool) if name in ("any", "all") else v


def handlers() -> list[Handler]:
    """This family's handlers, in match order."""
    return [
        Handler(
            "per_system_reduce", _reduce_pred, _run_reduce, "scatter over atoms into a per-system buffer"
        ),
        Handler(
            "plain_rows_reduce",
            _rows_reduce_pred,
            _run_rows_reduce,
            "scatter a plain per-row source with a per-atom index into a per-system buffer",
        ),
        Handler(
            "global_reduce", lambda f, a, k: _global_args(f, a, k) is not None, _run_global, "sum/any/..."
        ),
    ]
