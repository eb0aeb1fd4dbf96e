"""Triangle multiplicative update, outgoing and incoming (AlphaFold3 supplement, Alg. 12/13).

For a pair representation ``z[B, N, N, c]`` and a pair mask ``mask[B, N, N]``::

    x      <- LayerNorm(z)                                   # norm_in
    a, b   <- sigmoid(x W_g) * (x W_p) * mask                # g_in, p_in: c -> 2 h, split
    o_ij   <- sum_k a_ik * b_jk        (outgoing, Alg. 12)
    o_ij   <- sum_k a_ki * b_kj        (incoming, Alg. 13)
    out    <- sigmoid(x W_go) * (LayerNorm(o) W_po)          # g_out, norm_out, p_out

Module and parameter names follow Boltz-2 (``norm_in, p_in, g_in, norm_out, p_out, g_out``,
registered in that order; every projection bias-free). ``a`` is the first half of the
``p_in``/``g_in`` channels, ``b`` the second (Boltz's ``chunk(2, dim=-1)``). The contraction
runs in ``promote_types(dtype, float32)``: fp64 inputs stay fp64, bf16 accumulates in fp32.

The module is split into :meth:`project_in`, :meth:`contract` and :meth:`project_out` so the
context-parallel twin reuses the token-local parts unchanged and swaps only the contraction.
"""

from __future__ import annotations

import torch
from torch import nn

from twinshard.comm.amp import fp32_region
from twinshard.pair.reference.linear import Linear
from twinshard.pair.reference.norm import LayerNorm, compute_dtype

__all__ = [
    "TriangleMultiplication",
    "TriangleMultiplicationIncoming",
    "TriangleMultiplicationOutgoing",
    "triangle_contract",
]

DIRECTIONS = ("outgoing", "incoming")


def triangle_contract(a: torch.Tensor, b: torch.Tensor, direction: str) -> torch.Tensor:
    """The triangle contraction over the shared index k, per channel.

    outgoing: ``o[b, i, j, d] = sum_k a[b, i, k, d] b[b, j, k, d]``;
    incoming: ``o[b, i, j, d] = sum_k a[b, k, i, d] b[b, k, j, d]``.
    """
    with fp32_region(a.device.type):  # Boltz's .float() einsum: autocast off, a and b >= fp32
        if direction == "outgoing":
            return torch.einsum("bikd,bjkd->bijd", a, b)
        if direction == "incoming":
            return torch.einsum("bkid,bkjd->bijd", a, b)
    raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")


class TriangleMultiplication(nn.Module):
    """Serial triangle multiplicative update on ``z[B, N, N, dim]`` (see module docstring).

    ``hidden`` (the channel count of ``a`` and ``b``) defaults to ``dim``, as in Boltz-2.
    """

    def __init__(self, dim: int, direction: str = "outgoing", hidden: int | None = None):
        super().__init__()
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        hidden = dim if hidden is None else int(hidden)
        self.direction = direction
        self.dim = dim
        self.hidden = hidden
        self.norm_in = LayerNorm(dim)
        self.p_in = Linear(dim, 2 * hidden, bias=False, init="default")
        self.g_in = Linear(dim, 2 * hidden, bias=False, init="gating")
        self.norm_out = LayerNorm(hidden)
        self.p_out = Linear(hidden, dim, bias=False, init="final")
        self.g_out = Linear(dim, dim, bias=False, init="gating")

    # -- token-local parts (reused verbatim by the CP twin on its tiles) ----------------------
    def project_in(
        self, z: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(a, b, x)``: gated, masked projections in the compute dtype and the normed input."""
        x = self.norm_in(z)
        ab = self.p_in(x) * torch.sigmoid(self.g_in(x))
        if mask is not None:
            ab = ab * mask.unsqueeze(-1).to(ab.dtype)
        ab = ab.to(compute_dtype(z.dtype))
        a, b = ab.chunk(2, dim=-1)
        return a, b, x

    def project_out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Output gating: ``sigmoid(g_out(x)) * p_out(norm_out(o))`` in the input dtype."""
        o = self.p_out(self.norm_out(o.to(x.dtype)))
        return o * torch.sigmoid(self.g_out(x))

    def contract(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return triangle_contract(a, b, self.direction)

    def forward(self, z: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``z[B, N, N, dim]``, optional ``mask[B, N, N]`` (1 keeps, 0 drops) -> same as z."""
        if z.dim() != 4 or z.shape[1] != z.shape[2] or z.shape[-1] != self.dim:
            raise ValueError(f"expected a pair tensor [B, N, N, {self.dim}], got {tuple(z.shape)}")
        if mask is not None and tuple(mask.shape) != tuple(z.shape[:3]):
            raise ValueError(f"mask must be [B, N, N] = {tuple(z.shape[:3])}, got {tuple(mask.shape)}")
        a, b, x = self.project_in(z, mask)
        return self.project_out(self.contract(a, b), x)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, hidden={self.hidden}, direction={self.direction!r}"


class TriangleMultiplicationOutgoing(TriangleMultiplication):
    """AF3 Algorithm 12: ``o_ij = sum_k a_ik b_jk`` (edges leaving i and j)."""

    def __init__(self, dim: int, hidden: int | None = None):
        super().__init__(dim, "outgoing", hidden)


class TriangleMultiplicationIncoming(TriangleMultiplication):
    """AF3 Algorithm 13: ``o_ij = sum_k a_ki b_kj`` (edges entering i and j)."""

    def __init__(self, dim: int, hidden: int | None = None):
        super().__init__(dim, "incoming", hidden)
