"""Boltz-2's confidence losses (AF3 supplement section 4.3.1-4.3.4, Alg. 31's targets; boltz
``model/loss/confidencev2.py``), serial: the oracle of
``twinshard.pair.layers.confidence_loss.confidence_loss``.

Inputs (Boltz's names): the confidence heads' logits ``plddt_logits [B m, N, b_plddt]``,
``resolved_logits [B m, N, 2]``, ``pde_logits``/``pae_logits [B m, N, N, 64]``, the predicted
atoms ``sample_atom_coords [B m, A, 3]`` (sample ``b m + j`` is element b's j-th), the true atoms
``true_coords [B m, A, 3]`` with ``true_coords_resolved_mask [B m, A]`` (Boltz's
``get_true_coordinates`` without symmetry correction: element b's conformer and
``atom_resolved_mask`` repeated m times; :func:`true_coordinates`) and the features
``token_to_rep_atom``, ``r_set_to_rep_atom``, ``atom_to_token``, ``mol_type``, ``asym_id``,
``token_pad_mask``, ``atom_pad_mask``, ``atom_resolved_mask``, ``frames_idx [B, N, 3]``,
``frame_resolved_mask [B, N]`` (Boltz squeezes the conformer axis K = 1 first).

Token-level targets (``token_level_confidence``; x_i the representative atom of token i, the
R set the resolved polymer tokens' centre atoms, rows of ``r_set_to_rep_atom``; r the resolved
mask; everything computed without gradient, the coordinates enter through targets and masks):

- pLDDT: for token i and R-set atom k (k not x_i's own atom, both resolved, true distance below
  the cut-off 15 A, 30 A where k's token is DNA or RNA) the score
  ``s_ik = 1/4 sum_{t in .5, 1, 2, 4} [| |x_i - x_k|_true - |x_i - x_k|_pred | < t]``;
  ``lddt_i = (1e-10 + sum_k s_ik) / (1e-10 + n_i)`` over the n_i counted k; its bin
  ``min(floor(lddt_i b_plddt), b_plddt - 1)``; cross-entropy over tokens with r(x_i) = 1 and
  n_i > 0.
- PDE: ``| |x_i - x_j|_true - |x_i - x_j|_pred |``, bins of 32 / 64 A (the last open), over
  pairs of tokens whose representative atoms are resolved.
- PAE: the frame of token i from atoms (a, b, c) (``frames_idx``; for non-polymer chains of >= 3
  atoms recomputed from the coordinates, nearest resolved neighbours: :func:`compute_frame_pred`,
  on the true and on the predicted atoms separately): ``e1 = (w1 + w2)/|.|``,
  ``e2 = (w2 - w1)/|.|``, ``e3 = e1 x e2`` with ``w1 = (a - b)/|.|``, ``w2 = (c - b)/|.|`` (each
  norm + 1e-5); ``x_ij = E_i^T (b_j - b_i)``; the error ``sqrt(|x_ij^true - x_ij^pred|^2 + 1e-8)``;
  bins of 32 / 64 A; pairs with i's true frame resolved (``frame_resolved_mask``), both of i's
  frames valid (not collinear), the true frame centre of j resolved, i and j real.
- resolved: 2-class cross-entropy of r(x_i) over the real tokens.

Each loss is the per-sample mean ``sum(errors mask) / (1e-7 + sum(mask))`` then the mean over the
B m samples; ``loss = plddt + pde + resolved + alpha_pae pae``. The bin-index and lDDT formulas
follow Boltz's float operations exactly (a target on a bin edge lands in Boltz's bin).
Relative supervision (``relative_supervision_weight > 0``), ``mask_loss`` and atom-level
confidence raise ``NotImplementedError``. The logits' dtype promoted to >= fp32 throughout (fp64
stays fp64).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from twinshard.pair.reference.confidence import compute_frame_pred
from twinshard.pair.reference.norm import compute_dtype

__all__ = [
    "DNA",
    "RNA",
    "check_options",
    "confidence_loss",
    "cross_entropy_bins",
    "express_coordinate_in_frame",
    "frame_basis",
    "get_target_lddt",
    "get_target_pae",
    "get_target_pde",
    "lddt_dist",
    "lddt_scores",
    "pae_loss",
    "pde_loss",
    "plddt_loss",
    "resolved_errors",
    "resolved_loss",
    "true_coordinates",
]

DNA, RNA = 1, 2  # boltz.data.const.chain_type_ids
PAIR_MAX_DIST = 32.0  # PAE / PDE bins span 0..32 A (Boltz's max_dist)


def check_options(token_level_confidence: bool, mask_loss: Any, relative_supervision_weight: float) -> None:
    """The options outside this port raise (clear ``NotImplementedError``)."""
    if not token_level_confidence:
        raise NotImplementedError(
            "confidence_loss: atom-level confidence (token_level_confidence=False) is not supported; "
            "Boltz-2 trains token-level confidence"
        )
    if mask_loss is not None:
        raise NotImplementedError("confidence_loss: mask_loss (per-sample loss weights) is not supported")
    if relative_supervision_weight > 0.0:
        raise NotImplementedError(
            "confidence_loss: relative supervision (relative_supervision_weight > 0) is not supported"
        )


def true_coordinates(
    feats: Mapping[str, torch.Tensor], multiplicity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(true_coords [B m, A, 3], true_coords_resolved_mask [B m, A])`` from ``coords [B, K=1,
    A, 3]`` and ``atom_resolved_mask [B, A]``, each element repeated m times (Boltz's
    ``get_true_coordinates`` without symmetry correction)."""
    coords = feats["coords"]
    if coords.dim() != 4 or coords.shape[1] != 1:
        raise ValueError(f"coords must be [B, K=1, A, 3] (one conformer), got {tuple(coords.shape)}")
    m = int(multiplicity)
    return coords[:, 0].repeat_interleave(m, 0), feats["atom_resolved_mask"].repeat_interleave(m, 0)


