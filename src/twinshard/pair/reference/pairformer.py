"""The Pairformer layer and stack (AlphaFold3 supplement, Algorithm 17), as Boltz-2 runs it.

One layer, for a single representation ``s[B, N, c_s]``, a pair representation ``z[B, N, N,
c_z]``, a token mask ``mask[B, N]`` and a pair mask ``pair_mask[B, N, N]``::

    z <- z + Dropout_row(TriangleMultiplicationOutgoing(z, pair_mask))
    z <- z + Dropout_row(TriangleMultiplicationIncoming(z, pair_mask))
    z <- z + Dropout_row(TriangleAttentionStartingNode(z, pair_mask))
    z <- z + Dropout_col(TriangleAttentionEndingNode(z, pair_mask))
    z <- z + Transition(z)
    s' <- LayerNorm(s)                                   # pre_norm_s
    s <- s + AttentionPairBias(s', z, mask, k_in=s')
    s <- s + Transition(s)
    s <- s_post_norm(s)                                  # LayerNorm if post_layer_norm, else identity

No dropout on the single track and none after the transitions (as published and as Boltz-2).
The dropout rate is ``dropout`` (AF3: 0.25; Boltz-2's inference config: 0). ``convention``
picks the dropout masks (``twinshard.pair.reference.dropout``): ``"boltz"`` (default) drops
whole rows ``[B, N, 1, 1]`` after the first three updates and whole columns ``[B, 1, N, 1]``
after the ending-node attention; ``"af3"`` shares ``[B, 1, N, c]`` across rows, then
``[B, N, 1, c]`` across columns. Either way masks are keyed by global index; each site draws its
own stream (``assign_dropout_streams``: the stack assigns them from the sites' qualified names
when built; a lone layer needs the call), and ``forward(..., seed=...)`` picks the step.

Names and registration order follow Boltz-2's ``PairformerLayer`` / ``PairformerModule``
(``v2=True``): ``pre_norm_s, attention, tri_mul_out, tri_mul_in, tri_att_start, tri_att_end,
transition_s, transition_z, s_post_norm`` and ``layers.<i>``; the dropout sites
(``dropout_tri_mul_out`` ...) have no parameters, so a Boltz-2 ``state_dict`` loads unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from twinshard.comm.amp import fp32_region
from twinshard.pair.reference.attention import AttentionPairBias
from twinshard.pair.reference.dropout import CONVENTIONS, Dropout, assign_dropout_streams
from twinshard.pair.reference.norm import LayerNorm
from twinshard.pair.reference.transition import Transition
from twinshard.pair.reference.triangle import TriangleMultiplicationIncoming, TriangleMultiplicationOutgoing
from twinshard.pair.reference.triangle_attention import (
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
)

__all__ = ["PairformerLayer", "PairformerNoSeqLayer", "PairformerNoSeqModule", "PairformerStack"]


@dataclass(frozen=True)
class PairformerParts:
    """The module classes a Pairformer layer is built from: the serial ones (``SERIAL_PARTS``) or
    their CP twins (``pair.layers.pairformer``), so both register the same names in one order."""

    layer_norm: type[nn.Module]
    attention: type[nn.Module]
    tri_mul_out: type[nn.Module]
    tri_mul_in: type[nn.Module]
    tri_att_start: type[nn.Module]
    tri_att_end: type[nn.Module]
    transition: type[nn.Module]
    dropout: type[nn.Module]


SERIAL_PARTS = PairformerParts(
    LayerNorm,
    AttentionPairBias,
    TriangleMultiplicationOutgoing,
    TriangleMultiplicationIncoming,
    TriangleAttentionStartingNode,
    TriangleAttentionEndingNode,
    Transition,
    Dropout,
)


def build_layer(
    layer: nn.Module,
    parts: PairformerParts,
    token_s: int,
    token_z: int,
    num_heads: int,
    dropout: float,
    pairwise_head_width: int,
    pairwise_num_heads: int,
    post_layer_norm: bool,
    convention: str,
) -> None:
    """Register a Pairformer layer's settings and parts on ``layer`` in Boltz-2's order (the
    order ``named_parameters()`` and a Boltz ``state_dict`` follow)."""
    if convention not in CONVENTIONS:
        raise ValueError(f"dropout convention must be one of {CONVENTIONS}, got {convention!r}")
    layer.token_s = token_s
    layer.token_z = token_z
    layer.num_heads = num_heads
    layer.dropout = float(dropout)
    layer.post_layer_norm = bool(post_layer_norm)
    layer.convention = convention
    layer.pre_norm_s = parts.layer_norm(token_s)
    layer.attention = parts.attention(token_s, token_z, num_heads)
    layer.tri_mul_out = parts.tri_mul_out(token_z)
    layer.tri_mul_in = parts.tri_mul_in(token_z)
    layer.tri_att_start = parts.tri_att_start(token_z, pairwise_head_width, pairwise_num_heads, inf=1e9)
    layer.tri_att_end = parts.tri_att_end(token_z, pairwise_head_width, pairwise_num_heads, inf=1e9)
    layer.transition_s = parts.transition(token_s, 4 * token_s)
    layer.transition_z = parts.transition(token_z, 4 * token_z)
    layer.s_post_norm = parts.layer_norm(token_s) if layer.post_layer_norm else nn.Identity()
    layer.dropout_tri_mul_out = parts.dropout(dropout, convention=convention)
    layer.dropout_tri_mul_in = parts.dropout(dropout, convention=convention)
    layer.dropout_tri_att_start = parts.dropout(dropout, convention=convention)
    layer.dropout_tri_att_end = parts.dropout(dropout, columnwise=True, convention=convention)


def build_stack(
    stack: nn.Module,
    layer_cls: type[nn.Module],
    token_s: int,
    token_z: int,
    num_blocks: int,
    num_heads: int,
    dropout: float,
    pairwise_head_width: int,
    pairwise_num_heads: int,
    post_layer_norm: bool,
    activation_checkpointing: bool,
    convention: str,
) -> None:
    """``num_blocks`` layers of ``layer_cls`` on ``stack.layers``, then one dropout stream per
    site from its qualified name (the same for the serial stack and its twin)."""
    stack.token_s = token_s
    stack.token_z = token_z
    stack.num_blocks = int(num_blocks)
    stack.activation_checkpointing = bool(activation_checkpointing)
    layer_args = (num_heads, dropout, pairwise_head_width, pairwise_num_heads, post_layer_norm, convention)
    stack.layers = nn.ModuleList(layer_cls(token_s, token_z, *layer_args) for _ in range(stack.num_blocks))
    assign_dropout_streams(stack)


class PairformerLayer(nn.Module):
    """One Pairformer block (see module docstring); ``forward(s, z, mask, pair_mask, seed=None)
    -> (s, z)``."""

    def __init__(
        self,
        token_s: int,
        token_z: int,
        num_heads: int = 16,
        dropout: float = 0.25,
        pairwise_head_width: int = 32,
        pairwise_num_heads: int = 4,
        post_layer_norm: bool = False,
        convention: str = "boltz",
    ):
        super().__init__()
        build_layer(
            self,
            SERIAL_PARTS,
            token_s,
            token_z,
            num_heads,
            dropout,
            pairwise_head_width,
            pairwise_num_heads,
            post_layer_norm,
            convention,
        )

    def pair_stack(self, z: torch.Tensor, pair_mask: torch.Tensor, seed: int | None = None) -> torch.Tensor:
        """The pair half of the layer: four dropped-out residual updates and the transition."""
        z = z + self.dropout_tri_mul_out(self.tri_mul_out(z, pair_mask), seed)
        z = z + self.dropout_tri_mul_in(self.tri_mul_in(z, pair_mask), seed)
        z = z + self.dropout_tri_att_start(self.tri_att_start(z, pair_mask), seed)
        z = z + self.dropout_tri_att_end(self.tri_att_end(z, pair_mask), seed)
        return z + self.transition_z(z)

    def single_stack(self, s: torch.Tensor, z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The single half: attention with pair bias (keys from the normed ``s``), transition."""
        with fp32_region(s.device.type):  # Boltz: the attention half with autocast off
            s_normed = self.pre_norm_s(s)
            s = s + self.attention(s_normed, z, mask, k_in=s_normed)
        s = s + self.transition_s(s)
        return self.s_post_norm(s)

    def forward(
        self,
        s: torch.Tensor,
        z: torch.Tensor,
        mask: torch.Tensor | None = None,
        pair_mask: torch.Tensor | None = None,
        seed: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``s[B, N, token_s]``, ``z[B, N, N, token_z]``, ``mask[B, N]`` and ``pair_mask[B, N, N]``
        (default: all ones) -> ``(s, z)``. ``seed`` is required in training mode with dropout."""
        if (
            s.dim() != 3
            or z.dim() != 4
            or tuple(z.shape[:2]) != tuple(s.shape[:2])
            or z.shape[1] != z.shape[2]
        ):
            raise ValueError(
                f"expected s[B, N, c_s] and z[B, N, N, c_z], got {tuple(s.shape)} and {tuple(z.shape)}"
            )
        if mask is None:
            mask = s.new_ones(s.shape[:2])
        if pair_mask is None:
            pair_mask = mask[:, :, None] * mask[:, None, :]
        z = self.pair_stack(z, pair_mask, seed)
        return self.single_stack(s, z, mask), z

    def extra_repr(self) -> str:
        return (
            f"token_s={self.token_s}, token_z={self.token_z}, num_heads={self.num_heads}, "
            f"dropout={self.dropout}, convention={self.convention!r}"
        )


class PairformerStack(nn.Module):
    """``num_blocks`` Pairformer layers in sequence (Boltz-2's ``PairformerModule``).

    Dropout streams are assigned from the qualified site names at construction
    (``layers.<i>.dropout_tri_mul_out`` ...), so every site draws its own mask and a twin with the
    same names draws the same ones. ``activation_checkpointing`` recomputes each layer in
    backward (``torch.utils.checkpoint``, non-reentrant); the counter-based dropout redraws the
    same masks, so the result is unchanged.
    """

    def __init__(
        self,
        token_s: int,
        token_z: int,
        num_blocks: int,
        num_heads: int = 16,
        dropout: float = 0.25,
        pairwise_head_width: int = 32,
        pairwise_num_heads: int = 4,
        post_layer_norm: bool = False,
        activation_checkpointing: bool = False,
        convention: str = "boltz",
    ):
        super().__init__()
        build_stack(
            self,
            PairformerLayer,
            token_s,
            token_z,
            num_blocks,
            num_heads,
            dropout,
            pairwise_head_width,
            pairwise_num_heads,
            post_layer_norm,
            activation_checkpointing,
            convention,
        )

    def forward(
        self,
        s: torch.Tensor,
        z: torch.Tensor,
        mask: torch.Tensor | None = None,
        pair_mask: torch.Tensor | None = None,
        seed: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the layers in order: ``(s, z) -> (s, z)`` (arguments as ``PairformerLayer``)."""
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                s, z = checkpoint(layer, s, z, mask, pair_mask, seed, use_reentrant=False)
            else:
                s, z = layer(s, z, mask, pair_mask, seed)
        return s, z


# -- the pair half alone (Boltz-2's PairformerNoSeqLayer / PairformerNoSeqModule) -----------------


def build_noseq_layer(
    layer: nn.Module,
    parts: PairformerParts,
    token_z: int,
    dropout: float,
    pairwise_head_width: int,
    pairwise_num_heads: int,
    post_layer_norm: bool,
    convention: str,
) -> None:
    """Register a no-sequence Pairformer layer's settings and parts on ``layer`` in Boltz-2's
    order: ``tri_mul_out, tri_mul_in, tri_att_start, tri_att_end, transition_z``, then the four
    parameterless dropout sites. ``post_layer_norm`` is stored, as Boltz stores it, and never
    applied (Boltz's ``PairformerNoSeqLayer`` has no normalisation after the transition)."""
    if convention not in CONVENTIONS:
        raise ValueError(f"dropout convention must be one of {CONVENTIONS}, got {convention!r}")
    layer.token_z = token_z
    layer.dropout = float(dropout)
    layer.post_layer_norm = bool(post_layer_norm)
    layer.convention = convention
    layer.tri_mul_out = parts.tri_mul_out(token_z)
    layer.tri_mul_in = parts.tri_mul_in(token_z)
    layer.tri_att_start = parts.tri_att_start(token_z, pairwise_head_width, pairwise_num_heads, inf=1e9)
    layer.tri_att_end = parts.tri_att_end(token_z, pairwise_head_width, pairwise_num_heads, inf=1e9)
    layer.transition_z = parts.transition(token_z, 4 * token_z)
    layer.dropout_tri_mul_out = parts.dropout(dropout, convention=convention)
    layer.dropout_tri_mul_in = parts.dropout(dropout, convention=convention)
    layer.dropout_tri_att_start = parts.dropout(dropout, convention=convention)
    layer.dropout_tri_att_end = parts.dropout(dropout, columnwise=True, convention=convention)


def build_noseq_stack(
    stack: nn.Module,
    layer_cls: type[nn.Module],
    token_z: int,
    num_blocks: int,
    dropout: float,
    pairwise_head_width: int,
    pairwise_num_heads: int,
    post_layer_norm: bool,
    activation_checkpointing: bool,
    convention: str,
) -> None:
    """``num_blocks`` no-sequence layers on ``stack.layers``, then one dropout stream per site
    from its qualified name (the same for the serial module and its twin)."""
    stack.token_z = token_z
    stack.num_blocks = int(num_blocks)
    stack.dropout = float(dropout)
    stack.post_layer_norm = bool(post_layer_norm)
    stack.activation_checkpointing = bool(activation_checkpointing)
    layer_args = (dropout, pairwise_head_width, pairwise_num_heads, post_layer_norm, convention)
    stack.layers = nn.ModuleList(layer_cls(token_z, *layer_args) for _ in range(stack.num_blocks))
    assign_dropout_streams(stack)


def check_pair_input(z: torch.Tensor, what: str) -> None:
    if z.dim() != 4 or z.shape[1] != z.shape[2]:
        raise ValueError(f"{what}: expected z[B, N, N, c_z], got {tuple(z.shape)}")


class PairformerNoSeqLayer(nn.Module):
    """The pair half of a Pairformer layer (Boltz-2's ``PairformerNoSeqLayer``, used by the MSA
    and template modules)::

        z <- z + Dropout_row(TriangleMultiplicationOutgoing(z, pair_mask))
        z <- z + Dropout_row(TriangleMultiplicationIncoming(z, pair_mask))
        z <- z + Dropout_row(TriangleAttentionStartingNode(z, pair_mask))
        z <- z + Dropout_col(TriangleAttentionEndingNode(z, pair_mask))
        z <- z + Transition(z)

    ``forward(z, pair_mask=None, seed=None) -> z``; dropout as ``PairformerLayer`` (a lone
    layer needs ``assign_dropout_streams``; ``seed`` in training mode with dropout)."""

    PARTS = SERIAL_PARTS  # the CP twin's: CP_PARTS

    def __init__(
        self,
        token_z: int,
        dropout: float = 0.25,
        pairwise_head_width: int = 32,
        pairwise_num_heads: int = 4,
        post_layer_norm: bool = False,
        convention: str = "boltz",
    ):
        super().__init__()
        build_noseq_layer(
            self,
            self.PARTS,
            token_z,
            dropout,
            pairwise_head_width,
            pairwise_num_heads,
            post_layer_norm,
            convention,
        )

    pair_stack = PairformerLayer.pair_stack

    def forward(
        self, z: torch.Tensor, pair_mask: torch.Tensor | None = None, seed: int | None = None
    ) -> torch.Tensor:
        check_pair_input(z, type(self).__name__)
        if pair_mask is None:
            pair_mask = z.new_ones(z.shape[:3])
        return self.pair_stack(z, pair_mask, seed)

    def extra_repr(self) -> str:
        return f"token_z={self.token_z}, dropout={self.dropout}, convention={self.convention!r}"


class PairformerNoSeqModule(nn.Module):
    """``num_blocks`` no-sequence Pairformer layers in sequence (Boltz-2's
    ``PairformerNoSeqModule``): ``forward(z, pair_mask=None, seed=None) -> z``. Dropout streams
    and activation checkpointing as ``PairformerStack``."""

    LAYER: type[nn.Module] = PairformerNoSeqLayer  # the CP twin's: CPPairformerNoSeqLayer

    def __init__(
        self,
        token_z: int,
        num_blocks: int,
        dropout: float = 0.25,
        pairwise_head_width: int = 32,
        pairwise_num_heads: int = 4,
        post_layer_norm: bool = False,
        activation_checkpointing: bool = False,
        convention: str = "boltz",
    ):
        super().__init__()
        build_noseq_stack(
            self,
            self.LAYER,
            token_z,
            num_blocks,
            dropout,
            pairwise_head_width,
            pairwise_num_heads,
            post_layer_norm,
            activation_checkpointing,
            convention,
        )

    def forward(
        self, z: torch.Tensor, pair_mask: torch.Tensor | None = None, seed: int | None = None
    ) -> torch.Tensor:
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                z = checkpoint(layer, z, pair_mask, seed, use_reentrant=False)
            else:
                z = layer(z, pair_mask, seed)
        return z
