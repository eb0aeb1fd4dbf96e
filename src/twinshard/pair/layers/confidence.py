"""CP twin of Boltz-2's confidence module (``twinshard.pair.reference.confidence.ConfidenceModule``):
its own Pairformer and the pLDDT / PAE / PDE / resolved heads on a rows x cols grid, the pair
logits kept sharded, the summary figures from global reductions of partial sums.

Placements. In: ``s_inputs``, ``s`` single ``[B, Nr, c_s]`` at ``(Shard(1), Replicate())``, ``z``
pair ``[B, Nr, Nc, c_z]`` at ``(Shard(1), Shard(2))``, ``x_pred [B m, R A_blk, 3]`` of kind
``atom`` on ``sample_layout(layout, m)`` (the diffusion twin's output placement), the
``ShardedFeatures`` of ``distribute`` (with ``frames_idx`` single ``[B, Nr, 3]``,
``token_to_rep_atom`` ``token_atom``, ``atom_to_token`` ``atom_token``), ``pred_distogram_logits``
pair ``[B, Nr, Nc, 64]``. Out: ``pae_logits``, ``pde_logits`` pair ``[B m, Nr, Nc, bins]`` and
``pae``, ``pde`` pair ``[B m, Nr, Nc]`` (never gathered), ``plddt_logits``, ``resolved_logits``,
``plddt`` single ``[B m, Nr, ...]``; ``complex_plddt``, ``complex_iplddt``, ``complex_pde``,
``complex_ipde``, ``ptm``, ``iptm``, ``ligand_iptm``, ``protein_iptm`` ``[B m]`` and
``pair_chains_iptm[c1][c2]`` ``[B m]`` plain tensors, identical on every rank. Every DTensor
carries the layout, padding exactly zero.

Computation (the serial order): the norms, ``s_input_to_s`` and the heads are token-local
(``CPLayerNorm``/``CPLinear``); the z inputs are the trunk's pair-init twins
(``CPRelativePositionEncoder``, ``token_bonds``, ``CPEmbedding``, ``CPContactConditioning``);
``s_to_z``/``s_to_z_transpose`` the outer sum ``cp_outer_sum`` and ``s_to_z_prod_in1/in2`` the
outer product :func:`cp_outer_product` (the column side projected by its owners and moved, one
``column_block``); multiplicity repeats the local tiles along the batch. The representative
atoms' coordinates of the row block are ``token_to_rep_atom`` tile @ ``x_pred`` tile (local: a
row's tokens and atoms live on the same grid row); those of the column block come by one column
move (``column_block``); the distance bins are embedded tile by tile (``CPEmbedding``). The
Pairformer is ``CPPairformerStack``. ``pde`` reads ``z + z^T`` (one tile transpose).

Summary figures, exactly Boltz's (``ConfidenceHeads``), reduced without an N x N tensor on a rank:
``complex_plddt``/``complex_iplddt``: per-token terms summed over the rows, one all-reduce along
the grid column of ``[4, B m]``; the interface flag of a token (a contact with another chain in
its row) one all-reduce along the grid row of ``[B m, Nr/R]``. ``complex_pde``/``ipde``: one
all-reduce over the grid of ``[4, B m]``. pTM family: the tile's row sums of ``tm(PAE) x mask``
and of the mask, ``[2, Q, B m, Nr/R]`` (Q = 4 + chains^2), one all-reduce along the grid ROW
(the sum over every column block j), the per-row ratio, its max over the local rows, then one
all-gather along the grid COLUMN of ``[Q, B m]`` and the max; N_res one all-reduce along the
column. The chain ids: one all-gather (max id) and one all-reduce (presence) along the column.
The frame mask (:func:`cp_frame_mask`): polymer frames name atoms of the token's own grid row
(local; a frame atom elsewhere raises, on every rank); per chain statistics (tokens, atoms,
``mol_type`` at the chain's first token) two all-reduces along the column of ``[B, K]``; where
a non-polymer chain of >= 3 atoms exists, its frames are recomputed from the coordinates as
Boltz does, which needs that chain's atoms: one all-gather along the column of the atom
coordinates and chain ids (``[B m, R A_blk, 3]`` and ``[B, R A_blk, 2]``, O(A) per rank,
transient; no A x A or A x N tensor: the chain's distances are ``[m, tokens of my block,
chain atoms]``).

Gradients: the logits, ``pae``, ``pde``, ``plddt`` carry them (to ``s_inputs``, ``s``, ``z`` and
every parameter; ``x_pred`` enters through bins and masks only, as in Boltz, so it has none); the
summary figures are computed without gradient (metrics; nothing reads their gradient in Boltz).
Backward collectives: those of the parts (parameter-gradient all-reduces over the grid for pair
parts, over the grid column for token-local single parts; the column moves' reverses; one tile
transpose for ``z + z^T``; the Pairformer's).

Memory per rank: the parts' tiles (serial / P for pair-sized activations, serial / R for
single-sized), the distance tile ``[B m, Nr/R, Nc/C]`` and the moved column coordinates ``[B m,
Nc/C, 3]``; nothing N x N.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from twinshard import comm
from twinshard.comm import primitives as P
from twinshard.comm.ops import transpose_tiles
from twinshard.pair.atoms import unblock_atoms
from twinshard.pair.layers.linear import CPLinear
from twinshard.pair.layers.moves import column_block
from twinshard.pair.layers.norm import CPLayerNorm
from twinshard.pair.layers.pair_init import (
    CPContactConditioning,
    CPEmbedding,
    CPRelativePositionEncoder,
    cp_outer_sum,
    feature_layout,
    grid_params,
)
from twinshard.pair.layers.pairformer import CPPairformerStack
from twinshard.pair.layers.tokenwise import pointwise, rebuild
from twinshard.pair.layers.triangle import pair_grid
from twinshard.pair.layout import PairLayout, atom_keep, layout_of, with_layout
from twinshard.pair.reference.confidence import (
    CONTACT_BINS,
    DISTOGRAM_BINS,
    INTERFACE_WEIGHT,
    LIGAND_WEIGHT,
    NON_INTERFACE_WEIGHT,
    NONPOLYMER,
    PROTEIN,
    ConfidenceHeads,
    ConfidenceModule,
    aggregated_metric,
    bin_centres,
    chain_frames,
    collinear_mask,
    tm_function,
)
from twinshard.pair.tiling import PAIR, SINGLE, check_placements, from_local
from twinshard.runtime import ProcessGrid, raise_together
from twinshard.runtime.agree import agree_scalars

__all__ = ["CPConfidenceHeads", "CPConfidenceModule", "cp_frame_mask", "cp_frame_values", "cp_outer_product"]

HEAD_FEATURES = ("asym_id", "mol_type", "token_pad_mask", "frames_idx", "atom_to_token", "atom_pad_mask")


def _add(a: DTensor, b: DTensor) -> DTensor:
    return pointwise(lambda x, y: x + y, a, b)


def repeat_batch(x: DTensor, m: int) -> DTensor:
    """``x.repeat_interleave(m, 0)`` on the local tile (placements and layout kept)."""
    return x if m == 1 else rebuild(x.to_local().repeat_interleave(m, 0), x)


def cp_outer_product(lin_1: nn.Linear, lin_2: nn.Linear, s: DTensor, layout: PairLayout) -> DTensor:
    """``lin_1(s)_i * lin_2(s)_j`` (bias-free) as a pair DTensor ``[B, Nr, Nc, c]``: the row side
    local, the column side projected by its owners and moved (``column_block``); backward the
    reverse move, one all-reduce of ``s``'s gradient along the grid row, one of both weights'
    gradients over the grid (as ``cp_outer_sum``)."""
    check_placements(s, SINGLE, "outer product input s", ndim=3)
    grid = pair_grid(s)
    w_1, w_2 = grid_params([lin_1.weight, lin_2.weight], s.device_mesh)
    x = comm.sync_grad(s.to_local(), grid.row_group)
    a = F.linear(x, w_1)
    b = column_block(F.linear(x, w_2), grid, layout.padded, "confidence:prod_columns", differentiable=True)
    return with_layout(from_local(a[:, :, None] * b[:, None, :], s.device_mesh, PAIR), layout, "pair")


def _block_index(grid: ProcessGrid, layout: PairLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Global token indices of this rank's row block and column block."""
    (nr, nc), (rr, cc) = layout.padded, grid.coords
    ni, nj = nr // grid.rows, nc // grid.cols
    return torch.arange(rr * ni, (rr + 1) * ni, device=device), torch.arange(
        cc * nj, (cc + 1) * nj, device=device
    )


