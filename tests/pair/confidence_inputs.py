"""Small inputs for the confidence-module tests (serial vs boltz in tests/interop, twin vs serial
here): the features of ``synthetic_complex`` (protein chains and a ligand chain, one atom per
ligand token, padding tokens in elements b > 0) plus ``frames_idx`` (each token's first, middle
and last atom: polymer frames of three atoms; one-atom tokens a degenerate frame, which the
ligand chain's recomputation from the coordinates replaces), random trunk outputs
(``s_inputs``, ``s [B, N, ts]``, ``z [B, N, N, tz]``), predicted coordinates ``x_pred [B m, A, 3]``
(a few angstrom apart, so the 64 distance bins 2-22 A and the 8 A contact cut-off are all met)
and distogram logits ``[B, N, N, 64]``.
"""

from __future__ import annotations

import torch

from twinshard.pair.synthetic import synthetic_complex

F64 = torch.float64


def confidence_config(
    separate: bool = True, prod: bool = True, z_inputs: bool = True, dropout: float = 0.0
) -> dict:
    """``ConfidenceModule`` keyword arguments: the released Boltz-2 checkpoint's flags (s_to_z
    product, s_inputs into s, z inputs, separate intra/inter heads, bond types, fix_sym_check,
    cyclic positions), small sizes."""
    return dict(
        token_s=8,
        token_z=6,
        pairformer_args={
            "num_blocks": 1,
            "num_heads": 2,
            "dropout": dropout,
            "pairwise_head_width": 4,
            "pairwise_num_heads": 2,
            "post_layer_norm": False,
        },
        num_dist_bins=64,
        max_dist=22,
        add_s_to_z_prod=prod,
        add_s_input_to_s=True,
        add_z_input_to_z=z_inputs,
        bond_type_feature=True,
        fix_sym_check=True,
        cyclic_pos_enc=True,
        conditioning_cutoff_min=4.0,
        conditioning_cutoff_max=20.0,
        confidence_args={
            "num_plddt_bins": 50,
            "num_pde_bins": 64,
            "num_pae_bins": 64,
            "use_separate_heads": separate,
        },
    )


def frames_idx(feats: dict) -> torch.Tensor:
    """``[B, N, 3]`` global atom indices: each real token's first, middle and last atom."""
    a2t = feats["atom_to_token"]
    b, _, n = a2t.shape
    out = torch.zeros(b, n, 3, dtype=torch.int64)
    for i in range(b):
        for t in range(n):
            atoms = a2t[i, :, t].nonzero()[:, 0]
            if len(atoms):
                out[i, t] = torch.stack([atoms[0], atoms[len(atoms) // 2], atoms[-1]])
    return out


def confidence_case(
    b: int, n: int, cfg: dict, m: int = 1, seed: int = 0, atoms=(3, 6), chains: int = 3
) -> dict:
    feats = synthetic_complex(
        n, atoms_per_token=atoms, msa_depth=1, templates=0, chains=chains, batch=b, seed=seed
    )
    feats["frames_idx"] = frames_idx(feats)
    g = torch.Generator().manual_seed(seed + 100)
    ts, tz = cfg["token_s"], cfg["token_z"]
    a = feats["ref_pos"].shape[1]
    tok = feats["token_pad_mask"][..., None]
    amask = feats["atom_pad_mask"].repeat_interleave(m, 0)[..., None]
    # coordinates spread over ~15 A with atoms of a token ~1.5 A apart: every distance bin is met
    centre = 6.0 * torch.randn(b * m, n, 3, generator=g, dtype=F64)
    a2t = feats["atom_to_token"].to(F64).repeat_interleave(m, 0)
    x = (a2t @ centre + 1.5 * torch.randn(b * m, a, 3, generator=g, dtype=F64)) * amask
    return {
        "feats": feats,
        "s_inputs": torch.randn(b, n, ts, generator=g, dtype=F64) * tok,
        "s": torch.randn(b, n, ts, generator=g, dtype=F64) * tok,
        "z": torch.randn(b, n, n, tz, generator=g, dtype=F64),
        "x_pred": x,
        "pdist": 2 * torch.randn(b, n, n, 64, generator=g, dtype=F64),
        "m": m,
    }


# The outputs compared, in a fixed order (pair_chains_iptm flattened in sorted chain order).
LOGITS = ("pae_logits", "pde_logits", "plddt_logits", "resolved_logits")
FIGURES = (
    "pae",
    "pde",
    "plddt",
    "complex_plddt",
    "complex_iplddt",
    "complex_pde",
    "complex_ipde",
    "ptm",
    "iptm",
    "ligand_iptm",
    "protein_iptm",
)


def chain_pairs(out: dict) -> torch.Tensor:
    pc = out["pair_chains_iptm"]
    return torch.stack([pc[c1][c2] for c1 in sorted(pc) for c2 in sorted(pc[c1])], dim=-1)
