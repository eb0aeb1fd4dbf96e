"""The handler registry of ShardTensor's op dispatch, and the parsing of the calls handlers match.

``ShardTensor.__torch_function__`` asks :data:`REGISTRY` for the first enabled handler whose
predicate matches a call (:mod:`twinshard.shard.dispatch` lists the shipped ones). A gather or
scatter is normalised to an :class:`IndexCall`; the helpers here (the local gather and scatter,
the index's local rows) are shared by the handler families.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from twinshard.shard.shard_tensor import ShardTensor, from_local, leaves

__all__ = ["REGISTRY", "Handler", "IndexCall", "Registry", "parse_index_call", "register"]


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
        for a in leaves((args, kwargs)):
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


def placed_as(x: Any, placement: type) -> bool:
    return isinstance(x, ShardTensor) and isinstance(x._spec.placement, placement)


def plain_index(x: Any) -> Any:
    """The local rows of an index (not differentiable: integer)."""
    return x._local if isinstance(x, ShardTensor) else x


def index_predicate(kind: str, placement: type | None) -> Callable[[Any, tuple, dict], bool]:
    def pred(func: Any, args: tuple, kwargs: dict) -> bool:
        c = parse_index_call(func, args, kwargs)
        if c is None or c.dim != 0 or c.scatter != (kind == "scatter"):
            return False
        return placement is None or placed_as(c.target, placement)

    return pred


def local_gather(c: IndexCall, local: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if c.name == "index_select":
        return local.index_select(0, index)
    if c.name == "gather":
        return local.gather(0, index)
    # the whole key on the refreshed rows: tensors after the first index broadcast with it
    # (joint indexing, x[idx, j][k] = x[idx[k], j[k]]), as torch itself would
    return local[(index,) + tuple(plain_index(k) for k in c.rest)] if c.rest else local[index]


def wrap_like_index(out: torch.Tensor, index: Any) -> torch.Tensor:
    """A gather with a per-atom index has the index's rows (``table[numbers]``-like)."""
    if (
        isinstance(index, ShardTensor)
        and index._spec.per_atom
        and out.dim()
        and out.shape[0] == index.shape[0]
    ):
        return from_local(out, index._spec)
    return out


def local_scatter(c: IndexCall, zeros: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    if c.name.startswith("index_add"):
        return zeros.index_add(0, index, src, alpha=c.alpha)
    return zeros.scatter_add(0, index, src)
