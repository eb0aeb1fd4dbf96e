"""CP twin of Boltz-2's confidence losses (``twinshard.pair.reference.confidence_loss``): pLDDT, PDE,
PAE and resolved losses on a rows x cols grid, equal to serial to round-off, no N x N, A x N or
A x A tensor on a rank.

:func:`confidence_loss` ``(model_out, feats, true_coords, true_coords_resolved_mask,
token_level_confidence=True, multiplicity=1, alpha_pae=0.0)`` -> ``{"loss", "loss_breakdown"}``.

Placements in (m = multiplicity, R x C grid, ``lay_m = sample_layout(layout, m)``):

- ``model_out["pde_logits"]``, ``model_out["pae_logits"]`` (the latter read only when
  ``alpha_pae > 0``): pair ``[B m, Nr, Nc, bins]`` at ``(Shard(1), Shard(2))``;
  ``model_out["plddt_logits"]``, ``model_out["resolved_logits"]``: single ``[B m, Nr, bins]`` at
  ``(Shard(1), Replicate())`` (the CP confidence module's outputs);
- ``model_out["sample_atom_coords"]`` and ``true_coords``: kind ``atom`` ``[B m, R A_blk, 3]`` on
  ``lay_m`` (the diffusion twin's output placement; sample ``b m + j`` holds element b's atoms);
  ``true_coords_resolved_mask``: kind ``atom`` ``[B m, R A_blk]`` on ``lay_m``
  (:func:`cp_true_coordinates` makes both from the distributed ``coords``/``atom_resolved_mask``);
- ``feats``: the ``ShardedFeatures`` of ``distribute`` with ``token_to_rep_atom`` and
  ``r_set_token_to_atom`` (``token_atom``; distribute derives the latter from Boltz's
  ``r_set_to_rep_atom``), ``atom_to_token`` (``atom_token``), ``atom_pad_mask`` (``atom``),
  ``mol_type``, ``asym_id``, ``token_pad_mask``, ``frames_idx [B, Nr, 3]`` (single), and for the
  PAE loss ``frame_resolved_mask [B, Nr]`` (single) and ``atom_resolved_mask`` (``atom``).

Out: ``loss`` and each part (``plddt_loss``, ``pde_loss``, ``resolved_loss``, ``pae_loss``: 0.0
when ``alpha_pae == 0``; ``rel_*`` 0.0) as 0-d tensors identical (bit for bit) on every rank.
Gradients flow into the logits only (targets and masks are computed without gradient, from
detached coordinates, as Boltz's are); each rank's logits tile gets its complete gradient (the
single logits' tile, replicated along the grid row, gets the same gradient on every rank of the
row, as the heads' twins expect).

Computation. Per token of my row block: the representative atom ``token_to_rep_atom`` tile @
coordinates, my R-set atom (``r_set_token_to_atom`` tile @ coordinates, zero outside the R set),
the resolved flags, the nucleotide flag, the frames (:func:`cp_frame_values`: the PAE's frame
atoms and the resolved flag of the true frame's centre, non-polymer chains recomputed on the true
atoms with the resolved mask and on the predicted atoms with ``atom_resolved_mask``); the column
block's values of the same come by ONE column move (``column_block``, ``[B m, Nc/C, 16]``, 23
channels with PAE).
Then on the tile: PDE and PAE targets, masks and errors (``[B m, Nr/R, Nc/C]``), their per-sample
sums; pLDDT: the tile's tokens x the column block's R-set atoms, each token's counted pairs and
score sums over the local columns, summed over the WHOLE grid row (the lDDT of a token needs every
R-set atom; the sums are of 0/1 and quarter values, exact in any order), then the per-token
target, bin and cross-entropy on my rows; resolved: per token.

Collectives. Forward: the frames' (:func:`cp_frame_values`, twice when ``alpha_pae > 0``: two
all-reduces along the grid column of ``[B, K]`` chain counts and ``mol_type``, and where a
non-polymer chain of >= 3 atoms exists one all-gather along the column of ``[B m, A_blk, 3+k+1]``
and one of ``[B, A_blk, 2]``, transient O(A)); one column move of ``[B m, Nc/C, 16 or 23]``; one
all-gather along the grid ROW of the lDDT sums ``[2, B m, Nr/R]``; one all-gather along the grid
COLUMN of the single-loss sums ``[4, B m]`` and one over the grid of the pair-loss sums
``[4, B m]`` (each summed in rank order after the gather: the same bits on every rank).
Backward: none (each rank's sums are its own partials of a replicated value: the gradient is
passed to the local tile unchanged, DESIGN rule 7).

Memory per rank: the tiles ``[B m, Nr/R, Nc/C]`` (targets, masks, errors; the pair logits'
log-softmax ``[B m, Nr/R, Nc/C, bins]`` kept by autograd: serial / P) and the moved column block;
nothing N x N, A x N or A x A.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from twinshard.comm import primitives as P
from twinshard.pair.layers.confidence import _block_index, cp_frame_values
from twinshard.pair.layers.diffusion import sample_layout
from twinshard.pair.layers.moves import column_block
from twinshard.pair.layers.pair_init import feature_layout
from twinshard.pair.layout import layout_of, with_layout
from twinshard.pair.reference.confidence import collinear_mask
from twinshard.pair.reference.confidence_loss import (
    DNA,
    RNA,
    check_options,
    cross_entropy_bins,
    distance_bins,
    express_coordinate_in_frame,
    frame_basis,
    lddt_bins,
    lddt_scores,
    resolved_errors,
)
from twinshard.pair.reference.norm import compute_dtype
from twinshard.pair.tiling import PAIR, SINGLE, check_placements, from_local
from twinshard.runtime import ProcessGrid
from twinshard.runtime.agree import agree_scalars

__all__ = ["LOSS_FEATURES", "PAE_FEATURES", "confidence_loss", "cp_true_coordinates", "replicated_sum"]

LOSS_FEATURES = (
    "token_to_rep_atom",
    "r_set_token_to_atom",
    "atom_to_token",
    "atom_pad_mask",
    "mol_type",
    "asym_id",
    "token_pad_mask",
    "frames_idx",
)
PAE_FEATURES = ("frame_resolved_mask", "atom_resolved_mask")


class _ReplicatedSum(torch.autograd.Function):
    """Sum of per-rank partials over ``group`` (all-gather, then the sum in rank order: identical
    bits on every rank). The result is replicated and every rank differentiates it alike, so the
    backward passes the gradient to the local partial unchanged (slice, do not sum)."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, group: Any, op: str) -> torch.Tensor:
        every = P.all_gather(part.detach().unsqueeze(0).contiguous(), 0, group, op=op)
        return every.sum(0)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        return g, None, None


