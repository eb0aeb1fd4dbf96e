"""Small inputs for the whole-model tests (CP vs serial here, vs boltz's ``Boltz2`` in tests/interop):
a small :class:`~twinshard.pair.reference.model.ModelConfig` with the released checkpoint's flags
(the trunk of ``test_trunk_cp.config``, Boltz-2's predict diffusion parameters, the confidence
module of ``confidence_inputs.confidence_config``) and the synthetic complex with ``frames_idx``.
"""

from __future__ import annotations

import torch
from confidence_inputs import confidence_config, frames_idx

from twinshard.pair.reference.model import ModelConfig
from twinshard.pair.reference.sampler import BOLTZ2_DIFFUSION_PARAMS
from twinshard.pair.reference.trunk import TrunkConfig
from twinshard.pair.synthetic import synthetic_complex

F64 = torch.float64
WINDOW = 8  # atom windows of 8 queries x 32 keys: several straddle every token block


def score_model_args() -> dict:
    return {
        "sigma_data": 16,
        "dim_fourier": 4,
        "atom_encoder_depth": 1,
        "atom_encoder_heads": 2,
        "token_transformer_depth": 1,
        "token_transformer_heads": 2,
        "atom_decoder_depth": 1,
        "atom_decoder_heads": 2,
        "conditioning_transition_layers": 1,
    }


def confidence_model_args() -> dict:
    """``Boltz2``'s ``confidence_model_args`` (the model adds token_s/z, bond types, fix_sym_check,
    cyclic positions and the contact cut-offs itself)."""
    cfg = confidence_config()
    for k in (
        "token_s",
        "token_z",
        "bond_type_feature",
        "fix_sym_check",
        "cyclic_pos_enc",
        "conditioning_cutoff_min",
        "conditioning_cutoff_max",
    ):
        cfg.pop(k)
    return cfg


def model_config(confidence: bool = True) -> ModelConfig:
    pair = {"pairwise_head_width": 4, "pairwise_num_heads": 2}
    trunk = TrunkConfig(
        atom_s=8,
        atom_z=4,
        token_s=8,
        token_z=6,
        num_bins=64,  # the confidence module's contact probability reads 64 distogram bins
        atom_feature_dim=388,
        atoms_per_window_queries=WINDOW,
        atoms_per_window_keys=4 * WINDOW,
        embedder_args={
            "atom_encoder_depth": 1,
            "atom_encoder_heads": 2,
            "add_method_conditioning": True,
            "add_modified_flag": True,
            "add_cyclic_flag": True,
            "add_mol_type_feat": True,
        },
        msa_args={
            "msa_s": 8,
            "msa_blocks": 1,
            "msa_dropout": 0.0,
            "z_dropout": 0.0,
            "use_paired_feature": True,
            **pair,
        },
        pairformer_args={"num_blocks": 1, "num_heads": 2, "dropout": 0.0, "v2": True, **pair},
        template_args={"template_dim": 8, "template_blocks": 1, "dropout": 0.0, **pair},
        use_templates=True,
        use_templates_v2=True,
        fix_sym_check=True,
        cyclic_pos_enc=True,
        bond_type_feature=True,
    )
    return ModelConfig(
        trunk=trunk,
        score_model_args=score_model_args(),
        # sigma_max 0.5 (x sigma_data 16 = 8 A of initial noise): a random-weight score model leaves
        # the samples a few angstrom across, so the confidence's distance bins (2-22 A) and
        # contacts differ between samples (with Boltz's 160, every distance lands in the last bin)
        diffusion_process_args=dict(BOLTZ2_DIFFUSION_PARAMS, sigma_max=0.5),
        confidence_prediction=confidence,
        confidence_model_args=confidence_model_args() if confidence else None,
    )


def model_features(
    n: int,
    batch: int = 1,
    seed: int = 0,
    msa: int = 3,
    templates: int = 1,
    atoms=(2, 6),
    window: int = WINDOW,
) -> dict:
    feats = synthetic_complex(
        n,
        atoms_per_token=atoms,
        msa_depth=msa,
        templates=templates,
        chains=3,
        batch=batch,
        seed=seed,
        window=window,
    )
    feats["frames_idx"] = frames_idx(feats)
    return feats
