"""The shipped handlers of ShardTensor's op dispatch, in match order (the registry and call
parsing: :mod:`twinshard.shard.registry`; the handlers by family: ``halo_handlers``,
``reduce_handlers``, ``sharded_handlers``, :mod:`twinshard.shard.rowwise`).

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

from typing import Any

import torch

from twinshard.shard import halo_handlers, reduce_handlers, rowwise, sharded_handlers
from twinshard.shard.halo_handlers import fresh, lazy_halo
from twinshard.shard.placements import ShardSpec
from twinshard.shard.reduce_handlers import partial_to_replicate, plain_rows
from twinshard.shard.registry import (
    REGISTRY,
    Handler,
    IndexCall,
    Registry,
    parse_index_call,
    register,
)
from twinshard.shard.shard_tensor import ShardTensor, to_local

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
    """Every shipped handler, in match order (see the module docstring)."""
    grads = Handler("replicated_grads", _grads_pred, _run_grads, "all-reduce gradients of replicated inputs")
    pick, *rowwise_rest = rowwise.rowwise_handlers()
    return [
        pick,
        grads,
        *halo_handlers.handlers(),
        *reduce_handlers.handlers(),
        *sharded_handlers.handlers(),
        *rowwise_rest,
    ]


for _h in _shipped():
    REGISTRY.register(_h, first=False)


def spec_of(x: Any) -> ShardSpec | None:
    return x._spec if isinstance(x, ShardTensor) else None