def replicated_sum(part: torch.Tensor, group: Any, op: str) -> torch.Tensor:
    """The sum of ``part`` over ``group`` (``None``: the whole grid), the same bits on every rank;
    differentiable with the replicated-value adjoint (each rank's gradient goes to its own part)."""
    return _ReplicatedSum.apply(part, group, op)


def cp_true_coordinates(coords: DTensor, resolved: DTensor, multiplicity: int) -> tuple[DTensor, DTensor]:
    """The CP twin of Boltz's ``get_true_coordinates`` (no symmetry correction): ``coords`` kind
    ``atom`` ``[B, R A_blk, 3]`` (the distributed ``coords`` with its K = 1 axis squeezed) and
    ``resolved`` (``atom_resolved_mask``, ``[B, R A_blk]``) -> each element's tile repeated m
    times, on ``sample_layout(layout, m)``. Local; no communication."""
    layout = layout_of(coords) or layout_of(resolved)
    if layout is None:
        raise ValueError("cp_true_coordinates: the atom DTensors carry no PairLayout (use distribute)")
    m = int(multiplicity)
    lay = sample_layout(layout, m)
    out = []
    for x in (coords, resolved):
        check_placements(x, SINGLE, "cp_true_coordinates input (atom kind)")
        out.append(
            with_layout(from_local(x.to_local().repeat_interleave(m, 0), x.device_mesh, SINGLE), lay, "atom")
        )
    return out[0], out[1]


def _ordered_sum(part: torch.Tensor, group: Any, op: str) -> torch.Tensor:
    return P.all_gather(part.unsqueeze(0).contiguous(), 0, group, op=op).sum(0)


