"""CP twin of pair-weighted averaging (AF3 Alg. 10, Boltz-2's ``PairWeightedAveraging``).

Placements. In: MSA ``m[B, Sp, Nc, c_m]`` at ``(Shard(1), Shard(2))`` (sequences over grid rows,
tokens over grid columns), pair ``z[B, Nr, Nc, c_z]`` at ``(Shard(1), Shard(2))`` and an
optional pair mask ``mask[B, Nr, Nc]`` at the pair placement (N, S padded by
``twinshard.pair.features``). Out: the update of ``m``, ``[B, Sp, Nc, c_m]`` at the MSA
placement, carrying m's layout (else z's), padded entries exactly zero. Padded tokens are never
averaged over (from the layout: their weight is exactly zero, not ``exp(-inf)``); a given mask
is used as Boltz uses it (module ``twinshard.pair.reference.pair_averaging``). With neither a
layout nor a mask: a clear error.

Computation on rank (r, c). ``v``, ``g`` (``norm_m``, ``proj_m``, ``proj_g``) are token-local on
the MSA tile (sequences block r, tokens block c); the logits ``b[i, j]`` (``norm_z``,
``proj_z``) on the pair tile (i in row block r, j in column block c). The softmax over ``j``
is split over the grid row: the row maximum of the mask and of the logits come from an
all-gather of the per-row maxima along the grid row (no gradient; the result does not depend on
the shift), and the normaliser ``L_i = sum_j exp(b_ij - max)`` is summed over the grid row by one
all-reduce (its adjoint: an all-reduce), in ``promote_types(dtype, float32)``, so the weights
``w[i, j]`` of the local tile are final. The average ``o[s, i] = sum_j w[i, j] v[s, j]`` (per
head) is a distributed contraction (``twinshard.pair.layers.contraction.grid_contract``:
``O = V W^T``, the heads as channels, the head width folded into the rows of V: ``V[(s, d), j]``
is stored tiled like the MSA, ``(s, d)`` over grid rows, j over grid columns); the result
``O[(s, d), i]`` lands at the MSA placement (i over grid columns), where the gate and ``proj_o``
run token-locally. On a square grid Cannon (a skew and q - 1 ring shifts per operand), else
SUMMA over j-segments.

Gradients. Every rank's contributions are distinct (its tiles, its key block), so the
parameter gradients are summed over the whole grid (one all-reduce of the flat gradient per
dtype, >= fp32); the gradients of ``m`` and ``z`` are their tiles' own (the contraction's
backward runs two more contractions on the grid).

Collectives. Forward: two all-gathers of ``[B, Nr/R, 1]`` and ``[B, Nr/R, 1, H]`` maxima along
the grid row, one all-reduce of ``[B, Nr/R, H]`` normalisers along the grid row, the contraction
(per rank ~ ``Sp c_h H Nc / R + Nr Nc H / C`` elements over SUMMA, ``2 q`` tiles on Cannon).
Backward: the normalisers' all-reduce, two contractions, the parameter-gradient all-reduce.

Memory saved for backward per rank: the serial module's activations for the MSA tile
(``[B, Sp/R, Nc/C, c_m + 2 H c_h]``) and the pair tile (``[B, Nr/R, Nc/C, c_z]`` for the norm,
the logits and weights ``[B, Nr/R, Nc/C, H]``), plus the contraction's operand copies (one MSA
tile of ``H c_h`` channels, one pair tile of ``H``): serial / P. Nothing N x N on any rank beyond
the local tile; nothing N x N x c_h at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.func import functional_call

from twinshard import comm
from twinshard.comm import primitives as P
from twinshard.pair.features import layout_of, with_layout
from twinshard.pair.layers.contraction import Contraction, grid_contract
from twinshard.pair.layers.tokenwise import replicated_params
from twinshard.pair.layers.triangle import pair_grid
from twinshard.pair.reference.pair_averaging import PairWeightedAveraging, pwa_mask_bias
from twinshard.pair.tiling import MSA, PAIR, check_placements, from_local
from twinshard.runtime.grid import ProcessGrid

__all__ = ["PWA_SPEC", "CPPairWeightedAveraging"]

_PER_CHANNEL = "bmkd,bknd->bmnd"
# O[(s, d), i, h] = sum_j V[(s, d), j, h] W[i, j, h]: X = V (stored [S c_h, N]), Y = W used transposed
PWA_SPEC = Contraction(False, True, _PER_CHANNEL, _PER_CHANNEL, _PER_CHANNEL, "pwa", kernel="bmm")


def _row_max(x: torch.Tensor, grid: ProcessGrid, dim: int, op: str) -> torch.Tensor:
    """Max over ``dim`` across the grid row (``dim`` kept as 1); no gradient."""
    m = x.detach().amax(dim=dim, keepdim=True)
    if grid.cols == 1:
        return m
    return P.all_gather(m.contiguous(), dim, grid.row_group, op=op).amax(dim=dim, keepdim=True)


def row_softmax(b: torch.Tensor, grid: ProcessGrid) -> torch.Tensor:
    """Softmax over the token dim 2 of a pair tile's ``b[B, I, J, H]`` whose ``j`` run over the grid
    row: the tile's weights ``[B, I, J, H]``, normalised over all ``j`` (``-inf`` entries get weight
    zero)."""
    shift = _row_max(b, grid, 2, "pwa:logit_max")
    p = torch.exp(b - shift)
    total = p.sum(dim=2, keepdim=True)
    if grid.cols > 1:
        total = comm.all_reduce(total, grid.row_group)
    return p / total


@dataclass(frozen=True)
class _TileArgs:
    mask: torch.Tensor  # [B, I, J] pair tile, padded keys zero
    key_real: torch.Tensor | None  # [J] bool, this tile's columns that are real tokens
    grid: ProcessGrid
    shapes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]  # V, W, O global (rows, cols)


class CPPairWeightedAveraging(PairWeightedAveraging):
    """Context-parallel pair-weighted averaging; parameters as the serial module (module doc).
    ``forward(m, z, mask=None, chunk_heads=False)`` on DTensors."""

    _on_tile: bool = False

    def forward(self, m: DTensor, z: DTensor, mask: DTensor | None = None, chunk_heads: bool = False) -> Any:
        if self._on_tile:
            return self._tile_forward(m, z, mask)
        what = type(self).__name__
        if not isinstance(m, DTensor) or not isinstance(z, DTensor):
            raise TypeError(f"{what} takes DTensors (m MSA, z pair) from twinshard.pair.features")
        check_placements(m, MSA, f"{what} input m", ndim=4)
        check_placements(z, PAIR, f"{what} input z", ndim=4)
        if m.shape[-1] != self.c_m or z.shape[-1] != self.c_z:
            raise ValueError(
                f"expected m[B, S, N, {self.c_m}] and z[B, N, N, {self.c_z}], got {tuple(m.shape)}, {tuple(z.shape)}"
            )
        if m.shape[0] != z.shape[0] or m.shape[2] != z.shape[2]:
            raise ValueError(f"{what}: m {tuple(m.shape)} and z {tuple(z.shape)} disagree on B or N")
        if z.device_mesh != m.device_mesh:
            raise ValueError(f"{what}: m and z live on different meshes")
        grid = pair_grid(z)
        if mask is not None:
            check_placements(mask, PAIR, f"{what} mask", ndim=3)
            if tuple(mask.shape) != tuple(z.shape[:3]):
                raise ValueError(
                    f"{what}: mask {tuple(mask.shape)} must be z's [B, N, N] {tuple(z.shape[:3])}"
                )
        layout = layout_of(m) or layout_of(z) or (layout_of(mask) if mask is not None else None)
        if layout is None:
            if mask is None:
                raise ValueError(
                    f"{what} (mask=None): neither m nor z carries a PairLayout and no mask was given, so "
                    "padded tokens cannot be told from real ones: keep the layout from "
                    "twinshard.pair.features on them (with_layout), or pass mask="
                )
            if z.shape[1] != z.shape[2]:
                raise ValueError(
                    f"{what}: z {tuple(z.shape)} is not square and carries no PairLayout that tells its padding"
                )
        z_local = z.to_local()
        mask_local = mask.to_local() if mask is not None else z_local.new_ones(z_local.shape[:3])
        key_real = None
        if layout is not None and layout.n_tokens < z.shape[2]:
            nJ = z_local.shape[2]
            c = grid.coords[1]
            key_real = torch.arange(c * nJ, (c + 1) * nJ, device=z_local.device) < layout.n_tokens
            mask_local = mask_local * key_real.to(mask_local.dtype)
        sp, nc, nr = m.shape[1], z.shape[2], z.shape[1]
        shapes = ((sp * self.c_h, nc), (nr, nc), (sp * self.c_h, nc))
        named = list(self.named_parameters())
        synced = replicated_params([p for _, p in named], z)  # distinct partials: summed over the grid
        args = _TileArgs(mask_local, key_real, grid, shapes)
        self._on_tile = True
        try:
            out = functional_call(
                self, {k: v for (k, _), v in zip(named, synced)}, (m.to_local(), z_local, args)
            )
        finally:
            self._on_tile = False
        out = from_local(out, m.device_mesh, MSA)
        return out if layout is None else with_layout(out, layout, "msa")

    def _tile_forward(self, m: torch.Tensor, z: torch.Tensor, args: _TileArgs) -> torch.Tensor:
        grid = args.grid
        v, g = self.project_m(m)  # [B, S_l, J_l, H, c_h], [B, S_l, J_l, H c_h]
        b = self.logits(z)  # [B, I, J, H], compute dtype
        ct = b.dtype
        mk = args.mask.to(ct)
        mb = pwa_mask_bias(mk, self.inf, _row_max(mk, grid, 2, "pwa:mask_max"))
        if args.key_real is not None:  # padded tokens: never averaged over
            mb = torch.where(args.key_real.view(1, 1, -1), mb, torch.full_like(mb, -float("inf")))
        w = row_softmax(b + mb.unsqueeze(-1), grid)
        bsz, s_l, j_l, h, d = v.shape
        # V[(s, d), j, h]: rows (s, d) with s major, so grid row r holds sequences block r
        vx = v.to(ct).permute(0, 1, 4, 2, 3).reshape(bsz, s_l * d, j_l, h)
        vs, ws, os_ = args.shapes
        o = grid_contract(vx, w, grid, PWA_SPEC, vs, ws, zshape=os_)  # [B, S_l d, I_c, H]
        o = o.reshape(bsz, s_l, d, o.shape[2], h).permute(0, 1, 3, 4, 2)  # [B, S_l, I_c, H, c_h]
        return self.project_out(o, g)

    def serial_forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The serial computation on plain tensors (no communication)."""
        return PairWeightedAveraging.forward(self, *args, **kwargs)
