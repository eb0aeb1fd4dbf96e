"""CP twin of the outer product mean (MSA -> pair) on a rows x cols grid.

Placements. In: MSA ``m[B, Sp, Nc, c_in]`` at ``(Shard(1), Shard(2))`` (sequences over
grid rows, tokens over grid columns) and its mask ``[B, Sp, Nc]`` at the same placements
(Sp padded to a multiple of rows, N to a multiple of cols, Nc, by ``twinshard.pair.features``).
Out: pair ``z[B, Nr, Nc, c_out]`` at ``(Shard(1), Shard(2))`` (Nr: N padded to a multiple of
rows, from m's layout; without one Nr = Nc, which must then be a multiple of rows too),
carrying m's ``PairLayout`` (as a pair tensor), padded entries exactly zero. The padding
(sequences and tokens) is masked from the layout m (or the mask) carries: the whole mask
when ``mask=None``, a factor of a given mask, so padded sequences are never counted.
Without a layout a mask is required (else: a clear error).

Computation. ``norm``, ``proj_a``, ``proj_b`` and the masking are token-local on the MSA
tile. The sum over sequences ``O = A^T (x) B`` (an outer product in the channels,
contracted over s) is a distributed contraction whose reduction index s runs over the
grid rows (``twinshard.pair.layers.contraction``: Cannon on square grids with A's tiles
arriving grid-transposed, SUMMA over s-segments otherwise). The pair counts
``sum_s mask_si mask_sj`` are the same contraction on the mask (one channel, no grad).
``O / max(1, count)`` and ``proj_o`` are pair-tile local. Nothing larger than a pair
tile x c_hidden^2 (the accumulator) exists on any rank.

Collectives. Forward: the contraction of the ``a``/``b`` MSA tiles (c_hidden channels)
and of the mask (1 channel): Cannon skew + q - 1 ring shifts, or one exchange per operand per
s-segment. Backward: ``dO`` (c_hidden^2 channels) never moves. For ``dA`` and ``dB`` the
``b``/``a`` MSA tiles travel to the ``dO`` tiles and the partial gradients (MSA tiles)
travel to their owners: on square grids ring shifts plus one delivery, on rectangular
grids one operand fetch and one partial scatter per grid row (~2-3x the forward's bytes
in all); the partials of one step travel while the next step's product runs. Plus one all-reduce of the flat parameter gradient over the grid (>= fp32).

Memory saved for backward per rank: the serial module's activations for one MSA tile
(LayerNorm, projections, ``a``/``b``) and one pair tile (the ``proj_o`` input, tile x
c_hidden^2): serial / P.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from twinshard.pair.features import layout_of, with_layout
from twinshard.pair.layers.contraction import Contraction, Tiled, grid_contract, grid_matmul
from twinshard.pair.layers.tokenwise import TokenwiseTwin, mixing_layout
from twinshard.pair.layers.triangle import pair_grid
from twinshard.pair.reference.outer_product import OuterProductMean
from twinshard.pair.tiling import MSA, check_placements
from twinshard.runtime.grid import ProcessGrid

__all__ = ["CPOuterProductMean", "OPM_SPEC"]

# X = A (stored [S, N], used transposed), Y = B: O[i, j, c, d] = sum_s A[s, i, c] B[s, j, d].
OPM_SPEC = Contraction(
    tx=True,
    ty=False,
    forward="bmkc,bknd->bmncd",
    grad_x="bmkd,bkncd->bmnc",  # dA[s, i, c] = sum_j B[s, j, d] dO[i, j, c, d]  (B, dO^T)
    grad_y="bmkc,bkncd->bmnd",  # dB[s, j, d] = sum_i A[s, i, c] dO[i, j, c, d]  (A^T^T, dO)
    tag="opm",
    stationary_grad=True,  # dO (c_hidden^2 channels) stays put on square grids
    kernel="outer",  # one [B, (i c), s] @ [B, s, (j d)] batched matmul per block
)
_COUNT = "bmkc,bknd->bmncd"


class CPOuterProductMean(OuterProductMean, TokenwiseTwin):
    """Context-parallel outer product mean; parameters as the serial module (see module doc)."""

    _out_kind = "pair"  # MSA in, pair out: the layout passes on as a pair tensor's

    def forward(
        self,
        m: DTensor | torch.Tensor,
        mask: DTensor | torch.Tensor | None = None,
        grid: ProcessGrid | None = None,
    ) -> DTensor | torch.Tensor:
        if self._on_tile:
            return self._tile_forward(m, mask, grid)
        check_placements(m, MSA, f"{type(self).__name__} input m", ndim=4)
        if m.shape[-1] != self.c_in:
            raise ValueError(f"expected an MSA [B, S, N, {self.c_in}], got {tuple(m.shape)}")
        grid = pair_grid(m)
        if mask is not None:
            check_placements(mask, MSA, f"{type(self).__name__} mask", ndim=3)
            if tuple(mask.shape) != tuple(m.shape[:3]):
                raise ValueError(f"mask {tuple(mask.shape)} does not match m {tuple(m.shape)}")
        layout, keep = mixing_layout(m, mask, "msa", f"{type(self).__name__} (mask=None)")
        n_rows = m.shape[2] if layout is None else layout.padded[0]  # the output's Nr
        if n_rows % grid.rows:
            raise ValueError(
                f"token count {m.shape[2]} is not a multiple of the {grid.rows} grid rows: pad N "
                "with twinshard.pair.features (its layout pads each token axis for its grid axis)"
            )
        shape = m.to_local().shape[:3]
        mask_local = torch.ones(shape, dtype=m.dtype, device=m.device) if mask is None else mask.to_local()
        if keep is not None:  # padded sequences and tokens are never counted
            mask_local = mask_local * keep.to(mask_local.dtype).expand(shape)
        out = self.tile_forward(m, mask_local, (grid, n_rows))
        if layout is not None and layout_of(out) is None:  # the layout came with the mask
            out = with_layout(out, layout, "pair")
        return out

    def _tile_forward(
        self, m: torch.Tensor, mask: torch.Tensor, where: tuple[ProcessGrid, int]
    ) -> torch.Tensor:
        grid, n_rows = where
        a, b = self.project_in(m, mask)
        s, n = m.shape[1] * grid.rows, m.shape[2] * grid.cols
        zshape = (n_rows, n)
        with torch.no_grad():
            mk = mask.to(a.dtype).unsqueeze(-1).contiguous()
            count = grid_matmul(
                grid, Tiled(mk, s, n), True, Tiled(mk, s, n), False, _COUNT, "opm_count", out=zshape
            )
            count = count.reshape(*count.shape[:3], 1).clamp(min=1)
        # bf16/fp16 MSA: a and b are m.dtype values upcast, so they travel in m.dtype exactly;
        # the sum (divided by the counts before rounding, as serial) stays in fp32.
        wire = m.dtype if a.dtype != m.dtype else None
        o = grid_contract(a, b, grid, OPM_SPEC, (s, n), (s, n), wire_dtype=wire, zshape=zshape)
        o = o.reshape(*o.shape[:3], self.c_hidden * self.c_hidden) / count
        # The output is a pair tile: rows block r of Nr, columns block c of Nc.
        return self.project_out(o, m.dtype)
