"""Attention with pair bias on the single track (AlphaFold3 supplement, Algorithm 24, beta = 0).

For a single representation ``s[B, N, c_s]`` (already layer-normed by the caller, as in the
Pairformer: Boltz-2's ``pre_norm_s``), a pair representation ``z[B, N, N, c_z]`` and a token
mask ``mask[B, N]``::

    q_i^h   <- s_i W_q + b_q                 (per head, width c_s / H)    # proj_q
    k_j^h, v_j^h <- k_in_j W_k, k_in_j W_v   (k_in = s by default)         # proj_k, proj_v
    b_ij^h  <- LayerNorm(z_ij) W_z                                          # proj_z.0, proj_z.1
    g_i     <- sigmoid(s_i W_g)                                             # proj_g
    a_ij^h  <- softmax_j(q_i^h . k_j^h / sqrt(c_s / H) + b_ij^h + mask_bias_j)
    o_i     <- (g_i * concat_h sum_j a_ij^h v_j^h) W_o                     # proj_o

Masking: keys ``j`` with ``mask_j = 0`` get ``-inf`` (Boltz-2 adds ``(1 - mask) * -1e6``); a
sample with no valid token gets no mask bias (Boltz's shift cancels in the softmax; see
``triangle_attention``'s docstring for why the shift itself is dropped).

Names and registration order follow Boltz-2's ``attentionv2.AttentionPairBias``: ``proj_q``
(with bias), ``proj_k, proj_v, proj_g`` (bias-free), ``proj_z`` (a ``Sequential`` of a
LayerNorm and a bias-free linear to ``H``: keys ``proj_z.0.*``, ``proj_z.1.weight``),
``proj_o`` (bias-free, "final"-initialised), so its ``state_dict`` loads unchanged. The
attention runs in ``promote_types(dtype, float32)``, by the attention backend (``backend=``,
None: the context's, see ``twinshard.pair.reference.attention_backends``; not a parameter).

Split into :meth:`AttentionPairBias.project`, :func:`attend_single` and
:meth:`AttentionPairBias.project_out` so the CP twin swaps only the softmax over ``j``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from twinshard.comm.amp import fp32_region
from twinshard.pair.reference.attention_backends import biased_attention, resolve_backend
from twinshard.pair.reference.linear import Linear
from twinshard.pair.reference.norm import LayerNorm, compute_dtype
from twinshard.pair.reference.triangle_attention import key_mask_bias

__all__ = ["AttentionPairBias", "attend_single"]


def attend_single(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask_bias: torch.Tensor,
    backend: str = "reference",
) -> torch.Tensor:
    """``q[B, I, H, d]`` (scaled), ``k, v[B, J, H, d]``, ``bias[B, H, I, J]``, ``mask_bias[B, J]``
    -> ``o[B, I, H, d] = sum_j softmax_j(q_i . k_j + bias_ij + mask_bias_j) v_j`` (compute dtype),
    by ``backend`` (``twinshard.pair.reference.attention_backends``)."""
    ct = compute_dtype(q.dtype)
    if backend != "reference":
        with fp32_region(q.device.type):
            full = bias.to(ct) + mask_bias.to(ct)[:, None, None, :]
            o, _ = biased_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), full, backend)
            return o.transpose(1, 2)
    with fp32_region(q.device.type):  # Boltz: the softmax region with autocast off
        logits = torch.einsum("bihd,bjhd->bhij", q.to(ct), k.to(ct))
        logits = logits + bias.to(ct) + mask_bias.to(ct)[:, None, None, :]
        return torch.einsum("bhij,bjhd->bihd", logits.softmax(dim=-1), v.to(ct))


class AttentionPairBias(nn.Module):
    """Serial attention with pair bias (see module docstring). ``c_s`` must divide by ``num_heads``."""

    def __init__(self, c_s: int, c_z: int, num_heads: int, inf: float = 1e6, backend: str | None = None):
        super().__init__()
        if c_s % num_heads:
            raise ValueError(f"c_s = {c_s} must be a multiple of num_heads = {num_heads}")
        self.c_s = c_s
        self.c_z = c_z
        self.num_heads = num_heads
        self.head_dim = c_s // num_heads
        self.inf = float(inf)
        self.backend = None if backend is None else resolve_backend(backend)  # None: the context's
        self.proj_q = Linear(c_s, c_s, bias=True)
        self.proj_k = Linear(c_s, c_s, bias=False)
        self.proj_v = Linear(c_s, c_s, bias=False)
        self.proj_g = Linear(c_s, c_s, bias=False)
        self.proj_z = nn.Sequential(LayerNorm(c_z), Linear(c_z, num_heads, bias=False))
        self.proj_o = Linear(c_s, c_s, bias=False, init="final")

    def project(
        self, s: torch.Tensor, z: torch.Tensor, k_in: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, k, v, bias, g)``: ``q[B, N, H, d]`` scaled by ``1/sqrt(d)``, ``k, v[B, N, H, d]``,
        ``bias[B, H, N, N]`` from the pair, ``g[B, N, c_s]`` the sigmoid gate."""
        k_in = s if k_in is None else k_in
        heads = (self.num_heads, self.head_dim)
        q = self.proj_q(s).unflatten(-1, heads) / math.sqrt(self.head_dim)
        k = self.proj_k(k_in).unflatten(-1, heads)
        v = self.proj_v(k_in).unflatten(-1, heads)
        bias = self.proj_z(z).permute(0, 3, 1, 2)
        g = torch.sigmoid(self.proj_g(s))
        return q, k, v, bias, g

    def project_out(self, o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``o[B, N, H, d]`` -> ``(g * o) W_o`` as ``[B, N, c_s]`` in ``g``'s dtype."""
        return self.proj_o(g * o.flatten(-2).to(g.dtype))

    def forward(
        self,
        s: torch.Tensor,
        z: torch.Tensor,
        mask: torch.Tensor | None = None,
        k_in: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``s[B, N, c_s]``, ``z[B, N, N, c_z]``, optional token ``mask[B, N]`` and keys' input
        ``k_in[B, N, c_s]`` (default ``s``) -> update of ``s``, ``[B, N, c_s]``."""
        if s.dim() != 3 or s.shape[-1] != self.c_s:
            raise ValueError(f"expected a single tensor [B, N, {self.c_s}], got {tuple(s.shape)}")
        b, n = s.shape[:2]
        if tuple(z.shape) != (b, n, n, self.c_z):
            raise ValueError(
                f"expected a pair tensor [B, N, N, c_z] = {(b, n, n, self.c_z)}, got {tuple(z.shape)}"
            )
        if mask is None:
            mask = s.new_ones(b, n)
        if tuple(mask.shape) != (b, n):
            raise ValueError(f"mask must be [B, N] = {(b, n)}, got {tuple(mask.shape)}")
        q, k, v, bias, g = self.project(s, z, k_in)
        mb = key_mask_bias(mask, self.inf, q.dtype)
        o = attend_single(q, k, v, bias, mb, resolve_backend(self.backend))
        return self.project_out(o, g)

    def extra_repr(self) -> str:
        return f"c_s={self.c_s}, c_z={self.c_z}, num_heads={self.num_heads}, inf={self.inf:g}"
