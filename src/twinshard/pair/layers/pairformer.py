"""CP twins of the Pairformer layer and stack (AF3 Alg. 17 as Boltz-2 runs it).

The serial modules in ``twinshard.pair.reference.pairformer`` are the specification; these run
the same order of updates on a rows x cols grid::

    z <- z + Dropout_row(TriMulOut(z)); z <- z + Dropout_row(TriMulIn(z))
    z <- z + Dropout_row(TriAttStart(z)); z <- z + Dropout_col(TriAttEnd(z)); z <- z + Transition(z)
    s' <- LayerNorm(s); s <- s + AttentionPairBias(s', z, mask, k_in=s'); s <- s + Transition(s)
    s <- s_post_norm(s)

Placements. In and out: single ``s[B, Nr, c_s]`` at ``(Shard(1), Replicate())``, pair ``z[B, Nr,
Nc, c_z]`` at ``(Shard(1), Shard(2))`` (N padded along each axis for its grid axis, see
``twinshard.pair.tiling``); optional token ``mask[B, Nr]`` (single) and ``pair_mask[B, Nr,
Nc]`` (pair). With both masks None the padding is masked from the layout the
tensors carry (``twinshard.pair.features``); a token mask without a pair mask raises (every
rank alike: ``distribute`` builds the pair mask, and the plain-tensor boundary
``twinshard.pair.layers.boundary`` builds it from the token mask as serial does). Residual sums
are ``pointwise`` adds of identical placements: the output carries the input's layout with its
padding exactly zero.

Parameters: the serial names in the serial order (``pre_norm_s, attention, tri_mul_out,
tri_mul_in, tri_att_start, tri_att_end, transition_s, transition_z, s_post_norm``;
``layers.<i>`` in the stack), so a serial (or Boltz-2) ``state_dict`` loads unchanged.
Dropout: ``CPDropout`` sites with the serial names, hence the serial streams
(``assign_dropout_streams``, called by the stack as by the serial stack); each rank draws the
mask of its tile keyed by global index, so the masks equal serial on any grid, in either
convention (``"boltz"`` by default).

Collectives, forward and backward: those of the parts, in the serial order (two triangle
multiplications, two triangle attentions, attention with pair bias, and the replicated
parameter-gradient all-reduces of every part); the stack adds one ``agree_scalars`` check
(an all-gather of a few Python scalars: ``CPPairformerStack.control_scalars``) per forward,
before the first layer and before any rank-local check of the inputs, so a value that differs
on one rank raises the same error on every rank.

Activation checkpointing (``activation_checkpointing=True`` on the stack): each layer runs
under ``torch.utils.checkpoint`` (non-reentrant) on its LOCAL tiles, with early stop off, so
the recompute in backward re-runs the whole layer forward: every collective of the layer, in
the forward order, on every rank (all ranks unpack the same first saved tensor of a layer at
the same point of the same backward graph). Saved per layer: its inputs' local tiles
(``s`` and ``z``); the recompute peak is one layer's saved activations on the tile, so a stack
of L layers holds L layer inputs plus one layer's activations per rank.

The no-sequence layer and stack (``CPPairformerNoSeqLayer``, ``CPPairformerNoSeqModule``: Boltz-2's
``PairformerNoSeqLayer``/``PairformerNoSeqModule``, the pair stack of the MSA and template
modules) run the pair half alone: ``z`` in and out at ``(Shard(1), Shard(2))``, optional
``pair_mask`` (pair), the same four triangle parts, dropout sites and transition as the pair half
above, the same collectives (two triangle multiplications, two triangle attentions, the
parameter-gradient all-reduces), the module one ``agree_scalars`` per forward; saved per rank
serial / P (tiles only, nothing N x N).

Memory saved for backward per rank (no checkpointing): the parts' tile activations, serial / P
for the pair-sized terms (the single-track terms are serial / rows; they are O(N c_s), not
O(N^2)).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from twinshard.comm.amp import fp32_region
from twinshard.pair.features import layout_of
from twinshard.pair.layers.attention import CPAttentionPairBias
from twinshard.pair.layers.dropout import CPDropout
from twinshard.pair.layers.norm import CPLayerNorm
from twinshard.pair.layers.tokenwise import checkpointed, pointwise
from twinshard.pair.layers.transition import CPTransition
from twinshard.pair.layers.triangle import CPTriangleMultiplicationIncoming, CPTriangleMultiplicationOutgoing
from twinshard.pair.layers.triangle_attention import (
    CPTriangleAttentionEndingNode,
    CPTriangleAttentionStartingNode,
)
from twinshard.pair.reference.attention_backends import backends_agreed, module_backends
from twinshard.pair.reference.pairformer import (
    PairformerNoSeqLayer,
    PairformerNoSeqModule,
    PairformerParts,
    build_layer,
    build_stack,
)
from twinshard.pair.tiling import PAIR, SINGLE, check_placements
from twinshard.runtime.agree import agree_scalars  # re-exported: it moved to the runtime

__all__ = [
    "CPPairformerLayer",
    "CPPairformerNoSeqLayer",
    "CPPairformerNoSeqModule",
    "CPPairformerStack",
    "agree_scalars",
]


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


CP_PARTS = PairformerParts(
    CPLayerNorm,
    CPAttentionPairBias,
    CPTriangleMultiplicationOutgoing,
    CPTriangleMultiplicationIncoming,
    CPTriangleAttentionStartingNode,
    CPTriangleAttentionEndingNode,
    CPTransition,
    CPDropout,
)


class _PlainArgs:
    """How ``twinshard.pair.layers.boundary.plain`` feeds the caller's full tensors."""

    PLAIN_IN_KINDS = {"s": "single", "z": "pair", "mask": "single", "pair_mask": "pair"}

    def plain_prepare(self, argv: dict[str, Any]) -> dict[str, Any]:
        """The serial default: a token mask without a pair mask implies their outer product."""
        mask = argv.get("mask")
        if mask is not None and argv.get("pair_mask") is None and not isinstance(mask, DTensor):
            argv["pair_mask"] = mask[:, :, None] * mask[:, None, :]
        return argv


