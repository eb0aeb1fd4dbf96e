"""Token-local layers on DTensors: replicated parameters, placement-preserving tiles.

A token-local module (Linear, LayerNorm, Transition, any per-position map over
the channel dim) computes the same thing on a tile as on the full tensor, so its
CP twin runs the serial forward on ``x.to_local()`` and wraps the result with
the input's placements. The only communication is the parameter gradient:
every rank holds a partial sum over its own tokens, and the sum over the mesh
axes where the activation is SHARDED gives the serial gradient. Along replicated
axes every rank computed the same contribution, so summing there would
over-count it (DESIGN rule 7). The sum runs in >= fp32 (``twinshard.comm``) and
comes back identical on every rank.

Helpers here are public for other twins (triangle updates, outer product mean):
``replicated_params`` (one all-reduce per dtype in backward, none forward),
``TokenwiseTwin`` (mixin for subclasses of serial modules), ``pointwise``
(elementwise ops such as gating and residual adds on identical placements,
without DTensor redistribution), ``mixing_layout`` (the padding a mixing twin
must mask, from the layout its inputs carry).

Padding (see ``twinshard.pair.features``): a twin's output carries its input's
``PairLayout`` and has its padded entries set to exactly zero. A token-local twin
is exact on real entries whatever the padding holds, so an input without a
layout is accepted (the output then has none either); a mixing twin without a
layout and without a mask raises.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from twinshard import comm
from twinshard.pair.layout import PairLayout, _check_fits, layout_kind, layout_of, padding_keep, with_layout
from twinshard.pair.tiling import check_placements, from_local, reduction_axes
from twinshard.runtime.scope import scope_size

__all__ = ["TokenwiseTwin", "grad_group", "mixing_layout", "pointwise", "replicated_params"]


def grad_group(mesh: DeviceMesh, placements: Sequence[Placement]) -> dist.ProcessGroup | None | bool:
    """Process group over which parameter gradients of a layer on ``placements`` are summed.

    Returns ``False`` when no mesh axis is sharded (nothing to sum), ``None`` (the
    world, or the active sub-world: a dp replica) when every axis is sharded, else the subgroup of the one sharded axis.
    """
    axes = reduction_axes(placements)
    if not axes:
        return False
    if len(axes) == mesh.ndim:
        if mesh.size() != scope_size():
            raise ValueError(
                "the pair grid must span the whole world or sub-world (make_grid of its size, or a "
                "replica grid of twinshard.runtime.mesh.make_dp_mesh)"
            )
        return None
    if len(axes) == 1:
        return mesh.get_group(axes[0])
    raise ValueError(f"cannot reduce over mesh axes {axes} of a {mesh.ndim}-D mesh")


def replicated_params(params: Sequence[torch.Tensor], like: DTensor) -> list[torch.Tensor]:
    """``params`` as used on tiles of ``like``: identity forward; backward sums their gradients.

    ``comm.sync_params`` over the sharded mesh axes: views of the parameters (no copy); their
    gradients bucketed by dtype into one flat vector each, so a layer's backward issues one
    all-reduce per dtype instead of one per parameter. Nothing is communicated when ``like``
    is not sharded.
    """
    group = grad_group(like.device_mesh, like.placements)
    if group is False or not params:
        return list(params)
    return comm.sync_params(params, group)  # the one replicated-gradient utility (atoms use it too)


def _check_tokenwise_input(x: object, what: str) -> DTensor:
    if not isinstance(x, DTensor):
        raise TypeError(
            f"{what} takes a DTensor (pair, single or MSA placement on the rows x cols grid), got "
            f"{type(x).__name__}: distribute inputs with twinshard.pair.features.distribute; the "
            "serial module in twinshard.pair.reference takes plain tensors"
        )
    check_placements(x, x.placements, what)  # mesh names, no Partial, equal tiles
    last = x.ndim - 1
    if any(isinstance(p, Shard) and p.dim % x.ndim == last for p in x.placements):
        raise ValueError(f"{what} acts on the channel (last) dim, which must not be sharded")
    return x


class TokenwiseTwin(nn.Module):
    """Mixin for CP twins of token-local serial modules (put it after the serial class).

    Placements in = placements out (any placement that leaves the channel dim
    whole). Forward: no collective. Backward: one all-reduce of the flat
    parameter gradient per dtype over the sharded mesh axes. Saved for backward:
    whatever the serial module saves, for the local tile only (1/P of the serial
    bytes for pair and MSA tensors, 1/rows for single tensors).
    """

    _on_tile: bool = False
    _out_kind: str | None = None  # kind of the output when it differs from the input's

    def tile_forward(self, x: DTensor, *args: object, **kwargs: object) -> DTensor:
        """Run the serial forward on this rank's tile with gradient-synced parameters."""
        x = _check_tokenwise_input(x, type(self).__name__)
        named = list(self.named_parameters())
        synced = replicated_params([p for _, p in named], x)
        self._on_tile = True
        try:
            out = functional_call(
                self, {n: s for (n, _), s in zip(named, synced)}, (x.to_local(), *args), kwargs
            )
        finally:
            self._on_tile = False
        return carry_layout(from_local(out, x.device_mesh, x.placements), x, self._out_kind)


