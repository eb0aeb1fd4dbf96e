"""The CP twin of the diffusion loss (:mod:`twinshard.pair.reference.structure_loss`, Boltz-2's
``AtomDiffusion.compute_loss``): :func:`cp_compute_loss`, ``CPAtomDiffusion.compute_loss``.

Placements. In (``m`` = multiplicity, ``lay_m = sample_layout(feats.layout, m)``):

- ``out_dict["denoised_atom_coords"]``, ``out_dict["aligned_true_atom_coords"]``: atom DTensors
  ``[B m, R A_blk, 3]`` on ``lay_m`` (``(Shard(1), Replicate())``: grid row r holds the atoms of
  token row block r of every sample row ``b m + j``, replicated along the row), as the CP score
  model and :func:`~twinshard.pair.features.shard_tensor` (kind ``"atom"``, layout ``lay_m``) give
  them; a DTensor that carries another layout raises;
- ``out_dict["sigmas"]``: ``[B m]``, replicated (a plain tensor, or a DTensor with every placement
  ``Replicate``); its values are agreed across ranks;
- ``feats``: the ``ShardedFeatures`` of ``distribute``: ``atom_resolved_mask`` (atom ``[B, A]``),
  ``atom_to_token`` (atom_token), ``mol_type`` (single), ``plddt`` (atom, with
  ``filter_by_plddt > 0``) and ``coords``: the true coordinates ``[B m, A, 3]`` repeated per sample
  (Boltz-2's training forward sets ``feats["coords"]`` so), an atom DTensor on ``lay_m`` like the
  denoised coordinates (needed with ``add_smooth_lddt_loss``).

Out: ``{"loss", "loss_breakdown": {"mse_loss", "smooth_lddt_loss"}}``, 0-dim plain tensors with
the same bits on every rank; ``loss.backward()`` (on every rank: the backward communicates)
gives the denoised coordinates' DTensor its gradient, complete on every rank of each grid row
(collect it with ``collect_grad(kind="atom")``).

The weighted MSE. The alignment weights come from each atom's token ``mol_type`` on its own
tile (``atom_to_token`` is local to the row block). The rigid alignment is the reference's
:func:`~twinshard.pair.reference.alignment.weighted_rigid_align` with global atom sums
(:func:`~twinshard.pair.layers.sums.column_sum`: partials of the grid rows gathered along the
grid column and added in grid-row order): the weight sum, the two weighted centroids and the
3 x 3 covariance, then the SVD replicated on every rank. The per-row numerator and denominator
of the MSE are one more column sum.

The smooth lDDT without an ``A x A`` tensor. The atom-pair matrix of a sample row is tiled over
the grid: rank (r, c) scores the pairs (atoms of its row block r) x (column piece c), the global
atoms ``[c L, c L + L)`` with ``L = ceil(A / C)`` (on a square grid of equal blocks the piece of
column c is about row block c's atoms). Every ordered pair (i, j) lies in exactly one tile. The
piece's atoms (denoised coordinates with autograd, true coordinates, mask) come from the ranks
(a, c) of the grid column whose row block a meets the piece (:func:`atom_columns`, a pure function
of the replicated layout; one packed message per peer). The cutoff of a pair is its ROW atom's
(as Boltz), so the piece needs no nucleotide flag. Each rank sums ``e_ij valid_ij`` and
``valid_ij`` over its tile, per sample row; :func:`~twinshard.pair.layers.sums.grid_sum` adds
the partials of all ranks (row stage, then column stage), so each pair counts once.
``i != j`` is tested on global atom indices.

Gradients. The MSE part of a rank's tile gradient is complete (its atoms' terms are all on its
grid row; the column sums' adjoint is the replicated gradient). The lDDT part is partial: the
row side of rank (a, c) covers the pairs with column piece c only, the column side of a piece
goes back to the ranks (a, c) that sent it (the move's reverse exchange), so the lDDT gradient
enters through ``comm.sync_grad`` along the grid row (one all-reduce of the tile gradient).

Collectives. Forward: ``agree_scalars`` (multiplicity, flags, weights, the sigmas) and one
``raise_together`` (input checks), both object all-gathers; 4 column all-gathers for the
alignment (``diffusion_loss:align``: ``[R, B m, 1]``, ``[R, B m, 3]`` twice, ``[R, B m, 3, 3]``),
1 for the MSE sums (``[R, B m, 2]``); with the lDDT one point-to-point exchange along the grid
column (``diffusion_loss:columns``: each rank receives its piece, ``B m x L x 7`` values) and the
grid sum (``[C, B m, 2]`` along the row, ``[R, B m, 2]`` along the column). Backward: the reverse
exchange (``B m x L x 7``) and one all-reduce along the grid row of the tile gradient
(``[B m, A_blk, 3]``); the sums' adjoints communicate nothing.

Memory per rank: the tiles ``[B m, A_blk, 3]``, the piece ``[B m, L, 7]``, and per sample row
the pair tile ``A_blk x L`` (about ``A^2 / P``; autograd keeps a few such tiles per row for
backward, as the serial loss keeps its ``A x A`` ones). Nothing of size ``A x A`` or ``A x N``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from twinshard.comm.amp import autocast_rule
from twinshard.comm.ops import sync_grad
from twinshard.pair.layers.atom_transformer import slice_move, slice_return
from twinshard.pair.layers.diffusion import sample_layout
from twinshard.pair.layers.sums import column_sum, grid_sum
from twinshard.pair.layers.triangle import pair_grid
from twinshard.pair.layout import PairLayout, atom_keep, layout_kind, layout_of
from twinshard.pair.reference.alignment import weighted_rigid_align
from twinshard.pair.reference.structure_loss import (
    LOSS_KEYS,
    align_weights,
    atom_mol_type,
    is_nucleotide,
    lddt_pair_sums,
)
from twinshard.pair.tiling import SINGLE, check_placements
from twinshard.runtime import ProcessGrid, raise_together
from twinshard.runtime.agree import agree_scalars

__all__ = ["AtomColumns", "atom_columns", "column_atoms", "cp_compute_loss"]

_PLACEMENT_FIELDS = (
    "grid_shape",
    "n_tokens",
    "padded",
    "n_atoms",
    "atom_block",
    "atom_starts",
    "atom_counts",
)


@dataclass(frozen=True)
class AtomColumns:
    """Rank (r, c)'s column piece: global atoms ``[piece L, piece L + L)`` of every sample row.
    ``sends``: ``(peer, b, lo, hi)`` rows of my tile to send; ``recvs``: ``(peer, b, lo, hi,
    pos)`` rows ``[lo, hi)`` of the peer's tile, placed at piece position ``pos``."""

    piece: int
    length: int
    sends: tuple[tuple[int, int, int, int], ...]
    recvs: tuple[tuple[int, int, int, int, int], ...]


