"""CP twins of the MSA layer and module (AF3 Alg. 8, Boltz-2's ``MSALayer`` / ``MSAModule``).

The serial modules in ``twinshard.pair.reference.msa`` are the specification (names, order,
dropout streams); these run the same updates on a rows x cols grid.

Placements. ``CPMSAModule(...)(z, emb, feats, seed=None) -> z``: ``z[B, Nr, Nc, token_z]`` pair at
``(Shard(1), Shard(2))``, ``emb = s_inputs [B, Nr, token_s]`` single at ``(Shard(1),
Replicate())``, ``feats`` the ``ShardedFeatures`` of ``twinshard.pair.features.distribute``
(Boltz-2's names): ``msa`` (int), ``has_deletion``, ``deletion_value``, ``msa_paired`` and
``msa_mask`` at the MSA placement ``[B, Sp, Nc]`` (sequences over grid rows, tokens over grid
columns), ``token_pad_mask`` single. Out: the pair ``z`` (carrying its layout, padding exactly
zero). ``CPMSALayer(z, m, token_mask, msa_mask, seed=None) -> (z, m)``: ``m`` MSA, ``token_mask``
pair, ``msa_mask`` MSA (either mask may be None: padding from the layout).

Computation on rank (r, c). The MSA input ``[one_hot(msa), has_deletion, deletion_value,
msa_paired] W_msa`` is token-local on the MSA tile. ``s_proj(emb)`` is computed on the single
rows of grid row r, then moved to the token block of grid column c
(``pair.layers.moves.column_block``: one exchange) and broadcast over the tile's
sequences. The pair token mask ``token_pad_mask_i token_pad_mask_j`` is built on the pair tile
from the local single rows and the same move (no gradient). The layers: CP pair-weighted
averaging, ``CPDropout`` (Boltz's row-wise MSA mask ``[B, S, 1, 1]``, each rank drawing its
sequences' entries by global index), CP transition, CP outer product mean, the CP no-sequence
Pairformer layer.

Gradients. Parameters are replicated; every contribution is a true partial (distinct tiles),
so their gradients are summed over the grid. ``emb``'s gradient: the move's adjoint returns
partials to the senders, summed over the grid row (``comm.sync_grad``), where ``emb`` is
replicated.

Collectives. Forward: one ``agree_scalars`` check (module), the ``s_proj`` move and the token mask
move (one exchange each, ``[B, Nc/C, msa_s]`` and ``[B, Nc/C]`` received per rank), then per
layer those of its parts in order (pair-weighted averaging: row max all-gathers, a normaliser
all-reduce and a grid contraction; outer product mean: two contractions; the no-sequence layer:
two triangle multiplications and two triangle attentions). Backward: the parts' adjoints, the
reverse move, one all-reduce of ``emb``'s gradient along the grid row and the parameter-gradient
all-reduces.

Memory saved for backward per rank: the parts' tile activations (MSA tile and pair tile:
serial / P) and the moved ``s_proj`` rows (``[B, Nc/C, msa_s]``); nothing N x N beyond the tile.
With ``activation_checkpointing`` each layer keeps its inputs' tiles and recomputes (every
collective of the layer, in order, on every rank) in backward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from twinshard import comm
from twinshard.pair.features import layout_of, with_layout
from twinshard.pair.layers.dropout import CPDropout
from twinshard.pair.layers.moves import column_block
from twinshard.pair.layers.outer_product import CPOuterProductMean
from twinshard.pair.layers.pair_averaging import CPPairWeightedAveraging
from twinshard.pair.layers.pairformer import CPPairformerNoSeqLayer
from twinshard.pair.layers.tokenwise import checkpointed, pointwise, replicated_params
from twinshard.pair.layers.transition import CPTransition
from twinshard.pair.layers.triangle import pair_grid
from twinshard.pair.reference.msa import (
    MSALayer,
    MSAModule,
    check_msa_features,
    msa_input_features,
)
from twinshard.pair.tiling import MSA, PAIR, SINGLE, check_placements, from_local
from twinshard.runtime.agree import agree_scalars

__all__ = ["CPMSALayer", "CPMSAModule"]

CP_MSA_PARTS = {
    "transition": CPTransition,
    "pwa": CPPairWeightedAveraging,
    "noseq": CPPairformerNoSeqLayer,
    "opm": CPOuterProductMean,
    "dropout": CPDropout,
}


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


class CPMSALayer(MSALayer):
    """Context-parallel MSA layer (module docstring); the serial ``MSALayer``'s arguments,
    parameters and dropout sites. ``forward(z, m, token_mask=None, msa_mask=None, seed=None) ->
    (z, m)`` on DTensors."""

    PARTS = CP_MSA_PARTS

    def forward(
        self,
        z: DTensor,
        m: DTensor,
        token_mask: DTensor | None = None,
        msa_mask: DTensor | None = None,
        seed: int | None = None,
    ) -> tuple[DTensor, DTensor]:
        what = type(self).__name__
        if not isinstance(z, DTensor) or not isinstance(m, DTensor):
            raise TypeError(f"{what} takes DTensors (z pair, m MSA) from twinshard.pair.features")
        check_placements(z, PAIR, f"{what} input z", ndim=4)
        check_placements(m, MSA, f"{what} input m", ndim=4)
        m = pointwise(_add, m, self.dropout_msa(self.pair_weighted_averaging(m, z, token_mask), seed))
        m = pointwise(_add, m, self.msa_transition(m))
        z = pointwise(_add, z, self.outer_product_mean(m, msa_mask))
        z = self.pairformer_layer(z, token_mask, seed)
        return z, m


class CPMSAModule(MSAModule):
    """Context-parallel MSA module (module docstring); the serial ``MSAModule``'s arguments,
    parameters and dropout streams. ``forward(z, emb, feats, seed=None) -> z`` on DTensors and
    the ``ShardedFeatures`` of ``distribute``. ``subsample_msa=True`` raises: subsample the MSA
    features before ``distribute`` (what Boltz's draw does to them)."""

    LAYER = CPMSALayer

    def control_scalars(self, seed: int | None, z: Any, emb: Any, feats: Mapping[str, Any]) -> dict[str, Any]:
        """Values every rank's control flow depends on, checked equal before use."""
        sites = [m for m in self.modules() if isinstance(m, CPDropout)]
        layout = layout_of(z)
        return {
            "msa_blocks": len(self.layers),
            "activation_checkpointing": self.activation_checkpointing,
            "training": self.training,
            "seed": seed,
            "grad_enabled": torch.is_grad_enabled(),
            "dropout_p": tuple(m.p for m in sites),
            "dropout_convention": tuple(m.convention for m in sites),
            "shapes": tuple(tuple(getattr(x, "shape", ())) for x in (z, emb)),
            "dtypes": tuple(str(getattr(x, "dtype", None)) for x in (z, emb)),
            "features": tuple(sorted((k, tuple(getattr(v, "shape", ()))) for k, v in feats.items())),
            "n_tokens": None if layout is None else layout.n_tokens,
        }

    def _check(self, z: Any, emb: Any, feats: Mapping[str, Any]) -> None:
        what = type(self).__name__
        if self.subsample_msa:
            raise ValueError(
                f"{what}: subsample_msa=True draws a random subset (Boltz: torch.randperm) that every rank "
                "and the serial model must share: subsample the MSA features (msa, has_deletion, "
                "deletion_value, msa_paired, msa_mask) before distribute and build the module with "
                "subsample_msa=False"
            )
        check_msa_features(feats, self.use_paired_feature, what)
        if not isinstance(z, DTensor) or not isinstance(emb, DTensor):
            raise TypeError(f"{what} takes DTensors (z pair, emb single) from twinshard.pair.features")
        check_placements(z, PAIR, f"{what} input z", ndim=4)
        check_placements(emb, SINGLE, f"{what} input emb", ndim=3)
        names = ("msa", "has_deletion", "deletion_value", "msa_mask") + (
            ("msa_paired",) if self.use_paired_feature else ()
        )
        msa = feats["msa"]
        for k in names:
            check_placements(feats[k], MSA, f"{what} feature {k!r}", ndim=3)
            if tuple(feats[k].shape) != tuple(msa.shape):
                raise ValueError(
                    f"{what}: feature {k!r} {tuple(feats[k].shape)} differs from msa {tuple(msa.shape)}"
                )
        check_placements(feats["token_pad_mask"], SINGLE, f"{what} feature 'token_pad_mask'", ndim=2)
        layout = layout_of(msa) or layout_of(z)
        depth = msa.shape[1] if layout is None or layout.n_seqs is None else layout.n_seqs
        if depth == 0:
            raise ValueError(
                f"{what}: feature 'msa' has depth S = 0: Boltz-2 needs at least the query sequence"
            )
        b, nr = emb.shape[:2]
        if tuple(z.shape[:2]) != (b, nr) or msa.shape[0] != b or msa.shape[2] != z.shape[2]:
            raise ValueError(
                f"{what}: z {tuple(z.shape)}, emb {tuple(emb.shape)} and feature 'msa' {tuple(msa.shape)} "
                "disagree on B or N"
            )
        if msa.dtype.is_floating_point:
            raise TypeError(f"{what}: feature 'msa' must hold integer residue classes, got {msa.dtype}")

    def forward(
        self, z: DTensor, emb: DTensor, feats: Mapping[str, DTensor], seed: int | None = None
    ) -> DTensor:
        self._check(z, emb, feats)
        agree_scalars(self.control_scalars(seed, z, emb, feats), type(self).__name__)
        grid = pair_grid(z)
        layout = layout_of(feats["msa"]) or layout_of(z)  # the MSA's: it knows the depth
        f = msa_input_features(
            feats["msa"].to_local(),
            feats["has_deletion"].to_local(),
            feats["deletion_value"].to_local(),
            feats["msa_paired"].to_local() if self.use_paired_feature else None,
            self.msa_proj.weight.dtype,
        )
        w_msa, w_s = replicated_params([self.msa_proj.weight, self.s_proj.weight], z)
        nr, nc = z.shape[1], z.shape[2]
        # s_proj on this grid row's single rows; the rows of this grid column's token block
        e = comm.sync_grad(emb.to_local(), grid.row_group)  # replicated along the row
        s_cols = column_block(F.linear(e, w_s), grid, (nr, nc), "msa:s_proj")  # [B, Nc/C, msa_s]
        m_local = F.linear(f, w_msa) + s_cols.unsqueeze(1)
        m = from_local(m_local, z.device_mesh, MSA)
        if layout is not None:
            m = with_layout(m, layout, "msa")  # padded sequences and tokens exactly zero
        tok = feats["token_pad_mask"].to_local().detach().to(z.dtype)
        tok_cols = column_block(tok, grid, (nr, nc), "msa:token_mask", differentiable=False)
        token_mask = from_local(tok[:, :, None] * tok_cols[:, None, :], z.device_mesh, PAIR)
        if layout is not None:
            token_mask = with_layout(token_mask, layout, "pair")
        msa_mask = feats["msa_mask"]
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                z, m = checkpointed(lambda z, m, layer=layer: layer(z, m, token_mask, msa_mask, seed), z, m)
            else:
                z, m = layer(z, m, token_mask, msa_mask, seed)
        return z
