"""Plain tensors at a CP twin's boundary: drop a twin into a serial training script.

``plain(twin, grid)`` turns a CP twin (in place; it is returned) into a module that ALSO takes the
caller's full plain tensors: each plain tensor argument of a declared kind is padded and cut to
this rank's tile inside (``distribute``), the twin runs on DTensors, and each output is gathered
back to the caller's size (``collect``). DTensor arguments pass through unchanged, so a model can
mix both. Parameter names, order and the ``state_dict`` stay the twin's (= the serial module's),
so a serial checkpoint and a serial optimizer see the same parameters.

Contract: every rank runs the same script on the same full tensors (as with
``distribute(src=None)``), e.g. a serial training loop launched on every rank of the grid.

Gradients. The scatter's adjoint gathers the gradient tiles along the sharded grid axes, so the
gradient that reaches a plain input is the FULL gradient, identical on every rank (for a single
``[B, N, c]`` input, sharded over grid rows and replicated along them, every rank of a grid row
holds the same complete tile gradient: a gather over the grid columns' row blocks suffices). The
output's gather has the "every rank computed the same value" adjoint (each rank keeps its tile of
the replicated output gradient). Parameter gradients come out of the twin complete and identical
on every rank, so a plain optimizer step keeps the replicas identical.

Collectives added by the boundary: forward, one all-gather per output along its sharded axes;
backward, one all-gather per differentiable plain input. Memory: the caller's full tensors exist
anyway (a serial script holds them); the tiles are serial / P.

Kinds: ``in_kinds`` maps argument names to ``"pair" | "single" | "msa" | "sample"``; a twin may
declare ``PLAIN_IN_KINDS`` (and ``plain_prepare(arguments)``, which fills derived arguments from
the plain ones, e.g. the Pairformer's pair mask from the token mask, as the serial module does).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from twinshard.comm import primitives as P
from twinshard.comm.amp import autocast_rule
from twinshard.pair.features import PairLayout, _placements, collect_tensor, with_layout
from twinshard.pair.tiling import from_local, local_block
from twinshard.runtime import ProcessGrid

__all__ = ["plain", "to_dtensor"]


@autocast_rule()
class _Scatter(torch.autograd.Function):
    """Full tensor -> this rank's padded tile; backward gathers the full gradient on every rank.

    Dtype path: forward slices in x's dtype (no communication); backward all-gathers the
    gradient in its dtype.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kind: str, grid: ProcessGrid, layout: PairLayout) -> torch.Tensor:
        ctx.kind, ctx.grid, ctx.layout = kind, grid, layout
        return local_block(layout.pad(x.detach(), kind), grid, _placements(kind)).clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        pl, mesh = _placements(ctx.kind), ctx.grid.mesh
        for a in reversed(range(mesh.ndim)):  # cols first, then rows (as collect_tensor)
            if hasattr(pl[a], "dim"):
                g = P.all_gather(g.contiguous(), pl[a].dim % g.dim(), mesh.get_group(a), op="boundary:grad")
        return ctx.layout.unpad(g, ctx.kind), None, None, None


def to_dtensor(x: torch.Tensor, kind: str, grid: ProcessGrid, layout: PairLayout) -> DTensor:
    """A plain full tensor (the same on every rank) -> its DTensor of ``kind`` carrying ``layout``;
    the gradient that flows back to ``x`` is the full gradient on every rank."""
    local = _Scatter.apply(x, kind, grid, layout)
    return with_layout(from_local(local, grid.mesh, _placements(kind)), layout, kind)


def _collect(y: Any) -> Any:
    if isinstance(y, DTensor):
        return collect_tensor(y)
    if isinstance(y, tuple):
        return tuple(_collect(v) for v in y)
    return y


class _Plain:
    """Mixed in before the twin's class by :func:`plain`."""

    _plain_spec: tuple[ProcessGrid, dict[str, str]]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_on_tile", False):  # a twin's own tile-level re-entry
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        grid, kinds = self._plain_spec
        base = type(self).__mro__[2]  # the twin's class
        bound = inspect.signature(base.forward).bind(self, *args, **kwargs)
        bound.apply_defaults()
        argv = dict(bound.arguments)
        argv.pop("self")
        plain_ones = {
            k: v
            for k, v in argv.items()
            if k in kinds and isinstance(v, torch.Tensor) and not isinstance(v, DTensor)
        }
        if not plain_ones:
            return super().forward(**argv)  # type: ignore[misc]
        if hasattr(self, "plain_prepare"):
            argv = self.plain_prepare(argv)  # type: ignore[attr-defined]
        first = next(v for k, v in argv.items() if k in kinds and isinstance(v, torch.Tensor))
        layout = PairLayout.for_sizes(int(first.shape[1]), grid)
        for k, v in argv.items():
            if k in kinds and isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
                argv[k] = to_dtensor(v, kinds[k], grid, layout)
        return _collect(super().forward(**argv))  # type: ignore[misc]


_CLASSES: dict[type, type] = {}


def plain(module: nn.Module, grid: ProcessGrid, in_kinds: Mapping[str, str] | None = None) -> nn.Module:
    """Let the CP twin ``module`` take plain full tensors too (module docstring); in place."""
    kinds = dict(in_kinds if in_kinds is not None else getattr(module, "PLAIN_IN_KINDS", {}))
    if not kinds:
        raise ValueError(
            f"plain({type(module).__name__}): give in_kinds={{argument: kind}} (the twin declares no "
            "PLAIN_IN_KINDS)"
        )
    cls = type(module)
    if not issubclass(cls, _Plain):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"Plain{cls.__name__}", (_Plain, cls), {"__module__": cls.__module__})
        module.__class__ = _CLASSES[cls]
    module._plain_spec = (grid, kinds)
    return module
