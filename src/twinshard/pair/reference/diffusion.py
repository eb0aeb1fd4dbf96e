"""The first part of the structure module, serial: the diffusion conditioning and the score model
(AlphaFold3 supplement, Algorithms 20-23 and 5-6; Boltz-2's ``diffusion_conditioning.py``
``DiffusionConditioning``, ``diffusionv2.py`` ``DiffusionModule`` and ``encodersv2.py``
``FourierEmbedding``, ``SingleConditioning``, ``PairwiseConditioning``, ``AtomAttentionDecoder``).

``DiffusionConditioning(s_trunk, z_trunk, relative_position_encoding, feats)``, computed once per
structure (not per denoising step)::

    z <- PairwiseConditioning(z_trunk, relpos)      # LN + linear of [z_trunk, relpos], transitions
    q, c, p, to_keys <- AtomEncoder(feats, s_trunk, z)   # structure_prediction=True
    atom_enc_bias <- concat_l (LN + linear)_l(p)    # [B, K, W, H, enc_depth x enc_heads]
    atom_dec_bias <- concat_l (LN + linear)_l(p)    # [B, K, W, H, dec_depth x dec_heads]
    token_trans_bias <- concat_l (LN + linear)_l(z) # [B, N, N, token_depth x token_heads]

``DiffusionModule(s_inputs, s_trunk, r_noisy[B m, A, 3], times[B m], feats, conditioning, m)``
(Algorithm 20 without the preconditioning, which ``AtomDiffusion`` applies)::

    s <- SingleConditioning(times, repeat(s_trunk, m), repeat(s_inputs, m))    # [B m, N, 2 ts]
    a, q, c <- AtomAttentionEncoder(feats, q, c, atom_enc_bias, to_keys, r_noisy, m)
    a <- a + s_to_a_linear(s)
    a <- DiffusionTransformer(a, s, token_trans_bias, repeat(token_pad_mask, m))  # token level
    a <- a_norm(a)
    r_update <- AtomAttentionDecoder(a, q, c, atom_dec_bias, feats, to_keys, m)   # [B m, A, 3]

``repeat`` is ``repeat_interleave`` along the batch: sample ``b m + j`` is element b's j-th, and
every bias of element b serves its m samples.

Names and registration order are Boltz-2's (a ``Boltz2`` ``state_dict``'s
``diffusion_conditioning.*`` and ``structure_module.score_model.*`` load strict): conditioning
``pairwise_conditioner.{dim_pairwise_init_proj.{0,1}, transitions.*}``, ``atom_encoder.*``,
``atom_enc_proj_z.{l}.{0,1}``, ``atom_dec_proj_z.{l}.{0,1}``, ``token_trans_proj_z.{l}.{0,1}``;
score model ``single_conditioner.{norm_single, single_embed, fourier_embed.proj, norm_fourier,
fourier_to_single, transitions.*}``, ``atom_attention_encoder.*``, ``s_to_a_linear.{0,1}``,
``token_transformer.layers.*``, ``a_norm``, ``atom_attention_decoder.{a_to_q_trans, atom_decoder.*,
atom_feat_to_atom_pos_update.{0,1}}``. ``FourierEmbedding.proj`` is frozen (``requires_grad``
False), as in Boltz.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from twinshard.pair.reference.atom_encoder import AtomAttentionEncoder, AtomEncoder
from twinshard.pair.reference.atom_transformer import AtomTransformer, DiffusionTransformer
from twinshard.pair.reference.linear import Linear
from twinshard.pair.reference.norm import LayerNorm
from twinshard.pair.reference.pair_init import FourierEmbedding
from twinshard.pair.reference.transition import Transition

__all__ = [
    "AtomAttentionDecoder",
    "DiffusionConditioning",
    "DiffusionModule",
    "FourierEmbedding",
    "PairwiseConditioning",
    "SingleConditioning",
    "project_heads",
]


def project_heads(layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """``concat_l layers[l](x)`` on the last dim (one bias block of heads per transformer layer)."""
    return torch.cat([layer(x) for layer in layers], dim=-1)


def _proj_list(depth: int, dim: int, heads: int) -> nn.ModuleList:
    return nn.ModuleList(nn.Sequential(LayerNorm(dim), Linear(dim, heads, bias=False)) for _ in range(depth))


class SingleConditioning(nn.Module):
    """Algorithm 21 (single part): ``[s_trunk, s_inputs]`` -> LN -> linear, plus the embedded
    noise level, then ``num_transitions`` residual transitions. Returns ``(s, normed_fourier)``."""

    def __init__(
        self,
        sigma_data: float,
        token_s: int = 384,
        dim_fourier: int = 256,
        num_transitions: int = 2,
        transition_expansion_factor: int = 2,
        eps: float = 1e-20,
        disable_times: bool = False,
    ):
        super().__init__()
        self.eps, self.sigma_data, self.disable_times = eps, sigma_data, disable_times
        self.norm_single = LayerNorm(2 * token_s)
        self.single_embed = Linear(2 * token_s, 2 * token_s)
        if not disable_times:
            self.fourier_embed = FourierEmbedding(dim_fourier)
            self.norm_fourier = LayerNorm(dim_fourier)
            self.fourier_to_single = Linear(dim_fourier, 2 * token_s, bias=False)
        self.transitions = nn.ModuleList(
            Transition(dim=2 * token_s, hidden=transition_expansion_factor * 2 * token_s)
            for _ in range(num_transitions)
        )

    def forward(self, times: torch.Tensor, s_trunk: torch.Tensor, s_inputs: torch.Tensor) -> tuple:
        s = self.single_embed(self.norm_single(torch.cat((s_trunk, s_inputs), dim=-1)))
        normed = None
        if not self.disable_times:
            normed = self.norm_fourier(self.fourier_embed(times))
            s = self.fourier_to_single(normed)[:, None, :] + s
        for transition in self.transitions:
            s = transition(s) + s
        return s, normed


class PairwiseConditioning(nn.Module):
    """Algorithm 21 (pair part): ``[z_trunk, relpos]`` -> LN -> linear, then residual transitions."""

    def __init__(
        self,
        token_z: int,
        dim_token_rel_pos_feats: int,
        num_transitions: int = 2,
        transition_expansion_factor: int = 2,
    ):
        super().__init__()
        width = token_z + dim_token_rel_pos_feats
        self.dim_pairwise_init_proj = nn.Sequential(LayerNorm(width), Linear(width, token_z, bias=False))
        self.transitions = nn.ModuleList(
            Transition(dim=token_z, hidden=transition_expansion_factor * token_z)
            for _ in range(num_transitions)
        )

    def forward(self, z_trunk: torch.Tensor, token_rel_pos_feats: torch.Tensor) -> torch.Tensor:
        z = self.dim_pairwise_init_proj(torch.cat((z_trunk, token_rel_pos_feats), dim=-1))
        for transition in self.transitions:
            z = transition(z) + z
        return z


class DiffusionConditioning(nn.Module):
    """Boltz-2's ``DiffusionConditioning`` (module docstring). Returns ``(q, c, to_keys,
    atom_enc_bias, atom_dec_bias, token_trans_bias)``."""

    _encoder_cls: type[AtomEncoder] = AtomEncoder
    _pairwise_cls: type[PairwiseConditioning] = PairwiseConditioning

    def __init__(
        self,
        token_s: int,
        token_z: int,
        atom_s: int,
        atom_z: int,
        atoms_per_window_queries: int = 32,
        atoms_per_window_keys: int = 128,
        atom_encoder_depth: int = 3,
        atom_encoder_heads: int = 4,
        token_transformer_depth: int = 24,
        token_transformer_heads: int = 8,
        atom_decoder_depth: int = 3,
        atom_decoder_heads: int = 4,
        atom_feature_dim: int = 128,
        conditioning_transition_layers: int = 2,
        use_no_atom_char: bool = False,
        use_atom_backbone_feat: bool = False,
        use_residue_feats_atoms: bool = False,
    ):
        super().__init__()
        self.pairwise_conditioner = self._pairwise_cls(
            token_z=token_z, dim_token_rel_pos_feats=token_z, num_transitions=conditioning_transition_layers
        )
        self.atom_encoder = self._encoder_cls(
            atom_s=atom_s,
            atom_z=atom_z,
            token_s=token_s,
            token_z=token_z,
            atoms_per_window_queries=atoms_per_window_queries,
            atoms_per_window_keys=atoms_per_window_keys,
            atom_feature_dim=atom_feature_dim,
            structure_prediction=True,
            use_no_atom_char=use_no_atom_char,
            use_atom_backbone_feat=use_atom_backbone_feat,
            use_residue_feats_atoms=use_residue_feats_atoms,
        )
        self.atom_enc_proj_z = _proj_list(atom_encoder_depth, atom_z, atom_encoder_heads)
        self.atom_dec_proj_z = _proj_list(atom_decoder_depth, atom_z, atom_decoder_heads)
        self.token_trans_proj_z = _proj_list(token_transformer_depth, token_z, token_transformer_heads)

    def forward(self, s_trunk, z_trunk, relative_position_encoding, feats) -> tuple:
        z = self.pairwise_conditioner(z_trunk, relative_position_encoding)
        q, c, p, to_keys = self.atom_encoder(feats=feats, s_trunk=s_trunk, z=z)
        atom_enc_bias = project_heads(self.atom_enc_proj_z, p)
        atom_dec_bias = project_heads(self.atom_dec_proj_z, p)
        token_trans_bias = project_heads(self.token_trans_proj_z, z)
        return q, c, to_keys, atom_enc_bias, atom_dec_bias, token_trans_bias


class AtomAttentionDecoder(nn.Module):
    """Algorithm 6: tokens broadcast to their atoms (``a_to_q_trans``), the atom transformer, then
    ``atom_feat_to_atom_pos_update`` (LN + linear to 3; a bare linear with a post layer norm)."""

    _transformer_cls: type[AtomTransformer] = AtomTransformer

    def __init__(
        self,
        atom_s: int,
        token_s: int,
        attn_window_queries: int,
        attn_window_keys: int,
        atom_decoder_depth: int = 3,
        atom_decoder_heads: int = 4,
        activation_checkpointing: bool = False,
        transformer_post_layer_norm: bool = False,
    ):
        super().__init__()
        self.a_to_q_trans = Linear(2 * token_s, atom_s, bias=False, init="final")
        self.atom_decoder = self._transformer_cls(
            attn_window_queries=attn_window_queries,
            attn_window_keys=attn_window_keys,
            dim=atom_s,
            dim_single_cond=atom_s,
            depth=atom_decoder_depth,
            heads=atom_decoder_heads,
            activation_checkpointing=activation_checkpointing,
            post_layer_norm=transformer_post_layer_norm,
        )
        if transformer_post_layer_norm:
            self.atom_feat_to_atom_pos_update = Linear(atom_s, 3, bias=False, init="final")
        else:
            self.atom_feat_to_atom_pos_update = nn.Sequential(
                LayerNorm(atom_s), Linear(atom_s, 3, bias=False, init="final")
            )

    def forward(self, a, q, c, atom_dec_bias, feats, to_keys, multiplicity: int = 1) -> torch.Tensor:
        """``a[B m, N, 2 ts]``, ``q, c[B m, A, atom_s]``, ``atom_dec_bias[B, K, W, H, ...]`` ->
        ``r_update[B m, A, 3]``."""
        a2t = feats["atom_to_token"].repeat_interleave(multiplicity, 0)
        a_to_q = self.a_to_q_trans(a)
        q = q + torch.bmm(a2t.to(a_to_q.dtype), a_to_q).to(q.dtype)
        mask = feats["atom_pad_mask"].repeat_interleave(multiplicity, 0)
        q = self.atom_decoder(
            q=q, c=c, bias=atom_dec_bias, to_keys=to_keys, mask=mask, multiplicity=multiplicity
        )
        return self.atom_feat_to_atom_pos_update(q)


class DiffusionModule(nn.Module):
    """Boltz-2's score model ``DiffusionModule`` (module docstring)."""

    _encoder_cls: type[AtomAttentionEncoder] = AtomAttentionEncoder
    _decoder_cls: type[AtomAttentionDecoder] = AtomAttentionDecoder

    def __init__(
        self,
        token_s: int,
        atom_s: int,
        atoms_per_window_queries: int = 32,
        atoms_per_window_keys: int = 128,
        sigma_data: float = 16,
        dim_fourier: int = 256,
        atom_encoder_depth: int = 3,
        atom_encoder_heads: int = 4,
        token_transformer_depth: int = 24,
        token_transformer_heads: int = 8,
        atom_decoder_depth: int = 3,
        atom_decoder_heads: int = 4,
        conditioning_transition_layers: int = 2,
        activation_checkpointing: bool = False,
        transformer_post_ln: bool = False,
    ):
        super().__init__()
        self.atoms_per_window_queries = atoms_per_window_queries
        self.atoms_per_window_keys = atoms_per_window_keys
        self.sigma_data = sigma_data
        self.activation_checkpointing = activation_checkpointing
        self.single_conditioner = SingleConditioning(
            sigma_data=sigma_data,
            token_s=token_s,
            dim_fourier=dim_fourier,
            num_transitions=conditioning_transition_layers,
        )
        self.atom_attention_encoder = self._encoder_cls(
            atom_s=atom_s,
            token_s=token_s,
            atoms_per_window_queries=atoms_per_window_queries,
            atoms_per_window_keys=atoms_per_window_keys,
            atom_encoder_depth=atom_encoder_depth,
            atom_encoder_heads=atom_encoder_heads,
            structure_prediction=True,
            activation_checkpointing=activation_checkpointing,
            transformer_post_layer_norm=transformer_post_ln,
        )
        self.s_to_a_linear = nn.Sequential(
            LayerNorm(2 * token_s), Linear(2 * token_s, 2 * token_s, bias=False, init="final")
        )
        self.token_transformer = self._token_transformer(
            dim=2 * token_s,
            dim_single_cond=2 * token_s,
            depth=token_transformer_depth,
            heads=token_transformer_heads,
            activation_checkpointing=activation_checkpointing,
        )
        self.a_norm = LayerNorm(2 * token_s)
        self.atom_attention_decoder = self._decoder_cls(
            atom_s=atom_s,
            token_s=token_s,
            attn_window_queries=atoms_per_window_queries,
            attn_window_keys=atoms_per_window_keys,
            atom_decoder_depth=atom_decoder_depth,
            atom_decoder_heads=atom_decoder_heads,
            activation_checkpointing=activation_checkpointing,
        )

    def _token_transformer(self, **kwargs: Any) -> nn.Module:
        return DiffusionTransformer(**kwargs)

    def forward(
        self,
        s_inputs: torch.Tensor,
        s_trunk: torch.Tensor,
        r_noisy: torch.Tensor,
        times: torch.Tensor,
        feats: Mapping[str, torch.Tensor],
        diffusion_conditioning: Mapping[str, Any],
        multiplicity: int = 1,
    ) -> torch.Tensor:
        """``s_inputs, s_trunk[B, N, ts]``, ``r_noisy[B m, A, 3]``, ``times[B m]``, Boltz's
        conditioning dict (``q, c, to_keys, atom_enc_bias, atom_dec_bias, token_trans_bias``) ->
        ``r_update[B m, A, 3]``."""
        m = int(multiplicity)
        dc = diffusion_conditioning
        s, _ = self.single_conditioner(
            times, s_trunk.repeat_interleave(m, 0), s_inputs.repeat_interleave(m, 0)
        )
        a, q_skip, c_skip, to_keys = self.atom_attention_encoder(
            feats, dc["q"], dc["c"], dc["atom_enc_bias"], dc["to_keys"], r_noisy, m
        )
        a = a + self.s_to_a_linear(s)
        mask = feats["token_pad_mask"].repeat_interleave(m, 0).to(a.dtype)
        bias = dc["token_trans_bias"].repeat_interleave(m, 0)
        a = self.token_transformer(a, s, bias, mask)
        a = self.a_norm(a)
        return self.atom_attention_decoder(a, q_skip, c_skip, dc["atom_dec_bias"], feats, to_keys, m)
