"""Blocks of one atom and of none: the aten lowerings that depend on a block's row count.

A model's code is the same on every rank, but aten lowers some composite ops by the sizes it
sees, and a rank whose block holds one atom row (graph storage with fewer than two atoms per
rank, a halo block of an isolated atom) or none (more ranks than atoms, an empty domain of an
open cluster) sees sizes the others do not:

- ``tensordot(x [1, k], w [k, 1])`` (e3nn's compiled ``Linear`` to one output channel, as MACE's
  readouts) is lowered to ``dot(x.view(k), w.view(k))`` instead of ``mm``: the one atom's row is
  viewed as a vector (a per-atom ShardTensor of ``row_block = k``: one atom, ``k`` rows) and the
  dot looks like a contraction over atoms. On a block of one atom it contracts that atom's own
  elements only: :func:`one_atom_contraction` computes it on the local rows and returns an
  :class:`AtomScalar`, the 0-d value of the block's one atom, which becomes a per-atom
  ShardTensor again when it is viewed back to a shape with one leading row (tensordot's last
  step). The halo state is the atom operand's, as ``mm`` on more rows would give.
- ``x.view(0, -1)`` (mace's symmetric contraction, ``out.view(out.shape[0], -1)``) of a block
  without rows is ambiguous to aten (any size fits no elements); every other rank infers the
  size per row, so :func:`resolve_empty_view` gives the empty block the same shape.

No communication happens here: the result is what the op computes on more rows, restricted to
this block's rows. Anything else on an :class:`AtomScalar` raises ``UnhandledAtomOp``.

:func:`lost_message` and :func:`resurface` deal with a third effect of TorchScript: a Python
exception raised by the dispatch inside TorchScript code (e3nn's compiled modules) reaches the
caller as a ``RuntimeError`` whose message is empty (the interpreter drops the Python text). The
dispatch records the exception it raised (:func:`record`); ``ShardTensor.__torch_function__``,
through which every call of a scripted module with ShardTensor arguments passes, re-raises the
recorded exception (its own type, message and traceback) chained from the TorchScript error, which
shows where in the scripted code it happened.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from twinshard.runtime.world import no_message
from twinshard.shard.placements import ShardSpec
from twinshard.shard.shard_tensor import ShardTensor, UnhandledAtomOp, in_backward, leaves

__all__ = [
    "AtomScalar",
    "in_dot_backward",
    "lost_message",
    "one_atom_contraction",
    "record",
    "resolve_empty_view",
    "resurface",
]

aten = torch.ops.aten

# aten ops that contract a 1-D operand entirely: on a one-atom block, that atom's own elements
ONE_ATOM_CONTRACTIONS = frozenset({aten.dot.default, aten.vdot.default})
# views that take a shape with one inferred (-1) size
SHAPED_VIEWS = frozenset({aten.view.default, aten._unsafe_view.default})

_VIEW_BACK = {"view", "_unsafe_view", "reshape", "_reshape_alias", "unsqueeze", "expand", "alias"}
_KEEP_SCALAR = {"clone", "detach", "alias", "_to_copy", "lift_fresh"}


# ---------------------------------------------------------------------- one atom
def _one_atom(t: Any) -> bool:
    """A per-atom ShardTensor whose local block holds exactly one atom (all its rows)."""
    return (
        isinstance(t, ShardTensor)
        and t._spec.per_atom
        and t.dim() == 1
        and int(t.shape[0]) == t._spec.row_block
    )


def one_atom_contraction(func: Any, args: tuple, kwargs: dict) -> AtomScalar | None:
    """``dot`` / ``vdot`` of a one-atom per-atom vector with a plain one (see the module
    docstring): the block's one value as an :class:`AtomScalar`; None for any other call."""
    if func not in ONE_ATOM_CONTRACTIONS or kwargs or len(args) != 2:
        return None
    a, b = args
    atoms = [t for t in (a, b) if isinstance(t, ShardTensor)]
    if len(atoms) != 1 or not _one_atom(atoms[0]):
        return None
    x = atoms[0]
    la = x._local if a is x else a
    lb = x._local if b is x else b
    out = func(la, lb)
    return AtomScalar(out, x._spec.with_row_block(1))


def in_dot_backward() -> bool:
    """Is autograd running the backward of a ``dot`` / ``vdot``? On a ShardTensor that is a
    one-atom contraction (every other one raises in forward), and its gradient of the plain
    operand, ``grad * x``, is the sum over the block's one atom: a plain tensor, as ``mm``'s
    backward gives on more rows (not a per-atom ShardTensor)."""
    node = torch._C._current_autograd_node()
    return node is not None and node.name() in _DOT_BACKWARDS


_DOT_BACKWARDS = frozenset({"DotBackward0", "VdotBackward0"})