def _piece_of(coords: tuple[int, ...]) -> int:
    """The column piece a rank scores: its grid column."""
    return coords[1]


def atom_columns(layout: PairLayout, grid: ProcessGrid) -> AtomColumns:
    """This rank's :class:`AtomColumns` for atom tiles on ``layout`` (a pure function of the
    replicated layout: every rank derives every peer's part). The piece of rank (r, c) comes from
    the ranks (a, c) of its grid column, a the grid rows whose atoms meet it."""
    if layout.n_atoms is None or layout.atom_starts is None or layout.atom_counts is None:
        raise ValueError("the atom columns need a layout with atoms (distribute the atom features)")
    a_all, length = layout.n_atoms, -(-layout.n_atoms // grid.cols)
    me = grid.rank
    sends, recvs = [], []
    for rank in range(grid.size):  # every receiver, in rank order
        rr, cc = grid.coords_of(rank)
        p = _piece_of((rr, cc))
        lo_p, hi_p = p * length, min(p * length + length, a_all)
        for a in range(grid.rows):
            sender = grid.rank_of((a, cc))
            if me not in (rank, sender):
                continue
            for b, (st, cn) in enumerate(zip(layout.atom_starts, layout.atom_counts)):
                lo, hi = max(lo_p, st[a]), min(hi_p, st[a] + cn[a])
                if lo >= hi:
                    continue
                if sender == me:
                    sends.append((rank, b, lo - st[a], hi - st[a]))
                if rank == me:
                    recvs.append((sender, b, lo - st[a], hi - st[a], lo - lo_p))
    return AtomColumns(_piece_of(grid.coords), length, tuple(sends), tuple(recvs))


@autocast_rule()
class _ColumnAtoms(torch.autograd.Function):
    """My atom tile ``[B, A_blk, ...]`` -> my column piece ``[B, L, ...]`` (zeros where no atom
    of the piece exists). Backward: each received row's gradient goes back to its sender, which
    adds it to its tile's gradient (the reverse exchange). Dtype path: the tile's dtype on the
    wire and in the piece, the gradient's on the way back; no cast."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, plan: AtomColumns, op: str) -> torch.Tensor:
        ctx.plan, ctx.op, ctx.shape = plan, op, tuple(local.shape)
        pending = slice_move(local, plan.sends, plan.recvs, op)
        piece = local.new_zeros((local.shape[0], plan.length, *local.shape[2:]))
        for (_, b, lo, hi, pos), got in zip(plan.recvs, pending.wait()):
            piece[b, pos : pos + hi - lo] = got
        return piece

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        plan = ctx.plan
        g = g.contiguous()
        back = slice_return(g, plan.sends, plan.recvs, ctx.op)
        gl = g.new_zeros(ctx.shape)
        for (_, b, lo, hi), piece in zip(plan.sends, back.wait()):
            gl[b, lo:hi] += piece
        return gl, None, None


def column_atoms(local: torch.Tensor, plan: AtomColumns, op: str = "diffusion_loss:columns") -> torch.Tensor:
    """Differentiable column piece of an atom tile (:class:`AtomColumns`; module docstring)."""
    return _ColumnAtoms.apply(local.contiguous(), plan, op)


# -- input checks ------------------------------------------------------------------------------


def _same_placement(a: PairLayout, b: PairLayout) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in _PLACEMENT_FIELDS)


def _atom_tile(
    x: Any, name: str, lay: PairLayout, grid: ProcessGrid, what: str, width: int | None
) -> torch.Tensor:
    """The local tile of an atom DTensor on ``lay``; raises naming ``name`` otherwise."""
    check_placements(x, SINGLE, f"{what} {name}", grid=grid)
    own = layout_of(x)
    if own is not None and (layout_kind(x) != "atom" or not _same_placement(own, lay)):
        raise ValueError(
            f"{what}: {name} is placed on another layout (kind {layout_kind(x)!r}, {len(own.atom_starts or ())} "
            f"rows of atoms) than the atom layout of {len(lay.atom_starts or ())} rows (B x multiplicity) of the "
            "features: shard it with the features' layout (sample_layout(feats.layout, multiplicity))"
        )
    local = x.to_local()
    want = (len(lay.atom_starts), lay.atom_block) + (() if width is None else (width,))  # type: ignore[arg-type]
    if tuple(local.shape) != want:
        raise ValueError(
            f"{what}: {name}'s tile is {tuple(local.shape)}, expected {want} (B x multiplicity rows, "
            f"A_blk = {lay.atom_block} atoms{'' if width is None else ', xyz'}): wrong multiplicity or layout?"
        )
    return local


def _sigmas(x: Any, rows: int, what: str) -> torch.Tensor:
    if isinstance(x, DTensor):
        if not all(isinstance(p, Replicate) for p in x.placements):
            raise ValueError(f"{what}: sigmas must be replicated, got placements {x.placements}")
        x = x.to_local()
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != (rows,):
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what}: sigmas must be [B x multiplicity] = [{rows}], got {shape}")
    return x


def _local_inputs(
    feats: Mapping[str, Any], out_dict: Mapping[str, Any], m: int, lddt: bool, plddt: bool, what: str
) -> dict[str, Any]:
    """The local tiles of every input, checked (raises on this rank; the caller raises together)."""
    layout = getattr(feats, "layout", None)
    if layout is None or layout.n_atoms is None:
        raise ValueError(f"{what} takes the ShardedFeatures of distribute with atom features (feats.layout)")
    if m < 1:
        raise ValueError(f"{what}: multiplicity must be at least 1, got {m}")
    for k in LOSS_KEYS:
        if k not in out_dict:
            raise ValueError(f"{what}: out_dict has no {k!r} (the training forward's output)")
    need = {"atom_resolved_mask": "atom", "atom_to_token": "atom_token", "mol_type": "single"}
    need |= {"coords": "atom"} if lddt else {}
    need |= {"plddt": "atom"} if plddt else {}
    for k in sorted(need):
        if k not in feats:
            raise ValueError(f"{what}: feature {k!r} is missing (kind {need[k]})")
    den_dt = out_dict["denoised_atom_coords"]
    check_placements(den_dt, SINGLE, f"{what} denoised_atom_coords", ndim=3)
    grid = pair_grid(den_dt)
    lay_m = sample_layout(layout, m)
    out = {"grid": grid, "layout": layout, "lay_m": lay_m}
    for k in ("denoised_atom_coords", "aligned_true_atom_coords"):
        out[k] = _atom_tile(out_dict[k], k, lay_m, grid, what, 3)
    if lddt:  # Boltz-2's training forward repeats the true coordinates per sample: [B m, A, 3]
        name = "feats['coords'] (the true coordinates repeated per sample, [B m, A, 3])"
        out["coords"] = _atom_tile(feats["coords"], name, lay_m, grid, what, 3)
    for k in ("atom_resolved_mask",) + (("plddt",) if plddt else ()):
        out[k] = _atom_tile(feats[k], k, layout, grid, what, None)
    for k in ("atom_to_token", "mol_type"):
        check_placements(feats[k], SINGLE, f"{what} feature {k!r}", grid=grid)
        kind = layout.kinds.get(k, need[k])
        if kind != need[k]:
            raise ValueError(f"{what}: feature {k!r} is of kind {kind}, expected {need[k]}")
        out[k] = feats[k].to_local()
    out["sigmas"] = _sigmas(out_dict["sigmas"], len(lay_m.atom_starts), what)  # type: ignore[arg-type]
    return out


# -- the loss ------------------------------------------------------------------------------------


def _smooth_lddt(
    den: torch.Tensor,
    true: torch.Tensor,
    nucleotide: torch.Tensor,
    mask: torch.Tensor,
    lay_m: PairLayout,
    grid: ProcessGrid,
) -> torch.Tensor:
    """``1 - mean_rows lddt_row`` from my pair tiles (module docstring); ``den``, ``true``
    ``[B m, A_blk, 3]``, ``nucleotide``, ``mask`` ``[B m, A_blk]`` (mask zero on padding)."""
    ct = den.dtype
    plan = atom_columns(lay_m, grid)
    x = sync_grad(den, grid.row_group)  # the lDDT's tile gradient is a partial sum over the row
    cols = column_atoms(torch.cat([x, true.to(ct), mask[..., None]], -1), plan)
    pred_c, true_c, mask_c = cols[..., :3], cols[..., 3:6], cols[..., 6]
    r = grid.coords[0]
    starts = torch.tensor([s[r] for s in lay_m.atom_starts], device=den.device)  # type: ignore[union-attr]
    gi = starts[:, None] + torch.arange(den.shape[1], device=den.device)[None, :]
    gj = plan.piece * plan.length + torch.arange(plan.length, device=den.device)
    parts = []
    for i in range(den.shape[0]):
        distinct = (gi[i][:, None] != gj[None, :]).to(ct)
        e, n = lddt_pair_sums(
            x[i],
            true[i].to(ct),
            pred_c[i],
            true_c[i],
            nucleotide[i],
            mask[i],
            mask_c[i],
            distinct,
            30.0,
            15.0,
        )
        parts.append(torch.stack([e, n]))
    sums = grid_sum(torch.stack(parts), grid, "diffusion_loss:lddt")
    return 1.0 - (sums[:, 0] / (sums[:, 1] + 1e-5)).mean()


def cp_compute_loss(
    diffusion: Any,
    feats: Mapping[str, Any],
    out_dict: Mapping[str, Any],
    add_smooth_lddt_loss: bool = True,
    nucleotide_loss_weight: float = 5.0,
    ligand_loss_weight: float = 10.0,
    multiplicity: int = 1,
    filter_by_plddt: float = 0.0,
) -> dict[str, Any]:
    """Boltz-2's ``AtomDiffusion.compute_loss`` on the grid (module docstring) for the sampler
    module ``diffusion`` (its ``sigma_data``, ``align_svd_dtype``, ``zero``)."""
    what = f"{type(diffusion).__name__}.compute_loss"
    m = int(multiplicity)
    lddt, plddt = bool(add_smooth_lddt_loss), float(filter_by_plddt) > 0
    sig = out_dict.get("sigmas")
    sig_vals = None
    if isinstance(sig, torch.Tensor):
        sig_vals = tuple((sig.to_local() if isinstance(sig, DTensor) else sig).detach().reshape(-1).tolist())
    agree_scalars(
        {
            "multiplicity": m,
            "add_smooth_lddt_loss": lddt,
            "nucleotide_loss_weight": float(nucleotide_loss_weight),
            "ligand_loss_weight": float(ligand_loss_weight),
            "filter_by_plddt": float(filter_by_plddt),
            "sigmas": sig_vals,
        },
        what,
    )
    err, t = None, {}
    try:
        t = _local_inputs(feats, out_dict, m, lddt, plddt, what)
    except Exception as exc:  # raised together below
        err = exc
    raise_together(err, step=what)
    grid, lay_m = t["grid"], t["lay_m"]
    den = t["denoised_atom_coords"]
    ct = torch.promote_types(den.dtype, torch.float32)
    den = den.to(ct)
    keep = atom_keep(lay_m, "atom", grid.coords[0], den.device).to(ct)
    resolved = t["atom_resolved_mask"].to(ct)
    resolved_uni = resolved * (t["plddt"] > filter_by_plddt).to(ct) if plddt else resolved
    resolved_m = resolved_uni.repeat_interleave(m, 0) * keep
    atom_type = atom_mol_type(t["atom_to_token"], t["mol_type"], ct)
    weights = align_weights(atom_type, nucleotide_loss_weight, ligand_loss_weight, ct).repeat_interleave(m, 0)

    def atom_sum(v: torch.Tensor) -> torch.Tensor:
        return column_sum(v.sum(1), grid, "diffusion_loss:align")

    true_aug = t["aligned_true_atom_coords"].to(ct).detach()
    mask_align = resolved.repeat_interleave(m, 0) * keep  # Boltz: the unfiltered resolved mask
    svd = diffusion.align_svd_dtype
    x_true = weighted_rigid_align(true_aug, den.detach(), weights, mask_align, svd, atom_sum)
    sq = ((den - x_true) ** 2).sum(-1)
    part = torch.stack([(sq * weights * resolved_m).sum(-1), (3 * weights * resolved_m).sum(-1)], -1)
    tot = column_sum(part, grid, "diffusion_loss:mse")
    mse = tot[:, 0] / (tot[:, 1] + 1e-5)
    mse_loss = (mse * diffusion.loss_weight(t["sigmas"].to(ct))).mean()
    total, lddt_loss = mse_loss, diffusion.zero
    if lddt:
        nuc = is_nucleotide(atom_type, ct).repeat_interleave(m, 0)
        lddt_loss = _smooth_lddt(den, t["coords"], nuc, resolved_m, lay_m, grid)
        total = total + lddt_loss
    return {"loss": total, "loss_breakdown": {"mse_loss": mse_loss, "smooth_lddt_loss": lddt_loss}}
