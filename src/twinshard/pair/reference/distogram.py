"""Distogram head and loss (AlphaFold3 supplement, section 4.4; Boltz-2's ``DistogramModule`` and
``distogramv2.distogram_loss``).

Head, for a pair representation ``z[B, N, N, c_z]``::

    logits_ij <- (z_ij + z_ji) W + b            # distogram: c_z -> num_distograms * num_bins

reshaped to ``[B, N, N, num_distograms, num_bins]`` (symmetric in i, j by construction). The
parameter is Boltz-2's ``distogram`` (``distogram.weight``, ``distogram.bias``).

Target: the token-centre distance ``d_ij`` falls into bin ``sum_b [d_ij > edge_b]`` with
``edges = linspace(min_dist, max_dist, num_bins - 1)`` (AF3 / Boltz-2: 64 bins, 2 to 22 A), one-hot;
several conformers ``[B, N, N, K, num_bins]`` are summed and normalised,
``P_ij = t_ij / max(1, sum_bins t_ij)``.

Loss (Boltz-2's aggregated path, one predicted distogram)::

    e_ij   <- -sum_bins P_ij log_softmax(logits_ij)
    m_ij   <- mask_i mask_j (1 - [i == j])
    loss_b <- sum_ij m_ij e_ij / (1e-5 + sum_ij m_ij)         # per sample
    loss   <- mean_b loss_b

Everything runs in the logits' dtype promoted to >= fp32 (no ``.float()``: fp64 stays fp64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from twinshard.comm.amp import fp32_region
from twinshard.pair.reference.linear import Linear
from twinshard.pair.reference.norm import compute_dtype

__all__ = ["DistogramHead", "distogram_loss", "distogram_target"]


class DistogramHead(nn.Module):
    """``z[B, N, N, token_z] -> logits[B, N, N, num_distograms, num_bins]`` (module docstring)."""

    def __init__(self, token_z: int, num_bins: int = 64, num_distograms: int = 1):
        super().__init__()
        self.token_z = token_z
        self.num_bins = num_bins
        self.num_distograms = num_distograms
        self.distogram = Linear(token_z, num_distograms * num_bins, bias=True)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if z.dim() != 4 or z.shape[1] != z.shape[2] or z.shape[-1] != self.token_z:
            raise ValueError(f"expected a pair tensor [B, N, N, {self.token_z}], got {tuple(z.shape)}")
        logits = self.distogram(z + z.transpose(1, 2))
        return logits.unflatten(-1, (self.num_distograms, self.num_bins))

    def extra_repr(self) -> str:
        return f"token_z={self.token_z}, num_bins={self.num_bins}, num_distograms={self.num_distograms}"


def distogram_target(
    coords: torch.Tensor, num_bins: int = 64, min_dist: float = 2.0, max_dist: float = 22.0
) -> torch.Tensor:
    """One-hot distance bins ``[B, N, N, K, num_bins]`` from token centres ``coords[B, N, 3]`` or
    ``[B, N, K, 3]`` (K conformers), with Boltz-2's bin edges (module docstring)."""
    if coords.dim() == 3:
        coords = coords.unsqueeze(2)
    if coords.dim() != 4 or coords.shape[-1] != 3:
        raise ValueError(f"expected coords [B, N, 3] or [B, N, K, 3], got {tuple(coords.shape)}")
    x = coords.transpose(1, 2)  # [B, K, N, 3]
    d = (x[:, :, :, None, :] - x[:, :, None, :, :]).norm(dim=-1).permute(0, 2, 3, 1)  # [B, N, N, K]
    edges = torch.linspace(min_dist, max_dist, num_bins - 1, dtype=d.dtype, device=d.device)
    bins = (d.unsqueeze(-1) > edges).sum(dim=-1)
    return F.one_hot(bins, num_bins).to(coords.dtype)


def distogram_loss(
    logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, per_sample_loss[B])`` of ``logits[B, N, N, (1,) bins]`` against ``target[B, N, N,
    (K,) bins]`` (bin counts, summed over K and normalised) with token ``mask[B, N]``."""
    if logits.dim() == 5:
        if logits.shape[3] != 1:
            raise ValueError(f"the aggregated loss takes one predicted distogram, got {logits.shape[3]}")
        logits = logits.squeeze(3)
    if target.dim() == 5:
        target = target.sum(dim=3)
    b, n = logits.shape[:2]
    if logits.dim() != 4 or tuple(target.shape) != tuple(logits.shape):
        raise ValueError(
            f"logits and target must be [B, N, N, bins], got {tuple(logits.shape)}, {tuple(target.shape)}"
        )
    if tuple(mask.shape) != (b, n):
        raise ValueError(f"mask must be [B, N] = {(b, n)}, got {tuple(mask.shape)}")
    ct = compute_dtype(logits.dtype)
    with fp32_region(logits.device.type):  # Boltz: the distogram loss with autocast off
        target = target.to(ct)
        p = target / target.sum(-1, keepdim=True).clamp(min=1)
        errors = -(p * F.log_softmax(logits.to(ct), dim=-1)).sum(-1)
        m = mask.to(ct)
        pair = m[:, None, :] * m[:, :, None] * (1 - torch.eye(n, dtype=ct, device=logits.device))
        per_sample = (errors * pair).sum(dim=(-1, -2)) / (1e-5 + pair.sum(dim=(-1, -2)))
    return per_sample.mean(), per_sample
