"""CP twins of the Boltz-2 pair initialisation (``twinshard.pair.reference.pair_init``).

Every part maps a pair (i, j) from the features of token i and of token j, so a pair tile (r, c)
needs the features of its row block ``I_r`` (local: single features live on grid row r) and of
its column block ``J_c``, which :func:`twinshard.pair.layers.moves.column_block` brings from
their owners (one point-to-point exchange, Nc/C rows received per rank).

Placements. In: the ``ShardedFeatures`` of :func:`twinshard.pair.features.distribute` (token
features ``single`` ``[B, Nr]``, ``token_bonds``/``type_bonds``/``contact_*`` ``pair``), the single
input embedding ``s_inputs[B, Nr, c_s]`` at ``(Shard(1), Replicate())``. Out: pair tensors
``[B, Nr, Nc, c_z]`` at ``(Shard(1), Shard(2))`` carrying the features' layout, padded entries
exactly zero; ``s_init`` single. Parameters are replicated.

- :class:`CPRelativePositionEncoder`: forward one exchange of the column block of the five index
  features (stacked, integer, no gradient), plus one ``[B, Nc/C]`` exchange of ``cyclic_period``
  and one all-reduce of one value along the grid column (does any token have a period?) when
  ``cyclic_pos_enc``; backward one all-reduce of ``linear_layer.weight``'s gradient over the grid.
- :class:`CPContactConditioning`, :class:`CPEmbedding` (``token_bonds_type``), the ``token_bonds``
  ``CPLinear``: tile-local; backward one all-reduce of the parameter gradients over the grid
  (the frozen Fourier projection has none).
- :func:`cp_outer_sum` (``z_init_1(s)_i + z_init_2(s)_j``): the row side ``z_init_1(s[I_r])`` is
  local; the column side ``z_init_2(s)`` is projected on the owners' rows and its ``[B, Nc/C,
  c_z]`` block moved (:class:`~twinshard.pair.layers.moves.MoveRows`). Backward: the reverse move
  (gradients of the column side go back to the owners), one all-reduce of the gradient of ``s``
  along the grid row (``comm.sync_grad``: ``s`` is replicated there; each rank holds a partial),
  one all-reduce of both weights' gradients over the grid (each tile's contribution counted once:
  the row side by its tile, the column side by the one rank that sent it).

Memory saved for backward per rank: the one-hot relative-position features of the tile
``[B, Nr/R, Nc/C, 2 (2 r_max + 2) + 2 s_max + 3]`` (the serial module saves them for all N x N:
serial / P), the contact encoder's tile input, ``s`` rows and the moved column block
``[B, Nc/C, c_z]``. Nothing of size N x N on a rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.func import functional_call

from twinshard import comm
from twinshard.comm import primitives as P
from twinshard.pair.layers.linear import CPLinear
from twinshard.pair.layers.moves import column_block
from twinshard.pair.layers.tokenwise import grad_group, pointwise
from twinshard.pair.layers.triangle import pair_grid
from twinshard.pair.layout import KINDS, PairLayout, layout_of, with_layout
from twinshard.pair.reference.pair_init import (
    RELPOS_KEYS,
    ContactConditioning,
    Embedding,
    RelativePositionEncoder,
    add_pair_init,
)
from twinshard.pair.tiling import PAIR, SINGLE, check_placements, from_local
from twinshard.runtime.grid import ProcessGrid

__all__ = [
    "CP_PAIR_INIT_PARTS",
    "CPContactConditioning",
    "CPEmbedding",
    "CPPairInit",
    "CPRelativePositionEncoder",
    "cp_outer_sum",
    "cp_pair_init_forward",
    "feature_layout",
    "grid_params",
]


def grid_params(params: Sequence[torch.Tensor], mesh: DeviceMesh) -> list[torch.Tensor]:
    """Replicated parameters used on pair tiles: identity forward; backward one all-reduce of
    their (partial, per tile) gradients over the whole grid. Frozen parameters pass through."""
    params = list(params)
    live = [i for i, p in enumerate(params) if p.requires_grad]
    group = grad_group(mesh, PAIR)
    if group is False or not live:
        return params
    synced = comm.sync_params([params[i] for i in live], group)
    for i, s in zip(live, synced):
        params[i] = s
    return params


def feature_layout(
    feats: Mapping[str, Any], keys: Sequence[str], what: str
) -> tuple[PairLayout, ProcessGrid]:
    """The layout and grid of distributed features; a clear error (the same on every rank: it
    reads metadata) for a missing feature, a plain tensor, a wrong placement or no layout."""
    missing = [k for k in keys if k not in feats]
    if missing:
        raise KeyError(f"{what} needs the features {missing} (Boltz-2 names), which are missing")
    layout = getattr(feats, "layout", None)
    for k in keys:
        x = feats[k]
        if not isinstance(x, DTensor):
            raise TypeError(
                f"{what}: feature {k!r} is a {type(x).__name__}, not a DTensor: distribute the "
                "features with twinshard.pair.features.distribute"
            )
        kind = (layout.kinds.get(k) if layout is not None else None) or _kind_by_placement(x)
        check_placements(x, KINDS[kind], f"{what} feature {k!r}")
        layout = layout or layout_of(x)
    if layout is None:
        raise ValueError(
            f"{what}: the features carry no PairLayout, so padded tokens cannot be told from real "
            "ones: pass the ShardedFeatures that twinshard.pair.features.distribute returns"
        )
    return layout, pair_grid(feats[keys[0]])


def _kind_by_placement(x: DTensor) -> str:
    pl = tuple(x.placements)
    return "single" if pl == SINGLE else "template" if pl == KINDS["template"] else "pair"


def _pair_out(local: torch.Tensor, mesh: DeviceMesh, layout: PairLayout) -> DTensor:
    return with_layout(from_local(local, mesh, PAIR), layout, "pair")


class CPRelativePositionEncoder(RelativePositionEncoder):
    """``forward(feats) -> [B, Nr, Nc, token_z]`` pair DTensor (module docstring)."""

    def forward(self, feats: Mapping[str, DTensor]) -> DTensor:  # type: ignore[override]
        what = type(self).__name__
        layout, grid = feature_layout(feats, self.keys(), what)
        locs = [feats[k].to_local() for k in RELPOS_KEYS]
        ints = torch.stack([t.long() for t in locs], dim=-1)  # one move for the five indices
        col_ints = column_block(ints, grid, layout.padded, "relpos:columns", differentiable=False)
        row = {k: locs[i] for i, k in enumerate(RELPOS_KEYS)}
        col = {k: col_ints[..., i].to(locs[i].dtype) for i, k in enumerate(RELPOS_KEYS)}
        cyclic = False
        if self.cyclic_pos_enc:
            period = feats["cyclic_period"].to_local()
            here = (period > 0).any().to(torch.float32).reshape(1)
            cyclic = bool(P.all_reduce(here, grid.col_group, op="relpos:cyclic_any") > 0)
            if cyclic:
                col["cyclic_period"] = column_block(
                    period, grid, layout.padded, "relpos:cyclic_period", differentiable=False
                )
        (w,) = grid_params([self.linear_layer.weight], feats[RELPOS_KEYS[0]].device_mesh)
        out = F.linear(self.encode(row, col, cyclic), w)
        return _pair_out(out, feats[RELPOS_KEYS[0]].device_mesh, layout)

    def serial_forward(self, feats: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return RelativePositionEncoder.forward(self, feats)


class CPContactConditioning(ContactConditioning):
    """``forward(feats) -> [B, Nr, Nc, token_z]`` pair DTensor: the serial map on each tile."""

    _on_tile: bool = False

    def forward(self, feats: Mapping[str, Any]) -> Any:  # type: ignore[override]
        if self._on_tile:
            return self.encode(feats["contact_conditioning"], feats["contact_threshold"])
        layout, _ = feature_layout(feats, self.KEYS, type(self).__name__)
        cc = feats["contact_conditioning"]
        named = list(self.named_parameters())
        synced = grid_params([p for _, p in named], cc.device_mesh)
        self._on_tile = True
        try:
            out = functional_call(
                self,
                {n: s for (n, _), s in zip(named, synced)},
                ({k: feats[k].to_local() for k in self.KEYS},),
            )
        finally:
            self._on_tile = False
        return _pair_out(out, cc.device_mesh, layout)

    def serial_forward(self, feats: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return ContactConditioning.forward(self, feats)


class CPEmbedding(Embedding):
    """``nn.Embedding`` of a pair DTensor of indices ``[B, Nr, Nc]`` -> ``[B, Nr, Nc, dim]`` pair
    (Boltz-2's ``token_bonds_type`` of ``type_bonds``); tile-local, parameter gradient summed
    over the grid in backward."""

    def forward(self, idx: DTensor) -> DTensor:  # type: ignore[override]
        check_placements(idx, PAIR, f"{type(self).__name__} input", ndim=3)
        (w,) = grid_params([self.weight], idx.device_mesh)
        out = F.embedding(idx.to_local().long(), w, self.padding_idx, self.max_norm, self.norm_type)
        out = from_local(out, idx.device_mesh, PAIR)
        layout = layout_of(idx)
        return out if layout is None else with_layout(out, layout, "pair")

    def serial_forward(self, idx: torch.Tensor) -> torch.Tensor:
        return Embedding.forward(self, idx)


def cp_outer_sum(lin_i: nn.Linear, lin_j: nn.Linear, s: DTensor, layout: PairLayout | None = None) -> DTensor:
    """``lin_i(s)_i + lin_j(s)_j`` (bias-free or not) as a pair DTensor ``[B, Nr, Nc, c]`` from the
    single ``s[B, Nr, c_s]`` (module docstring: the column side moves after its projection)."""
    check_placements(s, SINGLE, "outer sum input s", ndim=3)
    layout = layout or layout_of(s)
    if layout is None:
        raise ValueError("outer sum: s carries no PairLayout: pass layout= (ShardedFeatures.layout)")
    grid = pair_grid(s)
    params = [lin_i.weight, lin_j.weight] + [b for b in (lin_i.bias, lin_j.bias) if b is not None]
    synced = grid_params(params, s.device_mesh)
    w_i, w_j = synced[:2]
    rest = iter(synced[2:])
    b_i = next(rest) if lin_i.bias is not None else None
    b_j = next(rest) if lin_j.bias is not None else None
    x = comm.sync_grad(s.to_local(), grid.row_group)  # replicated along the row: partial grads
    a = F.linear(x, w_i, b_i)
    b = column_block(F.linear(x, w_j, b_j), grid, layout.padded, "z_init:columns", differentiable=True)
    return _pair_out(a[:, :, None] + b[:, None, :], s.device_mesh, layout)


CP_PAIR_INIT_PARTS = {
    "linear": CPLinear,  # s_init, token_bonds; z_init_1/z_init_2 lend their weights to cp_outer_sum
    "rel_pos": CPRelativePositionEncoder,
    "embedding": CPEmbedding,
    "contact": CPContactConditioning,
}


def _add(a: DTensor, b: DTensor) -> DTensor:
    return pointwise(lambda x, y: x + y, a, b)


def cp_pair_init_forward(
    module: nn.Module,
    s_inputs: DTensor,
    feats: Mapping[str, DTensor],
    keep: dict[str, DTensor] | None = None,
) -> tuple[DTensor, DTensor]:
    """``(s_init [single], z_init [pair])`` from the parts registered on ``module`` by
    ``add_pair_init(..., parts=CP_PAIR_INIT_PARTS)`` (as :class:`CPPairInit` does): Boltz-2's
    additions in Boltz-2's order. ``keep`` receives the relative position encoding (a pair
    DTensor with the layout) as ``"relative_position_encoding"``."""
    keys = ("token_bonds",) + (("type_bonds",) if module.bond_type_feature else ())
    layout, _ = feature_layout(feats, keys, "pair init")
    check_placements(s_inputs, SINGLE, "pair init s_inputs", ndim=3)
    s_init = module.s_init(s_inputs)
    z = cp_outer_sum(module.z_init_1, module.z_init_2, s_inputs, layout)
    rel = module.rel_pos(feats)
    if keep is not None:
        keep["relative_position_encoding"] = rel
    z = _add(z, rel)
    bonds = feats["token_bonds"]
    bonds = from_local(bonds.to_local().to(module.token_bonds.weight.dtype), bonds.device_mesh, PAIR)
    z = _add(z, module.token_bonds(bonds))
    if module.bond_type_feature:
        z = _add(z, module.token_bonds_type(feats["type_bonds"]))
    z = _add(z, module.contact_conditioning(feats))
    return with_layout(s_init, layout, "single"), z


class CPPairInit(nn.Module):
    """CP twin of :class:`twinshard.pair.reference.pair_init.PairInit` (same names, same order):
    ``forward(s_inputs [single], feats) -> (s_init [single], z_init [pair])``."""

    def __init__(self, token_s: int, token_z: int, **kwargs: object):
        super().__init__()
        add_pair_init(self, token_s, token_z, parts=CP_PAIR_INIT_PARTS, **kwargs)  # type: ignore[arg-type]

    def forward(self, s_inputs: DTensor, feats: Mapping[str, DTensor]) -> tuple[DTensor, DTensor]:
        return cp_pair_init_forward(self, s_inputs, feats)
