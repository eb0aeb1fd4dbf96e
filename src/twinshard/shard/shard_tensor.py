"""``ShardTensor``: this rank's rows of a per-particle tensor, with their placement.

A ``ShardTensor`` is a ``torch.Tensor`` *wrapper subclass* around the local rows
(``to_local()``), carrying a :class:`~twinshard.shard.placements.ShardSpec`:
placement (``Owned`` / ``HaloPadded`` with its halo plan / ``PerSystem``), halo
state (fresh / stale / partial sums), process group and number of systems.
Wrapping is zero-copy (:meth:`ShardTensor.wrap`, :func:`from_local`). A model
written in plain PyTorch runs on it unchanged; two hooks make that safe:

``__torch_function__`` (above autograd) consults the handler registry of
:mod:`twinshard.shard.dispatch`: the first handler whose predicate matches the
call runs instead of the op (halo refresh before a gather along the atom
dimension, halo correction after a scatter into a halo-padded tensor, a
per-system reduce, the sharded-storage gathers and scatters, ...). Handlers are
built from differentiable pieces (:func:`to_local` / :func:`from_local` and the
comm ops with exact adjoints), so their backward is the exact adjoint, double
backward included (``torch.autograd.grad(..., create_graph=True)`` inside a
model's forward, as MACE computes forces). Unmatched calls take the default path.

``__torch_dispatch__`` (below autograd) runs every remaining aten op on the local
rows and decides what comes out:

- **keeps the subclass** (same spec; halo state FRESH only if every per-atom input
  was FRESH, else STALE): ops whose output keeps the atom rows at dim 0 —
  pointwise ops and ``cat``/``stack`` along another dim (a plain input with the same
  number of rows makes the result STALE: its halo rows are not known to be copies),
  ``mm``/``addmm``/``bmm``/``matmul`` with the ShardTensor on the left, reductions and views over the
  other dims, ``index``/``gather`` of a plain table with a per-atom index
  (``embedding[numbers]``: the index's rows), ``clone``/``detach``/``to``, and the
  like-shaped allocators ``zeros_like``, ``ones_like``, ``full_like``, ``empty_like``,
  ``rand_like`` and ``new_zeros``/``new_ones``/``new_full``/``new_empty`` of the same
  number of rows (zeros/ones/full are FRESH, empty/rand STALE); in-place ops return
  the same ShardTensor with its state updated (``zero_``/``fill_``: FRESH).
  ``x[:n_owned]`` of a halo-padded tensor is an ``Owned`` ShardTensor.
- **returns plain tensors**: results without the atom rows at dim 0 (a gather
  with a per-edge index, reductions over systems, other slices of dim 0 — local
  rows — and allocators of another size).
- **raises** (``UnhandledAtomOp``, naming the op): an op that indexes, reduces,
  contracts, transposes or merges the atom dimension of a per-atom ShardTensor
  and matched no handler — a sum over atoms of a halo-padded tensor would count
  halo rows twice, so it is never silently computed on local rows.
  An opaque custom op (a ``torch.library`` kernel outside ``aten``/``prims``) with a
  per-atom ShardTensor argument raises too: it runs distributed only through an adapter
  (:mod:`twinshard.shard.custom_ops`), which hands it local rows.
  Autograd's own backward ops (which run here with ShardTensor gradients) are
  exempt: their communication is in the handlers' adjoints.

Blocks of one atom row or none see lowerings the others do not (``tensordot`` to one
channel becomes ``dot`` of the row; ``view(0, -1)`` is ambiguous): the exact local answer
for them is in :mod:`twinshard.shard.small_blocks`. What ``__torch_dispatch__`` raises is
recorded there too, so that ``__torch_function__`` re-raises it (its type, message, traceback)
when TorchScript, which drops a Python exception's text, hands back an empty ``RuntimeError``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from twinshard.shard.placements import HaloPadded, HaloState, Owned, PerSystem, ShardSpec

__all__ = ["ShardTensor", "UnhandledAtomOp", "from_local", "to_local", "in_backward"]

aten = torch.ops.aten


class UnhandledAtomOp(RuntimeError):
    """An op over the atom dimension of a ShardTensor that no handler matched."""


_tls = threading.local()


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


@contextlib.contextmanager
def _calling(name: str) -> Iterator[None]:
    prev = getattr(_tls, "fn", None)
    _tls.fn = name
    try:
        yield
    finally:
        _tls.fn = prev


def fn_name(func: Any) -> str:
    name = getattr(func, "__name__", repr(func))
    owner = getattr(func, "__qualname__", name)
    if owner.startswith("TensorBase.") or owner.startswith("Tensor."):
        return f"Tensor.{name}"
    mod = getattr(func, "__module__", None) or "torch"
    return f"{mod}.{name}" if mod else name


class ShardTensor(torch.Tensor):
    """This rank's rows of a sharded per-particle (or per-system) tensor; see the module docstring.

    Build with :meth:`wrap` (zero-copy, not differentiable: for inputs) or :func:`from_local`
    (zero-copy, differentiable). ``to_local()`` gives the local rows (differentiable)."""

    _local: torch.Tensor
    _spec: ShardSpec

    @staticmethod
    def __new__(cls, local: torch.Tensor, spec: ShardSpec, requires_grad: bool = False) -> ShardTensor:
        if isinstance(local, ShardTensor):
            raise TypeError("ShardTensor: the local rows must be a plain tensor")
        if spec.per_atom and local.dim() == 0:
            raise ValueError("a per-atom ShardTensor needs a dim 0 (the atoms)")
        if spec.halo:
            n = (spec.placement.n_owned + spec.placement.n_halo) * spec.row_block
            if local.shape[0] != n:
                raise ValueError(
                    f"a halo-padded ShardTensor needs n_owned + n_halo = {n} rows, got {local.shape[0]}"
                )
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            local.shape,
            strides=local.stride(),
            dtype=local.dtype,
            layout=local.layout,
            device=local.device,
            requires_grad=requires_grad,
        )
        r._local = local
        r._spec = spec
        return r

    # ------------------------------------------------------------------ construction
    @classmethod
    def wrap(cls, local: torch.Tensor, spec: ShardSpec) -> ShardTensor:
        """Zero-copy wrapper around ``local`` (a leaf; ``requires_grad`` as ``local``'s, not linked
        to ``local`` by autograd: use :func:`from_local` for that)."""
        return cls(local.detach(), spec, requires_grad=local.requires_grad)

    # ------------------------------------------------------------------ metadata
    @property
    def spec(self) -> ShardSpec:
        return self._spec

    @property
    def placement(self) -> Owned | HaloPadded | PerSystem:
        return self._spec.placement

    @property
    def state(self) -> HaloState:
        return self._spec.state

    @property
    def plan(self) -> Any:
        return self._spec.plan

    @property
    def group(self) -> Any:
        return self._spec.group

    @property
    def n_systems(self) -> int:
        return self._spec.n_systems

    @property
    def n_owned(self) -> int:
        """Owned rows (all rows unless halo-padded)."""
        n = self._spec.n_owned
        return int(self._local.shape[0]) if n is None else n

    def set_state(self, state: HaloState) -> ShardTensor:
        """Declare the halo state (e.g. STALE after writing owned rows through a plain view)."""
        self._spec = self._spec.with_state(state)
        return self

    def to_local(self) -> torch.Tensor:
        """The local rows as a plain tensor (differentiable; backward wraps the gradient)."""
        return to_local(self)

    def __repr__(self) -> str:  # no aten ops: the default repr would dispatch
        return f"ShardTensor({self._spec!r}, local={self._local!r})"

    def __reduce_ex__(self, proto: int) -> Any:
        raise TypeError("a ShardTensor does not travel between processes: send .to_local() instead")

    # ------------------------------------------------------------------ hooks
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        from twinshard.shard.dispatch import REGISTRY

        handler = REGISTRY.match(func, args, kwargs)
        with _calling(fn_name(func)):
            try:
                if handler is not None:
                    return handler.run(func, args, kwargs)
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            except Exception as exc:  # TorchScript drops the text of what the dispatch raised
                raised = _small.resurface(exc)
                if raised is None:
                    raise
                raise raised from exc

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        try:
            return _dispatch(func, args, kwargs or {})
        except Exception as exc:
            _small.record(exc)  # for __torch_function__: inside TorchScript its message is lost
            raise


def _dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """``ShardTensor.__torch_dispatch__``: the op on the local rows, then the output's spec."""
    sts = [a for a in leaves((args, kwargs)) if isinstance(a, ShardTensor)]
    if not in_backward():
        if func in _small.ONE_ATOM_CONTRACTIONS:  # a block of one atom: dot over its own row
            one = _small.one_atom_contraction(func, args, kwargs)
            if one is not None:
                return one
        check_atom_op(func, args, kwargs)
    largs, lkwargs = _map_tensors(_unwrap, (args, kwargs))
    if func in _small.SHAPED_VIEWS and len(largs) > 1:  # view(0, -1) of a block without rows
        shape = _small.resolve_empty_view(args[0], largs[1])
        if shape is not None:
            largs = (largs[0], shape, *largs[2:])
    out = func(*largs, **lkwargs)
    if func is aten.mul.Tensor and _small.in_dot_backward():
        return out  # a one-atom dot's gradient of its plain operand: a local sum, plain
    schema = func._schema
    written = [
        i
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write and i < len(args)
    ]
    if written:  # in place: the wrappers stay, their state follows the op
        for i in written:
            w = args[i]
            if isinstance(w, ShardTensor) and w._spec.halo:
                w._spec = w._spec.with_state(_mutated_state(func, w, args))
            if isinstance(w, ShardTensor) and not in_backward():
                _write_through(w)
        if len(schema.returns) == 1 and schema.returns[0].alias_info is not None:
            return args[written[0]]
        return out
    grouped = _row_view(func, args, out)
    if grouped is not None:
        return grouped
    spec = _out_spec(func, args, sts)
    if spec is None:
        return out
    n = _rows_of(args, sts)
    return _map_tensors(lambda t: _rewrap(t, spec, n, func, args), out)


