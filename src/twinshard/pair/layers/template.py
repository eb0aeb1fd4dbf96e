"""CP twins of Boltz-2's template module (``twinshard.pair.reference.template``):
``CPTemplateV2Module`` and the version-1 ``CPTemplateModule``.

Placements. In: ``z[B, Nr, Nc, c_z]`` and ``pair_mask[B, Nr, Nc]`` at the pair placement
``(Shard(1), Shard(2))``; the ``ShardedFeatures`` of ``distribute`` with the template features of
kind ``template`` ``[B, T, Nr, ...]`` at ``(Shard(2), Replicate())`` (tokens over grid rows, T
whole) and, for version 1, ``asym_id`` single. Out: the update ``[B, Nr, Nc, c_z]`` pair, carrying
the layout, padded entries exactly zero.

Computation on rank (r, c). The template pair features of the tile (rows ``I_r`` x columns
``J_c``, every template) come from the row block's features (local) and the column block's,
which ONE exchange brings (``column_block``: the column side's frame, origin, CB, masks,
visibility ids and residue types packed in one ``[B, T, Nc/C, 51]`` buffer, no gradient); the
serial ``pair_features`` runs on the two sides unchanged (the CB distances by torch.cdist with the
formula serial torch.cdist picks for the caller's N). Which templates count (``template_mask``
anywhere along the tokens) is one all-reduce of ``[B, T]`` along the grid column. Then
``z_proj(z_norm(z)) + a_proj(a)`` on the tile, the CP no-sequence Pairformer
(``CPPairformerNoSeqModule``) on the ``B*T`` pair tensors, ``v_norm``, the masked average over T
and ``u_proj(relu(.))``: all tile-local.

Collectives. Forward: the column move (one point-to-point exchange, ``template:columns``), the
``[B, T]`` all-reduce along the grid column (``template:counted``), the Pairformer's (two triangle
multiplications and two triangle attentions per block). Backward: the Pairformer's, and one
all-reduce over the grid of the flat gradient of ``z_norm, v_norm, z_proj, a_proj, u_proj``
(each tile's contribution is a true partial). The gradient of ``z`` is this rank's tile.

Memory saved for backward per rank: the tile's ``a_tij [B, T, Nr/R, Nc/C, 71 + num_bins]`` (a_proj's
input), ``v`` before and after ``v_norm`` ``[B, T, Nr/R, Nc/C, template_dim]`` and the Pairformer's
tile activations: serial / P. Nothing N x N on a rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.func import functional_call

from twinshard.comm import primitives as P
from twinshard.pair.layers.moves import column_block
from twinshard.pair.layers.pair_init import feature_layout, grid_params
from twinshard.pair.layers.pairformer import CPPairformerNoSeqModule
from twinshard.pair.layers.tokenwise import pointwise
from twinshard.pair.layout import with_layout
from twinshard.pair.reference.template import TemplateModule, TemplateV2Module, _Template
from twinshard.pair.tiling import PAIR, check_placements, from_local

__all__ = ["CPTemplateModule", "CPTemplateV2Module"]

# the column side of the template pair features, packed for one move: (key, trailing shape)
_COLUMN = (
    ("template_frame_rot", (3, 3)),
    ("template_frame_t", (3,)),
    ("template_cb", (3,)),
    ("template_mask_frame", ()),
    ("template_mask_cb", ()),
    ("template_restype", None),  # (33,)
)


class _CPTemplate(_Template):
    _stage: str | None = None

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("pairformer_cls", CPPairformerNoSeqModule)
        super().__init__(*args, **kwargs)

    def _column_side(self, row: Mapping[str, torch.Tensor], grid: Any, padded: tuple[int, int]) -> dict:
        """The column block's features in one move (template tensors, tokens on dim 2)."""
        keys = [k for k, _ in _COLUMN] + ([self.VISIBILITY_KEY] if self.VISIBILITY_KEY != "asym_id" else [])
        dt = row["template_cb"].dtype
        b, t, n = row["template_cb"].shape[:3]
        parts = [row[k].reshape(b, t, n, math.prod(row[k].shape[3:])).to(dt) for k in keys]
        widths = [p.shape[-1] for p in parts]
        moved = column_block(
            torch.cat(parts, dim=-1), grid, padded, "template:columns", token_dim=2, differentiable=False
        )
        col = {}
        for k, piece in zip(keys, moved.split(widths, dim=-1)):
            col[k] = piece.reshape(piece.shape[:3] + row[k].shape[3:]).to(row[k].dtype)
        if self.VISIBILITY_KEY == "asym_id":
            col["asym_id"] = column_block(
                row["asym_id"], grid, padded, "template:asym_id", differentiable=False
            )
        return col

    def forward(  # type: ignore[override]
        self,
        z: Any,
        feats: Mapping[str, Any],
        pair_mask: Any = None,
        use_kernels: bool = False,
        seed: int | None = None,
    ) -> Any:
        if self._stage == "in":
            return self.project_in(z, feats)  # (z tile, a tile)
        if self._stage == "out":
            return self.project_out(z, feats)  # (v tile, counted)
        what = type(self).__name__
        check_placements(z, PAIR, f"{what} input z", ndim=4)
        layout, grid = feature_layout(feats, self.keys(), what)
        if pair_mask is not None:
            check_placements(pair_mask, PAIR, f"{what} pair_mask", ndim=3)
        b, t = feats["template_mask"].shape[:2]
        row = {k: feats[k].to_local() for k in self.keys()}
        col = self._column_side(row, grid, layout.padded)
        here = row["template_mask"].any(dim=2).to(torch.float32)
        counted = here if t == 0 else P.all_reduce(here, grid.col_group, op="template:counted") > 0
        a = self.pair_features(row, col, layout.n_tokens)
        named = [(k, p) for k, p in self.named_parameters() if not k.startswith("pairformer.")]
        synced = {k: s for (k, _), s in zip(named, grid_params([p for _, p in named], z.device_mesh))}
        v = self._run("in", synced, z.to_local(), a)
        if t > 0:
            ni, nj = v.shape[2], v.shape[3]
            flat = with_layout(from_local(v.reshape(b * t, ni, nj, -1), z.device_mesh, PAIR), layout, "pair")
            pm = None
            if pair_mask is not None:
                pm_local = pair_mask.to_local()[:, None].expand(-1, t, -1, -1).reshape(b * t, ni, nj)
                pm = with_layout(from_local(pm_local, z.device_mesh, PAIR), layout, "pair")
            flat = pointwise(lambda x, y: x + y, flat, self.pairformer(flat, pm, seed))
            v = flat.to_local().view(v.shape)
        u = self._run("out", synced, v, counted)
        return with_layout(from_local(u, z.device_mesh, PAIR), layout, "pair")

    def _run(self, stage: str, params: dict, *args: Any) -> torch.Tensor:
        self._stage = stage
        try:
            return functional_call(self, params, args)
        finally:
            self._stage = None


class CPTemplateV2Module(_CPTemplate, TemplateV2Module):
    """CP ``TemplateV2Module``: ``forward(z, feats, pair_mask, use_kernels=False, seed=None)``."""


class CPTemplateModule(_CPTemplate, TemplateModule):
    """CP version-1 ``TemplateModule`` (visibility by ``asym_id``, moved like the rest)."""
