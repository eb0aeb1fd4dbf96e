"""SwiGLU transition (AlphaFold3 supplement, Algorithm 11).

    x <- LayerNorm(x)
    a <- LinearNoBias(x);  b <- LinearNoBias(x)      # c -> n c, n = 4
    x <- LinearNoBias(swish(a) * b)                  # n c -> c

Module and parameter names follow Boltz-2 (``norm``, ``fc1``, ``fc2``, ``fc3``),
in registration order ``norm.weight, norm.bias, fc1.weight, fc2.weight,
fc3.weight``. ``fc3`` is "final"-initialised (zeros), so a fresh transition adds
nothing to its residual stream. The transition is token-local: it acts on each
position (single, pair or MSA entry) independently.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from twinshard.pair.reference.linear import Linear
from twinshard.pair.reference.norm import LayerNorm

__all__ = ["Transition"]


class Transition(nn.Module):
    """SwiGLU transition on the last dim: ``dim -> hidden -> out_dim`` (hidden = 4 dim)."""

    def __init__(self, dim: int, hidden: int | None = None, out_dim: int | None = None, expansion: int = 4):
        super().__init__()
        hidden = expansion * dim if hidden is None else hidden
        out_dim = dim if out_dim is None else out_dim
        self.norm = LayerNorm(dim)
        self.fc1 = Linear(dim, hidden, bias=False, init="default")
        self.fc2 = Linear(dim, hidden, bias=False, init="default")
        self.fc3 = Linear(hidden, out_dim, bias=False, init="final")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.fc3(F.silu(self.fc1(x)) * self.fc2(x))
