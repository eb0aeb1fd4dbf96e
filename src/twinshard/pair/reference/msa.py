"""The MSA module (AlphaFold3 supplement, Algorithm 8, as Boltz-2's ``MSAModule``/``MSALayer``).

Input embedding, from the Boltz-2 features (``msa [B, S, N]`` int residue classes,
``has_deletion``, ``deletion_value``, ``msa_paired`` ``[B, S, N]``, ``msa_mask [B, S, N]``,
``token_pad_mask [B, N]``) and the single input embedding ``emb = s_inputs [B, N, c_s]``::

    f      <- [one_hot(msa, 33), has_deletion, deletion_value, (msa_paired)]   # use_paired_feature
    m      <- f W_msa + (emb W_s)[:, None]                                    # msa_proj, s_proj
    token_mask <- token_pad_mask_i token_pad_mask_j                            # [B, N, N]

then ``msa_blocks`` layers, each::

    m <- m + Dropout_row(PairWeightedAveraging(m, z, token_mask))   # row-wise: [B, S, 1, 1]
    m <- m + Transition(m)                                          # msa_transition
    z <- z + OuterProductMean(m, msa_mask)
    z <- PairformerNoSeqLayer(z, token_mask)                        # pairformer_layer

and the module returns ``z`` (Boltz-2's trunk then adds it to its own ``z``: ``z + msa_module(z,
...)``). Boltz-2 fixes the pair-weighted averaging at 8 heads of width 32 and the outer product
mean's hidden width at 32; ``pwa_heads``, ``pwa_head_width`` and ``opm_hidden`` default to those
(smaller values only for tests).

Dropout. The MSA dropout is Boltz's ``get_dropout_mask(msa_dropout, m)``: whole sequences,
mask ``[B, S, 1, 1]``, here drawn by ``twinshard.pair.reference.dropout`` (counter-based, keyed by
global (batch, sequence), ``convention="boltz"`` by default; ``"af3"``: ``[B, 1, N, c]``); the
pair stack's dropout is the ``PairformerNoSeqLayer``'s. Streams come from the sites' qualified
names (``layers.<i>.dropout_msa``, ``layers.<i>.pairformer_layer.dropout_tri_mul_out`` ...).

Subsampling. Boltz's ``subsample_msa=True`` draws ``torch.randperm`` inside forward. Here the
draw is the caller's: ``forward(..., msa_indices=idx)`` selects those sequences of the features
(as Boltz's ``m[:, idx]`` and ``msa_mask[:, idx]``); ``subsample_msa=True`` without
``msa_indices`` raises (never a silently different draw).

Names and registration order follow Boltz-2: ``s_proj, msa_proj, layers.<i>.{msa_transition,
pair_weighted_averaging, pairformer_layer, outer_product_mean}`` (plus parameterless dropout
sites), so a Boltz-2 ``state_dict`` loads unchanged (strict).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from twinshard.pair.reference.dropout import CONVENTIONS, Dropout, assign_dropout_streams
from twinshard.pair.reference.linear import Linear
from twinshard.pair.reference.outer_product import OuterProductMean
from twinshard.pair.reference.pair_averaging import PairWeightedAveraging
from twinshard.pair.reference.pairformer import PairformerNoSeqLayer
from twinshard.pair.reference.transition import Transition

__all__ = ["MSA_FEATURES", "NUM_TOKENS", "MSALayer", "MSAModule", "msa_input_features"]

NUM_TOKENS = 33  # Boltz-2's residue classes (boltz.data.const.num_tokens)
MSA_FEATURES = ("msa", "has_deletion", "deletion_value", "msa_mask", "token_pad_mask")


def check_msa_features(feats: Mapping[str, object], use_paired_feature: bool, what: str) -> None:
    """Every feature the module reads is there (else a ``KeyError`` naming the missing ones)."""
    need = MSA_FEATURES + (("msa_paired",) if use_paired_feature else ())
    missing = [k for k in need if k not in feats]
    if missing:
        raise KeyError(
            f"{what}: missing MSA features {missing} (Boltz-2's names; the module reads {list(need)})"
        )


def msa_input_features(
    msa: torch.Tensor,
    has_deletion: torch.Tensor,
    deletion_value: torch.Tensor,
    msa_paired: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``[one_hot(msa, 33), has_deletion, deletion_value, (msa_paired)]`` in ``dtype`` (token-local)."""
    if msa.dtype.is_floating_point:
        raise TypeError(f"feature 'msa' must hold integer residue classes, got {msa.dtype}")
    parts = [F.one_hot(msa.long(), num_classes=NUM_TOKENS).to(dtype)]
    parts += [has_deletion.unsqueeze(-1).to(dtype), deletion_value.unsqueeze(-1).to(dtype)]
    if msa_paired is not None:
        parts.append(msa_paired.unsqueeze(-1).to(dtype))
    return torch.cat(parts, dim=-1)


