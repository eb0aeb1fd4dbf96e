"""CP twin of the row-/column-wise ``Dropout``: the same mask as serial on any grid.

Placements: in = out, for ``x[..., R, C, c]`` with any placement of the two
spatial dims (pair ``(Shard(1), Shard(2))``, MSA sequences x tokens). Each rank
draws the mask only for its tile, keyed by the GLOBAL (batch, row or column,
channel) index (``twinshard.rng``), so the assembled mask equals the
serial one bit for bit; padding sits after the real entries and does not shift
their indices. Collectives: none, forward or backward. Saved for backward per
rank: the tile's mask, ``[B, 1, C/cols, c]`` (row-wise) or ``[B, R/rows, 1, c]``
(column-wise), serial / cols or serial / rows. The output carries the input's
``PairLayout`` with padding zeroed (``twinshard.pair.features``).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from twinshard.pair.layers.tokenwise import _check_tokenwise_input, carry_layout
from twinshard.pair.reference.dropout import Dropout
from twinshard.pair.tiling import from_local, local_offsets

__all__ = ["CPDropout"]


class CPDropout(Dropout):
    """``Dropout(p, columnwise, stream)`` on DTensors; identity in eval mode or at p = 0."""

    def forward(self, x: DTensor, seed: int | None = None) -> DTensor:
        x = _check_tokenwise_input(x, "CPDropout")
        if not self.active():
            return x
        if seed is None:
            raise ValueError("CPDropout in training mode needs seed=<int>, the same on every rank")
        if x.ndim < 3:
            raise ValueError(f"dropout needs x[..., R, C, c], got shape {tuple(x.shape)}")
        off = local_offsets(x.shape, x.device_mesh, x.placements)
        local = x.to_local()
        mask = self.mask(local.shape, seed, local.dtype, local.device, row_offset=off[-3], col_offset=off[-2])
        return carry_layout(from_local(local * mask, x.device_mesh, x.placements), x)

    def serial_forward(self, x: torch.Tensor, seed: int | None = None) -> torch.Tensor:
        return Dropout.forward(self, x, seed)
