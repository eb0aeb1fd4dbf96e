"""Layer normalisation over the channel (last) dimension, computed in >= fp32.

Inputs in bf16/fp16 are normalised in fp32 and cast back; fp32 stays fp32 and
fp64 stays fp64 (``torch.promote_types(dtype, torch.float32)``), so an fp64
parity run has no hidden fp32 step. Parameter names are nn.LayerNorm's
(``weight``, ``bias``), which AF3/Boltz checkpoints use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LayerNorm", "compute_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype internal reductions run in: at least fp32, never lower than the input."""
    return torch.promote_types(dtype, torch.float32)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (default eps 1e-5, as AF3/Boltz) that normalises in >= fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ct = compute_dtype(x.dtype)
        w = None if self.weight is None else self.weight.to(ct)
        b = None if self.bias is None else self.bias.to(ct)
        return F.layer_norm(x.to(ct), self.normalized_shape, w, b, self.eps).to(x.dtype)