def cross_entropy_bins(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``-log_softmax(logits)[index]`` per entry (the one-hot cross-entropy)."""
    ls = F.log_softmax(logits, dim=-1)
    return -ls.gather(-1, index.unsqueeze(-1)).squeeze(-1)


def distance_bins(target: torch.Tensor, num_bins: int, max_dist: float = PAIR_MAX_DIST) -> torch.Tensor:
    """Boltz's bin of a distance error: ``min(floor(target num_bins / max_dist), num_bins - 1)``."""
    return torch.clamp(torch.floor(target * num_bins / max_dist).long(), max=num_bins - 1)


def lddt_bins(target: torch.Tensor, num_bins: int) -> torch.Tensor:
    return torch.clamp(torch.floor(target * num_bins).long(), max=num_bins - 1)


def lddt_scores(
    pred_d: torch.Tensor, true_d: torch.Tensor, mask: torch.Tensor, cutoff: torch.Tensor
) -> tuple:
    """``(counted, score)``: the pairs scored (true distance below the cut-off, in the mask) and
    the lDDT score of each (1/4 per threshold 0.5, 1, 2, 4 A the distance error stays under)."""
    counted = (true_d < cutoff).to(mask.dtype) * mask
    err = torch.abs(true_d - pred_d)
    score = 0.25 * ((err < 0.5).to(mask.dtype) + (err < 1.0) + (err < 2.0) + (err < 4.0))
    return counted, score


def lddt_dist(
    dmat_predicted, dmat_true, mask, cutoff=15.0, per_atom=False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row lDDT ``(1e-10 + sum score) / (1e-10 + count)`` and whether any pair counted
    (``per_atom``); else the whole-matrix lDDT and the count."""
    cutoff = torch.as_tensor(cutoff, dtype=dmat_true.dtype, device=dmat_true.device)
    counted, score = lddt_scores(dmat_predicted, dmat_true, mask, cutoff)
    dims = -1 if per_atom else (-2, -1)
    n, s = counted.sum(dim=dims), (counted * score).sum(dim=dims)
    lddt = (1.0 / (1e-10 + n)) * (1e-10 + s)
    return (lddt, (n != 0).to(mask.dtype)) if per_atom else (lddt, n)


def _rep(feats: Mapping[str, torch.Tensor], key: str, m: int, dtype: torch.dtype) -> torch.Tensor:
    return feats[key].repeat_interleave(m, 0).to(dtype)


def resolved_errors(logits: torch.Tensor, resolved: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the 2-class head (class 0 resolved) against the 0/1 ``resolved``."""
    ls = F.log_softmax(logits, dim=-1)
    return -resolved * ls[..., 0] - (1 - resolved) * ls[..., 1]


def per_sample_mean(errors: torch.Tensor, mask: torch.Tensor, dims) -> torch.Tensor:
    return ((errors * mask).sum(dim=dims) / (1e-7 + mask.sum(dim=dims))).mean()


def resolved_loss(
    pred_resolved, feats, true_coords_resolved_mask, token_level_confidence=True, multiplicity=1
) -> torch.Tensor:
    """Token-level resolved loss (module docstring)."""
    check_options(token_level_confidence, None, 0.0)
    ct = compute_dtype(pred_resolved.dtype)
    t2r = _rep(feats, "token_to_rep_atom", multiplicity, ct)
    ref = (t2r @ true_coords_resolved_mask.to(ct)[..., None])[..., 0]
    pad = _rep(feats, "token_pad_mask", multiplicity, ct)
    return per_sample_mean(resolved_errors(pred_resolved.to(ct), ref), pad, -1)


def get_target_lddt(
    pred_atom_coords,
    feats,
    true_atom_coords,
    true_coords_resolved_mask,
    token_level_confidence=True,
    multiplicity=1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(target_lddt [B m, N], mask_no_match [B m, N], atom_mask [B m, N])`` (module docstring)."""
    check_options(token_level_confidence, None, 0.0)
    m, dt = multiplicity, true_atom_coords.dtype
    with torch.no_grad():
        t2r = _rep(feats, "token_to_rep_atom", m, dt)
        rset = _rep(feats, "r_set_to_rep_atom", m, dt)  # [B m, N_R, A]
        res = true_coords_resolved_mask.to(dt)
        xt, xp = true_atom_coords.detach(), pred_atom_coords.detach().to(dt)
        true_d = torch.cdist(t2r @ xt, rset @ xt)
        pred_d = torch.cdist(t2r @ xp, rset @ xp)
        rep_res = (t2r @ res[..., None])[..., 0]  # [B m, N]
        r_res = (rset @ res[..., None])[..., 0]  # [B m, N_R]
        same_atom = t2r @ rset.transpose(1, 2)  # [B m, N, N_R]: x_i is R atom k itself
        pair_mask = rep_res[:, :, None] * r_res[:, None, :] * (1 - same_atom)
        mol = feats["mol_type"].repeat_interleave(m, 0)
        nuc_tok = ((mol == DNA) | (mol == RNA)).to(dt)
        a2t = _rep(feats, "atom_to_token", m, dt)
        nuc_r = (rset @ (a2t @ nuc_tok[..., None]))[..., 0]  # [B m, N_R]
        cutoff = 15 + 15 * nuc_r[:, None, :]
        target, no_match = lddt_dist(pred_d, true_d, pair_mask, cutoff, per_atom=True)
    return target, no_match, rep_res


def plddt_loss(
    pred_lddt, pred_atom_coords, feats, true_atom_coords, true_coords_resolved_mask,
    token_level_confidence=True, multiplicity=1,
) -> torch.Tensor:  # fmt: skip
    """Token-level pLDDT loss (module docstring)."""
    target, no_match, atom_mask = get_target_lddt(
        pred_atom_coords,
        feats,
        true_atom_coords,
        true_coords_resolved_mask,
        token_level_confidence,
        multiplicity,
    )
    ct = compute_dtype(pred_lddt.dtype)
    errors = cross_entropy_bins(pred_lddt.to(ct), lddt_bins(target, pred_lddt.shape[-1]))
    return per_sample_mean(errors, (atom_mask * no_match).to(ct), -1)


def frame_basis(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``[..., 3 (e1, e2, e3), 3]``: the orthonormal frame of atoms (a, b, c) (module docstring)."""

    def unit(v: torch.Tensor) -> torch.Tensor:
        return v / (torch.norm(v, dim=-1, keepdim=True) + 1e-5)

    w1, w2 = unit(a - b), unit(c - b)
    e1, e2 = unit(w1 + w2), unit(w2 - w1)
    return torch.stack([e1, e2, torch.linalg.cross(e1, e2)], dim=-2)


def express_coordinate_in_frame(basis_i: torch.Tensor, b_i: torch.Tensor, b_j: torch.Tensor) -> torch.Tensor:
    """``x_ij = E_i (b_j - b_i)``: ``basis_i [B, I, 3, 3]``, ``b_i [B, I, 3]``, ``b_j [B, J, 3]``
    -> ``[B, I, J, 3]``."""
    d = b_j[:, None, :, :] - b_i[:, :, None, :]
    return (d[:, :, :, None, :] * basis_i[:, :, None, :, :]).sum(-1)


def _frame_atoms(x: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
    bi = torch.arange(x.shape[0], device=x.device)[:, None, None]
    return x[bi, frames]  # [B m, N, 3, ...]


def get_target_pae(
    pred_atom_coords, feats, true_atom_coords, true_coords_resolved_mask, multiplicity=1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(target_pae [B m, N, N], pair_mask [B m, N, N])`` (module docstring)."""
    m, dt = multiplicity, true_atom_coords.dtype
    with torch.no_grad():
        xt, xp = true_atom_coords.detach(), pred_atom_coords.detach().to(dt)
        res = true_coords_resolved_mask
        frames_t, ok_t = compute_frame_pred(xt, feats, m, resolved=res)
        frames_p, ok_p = compute_frame_pred(
            xp, feats, m, resolved=feats["atom_resolved_mask"].repeat_interleave(m, 0)
        )
        ft, fp = _frame_atoms(xt, frames_t), _frame_atoms(xp, frames_p)  # [B m, N, 3, 3]
        x_t = express_coordinate_in_frame(
            frame_basis(ft[:, :, 0], ft[:, :, 1], ft[:, :, 2]), ft[:, :, 1], ft[:, :, 1]
        )
        x_p = express_coordinate_in_frame(
            frame_basis(fp[:, :, 0], fp[:, :, 1], fp[:, :, 2]), fp[:, :, 1], fp[:, :, 1]
        )
        target = torch.sqrt(((x_t - x_p) ** 2).sum(-1) + 1e-8)
        b_res = torch.gather(res.to(dt), 1, frames_t[:, :, 1])  # [B m, N]: j's true frame centre resolved
        pad = _rep(feats, "token_pad_mask", m, dt)
        row = _rep(feats, "frame_resolved_mask", m, dt) * ok_t.to(dt) * ok_p.to(dt) * pad
        pair_mask = row[:, :, None] * (b_res * pad)[:, None, :]
    return target, pair_mask


def pae_loss(
    pred_pae, pred_atom_coords, feats, true_atom_coords, true_coords_resolved_mask, multiplicity=1
) -> torch.Tensor:
    """PAE loss (module docstring)."""
    target, mask = get_target_pae(
        pred_atom_coords, feats, true_atom_coords, true_coords_resolved_mask, multiplicity
    )
    ct = compute_dtype(pred_pae.dtype)
    errors = cross_entropy_bins(pred_pae.to(ct), distance_bins(target, pred_pae.shape[-1]))
    return per_sample_mean(errors, mask.to(ct), (-2, -1))


def get_target_pde(
    pred_atom_coords, feats, true_atom_coords, true_coords_resolved_mask, multiplicity=1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(target_pde [B m, N, N], mask [B m, N, N])`` (module docstring)."""
    dt = true_atom_coords.dtype
    with torch.no_grad():
        t2r = _rep(feats, "token_to_rep_atom", multiplicity, dt)
        tok = (t2r @ true_coords_resolved_mask.to(dt)[..., None])[..., 0]
        xt, xp = t2r @ true_atom_coords.detach(), t2r @ pred_atom_coords.detach().to(dt)
        target = torch.abs(torch.cdist(xt, xt) - torch.cdist(xp, xp))
    return target, tok[:, :, None] * tok[:, None, :]


def pde_loss(
    pred_pde, pred_atom_coords, feats, true_atom_coords, true_coords_resolved_mask, multiplicity=1
) -> torch.Tensor:
    """PDE loss (module docstring)."""
    target, mask = get_target_pde(
        pred_atom_coords, feats, true_atom_coords, true_coords_resolved_mask, multiplicity
    )
    ct = compute_dtype(pred_pde.dtype)
    errors = cross_entropy_bins(pred_pde.to(ct), distance_bins(target, pred_pde.shape[-1]))
    return per_sample_mean(errors, mask.to(ct), (-2, -1))


def confidence_loss(
    model_out: Mapping[str, torch.Tensor],
    feats: Mapping[str, torch.Tensor],
    true_coords: torch.Tensor,
    true_coords_resolved_mask: torch.Tensor,
    token_level_confidence: bool = True,
    multiplicity: int = 1,
    alpha_pae: float = 0.0,
    mask_loss: torch.Tensor | None = None,
    relative_supervision_weight: float = 0.0,
) -> dict[str, Any]:
    """``{"loss", "loss_breakdown": {plddt_loss, pde_loss, resolved_loss, pae_loss, rel_*}}``
    (Boltz's keys; ``pae_loss`` is 0.0 when ``alpha_pae == 0``, the ``rel_*`` terms 0.0)."""
    check_options(token_level_confidence, mask_loss, relative_supervision_weight)
    m = int(multiplicity)
    x = model_out["sample_atom_coords"]
    plddt = plddt_loss(model_out["plddt_logits"], x, feats, true_coords, true_coords_resolved_mask, True, m)
    pde = pde_loss(model_out["pde_logits"], x, feats, true_coords, true_coords_resolved_mask, m)
    resolved = resolved_loss(model_out["resolved_logits"], feats, true_coords_resolved_mask, True, m)
    pae: Any = 0.0
    if alpha_pae > 0.0:
        pae = pae_loss(model_out["pae_logits"], x, feats, true_coords, true_coords_resolved_mask, m)
    return {
        "loss": plddt + pde + resolved + alpha_pae * pae,
        "loss_breakdown": {
            "plddt_loss": plddt,
            "pde_loss": pde,
            "resolved_loss": resolved,
            "pae_loss": pae,
            "rel_plddt_loss": 0.0,
            "rel_pde_loss": 0.0,
            "rel_pae_loss": 0.0,
        },
    }