def carry_layout(out: DTensor, like: DTensor, kind: str | None = None) -> DTensor:
    """``out`` with ``like``'s layout attached (as ``kind``, default ``like``'s) and its padding
    zeroed; unchanged when ``like`` carries no layout."""
    layout = layout_of(like)
    if layout is None:
        return out
    return with_layout(out, layout, kind or layout_kind(like))


def mixing_layout(
    x: DTensor, mask: DTensor | None, kind: str, what: str
) -> tuple[PairLayout | None, torch.Tensor | None]:
    """The layout a mixing twin (one that sums over tokens or sequences) works with, and the bool
    keep-mask of ``x``'s local tile (None where the tile has no padding).

    The layout comes from ``x``, else from ``mask``. With neither a layout nor a mask the padding
    cannot be told from real entries, so this raises (every rank alike: it reads metadata).
    """
    layout = layout_of(x)
    if layout is None and mask is not None:
        layout = layout_of(mask)
    if layout is None:
        if mask is None:
            raise ValueError(
                f"{what}: the input carries no PairLayout and no mask was given, so padded "
                "tokens cannot be told from real ones. A plain DTensor op (z + y, z.detach()) drops "
                "the layout: restore it with twinshard.pair.features.with_layout(z + y, z), or add "
                "with twinshard.pair.layers.pointwise(lambda a, b: a + b, z, y), or pass mask="
            )
        if kind == "pair" and x.shape[1] != x.shape[2]:
            raise ValueError(
                f"{what}: a pair tensor of shape {tuple(x.shape)} is not square; token axes padded "
                "apart come from twinshard.pair.features (distribute, shard_tensor), whose PairLayout "
                "tells their padding: keep it on the tensor (with_layout)"
            )
        return None, None
    _check_fits(x, layout, kind, what)
    return layout, padding_keep(x, layout, kind)


def pointwise(fn: Callable[..., torch.Tensor], *xs: DTensor) -> DTensor:
    """``fn`` applied to the local tiles of DTensors that share mesh, placements and shape.

    For gating (``a * sigmoid(g)``), residual adds and masks (e.g. ``pair_mask[B, N, N]``
    against ``z[B, N, N, c]``: ``fn`` does the broadcasting): no collective, and a
    clear error instead of an implicit redistribution when the placements differ.
    The output takes the placements of the first argument and its layout (padding zeroed).
    """
    if not xs:
        raise ValueError("pointwise needs at least one DTensor")
    first = _check_tokenwise_input(xs[0], "pointwise")
    for k, x in enumerate(xs[1:], start=1):
        if not isinstance(x, DTensor):
            raise TypeError(f"pointwise argument {k} is {type(x).__name__}, not a DTensor")
        if x.device_mesh != first.device_mesh or tuple(x.placements) != tuple(first.placements):
            raise ValueError(
                f"pointwise argument {k} has placements {tuple(x.placements)} on "
                f"{x.device_mesh}, argument 0 has {tuple(first.placements)} on "
                f"{first.device_mesh}: elementwise ops need identical placements"
            )
        sharded = [p.dim for p in first.placements if isinstance(p, Shard)]
        if any(x.shape[d] != first.shape[d] for d in sharded):
            raise ValueError(
                f"pointwise: shapes {tuple(first.shape)} and {tuple(x.shape)} differ along the "
                f"sharded dims {sharded}; only unsharded trailing dims may broadcast"
            )
    out = fn(*(x.to_local() for x in xs))
    return carry_layout(from_local(out, first.device_mesh, first.placements), first)


def rebuild(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as a DTensor with ``like``'s mesh, placements and layout (padding zeroed)."""
    return carry_layout(from_local(local, like.device_mesh, like.placements), like)


def checkpointed(call: Callable[..., Any], *xs: DTensor) -> Any:
    """``call(*xs)`` (a DTensor or a tuple of DTensors, with the placements and layouts of the
    first ``len`` inputs, in order) under non-reentrant activation checkpointing on the local
    tiles: backward recomputes the whole call, issuing its collectives in the forward order on
    every rank. ``preserve_rng_state=False``: dropout is counter-based (keyed by global index),
    so torch's RNG state need not be saved per call. The one checkpointing rule of the CP stacks
    (Pairformer, its no-sequence form, the MSA module)."""

    def run(*tiles: torch.Tensor) -> Any:
        out = call(*(rebuild(t, x) for t, x in zip(tiles, xs)))
        return out.to_local() if isinstance(out, DTensor) else tuple(o.to_local() for o in out)

    got = checkpoint(
        run, *(x.to_local() for x in xs), use_reentrant=False, early_stop=False, preserve_rng_state=False
    )
    if isinstance(got, torch.Tensor):
        return rebuild(got, xs[0])
    return tuple(rebuild(g, x) for g, x in zip(got, xs))
