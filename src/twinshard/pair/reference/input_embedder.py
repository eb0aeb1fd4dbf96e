"""The input embedder (AlphaFold3 supplement, Algorithm 2; Boltz-2's ``trunkv2.InputEmbedder``).

::

    q, c, p, to_keys <- AtomEncoder(feats)
    a <- AtomAttentionEncoder(feats, q, c, atom_enc_proj_z(p), to_keys)     # [B, N, token_s]
    s_inputs <- a + res_type_encoding(res_type) + msa_profile_encoding([profile, deletion_mean])
               (+ method_conditioning_init(method_feature) + modified_conditioning_init(modified)
                + cyclic_conditioning_init(min(cyclic_period, 1)) + mol_type_conditioning_init(mol_type),
                each with its add_* flag)

``atom_enc_proj_z`` (LayerNorm, then a bias-free linear to ``depth x heads``) turns the window
pair features into every layer's attention bias at once. The conditionings start at zero
(Boltz-2 zero-fills them). Names and registration order are Boltz-2's: ``atom_encoder``,
``atom_enc_proj_z.{0,1}``, ``atom_attention_encoder``, ``res_type_encoding``,
``msa_profile_encoding``, then the optional ``method_conditioning_init``,
``modified_conditioning_init``, ``cyclic_conditioning_init``, ``mol_type_conditioning_init``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from twinshard.pair.reference.atom_encoder import NUM_MOL_TYPES, NUM_TOKENS, AtomAttentionEncoder, AtomEncoder
from twinshard.pair.reference.linear import Linear
from twinshard.pair.reference.norm import LayerNorm

__all__ = ["InputEmbedder", "NUM_METHOD_TYPES"]

NUM_METHOD_TYPES = 12  # Boltz-2's const.num_method_types


def _zero_embedding(n: int, dim: int) -> nn.Embedding:
    e = nn.Embedding(n, dim)
    with torch.no_grad():
        e.weight.zero_()
    return e


class InputEmbedder(nn.Module):
    """Per-token input embedding ``s_inputs[B, N, token_s]`` from atoms and tokens (module doc)."""

    _atom_encoder_cls: type[AtomEncoder] = AtomEncoder
    _attention_encoder_cls: type[AtomAttentionEncoder] = AtomAttentionEncoder

    def __init__(
        self,
        atom_s: int,
        atom_z: int,
        token_s: int,
        token_z: int,
        atoms_per_window_queries: int,
        atoms_per_window_keys: int,
        atom_feature_dim: int,
        atom_encoder_depth: int,
        atom_encoder_heads: int,
        activation_checkpointing: bool = False,
        add_method_conditioning: bool = False,
        add_modified_flag: bool = False,
        add_cyclic_flag: bool = False,
        add_mol_type_feat: bool = False,
        use_no_atom_char: bool = False,
        use_atom_backbone_feat: bool = False,
        use_residue_feats_atoms: bool = False,
    ):
        super().__init__()
        self.token_s = token_s
        self.add_method_conditioning = add_method_conditioning
        self.add_modified_flag = add_modified_flag
        self.add_cyclic_flag = add_cyclic_flag
        self.add_mol_type_feat = add_mol_type_feat
        self.atom_encoder = self._atom_encoder_cls(
            atom_s=atom_s,
            atom_z=atom_z,
            token_s=token_s,
            token_z=token_z,
            atoms_per_window_queries=atoms_per_window_queries,
            atoms_per_window_keys=atoms_per_window_keys,
            atom_feature_dim=atom_feature_dim,
            structure_prediction=False,
            use_no_atom_char=use_no_atom_char,
            use_atom_backbone_feat=use_atom_backbone_feat,
            use_residue_feats_atoms=use_residue_feats_atoms,
        )
        self.atom_enc_proj_z = nn.Sequential(
            LayerNorm(atom_z), Linear(atom_z, atom_encoder_depth * atom_encoder_heads, bias=False)
        )
        self.atom_attention_encoder = self._attention_encoder_cls(
            atom_s=atom_s,
            token_s=token_s,
            atoms_per_window_queries=atoms_per_window_queries,
            atoms_per_window_keys=atoms_per_window_keys,
            atom_encoder_depth=atom_encoder_depth,
            atom_encoder_heads=atom_encoder_heads,
            structure_prediction=False,
            activation_checkpointing=activation_checkpointing,
        )
        self.res_type_encoding = Linear(NUM_TOKENS, token_s, bias=False)
        self.msa_profile_encoding = Linear(NUM_TOKENS + 1, token_s, bias=False)
        if add_method_conditioning:
            self.method_conditioning_init = _zero_embedding(NUM_METHOD_TYPES, token_s)
        if add_modified_flag:
            self.modified_conditioning_init = _zero_embedding(2, token_s)
        if add_cyclic_flag:
            self.cyclic_conditioning_init = Linear(1, token_s, bias=False, init="final")
        if add_mol_type_feat:
            self.mol_type_conditioning_init = _zero_embedding(NUM_MOL_TYPES, token_s)

    def token_terms(self, a: torch.Tensor, feats: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``a`` plus the per-token encodings and conditionings (token-local)."""
        dt = a.dtype
        s = (
            a
            + self.res_type_encoding(feats["res_type"].to(dt))
            + self.msa_profile_encoding(
                torch.cat([feats["profile"].to(dt), feats["deletion_mean"].to(dt).unsqueeze(-1)], dim=-1)
            )
        )
        if self.add_method_conditioning:
            s = s + self.method_conditioning_init(feats["method_feature"].long())
        if self.add_modified_flag:
            s = s + self.modified_conditioning_init(feats["modified"].long())
        if self.add_cyclic_flag:
            s = s + self.cyclic_conditioning_init(feats["cyclic_period"].to(dt).clamp(max=1.0).unsqueeze(-1))
        if self.add_mol_type_feat:
            s = s + self.mol_type_conditioning_init(feats["mol_type"].long())
        return s

    def forward(self, feats: Mapping[str, torch.Tensor], affinity: bool = False) -> torch.Tensor:
        """Boltz-2's feature dict -> ``s_inputs[B, N, token_s]``."""
        if affinity:
            raise NotImplementedError("the affinity module's profile (affinity=True) is not supported")
        q, c, p, to_keys = self.atom_encoder(feats)
        a, _, _, _ = self.atom_attention_encoder(
            feats=feats, q=q, c=c, atom_enc_bias=self.atom_enc_proj_z(p), to_keys=to_keys
        )
        return self.token_terms(a, feats)
