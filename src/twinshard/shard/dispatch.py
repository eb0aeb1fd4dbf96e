"""The op-dispatch registry of ShardTensor and the shipped handlers.

``ShardTensor.__torch_function__`` asks :data:`REGISTRY` for the first handler
whose predicate matches a call; it runs instead of the op, else the default
path runs (and raises for an unhandled op over the atom dimension, see
:mod:`twinshard.shard.shard_tensor`). Users register their own with
:func:`register` (first by default); :meth:`Registry.disabled` switches handlers
off inside a ``with`` block (negative controls).

Shipped handlers, in match order (each is built from differentiable pieces —
``to_local``/``from_local``, the halo plan's forward/reverse exchanges, the comm
all_to_all — so its backward is the exact adjoint, tested with ``adjoint_pair``):

``halo_refresh``
    a gather along dim 0 (``index_select``, ``x[idx]``, ``gather``) from a
    halo-padded ShardTensor: a STALE one is refreshed first (forward exchange of
    the owned rows into the halo; backward: halo gradients summed onto their
    owners), a PARTIAL one is corrected first; then the local gather. The
    refreshed tensor is cached on the stale one until it (or its local rows) is modified in
    place.
``halo_correction``
    ``index_add(_)`` / ``scatter_add(_)`` along dim 0 into a halo-padded
    ShardTensor: the contributions are scattered locally, the halo rows' partial
    sums go to their owners (reverse exchange) and the owners' totals come back
    into the halo (forward exchange), so the result keeps the target's state (a PARTIAL
    target stays PARTIAL: the contributions are added to its local rows, no exchange).
    Inside :func:`lazy_halo` (``DistributedPotential(mode="dispatch")`` runs models
    there) the forward exchange is left to the next gather: the result is STALE
    (owned rows complete, halo rows zero), and when no rank's index hits a halo row
    (agreed by one all-reduce of a flag; a block's edges have owned receivers) the
    reverse exchange is skipped too, as a refresh hook would: exact, since a STALE
    halo is refreshed before any gather and dropped by every reduction.
``per_system_reduce``
    ``index_add(_)`` / ``scatter_add(_)`` from a per-atom ShardTensor source into
    a buffer that is not per-atom (``(n_systems, F)``, plain or PerSystem): halo
    rows are dropped (each atom counts once), the scatter runs locally, then one
    all-reduce (Partial -> Replicate; backward: the identity, a replicated
    gradient counted once).
``plain_rows_reduce``
    ``index_add(_)`` / ``scatter_add(_)`` along dim 0 with a per-atom ShardTensor index (a
    system index, ``batch``) into a buffer that is not per-atom, from a *plain per-row* source
    (below), as mace's ZBL pair energy is summed per system: the source is read as the index's
    rows (:func:`plain_rows`), then as ``per_system_reduce`` (owned rows only, one all-reduce).
    A rank whose source's dim 0 is not its index's raises on every rank: the check rides on the
    same all-reduce (one extra element), so no rank is left waiting.
``global_reduce``
    ``sum`` (all dims, or dim 0), ``any``, ``all``, ``amax``, ``amin`` (all dims)
    of a per-atom ShardTensor: halo rows dropped, reduced locally, all-reduced
    (sum: differentiable as above; the others are not).
``sharded_gather`` / ``sharded_scatter``
    storage without halo (``Owned(counts)``: indices are global row ids):
    ``index_select``/``x[idx]`` fetches rows other ranks own with an uneven
    all-to-all (ids out, rows back; backward: the reverse all-to-all and a local
    index_add); ``index_add(_)``/``scatter_add(_)`` ships contributions to the
    owners' rows. ``PAD`` (-1) ids gather zero rows and scatter nothing; ids out of range
    raise on every rank (flagged in the counts all-to-all). A placement with ``to_global(ids,
    rank)`` addresses rows relative to the rank (the graph storage's ``OwnedFirst``). The
    routing (the counts and ids all-to-alls, the ``unique`` and sort) is kept per call and
    reused while every rank's index is the same tensor, unwritten (one all-gather of the ranks'
    index keys per call decides, the same on every rank): a model gathering with its edge index
    at every layer routes once.
``replicated_grads``
    ``torch.autograd.grad`` with ShardTensor inputs beside plain ones (a strain
    or displacement every rank applies, as MACE's stress): the plain inputs are
    replicated, so their gradients are per-rank partial sums and are all-reduced.

No index handler takes an ``out=`` buffer: such a call takes the default path, which raises
over the atom dimension (``UnhandledAtomOp``, on every rank).

Plain per-row tensors. A model may allocate a plain tensor from a per-atom *count* and fill it
from plain per-edge values (mace's ZBL: ``scatter_sum(v_edges, receiver, dim=0,
dim_size=node_attrs.size(0))`` into a fresh ``torch.zeros``): no handler sees that, and the
result is a plain tensor with the block's local row count, the local rows of a per-atom quantity.
Its semantics (:func:`plain_rows`): in halo storage its **owned rows are the values and its halo
rows are unknown**, exactly a STALE halo-padded tensor (a scatter of a block's edges onto their
receivers, which are owned, leaves the halo rows zero); without halo its rows are the owned rows.
Being STALE, its halo rows are never read: a gather refreshes them from their owners, a reduction
drops them. (A plain buffer holding partial sums in its halo rows, a scatter onto *sender* rows,
is outside this reading: it needs the reverse exchange, which only a ShardTensor target gets, from
``halo_correction``.)

Which plain tensor is per-row: only an operand of an op that also has a per-atom ShardTensor
operand and whose own semantics pair the plain tensor's dim 0 with that operand's atom rows,
element by element, with dim 0 equal to the local row count exactly: the source of a scatter
whose index is per-atom (``plain_rows_reduce``: source row ``i`` goes where index row ``i`` says);
an operand of ``torch.stack`` beside per-atom ShardTensors of the same shape and dtype
(``stack_then_sum`` in :mod:`~twinshard.shard.rowwise`; a stack or ``cat`` along another dim
takes the default path); a pointwise operand with the same row count, an einsum operand holding
the atom letter first (results STALE, which is always safe: at worst one refresh too many). A
plain tensor anywhere else (a gather's or scatter's index, a table, the right side of a matmul, a
scatter source whose index is plain) is never read as per-row. So a per-edge tensor that happens
to have as many rows as the block (``n_edges == n_rows``) meets atom rows only where the op
itself pairs them row by row, as the serial model (``N`` atoms, its own edge count) would, or fail.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from twinshard.comm import primitives as prim
from twinshard.runtime.world import on_shutdown
from twinshard.shard.placements import PAD, HaloPadded, HaloState, Owned, ShardSpec
from twinshard.shard.shard_tensor import ShardTensor, _leaves, from_local, to_local

__all__ = [
    "REGISTRY",
    "Handler",
    "IndexCall",
    "Registry",
    "fresh",
    "lazy_halo",
    "parse_index_call",
    "partial_to_replicate",
    "plain_rows",
    "register",
]


@dataclass
class Handler:
    """A named ``predicate(func, args, kwargs) -> bool`` and the ``run(func, args, kwargs)`` that
    replaces the op when it matches."""

    name: str
    predicate: Callable[[Any, tuple, dict], bool]
    run: Callable[[Any, tuple, dict], Any]
    doc: str = ""


class Registry:
    """Ordered handlers; the first enabled one whose predicate matches runs."""

    def __init__(self) -> None:
        self._handlers: list[Handler] = []
        self._off: set[str] = set()

    def register(self, handler: Handler, first: bool = True) -> Handler:
        self.unregister(handler.name)
        if first:
            self._handlers.insert(0, handler)
        else:
            self._handlers.append(handler)
        return handler

    def unregister(self, name: str) -> Handler | None:
        for i, h in enumerate(self._handlers):
            if h.name == name:
                return self._handlers.pop(i)
        return None

    def names(self) -> list[str]:
        return [h.name for h in self._handlers]

    def match(self, func: Any, args: tuple, kwargs: dict) -> Handler | None:
        # rows that are not atoms (a row-wise view [n * a, b], ShardSpec.row_block > 1): no handler
        # applies; the default path raises for an op over the atom dimension
        for a in _leaves((args, kwargs)):
            if isinstance(a, ShardTensor) and a._spec.row_block != 1:
                return None
        for h in self._handlers:
            if h.name not in self._off and h.predicate(func, args, kwargs):
                return h
        return None

    @contextlib.contextmanager
    def disabled(self, *names: str) -> Iterator[None]:
        """Switch handlers off inside the block (unknown names raise)."""
        unknown = set(names) - set(self.names())
        if unknown:
            raise KeyError(f"no handlers named {sorted(unknown)}; registered: {self.names()}")
        before = set(self._off)
        self._off |= set(names)
        try:
            yield
        finally:
            self._off = before

    @contextlib.contextmanager
    def installed(self, handler: Handler, first: bool = True) -> Iterator[Handler]:
        """``handler`` inside the block only: it takes the place of a handler of the same name (which
        comes back afterwards), else goes first (or last)."""
        prev_index = self.names().index(handler.name) if handler.name in self.names() else None
        prev = self.unregister(handler.name)
        if prev_index is not None:  # takes the place of the handler it replaces
            self._handlers.insert(prev_index, handler)
        else:
            self.register(handler, first)
        try:
            yield handler
        finally:
            self.unregister(handler.name)
            if prev is not None:
                self._handlers.insert(prev_index, prev)


REGISTRY = Registry()


def register(
    name: str,
    predicate: Callable[[Any, tuple, dict], bool],
    run: Callable[[Any, tuple, dict], Any],
    first: bool = True,
    doc: str = "",
) -> Handler:
    """Add a handler to :data:`REGISTRY` (before the shipped ones unless ``first=False``)."""
    return REGISTRY.register(Handler(name, predicate, run, doc), first)


# ---------------------------------------------------------------------- parsing index calls
_GATHERS = {"index_select", "__getitem__", "gather"}
_SCATTERS = {"index_add", "index_add_", "scatter_add", "scatter_add_"}


@dataclass
class IndexCall:
    """A gather or scatter along one dim, normalised from its torch-function call."""

    name: str
    target: Any  # the indexed tensor (gather source / scatter destination)
    dim: int
    index: Any
    source: Any = None
    alpha: Any = 1
    rest: tuple = ()  # __getitem__: the key after the first (tensor) index

    @property
    def scatter(self) -> bool:
        return self.name in _SCATTERS

    @property
    def inplace(self) -> bool:
        return self.name.endswith("_") and not self.name.startswith("__")


def parse_index_call(func: Any, args: tuple, kwargs: dict) -> IndexCall | None:
    name = getattr(func, "__name__", "")
    if name not in _GATHERS and name not in _SCATTERS or not args:
        return None
    if kwargs.get("out") is not None:  # no handler writes an out= buffer: the default path raises
        return None
    t = args[0]
    if not isinstance(t, torch.Tensor):
        return None
    if name == "__getitem__":
        key = args[1]
        rest: tuple = ()
        if isinstance(key, tuple) and key and isinstance(key[0], torch.Tensor):
            key, rest = key[0], tuple(key[1:])
        if not isinstance(key, torch.Tensor) or key.dtype not in (torch.int64, torch.int32):
            return None
        return IndexCall(name, t, 0, key, rest=rest)
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    index = kwargs.get("index", args[2] if len(args) > 2 else None)
    if not isinstance(dim, int) or not isinstance(index, torch.Tensor):
        return None
    dim = dim % max(t.dim(), 1)
    if name in _SCATTERS:
        src = kwargs.get("source", kwargs.get("src", args[3] if len(args) > 3 else None))
        return IndexCall(name, t, dim, index, src, kwargs.get("alpha", 1))
    return IndexCall(name, t, dim, index)


def _is(x: Any, placement: type) -> bool:
    return isinstance(x, ShardTensor) and isinstance(x._spec.placement, placement)


def _plain(x: Any) -> Any:
    """The local rows of an index (not differentiable: integer)."""
    return x._local if isinstance(x, ShardTensor) else x


def _index_pred(kind: str, placement: type | None) -> Callable[[Any, tuple, dict], bool]:
    def pred(func: Any, args: tuple, kwargs: dict) -> bool:
        c = parse_index_call(func, args, kwargs)
        if c is None or c.dim != 0 or c.scatter != (kind == "scatter"):
            return False
        return placement is None or _is(c.target, placement)

    return pred


def _local_gather(c: IndexCall, local: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if c.name == "index_select":
        return local.index_select(0, index)
    if c.name == "gather":
        return local.gather(0, index)
    # the whole key on the refreshed rows: tensors after the first index broadcast with it
    # (joint indexing, x[idx, j][k] = x[idx[k], j[k]]), as torch itself would
    return local[(index,) + tuple(_plain(k) for k in c.rest)] if c.rest else local[index]


def _wrap_like_index(out: torch.Tensor, index: Any) -> torch.Tensor:
    """A gather with a per-atom index has the index's rows (``table[numbers]``-like)."""
    if (
        isinstance(index, ShardTensor)
        and index._spec.per_atom
        and out.dim()
        and out.shape[0] == index.shape[0]
    ):
        return from_local(out, index._spec)
    return out


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
    return _wrap_like_index(_local_gather(c, to_local(x), _plain(c.index)), c.index)


