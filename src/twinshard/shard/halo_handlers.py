"""Handlers of halo-padded ShardTensors: ``halo_refresh`` (a gather refreshes a STALE table) and
``halo_correction`` (a scatter sends the halo rows' partial sums to their owners); see
:mod:`twinshard.shard.dispatch`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from twinshard.comm import primitives as prim
from twinshard.shard.placements import HaloPadded, HaloState
from twinshard.shard.registry import (
    Handler,
    index_predicate,
    local_gather,
    local_scatter,
    parse_index_call,
    plain_index,
    wrap_like_index,
)
from twinshard.shard.shard_tensor import ShardTensor, from_local, to_local

__all__ = ["fresh", "lazy_halo"]


# ---------------------------------------------------------------------- halo refresh / correction
def fresh(x: ShardTensor) -> ShardTensor:
    """``x`` with fresh halo rows (differentiable): a STALE tensor's halo is overwritten by its
    owners' rows (forward exchange), a PARTIAL one's halo partial sums go to the owners first."""
    if x.state == HaloState.FRESH:
        return x
    # the kept refresh is stale once x is written in place, through the wrapper (x._version) or
    # its local rows (to_local(x)[:n] += ...: _local._version), and has no graph if it was built
    # under no_grad (a gather with grad then would silently drop x's gradient)
    version = (x._version, x._local._version)
    linked = torch.is_grad_enabled() and x.requires_grad
    cached = getattr(x, "_fresh_cache", None)
    if cached is not None and cached[0] == version and (cached[1].requires_grad or not linked):
        return cached[1]
    plan = x.plan
    local = to_local(x)
    n = plan.n_owned
    own = local[:n]
    if x.state == HaloState.PARTIAL:
        own = own + plan.reverse(local[n:])
    out = from_local(torch.cat([own, plan.forward(own)]), x._spec.with_state(HaloState.FRESH))
    x._fresh_cache = (version, out)
    return out


def _run_refresh(func: Any, args: tuple, kwargs: dict) -> Any:
    c = parse_index_call(func, args, kwargs)
    assert c is not None
    x = fresh(c.target)
    return wrap_like_index(local_gather(c, to_local(x), plain_index(c.index)), c.index)


_LAZY = [0]  # depth of lazy_halo() blocks (ranks are single-threaded; backward runs no handler)


@contextlib.contextmanager
def lazy_halo() -> Iterator[None]:
    """Inside the block, ``halo_correction`` returns a STALE result without the forward exchange
    (and without the reverse one when no rank scatters into a halo row); see the module docstring.
    Outside, the result is FRESH (halo rows hold their owners' totals) for callers that read them."""
    _LAZY[0] += 1
    try:
        yield
    finally:
        _LAZY[0] -= 1


def _hits_halo(index: torch.Tensor, n_owned: int, group: Any) -> bool:
    """Collective (one all-reduce of a flag): does any rank's scatter index hit a halo row?"""
    local = index.numel() > 0 and bool(index.max() >= n_owned)
    flag = torch.tensor([float(local)], dtype=torch.float64, device=index.device)
    return bool(prim.all_reduce(flag, group, op="halo_correction_vote")[0] > 0)


def _run_correction(func: Any, args: tuple, kwargs: dict) -> Any:
    c = parse_index_call(func, args, kwargs)
    assert c is not None
    base: ShardTensor = c.target
    plan = base.plan
    local = to_local(base)
    index = plain_index(c.index)
    contrib = local_scatter(c, torch.zeros_like(local), index, to_local(c.source))
    n = plan.n_owned
    if base.state == HaloState.PARTIAL:  # partial sums stay partial: the local scatter is exact
        if c.inplace:
            return base.add_(from_local(contrib, base._spec))
        return from_local(local + contrib, base._spec)
    if _LAZY[0]:
        if _hits_halo(index, n, base.group):
            own = contrib[:n] + plan.reverse(contrib[n:])
            # zero halo rows, not linked to the sources: a STALE halo must not carry gradients
            contrib = torch.cat([own, own.new_zeros((local.shape[0] - n,) + tuple(own.shape[1:]))])
        full = from_local(contrib, base._spec.with_state(HaloState.STALE))
    else:
        own = contrib[:n] + plan.reverse(contrib[n:])  # halo partial sums onto their owners
        full = from_local(torch.cat([own, plan.forward(own)]), base._spec.with_state(HaloState.FRESH))
    if c.inplace:
        return base.add_(full)
    return base + full


def handlers() -> list[Handler]:
    """This family's handlers, in match order."""
    return [
        Handler("halo_refresh", index_predicate("gather", HaloPadded), _run_refresh, "refresh a stale halo"),
        Handler(
            "halo_correction", index_predicate("scatter", HaloPadded), _run_correction, "correct halo sums"
        ),
    ]
