"""Triangle attention around the starting and the ending node (AlphaFold3 supplement, Alg. 14/15).

For a pair representation ``z[B, N, N, c]`` and a pair mask ``mask[B, N, N]``, starting node::

    x          <- LayerNorm(z)                                      # layer_norm
    q, k, v    <- x W_q / sqrt(c_h), x W_k, x W_v                   # mha.linear_q/k/v: c -> H c_h
    b_jk^h     <- x_jk W_b                                          # linear: c -> H
    g_ij       <- sigmoid(x_ij W_g)                                 # mha.linear_g
    a_ijk^h    <- softmax_k(q_ij^h . k_ik^h + b_jk^h + mask_bias_ik)
    o_ij       <- (g_ij * sum_k a_ijk^h v_ik^h) W_o                 # mha.linear_o: H c_h -> c

Ending node (Alg. 15) is the starting node applied to ``z`` transposed (``z_ji``, ``mask_ji``),
with the output transposed back: ``a_ijk = softmax_k(q_ij . k_kj + b_ki)``, ``o_ij = g_ij *
sum_k a_ijk v_kj``.

Masking. Keys ``(i, k)`` with ``mask_ik = 0`` get ``mask_bias = -inf`` (Boltz-2/OpenFold add
``inf * (mask - 1)`` with ``inf = 1e9``), so their weight is exactly zero. A row with no valid
key at all gets ``mask_bias = 0`` instead: Boltz adds ``-1e9`` to every logit of such a row,
which a softmax cancels in exact arithmetic (shift invariance), but in floating point it rounds
every logit to a grid of ``ulp(1e9) ~ 1.2e-7``; dropping the shift gives Boltz's exact-arithmetic
result without that noise, so a reordered (distributed) evaluation can match to round-off.

Names and registration order follow Boltz-2 (an OpenFold port): ``layer_norm, linear,
mha.linear_q, mha.linear_k, mha.linear_v, mha.linear_o, mha.linear_g``, all bias-free, so a
Boltz-2 ``TriangleAttention`` ``state_dict`` loads unchanged. ``c_hidden`` is the per-head
width. Initialisation as OpenFold: Glorot-uniform ``q, k, v``, normal(0, 1/fan_in) ``linear``,
"final" ``linear_o``, "gating" ``linear_g``. The softmax runs in
``promote_types(dtype, float32)``, by the attention backend (``backend=``, None: the context's;
``twinshard.pair.reference.attention_backends``; not a parameter).

The module is split into :meth:`TriangleAttention.project`, :func:`attend` and
:meth:`TriangleAttention.project_out` so the context-parallel twin reuses the token-local parts
unchanged and swaps only the attention over ``k``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from twinshard.comm.amp import fp32_region
from twinshard.pair.reference.attention_backends import biased_attention, resolve_backend
from twinshard.pair.reference.linear import Linear
from twinshard.pair.reference.norm import LayerNorm, compute_dtype

__all__ = [
    "TriangleAttention",
    "TriangleAttentionEndingNode",
    "TriangleAttentionStartingNode",
    "attend",
    "key_mask_bias",
]


def key_mask_bias(mask: torch.Tensor, inf: float, dtype: torch.dtype) -> torch.Tensor:
    """Additive bias ``inf * (mask - 1)`` over the last (key) axis of ``mask``, zero on rows
    without any valid key (module docstring: Boltz's ``-inf`` shift there cancels exactly)."""
    m = mask.to(dtype)
    return inf * (m - 1) * m.amax(dim=-1, keepdim=True)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mask_bias: torch.Tensor,
    backend: str = "reference",
) -> torch.Tensor:
    """Biased softmax attention along the row, per head.

    ``q, k, v[B, I, H, J, c_h]`` (``q`` already scaled), ``bias[B, H, J, K]`` (the triangle
    bias, shared by every row ``i``), ``mask_bias[B, I, K]`` -> ``o[B, I, H, J, c_h]`` with
    ``o_ij = sum_k softmax_k(q_ij . k_ik + bias_jk + mask_bias_ik) v_ik``, in the compute dtype,
    by ``backend`` (``attention_backends``; for a fused kernel the additive bias
    ``bias_jk + mask_bias_ik`` is formed as one ``[B, I, H, J, K]`` tensor, the size of the
    reference's logits, but no probabilities are saved for backward).
    """
    ct = compute_dtype(q.dtype)
    if backend != "reference":
        with fp32_region(q.device.type):
            full = bias.to(ct).unsqueeze(1) + mask_bias.to(ct)[:, :, None, None, :]
            o, _ = biased_attention(
                q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), full.flatten(0, 1), backend
            )
            return o.unflatten(0, q.shape[:2])
    with fp32_region(q.device.type):  # Boltz: the softmax region with autocast off
        logits = torch.einsum("bihjd,bihkd->bihjk", q.to(ct), k.to(ct))
        logits = logits + bias.to(ct).unsqueeze(1) + mask_bias.to(ct)[:, :, None, None, :]
        return torch.einsum("bihjk,bihkd->bihjd", logits.softmax(dim=-1), v.to(ct))


def _glorot_uniform_(w: torch.Tensor) -> None:
    nn.init.xavier_uniform_(w)