def build_msa_layer(
    layer: nn.Module,
    parts: dict[str, type[nn.Module]],
    msa_s: int,
    token_z: int,
    msa_dropout: float,
    z_dropout: float,
    pairwise_head_width: int,
    pairwise_num_heads: int,
    convention: str,
    pwa_heads: int,
    pwa_head_width: int,
    opm_hidden: int,
) -> None:
    """Register an MSA layer's settings and parts in Boltz-2's order."""
    if convention not in CONVENTIONS:
        raise ValueError(f"dropout convention must be one of {CONVENTIONS}, got {convention!r}")
    layer.msa_dropout = float(msa_dropout)
    layer.convention = convention
    layer.msa_transition = parts["transition"](msa_s, 4 * msa_s)
    layer.pair_weighted_averaging = parts["pwa"](msa_s, token_z, pwa_head_width, pwa_heads)
    layer.pairformer_layer = parts["noseq"](
        token_z,
        dropout=z_dropout,
        pairwise_head_width=pairwise_head_width,
        pairwise_num_heads=pairwise_num_heads,
        convention=convention,
    )
    layer.outer_product_mean = parts["opm"](msa_s, opm_hidden, token_z)
    layer.dropout_msa = parts["dropout"](msa_dropout, convention=convention)


SERIAL_MSA_PARTS = {
    "transition": Transition,
    "pwa": PairWeightedAveraging,
    "noseq": PairformerNoSeqLayer,
    "opm": OuterProductMean,
    "dropout": Dropout,
}


