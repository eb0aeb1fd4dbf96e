"""Boltz-2's confidence module (AF3 supplement Alg. 31; boltz ``modules/confidencev2.py``
``ConfidenceModule`` / ``ConfidenceHeads`` and ``layers/confidence_utils.py``), serial: the oracle of
``twinshard.pair.layers.confidence.CPConfidenceModule``.

From the trunk's ``s_inputs``, ``s [B, N, c_s]``, ``z [B, N, N, c_z]``, the predicted atom coordinates
``x_pred [B m, A, 3]`` (m = multiplicity: sample ``b m + j`` is element b's j-th) and the features::

    s_inputs <- s_inputs_norm(s_inputs);  s <- s_norm(s)                [no s_norm: no_update_s]
    s        <- s + s_input_to_s(s_inputs)                                [add_s_input_to_s]
    z        <- z_norm(z)
    z        <- z + rel_pos(feats) + token_bonds(token_bonds)              [add_z_input_to_z]
                  + token_bonds_type(type_bonds) + contact_conditioning(feats)
    s        <- repeat(s, m)
    z        <- z + s_to_z(s_inputs)_i + s_to_z_transpose(s_inputs)_j
    z        <- z + s_to_z_prod_out(s_to_z_prod_in1(s_inputs)_i * s_to_z_prod_in2(s_inputs)_j)  [add_s_to_z_prod]
    z, s_inputs <- repeat(z, m), repeat(s_inputs, m)
    x_rep    <- token_to_rep_atom @ x_pred                                 # [B m, N, 3]
    d_ij     <- |x_rep_i - x_rep_j|;  z <- z + dist_bin_pairwise_embed(sum_k [d_ij > boundary_k])
    s, z     <- pairformer_stack(s, z, token_pad_mask, pair_mask)
    heads(s, z, x_pred, d, feats)

Heads (token-level confidence only): ``pae_logits = to_pae_logits(z)`` (or, ``use_separate_heads``,
intra-chain and inter-chain heads masked by same/different chain), ``pde_logits =
to_pde_logits(z + z^T)`` (likewise), ``plddt_logits = to_plddt_logits(s)``, ``resolved_logits =
to_resolved_logits(s)``; derived figures: ``plddt``/``pae``/``pde`` (expected bin centre; 1, 32, 32
A), ``complex_plddt``, ``complex_iplddt`` (ligand weight 20, interface 10, other 1),
``complex_pde``/``complex_ipde`` (weighted by the distogram's contact probability, first 20 of 64
bins), ``ptm``, ``iptm``, ``ligand_iptm``, ``protein_iptm`` and ``pair_chains_iptm[c1][c2]`` (tm
score of the expected PAE over pairs of valid frames; per row i the mean over j, then the max
over i). The frames are ``frames_idx`` (``[B, N, 3]`` global atom indices), recomputed for
non-polymer chains of >= 3 atoms from the predicted coordinates (nearest neighbours in the chain,
Boltz's ``compute_frame_pred`` at inference); a token counts where its frame is neither collinear
nor degenerate (``frame_mask``).

Boltz's numerics are kept where they decide values: bin centres come from ``torch.arange`` in
torch's default dtype (fp32 values, promoted), the distance boundaries are a buffer from
``torch.linspace`` (fp32, cast with the module), ``torch.cdist`` for the distances.
Parameter names and registration order are Boltz-2's (``boundaries``, ``dist_bin_pairwise_embed``,
``s_to_z``, ``s_to_z_transpose``, [``s_to_z_prod_in1/in2/out``], ``s_inputs_norm``, [``s_norm``],
``z_norm``, [``s_input_to_s``], [``rel_pos``, ``token_bonds``, [``token_bonds_type``],
``contact_conditioning``], ``pairformer_stack``, ``confidence_heads``), so ``confidence_module.*`` of
a Boltz-2 ``state_dict`` loads strict. ``run_sequentially`` and atom-level confidence are not
supported (clear errors).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from twinshard.pair.reference.linear import Linear
from twinshard.pair.reference.norm import LayerNorm
from twinshard.pair.reference.pair_init import (
    BOND_TYPES,
    ContactConditioning,
    Embedding,
    RelativePositionEncoder,
)

__all__ = [
    "NONPOLYMER",
    "PROTEIN",
    "ConfidenceHeads",
    "ConfidenceModule",
    "aggregated_metric",
    "bin_centres",
    "chain_frames",
    "collinear_mask",
    "compute_frame_pred",
    "frame_mask",
    "stack_args",
    "tm_function",
]

PROTEIN, NONPOLYMER = 0, 3  # boltz.data.const.chain_type_ids
LIGAND_WEIGHT, INTERFACE_WEIGHT, NON_INTERFACE_WEIGHT = 20, 10, 1
CONTACT_BINS, DISTOGRAM_BINS = 20, 64  # Boltz: the first 20 of 64 distogram bins are "contact"
_STACK_KEYS = (
    "num_blocks",
    "num_heads",
    "dropout",
    "pairwise_head_width",
    "pairwise_num_heads",
    "post_layer_norm",
    "activation_checkpointing",
)


def stack_args(pairformer_args: Mapping[str, Any]) -> dict[str, Any]:
    """The Pairformer stack's arguments from Boltz's ``pairformer_args`` (``v2`` must be True or
    absent: Boltz's ConfidenceModule forces it; ``no_update_s``, ``offload_to_cpu`` are not the
    stack's, as Boltz's ``PairformerModule`` ignores them)."""
    if not pairformer_args.get("v2", True):
        raise ValueError("ConfidenceModule (v2) runs a v2 Pairformer: pairformer_args v2 must be True")
    return {k: pairformer_args[k] for k in _STACK_KEYS if k in pairformer_args}


def bin_centres(num_bins: int, end: float, device: torch.device | None = None) -> torch.Tensor:
    """Boltz's bin centres ``arange(w / 2, end, w)`` with ``w = end / num_bins``, in torch's default
    dtype as Boltz forms them (fp32 values; they are promoted where they meet fp64)."""
    w = end / num_bins
    return torch.arange(start=0.5 * w, end=end, step=w, device=device)


def aggregated_metric(logits: torch.Tensor, end: float = 1.0) -> torch.Tensor:
    """Expected bin centre under ``softmax(logits)`` (Boltz's ``compute_aggregated_metric``)."""
    probs = F.softmax(logits, dim=-1)
    return (probs * bin_centres(logits.shape[-1], end, logits.device)).sum(-1)


def tm_function(d: torch.Tensor, n_res: torch.Tensor) -> torch.Tensor:
    """TM-score kernel ``1 / (1 + (d / d0)^2)``, ``d0 = 1.24 (max(N, 19) - 15)^(1/3) - 1.8``."""
    d0 = 1.24 * (torch.clip(n_res, min=19) - 15) ** (1 / 3) - 1.8
    return 1 / (1 + (d / d0) ** 2)


def collinear_mask(v1: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
    """Valid frame: the two arms neither (anti)parallel (|cos| < 0.9063) nor shorter than 1e-2.
    ``v1``, ``v2`` ``[..., 3]`` -> bool ``[...]``."""
    n1 = torch.norm(v1, dim=-1, keepdim=True)
    n2 = torch.norm(v2, dim=-1, keepdim=True)
    cos = ((v1 / (n1 + 1e-6)) * (v2 / (n2 + 1e-6))).sum(-1)
    return (cos.abs() < 0.9063) & (n1[..., 0] > 1e-2) & (n2[..., 0] > 1e-2)


def chain_frames(xc: torch.Tensor, resolved: torch.Tensor | None = None) -> torch.Tensor:
    """Frames of a non-polymer chain's atoms from their coordinates ``xc [m, n, 3]`` (n >= 3):
    per atom (nearest other, itself, second nearest) as chain-local indices ``[m, n, 3]``.
    ``resolved`` (bool ``[m, n]``, training): a pair with an unresolved atom is infinitely far
    (Boltz's ``compute_frame_pred`` outside inference; ties keep ``torch.sort``'s order)."""
    d = ((xc[:, None, :, :] - xc[:, :, None, :]) ** 2).sum(-1) ** 0.5  # [m, k, l] = |x_l - x_k|
    if resolved is not None:
        both = resolved[:, None, :] & resolved[:, :, None]
        d = d + torch.where(both, torch.zeros((), dtype=d.dtype), torch.full((), math.inf, dtype=d.dtype))
    idx = torch.sort(d, dim=2).indices
    return torch.cat([idx[:, :, 1:2], idx[:, :, 0:1], idx[:, :, 2:3]], dim=2)


def compute_frame_pred(
    x_pred: torch.Tensor,
    feats: Mapping[str, torch.Tensor],
    multiplicity: int,
    resolved: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(frames [B m, N, 3], mask [B m, N])``: each token's frame (``frames_idx``, global atom
    indices, recomputed for non-polymer chains of >= 3 atoms from ``x_pred [B m, A, 3]``: Boltz's
    ``compute_frame_pred``) and 1 where that frame is neither collinear nor degenerate and the
    token real. ``resolved`` ``[B m, A]`` (training): unresolved atoms are never a frame's
    neighbours; sample ``b m + j`` uses its own row (boltz indexes the rows by the batch element
    b, the same for B = 1, the only batch size its training step supports)."""
    m = multiplicity
    asym = feats["asym_id"]
    bsz = asym.shape[0]
    a2t = feats["atom_to_token"].to(x_pred.dtype)
    asym_atom = (a2t @ asym[..., None].to(x_pred.dtype))[..., 0]
    tok_mask, atom_mask = feats["token_pad_mask"], feats["atom_pad_mask"]
    frames = feats["frames_idx"].long().repeat_interleave(m, 0).clone()  # [B m, N, 3]
    n = frames.shape[1]
    for b in range(bsz):
        t0 = a0 = 0
        for cid in torch.unique(asym[b]).tolist():
            in_tok = (asym[b] == cid) & (tok_mask[b] > 0)
            in_atom = (asym_atom[b] == cid) & (atom_mask[b] > 0)
            nt, na = int(in_tok.sum()), int(in_atom.sum())
            if na >= 3 and int(feats["mol_type"][b, t0]) == NONPOLYMER:
                xc = x_pred[b * m : (b + 1) * m][:, in_atom]
                rc = None if resolved is None else resolved[b * m : (b + 1) * m][:, in_atom] > 0
                top = min(t0 + na, n)
                frames[b * m : (b + 1) * m, t0:top] = (chain_frames(xc, rc) + a0)[:, : top - t0]
            t0 += nt
            a0 += na
    bi = torch.arange(frames.shape[0], device=frames.device)[:, None, None]
    f = x_pred[bi, frames]  # [B m, N, 3 (frame atoms), 3]
    ok = collinear_mask(f[:, :, 1] - f[:, :, 0], f[:, :, 1] - f[:, :, 2])
    return frames, ok * tok_mask.repeat_interleave(m, 0)


def frame_mask(x_pred: torch.Tensor, feats: Mapping[str, torch.Tensor], multiplicity: int) -> torch.Tensor:
    """``[B m, N]`` float: 1 where token i's frame (``frames_idx``, recomputed for non-polymer
    chains of >= 3 atoms) is valid and the token real (Boltz's ``compute_frame_pred``, inference)."""
    return compute_frame_pred(x_pred, feats, multiplicity)[1]


class ConfidenceHeads(nn.Module):
    """Boltz-2's ``ConfidenceHeads`` (token-level confidence): parameters ``to_pae_logits`` (or
    ``to_pae_intra_logits``, ``to_pae_inter_logits``), likewise ``to_pde_*``, ``to_plddt_logits``,
    ``to_resolved_logits`` (all bias-free), in Boltz's order."""

    linear: type[nn.Module] = Linear  # the twin's heads use CPLinear

    def __init__(
        self,
        token_s: int,
        token_z: int,
        num_plddt_bins: int = 50,
        num_pde_bins: int = 64,
        num_pae_bins: int = 64,
        token_level_confidence: bool = True,
        use_separate_heads: bool = False,
        **kwargs: Any,
    ):
        super().__init__()
        if not token_level_confidence:
            raise NotImplementedError(
                "atom-level confidence (token_level_confidence=False) is not supported; Boltz-2 "
                "releases token-level confidence"
            )
        self.token_level_confidence = True
        self.use_separate_heads = use_separate_heads
        lin = self.linear
        if use_separate_heads:
            self.to_pae_intra_logits = lin(token_z, num_pae_bins, bias=False)
            self.to_pae_inter_logits = lin(token_z, num_pae_bins, bias=False)
            self.to_pde_intra_logits = lin(token_z, num_pde_bins, bias=False)
            self.to_pde_inter_logits = lin(token_z, num_pde_bins, bias=False)
        else:
            self.to_pae_logits = lin(token_z, num_pae_bins, bias=False)
            self.to_pde_logits = lin(token_z, num_pde_bins, bias=False)
        self.to_plddt_logits = lin(token_s, num_plddt_bins, bias=False)
        self.to_resolved_logits = lin(token_s, 2, bias=False)

    def pair_logits(self, zz: torch.Tensor, same: torch.Tensor | None, kind: str) -> torch.Tensor:
        """``kind`` (``pae`` of z, ``pde`` of z + z^T) logits of ``zz``; ``same`` the same-chain pairs."""
        if not self.use_separate_heads:
            return getattr(self, f"to_{kind}_logits")(zz)
        same = same.to(zz.dtype)[..., None]
        intra = getattr(self, f"to_{kind}_intra_logits")(zz) * same
        inter = getattr(self, f"to_{kind}_inter_logits")(zz) * (1 - same)
        return inter + intra

    def forward(
        self,
        s: torch.Tensor,
        z: torch.Tensor,
        x_pred: torch.Tensor,
        d: torch.Tensor,
        feats: Mapping[str, torch.Tensor],
        pred_distogram_logits: torch.Tensor,
        multiplicity: int = 1,
    ) -> dict[str, Any]:
        m = multiplicity
        asym = feats["asym_id"].repeat_interleave(m, 0)
        same = asym[:, :, None] == asym[:, None, :]
        pae_logits = self.pair_logits(z, same, "pae")
        pde_logits = self.pair_logits(z + z.transpose(1, 2), same, "pde")
        resolved_logits = self.to_resolved_logits(s)
        plddt_logits = self.to_plddt_logits(s)

        mol = feats["mol_type"].repeat_interleave(m, 0)
        is_ligand = (mol == NONPOLYMER).to(s.dtype)
        pad = feats["token_pad_mask"].repeat_interleave(m, 0).to(s.dtype)
        plddt = aggregated_metric(plddt_logits)
        complex_plddt = (plddt * pad).sum(-1) / pad.sum(-1)
        contact_other = (d < 8).to(s.dtype) * (~same).to(s.dtype) * (1 - is_ligand)[:, :, None]
        interface = contact_other.max(dim=-1).values
        non_interface = (1 - interface) * (1 - is_ligand)
        weight = (
            is_ligand * LIGAND_WEIGHT + interface * INTERFACE_WEIGHT + non_interface * NON_INTERFACE_WEIGHT
        )
        complex_iplddt = (plddt * pad * weight).sum(-1) / (pad * weight).sum(-1)

        pde = aggregated_metric(pde_logits, end=32)
        if pred_distogram_logits.shape[-1] != DISTOGRAM_BINS:
            raise ValueError(
                f"pred_distogram_logits must have {DISTOGRAM_BINS} bins (Boltz's contact probability "
                f"sums the first {CONTACT_BINS}), got {pred_distogram_logits.shape[-1]}"
            )
        prob = F.softmax(pred_distogram_logits, dim=-1).repeat_interleave(m, 0)
        prob_contact = prob[..., :CONTACT_BINS].sum(-1)
        n = pad.shape[1]
        off_diag = 1 - torch.eye(n, dtype=pad.dtype, device=pad.device)
        pair_mask = pad[:, :, None] * pad[:, None, :] * off_diag * prob_contact
        complex_pde = (pde * pair_mask).sum((1, 2)) / pair_mask.sum((1, 2))
        inter_mask = pair_mask * (~same).to(pad.dtype)
        complex_ipde = (pde * inter_mask).sum((1, 2)) / (inter_mask.sum((1, 2)) + 1e-5)
        out: dict[str, Any] = dict(
            pde_logits=pde_logits,
            plddt_logits=plddt_logits,
            resolved_logits=resolved_logits,
            pde=pde,
            plddt=plddt,
            complex_plddt=complex_plddt,
            complex_iplddt=complex_iplddt,
            complex_pde=complex_pde,
            complex_ipde=complex_ipde,
            pae_logits=pae_logits,
            pae=aggregated_metric(pae_logits, end=32),
        )
        out.update(self.ptms(pae_logits, frame_mask(x_pred, feats, m), feats, m))
        return out

    @staticmethod
    def ptms(
        logits: torch.Tensor, maski: torch.Tensor, feats: Mapping[str, torch.Tensor], m: int
    ) -> dict[str, Any]:
        """pTM, ipTM, ligand/protein ipTM and the per-chain-pair ipTM (Boltz's ``compute_ptms``)."""
        pad = feats["token_pad_mask"].repeat_interleave(m, 0).to(logits.dtype)
        asym = feats["asym_id"].repeat_interleave(m, 0)
        mol = feats["mol_type"].repeat_interleave(m, 0)
        valid = maski[:, :, None] * pad[:, None, :] * pad[:, :, None]  # row i: frame and real; col j real
        other = (asym[:, None, :] != asym[:, :, None]).to(pad.dtype)
        n_res = pad.sum(-1, keepdim=True)
        tm_value = tm_function(bin_centres(logits.shape[-1], 32.0, logits.device)[None], n_res)
        tm = (F.softmax(logits, dim=-1) * tm_value[:, None, None, :]).sum(-1)  # [B m, N, N]

        def best(pm: torch.Tensor) -> torch.Tensor:
            return ((tm * pm).sum(-1) / (pm.sum(-1) + 1e-5)).max(dim=1).values

        lig = (mol == NONPOLYMER).to(pad.dtype)
        prot = (mol == PROTEIN).to(pad.dtype)
        lig_prot = lig[:, :, None] * prot[:, None, :] + prot[:, :, None] * lig[:, None, :]
        out: dict[str, Any] = {
            "ptm": best(valid),
            "iptm": best(valid * other),
            "ligand_iptm": best(valid * other * lig_prot),
            "protein_iptm": best(valid * other * (prot[:, :, None] * prot[:, None, :])),
        }
        chains = torch.unique(asym).tolist()
        out["pair_chains_iptm"] = {
            c1: {
                c2: best(valid * (asym[:, None, :] == c1) * (asym[:, :, None] == c2).to(pad.dtype))
                for c2 in chains
            }
            for c1 in chains
        }
        return out


class ConfidenceModule(nn.Module):
    """Boltz-2's ``ConfidenceModule`` (module docstring). ``forward(s_inputs, s, z, x_pred, feats,
    pred_distogram_logits, multiplicity=1, seed=None) -> dict`` (Boltz's keys); ``seed`` keys the
    Pairformer's dropout (``convention``), None without dropout."""

    def __init__(
        self,
        token_s: int,
        token_z: int,
        pairformer_args: dict,
        num_dist_bins: int = 64,
        token_level_confidence: bool = True,
        max_dist: float = 22,
        add_s_to_z_prod: bool = False,
        add_s_input_to_s: bool = False,
        add_z_input_to_z: bool = False,
        maximum_bond_distance: int = 0,
        bond_type_feature: bool = False,
        confidence_args: dict | None = None,
        compile_pairformer: bool = False,
        fix_sym_check: bool = False,
        cyclic_pos_enc: bool = False,
        return_latent_feats: bool = False,
        conditioning_cutoff_min: float | None = None,
        conditioning_cutoff_max: float | None = None,
        convention: str = "boltz",
        **kwargs: Any,
    ):
        super().__init__()
        if not token_level_confidence:
            raise NotImplementedError("atom-level confidence (token_level_confidence=False) is not supported")
        parts = self.parts()
        lin, norm = parts["linear"], parts["layer_norm"]
        self.no_update_s = bool(pairformer_args.get("no_update_s", False))
        self.register_buffer("boundaries", torch.linspace(2, max_dist, num_dist_bins - 1))
        self.dist_bin_pairwise_embed = parts["embedding"](num_dist_bins, token_z)
        self.token_level_confidence = True
        self.s_to_z = lin(token_s, token_z, bias=False)
        self.s_to_z_transpose = lin(token_s, token_z, bias=False)
        self.add_s_to_z_prod = add_s_to_z_prod
        if add_s_to_z_prod:
            self.s_to_z_prod_in1 = lin(token_s, token_z, bias=False)
            self.s_to_z_prod_in2 = lin(token_s, token_z, bias=False)
            self.s_to_z_prod_out = lin(token_z, token_z, bias=False)
        self.s_inputs_norm = norm(token_s)
        if not self.no_update_s:
            self.s_norm = norm(token_s)
        self.z_norm = norm(token_z)
        self.add_s_input_to_s = add_s_input_to_s
        if add_s_input_to_s:
            self.s_input_to_s = lin(token_s, token_s, bias=False)
        self.add_z_input_to_z = add_z_input_to_z
        self.bond_type_feature = False
        if add_z_input_to_z:
            self.rel_pos = parts["rel_pos"](
                token_z, fix_sym_check=fix_sym_check, cyclic_pos_enc=cyclic_pos_enc
            )
            bonds = 1 if maximum_bond_distance == 0 else maximum_bond_distance + 2
            self.token_bonds = lin(bonds, token_z, bias=False)
            self.bond_type_feature = bond_type_feature
            if bond_type_feature:
                self.token_bonds_type = parts["embedding"](len(BOND_TYPES) + 1, token_z)
            self.contact_conditioning = parts["contact"](
                token_z, cutoff_min=conditioning_cutoff_min, cutoff_max=conditioning_cutoff_max
            )
        self.pairformer_stack = parts["pairformer"](
            token_s, token_z, **stack_args(pairformer_args), convention=convention
        )
        self.return_latent_feats = return_latent_feats
        self.confidence_heads = parts["heads"](token_s, token_z, **(confidence_args or {}))

    @classmethod
    def parts(cls) -> dict[str, type]:
        from twinshard.pair.reference.pairformer import PairformerStack

        return {
            "linear": Linear,
            "layer_norm": LayerNorm,
            "embedding": Embedding,
            "rel_pos": RelativePositionEncoder,
            "contact": ContactConditioning,
            "pairformer": PairformerStack,
            "heads": ConfidenceHeads,
        }

    def z_inputs(self, z: torch.Tensor, feats: Mapping[str, torch.Tensor]) -> torch.Tensor:
        z = z + self.rel_pos(feats)
        z = z + self.token_bonds(feats["token_bonds"].to(self.token_bonds.weight.dtype))
        if self.bond_type_feature:
            z = z + self.token_bonds_type(feats["type_bonds"])
        return z + self.contact_conditioning(feats)

    def forward(
        self,
        s_inputs: torch.Tensor,
        s: torch.Tensor,
        z: torch.Tensor,
        x_pred: torch.Tensor,
        feats: Mapping[str, torch.Tensor],
        pred_distogram_logits: torch.Tensor,
        multiplicity: int = 1,
        run_sequentially: bool = False,
        seed: int | None = None,
    ) -> dict[str, Any]:
        m = int(multiplicity)
        if run_sequentially and m > 1:
            raise NotImplementedError("run_sequentially is not supported: run the samples as one batch")
        if x_pred.dim() == 4:
            x_pred = x_pred.reshape(-1, *x_pred.shape[2:])
        s_inputs = self.s_inputs_norm(s_inputs)
        if not self.no_update_s:
            s = self.s_norm(s)
        if self.add_s_input_to_s:
            s = s + self.s_input_to_s(s_inputs)
        z = self.z_norm(z)
        if self.add_z_input_to_z:
            z = self.z_inputs(z, feats)
        s = s.repeat_interleave(m, 0)
        z = z + self.s_to_z(s_inputs)[:, :, None, :] + self.s_to_z_transpose(s_inputs)[:, None, :, :]
        if self.add_s_to_z_prod:
            z = z + self.s_to_z_prod_out(
                self.s_to_z_prod_in1(s_inputs)[:, :, None, :] * self.s_to_z_prod_in2(s_inputs)[:, None, :, :]
            )
        z = z.repeat_interleave(m, 0)
        t2r = feats["token_to_rep_atom"].repeat_interleave(m, 0).to(x_pred.dtype)
        x_rep = torch.bmm(t2r, x_pred)
        d = torch.cdist(x_rep, x_rep)
        bins = (d.unsqueeze(-1) > self.boundaries).sum(dim=-1).long()
        z = z + self.dist_bin_pairwise_embed(bins)
        mask = feats["token_pad_mask"].repeat_interleave(m, 0)
        mask = mask if mask.is_floating_point() else mask.to(z.dtype)
        pair_mask = mask[:, :, None] * mask[:, None, :]
        s, z = self.pairformer_stack(s, z, mask, pair_mask, seed)
        out: dict[str, Any] = {}
        if self.return_latent_feats:
            out["s_conf"], out["z_conf"] = s, z
        out.update(self.confidence_heads(s, z, x_pred, d, feats, pred_distogram_logits, m))
        return out
