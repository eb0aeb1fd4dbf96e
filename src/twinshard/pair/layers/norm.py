"""CP twin of ``twinshard.pair.reference.LayerNorm`` (normalises the unsharded channel dim).

Placements: in = out (channel dim whole). Collectives: none forward; backward
one all-reduce of ``[weight, bias]`` over the sharded mesh axes, in >= fp32.
Saved for backward per rank: the input tile and per-token statistics of the
tile (serial / P for pair and MSA activations).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from twinshard.pair.layers.tokenwise import TokenwiseTwin
from twinshard.pair.reference.norm import LayerNorm

__all__ = ["CPLayerNorm"]


class CPLayerNorm(LayerNorm, TokenwiseTwin):
    """LayerNorm over channels on each tile; parameters ``weight``, ``bias`` as the serial one."""

    def forward(self, x: DTensor) -> DTensor:
        if self._on_tile:
            return LayerNorm.forward(self, x)
        return self.tile_forward(x)

    def serial_forward(self, x: torch.Tensor) -> torch.Tensor:
        return LayerNorm.forward(self, x)