class MSALayer(nn.Module):
    """One MSA layer (module docstring): ``forward(z, m, token_mask, msa_mask, seed=None) ->
    (z, m)``; ``token_mask`` is the pair mask ``[B, N, N]``, ``msa_mask`` ``[B, S, N]``. The CP
    twin subclasses it with its own ``PARTS`` (same names, same order)."""

    PARTS = SERIAL_MSA_PARTS

    def __init__(
        self,
        msa_s: int,
        token_z: int,
        msa_dropout: float,
        z_dropout: float,
        pairwise_head_width: int = 32,
        pairwise_num_heads: int = 4,
        convention: str = "boltz",
        pwa_heads: int = 8,
        pwa_head_width: int = 32,
        opm_hidden: int = 32,
    ):
        super().__init__()
        build_msa_layer(
            self,
            self.PARTS,
            msa_s,
            token_z,
            msa_dropout,
            z_dropout,
            pairwise_head_width,
            pairwise_num_heads,
            convention,
            pwa_heads,
            pwa_head_width,
            opm_hidden,
        )

    def forward(
        self,
        z: torch.Tensor,
        m: torch.Tensor,
        token_mask: torch.Tensor,
        msa_mask: torch.Tensor,
        seed: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = m + self.dropout_msa(self.pair_weighted_averaging(m, z, token_mask), seed)
        m = m + self.msa_transition(m)
        z = z + self.outer_product_mean(m, msa_mask)
        z = self.pairformer_layer(z, token_mask, seed)
        return z, m


def build_msa_module(
    module: nn.Module,
    layer_cls: type[nn.Module],
    msa_s: int,
    token_z: int,
    token_s: int,
    msa_blocks: int,
    msa_dropout: float,
    z_dropout: float,
    pairwise_head_width: int,
    pairwise_num_heads: int,
    activation_checkpointing: bool,
    use_paired_feature: bool,
    subsample_msa: bool,
    num_subsampled_msa: int,
    convention: str,
    pwa_heads: int,
    pwa_head_width: int,
    opm_hidden: int,
) -> None:
    """Register the MSA module's settings and parts in Boltz-2's order, then one dropout stream
    per site from its qualified name."""
    module.msa_blocks = int(msa_blocks)
    module.msa_dropout = float(msa_dropout)
    module.z_dropout = float(z_dropout)
    module.use_paired_feature = bool(use_paired_feature)
    module.activation_checkpointing = bool(activation_checkpointing)
    module.subsample_msa = bool(subsample_msa)
    module.num_subsampled_msa = int(num_subsampled_msa)
    module.convention = convention
    module.s_proj = Linear(token_s, msa_s, bias=False, init="default")
    module.msa_proj = Linear(NUM_TOKENS + 2 + int(use_paired_feature), msa_s, bias=False, init="default")
    layer_args = (msa_dropout, z_dropout, pairwise_head_width, pairwise_num_heads, convention)
    extra = {"pwa_heads": pwa_heads, "pwa_head_width": pwa_head_width, "opm_hidden": opm_hidden}
    module.layers = nn.ModuleList(
        layer_cls(msa_s, token_z, *layer_args, **extra) for _ in range(module.msa_blocks)
    )
    assign_dropout_streams(module)


class MSAModule(nn.Module):
    """Serial MSA module (module docstring): ``forward(z, emb, feats, seed=None,
    msa_indices=None) -> z`` with ``z[B, N, N, token_z]``, ``emb[B, N, token_s]``."""

    LAYER: type[nn.Module] = MSALayer  # the CP twin's: CPMSALayer

    def __init__(
        self,
        msa_s: int,
        token_z: int,
        token_s: int,
        msa_blocks: int,
        msa_dropout: float,
        z_dropout: float,
        pairwise_head_width: int = 32,
        pairwise_num_heads: int = 4,
        activation_checkpointing: bool = False,
        use_paired_feature: bool = True,
        subsample_msa: bool = False,
        num_subsampled_msa: int = 1024,
        convention: str = "boltz",
        pwa_heads: int = 8,
        pwa_head_width: int = 32,
        opm_hidden: int = 32,
    ):
        super().__init__()
        build_msa_module(
            self,
            self.LAYER,
            msa_s,
            token_z,
            token_s,
            msa_blocks,
            msa_dropout,
            z_dropout,
            pairwise_head_width,
            pairwise_num_heads,
            activation_checkpointing,
            use_paired_feature,
            subsample_msa,
            num_subsampled_msa,
            convention,
            pwa_heads,
            pwa_head_width,
            opm_hidden,
        )

    def forward(
        self,
        z: torch.Tensor,
        emb: torch.Tensor,
        feats: Mapping[str, torch.Tensor],
        seed: int | None = None,
        msa_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        what = type(self).__name__
        check_msa_features(feats, self.use_paired_feature, what)
        msa = feats["msa"]
        if msa.dim() != 3 or msa.shape[1] == 0:
            raise ValueError(f"{what}: feature 'msa' must be [B, S, N] with S >= 1, got {tuple(msa.shape)}")
        f = msa_input_features(
            msa,
            feats["has_deletion"],
            feats["deletion_value"],
            feats["msa_paired"] if self.use_paired_feature else None,
            self.msa_proj.weight.dtype,
        )
        msa_mask = feats["msa_mask"]
        if self.subsample_msa:
            if msa_indices is None:
                raise ValueError(
                    f"{what}: subsample_msa=True draws a random subset in Boltz (torch.randperm); "
                    "pass the draw as msa_indices= (e.g. torch.randperm(S)[:num_subsampled_msa])"
                )
            f, msa_mask = f[:, msa_indices], msa_mask[:, msa_indices]
        elif msa_indices is not None:
            raise ValueError(f"{what}: msa_indices given but subsample_msa=False")
        tok = feats["token_pad_mask"].to(z.dtype)
        token_mask = tok[:, :, None] * tok[:, None, :]
        m = self.msa_proj(f) + self.s_proj(emb).unsqueeze(1)
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                z, m = checkpoint(layer, z, m, token_mask, msa_mask, seed, use_reentrant=False)
            else:
                z, m = layer(z, m, token_mask, msa_mask, seed)
        return z