class AtomScalar(torch.Tensor):
    """The 0-d value of a block that holds one atom (from :func:`one_atom_contraction`): the local
    0-d tensor and the ShardSpec of the block. A view to a shape with one leading row gives back a
    per-atom ShardTensor (one row per atom); clones, detaches, dtype casts and pointwise ops with
    plain scalars keep the AtomScalar; any other op raises ``UnhandledAtomOp``."""

    _local: torch.Tensor
    _spec: ShardSpec

    @staticmethod
    def __new__(cls, local: torch.Tensor, spec: ShardSpec) -> AtomScalar:
        if local.dim() != 0:
            raise ValueError(f"an AtomScalar is 0-d, got {tuple(local.shape)}")
        r = torch.Tensor._make_wrapper_subclass(
            cls, (), dtype=local.dtype, layout=local.layout, device=local.device, requires_grad=False
        )
        r._local = local
        r._spec = spec
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:  # no aten ops
        return f"AtomScalar({self._spec!r}, local={self._local!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        try:
            return _scalar_dispatch(func, args, kwargs or {})
        except Exception as exc:
            record(exc)  # inside TorchScript its message would be lost
            raise


def _scalar_dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """``AtomScalar.__torch_dispatch__`` (see the class docstring)."""
    flat = leaves((args, kwargs))
    mine = [t for t in flat if isinstance(t, AtomScalar)]
    spec = mine[0]._spec
    others = [t for t in flat if isinstance(t, ShardTensor)]
    largs, lkwargs = _unwrap((args, kwargs))
    out = func(*largs, **lkwargs)
    if in_backward():  # autograd's own ops: their communication is in the handlers' adjoints
        return _rewrap_scalar(out, spec)
    name = func._schema.name.split("::")[-1]
    if not others:
        if name in _VIEW_BACK and isinstance(out, torch.Tensor) and out.dim() >= 1:
            if int(out.shape[0]) == 1 and out.numel() == 1:
                return ShardTensor(out, spec)
        elif isinstance(out, torch.Tensor) and out.dim() == 0:
            pointwise = torch.Tag.pointwise in func.tags
            if name in _KEEP_SCALAR or pointwise:
                return AtomScalar(out, spec)
    raise UnhandledAtomOp(
        f"{func} on the value of a one-atom block (the 0-d result of a contraction over that "
        "atom's row, as aten lowers tensordot on one row): only a view back to one leading row, "
        "clones, casts and pointwise ops with plain scalars are handled; call .to_local() and "
        "do the communication explicitly"
    )


def _rewrap_scalar(out: Any, spec: ShardSpec) -> Any:
    if isinstance(out, torch.Tensor) and out.dim() == 0 and not isinstance(out, (ShardTensor, AtomScalar)):
        return AtomScalar(out, spec)
    return out


def _unwrap(tree: Any) -> Any:
    if isinstance(tree, AtomScalar):
        return tree._local
    kind = type(tree)
    if kind is list or kind is tuple:
        return kind(_unwrap(t) for t in tree)
    if kind is dict:
        return {k: _unwrap(v) for k, v in tree.items()}
    return tree


# ---------------------------------------------------------------------- no atoms
def resolve_empty_view(x: Any, shape: Any) -> list[int] | None:
    """The shape a rank with rows would infer for ``x.view(shape)`` when ``x`` is a per-atom
    ShardTensor without rows (so aten finds ``-1`` ambiguous): ``shape`` keeps the row dim first
    (``0``) and one ``-1`` among the others, resolved from ``x``'s size per row. None otherwise
    (not ambiguous, or not a row-keeping view)."""
    if not (isinstance(x, ShardTensor) and x._spec.per_atom and x.dim() >= 1 and int(x.shape[0]) == 0):
        return None
    try:
        dims = [int(s) for s in shape]
    except TypeError:
        return None
    if len(dims) < 2 or dims[0] != 0 or dims[1:].count(-1) != 1 or 0 in dims[1:]:
        return None
    per_row = 1
    for s in x.shape[1:]:
        per_row *= int(s)
    known = 1
    for s in dims[1:]:
        if s != -1:
            known *= s
    if per_row == 0 or known <= 0 or per_row % known:
        return None
    return [per_row // known if s == -1 else s for s in dims]


# ---------------------------------------------------------------------- lost messages
_tls = threading.local()


def record(exc: BaseException) -> None:
    """Remember the exception the dispatch raised (TorchScript may drop its message)."""
    _tls.raised = exc


def lost_message(exc: BaseException) -> bool:
    """Has ``exc`` no message of its own (:func:`twinshard.runtime.world.no_message`)?"""
    return no_message(exc)


def resurface(exc: BaseException) -> BaseException | None:
    """The exception the dispatch raised inside the TorchScript call that failed with ``exc``
    (None if none was recorded, or ``exc`` has a message of its own). Clears the record."""
    raised = getattr(_tls, "raised", None)
    _tls.raised = None
    if raised is None or raised is exc or not lost_message(exc):
        return None
    return raised
