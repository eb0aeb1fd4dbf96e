"""Pair-weighted averaging: the MSA's row update from the pair representation (AlphaFold3
supplement, Algorithm 10, as Boltz-2's ``PairWeightedAveraging``).

For an MSA ``m[B, S, N, c_m]``, a pair representation ``z[B, N, N, c_z]`` and a pair mask
``mask[B, N, N]``, with ``H`` heads of width ``c_h``::

    m      <- LayerNorm(m);  z <- LayerNorm(z)                    # norm_m, norm_z
    v      <- m W_m            [B, S, N, H, c_h]                    # proj_m (no bias)
    g      <- sigmoid(m W_g)   [B, S, N, H * c_h]                   # proj_g (no bias)
    b      <- z W_z            [B, N, N, H]                         # proj_z (no bias)
    w_ij   <- softmax_j(b_ij - inf (1 - mask_ij))                   # per head, over j
    o_si   <- sum_j w_ij v_sj  (per head), flattened h * c_h + d
    out    <- (g * o) W_o                                           # proj_o (no bias, "final")

Masking. Boltz adds ``-inf (1 - mask_ij)`` (``inf = 1e6``) to the logits. In exact arithmetic
a row whose entries are all masked is then a softmax of ``b_ij`` alone (the shift is the same
for every j); Boltz computes ``b_ij - 1e6`` and so rounds every logit of such a row to
ulp(1e6) ~ 1e-10. Here the mask bias is ``inf (mask_ij - 1) max_j mask_ij``: the same function
(masked entries of a row with a valid entry get ``-inf``; a fully masked row gets no bias),
without that rounding. The softmax and the average run in ``promote_types(dtype, float32)``.

Names and registration order follow Boltz-2: ``norm_m, norm_z, proj_m, proj_g, proj_z,
proj_o``, attributes ``c_m, c_z, c_h, num_heads, inf``; ``proj_o`` is "final"-initialised.
Boltz's ``chunk_heads`` (eval mode, N > 384: heads one at a time) computes the same function;
it is accepted and changes nothing here.
"""

from __future__ import annotations

import torch
from torch import nn

from twinshard.pair.reference.linear import Linear
from twinshard.pair.reference.norm import LayerNorm, compute_dtype

__all__ = ["PairWeightedAveraging", "pwa_mask_bias"]


def pwa_mask_bias(mask: torch.Tensor, inf: float, row_max: torch.Tensor) -> torch.Tensor:
    """``inf (mask - 1) row_max``: ``-inf`` on masked entries of a row that has a valid entry
    (``row_max = max_j mask_ij`` is 1), nothing on a fully masked row (``row_max`` 0)."""
    return inf * (mask - 1) * row_max


class PairWeightedAveraging(nn.Module):
    """Serial pair-weighted averaging (module docstring). ``forward(m, z, mask=None,
    chunk_heads=False) -> update of m``, ``[B, S, N, c_m]``."""

    def __init__(self, c_m: int, c_z: int, c_h: int, num_heads: int, inf: float = 1e6):
        super().__init__()
        self.c_m = c_m
        self.c_z = c_z
        self.c_h = c_h
        self.num_heads = num_heads
        self.inf = inf
        self.norm_m = LayerNorm(c_m)
        self.norm_z = LayerNorm(c_z)
        self.proj_m = Linear(c_m, c_h * num_heads, bias=False, init="default")
        self.proj_g = Linear(c_m, c_h * num_heads, bias=False, init="default")
        self.proj_z = Linear(c_z, num_heads, bias=False, init="default")
        self.proj_o = Linear(c_h * num_heads, c_m, bias=False, init="final")

    def project_m(self, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-local: values ``v[B, S, N, H, c_h]`` and the gate ``g[B, S, N, H * c_h]``."""
        x = self.norm_m(m)
        v = self.proj_m(x)
        return v.reshape(*v.shape[:3], self.num_heads, self.c_h), torch.sigmoid(self.proj_g(x))

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """Pair-local: the per-head logits ``b[B, N, N, H]`` in the compute dtype."""
        return self.proj_z(self.norm_z(z)).to(compute_dtype(z.dtype))

    def project_out(self, o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Token-local: ``o[B, S, N, H, c_h]`` gated and projected to ``c_m``."""
        o = o.reshape(*o.shape[:3], self.num_heads * self.c_h).to(g.dtype)
        return self.proj_o(g * o)

    def forward(
        self, m: torch.Tensor, z: torch.Tensor, mask: torch.Tensor | None = None, chunk_heads: bool = False
    ) -> torch.Tensor:
        if m.dim() != 4 or m.shape[-1] != self.c_m:
            raise ValueError(f"expected an MSA m[B, S, N, {self.c_m}], got {tuple(m.shape)}")
        b_, _, n = m.shape[:3]
        if z.dim() != 4 or tuple(z.shape[:3]) != (b_, n, n) or z.shape[-1] != self.c_z:
            raise ValueError(f"expected z[B, N, N, {self.c_z}] with m's B, N, got {tuple(z.shape)}")
        if mask is None:
            mask = z.new_ones(z.shape[:3])
        if tuple(mask.shape) != tuple(z.shape[:3]):
            raise ValueError(f"mask must be [B, N, N] = {tuple(z.shape[:3])}, got {tuple(mask.shape)}")
        v, g = self.project_m(m)
        b = self.logits(z)
        ct = b.dtype
        mk = mask.to(ct)
        b = b + pwa_mask_bias(mk, self.inf, mk.amax(dim=-1, keepdim=True)).unsqueeze(-1)
        w = torch.softmax(b, dim=2)  # over j
        o = torch.einsum("bijh,bsjhd->bsihd", w, v.to(ct))
        return self.project_out(o, g)

    def extra_repr(self) -> str:
        return f"c_m={self.c_m}, c_z={self.c_z}, c_h={self.c_h}, num_heads={self.num_heads}, inf={self.inf}"