def _unwrap(t: Any) -> Any:
    return t._local if isinstance(t, ShardTensor) else t


# Every op on a ShardTensor flattens its arguments (twice with the registry's match): pytree's
# generic flatten costs ~0.1 ms per call, a fifth of a small model's evaluation; op arguments are
# nested lists, tuples and dicts, walked here directly.
def leaves(tree: Any, out: list | None = None) -> list:
    """The leaves of nested lists, tuples and dicts, in order."""
    out = [] if out is None else out
    if isinstance(tree, (list, tuple)):
        for t in tree:
            leaves(t, out)
    elif isinstance(tree, dict):
        for t in tree.values():
            leaves(t, out)
    else:
        out.append(tree)
    return out


def _map_tensors(fn: Any, tree: Any) -> Any:
    """``fn`` applied to every tensor in nested lists, tuples and dicts (new containers)."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    kind = type(tree)
    if kind is list or kind is tuple:
        return kind(_map_tensors(fn, t) for t in tree)
    if kind is dict:
        return {k: _map_tensors(fn, v) for k, v in tree.items()}
    return tree


def _view_name(func: Any) -> str:
    return func._schema.name.split("::")[-1] if getattr(func, "_schema", None) else ""


def _per_atom_block(x: ShardTensor, shape: Any) -> int | None:
    """Rows per atom of a view of ``x`` to ``shape`` that keeps each atom's elements in its own
    rows (None if the view splits an atom's elements across rows, or mixes atoms)."""
    per_atom = x._spec.row_block
    for d in x.shape[1:]:
        per_atom *= int(d)
    rest = 1
    for d in list(shape)[1:]:
        rest *= int(d)
    if len(shape) == 0 or rest == 0 or per_atom == 0:
        return None
    if per_atom % rest:
        return None
    k = per_atom // rest
    n_atoms = x.shape[0] // x._spec.row_block
    return k if int(shape[0]) == n_atoms * k else None


def _row_view(func: Any, args: tuple, out: Any) -> ShardTensor | None:
    """A view / reshape of a per-atom ShardTensor that changes dim 0 but keeps every atom's
    elements in its own contiguous rows: the result keeps the spec with the new ``row_block``."""
    if _view_name(func) not in _VIEWS or not args or not isinstance(out, torch.Tensor):
        return None
    x = args[0]
    if not (isinstance(x, ShardTensor) and x._spec.per_atom) or out.dim() == 0 or out.shape[0] == x.shape[0]:
        return None
    k = _per_atom_block(x, out.shape)
    if k is None:
        return None
    return ShardTensor(out, x._spec.with_row_block(k))


# ---------------------------------------------------------------------- propagation rules
_FRESH_ALLOC = {
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
}
_STALE_ALLOC = {
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.rand_like.default,
    aten.randn_like.default,
}
_INDEX_BY = {aten.index.Tensor, aten.index_select.default, aten.gather.default, aten.embedding.default}


def _per_atom(sts: list[ShardTensor]) -> list[ShardTensor]:
    return [t for t in sts if t._spec.per_atom]


def _rows_of(args: tuple, sts: list[ShardTensor]) -> int:
    pa = _per_atom(sts)
    return int((pa or sts)[0].shape[0])


def _combine(func: Any, args: tuple, ref: ShardTensor) -> HaloState:
    """Halo state of a row-wise op's output: FRESH iff every per-atom input is FRESH; a plain
    input with the atom rows (pointwise ops) has unknown halo rows, so it makes the result STALE."""
    n = ref.shape[0]
    flat = leaves(args)
    if func in _FRESH_ALLOC:
        return HaloState.FRESH
    if func in _STALE_ALLOC:
        return HaloState.STALE
    if func in _INDEX_BY:  # the rows come from the index, not from the (replicated) table
        idx = [a for a in flat[1:] if isinstance(a, ShardTensor) and a._spec.per_atom]
        if isinstance(args[0], ShardTensor) and args[0]._spec.per_atom:  # a per-atom table along
            idx.append(args[0])  # another dim (x.index_select(1, c), x[:, c]) keeps its rows' state
        return HaloState.FRESH if all(t.state == HaloState.FRESH for t in idx) else HaloState.STALE
    # stack / cat along another dim pair their operands' rows as a pointwise op does
    pointwise = torch.Tag.pointwise in func.tags or func in (
        aten.where.self,
        aten.cat.default,
        aten.stack.default,
    )
    for a in flat:
        if isinstance(a, ShardTensor):
            if a._spec.per_atom and a.state != HaloState.FRESH:
                return HaloState.STALE
        elif pointwise and isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == n and n != 1:
            # a plain operand with the block's rows is per-row (STALE), on a block without rows
            # too (the state must not depend on the row count: the next gather's refresh is a
            # collective); one row is ambiguous with a broadcast operand and is taken as one
            return HaloState.STALE
    return HaloState.FRESH


def _mutated_state(func: Any, w: ShardTensor, args: tuple) -> HaloState:
    if func in (aten.zero_.default, aten.fill_.Scalar):
        return HaloState.FRESH
    if func is aten.copy_.default:
        src = args[1]
        if isinstance(src, ShardTensor):
            return src.state if src._spec.per_atom else HaloState.FRESH
        return HaloState.STALE if (src.dim() > 0 and src.shape[0] == w.shape[0]) else HaloState.FRESH
    if w.state != HaloState.FRESH:
        return w.state
    return _combine(func, args, w)


def _write_through(view: ShardTensor) -> None:
    """An in-place write into a view of a halo-padded ShardTensor sets the base's state too (the
    view is a new wrapper: its state alone would change). e3nn's ``Extract`` (inside ``Gate``)
    fills a FRESH ``new_zeros`` buffer column by column, ``out.narrow(-1, a, n).copy_(x)``: from a
    STALE ``x`` the buffer is STALE, else the next gather would read its halo rows unrefreshed.
    A view of the same rows (other columns): FRESH and STALE give STALE; PARTIAL meets only
    PARTIAL (a halo mixing partial sums and copies has no state: raises)."""
    base = view._base
    if not isinstance(base, ShardTensor) or base is view or not (base._spec.halo and view._spec.halo):
        return
    old, new = base.state, view.state
    if old == new:
        return
    if HaloState.PARTIAL in (old, new):
        raise UnhandledAtomOp(
            f"an in-place write of a {new.value} view into a {old.value} halo-padded tensor: its halo "
            "rows would hold partial sums in some columns and copies in others"
        )
    base._spec = base._spec.with_state(HaloState.STALE)


def _out_spec(func: Any, args: tuple, sts: list[ShardTensor]) -> ShardSpec | None:
    if not sts:
        return None
    pa = _per_atom(sts)
    ref = (pa or sts)[0]
    if not pa:
        return ref._spec
    if func is aten.slice.Tensor and args[0] is ref and _dim(args, 1, 0, ref) == 0 and ref._spec.halo:
        start, end = _arg(args, 2, 0), _arg(args, 3, None)
        if (start in (0, None)) and end == ref._spec.n_owned:
            return ref._spec.owned()
        if (start in (0, None)) and (end is None or end >= ref.shape[0]):
            return ref._spec
        return None  # other local rows: a plain tensor
    return ref._spec.with_state(_combine(func, args, ref))


def _rewrap(t: Any, spec: ShardSpec, n: int, func: Any, args: tuple) -> Any:
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    if spec.halo and t.shape[0] != n:
        return t
    if not spec.halo and t.shape[0] != n and not (func is aten.slice.Tensor and spec.placement == Owned()):
        return t
    return ShardTensor(t, spec)


def _arg(args: tuple, i: int, default: Any) -> Any:
    return args[i] if len(args) > i else default


def _dim(args: tuple, i: int, default: int, t: torch.Tensor) -> int:
    d = _arg(args, i, default)
    return d % max(t.dim(), 1) if isinstance(d, int) else d


# ---------------------------------------------------------------------- the atom-dimension check
_INDEXING = {
    "index_select": 1,
    "gather": 1,
    "scatter": 1,
    "scatter_add": 1,
    "scatter_reduce": 1,
    "index_add": 1,
    "index_copy": 1,
    "index_fill": 1,
    "index_reduce": 1,
    "cumsum": 1,
    "cumprod": 1,
    "cummax": 1,
    "cummin": 1,
    "logcumsumexp": 1,
    "sort": 1,
    "argsort": 1,
    "topk": 2,
    "kthvalue": 2,
    "select": 1,
    "unbind": 1,
    "split": 2,
    "split_with_sizes": 2,
    "narrow": 1,
    "flip": None,
    "roll": None,
    "take": None,
    "put": None,
    "put_": None,
    "masked_select": None,
    "nonzero": None,
    "unique_dim": 1,
    "_unique2": None,
    "index_put": None,
}
_SCATTERS = {"index_add", "scatter_add", "scatter", "scatter_reduce", "index_copy", "index_reduce"}
_CONTRACT_RIGHT = {"mm": 1, "addmm": 2, "mv": 1, "addmv": 2, "dot": None, "vdot": None, "outer": None}
_MOVES = {"transpose", "t", "permute", "movedim", "swapaxes", "swapdims", "expand", "unsqueeze"}
_VIEWS = {"view", "_unsafe_view", "reshape", "flatten", "_reshape_alias", "view_as"}


def _atom_dims(d: Any, ndim: int) -> bool:
    """Does the dim argument ``d`` (int, list or None = all) include the atom dimension 0?"""
    if d is None:
        return True
    ds = [d] if isinstance(d, int) else list(d)
    return not ds or any(int(x) % max(ndim, 1) == 0 for x in ds)


def check_atom_op(func: Any, args: tuple, kwargs: dict) -> None:
    """Raise ``UnhandledAtomOp`` if ``func`` indexes, reduces, contracts, moves or merges the atom
    dimension of a per-atom ShardTensor argument (no handler matched it)."""
    if getattr(func, "namespace", "aten") not in _TORCH_NAMESPACES:
        _check_opaque(func, args, kwargs)
        return
    name = func._schema.name.split("::")[-1].rstrip("_") if func._schema.name else str(func)
    base = name
    x = args[0] if args else None
    if isinstance(x, ShardTensor) and x._spec.per_atom:
        nd = x.dim()
        why = None
        if base in ("index", "index_put") or func in (aten.index.Tensor, aten.index_put.default):
            idx = args[1] if len(args) > 1 else kwargs.get("indices")
            if idx and idx[0] is not None:
                why = "indexes"
        elif base in _INDEXING:
            pos = _INDEXING[base]
            d = kwargs.get("dim", args[pos] if pos is not None and len(args) > pos else 0)
            if pos is None or _atom_dims(d, nd):
                why = "indexes"
        elif torch.Tag.reduction in func.tags:
            names = [a.name for a in func._schema.arguments]
            if "dim" in names:
                i = names.index("dim")
                d = kwargs.get("dim", args[i] if len(args) > i else None)
                if _atom_dims(d, nd):
                    why = "reduces over"
            elif func._overloadname in ("default", "dtype", "Scalar", "names_dim", ""):
                why = "reduces over"
        elif base in _MOVES:
            if base in ("transpose", "swapaxes", "swapdims"):
                moved = 0 in (int(args[1]) % nd, int(args[2]) % nd) and int(args[1]) % nd != int(args[2]) % nd
            elif base == "t":
                moved = nd == 2
            elif base == "permute":
                moved = int(args[1][0]) % nd != 0
            elif base == "movedim":
                moved = True
            elif base == "unsqueeze":
                moved = int(args[1]) % (nd + 1) == 0
            else:  # expand with new leading dims
                moved = len(args[1]) != nd
            if moved:
                why = "moves"
        elif base in _VIEWS:
            shape = args[1] if len(args) > 1 else None
            if isinstance(shape, torch.Tensor):
                shape = tuple(shape.shape)
            if base == "flatten":
                if int(args[1] if len(args) > 1 else 0) % nd == 0 and nd > 1:
                    end = int(args[2] if len(args) > 2 else -1) % nd
                    why = "merges" if end > 0 else None
            elif shape is not None:
                first = int(shape[0]) if len(shape) else None
                if first == -1 and len(shape) >= 1:
                    rest = 1
                    for d in shape[1:]:
                        rest *= int(d)
                    first = x.numel() // rest if rest else None
                    shape = [first] + list(shape[1:])
                if first != x.shape[0] and (first is None or _per_atom_block(x, shape) is None):
                    why = "merges"
        elif base in ("cat", "stack"):
            pass  # handled below (args[0] is a list)
        if why is None and base in ("bmm", "baddbmm") and len(args) > 1:
            pass
        if why:
            raise _unhandled(func, why)
    if base in _SCATTERS and not (isinstance(x, ShardTensor) and x._spec.per_atom):
        # a scatter from per-atom rows (source or index) into a buffer that is not per-atom
        # sums over atoms: on local rows it would count halo rows and miss other ranks
        d = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        rest = list(args[2:]) + list(kwargs.values())
        if (
            isinstance(d, int)
            and d % max(x.dim(), 1) == 0
            and any(isinstance(a, ShardTensor) and a._spec.per_atom for a in rest)
        ):
            raise _unhandled(func, "scatters over")
    if base in _CONTRACT_RIGHT:
        pos = _CONTRACT_RIGHT[base]
        cand = [args[pos]] if pos is not None and len(args) > pos else list(args[:2])
        if any(isinstance(a, ShardTensor) and a._spec.per_atom for a in cand):
            raise _unhandled(func, "contracts")
    if base in ("cat", "stack") and args and isinstance(args[0], (list, tuple)):
        ts = args[0]
        d = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        pa = [t for t in ts if isinstance(t, ShardTensor) and t._spec.per_atom]
        if pa and (int(d) % (pa[0].dim() + (base == "stack")) == 0):
            raise _unhandled(func, "concatenates along")


_TORCH_NAMESPACES = {"aten", "prims"}


def _check_opaque(func: Any, args: tuple, kwargs: dict) -> None:
    """An opaque kernel (``torch.library.custom_op`` and the like) sees only local rows: with a
    per-atom ShardTensor argument and no adapter it raises (on every rank: every rank calls it)."""
    flat, _ = tree_flatten((args, kwargs))
    if any(isinstance(a, ShardTensor) and a._spec.per_atom for a in flat):
        raise UnhandledAtomOp(
            f"custom op {func._schema.name} is an opaque kernel called with a per-atom ShardTensor "
            "and no adapter is installed: on local rows it would give a silently wrong answer (stale "
            "halo rows, partial sums left in the halo, rows other ranks own missing). Declare its "
            "inputs and outputs with twinshard.shard.custom_ops.adapt(...) and call it inside "
            "twinshard.shard.custom_ops.distributed_scope(), or call it on .to_local() rows"
        )


def _minus_one_keeps(x: torch.Tensor, shape: Any) -> bool:
    rest = 1
    for s in shape[1:]:
        rest *= int(s)
    return rest > 0 and x.numel() // rest == x.shape[0]


def _unhandled(func: Any, why: str) -> UnhandledAtomOp:
    called = getattr(_tls, "fn", None)
    via = f" (called as {called})" if called else ""
    return UnhandledAtomOp(
        f"{func}{via} {why} the atom dimension of a per-atom ShardTensor and no dispatch handler "
        "matched it: on local rows it would give a silently wrong answer (halo rows counted twice, "
        "rows other ranks own missing). Register a handler (twinshard.shard.dispatch.register) "
        "or call .to_local() and do the communication explicitly"
    )


# ---------------------------------------------------------------------- differentiable wrap/unwrap
class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, spec: ShardSpec) -> ShardTensor:
        ctx.spec = spec
        return ShardTensor(local.detach(), spec)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (_ToLocal.apply(g) if isinstance(g, ShardTensor) else g), None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, st: ShardTensor) -> torch.Tensor:
        ctx.spec = st._spec
        return st._local.view_as(st._local)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor]:
        if isinstance(g, ShardTensor):
            return (g,)
        return (_FromLocal.apply(g, ctx.spec),)


def from_local(local: torch.Tensor, spec: ShardSpec) -> ShardTensor:
    """Zero-copy ShardTensor over ``local``; differentiable (the gradient comes back unwrapped)."""
    if isinstance(local, ShardTensor):
        raise TypeError("from_local: already a ShardTensor")
    return _FromLocal.apply(local, spec)


def to_local(x: torch.Tensor) -> torch.Tensor:
    """The local rows of a ShardTensor (differentiable); a plain tensor passes through."""
    return _ToLocal.apply(x) if isinstance(x, ShardTensor) else x


# the one-atom / no-atom lowerings and the TorchScript error record (imports ShardTensor from here)
from twinshard.shard import small_blocks as _small  # noqa: E402