def _normal_fan_in_(w: torch.Tensor) -> None:
    nn.init.normal_(w, std=1.0 / math.sqrt(max(1, w.shape[1])))


class _TriangleMHA(nn.Module):
    """The projections of triangle attention (Boltz-2's ``mha``: ``linear_q/k/v/o/g``)."""

    def __init__(self, c_in: int, c_hidden: int, no_heads: int):
        super().__init__()
        width = c_hidden * no_heads
        self.linear_q = Linear(c_in, width, bias=False)
        self.linear_k = Linear(c_in, width, bias=False)
        self.linear_v = Linear(c_in, width, bias=False)
        self.linear_o = Linear(width, c_in, bias=False, init="final")
        self.linear_g = Linear(c_in, width, bias=False, init="gating")
        with torch.no_grad():
            for lin in (self.linear_q, self.linear_k, self.linear_v):
                _glorot_uniform_(lin.weight)


class TriangleAttention(nn.Module):
    """Serial triangle attention on ``z[B, N, N, c_in]`` (see module docstring).

    ``starting=True``: around the starting node (Alg. 14); ``False``: the ending node (Alg. 15).
    Boltz-2's Pairformer uses ``c_hidden=32, no_heads=4, inf=1e9``.
    """

    def __init__(
        self,
        c_in: int,
        c_hidden: int = 32,
        no_heads: int = 4,
        starting: bool = True,
        inf: float = 1e9,
        backend: str | None = None,
    ):
        super().__init__()
        self.c_in = c_in
        self.c_hidden = c_hidden
        self.no_heads = no_heads
        self.starting = bool(starting)
        self.inf = float(inf)
        self.backend = None if backend is None else resolve_backend(backend)  # None: the context's
        self.layer_norm = LayerNorm(c_in)
        self.linear = Linear(c_in, no_heads, bias=False)
        with torch.no_grad():
            _normal_fan_in_(self.linear.weight)
        self.mha = _TriangleMHA(c_in, c_hidden, no_heads)

    # -- token-local parts (reused verbatim by the CP twin on its tiles) ----------------------
    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, I, J, H c_h] -> [B, I, H, J, c_h]``."""
        return t.unflatten(-1, (self.no_heads, self.c_hidden)).transpose(-2, -3)

    def project(
        self, z: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, k, v, bias, g)`` of the starting-node form for ``z`` (already transposed for
        the ending node): ``q, k, v[B, I, H, J, c_h]`` with ``q`` scaled, ``bias[B, H, I, J]``,
        ``g[B, I, J, H c_h]`` (the sigmoid gate)."""
        x = self.layer_norm(z)
        q = self._heads(self.mha.linear_q(x)) / math.sqrt(self.c_hidden)
        k = self._heads(self.mha.linear_k(x))
        v = self._heads(self.mha.linear_v(x))
        bias = self.linear(x).permute(0, 3, 1, 2)
        g = torch.sigmoid(self.mha.linear_g(x))
        return q, k, v, bias, g

    def project_out(self, o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``o[B, I, H, J, c_h]`` -> ``(g * o) W_o`` as ``[B, I, J, c_in]`` in ``g``'s dtype."""
        o = o.transpose(-2, -3).flatten(-2).to(g.dtype)
        return self.mha.linear_o(g * o)

    def forward(self, z: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``z[B, N, N, c_in]``, optional ``mask[B, N, N]`` (1 keeps, 0 drops) -> same shape as z."""
        if z.dim() != 4 or z.shape[1] != z.shape[2] or z.shape[-1] != self.c_in:
            raise ValueError(f"expected a pair tensor [B, N, N, {self.c_in}], got {tuple(z.shape)}")
        if mask is None:
            mask = z.new_ones(z.shape[:3])
        if tuple(mask.shape) != tuple(z.shape[:3]):
            raise ValueError(f"mask must be [B, N, N] = {tuple(z.shape[:3])}, got {tuple(mask.shape)}")
        if not self.starting:
            z, mask = z.transpose(1, 2), mask.transpose(1, 2)
        q, k, v, bias, g = self.project(z)
        mb = key_mask_bias(mask, self.inf, q.dtype)
        o = self.project_out(attend(q, k, v, bias, mb, resolve_backend(self.backend)), g)
        return o if self.starting else o.transpose(1, 2)

    def extra_repr(self) -> str:
        node = "starting" if self.starting else "ending"
        return f"c_in={self.c_in}, c_hidden={self.c_hidden}, no_heads={self.no_heads}, {node} node, inf={self.inf:g}"


class TriangleAttentionStartingNode(TriangleAttention):
    """AF3 Algorithm 14: each row ``i`` attends along itself, biased by ``b_jk``."""

    def __init__(
        self, c_in: int, c_hidden: int = 32, no_heads: int = 4, inf: float = 1e9, backend: str | None = None
    ):
        super().__init__(c_in, c_hidden, no_heads, starting=True, inf=inf, backend=backend)


class TriangleAttentionEndingNode(TriangleAttention):
    """AF3 Algorithm 15: each column ``j`` attends along itself, biased by ``b_ki``."""

    def __init__(
        self, c_in: int, c_hidden: int = 32, no_heads: int = 4, inf: float = 1e9, backend: str | None = None
    ):
        super().__init__(c_in, c_hidden, no_heads, starting=False, inf=inf, backend=backend)