def _check_inputs(model_out, feats, true_coords, true_mask, m, alpha_pae) -> tuple:
    what = "confidence_loss (CP)"
    keys = LOSS_FEATURES + (PAE_FEATURES if alpha_pae > 0 else ())
    layout, grid = feature_layout(feats, keys, what)
    logits = ["plddt_logits", "resolved_logits", "pde_logits"] + (["pae_logits"] if alpha_pae > 0 else [])
    missing = [k for k in logits + ["sample_atom_coords"] if k not in model_out]
    if missing:
        raise KeyError(f"{what}: model_out lacks {missing}")
    for k in logits:
        pair = k in ("pde_logits", "pae_logits")
        check_placements(model_out[k], PAIR if pair else SINGLE, f"{what} {k}", ndim=4 if pair else 3)
    for name, x, nd in (
        ("sample_atom_coords", model_out["sample_atom_coords"], 3),
        ("true_coords", true_coords, 3),
        ("true_coords_resolved_mask", true_mask, 2),
    ):
        check_placements(x, SINGLE, f"{what} {name} (atom kind on sample_layout)", ndim=nd)
    agree_scalars(
        {
            "multiplicity": m,
            "alpha_pae": float(alpha_pae),
            "shapes": [tuple(model_out[k].shape) for k in logits + ["sample_atom_coords"]],
            "true": (tuple(true_coords.shape), tuple(true_mask.shape)),
        },
        what,
    )
    bm = feats["token_pad_mask"].shape[0] * m
    for k in logits + ["sample_atom_coords"]:
        if model_out[k].shape[0] != bm:
            raise ValueError(
                f"{what}: {k} holds {model_out[k].shape[0]} samples, expected B x multiplicity = {bm}"
            )
    a_rows = tuple(model_out["sample_atom_coords"].shape[:2])
    if tuple(true_coords.shape[:2]) != a_rows or tuple(true_mask.shape) != a_rows:
        raise ValueError(
            f"{what}: true_coords {tuple(true_coords.shape)} / true_coords_resolved_mask {tuple(true_mask.shape)} "
            f"must be placed like sample_atom_coords {tuple(model_out['sample_atom_coords'].shape)} "
            "(kind atom on sample_layout(layout, m): cp_true_coordinates)"
        )
    return layout, grid, what