def _local_scatter(c: IndexCall, zeros: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    if c.name.startswith("index_add"):
        return zeros.index_add(0, index, src, alpha=c.alpha)
    return zeros.scatter_add(0, index, src)


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
    index = _plain(c.index)
    contrib = _local_scatter(c, torch.zeros_like(local), index, to_local(c.source))
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


def _owned_rows(x: Any) -> Any:
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
    index = _plain(c.index)[:n]
    zeros = torch.zeros(c.target.shape, dtype=src.dtype, device=src.device)
    return _local_scatter(c, zeros, index, _owned_rows(src))


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
    rows = _owned_rows(x)
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


def _sharded_pred(kind: str) -> Callable[[Any, tuple, dict], bool]:
    base = _index_pred(kind, Owned)

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
    gidx = _plain(c.index)
    dev = x._local.device

    def route() -> tuple[torch.Tensor, list[int], list[int], torch.Tensor, bool]:
        flat = gidx.reshape(-1).to(torch.int64)
        valid = flat != PAD
        uniq, inverse = torch.unique(_global_ids(x, flat[valid], me), sorted=True, return_inverse=True)
        _, s, r = _route(uniq, offsets, x, nranks)
        wanted = prim.all_to_all(uniq.to(dev), s, r, x.group, op="sharded_gather")  # ids others need
        pos = torch.full((flat.numel(),), uniq.numel(), dtype=torch.int64, device=dev)
        pos[valid] = inverse
        return wanted - offsets[me], s, r, pos, not bool(valid.all())

    mine, s, r, pos, pad = _routing("gather", gidx, x, route)
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
    given = _plain(c.index)
    src = to_local(c.source)
    dev = x._local.device

    def route() -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
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
        return keep[order], s, r, ids_in - offsets[me]

    picked, s, r, rows_in = _routing("scatter", given, x, route)
    vals = src.index_select(0, picked)
    if c.alpha != 1:
        vals = vals * c.alpha
    vals_in = _RowsAllToAll.apply(vals, s, r, x.group) if nranks > 1 else vals
    local = to_local(x)
    contrib = torch.zeros_like(local).index_add(0, rows_in, vals_in.to(local.dtype))
    full = from_local(contrib, x._spec)
    if c.inplace:
        return x.add_(full)
    return x + full


# ---------------------------------------------------------------------- gradients of replicated inputs
def _grads_pred(func: Any, args: tuple, kwargs: dict) -> bool:
    if func is not torch.autograd.grad:
        return False
    inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    return any(isinstance(t, ShardTensor) for t in inputs) and any(
        not isinstance(t, ShardTensor) for t in inputs
    )


def _run_grads(func: Any, args: tuple, kwargs: dict) -> Any:
    inputs = args[1] if len(args) > 1 else kwargs["inputs"]
    single = isinstance(inputs, torch.Tensor)
    inputs = (inputs,) if single else tuple(inputs)
    group = next(t.group for t in inputs if isinstance(t, ShardTensor))
    with torch._C.DisableTorchFunctionSubclass():
        grads = func(*args, **kwargs)
    out = []
    for t, g in zip(inputs, grads):
        if not isinstance(t, ShardTensor):
            # a plain (replicated) input: each rank holds its atoms' part of the gradient; every
            # rank must take part, so a missing gradient is a zero one
            gg = torch.zeros_like(t) if g is None else g
            # a plain input's gradient is plain: the backward may have wrapped it as per-atom when
            # its row count equals a rank's atom count (one atom per rank, one system)
            g = partial_to_replicate(to_local(gg), group)
        out.append(g)
    return tuple(out)


# ---------------------------------------------------------------------- shipped handlers, in order
def _shipped() -> list[Handler]:
    return [
        Handler("replicated_grads", _grads_pred, _run_grads, "all-reduce gradients of replicated inputs"),
        Handler("halo_refresh", _index_pred("gather", HaloPadded), _run_refresh, "refresh a stale halo"),
        Handler("halo_correction", _index_pred("scatter", HaloPadded), _run_correction, "correct halo sums"),
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
        Handler("sharded_gather", _sharded_pred("gather"), _run_sharded_gather, "fetch rows owned elsewhere"),
        Handler("sharded_scatter", _sharded_pred("scatter"), _run_sharded_scatter, "ship rows to owners"),
    ]


for _h in _shipped():
    REGISTRY.register(_h, first=False)


def spec_of(x: Any) -> ShardSpec | None:
    return x._spec if isinstance(x, ShardTensor) else None


# the row-wise handlers (einsum / tensordot / x[arange(n), idx] keeping the atom rows)
import twinshard.shard.rowwise  # noqa: E402, F401
