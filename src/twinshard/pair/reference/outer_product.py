"""Outer product mean: MSA -> pair update (AlphaFold3 supplement, Algorithm 9).

For an MSA ``m[B, S, N, c_in]`` and its mask ``mask[B, S, N]``::

    m      <- LayerNorm(m)                                      # norm
    a, b   <- (m W_a) * mask, (m W_b) * mask                    # proj_a, proj_b: c_in -> h
    o_ij   <- sum_s a_si (x) b_sj / max(1, sum_s mask_si mask_sj)   # masked mean over S
    z_ij   <- flatten(o_ij) W_o + bias                          # proj_o: h*h -> c_out

The masked mean divides by the number of sequences where both tokens are present,
clamped at one (Boltz-2's convention; AF3 writes a plain mean over S). The flatten
order is ``(c, d) -> c * h + d`` with ``c`` from ``a`` and ``d`` from ``b``. Names and
registration order follow Boltz-2: ``norm, proj_a, proj_b, proj_o``; ``proj_o`` is
"final"-initialised (weight and bias zero). The outer product runs in
``promote_types(dtype, float32)``.
"""

from __future__ import annotations

import torch
from torch import nn

from twinshard.comm.amp import fp32_region
from twinshard.pair.reference.linear import Linear
from twinshard.pair.reference.norm import LayerNorm, compute_dtype

__all__ = ["OuterProductMean", "outer_product_sum"]


def outer_product_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``o[b, i, j, c * h + d] = sum_s a[b, s, i, c] b[b, s, j, d]`` (flattened outer product)."""
    with fp32_region(a.device.type):  # Boltz's .float() einsum: autocast off, a and b >= fp32
        o = torch.einsum("bsic,bsjd->bijcd", a, b)
    return o.reshape(*o.shape[:3], a.shape[-1] * b.shape[-1])


class OuterProductMean(nn.Module):
    """Serial outer product mean (see module docstring)."""

    def __init__(self, c_in: int, c_hidden: int, c_out: int):
        super().__init__()
        self.c_in = c_in
        self.c_hidden = c_hidden
        self.c_out = c_out
        self.norm = LayerNorm(c_in)
        self.proj_a = Linear(c_in, c_hidden, bias=False, init="default")
        self.proj_b = Linear(c_in, c_hidden, bias=False, init="default")
        self.proj_o = Linear(c_hidden * c_hidden, c_out, bias=True, init="final")

    def project_in(self, m: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked projections ``(a, b)`` in the compute dtype (token-local)."""
        mk = mask.unsqueeze(-1).to(m.dtype)
        x = self.norm(m)
        ct = compute_dtype(m.dtype)
        return (self.proj_a(x) * mk).to(ct), (self.proj_b(x) * mk).to(ct)

    @staticmethod
    def pair_count(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``max(1, sum_s mask_si mask_sj)`` as ``[B, N, N, 1]``."""
        mk = mask.to(dtype)
        with fp32_region(mk.device.type):  # counts: exact in dtype (>= fp32), never autocast
            return torch.einsum("bsi,bsj->bij", mk, mk).clamp(min=1).unsqueeze(-1)

    def project_out(self, o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.proj_o(o.to(dtype))

    def forward(self, m: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``m[B, S, N, c_in]``, optional ``mask[B, S, N]`` -> ``z[B, N, N, c_out]``."""
        if m.dim() != 4 or m.shape[-1] != self.c_in:
            raise ValueError(f"expected an MSA [B, S, N, {self.c_in}], got {tuple(m.shape)}")
        if mask is None:
            mask = m.new_ones(m.shape[:3])
        if tuple(mask.shape) != tuple(m.shape[:3]):
            raise ValueError(f"mask must be [B, S, N] = {tuple(m.shape[:3])}, got {tuple(mask.shape)}")
        a, b = self.project_in(m, mask)
        o = outer_product_sum(a, b) / self.pair_count(mask, a.dtype)
        return self.project_out(o, m.dtype)

    def extra_repr(self) -> str:
        return f"c_in={self.c_in}, c_hidden={self.c_hidden}, c_out={self.c_out}"
