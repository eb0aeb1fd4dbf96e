"""Linear layers with the AlphaFold3 / Boltz-2 initialisation conventions.

AF3 (supplement, section 3.x "Linear" conventions) uses four initialisers:
``"default"`` (LeCun: truncated normal, variance 1 / fan_in), ``"relu"`` (He:
variance 2 / fan_in), ``"final"`` (weights zero, so a residual branch starts as
the identity) and ``"gating"`` (weights zero, bias one, so a sigmoid gate starts
near open). Biases are zero unless stated. The forward is plain ``F.linear``:
a module converted with ``.double()`` computes in fp64.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["Linear", "init_linear"]

# Standard deviation of a unit normal truncated to [-2, 2]: dividing by it makes
# the truncated draw have the intended variance.
_TRUNC_STD = 0.87962566103423978

INITS = ("default", "relu", "final", "gating")


def init_linear(layer: nn.Linear, init: str = "default") -> None:
    """Initialise ``layer`` in place with one of the AF3 schemes (see module docstring)."""
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}; choose one of {INITS}")
    w = layer.weight
    with torch.no_grad():
        if init in ("default", "relu"):
            scale = (1.0 if init == "default" else 2.0) / max(1, w.shape[1])
            std = math.sqrt(scale) / _TRUNC_STD
            nn.init.trunc_normal_(w, mean=0.0, std=std, a=-2.0 * std, b=2.0 * std)
        else:
            w.zero_()
        if layer.bias is not None:
            layer.bias.fill_(1.0 if init == "gating" else 0.0)


class Linear(nn.Linear):
    """``y = x W^T + b`` over the last dim, AF3-initialised.

    Parameters: ``weight [out, in]`` and, when ``bias=True``, ``bias [out]`` (the
    nn.Linear names, so Boltz/AF3 checkpoints load unchanged).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        init: str = "default",
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.init = init
        init_linear(self, init)

    def reset_parameters(self) -> None:
        # nn.Linear.__init__ calls this before self.init exists; AF3 init is applied afterwards.
        if hasattr(self, "init"):
            init_linear(self, self.init)
        else:
            super().reset_parameters()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, init={self.init!r}"