class CPPairformerLayer(_PlainArgs, nn.Module):
    """Context-parallel Pairformer layer; the serial ``PairformerLayer``'s arguments and
    parameters (module docstring). ``forward(s, z, mask=None, pair_mask=None, seed=None) ->
    (s, z)`` on DTensors (for plain tensors see ``twinshard.pair.layers.boundary``)."""

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
        # registration order = the serial PairformerLayer's (so named_parameters() agree)
        build_layer(
            self,
            CP_PARTS,
            token_s,
            token_z,
            num_heads,
            dropout,
            pairwise_head_width,
            pairwise_num_heads,
            post_layer_norm,
            convention,
        )

    def pair_stack(self, z: DTensor, pair_mask: DTensor | None, seed: int | None = None) -> DTensor:
        """The pair half: four dropped-out residual updates and the transition."""
        z = pointwise(_add, z, self.dropout_tri_mul_out(self.tri_mul_out(z, pair_mask), seed))
        z = pointwise(_add, z, self.dropout_tri_mul_in(self.tri_mul_in(z, pair_mask), seed))
        z = pointwise(_add, z, self.dropout_tri_att_start(self.tri_att_start(z, pair_mask), seed))
        z = pointwise(_add, z, self.dropout_tri_att_end(self.tri_att_end(z, pair_mask), seed))
        return pointwise(_add, z, self.transition_z(z))

    def single_stack(self, s: DTensor, z: DTensor, mask: DTensor | None) -> DTensor:
        """The single half: attention with pair bias (keys from the normed ``s``), transition."""
        with fp32_region(s.device.type):  # Boltz: the attention half with autocast off
            # on operands in the weights' dtype or wider, as serial (a local cast of each tile;
            # none in fp32, fp64 and bf16)
            ct = torch.promote_types(s.dtype, self.pre_norm_s.weight.dtype)
            if s.dtype != ct:
                s = pointwise(lambda t: t.to(ct), s)
            if z.dtype != ct:
                z = pointwise(lambda t: t.to(ct), z)
            s_normed = self.pre_norm_s(s)
            s = pointwise(_add, s, self.attention(s_normed, z, mask, k_in=s_normed))
        s = pointwise(_add, s, self.transition_s(s))
        return self.s_post_norm(s)

    def forward(
        self,
        s: DTensor,
        z: DTensor,
        mask: DTensor | None = None,
        pair_mask: DTensor | None = None,
        seed: int | None = None,
    ) -> tuple[DTensor, DTensor]:
        what = type(self).__name__
        if not isinstance(s, DTensor) or not isinstance(z, DTensor):
            raise TypeError(
                f"{what} takes DTensors (s single, z pair); for plain tensors wrap it with "
                "twinshard.pair.layers.boundary.plain(module, grid)"
            )
        check_placements(s, SINGLE, f"{what} input s", ndim=3)
        check_placements(z, PAIR, f"{what} input z", ndim=4)
        square = z.shape[1] == z.shape[2] or layout_of(z) is not None  # else: padding unknown
        if tuple(z.shape[:2]) != tuple(s.shape[:2]) or not square:
            raise ValueError(
                f"expected s[B, N, c_s] and z[B, N, N, c_z], got {tuple(s.shape)} and {tuple(z.shape)}"
            )
        if mask is not None and pair_mask is None:
            raise ValueError(
                f"{what}: a token mask without pair_mask: pass pair_mask (distribute() builds it from "
                "the token mask, as does the plain-tensor boundary), or neither (masks from the layout)"
            )
        z = self.pair_stack(z, pair_mask, seed)
        return self.single_stack(s, z, mask), z

    def extra_repr(self) -> str:
        return (
            f"token_s={self.token_s}, token_z={self.token_z}, num_heads={self.num_heads}, "
            f"dropout={self.dropout}, convention={self.convention!r}"
        )


