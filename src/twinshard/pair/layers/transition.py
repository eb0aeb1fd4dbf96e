"""CP twin of the SwiGLU ``Transition`` (AF3 Algorithm 11).

Placements: in = out (pair ``(Shard(1), Shard(2))``, single ``(Shard(1),
Replicate())`` or MSA; channel dim whole). Collectives: none forward; backward
one all-reduce of the five flattened parameters (``norm.weight, norm.bias,
fc1.weight, fc2.weight, fc3.weight``) over the sharded mesh axes, in >= fp32.
Saved for backward per rank: the serial transition's saved tensors for the
local tile only (input, normalised input, both hidden projections and the
gated product: about ``(2 + 3 * expansion) * tile`` elements, serial / P).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from twinshard.pair.layers.tokenwise import TokenwiseTwin
from twinshard.pair.reference.transition import Transition

__all__ = ["CPTransition"]


class CPTransition(Transition, TokenwiseTwin):
    """Same constructor, parameter names and order as the serial ``Transition``."""

    def forward(self, x: DTensor) -> DTensor:
        if self._on_tile:
            return Transition.forward(self, x)
        return self.tile_forward(x)

    def serial_forward(self, x: torch.Tensor) -> torch.Tensor:
        return Transition.forward(self, x)