def _gather_max(x: torch.Tensor, grid: ProcessGrid, op: str) -> torch.Tensor:
    """Elementwise max of ``x`` over the grid column (one all-gather)."""
    got = P.all_gather(x.contiguous()[None], 0, grid.col_group, op=op)
    return got.max(dim=0).values


def _chain_ids(asym_rows: torch.Tensor, rows_real: torch.Tensor, grid: ProcessGrid) -> list[int]:
    """Every chain id of the real tokens (Boltz's ``torch.unique(asym_id)``), sorted, on every rank."""
    ids = asym_rows[:, rows_real].long()
    local_max = ids.max() if ids.numel() else torch.zeros((), dtype=torch.long)
    k = int(_gather_max(local_max.reshape(1).to(torch.float64), grid, "confidence:chain_max")[0]) + 1
    here = torch.zeros(k, dtype=torch.float64)
    here[ids.flatten()] = 1
    present = P.all_reduce(here, grid.col_group, op="confidence:chain_ids") > 0
    return [int(c) for c in present.nonzero()[:, 0]]


def cp_frame_mask(
    x_local: torch.Tensor, feats: Mapping[str, DTensor], layout: PairLayout, grid: ProcessGrid, m: int
) -> torch.Tensor:
    """``[B m, Nr/R]``: the serial ``frame_mask`` of this rank's token rows (module docstring)."""
    f = cp_frame_values(x_local, feats, layout, grid, m)
    ok = collinear_mask(f[:, :, 1] - f[:, :, 0], f[:, :, 1] - f[:, :, 2])
    return ok * feats["token_pad_mask"].to_local().repeat_interleave(m, 0)


