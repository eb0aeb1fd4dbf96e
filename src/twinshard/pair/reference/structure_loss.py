"""The structure module's training loss, serial: Boltz-2's ``AtomDiffusion.compute_loss``
(``diffusionv2.py``) with its ``smooth_lddt_loss`` (AlphaFold3 supplement, Algorithm 27) and
the weighted rigid alignment (Algorithm 28, :func:`~twinshard.pair.reference.alignment.weighted_rigid_align`).

For ``B m`` rows (element b's samples at rows ``b m + j``), atoms ``a`` of ``A``::

    t_a    = mol_type of atom a's token (atom_to_token @ mol_type; 0 = protein for atoms on no token)
    w_a    = 1 + nucleotide_loss_weight [t_a in (DNA, RNA)] + ligand_loss_weight [t_a = NONPOLYMER]
    r_a    = atom_resolved_mask_a (x [plddt_a > filter_by_plddt] when filter_by_plddt > 0)
    x_true = weighted_rigid_align(aligned_true_atom_coords onto denoised_atom_coords (detached),
                                  weights w, mask atom_resolved_mask (unfiltered)), detached
    mse    = mean_rows( loss_weight(sigma) sum_a w_a r_a |x_den,a - x_true,a|^2 / (3 sum_a w_a r_a + 1e-5) )
    loss   = mse + smooth_lddt_loss(x_den, coords, [t in (DNA, RNA)], r, multiplicity=m)

with ``loss_weight(sigma) = (sigma^2 + sd^2) / (sigma sd)^2`` and the smooth lDDT, per row::

    D_ij = |t_i - t_j|  (true),  d_ij = |p_i - p_j + 1e-6|  (predicted; torch's pairwise_distance)
    valid_ij = [i != j] r_i r_j ([D_ij < 30] if atom i is a nucleotide else [D_ij < 15])
    e_ij = (s(0.5 - |D_ij - d_ij|) + s(1 - .) + s(2 - .) + s(4 - .)) / 4     (s: the logistic)
    lddt_row = sum_ij valid_ij e_ij / (sum_ij valid_ij + 1e-5);    loss = 1 - mean_rows lddt_row

(the cutoff is that of the ROW atom i, as Boltz's ``is_nucleotide_i.unsqueeze(-1)``; strict
``<``). Boltz computes in fp32 (``.float()``); here in ``promote_types(dtype, float32)`` (fp64
stays fp64), the alignment's SVD in ``AtomDiffusion.align_svd_dtype`` (fp32 as Boltz).
Distances are ``sqrt(x^2 + y^2 + z^2)`` written out, so a distributed run that scores a tile of
the pairs computes the same bits for the same pair (the cutoff decisions agree exactly).

One deviation: Boltz's ``smooth_lddt_loss`` iterates over ``true_coords``' rows; passed fewer
true rows than predicted ones (``[B, A, 3]`` against ``[B m, A, 3]``) it silently scores the
first rows only. Here that raises (``compute_loss`` is always handed ``[B m, A, 3]`` true
coordinates by Boltz-2's training forward).

Memory: one ``A x A`` pair matrix (and its autograd intermediates) per row, as Boltz.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from twinshard.pair.feature_contract import MOL_TYPE_IDS
from twinshard.pair.reference.alignment import weighted_rigid_align

__all__ = [
    "NUCLEOTIDE_TYPES",
    "align_weights",
    "atom_mol_type",
    "compute_loss",
    "lddt_pair_sums",
    "loss_weight",
    "smooth_lddt_loss",
]

NUCLEOTIDE_TYPES = (MOL_TYPE_IDS["DNA"], MOL_TYPE_IDS["RNA"])
LIGAND_TYPE = MOL_TYPE_IDS["NONPOLYMER"]
LOSS_KEYS = ("denoised_atom_coords", "sigmas", "aligned_true_atom_coords")


def loss_weight(sigma: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """EDM's loss weight ``(sigma^2 + sd^2) / (sigma sd)^2``."""
    return (sigma**2 + sigma_data**2) / ((sigma * sigma_data) ** 2)


def atom_mol_type(atom_to_token: torch.Tensor, mol_type: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, A]`` mol type of each atom's token (``atom_to_token[B, A, N] @ mol_type[B, N]``; an
    atom mapped to no token gets 0, as Boltz's ``bmm``). Works on a tile (local token indices)."""
    return (atom_to_token.to(dtype) @ mol_type.to(dtype)[..., None])[..., 0].long()