def stack_control_scalars(
    stack: nn.Module, seed: int | None, masks: dict[str, Any], *xs: Any
) -> dict[str, Any]:
    """The values every rank's control flow (or every rank's share of one result) depends on,
    checked equal before use: the stack's depth, checkpointing, train/eval mode, seed, grad mode,
    each dropout site's rate and convention (in module order), which masks are given, and the
    inputs' global shapes, dtypes and token count (a rank that loaded another sample would
    otherwise compute its tiles of another problem, or hang)."""
    sites = [m for m in stack.modules() if isinstance(m, CPDropout)]
    layout = next((lay for lay in (layout_of(x) for x in reversed(xs)) if lay is not None), None)
    return {
        "num_blocks": len(stack.layers),
        "activation_checkpointing": stack.activation_checkpointing,
        "training": stack.training,
        "seed": seed,
        "grad_enabled": torch.is_grad_enabled(),
        "dropout_p": tuple(m.p for m in sites),
        "dropout_convention": tuple(m.convention for m in sites),
        **{k: m is not None for k, m in masks.items()},
        "shapes": tuple(tuple(getattr(x, "shape", ())) for x in xs),
        "dtypes": tuple(str(getattr(x, "dtype", None)) for x in xs),
        "n_tokens": None if layout is None else layout.n_tokens,
        "attention_backends": module_backends(stack),
    }