def cp_frame_values(
    x_local: torch.Tensor,
    feats: Mapping[str, DTensor],
    layout: PairLayout,
    grid: ProcessGrid,
    m: int,
    values: torch.Tensor | None = None,
    resolved: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B m, Nr/R, 3, k]``: per-atom ``values`` (``[B m, A_blk, k]`` on the atom tile; default the
    coordinates ``x_local [B m, A_blk, 3]``) at the three frame atoms of each of this rank's token
    rows: Boltz's ``compute_frame_pred`` (the serial ``compute_frame_pred``), non-polymer chains of
    >= 3 atoms recomputed from ``x_local``; ``resolved`` (``[B m, A_blk]``, training) keeps
    unresolved atoms out of the nearest neighbours. Collectives (module docstring): two
    all-reduces along the grid column of chain statistics; where a chain is recomputed, one
    all-gather along the column of ``[B m, A_blk, 3 + k + 1]`` (coordinates, values, resolved)
    and one of the chain tags; a polymer frame atom off the token's grid row raises on every rank."""
    r = grid.coords[0]
    asym = feats["asym_id"].to_local().long()  # [B, nI]
    mol = feats["mol_type"].to_local().long()
    tok = feats["token_pad_mask"].to_local()
    frames = feats["frames_idx"].to_local().long()  # [B, nI, 3] global atom indices
    a2t = feats["atom_to_token"].to_local().to(x_local.dtype)  # [B, A_blk, nI]
    keep_atoms = atom_keep(layout, "atom", r, x_local.device)
    atom_pad = (feats["atom_pad_mask"].to_local() > 0) & keep_atoms
    asym_atom = (a2t @ asym[..., None].to(x_local.dtype))[..., 0].long()  # [B, A_blk]
    bsz, ni = asym.shape
    rows, _ = _block_index(grid, layout, x_local.device)
    rows_real = rows < layout.n_tokens
    chains = _chain_ids(asym, rows_real, grid)
    k = max(chains) + 1
    counts = torch.zeros(2, bsz, k, dtype=torch.float64)
    for b in range(bsz):
        counts[0, b] = torch.bincount(asym[b][tok[b] > 0], minlength=k)[:k].double()
        counts[1, b] = torch.bincount(asym_atom[b][atom_pad[b]], minlength=k)[:k].double()
    counts = P.all_reduce(counts, grid.col_group, op="confidence:chain_counts").long()
    # Boltz's walk over the sorted chain ids: first token t0 and first atom a0 of each chain
    starts: list[dict[int, tuple[int, int, int, int]]] = []
    for b in range(bsz):
        t0 = a0 = 0
        per: dict[int, tuple[int, int, int, int]] = {}
        for c in chains:
            nt, na = int(counts[0, b, c]), int(counts[1, b, c])
            per[c] = (t0, a0, nt, na)
            t0, a0 = t0 + nt, a0 + na
        starts.append(per)
    mol_t0 = torch.zeros(bsz, k, dtype=torch.float64)  # mol_type at each chain's first token
    for b in range(bsz):
        for c, (t0, _, _, na) in starts[b].items():
            if na >= 3 and rows[0] <= t0 < rows[-1] + 1:
                mol_t0[b, c] = float(mol[b, t0 - int(rows[0])])
    mol_t0 = P.all_reduce(mol_t0, grid.col_group, op="confidence:chain_mol").long()
    redo = [
        (b, c, t0, a0, na)
        for b in range(bsz)
        for c, (t0, a0, _, na) in starts[b].items()
        if na >= 3 and int(mol_t0[b, c]) == NONPOLYMER
    ]
    frames = frames.repeat_interleave(m, 0).clone()
    recomputed = torch.zeros(bsz * m, ni, dtype=torch.bool)
    v_local = x_local if values is None else values
    k = v_local.shape[-1]
    v_full = None
    if redo:  # replicated decision: every rank gathers
        payload = [x_local] + ([] if values is None else [values.to(x_local.dtype)])
        payload += [] if resolved is None else [resolved[..., None].to(x_local.dtype)]
        blocked = P.all_gather(
            torch.cat(payload, -1).contiguous(), 1, grid.col_group, op="confidence:ligand_coords"
        )
        tags = torch.stack([asym_atom, atom_pad.long()], dim=-1).to(x_local.dtype)
        tags = P.all_gather(tags.contiguous(), 1, grid.col_group, op="confidence:ligand_atoms")
        from twinshard.pair.layers.diffusion import sample_layout

        full = unblock_atoms(blocked, sample_layout(layout, m), "atom")  # [B m, A, 3 (+ k) (+ 1)]
        x_full = full[..., :3]
        v_full = x_full if values is None else full[..., 3 : 3 + k].to(v_local.dtype)
        r_full = None if resolved is None else full[..., -1] > 0
        tags = unblock_atoms(tags, layout, "atom").long()  # [B, A, 2]
        lo = int(rows[0])
        for b, c, t0, a0, na in redo:
            top = min(t0 + na, layout.n_tokens)
            mine = range(max(t0, lo), min(top, lo + ni))
            if not len(mine):
                continue
            in_atom = (tags[b, :, 0] == c) & (tags[b, :, 1] > 0)
            xc = x_full[b * m : (b + 1) * m][:, in_atom]
            rc = None if r_full is None else r_full[b * m : (b + 1) * m][:, in_atom]
            f = chain_frames(xc, rc) + a0  # [m, na, 3]
            q = torch.tensor([t - t0 for t in mine])
            t = torch.tensor([t - lo for t in mine])
            frames[b * m : (b + 1) * m, t] = f[:, q]
            recomputed[b * m : (b + 1) * m, t] = True
    # coordinates of the frame atoms: local (the token's own grid row) unless recomputed
    st = torch.tensor([s[r] for s in layout.atom_starts], dtype=torch.long).repeat_interleave(m)  # type: ignore[union-attr]
    cn = torch.tensor([c[r] for c in layout.atom_counts], dtype=torch.long).repeat_interleave(m)  # type: ignore[union-attr]
    local = frames - st[:, None, None]
    tokm = tok.repeat_interleave(m, 0) > 0
    outside = ((local < 0) | (local >= cn[:, None, None])).any(-1) & ~recomputed & tokm & rows_real[None]
    err = None
    if bool(outside.any()):
        bm, i = (int(v) for v in outside.nonzero()[0])
        err = ValueError(
            f"feature 'frames_idx': token {int(rows[i])} of sample {bm // m} names atoms "
            f"{frames[bm, i].tolist()}, not all on its grid row (atoms {int(st[bm])}..{int(st[bm] + cn[bm]) - 1}): "
            "a token's frame must be atoms of its own token block (Boltz's polymer frames are the residue's "
            "own N, CA, C; non-polymer chains are recomputed)"
        )
    raise_together(err, step="CPConfidenceHeads (frames)")
    bi = torch.arange(bsz * m)[:, None, None]
    f = v_local[bi, local.clamp(min=0, max=v_local.shape[1] - 1)]
    if v_full is not None:
        f = torch.where(
            recomputed[..., None, None], v_full[bi, frames.clamp(min=0, max=v_full.shape[1] - 1)], f
        )
    return f


