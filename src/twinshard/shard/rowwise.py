"""Row-wise handlers: ops that keep the atom dimension as a batch dimension (registered in
:data:`~twinshard.shard.registry.REGISTRY` by :mod:`twinshard.shard.dispatch`, in its order).

Equivariant models contract features per atom with ``einsum`` / ``tensordot`` (MACE's symmetric
contraction, e3nn's tensor products) and pick one column per row with ``x[arange(n), col]``
(MACE's per-head energies). On local rows these are exact: row ``i`` of the result depends on
row ``i`` of the per-atom inputs only. But aten lowers them to ``permute`` / ``reshape`` /
``bmm`` sequences that merge or move the atom dimension, which the dispatch refuses (it cannot
tell a batch dimension from a contracted one at that level). These handlers recognise the
row-wise form at the ``torch`` level, run the op on the local rows and re-wrap the result with
the inputs' placement; anything else takes the default path (and raises there if unsafe).

``rowwise_einsum``
    ``torch.einsum(eq, *operands)`` where every per-atom ShardTensor operand's subscripts start
    with the same letter ``a``, the output's subscripts start with ``a``, and a plain operand
    holds ``a`` only as its first subscript with the same number of rows (a plain per-row input:
    the result's halo becomes STALE) or not at all (a replicated table).
``rowwise_tensordot``
    ``torch.tensordot(x, w, dims)`` with ``x`` a per-atom ShardTensor whose dim 0 is not
    contracted and ``w`` plain (a replicated table): the result keeps ``x``'s rows first.
``rowwise_pick``
    ``x[arange(n), idx, ...]`` with ``n`` the local row count of a per-atom ShardTensor ``x``:
    row ``i`` of the result is drawn from row ``i`` of ``x``.
``stack_then_sum``
    ``torch.stack(ts, dim=0)`` of per-atom ShardTensors with the same spec (placement, plan,
    group, systems; halo state FRESH or STALE) and shape, as MACE's ``ScaleShiftMACE`` does with
    its per-layer node energies (``torch.sum(torch.stack(node_es_list, dim=0), dim=0)``): the atom
    dimension moves to dim 1, which no ShardSpec describes, so the result is a
    :class:`StackedRows` (the stacked local rows ``[k, n, ...]`` with the spec) whose only op is
    the reduction over the new leading dim, ``sum(dim=0)``, giving back a per-atom ShardTensor;
    every other op on it raises ``UnhandledAtomOp``. Plain operands of the same shape and dtype
    are plain per-row tensors (the local rows of a per-atom quantity, as mace's ZBL pair energy
    ``V_ZBL [n_local]``; read with :func:`~twinshard.shard.dispatch.plain_rows`: STALE), as long
    as one operand is a per-atom ShardTensor; the result is then STALE. Every other stack / cat
    along the atom dimension still raises.

Halo state of the result: FRESH iff every per-atom input is FRESH and no plain input has the
atom rows. No communication: the backward is the local op's backward on the local rows, which
is the exact adjoint (row-wise ops commute with the halo exchanges).
"""

from __future__ import annotations

from typing import Any

import torch

from twinshard.shard.placements import HaloState, ShardSpec
from twinshard.shard.reduce_handlers import plain_rows
from twinshard.shard.registry import Handler
from twinshard.shard.shard_tensor import ShardTensor, UnhandledAtomOp, from_local, to_local

__all__ = ["StackedRows", "rowwise_handlers"]


def _per_atom(t: Any) -> bool:
    return isinstance(t, ShardTensor) and t._spec.per_atom


def _same_layout(sts: list[ShardTensor]) -> bool:
    ref = sts[0]
    for t in sts[1:]:
        if t.shape[0] != ref.shape[0] or type(t.placement) is not type(ref.placement):
            return False
        if ref._spec.halo and t._spec.plan is not ref._spec.plan:
            return False
        if not ref._spec.halo and t.placement != ref.placement:
            return False
    return True


def _spec_of(sts: list[ShardTensor], plain_rows: bool) -> ShardSpec:
    fresh = not plain_rows and all(t.state == HaloState.FRESH for t in sts)
    return sts[0]._spec.with_state(HaloState.FRESH if fresh else HaloState.STALE)


# ---------------------------------------------------------------------- einsum
def _einsum_parts(args: tuple, kwargs: dict) -> tuple[str, list[Any]] | None:
    if not args or not isinstance(args[0], str):
        return None
    ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    return args[0].replace(" ", ""), ops


