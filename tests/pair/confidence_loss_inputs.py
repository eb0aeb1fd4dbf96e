"""Small inputs for the confidence-loss tests (serial vs boltz in tests/interop, twin vs serial
here): ``synthetic_complex`` (protein chains and a ligand chain of one-atom tokens, padding
tokens in elements b > 0) with chain 0 relabelled RNA where ``nucleic`` (its tokens get the
30 A lDDT cut-off), plus ``synthetic_training_features`` (true coordinates, resolved masks with
unresolved atoms, the R set, frames with Boltz's K = 1 axis squeezed as Boltz's training step
does), predicted coordinates ``sample_atom_coords [B m, A, 3]`` (the true ones plus noise of
~1.2 A, so every lDDT threshold and many PAE/PDE bins are met) and random fp64 logits.
"""

from __future__ import annotations

import torch

from twinshard.pair.synthetic import synthetic_complex, synthetic_training_features

F64 = torch.float64
LOGIT_KEYS = ("plddt_logits", "resolved_logits", "pde_logits", "pae_logits")
BINS = {"plddt_logits": 50, "resolved_logits": 2, "pde_logits": 64, "pae_logits": 64}
TRAIN_KEYS = (
    "atom_resolved_mask",
    "token_to_center_atom",
    "r_set_to_rep_atom",
    "frames_idx",
    "frame_resolved_mask",
)


def loss_case(b: int, n: int, m: int = 1, seed: int = 0, nucleic: bool = True, atoms=(3, 6)) -> dict:
    """``{"feats", "true_coords", "true_mask", "logits": {...}, "x_pred", "m"}``."""
    feats = synthetic_complex(
        n, atoms_per_token=atoms, msa_depth=1, templates=0, chains=3, batch=b, seed=seed
    )
    if nucleic:
        mol = feats["mol_type"].clone()
        mol[(feats["asym_id"] == 0) & (feats["token_pad_mask"] > 0)] = 2  # chain 0: RNA
        feats["mol_type"] = mol
    extra = synthetic_training_features(feats, seed=seed + 7)
    feats.update({k: extra[k] for k in TRAIN_KEYS})
    feats["frames_idx"] = feats["frames_idx"][:, 0]  # Boltz's training step squeezes K = 1
    feats["frame_resolved_mask"] = feats["frame_resolved_mask"][:, 0]
    true = extra["coords"][:, 0].repeat_interleave(m, 0)
    true_mask = extra["atom_resolved_mask"].repeat_interleave(m, 0)
    g = torch.Generator().manual_seed(seed + 31)
    amask = feats["atom_pad_mask"].repeat_interleave(m, 0)[..., None]
    x = (true + 1.2 * torch.randn(true.shape, generator=g, dtype=F64)) * amask
    logits = {}
    for k in LOGIT_KEYS:
        shape = (b * m, n, n, BINS[k]) if k in ("pde_logits", "pae_logits") else (b * m, n, BINS[k])
        logits[k] = 2 * torch.randn(shape, generator=g, dtype=F64)
    return {
        "feats": feats,
        "true_coords": true,
        "true_mask": true_mask,
        "logits": logits,
        "x_pred": x,
        "m": m,
    }


def flat_losses(out: dict) -> torch.Tensor:
    """``[loss, plddt, pde, resolved, pae]`` of a confidence_loss result (pae 0.0 as a tensor)."""
    br = out["loss_breakdown"]
    parts = [out["loss"]] + [br[k] for k in ("plddt_loss", "pde_loss", "resolved_loss", "pae_loss")]
    like = out["loss"]
    return torch.stack([p if isinstance(p, torch.Tensor) else like.new_tensor(float(p)) for p in parts])