def confidence_loss(
    model_out: Mapping[str, Any],
    feats: Mapping[str, DTensor],
    true_coords: DTensor,
    true_coords_resolved_mask: DTensor,
    token_level_confidence: bool = True,
    multiplicity: int = 1,
    alpha_pae: float = 0.0,
    mask_loss: torch.Tensor | None = None,
    relative_supervision_weight: float = 0.0,
) -> dict[str, Any]:
    """Boltz-2's ``confidence_loss`` on the grid (module docstring: placements, collectives)."""
    check_options(token_level_confidence, mask_loss, relative_supervision_weight)
    m = int(multiplicity)
    layout, grid, _ = _check_inputs(model_out, feats, true_coords, true_coords_resolved_mask, m, alpha_pae)
    with_pae = alpha_pae > 0.0
    plddt_l = model_out["plddt_logits"].to_local()
    ct = compute_dtype(plddt_l.dtype)
    with torch.no_grad():
        t = _targets(model_out, feats, true_coords, true_coords_resolved_mask, layout, grid, m, with_pae)
    # single losses: my row block's tokens, summed along the grid column
    errors = cross_entropy_bins(plddt_l.to(ct), lddt_bins(t["lddt"], plddt_l.shape[-1]))
    w_plddt = t["lddt_mask"].to(ct)
    res_l = model_out["resolved_logits"].to_local().to(ct)
    w_res = t["pad"].to(ct)
    single = torch.stack(
        [
            (errors * w_plddt).sum(-1),
            w_plddt.sum(-1),
            (resolved_errors(res_l, t["rep_res"].to(ct)) * w_res).sum(-1),
            w_res.sum(-1),
        ]
    )
    single = replicated_sum(single, grid.col_group, "confidence_loss:single_sums")
    # pair losses: my tile, summed over the grid
    pde_l = model_out["pde_logits"].to_local().to(ct)
    err_pde = cross_entropy_bins(pde_l, distance_bins(t["pde"], pde_l.shape[-1]))
    w_pde = t["pde_mask"].to(ct)
    pair = [(err_pde * w_pde).sum((1, 2)), w_pde.sum((1, 2))]
    if with_pae:
        pae_l = model_out["pae_logits"].to_local().to(ct)
        err_pae = cross_entropy_bins(pae_l, distance_bins(t["pae"], pae_l.shape[-1]))
        w_pae = t["pae_mask"].to(ct)
        pair += [(err_pae * w_pae).sum((1, 2)), w_pae.sum((1, 2))]
    pair_sums = replicated_sum(torch.stack(pair), None, "confidence_loss:pair_sums")

    def mean(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
        return (num / (1e-7 + den)).mean()

    plddt = mean(single[0], single[1])
    resolved = mean(single[2], single[3])
    pde = mean(pair_sums[0], pair_sums[1])
    pae: Any = mean(pair_sums[2], pair_sums[3]) if with_pae else 0.0
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


def _targets(
    model_out: Mapping[str, Any],
    feats: Mapping[str, DTensor],
    true_coords: DTensor,
    true_mask: DTensor,
    layout: Any,
    grid: ProcessGrid,
    m: int,
    with_pae: bool,
) -> dict[str, torch.Tensor]:
    """The targets and masks of this rank's rows (single losses) and tile (pair losses)."""
    xp = model_out["sample_atom_coords"].to_local().detach()
    xt = true_coords.to_local().detach()
    dt = xt.dtype
    xp = xp.to(dt)
    rm = true_mask.to_local().detach().to(dt)  # [B m, A_blk]

    def tok(key: str) -> torch.Tensor:
        return feats[key].to_local().repeat_interleave(m, 0)

    rows, cols = _block_index(grid, layout, xt.device)
    t2r, rset = tok("token_to_rep_atom").to(dt), tok("r_set_token_to_atom").to(dt)  # [B m, Nr/R, A_blk]
    pad = tok("token_pad_mask").to(dt)
    mol = tok("mol_type")
    rep_res = (t2r @ rm[..., None])[..., 0]
    r_res = (rset @ rm[..., None])[..., 0]
    nuc = ((mol == DNA) | (mol == RNA)).to(dt)
    same = (t2r * rset).sum(-1)  # my representative atom is my R-set atom
    row = [
        t2r @ xt,
        t2r @ xp,
        rep_res[..., None],
        rset @ xt,
        rset @ xp,
        r_res[..., None],
        nuc[..., None],
        pad[..., None],
    ]
    out: dict[str, torch.Tensor] = {"pad": pad, "rep_res": rep_res}
    if with_pae:
        vals = torch.cat([xt, rm[..., None]], -1)
        ft = cp_frame_values(xt, feats, layout, grid, m, values=vals, resolved=rm)  # [B m, Nr/R, 3, 4]
        amask = feats["atom_resolved_mask"].to_local().repeat_interleave(m, 0)
        fp = cp_frame_values(xp, feats, layout, grid, m, resolved=amask)  # [B m, Nr/R, 3, 3]
        ok_t = collinear_mask(ft[:, :, 1, :3] - ft[:, :, 0, :3], ft[:, :, 1, :3] - ft[:, :, 2, :3]).to(dt)
        ok_p = collinear_mask(fp[:, :, 1] - fp[:, :, 0], fp[:, :, 1] - fp[:, :, 2]).to(dt)
        basis_t = frame_basis(ft[:, :, 0, :3], ft[:, :, 1, :3], ft[:, :, 2, :3])
        basis_p = frame_basis(fp[:, :, 0], fp[:, :, 1], fp[:, :, 2])
        b_t, b_p, b_res = ft[:, :, 1, :3], fp[:, :, 1], ft[:, :, 1, 3]
        row += [b_t, b_p, b_res[..., None]]
    col = column_block(
        torch.cat(row, -1), grid, layout.padded, "confidence_loss:columns", differentiable=False
    )
    xt_c, xp_c, rep_res_c = col[..., 0:3], col[..., 3:6], col[..., 6]
    xt_rc, xp_rc, r_res_c, nuc_c, pad_c = (
        col[..., 7:10],
        col[..., 10:13],
        col[..., 13],
        col[..., 14],
        col[..., 15],
    )
    xt_r, xp_r = row[0], row[1]
    # PDE
    out["pde"] = torch.abs(torch.cdist(xt_r, xt_c) - torch.cdist(xp_r, xp_c))
    out["pde_mask"] = rep_res[:, :, None] * rep_res_c[:, None, :]
    # pLDDT: my tokens x the column block's R-set atoms, sums over the whole grid row
    eq = (rows[:, None] == cols[None, :]).to(dt)
    pair_mask = rep_res[:, :, None] * r_res_c[:, None, :] * (1 - eq * same[:, :, None])
    cutoff = 15 + 15 * nuc_c[:, None, :]
    counted, score = lddt_scores(torch.cdist(xp_r, xp_rc), torch.cdist(xt_r, xt_rc), pair_mask, cutoff)
    sums = _ordered_sum(
        torch.stack([counted.sum(-1), (counted * score).sum(-1)]), grid.row_group, "confidence_loss:lddt_rows"
    )
    out["lddt"] = (1.0 / (1e-10 + sums[0])) * (1e-10 + sums[1])
    out["lddt_mask"] = rep_res * (sums[0] != 0).to(dt)
    if with_pae:
        b_t_c, b_p_c, b_res_c = col[..., 16:19], col[..., 19:22], col[..., 22]
        x_t = express_coordinate_in_frame(basis_t, b_t, b_t_c)
        x_p = express_coordinate_in_frame(basis_p, b_p, b_p_c)
        out["pae"] = torch.sqrt(((x_t - x_p) ** 2).sum(-1) + 1e-8)
        frm = tok("frame_resolved_mask").to(dt)
        row_mask = frm * ok_t * ok_p * pad
        out["pae_mask"] = row_mask[:, :, None] * (b_res_c * pad_c)[:, None, :]
    return out
