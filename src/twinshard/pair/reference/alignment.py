"""Boltz's weighted rigid alignment (AlphaFold3 supplement, Algorithm 28; ``weighted_rigid_align``
of ``boltz/model/loss/diffusionv2.py``): the weighted Kabsch fit of one point cloud onto another,
used by the sampler (``alignment_reverse_diff``) and by the diffusion loss. The atom sums go
through a caller's ``atom_sum`` so a distributed caller passes its global sum over the atom blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["rotation_from_covariance", "weighted_rigid_align"]


def rotation_from_covariance(cov: torch.Tensor, svd_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Kabsch: the proper rotation ``U diag(1, 1, det(U V^T)) V^T`` of the SVD ``cov = U S V^T``
    (``cov[..., 3, 3]``), computed in ``svd_dtype`` (Boltz: fp32) and returned in ``cov``'s dtype."""
    c = cov.to(svd_dtype)
    u, _, vh = torch.linalg.svd(c, driver="gesvd" if c.is_cuda else None)
    det = torch.det(u @ vh)
    f = torch.ones(c.shape[:-1], dtype=c.dtype, device=c.device)
    f[..., -1] = det
    return ((u * f[..., None, :]) @ vh).to(cov.dtype)


def weighted_rigid_align(
    true_coords: torch.Tensor,
    pred_coords: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    svd_dtype: torch.dtype = torch.float32,
    atom_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """AF3 Algorithm 28 (Boltz's ``weighted_rigid_align``): ``true_coords[B, A, 3]`` rotated and
    translated onto ``pred_coords`` by the ``mask x weights``-weighted Kabsch fit; detached.

    ``atom_sum(x[B, A, ...]) -> [B, ...]`` sums over the atom axis (default ``x.sum(1)``; the CP
    sampler passes its global sum over the atom blocks): the weighted centroids, then the 3 x 3
    covariance ``sum_a w_a (p_a - p_c)(t_a - t_c)^T`` (two passes, as Boltz)."""
    atom_sum = atom_sum or (lambda x: x.sum(1))
    w = (mask * weights).unsqueeze(-1)
    wsum = atom_sum(w)[:, None]
    t_c = atom_sum(true_coords * w)[:, None] / wsum
    p_c = atom_sum(pred_coords * w)[:, None] / wsum
    t0, p0 = true_coords - t_c, pred_coords - p_c
    cov = atom_sum((w * p0)[..., :, None] * t0[..., None, :])  # [B, 3, 3]: i from pred, j from true
    rot = rotation_from_covariance(cov, svd_dtype)
    return (torch.einsum("bni,bji->bnj", t0, rot) + p_c).detach()
