"""The atom transformer: sequence-local attention over atoms (AlphaFold3 supplement, Algorithms 7
and 23-26; Boltz-2's ``transformersv2``).

Atoms ``[B, A, ...]`` (A a multiple of the query window W) are cut into ``K = A / W`` windows of W
consecutive queries. Window ``k`` attends to the H keys ``[W k - (H - W) / 2, W k + (H + W) / 2)``
(W = 32, H = 128: atoms ``[32 k - 48, 32 k + 80)``); keys outside ``[0, A)`` are zero, with mask
0 (Boltz-2's ``get_indexing_matrix`` / ``single_to_keys``, whose one-hot product selects the
same atoms exactly). :func:`window_keys` takes the keys of every window from a *frame*: a
``[B, L, ...]`` run of consecutive atoms starting ``(H - W) / 2`` atoms before the first
window's first query; the serial frame is the whole of ``[0, A)`` zero-padded at both ends. The
CP twin (``twinshard.pair.layers.atom_encoder``) builds its own frame (its atoms plus a halo)
and runs these modules unchanged.

Per layer (Algorithm 23, Boltz-2's ``DiffusionTransformerLayer``)::

    b <- AdaLN(a, s)                         # adaln: LayerNorm(a) scaled and shifted by s
    k_in <- keys of b (window_keys);  key_mask <- keys of the atom mask
    b <- AttentionPairBias(b, bias_l, key_mask, k_in)     # pair_bias_attn (bias precomputed)
    a <- a + sigmoid(s W + c) * b            # output_projection_linear (zero weight, bias -2)
    a <- a + ConditionedTransition(a, s)     # transition (Algorithm 25)
    a <- post_lnorm(a)                       # LayerNorm with post_layer_norm, else identity

The attention (``WindowAttention``, Boltz-2's ``attentionv2.AttentionPairBias`` with
``compute_pair_bias=False``): ``softmax_j(q_i . k_j / sqrt(d) + bias_ij - inf (1 - mask_j))``
with ``inf = 1e6`` as Boltz-2 adds it (no shift dropped: a masked key's logit is ``-1e6`` plus
O(1), whose ``exp`` is exactly 0 in fp32 and fp64 whenever one key of the window is real).

Names and registration order are Boltz-2's, so its ``state_dict`` loads unchanged:
``diffusion_transformer.layers.{l}.adaln.{s_norm.weight, s_scale.weight, s_scale.bias,
s_bias.weight}``, ``pair_bias_attn.{proj_q.weight, proj_q.bias, proj_k.weight, proj_v.weight,
proj_g.weight, proj_o.weight}``, ``output_projection_linear.{weight, bias}`` (also reachable as
``output_projection.0``), ``transition.{adaln.*, swish_gate.0.weight, a_to_b.weight,
b_to_a.weight, output_projection.0.{weight, bias}}``, ``post_lnorm.*``. Activation checkpointing
is accepted and stored; it changes no value, and these modules do not recompute.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from twinshard.pair.reference.linear import Linear
from twinshard.pair.reference.norm import LayerNorm, compute_dtype

__all__ = [
    "AdaLN",
    "AtomTransformer",
    "ConditionedTransitionBlock",
    "DiffusionTransformer",
    "DiffusionTransformerLayer",
    "WindowAttention",
    "check_windows",
    "frame_margin",
    "window_keys",
]


def check_windows(w: int, h: int) -> None:
    """Boltz-2's window shapes: W even, H a multiple of W / 2, H / (W / 2) even."""
    if w < 2 or w % 2 or h % (w // 2) or (h // (w // 2)) % 2 or h < w:
        raise ValueError(
            f"atom windows of {w} queries x {h} keys: W must be even and H a multiple of W / 2 with "
            "H / (W / 2) even and H >= W (Boltz-2's get_indexing_matrix)"
        )


def frame_margin(w: int, h: int) -> int:
    """Atoms a frame holds before the first window's first query: ``(H - W) / 2``."""
    return (h - w) // 2


def window_keys(frame: torch.Tensor, windows: int, w: int, h: int) -> torch.Tensor:
    """``[B, L, ...]`` frame -> ``[B, windows, H, ...]``: window k's keys are frame atoms
    ``[W k, W k + H)`` (the frame starts ``(H - W) / 2`` atoms before window 0's queries)."""
    need = w * (windows - 1) + h
    if frame.shape[1] < need:
        raise ValueError(f"a frame of {frame.shape[1]} atoms is too short for {windows} windows ({need})")
    x = frame[:, :need].unfold(1, h, w)  # [B, windows, ..., H]
    return x.movedim(-1, 2)


def serial_frame(x: torch.Tensor, w: int, h: int) -> torch.Tensor:
    """The serial frame of atoms ``x[B, A, ...]``: zeros, ``[0, A)``, zeros (``(H - W) / 2`` each)."""
    m = frame_margin(w, h)
    pad = [0, 0] * (x.ndim - 2) + [m, m]
    return F.pad(x, pad)


class AdaLN(nn.Module):
    """Adaptive LayerNorm (Algorithm 26): ``sigmoid(s_scale(LN(s))) * LN(a) + s_bias(LN(s))``."""

    def __init__(self, dim: int, dim_single_cond: int):
        super().__init__()
        self.a_norm = LayerNorm(dim, elementwise_affine=False, bias=False)
        self.s_norm = LayerNorm(dim_single_cond, bias=False)
        self.s_scale = Linear(dim_single_cond, dim)
        self.s_bias = Linear(dim_single_cond, dim, bias=False)

    def forward(self, a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        a = self.a_norm(a)
        s = self.s_norm(s)
        return torch.sigmoid(self.s_scale(s)) * a + self.s_bias(s)


def _gate_linear(d_in: int, d_out: int) -> Linear:
    """Boltz-2's output projections: weight zero, bias -2 (a gate that starts nearly shut)."""
    lin = Linear(d_in, d_out, init="final")
    with torch.no_grad():
        lin.bias.fill_(-2.0)
    return lin


class _SwiGLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, gates = x.chunk(2, dim=-1)
        return F.silu(gates) * x


class ConditionedTransitionBlock(nn.Module):
    """Algorithm 25: ``sigmoid(s W + c) * b_to_a(swiglu(AdaLN(a, s)) * a_to_b(AdaLN(a, s)))``."""

    def __init__(self, dim_single: int, dim_single_cond: int, expansion_factor: int = 2):
        super().__init__()
        self.adaln = AdaLN(dim_single, dim_single_cond)
        inner = int(dim_single * expansion_factor)
        self.swish_gate = nn.Sequential(Linear(dim_single, 2 * inner, bias=False), _SwiGLU())
        self.a_to_b = Linear(dim_single, inner, bias=False)
        self.b_to_a = Linear(inner, dim_single, bias=False)
        self.output_projection = nn.Sequential(_gate_linear(dim_single_cond, dim_single), nn.Sigmoid())

    def forward(self, a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        a = self.adaln(a, s)
        b = self.swish_gate(a) * self.a_to_b(a)
        return self.output_projection(s) * self.b_to_a(b)


class WindowAttention(nn.Module):
    """Attention with a precomputed pair bias, keys from ``k_in`` (Boltz-2's
    ``AttentionPairBias(compute_pair_bias=False)``; see the module docstring)."""

    def __init__(self, c_s: int, num_heads: int, inf: float = 1e6):
        super().__init__()
        if c_s % num_heads:
            raise ValueError(f"c_s = {c_s} must be a multiple of num_heads = {num_heads}")
        self.c_s, self.num_heads, self.head_dim, self.inf = c_s, num_heads, c_s // num_heads, float(inf)
        self.proj_q = Linear(c_s, c_s, bias=True)
        self.proj_k = Linear(c_s, c_s, bias=False)
        self.proj_v = Linear(c_s, c_s, bias=False)
        self.proj_g = Linear(c_s, c_s, bias=False)
        self.proj_o = Linear(c_s, c_s, bias=False, init="final")

    def forward(
        self, s: torch.Tensor, bias: torch.Tensor, key_mask: torch.Tensor, k_in: torch.Tensor
    ) -> torch.Tensor:
        """``s[Bw, W, c_s]`` queries, ``bias[Bw, W, H, heads]``, ``key_mask[Bw, H]``,
        ``k_in[Bw, H, c_s]`` -> ``[Bw, W, c_s]``."""
        heads = (self.num_heads, self.head_dim)
        q = self.proj_q(s).unflatten(-1, heads)
        k = self.proj_k(k_in).unflatten(-1, heads)
        v = self.proj_v(k_in).unflatten(-1, heads)
        g = torch.sigmoid(self.proj_g(s))
        ct = compute_dtype(q.dtype)
        logits = torch.einsum("bihd,bjhd->bhij", q.to(ct), k.to(ct)) / math.sqrt(self.head_dim)
        logits = logits + bias.to(ct).permute(0, 3, 1, 2)
        logits = logits + (1 - key_mask.to(ct)[:, None, None, :]) * -self.inf
        o = torch.einsum("bhij,bjhd->bihd", logits.softmax(dim=-1), v.to(ct)).to(v.dtype)
        return self.proj_o(g * o.flatten(-2))


class DiffusionTransformerLayer(nn.Module):
    """One layer of Algorithm 23 (module docstring)."""

    def __init__(
        self, heads: int, dim: int, dim_single_cond: int | None = None, post_layer_norm: bool = False
    ):
        super().__init__()
        dim_single_cond = dim if dim_single_cond is None else dim_single_cond
        self.adaln = AdaLN(dim, dim_single_cond)
        self.pair_bias_attn = WindowAttention(dim, heads)
        self.output_projection_linear = _gate_linear(dim_single_cond, dim)
        self.output_projection = nn.Sequential(self.output_projection_linear, nn.Sigmoid())
        self.transition = ConditionedTransitionBlock(dim, dim_single_cond)
        self.post_lnorm = LayerNorm(dim) if post_layer_norm else nn.Identity()

    def forward(
        self,
        a: torch.Tensor,
        s: torch.Tensor,
        bias: torch.Tensor,
        key_mask: torch.Tensor,
        to_keys: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> torch.Tensor:
        b = self.adaln(a, s)
        k_in = b if to_keys is None else to_keys(b)
        b = self.pair_bias_attn(b, bias, key_mask, k_in)
        a = a + self.output_projection(s) * b
        a = a + self.transition(a, s)
        return self.post_lnorm(a)


class DiffusionTransformer(nn.Module):
    """Algorithm 23: ``depth`` layers; the bias's channels are ``(depth, heads)``, layer major."""

    def __init__(
        self,
        depth: int,
        heads: int,
        dim: int = 384,
        dim_single_cond: int | None = None,
        pair_bias_attn: bool = True,
        activation_checkpointing: bool = False,
        post_layer_norm: bool = False,
    ):
        super().__init__()
        if not pair_bias_attn:
            raise NotImplementedError("DiffusionTransformer(pair_bias_attn=False) has no reference here")
        self.activation_checkpointing = activation_checkpointing
        self.pair_bias_attn = pair_bias_attn
        dim_single_cond = dim if dim_single_cond is None else dim_single_cond
        self.layers = nn.ModuleList(
            DiffusionTransformerLayer(heads, dim, dim_single_cond, post_layer_norm) for _ in range(depth)
        )

    def forward(
        self,
        a: torch.Tensor,
        s: torch.Tensor,
        bias: torch.Tensor,
        mask: torch.Tensor,
        to_keys: Callable[[torch.Tensor], torch.Tensor] | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``a, s[Bw, W, ...]``, ``bias[Bw, W, H, depth * heads]``, ``mask[Bw, W]``; the keys
        of ``x[Bw, W, ...]`` are ``to_keys(x)`` (``[Bw, H, ...]``; None: the queries themselves).
        ``key_mask[Bw, H]`` defaults to the keys of ``mask`` (the same for every layer)."""
        if key_mask is None:
            key_mask = mask if to_keys is None else to_keys(mask.unsqueeze(-1)).squeeze(-1)
        depth = len(self.layers)
        bias = bias.unflatten(-1, (depth, bias.shape[-1] // depth))
        for i, layer in enumerate(self.layers):
            a = layer(a, s, bias[..., i, :], key_mask, to_keys)
        return a


class AtomTransformer(nn.Module):
    """Algorithm 7: the diffusion transformer on windows of ``attn_window_queries`` atoms."""

    def __init__(self, attn_window_queries: int, attn_window_keys: int, **diffusion_transformer_kwargs):
        super().__init__()
        check_windows(attn_window_queries, attn_window_keys)
        self.attn_window_queries = attn_window_queries
        self.attn_window_keys = attn_window_keys
        self.diffusion_transformer = DiffusionTransformer(**diffusion_transformer_kwargs)

    def forward(
        self,
        q: torch.Tensor,
        c: torch.Tensor,
        bias: torch.Tensor,
        to_keys: Callable[[torch.Tensor], torch.Tensor],
        mask: torch.Tensor,
        multiplicity: int = 1,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``q, c[B, A, ...]`` (A = K W), ``bias[B, K, W, H, ...]``, ``to_keys(x[B, A, ...]) ->
        [B, K, H, ...]``, ``mask[B, A]``; ``key_mask[B, K, H]`` (default: the keys of ``mask``).
        With ``multiplicity`` m: ``q, c, mask`` hold ``B m`` samples (sample ``b m + j`` is the
        j-th of element b) and the bias (and a given key mask) of element b serves all m
        (Boltz-2's ``repeat_interleave``)."""
        w, h = self.attn_window_queries, self.attn_window_keys
        b, a, d = q.shape
        if multiplicity != 1:  # q, c, mask [B m, A, ...]; bias [B, K, W, H, ...] shared by the m samples
            bias = bias.repeat_interleave(multiplicity, 0)
            if key_mask is not None and key_mask.shape[0] != b:
                key_mask = key_mask.repeat_interleave(multiplicity, 0)
        if a % w:
            raise ValueError(f"{a} atoms are not a whole number of windows of {w}: pad A (Boltz pads it)")
        k = a // w
        bias = bias.reshape(b * k, w, h, bias.shape[-1])

        def keys(x: torch.Tensor) -> torch.Tensor:
            return to_keys(x.reshape(b, k * w, -1)).reshape(b * k, h, -1)

        if key_mask is not None:
            key_mask = key_mask.reshape(b * k, h)
        out = self.diffusion_transformer(
            q.reshape(b * k, w, d),
            c.reshape(b * k, w, -1),
            bias,
            mask.to(q.dtype).reshape(b * k, w),
            keys,
            key_mask,
        )
        return out.reshape(b, a, d)