class CPConfidenceHeads(ConfidenceHeads):
    """The heads on DTensors (module docstring): ``forward(s, z, x_pred, d, feats,
    pred_distogram_logits, multiplicity)`` with ``d`` the local distance tile ``[B m, Nr/R, Nc/C]``."""

    linear = CPLinear

    def forward(  # type: ignore[override]
        self,
        s: DTensor,
        z: DTensor,
        x_pred: DTensor,
        d: torch.Tensor,
        feats: Mapping[str, DTensor],
        pred_distogram_logits: DTensor,
        multiplicity: int = 1,
    ) -> dict[str, Any]:
        m = int(multiplicity)
        layout, grid = feature_layout(feats, HEAD_FEATURES, type(self).__name__)
        check_placements(pred_distogram_logits, PAIR, "pred_distogram_logits", ndim=4)
        if pred_distogram_logits.shape[-1] != DISTOGRAM_BINS:
            raise ValueError(
                f"pred_distogram_logits must have {DISTOGRAM_BINS} bins (Boltz's contact probability "
                f"sums the first {CONTACT_BINS}), got {pred_distogram_logits.shape[-1]}"
            )
        rows, cols = _block_index(grid, layout, d.device)
        rows_real, cols_real = rows < layout.n_tokens, cols < layout.n_tokens
        tok_feats = torch.stack(
            [feats[k].to_local().long() for k in ("asym_id", "mol_type")]
            + [(feats["token_pad_mask"].to_local() > 0).long()],
            dim=-1,
        )
        col_feats = column_block(
            tok_feats, grid, layout.padded, "confidence:token_columns", differentiable=False
        )
        tok_feats, col_feats = tok_feats.repeat_interleave(m, 0), col_feats.repeat_interleave(m, 0)
        asym_r, asym_c = tok_feats[..., 0], col_feats[..., 0]
        same = asym_r[:, :, None] == asym_c[:, None, :]
        zl = z.to_local()
        pae_logits = self.pair_logits(z, same, "pae")
        pde_logits = self.pair_logits(rebuild(zl + transpose_tiles(zl, grid), z), same, "pde")
        resolved_logits = self.to_resolved_logits(s)
        plddt_logits = self.to_plddt_logits(s)
        out: dict[str, Any] = dict(
            pde_logits=pde_logits,
            plddt_logits=plddt_logits,
            resolved_logits=resolved_logits,
            pde=with_layout(
                from_local(aggregated_metric(pde_logits.to_local(), 32), z.device_mesh, PAIR), layout, "pair"
            ),
            plddt=with_layout(
                from_local(aggregated_metric(plddt_logits.to_local()), s.device_mesh, SINGLE),
                layout,
                "single",
            ),
            pae_logits=pae_logits,
            pae=with_layout(
                from_local(aggregated_metric(pae_logits.to_local(), 32), z.device_mesh, PAIR), layout, "pair"
            ),
        )
        with torch.no_grad():
            out.update(
                self.figures(out, d, feats, pred_distogram_logits, m, tok_feats, col_feats, layout, grid)
            )
            maski = cp_frame_mask(x_pred.to_local(), feats, layout, grid, m)
            out.update(
                self.cp_ptms(pae_logits.to_local(), maski, tok_feats, col_feats, rows_real, cols_real, grid)
            )
        return out

    def pair_logits(self, zz: DTensor, same: torch.Tensor | None, kind: str) -> DTensor:  # type: ignore[override]
        if not self.use_separate_heads:
            return getattr(self, f"to_{kind}_logits")(zz)
        w = same.to(zz.dtype)[..., None]
        intra = getattr(self, f"to_{kind}_intra_logits")(zz)
        inter = getattr(self, f"to_{kind}_inter_logits")(zz)
        return rebuild(inter.to_local() * (1 - w) + intra.to_local() * w, intra)

    @staticmethod
    def figures(out, d, feats, pdist, m, tok_feats, col_feats, layout, grid) -> dict[str, torch.Tensor]:
        plddt, pde = out["plddt"].to_local(), out["pde"].to_local()
        dt = plddt.dtype
        rows, cols = _block_index(grid, layout, d.device)
        cols_real = (cols < layout.n_tokens).to(dt)
        asym_r, asym_c = tok_feats[..., 0], col_feats[..., 0]
        is_lig = (tok_feats[..., 1] == NONPOLYMER).to(dt)
        pad_r, pad_c = tok_feats[..., 2].to(dt), col_feats[..., 2].to(dt)
        other = (asym_r[:, :, None] != asym_c[:, None, :]).to(dt)
        # interface: a contact (< 8 A) with another chain anywhere in the token's row of the grid
        contact = (d < 8).to(dt) * other * (1 - is_lig)[:, :, None] * cols_real
        hit = P.all_reduce(contact.max(dim=-1).values.contiguous(), grid.row_group, op="confidence:interface")
        interface = (hit > 0).to(dt)
        weight = (
            is_lig * LIGAND_WEIGHT
            + interface * INTERFACE_WEIGHT
            + (1 - interface) * (1 - is_lig) * NON_INTERFACE_WEIGHT
        )
        tok_sums = torch.stack(
            [
                (plddt * pad_r).sum(-1),
                pad_r.sum(-1),
                (plddt * pad_r * weight).sum(-1),
                (pad_r * weight).sum(-1),
            ]
        )
        tok_sums = P.all_reduce(tok_sums, grid.col_group, op="confidence:plddt_sums")
        prob = F.softmax(pdist.to_local(), dim=-1).repeat_interleave(m, 0)[..., :CONTACT_BINS].sum(-1)
        off_diag = (rows[:, None] != cols[None, :]).to(dt)
        pm = pad_r[:, :, None] * pad_c[:, None, :] * off_diag * prob
        im = pm * other
        pair_sums = torch.stack(
            [(pde * pm).sum((1, 2)), pm.sum((1, 2)), (pde * im).sum((1, 2)), im.sum((1, 2))]
        )
        pair_sums = P.all_reduce(pair_sums, None, op="confidence:pde_sums")
        return {
            "complex_plddt": tok_sums[0] / tok_sums[1],
            "complex_iplddt": tok_sums[2] / tok_sums[3],
            "complex_pde": pair_sums[0] / pair_sums[1],
            "complex_ipde": pair_sums[2] / (pair_sums[3] + 1e-5),
        }

    @staticmethod
    def cp_ptms(logits, maski, tok_feats, col_feats, rows_real, cols_real, grid) -> dict[str, Any]:
        """The serial ``ptms`` from the local PAE logits tile: row sums all-reduced along the grid
        row, the max over rows along the grid column (module docstring)."""
        dt = logits.dtype
        asym_r, asym_c = tok_feats[..., 0], col_feats[..., 0]
        pad_r = tok_feats[..., 2].to(dt) * rows_real.to(dt)
        pad_c = col_feats[..., 2].to(dt) * cols_real.to(dt)
        n_res = P.all_reduce(pad_r.sum(-1, keepdim=True), grid.col_group, op="confidence:n_res")
        tm_value = tm_function(bin_centres(logits.shape[-1], 32.0, logits.device)[None], n_res)
        tm = (F.softmax(logits, dim=-1) * tm_value[:, None, None, :]).sum(-1)  # [B m, nI, nJ]
        valid = maski[:, :, None] * pad_c[:, None, :] * pad_r[:, :, None]
        other = (asym_c[:, None, :] != asym_r[:, :, None]).to(dt)
        lig_r, lig_c = (tok_feats[..., 1] == NONPOLYMER).to(dt), (col_feats[..., 1] == NONPOLYMER).to(dt)
        prot_r, prot_c = (tok_feats[..., 1] == PROTEIN).to(dt), (col_feats[..., 1] == PROTEIN).to(dt)
        lig_prot = lig_r[:, :, None] * prot_c[:, None, :] + prot_r[:, :, None] * lig_c[:, None, :]
        chains = _chain_ids(tok_feats[:: max(1, 1), :, 0], rows_real, grid)
        masks = [
            valid,
            valid * other,
            valid * other * lig_prot,
            valid * other * (prot_r[:, :, None] * prot_c[:, None, :]),
        ]
        masks += [
            valid * (asym_c[:, None, :] == c1) * (asym_r[:, :, None] == c2).to(dt)
            for c1 in chains
            for c2 in chains
        ]
        pm = torch.stack(masks)  # [Q, B m, nI, nJ]
        sums = torch.stack([(tm * pm).sum(-1), pm.sum(-1)])  # [2, Q, B m, nI]
        sums = P.all_reduce(sums, grid.row_group, op="confidence:ptm_rows")
        best = _gather_max((sums[0] / (sums[1] + 1e-5)).max(dim=-1).values, grid, "confidence:ptm_max")
        out: dict[str, Any] = dict(zip(("ptm", "iptm", "ligand_iptm", "protein_iptm"), best[:4]))
        q = 4
        out["pair_chains_iptm"] = {}
        for c1 in chains:
            out["pair_chains_iptm"][c1] = {}
            for c2 in chains:
                out["pair_chains_iptm"][c1][c2] = best[q]
                q += 1
        return out