def _einsum_plan(func: Any, args: tuple, kwargs: dict) -> tuple[str, list[Any], bool] | None:
    """(equation, operands, plain per-row input?) if this einsum is row-wise over the atoms."""
    if func is not torch.einsum and getattr(func, "__name__", "") != "einsum":
        return None
    parts = _einsum_parts(args, kwargs)
    if parts is None or kwargs:
        return None
    eq, ops = parts
    if "->" not in eq:
        return None
    lhs, out = eq.split("->")
    subs = lhs.split(",")
    if len(subs) != len(ops):
        return None
    sts = [o for o in ops if _per_atom(o)]
    if not sts or not _same_layout(sts):
        return None
    letters = {s[0] for s, o in zip(subs, ops) if _per_atom(o) and s}
    if len(letters) != 1:
        return None
    a = letters.pop()
    if not a.isalpha() or not out.startswith(a) or out.count(a) != 1:
        return None
    n = sts[0].shape[0]
    plain_rows = False
    for s, o in zip(subs, ops):
        if s.count(a) > 1:
            return None
        if _per_atom(o):
            continue
        if isinstance(o, ShardTensor):  # a per-system ShardTensor holding the atom letter
            if a in s:
                return None
            continue
        if a in s:
            if s[0] != a or not isinstance(o, torch.Tensor) or o.dim() == 0 or o.shape[0] != n:
                return None
            plain_rows = True
    return eq, ops, plain_rows


def _run_einsum(func: Any, args: tuple, kwargs: dict) -> Any:
    eq, ops, plain_rows = _einsum_plan(func, args, kwargs)  # type: ignore[misc]
    sts = [o for o in ops if _per_atom(o)]
    with torch._C.DisableTorchFunctionSubclass():
        out = torch.einsum(eq, *[to_local(o) for o in ops])
    return from_local(out, _spec_of(sts, plain_rows))


# ---------------------------------------------------------------------- tensordot
def _tensordot_dims(a: torch.Tensor, b: torch.Tensor, dims: Any) -> tuple[list[int], list[int]] | None:
    if isinstance(dims, int):
        return list(range(a.dim() - dims, a.dim())), list(range(dims))
    if isinstance(dims, torch.Tensor):
        dims = dims.tolist()
    if isinstance(dims, (list, tuple)) and len(dims) == 2:
        da, db = dims
        da = [da] if isinstance(da, int) else list(da)
        db = [db] if isinstance(db, int) else list(db)
        return [int(d) % a.dim() for d in da], [int(d) % max(b.dim(), 1) for d in db]
    return None


def _tensordot_pred(func: Any, args: tuple, kwargs: dict) -> bool:
    if func is not torch.tensordot and getattr(func, "__name__", "") != "tensordot":
        return False
    if len(args) < 2 or not _per_atom(args[0]) or isinstance(args[1], ShardTensor):
        return False
    if kwargs.get("out") is not None:
        return False
    dims = kwargs.get("dims", args[2] if len(args) > 2 else 2)
    dd = _tensordot_dims(args[0], args[1], dims)
    return dd is not None and 0 not in dd[0]


def _run_tensordot(func: Any, args: tuple, kwargs: dict) -> Any:
    x, w = args[0], args[1]
    dims = kwargs.get("dims", args[2] if len(args) > 2 else 2)
    da, db = _tensordot_dims(x, w, dims)  # type: ignore[misc]
    with torch._C.DisableTorchFunctionSubclass():
        out = torch.tensordot(to_local(x), w, dims=(da, db))
    return from_local(out, _spec_of([x], False))


# ---------------------------------------------------------------------- x[arange(n), idx]
def _pick_key(func: Any, args: tuple) -> tuple | None:
    if getattr(func, "__name__", "") != "__getitem__" or len(args) < 2 or not _per_atom(args[0]):
        return None
    key = args[1]
    if not isinstance(key, tuple) or len(key) < 2:
        return None
    first = key[0]
    if isinstance(first, ShardTensor) or not isinstance(first, torch.Tensor) or first.dim() != 1:
        return None
    n = args[0].shape[0]
    if first.dtype not in (torch.int64, torch.int32) or first.numel() != n:
        return None
    if not torch.equal(first, torch.arange(n, dtype=first.dtype, device=first.device)):
        return None
    if not any(isinstance(k, torch.Tensor) for k in key[1:]):
        return None  # x[arange, 0]: an ordinary slice-like gather, rows kept by the default path
    for k in key[1:]:
        if _per_atom(k) and not _same_layout([args[0], k]):
            return None
        if isinstance(k, torch.Tensor) and not _per_atom(k) and k.dim() > 0 and k.shape[0] not in (1, n):
            return None
    return key


