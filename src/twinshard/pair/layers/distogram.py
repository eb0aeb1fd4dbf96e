"""CP twin of the distogram head and its loss: the loss as ONE ``autograd.Function``.

The serial module (``twinshard.pair.reference.distogram``) computes, per sample b,
``loss_b = sum_ij m_ij e_ij / (1e-5 + sum_ij m_ij)`` with ``e_ij = -sum_bins P_ij
log_softmax((z_ij + z_ji) W + b)`` and ``m_ij = mask_i mask_j (1 - [i == j])``, then the mean
over b. Here it runs on the pair tiles of a rows x cols grid and is the template for other
heads: placements in, local tensor math, named collectives, placements out, and a backward
written by hand so that nothing of the [N, N, bins] logits is kept.

:class:`DistogramLossFunction` -- ``apply(z, weight, bias, target, pair_weight, grid)``:

Placements. In: ``z`` the local tile ``[B, Nr/R, Nc/C, c_z]`` of a pair DTensor at
``(Shard(1), Shard(2))``; ``weight [bins, c_z]`` and ``bias [bins]`` replicated (the
head's parameters); ``target`` the local tile ``[B, Nr/R, Nc/C, bins]`` of the pair-placed bin
counts (conformers already summed); ``pair_weight`` the local tile ``[B, Nr/R, Nc/C]`` of
``m_ij`` (zero on padding, on the diagonal and on masked tokens; no gradient). Out:
``per_sample [B]``, replicated: identical on every rank.

Collectives. Forward: one tile transpose (``comm.transpose_tiles_local``: this rank's tile
of ``z^T``, one point-to-point exchange of one tile's worth of elements) and ONE all-reduce
over the grid of ``[2, B]`` values (the masked error sums and the mask sums), in
``promote_types(dtype, float32)``. Backward: one tile transpose of ``d(z + z^T)`` (the
transposition is its own adjoint) and ONE all-reduce of the flat ``[bins * c_z + bins]``
parameter gradient over the grid (each rank's share is a true partial: tiles are disjoint, so
nothing is counted twice). The returned gradients of ``weight`` and ``bias`` are complete and
identical on every rank; the gradient of ``z`` is this rank's tile, complete (``z`` is not
replicated).

Memory saved for backward per rank: ``z + z^T`` on the tile, ``[B, Nr/R, Nc/C, c_z]`` (serial
/ P), the per-sample mask sums ``[B]`` and references to the caller's ``target`` and
``pair_weight`` tiles (inputs, not copies). The logits ``[B, Nr/R, Nc/C, bins]`` and their
softmax are recomputed in backward (one local matmul), never saved: the serial autograd keeps
the symmetrised pair, the logits and the log-softmax, so the Function saves less than
serial / P.

:class:`CPDistogramHead` -- the serial ``DistogramHead``'s parameter (``distogram.weight``,
``distogram.bias``); ``loss(z, target, mask=None) -> (loss, per_sample)`` on DTensors, with the
token mask single-placed (default: the layout's real tokens); ``forward(z)`` gives the logits
DTensor ``[B, Nr, Nc, 1, bins]`` (pair placement) for inspection.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from twinshard.comm import primitives as P
from twinshard.comm.amp import autocast_rule
from twinshard.comm.ops import transpose_tiles, transpose_tiles_local
from twinshard.pair.features import layout_of, with_layout
from twinshard.pair.layers.tokenwise import replicated_params
from twinshard.pair.layers.triangle import pair_grid
from twinshard.pair.reference.distogram import DistogramHead
from twinshard.pair.reference.norm import compute_dtype
from twinshard.pair.tiling import PAIR, SINGLE, check_placements, from_local, pad_dim
from twinshard.runtime import ProcessGrid

__all__ = ["CPDistogramHead", "DistogramLossFunction"]


@autocast_rule("compute")
class DistogramLossFunction(torch.autograd.Function):
    """Per-sample distogram loss on pair tiles (placements, collectives, saved memory: module
    docstring).

    Dtype path (cast="compute": Boltz's distogram loss in fp32, autocast off): the transposed
    tile travels in z's dtype; the logits are computed in z's and weight's dtypes and taken to
    ``ct = promote(z, fp32)``, the log-softmax, the per-sample sums (one all-reduce, >= fp32)
    and the loss in ``ct``. Backward: logits recomputed, dlogits and the parameter gradients in
    ``ct`` (one all-reduce in ``ct``), dz in z's dtype, its transposed tile in z's dtype.
    """

    @staticmethod
    def forward(
        ctx: Any,
        z: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        target: torch.Tensor,
        pair_weight: torch.Tensor,
        grid: ProcessGrid,
    ) -> torch.Tensor:
        ct = compute_dtype(z.dtype)
        sym = z + transpose_tiles_local(z.contiguous(), grid, op="distogram:transpose")
        logits = F.linear(sym, weight, bias).to(ct)
        p = target.to(ct)
        p = p / p.sum(-1, keepdim=True).clamp(min=1)
        errors = -(p * torch.log_softmax(logits, dim=-1)).sum(-1)
        w = pair_weight.to(ct)
        sums = P.all_reduce(torch.stack([(errors * w).sum((1, 2)), w.sum((1, 2))]), None, op="distogram:sums")
        den = 1e-5 + sums[1]
        ctx.grid = grid
        ctx.save_for_backward(sym, weight, bias, target, pair_weight, den)
        return sums[0] / den

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        sym, weight, bias, target, pair_weight, den = ctx.saved_tensors
        ct = den.dtype
        logits = F.linear(sym, weight, bias).to(ct)  # recomputed, never saved
        p = target.to(ct)
        p = p / p.sum(-1, keepdim=True).clamp(min=1)
        coef = (g.to(ct) / den)[:, None, None] * pair_weight.to(ct)
        dlogits = coef[..., None] * (torch.softmax(logits, dim=-1) * p.sum(-1, keepdim=True) - p)
        flat_l, flat_s = dlogits.flatten(0, 2), sym.to(ct).flatten(0, 2)
        dw, db = flat_l.T @ flat_s, flat_l.sum(0)
        grads = P.all_reduce(torch.cat([dw.flatten(), db]), None, op="distogram:param_grads")
        dw, db = grads[: dw.numel()].view_as(weight), grads[dw.numel() :]
        dsym = (dlogits @ weight.to(ct)).to(sym.dtype)
        dz = dsym + transpose_tiles_local(dsym.contiguous(), ctx.grid, op="distogram:transpose_backward")
        return dz, dw.to(weight.dtype), db.to(bias.dtype), None, None, None


def _pair_weight(z: DTensor, mask: DTensor | None, grid: ProcessGrid) -> torch.Tensor:
    """Local tile of ``mask_i mask_j (1 - [i == j])`` with padding zero (no gradient)."""
    local = z.to_local()
    b, ni, nj = local.shape[:3]
    r, c = grid.coords
    rows = torch.arange(r * ni, (r + 1) * ni, device=local.device)
    cols = torch.arange(c * nj, (c + 1) * nj, device=local.device)
    layout = layout_of(z) or (layout_of(mask) if mask is not None else None)
    if mask is None:
        if layout is None:
            raise ValueError(
                "distogram loss (mask=None): z carries no PairLayout, so padded tokens cannot be told "
                "from real ones: pass mask= or restore the layout with twinshard.pair.features.with_layout"
            )
        full = (torch.arange(max(layout.padded), device=local.device) < layout.n_tokens).to(local.dtype)
        full = full.expand(b, -1)
    else:  # the single mask's rows I_r are local; its columns J_c come from the grid column
        full = P.all_gather(
            mask.to_local().detach().to(local.dtype).contiguous(), 1, grid.col_group, op="distogram:mask"
        )
        if layout is not None:
            full = full * (torch.arange(full.shape[1], device=local.device) < layout.n_tokens)
        full = pad_dim(full, 1, max(full.shape[1], (c + 1) * nj))  # columns beyond Nr: padding
    mi, mj = full[:, rows], full[:, cols]
    off_diag = (rows[:, None] != cols[None, :]).to(local.dtype)
    return mi[:, :, None] * mj[:, None, :] * off_diag


class CPDistogramHead(DistogramHead):
    """Distogram head on pair DTensors; the loss through :class:`DistogramLossFunction`."""

    def loss(
        self, z: DTensor, target: DTensor, mask: DTensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, per_sample[B])``, replicated on every rank. ``z`` pair ``[B, Nr, Nc, c_z]``,
        ``target`` pair ``[B, Nr, Nc, (K,) bins]`` (bin counts), ``mask`` single ``[B, Nr]``."""
        what = type(self).__name__
        check_placements(z, PAIR, f"{what} input z", ndim=4)
        check_placements(target, PAIR, f"{what} target")
        if mask is not None:
            check_placements(mask, SINGLE, f"{what} mask", ndim=2)
        if self.num_distograms != 1:
            raise ValueError(f"the aggregated loss takes one predicted distogram, got {self.num_distograms}")
        if z.shape[-1] != self.token_z or (z.shape[1] != z.shape[2] and layout_of(z) is None):
            raise ValueError(f"expected a pair tensor [B, N, N, {self.token_z}], got {tuple(z.shape)}")
        if tuple(target.shape[:3]) != tuple(z.shape[:3]) or target.shape[-1] != self.num_bins:
            raise ValueError(
                f"target must be [B, N, N, (K,) {self.num_bins}] matching z, got {tuple(target.shape)}"
            )
        grid = pair_grid(z)
        t = target.to_local()
        if t.dim() == 5:
            t = t.sum(dim=3)
        per_sample = DistogramLossFunction.apply(
            z.to_local(),
            self.distogram.weight,
            self.distogram.bias,
            t.detach(),
            _pair_weight(z, mask, grid),
            grid,
        )
        return per_sample.mean(), per_sample

    def forward(self, z: DTensor) -> DTensor:
        """Logits ``[B, Nr, Nc, num_distograms, num_bins]`` at the pair placement."""
        check_placements(z, PAIR, f"{type(self).__name__} input z", ndim=4)
        grid = pair_grid(z)
        w, b = replicated_params([self.distogram.weight, self.distogram.bias], z)
        local = z.to_local()
        logits = F.linear(local + transpose_tiles(local, grid), w, b)
        out = from_local(logits.unflatten(-1, (self.num_distograms, self.num_bins)), z.device_mesh, PAIR)
        layout = layout_of(z)
        return out if layout is None else with_layout(out, layout, "pair")
