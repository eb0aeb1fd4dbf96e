"""CP twin of ``twinshard.pair.reference.Linear``.

Placements: in = out, any placement that keeps the channel dim whole (pair
``(Shard(1), Shard(2))``, single ``(Shard(1), Replicate())``, MSA, replicated).
Collectives: none forward; backward one all-reduce of ``[weight, bias]`` (flat,
>= fp32) over the sharded mesh axes. Saved for backward per rank: the input
tile, i.e. serial / P for pair and MSA activations, serial / rows for single.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from twinshard.pair.layers.tokenwise import TokenwiseTwin
from twinshard.pair.reference.linear import Linear

__all__ = ["CPLinear"]


class CPLinear(Linear, TokenwiseTwin):
    """``y = x W^T + b`` on each tile; parameters ``weight``, ``bias`` as the serial Linear."""

    def forward(self, x: DTensor) -> DTensor:
        if self._on_tile:
            return Linear.forward(self, x)
        return self.tile_forward(x)

    def serial_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The serial computation on a plain tensor (no communication)."""
        return Linear.forward(self, x)