def _run_pick(func: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    key = _pick_key(func, args)
    assert key is not None
    local_key = tuple(k._local if isinstance(k, ShardTensor) else k for k in key)
    out = to_local(x)[local_key]
    sts = [x] + [k for k in key[1:] if _per_atom(k)]
    plain_rows = any(
        isinstance(k, torch.Tensor) and not _per_atom(k) and k.dim() > 0 and k.shape[0] > 1 for k in key[1:]
    )
    return from_local(out, _spec_of(sts, plain_rows))


# ---------------------------------------------------------------------- sum(stack(ts, 0), 0)
class StackedRows(torch.Tensor):
    """``torch.stack`` of per-atom ShardTensors along a new leading dim: the local ``[k, n, ...]``
    (a plain-tensor subclass attached to the autograd graph) and the ShardSpec of its dim 1. Only
    ``sum(dim=0)`` (over the new dim) is defined: it returns a per-atom ShardTensor; any other op
    raises ``UnhandledAtomOp`` (the atom rows sit at dim 1, which the dispatch does not track)."""

    _spec: ShardSpec

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "sum" and _sum_leading(args, kwargs):
            x: StackedRows = args[0]
            with torch._C.DisableTorchFunctionSubclass():
                out = x.as_subclass(torch.Tensor).sum(0)
            return from_local(out, x._spec)
        if name in _STACKED_BENIGN:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise UnhandledAtomOp(
            f"{name or func} on a stack of per-atom ShardTensors (atom rows at dim 1): only "
            "sum(dim=0) over the stacked dim is handled (stack_then_sum); call .to_local() on the "
            "inputs and do the communication explicitly"
        )

    def __repr__(self) -> str:
        with torch._C.DisableTorchFunctionSubclass():
            return f"StackedRows({self._spec!r}, local={self.as_subclass(torch.Tensor)!r})"


# attribute reads and metadata only (no values over the atom rows)
_STACKED_BENIGN = {"__get__", "size", "dim", "numel", "__len__", "__format__", "requires_grad_"}


def _sum_leading(args: tuple, kwargs: dict) -> bool:
    if not args or not isinstance(args[0], StackedRows) or set(kwargs) - {"dim", "keepdim"}:
        return False
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return isinstance(dim, int) and dim % args[0].dim() == 0 and not keepdim and len(args) <= 3


def _stack_parts(func: Any, args: tuple, kwargs: dict) -> tuple[list[Any], ShardTensor] | None:
    """(the operands, the first per-atom one) of a ``stack_then_sum`` stack: per-atom
    ShardTensors of one spec and shape, and plain per-row tensors of that shape and dtype."""
    if func is not torch.stack or not args or not isinstance(args[0], (list, tuple)) or not args[0]:
        return None
    if set(kwargs) - {"dim"} or len(args) > 2:
        return None
    ts = list(args[0])
    sts = [t for t in ts if _per_atom(t)]
    if not sts:
        return None
    ref = sts[0]
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    if not isinstance(dim, int) or dim % (ref.dim() + 1) != 0:
        return None
    for t in ts:
        if not isinstance(t, torch.Tensor) or t.shape != ref.shape or t.dtype != ref.dtype:
            return None
        if not isinstance(t, ShardTensor):  # a plain per-row tensor: its dim 0 lines up with ref's
            continue
        if not _per_atom(t) or t._spec.row_block != 1:
            return None
        if t._spec.state == HaloState.PARTIAL or t._spec.n_systems != ref._spec.n_systems:
            return None
        if t._spec.group is not ref._spec.group:
            return None
    return (ts, ref) if _same_layout(sts) else None


def _run_stack(func: Any, args: tuple, kwargs: dict) -> Any:
    parts = _stack_parts(func, args, kwargs)
    assert parts is not None
    ts, ref = parts
    ts = [t if isinstance(t, ShardTensor) else plain_rows(t, ref) for t in ts]  # STALE rows
    with torch._C.DisableTorchFunctionSubclass():
        local = torch.stack([to_local(t) for t in ts], dim=0)
    out = local.as_subclass(StackedRows)
    out._spec = _spec_of(ts, False)
    return out


def rowwise_handlers() -> list[Handler]:
    """This family's handlers: ``rowwise_pick`` (matched first of all), then the others (last)."""
    return [
        Handler("rowwise_pick", lambda f, a, k: _pick_key(f, a) is not None, _run_pick, "x[arange(n), idx]"),
        Handler(
            "rowwise_einsum",
            lambda f, a, k: _einsum_plan(f, a, k) is not None,
            _run_einsum,
            "row-wise einsum",
        ),
        Handler("rowwise_tensordot", _tensordot_pred, _run_tensordot, "tensordot keeping the rows"),
        Handler(
            "stack_then_sum",
            lambda f, a, k: _stack_parts(f, a, k) is not None,
            _run_stack,
            "stack per-atom tensors along a new dim 0, then sum over it",
        ),
    ]


# x[arange(n), idx] must be seen before halo_refresh (which would treat it as a gather)
