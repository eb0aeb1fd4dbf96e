"""Small inputs for the diffusion conditioning and score-model tests (serial vs boltz in
tests/interop, twin vs serial here): the atom and token features of ``embed_inputs.atom_complex``
plus random trunk outputs (``s_inputs``, ``s_trunk``, ``z_trunk``, the relative position
encoding), noise levels and noisy coordinates for ``multiplicity`` samples per element.
"""

from __future__ import annotations

import torch
from embed_inputs import atom_complex, embedder_config

F64 = torch.float64


def conditioning_config(w: int = 32, h: int = 128, **flags) -> dict:
    """``DiffusionConditioning`` keyword arguments (small; every atom-feature path on)."""
    emb = embedder_config(w, h, **flags)
    return dict(
        token_s=6,
        token_z=4,
        atom_s=8,
        atom_z=4,
        atoms_per_window_queries=w,
        atoms_per_window_keys=h,
        atom_encoder_depth=2,
        atom_encoder_heads=2,
        token_transformer_depth=2,
        token_transformer_heads=2,
        atom_decoder_depth=2,
        atom_decoder_heads=2,
        atom_feature_dim=emb["atom_feature_dim"],
        conditioning_transition_layers=2,
        use_no_atom_char=emb["use_no_atom_char"],
        use_atom_backbone_feat=emb["use_atom_backbone_feat"],
        use_residue_feats_atoms=emb["use_residue_feats_atoms"],
    )


def module_config(cfg: dict) -> dict:
    """The matching ``DiffusionModule`` keyword arguments (as ``Boltz2`` builds them)."""
    keep = (
        "token_s",
        "atom_s",
        "atoms_per_window_queries",
        "atoms_per_window_keys",
        "atom_encoder_depth",
        "atom_encoder_heads",
        "token_transformer_depth",
        "token_transformer_heads",
        "atom_decoder_depth",
        "atom_decoder_heads",
        "conditioning_transition_layers",
    )
    return {k: cfg[k] for k in keep} | {"sigma_data": 16, "dim_fourier": 4}


def diffusion_case(
    b: int, n: int, cfg: dict, seed: int = 0, w: int = 32, multiplicity: int = 1, atoms=(3, 8)
) -> dict:
    """Features and random trunk outputs: ``feats``, ``s_inputs``, ``s_trunk`` ``[B, N, ts]``,
    ``z_trunk``, ``relpos`` ``[B, N, N, tz]``, ``times[B m]``, ``r[B m, A, 3]``."""
    feats = atom_complex(b, n, atoms, seed=seed, w=w)
    g = torch.Generator().manual_seed(seed + 100)
    ts, tz = cfg["token_s"], cfg["token_z"]
    a = feats["ref_pos"].shape[1]
    m = multiplicity
    tok = feats["token_pad_mask"][..., None]
    amask = feats["atom_pad_mask"].repeat_interleave(m, 0)[..., None]
    return {
        "feats": feats,
        "s_inputs": torch.randn(b, n, ts, generator=g, dtype=F64) * tok,
        "s_trunk": torch.randn(b, n, ts, generator=g, dtype=F64) * tok,
        "z_trunk": torch.randn(b, n, n, tz, generator=g, dtype=F64),
        "relpos": torch.randn(b, n, n, tz, generator=g, dtype=F64),
        "times": 0.25 * torch.log(torch.rand(b * m, generator=g, dtype=F64) * 10 + 0.1),
        "r": 1.5 * torch.randn(b * m, a, 3, generator=g, dtype=F64) * amask,
    }
