"""CP twin of the Boltz-2 trunk (``twinshard.pair.reference.trunk.Boltz2Trunk``): from a distributed
Boltz-2 feature dict to ``s``, ``z`` and the distogram logits, on a rows x cols grid.

Placements. In: the ``ShardedFeatures`` of :func:`twinshard.pair.features.distribute` (Boltz-2's
names and kinds, ``twinshard.pair.feature_contract``): token features ``single`` (row block r on
grid row r), pair features tiled, MSA features (sequences over rows, tokens over columns),
template features (tokens over rows), atom features on the grid row of their tokens (``atom``,
``atom_token``). Out: ``s_inputs`` and ``s`` ``[B, Nr, token_s]`` at ``(Shard(1), Replicate())``,
``z`` ``[B, Nr, Nc, token_z]`` at ``(Shard(1), Shard(2))`` and ``pdistogram`` ``[B, Nr, Nc, 1,
num_bins]`` likewise; each carries the layout, padded entries exactly zero.

The trunk is the serial one's ``forward`` with its parts replaced by their twins (the same
``build_trunk``, so the same names in the same order; a Boltz-2 ``state_dict``'s trunk part loads
strict): ``CPInputEmbedder`` (window attention over the row's atoms with a halo of atoms),
``cp_pair_init_forward`` (the outer sum's column side, relative positions, bonds and contact
conditioning), ``CPLayerNorm``/``CPLinear`` for recycling, ``CPTemplateV2Module``,
``CPMSAModule``, ``CPPairformerStack`` and ``CPDistogramHead``; residual sums are ``pointwise``
(the first argument's layout, padding zeroed).

Collectives: those of the parts (each part's docstring states its own, forward and backward),
plus one status exchange per forward (every feature the configuration reads is present; the
missing ones named on every rank) and one ``agree_scalars`` (recycling steps, seed, train/eval and grad mode, feature
names, shapes and dtypes: a rank that loaded another sample or another recycling count raises,
on every rank, instead of hanging or computing its tiles of another problem).

Memory per rank: the parts' (pair-sized activations serial / P, single-sized serial / rows, atom
features and atom activations serial / rows plus the window halo); no rank holds a full N x N,
A x N or A x A tensor. Only the last recycling cycle saves activations for backward (the earlier
ones run under ``no_grad``, as in Boltz).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from twinshard.pair.layers.tokenwise import pointwise
from twinshard.pair.reference.trunk import Boltz2Trunk, TrunkParts, recycling_error
from twinshard.runtime.agree import agree_scalars, raise_together

__all__ = ["CPBoltz2Trunk", "cp_parts"]


def cp_parts() -> TrunkParts:
    from twinshard.pair.layers.distogram import CPDistogramHead
    from twinshard.pair.layers.input_embedder import CPInputEmbedder
    from twinshard.pair.layers.linear import CPLinear
    from twinshard.pair.layers.msa import CPMSAModule
    from twinshard.pair.layers.norm import CPLayerNorm
    from twinshard.pair.layers.pair_init import CP_PAIR_INIT_PARTS
    from twinshard.pair.layers.pairformer import CPPairformerStack
    from twinshard.pair.layers.template import CPTemplateModule, CPTemplateV2Module

    return TrunkParts(
        CPInputEmbedder,
        CPLinear,
        CPLayerNorm,
        CP_PAIR_INIT_PARTS,
        CPTemplateModule,
        CPTemplateV2Module,
        CPMSAModule,
        CPPairformerStack,
        CPDistogramHead,
    )


class CPBoltz2Trunk(Boltz2Trunk):
    """The CP Boltz-2 trunk (module docstring): ``forward(feats, recycling_steps=0, seed=None)``
    with ``feats`` from ``distribute`` -> ``{"s_inputs", "s", "z", "pdistogram"}`` as DTensors."""

    @classmethod
    def parts(cls) -> TrunkParts:
        return cp_parts()

    def add(self, a: DTensor, b: DTensor) -> DTensor:
        return pointwise(lambda x, y: x + y, a, b)

    def pair_init(
        self, s_inputs: DTensor, feats: Mapping[str, DTensor], keep: dict | None = None
    ) -> tuple[DTensor, DTensor]:
        from twinshard.pair.layers.pair_init import cp_pair_init_forward

        return cp_pair_init_forward(self, s_inputs, feats, keep)

    def masks(self, feats: Mapping[str, DTensor]) -> tuple[DTensor, DTensor]:
        """The token and pair masks ``distribute`` placed (``pair_mask`` is the outer product of
        ``token_pad_mask`` unless the caller gave one)."""
        for k in ("token_pad_mask", "pair_mask"):
            if k not in feats:
                raise KeyError(f"CPBoltz2Trunk: feats has no {k!r}: pass the ShardedFeatures of distribute")
        return feats["token_pad_mask"], feats["pair_mask"]

    def check_features(self, feats: Mapping[str, Any], recycling_steps: int, seed: int | None) -> None:
        """The recycling count must be valid and every feature this configuration reads
        (``trunk_feature_names(config)``) a distributed tensor of ``feats``; what is wrong is
        raised on every rank together (one status exchange), so a rank given a bad count never
        leaves the others waiting. The features' values were checked by ``distribute`` (the
        feature contract, on the rank(s) holding the data); the atom window by the atom encoder."""
        from twinshard.pair.feature_contract import trunk_feature_names

        need = trunk_feature_names(self.config)
        missing = [k for k in need if not isinstance(feats.get(k), DTensor)]
        err = recycling_error(recycling_steps, seed)
        if err is None and missing:
            plain = [k for k in missing if k in feats]
            err = ValueError(
                f"feature {missing[0]!r}: is missing (the trunk reads it); all missing: {missing}"
                + (f" ({plain} are not distributed tensors)" if plain else "")
                + ": distribute (twinshard.pair.features.distribute) a dict holding every feature "
                "twinshard.pair.feature_contract.trunk_feature_names(config) lists"
            )
        raise_together(err, step=f"{type(self).__name__}.forward (features)")

    def control_scalars(self, feats: Mapping[str, Any], recycling_steps: int, seed: int | None) -> None:
        """Every rank must run the same recycling count, seed and mode on the same features."""
        agree_scalars(
            {
                "recycling_steps": int(recycling_steps),
                "seed": seed,
                "training": self.training,
                "grad_enabled": torch.is_grad_enabled(),
                "features": tuple(
                    (k, tuple(v.shape), str(v.dtype))
                    for k, v in sorted(feats.items())
                    if isinstance(v, DTensor)
                ),
            },
            type(self).__name__,
        )