def is_nucleotide(atom_type: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (atom_type == NUCLEOTIDE_TYPES[0]).to(dtype) + (atom_type == NUCLEOTIDE_TYPES[1]).to(dtype)


def align_weights(
    atom_type: torch.Tensor, nucleotide_loss_weight: float, ligand_loss_weight: float, dtype: torch.dtype
) -> torch.Tensor:
    """``1 + nucleotide_loss_weight [DNA or RNA] + ligand_loss_weight [NONPOLYMER]`` per atom."""
    lig = (atom_type == LIGAND_TYPE).to(dtype)
    return 1 + nucleotide_loss_weight * is_nucleotide(atom_type, dtype) + ligand_loss_weight * lig


def _norm3(v: torch.Tensor) -> torch.Tensor:
    """``|v|`` over the last dim (3), the sum written out (the same bits for any tile shape)."""
    x, y, z = v.unbind(-1)
    return torch.sqrt(x * x + y * y + z * z)


def lddt_pair_sums(
    pred_i: torch.Tensor,
    true_i: torch.Tensor,
    pred_j: torch.Tensor,
    true_j: torch.Tensor,
    nucleotide_i: torch.Tensor,
    mask_i: torch.Tensor,
    mask_j: torch.Tensor,
    distinct: torch.Tensor,
    nucleic_acid_cutoff: float,
    other_cutoff: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's smooth-lDDT sums over the pairs (i, j) of atoms ``i`` (``[I, 3]`` coordinates,
    ``[I]`` nucleotide flag and mask) x atoms ``j`` (``[J, 3]``, ``[J]``): ``(sum valid e,
    sum valid)``, ``distinct[I, J]`` the ``i != j`` factor (module docstring)."""
    true_d = _norm3(true_i[:, None, :] - true_j[None, :, :])
    nuc = nucleotide_i[:, None]
    valid = nuc * (true_d < nucleic_acid_cutoff).to(true_d.dtype)
    valid = valid + (1 - nuc) * (true_d < other_cutoff).to(true_d.dtype)
    valid = valid * distinct * mask_i[:, None] * mask_j[None, :]
    pred_d = _norm3(pred_i[:, None, :] - pred_j[None, :, :] + 1e-6)
    diff = (true_d - pred_d).abs()
    eps = (
        torch.sigmoid(0.5 - diff)
        + torch.sigmoid(1.0 - diff)
        + torch.sigmoid(2.0 - diff)
        + torch.sigmoid(4.0 - diff)
    ) / 4.0
    return (eps * valid).sum(), valid.sum()


def smooth_lddt_loss(
    pred_coords: torch.Tensor,
    true_coords: torch.Tensor,
    is_nucleotide: torch.Tensor,
    coords_mask: torch.Tensor,
    nucleic_acid_cutoff: float = 30.0,
    other_cutoff: float = 15.0,
    multiplicity: int = 1,
) -> torch.Tensor:
    """Boltz's ``smooth_lddt_loss`` (module docstring): ``pred_coords``/``true_coords``
    ``[B m, A, 3]``, ``is_nucleotide``/``coords_mask`` ``[B, A]`` (row ``i`` uses element
    ``i // multiplicity``). Returns ``1 - mean_rows lddt_row``, a scalar."""
    m = int(multiplicity)
    rows, a = true_coords.shape[:2]
    if tuple(pred_coords.shape) != tuple(true_coords.shape) or true_coords.shape[-1] != 3:
        raise ValueError(
            f"smooth_lddt_loss: pred_coords {tuple(pred_coords.shape)} and true_coords "
            f"{tuple(true_coords.shape)} must both be [B m, A, 3]"
        )
    if m < 1 or is_nucleotide.shape[0] * m != rows or coords_mask.shape[0] * m != rows:
        raise ValueError(
            f"smooth_lddt_loss: {rows} coordinate rows, but is_nucleotide {tuple(is_nucleotide.shape)} and "
            f"coords_mask {tuple(coords_mask.shape)} with multiplicity {m} make "
            f"{is_nucleotide.shape[0] * m} and {coords_mask.shape[0] * m}"
        )
    dt = pred_coords.dtype
    distinct = 1 - torch.eye(a, dtype=dt, device=pred_coords.device)
    lddt = []
    for i in range(rows):
        nuc, mask = is_nucleotide[i // m].to(dt), coords_mask[i // m].to(dt)
        e, n = lddt_pair_sums(
            pred_coords[i],
            true_coords[i].to(dt),
            pred_coords[i],
            true_coords[i].to(dt),
            nuc,
            mask,
            mask,
            distinct,
            nucleic_acid_cutoff,
            other_cutoff,
        )
        lddt.append(e / (n + 1e-5))
    return 1.0 - torch.stack(lddt).mean()


def _check_inputs(
    feats: Mapping[str, Any], out_dict: Mapping[str, Any], m: int, lddt: bool, plddt: bool
) -> None:
    if m < 1:
        raise ValueError(f"compute_loss: multiplicity must be at least 1, got {m}")
    for k in LOSS_KEYS:
        if k not in out_dict:
            raise ValueError(f"compute_loss: out_dict has no {k!r} (the training forward's output)")
    need = ["atom_resolved_mask", "atom_to_token", "mol_type"] + (["coords"] if lddt else [])
    need += ["plddt"] if plddt else []
    for k in need:
        if k not in feats:
            raise ValueError(f"compute_loss: feature {k!r} is missing")
    b, a = feats["atom_resolved_mask"].shape[:2]
    rows = (b * m, a, 3)
    for name, x in [(k, out_dict[k]) for k in LOSS_KEYS if k != "sigmas"] + (
        [("coords", feats["coords"])] if lddt else []
    ):
        if tuple(x.shape) != rows:
            raise ValueError(
                f"compute_loss: {name} has shape {tuple(x.shape)}, expected {rows} (B m rows for B = {b} "
                f"elements of atom_resolved_mask and multiplicity {m}, A = {a} atoms)"
            )
    if tuple(out_dict["sigmas"].shape) != (b * m,):
        raise ValueError(
            f"compute_loss: sigmas has shape {tuple(out_dict['sigmas'].shape)}, expected ({b * m},)"
        )


def compute_loss(
    diffusion: Any,
    feats: Mapping[str, Any],
    out_dict: Mapping[str, Any],
    add_smooth_lddt_loss: bool = True,
    nucleotide_loss_weight: float = 5.0,
    ligand_loss_weight: float = 10.0,
    multiplicity: int = 1,
    filter_by_plddt: float = 0.0,
) -> dict[str, Any]:
    """Boltz-2's ``AtomDiffusion.compute_loss`` (module docstring) for the sampler module
    ``diffusion`` (its ``sigma_data``, ``align_svd_dtype``, ``zero``). ``out_dict``:
    ``denoised_atom_coords`` and ``aligned_true_atom_coords`` ``[B m, A, 3]``, ``sigmas[B m]``;
    ``feats``: ``atom_resolved_mask[B, A]``, ``atom_to_token[B, A, N]``, ``mol_type[B, N]``,
    ``coords[B m, A, 3]`` (the true coordinates, repeated per sample, not augmented) and, with
    ``filter_by_plddt > 0``, ``plddt[B, A]``. Returns ``{"loss", "loss_breakdown": {"mse_loss",
    "smooth_lddt_loss"}}``."""
    m = int(multiplicity)
    _check_inputs(feats, out_dict, m, add_smooth_lddt_loss, filter_by_plddt > 0)
    den = out_dict["denoised_atom_coords"]
    ct = torch.promote_types(den.dtype, torch.float32)
    den = den.to(ct)
    sigmas = out_dict["sigmas"].to(ct)
    resolved = feats["atom_resolved_mask"].to(ct)
    resolved_uni = resolved
    if filter_by_plddt > 0:
        resolved_uni = resolved * (feats["plddt"] > filter_by_plddt).to(ct)
    resolved_m = resolved_uni.repeat_interleave(m, 0)
    atom_type = atom_mol_type(feats["atom_to_token"], feats["mol_type"], ct)
    weights = align_weights(atom_type, nucleotide_loss_weight, ligand_loss_weight, ct).repeat_interleave(m, 0)
    x_true = weighted_rigid_align(
        out_dict["aligned_true_atom_coords"].to(ct).detach(),
        den.detach(),
        weights,
        resolved.repeat_interleave(m, 0),
        diffusion.align_svd_dtype,
    )
    sq = ((den - x_true) ** 2).sum(-1)
    mse = (sq * weights * resolved_m).sum(-1) / ((3 * weights * resolved_m).sum(-1) + 1e-5)
    mse_loss = (mse * loss_weight(sigmas, diffusion.sigma_data)).mean()
    total = mse_loss
    lddt = diffusion.zero
    if add_smooth_lddt_loss:
        lddt = smooth_lddt_loss(
            den, feats["coords"].to(ct), is_nucleotide(atom_type, ct), resolved_uni, multiplicity=m
        )
        total = total + lddt
    return {"loss": total, "loss_breakdown": {"mse_loss": mse_loss, "smooth_lddt_loss": lddt}}