class CPPairformerStack(_PlainArgs, nn.Module):
    """``num_blocks`` CP Pairformer layers (the serial ``PairformerStack``'s arguments, names and
    dropout streams); ``activation_checkpointing`` recomputes each layer in backward on every
    rank in the same collective order (module docstring)."""

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
            CPPairformerLayer,
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

    def control_scalars(
        self,
        seed: int | None,
        s: Any = None,
        z: Any = None,
        mask: DTensor | None = None,
        pair_mask: DTensor | None = None,
    ) -> dict[str, Any]:
        """The values checked equal on every rank before use (:func:`stack_control_scalars`)."""
        return stack_control_scalars(self, seed, {"mask": mask, "pair_mask": pair_mask}, s, z)

    def forward(
        self,
        s: DTensor,
        z: DTensor,
        mask: DTensor | None = None,
        pair_mask: DTensor | None = None,
        seed: int | None = None,
    ) -> tuple[DTensor, DTensor]:
        """Run the layers in order: ``(s, z) -> (s, z)`` (arguments as ``CPPairformerLayer``)."""
        scalars = self.control_scalars(seed, s, z, mask, pair_mask)
        agree_scalars(scalars, type(self).__name__)
        with backends_agreed(scalars["attention_backends"]):
            for layer in self.layers:
                if self.activation_checkpointing and torch.is_grad_enabled():
                    s, z = checkpointed(lambda s, z, layer=layer: layer(s, z, mask, pair_mask, seed), s, z)
                else:
                    s, z = layer(s, z, mask, pair_mask, seed)
        return s, z


class _PlainPairArgs:
    """How ``twinshard.pair.layers.boundary.plain`` feeds the caller's full tensors."""

    PLAIN_IN_KINDS = {"z": "pair", "pair_mask": "pair"}


def _check_noseq_input(z: Any, what: str) -> None:
    if not isinstance(z, DTensor):
        raise TypeError(
            f"{what} takes a DTensor z (pair); for plain tensors wrap it with "
            "twinshard.pair.layers.boundary.plain(module, grid)"
        )
    check_placements(z, PAIR, f"{what} input z", ndim=4)
    if z.shape[1] != z.shape[2] and layout_of(z) is None:
        raise ValueError(f"{what}: expected z[B, N, N, c_z], got {tuple(z.shape)}")


class CPPairformerNoSeqLayer(_PlainPairArgs, PairformerNoSeqLayer):
    """Context-parallel ``PairformerNoSeqLayer``: the pair half of ``CPPairformerLayer`` alone
    (module docstring). ``forward(z, pair_mask=None, seed=None) -> z`` on DTensors."""

    PARTS = CP_PARTS
    pair_stack = CPPairformerLayer.pair_stack

    def forward(self, z: DTensor, pair_mask: DTensor | None = None, seed: int | None = None) -> DTensor:
        _check_noseq_input(z, type(self).__name__)
        return self.pair_stack(z, pair_mask, seed)


class CPPairformerNoSeqModule(_PlainPairArgs, PairformerNoSeqModule):
    """``num_blocks`` CP no-sequence layers (the serial ``PairformerNoSeqModule``'s arguments,
    names and dropout streams); one ``agree_scalars`` per forward, checkpointing as
    ``CPPairformerStack``."""

    LAYER = CPPairformerNoSeqLayer

    def control_scalars(
        self, seed: int | None, z: Any = None, pair_mask: DTensor | None = None
    ) -> dict[str, Any]:
        """As ``CPPairformerStack.control_scalars``, for ``z`` alone."""
        return stack_control_scalars(self, seed, {"pair_mask": pair_mask}, z)

    def forward(self, z: DTensor, pair_mask: DTensor | None = None, seed: int | None = None) -> DTensor:
        """Run the layers in order: ``z -> z`` (arguments as ``CPPairformerNoSeqLayer``)."""
        scalars = self.control_scalars(seed, z, pair_mask)
        agree_scalars(scalars, type(self).__name__)
        with backends_agreed(scalars["attention_backends"]):
            for layer in self.layers:
                if self.activation_checkpointing and torch.is_grad_enabled():
                    z = checkpointed(lambda z, layer=layer: layer(z, pair_mask, seed), z)
                else:
                    z = layer(z, pair_mask, seed)
        return z
