"""CP twin of the triangle multiplicative update (outgoing and incoming) on a rows x cols grid.

Placements. In: pair ``z[B, Nr, Nc, dim]`` at ``(Shard(1), Shard(2))`` and its mask
``[B, Nr, Nc]`` at the same placements (N padded to a multiple of rows along dim 1 and of cols
along dim 2 by ``twinshard.pair.features``; Nr != Nc only with the layout that says so). Out:
``[B, Nr, Nc, dim]`` at ``(Shard(1), Shard(2))``,
carrying z's ``PairLayout``, padded entries exactly zero. The padding mask comes from the
layout z (or the mask) carries: with ``mask=None`` it is the whole mask, a given mask is
multiplied by it, so padding never leaks into real entries (``a`` and ``b`` are masked
before the contraction). Without a layout a mask is required (else: a clear error).

Computation. ``norm_in``, ``p_in``/``g_in`` gating, masking, ``norm_out``, ``p_out`` and
``g_out`` are token-local and run unchanged (the serial module's own methods) on the
local tile. The contraction over k is distributed (``twinshard.pair.layers.contraction``):
outgoing ``O = A B^T`` (B's tiles arrive grid-transposed), incoming ``O = A^T B`` (A's
tiles arrive grid-transposed); Cannon on square grids, SUMMA over k-segments on
rectangular ones.

Collectives. Forward: one skew exchange and q - 1 ring shifts of the ``a`` and ``b``
tiles, each shift in ``RING_CHUNKS`` channel chunks (Cannon; ~2 N^2 h / sqrt(P) elements
per rank), or one exchange per operand per k-segment (SUMMA: k cut at every tile edge and
to segments of at most ``SEGMENT_BUDGET`` of the output tile; N^2 h (1/R + 1/C) per rank). Backward: two more distributed contractions
(``dA`` and ``dB``, each the same schedule as the forward, tagged ``:backward`` in
the ledger) and one all-reduce of the flat parameter gradient over the grid (>= fp32).

Wire dtype. With bf16/fp16 activations ``a``, ``b`` (and the output's gradient) travel and are
saved in the activation dtype (exact: they are activation values upcast); every block product
accumulates in fp32 and the result is rounded once to the activation dtype, as the serial
``project_out`` does. The local products are channel-first batched matmuls (operands laid out
once per call, see ``Contraction.kernel``).

Memory saved for backward per rank: what the serial module saves, for one tile
(serial / P): the token-local activations plus the ``a`` and ``b`` tiles. Transient
memory: one output tile, plus on square grids the skewed ``a`` and ``b`` tiles and one channel
chunk of each in flight; on rectangular grids one SUMMA segment's pieces in use, the next in
flight and the copies sent, each at most one output tile. Measured peak per rank (N=24,
c=h=8, fp64, ``twinshard bench pair``): 1.06 x serial / P on 2x2, 1.07 on 3x3, 1.00 on 2x3;
c=h=32 on 2x3: 1.03 at N=100, 1.08 at N=49, 1.16 at N=25 (padding 1.02, 1.06, 1.12).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from twinshard.pair.features import layout_of, with_layout
from twinshard.pair.layers.contraction import Contraction, grid_contract
from twinshard.pair.layers.tokenwise import TokenwiseTwin, mixing_layout
from twinshard.pair.reference.triangle import TriangleMultiplication
from twinshard.pair.tiling import PAIR, check_placements
from twinshard.runtime.grid import ProcessGrid, make_grid

__all__ = [
    "CPTriangleMultiplication",
    "CPTriangleMultiplicationIncoming",
    "CPTriangleMultiplicationOutgoing",
    "TRIMUL_SPECS",
]

_PER_CHANNEL = "bmkd,bknd->bmnd"  # one block product, channel by channel
TRIMUL_SPECS = {
    "outgoing": Contraction(
        False, True, _PER_CHANNEL, _PER_CHANNEL, _PER_CHANNEL, "trimul_out", kernel="bmm"
    ),
    "incoming": Contraction(True, False, _PER_CHANNEL, _PER_CHANNEL, _PER_CHANNEL, "trimul_in", kernel="bmm"),
}


def pair_grid(x: DTensor) -> ProcessGrid:
    """The ProcessGrid whose mesh ``x`` lives on (grids are cached per shape)."""
    grid = make_grid(tuple(x.device_mesh.shape))
    if grid.mesh != x.device_mesh:
        raise ValueError("the input lives on a mesh not built by twinshard.runtime.make_grid")
    return grid


class CPTriangleMultiplication(TriangleMultiplication, TokenwiseTwin):
    """Context-parallel triangle multiplication; parameters as the serial module (see module doc).

    ``forward(z, mask=None)``: with ``mask=None`` every real entry counts; the padding is
    masked from the layout ``z`` carries (raises when z has none and no mask is given).
    """

    def forward(
        self,
        z: DTensor | torch.Tensor,
        mask: DTensor | torch.Tensor | None = None,
        grid: ProcessGrid | None = None,
    ) -> DTensor | torch.Tensor:
        if self._on_tile:
            return self._tile_forward(z, mask, grid)
        check_placements(z, PAIR, f"{type(self).__name__} input z", ndim=4)
        if z.shape[-1] != self.dim:
            raise ValueError(f"expected a pair tensor [B, N, N, {self.dim}], got {tuple(z.shape)}")
        mask_local = None
        if mask is not None:
            check_placements(mask, PAIR, f"{type(self).__name__} mask", ndim=3)
            if tuple(mask.shape) != tuple(z.shape[:3]):
                raise ValueError(f"mask {tuple(mask.shape)} does not match z {tuple(z.shape)}")
            mask_local = mask.to_local()
        layout, keep = mixing_layout(z, mask, "pair", f"{type(self).__name__} (mask=None)")
        if keep is not None:  # this tile holds padding: it never counts, whatever the mask says
            keep = keep.to(z.dtype).expand(z.to_local().shape[:3])
            mask_local = keep if mask_local is None else mask_local * keep
        out = self.tile_forward(z, mask_local, pair_grid(z))
        if layout is not None and layout_of(out) is None:  # the layout came with the mask
            out = with_layout(out, layout, "pair")
        return out

    def _tile_forward(self, z: torch.Tensor, mask: torch.Tensor | None, grid: ProcessGrid) -> torch.Tensor:
        a, b, x = self.project_in(z, mask)
        shape = (z.shape[1] * grid.rows, z.shape[2] * grid.cols)  # (Nr, Nc), also a's and b's
        # bf16/fp16 activations: a and b are z.dtype values upcast for the sum, so their tiles are
        # stored and sent in z.dtype exactly; the fp32 sum is rounded once, as project_out would.
        wire = z.dtype if a.dtype != z.dtype else None
        spec = TRIMUL_SPECS[self.direction]
        o = grid_contract(a, b, grid, spec, shape, shape, wire_dtype=wire, out_dtype=wire, zshape=shape)
        return self.project_out(o, x)


class CPTriangleMultiplicationOutgoing(CPTriangleMultiplication):
    """CP twin of AF3 Algorithm 12 (``o_ij = sum_k a_ik b_jk``)."""

    def __init__(self, dim: int, hidden: int | None = None):
        super().__init__(dim, "outgoing", hidden)


class CPTriangleMultiplicationIncoming(CPTriangleMultiplication):
    """CP twin of AF3 Algorithm 13 (``o_ij = sum_k a_ki b_kj``)."""

    def __init__(self, dim: int, hidden: int | None = None):
        super().__init__(dim, "incoming", hidden)
