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
without DTensor redistribution).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.func import functional_call

from twinshard import comm
from twinshard.tensors.dtensor import check_placements, from_local, reduction_axes

__all__ = ["TokenwiseTwin", "grad_group", "pointwise", "replicated_params"]


def grad_group(mesh: DeviceMesh, placements: Sequence[Placement]) -> dist.ProcessGroup | None | bool:
    """Process group over which parameter gradients of a layer on ``placements`` are summed.

    Returns ``False`` when no mesh axis is sharded (nothing to sum), ``None`` (the
    world) when every axis is sharded, else the subgroup of the one sharded axis.
    """
    axes = reduction_axes(placements)
    if not axes:
        return False
    if len(axes) == mesh.ndim:
        if mesh.size() != dist.get_world_size():
            raise ValueError("the pair grid must span the whole world (make_grid of world size)")
        return None
    if len(axes) == 1:
        return mesh.get_group(axes[0])
    raise ValueError(f"cannot reduce over mesh axes {axes} of a {mesh.ndim}-D mesh")


def replicated_params(params: Sequence[torch.Tensor], like: DTensor) -> list[torch.Tensor]:
    """``params`` as used on tiles of ``like``: identity forward; backward sums their gradients.

    ``comm.sync_params`` over the sharded mesh axes: parameters bucketed by dtype into
    one flat vector each, so a layer's backward issues one all-reduce per dtype instead
    of one per parameter. Nothing is communicated when ``like`` is not sharded.
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
        return from_local(out, x.device_mesh, x.placements)


def pointwise(fn: Callable[..., torch.Tensor], *xs: DTensor) -> DTensor:
    """``fn`` applied to the local tiles of DTensors that share mesh, placements and shape.

    For gating (``a * sigmoid(g)``), residual adds and masks (e.g. ``pair_mask[B, N, N]``
    against ``z[B, N, N, c]``: ``fn`` does the broadcasting): no collective, and a
    clear error instead of an implicit redistribution when the placements differ.
    The output takes the placements of the first argument.
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
    return from_local(out, first.device_mesh, first.placements)
