"""CP twin of Boltz-2's input embedder (serial: :mod:`twinshard.pair.reference.input_embedder`).

``CPInputEmbedder(...)(feats) -> s_inputs``. In: the ``ShardedFeatures`` of
``twinshard.pair.features.distribute`` holding the atom features (kinds ``atom``, ``atom_token``;
see :mod:`twinshard.pair.atoms`) and the token features ``res_type``, ``profile``,
``deletion_mean`` (+ ``method_feature``, ``modified``, ``cyclic_period``, ``mol_type`` as the
flags ask), all of kind ``single``. Out: ``s_inputs[B, Nr, token_s]`` at the single placement
``(Shard(1), Replicate())``, carrying the layout, padded tokens exactly zero.

Computation: the CP atom encoder and atom attention encoder on grid row r's atoms
(:mod:`twinshard.pair.layers.atom_encoder`: the window halo, once for the static key features and
once per transformer layer, along the grid column), ``atom_enc_proj_z`` on the rank's windows,
then the token terms on the rank's token rows (token-local). Collectives: forward, ``1 + depth``
halo exchanges (``embed:halo``, halo atoms x channels x itemsize bytes per rank each); backward,
their reverses and one all-reduce of the flat parameter gradient over the grid column (every
rank of a row computed the same values; summed over the column each row counts once).
Memory per rank: the serial module's activations for its ``A_blk`` atoms, ``nW`` windows and
``Nr/R`` tokens; nothing of size A x N or N x N.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from twinshard.pair.features import with_layout
from twinshard.pair.layers.atom_encoder import (
    ATOM_INPUTS,
    CPAtomAttentionEncoder,
    CPAtomEncoder,
    TileFeatures,
    synced_call,
    tile_features,
)
from twinshard.pair.reference.input_embedder import InputEmbedder
from twinshard.pair.tiling import SINGLE, from_local

__all__ = ["CPInputEmbedder"]


class CPInputEmbedder(InputEmbedder):
    """Context-parallel input embedder; parameters as the serial module (module docstring)."""

    _atom_encoder_cls = CPAtomEncoder
    _attention_encoder_cls = CPAtomAttentionEncoder

    def needs(self) -> dict[str, str]:
        """The features this embedder reads, by kind."""
        need = dict(ATOM_INPUTS) | {"ref_charge": "atom", "ref_element": "atom"}
        need |= {"res_type": "single", "profile": "single", "deletion_mean": "single"}
        enc = self.atom_encoder
        if not enc.use_no_atom_char:
            need["ref_atom_name_chars"] = "atom"
        if enc.use_atom_backbone_feat:
            need["atom_backbone_feat"] = "atom"
        if enc.use_residue_feats_atoms:
            need |= {"modified": "single", "mol_type": "single"}
        flags = {
            "method_feature": self.add_method_conditioning,
            "modified": self.add_modified_flag,
            "cyclic_period": self.add_cyclic_flag,
            "mol_type": self.add_mol_type_feat,
        }
        return need | {k: "single" for k, on in flags.items() if on}

    def forward(self, feats: Mapping[str, Any], affinity: bool = False) -> Any:
        if isinstance(feats, TileFeatures):
            return InputEmbedder.forward(self, feats, affinity)
        tile = tile_features(feats, type(self).__name__, self.needs())
        like: DTensor = feats["ref_pos"]
        s: torch.Tensor = synced_call(self, like, (tile, affinity))
        return with_layout(from_local(s, like.device_mesh, SINGLE), tile.layout, "single")