class CPConfidenceModule(ConfidenceModule):
    """The CP confidence module (module docstring): the serial module's arguments, names and order
    (a ``confidence_module.*`` slice of a Boltz-2 ``state_dict`` loads strict); ``forward(s_inputs,
    s, z, x_pred, feats, pred_distogram_logits, multiplicity=1, seed=None) -> dict``."""

    @classmethod
    def parts(cls) -> dict[str, type]:
        return {
            "linear": CPLinear,
            "layer_norm": CPLayerNorm,
            "embedding": CPEmbedding,
            "rel_pos": CPRelativePositionEncoder,
            "contact": CPContactConditioning,
            "pairformer": CPPairformerStack,
            "heads": CPConfidenceHeads,
        }

    def z_inputs(self, z: DTensor, feats: Mapping[str, DTensor]) -> DTensor:  # type: ignore[override]
        z = _add(z, self.rel_pos(feats))
        bonds = feats["token_bonds"]
        bonds = from_local(bonds.to_local().to(self.token_bonds.weight.dtype), bonds.device_mesh, PAIR)
        z = _add(z, self.token_bonds(bonds))
        if self.bond_type_feature:
            z = _add(z, self.token_bonds_type(feats["type_bonds"]))
        return _add(z, self.contact_conditioning(feats))

    def forward(  # type: ignore[override]
        self,
        s_inputs: DTensor,
        s: DTensor,
        z: DTensor,
        x_pred: DTensor,
        feats: Mapping[str, DTensor],
        pred_distogram_logits: DTensor,
        multiplicity: int = 1,
        run_sequentially: bool = False,
        seed: int | None = None,
    ) -> dict[str, Any]:
        m = int(multiplicity)
        what = type(self).__name__
        if run_sequentially and m > 1:
            raise NotImplementedError("run_sequentially is not supported: run the samples as one batch")
        layout, grid = feature_layout(feats, ("token_pad_mask", "pair_mask", "token_to_rep_atom"), what)
        check_placements(s_inputs, SINGLE, f"{what} s_inputs", ndim=3)
        check_placements(s, SINGLE, f"{what} s", ndim=3)
        check_placements(z, PAIR, f"{what} z", ndim=4)
        check_placements(x_pred, SINGLE, f"{what} x_pred (atom kind)", ndim=3)
        agree_scalars(
            {
                "multiplicity": m,
                "seed": seed,
                "training": self.training,
                "grad_enabled": torch.is_grad_enabled(),
                "x_pred": tuple(x_pred.shape),
            },
            what,
        )
        if x_pred.shape[0] != s.shape[0] * m:
            raise ValueError(
                f"{what}: x_pred holds {x_pred.shape[0]} samples, expected B x multiplicity = {s.shape[0] * m}"
            )
        layout = layout_of(z) or layout
        s_inputs = self.s_inputs_norm(s_inputs)
        if not self.no_update_s:
            s = self.s_norm(s)
        if self.add_s_input_to_s:
            s = _add(s, self.s_input_to_s(s_inputs))
        z = self.z_norm(z)
        if self.add_z_input_to_z:
            z = self.z_inputs(z, feats)
        s = repeat_batch(s, m)
        z = _add(z, cp_outer_sum(self.s_to_z, self.s_to_z_transpose, s_inputs, layout))
        if self.add_s_to_z_prod:
            z = _add(
                z,
                self.s_to_z_prod_out(
                    cp_outer_product(self.s_to_z_prod_in1, self.s_to_z_prod_in2, s_inputs, layout)
                ),
            )
        z = repeat_batch(z, m)
        x_local = x_pred.to_local().detach()
        t2r = feats["token_to_rep_atom"].to_local().repeat_interleave(m, 0).to(x_local.dtype)
        x_rows = torch.bmm(t2r, x_local)  # [B m, Nr/R, 3]: my token block's representative atoms
        x_cols = column_block(x_rows, grid, layout.padded, "confidence:rep_columns", differentiable=False)
        d = torch.cdist(x_rows, x_cols)
        bins = (d.unsqueeze(-1) > self.boundaries).sum(dim=-1).long()
        bins = with_layout(from_local(bins, z.device_mesh, PAIR), layout, "pair")
        z = _add(z, self.dist_bin_pairwise_embed(bins))
        mask = repeat_batch(feats["token_pad_mask"], m)
        pair_mask = repeat_batch(feats["pair_mask"], m)
        s, z = self.pairformer_stack(s, z, mask, pair_mask, seed)
        out: dict[str, Any] = {}
        if self.return_latent_feats:
            out["s_conf"], out["z_conf"] = s, z
        out.update(self.confidence_heads(s, z, x_pred, d, feats, pred_distogram_logits, m))
        return out
