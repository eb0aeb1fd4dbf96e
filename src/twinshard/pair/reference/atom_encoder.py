"""The atom encoder and the atom attention encoder (AlphaFold3 supplement, Algorithm 5; Boltz-2's
``encodersv2.AtomEncoder`` / ``AtomAttentionEncoder`` with ``structure_prediction=False``).

``AtomEncoder(feats)``: per atom, ``c = embed_atom_features([ref_pos, ref_charge, ref_element,
ref_atom_name_chars (unless use_no_atom_char), atom_backbone_feat (use_atom_backbone_feat),
the token's [res_type, modified, one_hot(mol_type, 4)] (use_residue_feats_atoms)])``; per window
pair (query i of window k, key j of its H keys, :mod:`~twinshard.pair.reference.atom_transformer`)::

    d_ij = ref_pos_j - ref_pos_i;  v_ij = mask_i & mask_j & (uid_i == uid_j)
    p_ij = (embed_atompair_ref_pos(d_ij) + embed_atompair_ref_dist(1 / (1 + |d_ij|^2))
            + embed_atompair_mask(v_ij)) * v_ij
    p_ij += c_to_p_trans_q(c_i) + c_to_p_trans_k(c_j);  p_ij += p_mlp(p_ij)

returning ``(q = c, c, p[B, K, W, H, atom_z], to_keys)``. With ``structure_prediction=True``
(the diffusion conditioning's encoder, AF3 Algorithm 5 lines 9-11), on the trunk's ``s_trunk`` and
the conditioned pair ``z``: ``c <- c + A2T s_to_c_trans(s_trunk)`` (``q`` stays the unconditioned
embedding) and ``p_ij += z_to_p_trans(z)[token(i), token(j)]`` (zero where an atom maps to no
token or the key lies outside ``[0, A)``), added before the ``c_to_p`` terms, as Boltz-2 does. ``AtomAttentionEncoder(feats, q, c,
atom_enc_bias, to_keys)``: ``q = AtomTransformer(q, c, atom_enc_bias)``, then the mean over each
token's atoms ``a = (A2T / (sum_atoms A2T + 1e-6))^T relu(q W)`` (``atom_to_token_trans``),
returning ``(a[B, N, token_s], q, c, to_keys)``.

The window geometry and the pair features are split out (:meth:`AtomEncoder.atom_features`,
:meth:`AtomEncoder.pair_features`, :func:`token_mean`) so the CP twin runs the same code on its
own atoms and key frame. Names and registration order are Boltz-2's (``embed_atom_features``,
``embed_atompair_ref_pos``, ``embed_atompair_ref_dist``, ``embed_atompair_mask``,
``[s_to_c_trans.{0,1}, z_to_p_trans.{0,1}]``, ``c_to_p_trans_k.1``, ``c_to_p_trans_q.1``,
``p_mlp.{1,3,5}``; ``[r_to_q_trans]``, ``atom_encoder.*`` (the :class:`AtomTransformer`),
``atom_to_token_trans.0``; bracketed: ``structure_prediction=True`` only).
``AtomAttentionEncoder(structure_prediction=True)`` takes noisy coordinates ``r[B m, A, 3]``:
``q <- repeat(q, m) + r_to_q_trans(r)``, ``c <- repeat(c, m)`` (``repeat_interleave``: sample
``b m + j`` is element b's j-th), the transformer's bias shared by the m samples, and maps to
``2 token_s`` channels.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from twinshard.pair.reference.atom_transformer import AtomTransformer, serial_frame, window_keys
from twinshard.pair.reference.linear import Linear
from twinshard.pair.reference.norm import LayerNorm

__all__ = [
    "AtomAttentionEncoder",
    "AtomEncoder",
    "atom_tokens",
    "serial_to_keys",
    "token_mean",
    "token_pair_gather",
]

NUM_TOKENS = 33  # Boltz-2's const.num_tokens (res_type width)
NUM_MOL_TYPES = 4  # len(const.chain_type_ids)


def serial_to_keys(w: int, h: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Boltz-2's ``to_keys`` on the whole of ``[0, A)``: ``x[B, A, ...] -> [B, A / W, H, ...]``."""

    def to_keys(x: torch.Tensor) -> torch.Tensor:
        return window_keys(serial_frame(x, w, h), x.shape[1] // w, w, h)

    return to_keys


def token_mean(atom_to_token: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Mean over each token's atoms: ``atom_to_token[B, A, N]``, ``x[B, A, c]`` -> ``[B, N, c]``
    (Boltz-2's ``+ 1e-6`` in the denominator included)."""
    a2t = atom_to_token.to(x.dtype)
    return torch.bmm((a2t / (a2t.sum(dim=1, keepdim=True) + 1e-6)).transpose(1, 2), x)


def atom_tokens(atom_to_token: torch.Tensor) -> torch.Tensor:
    """``[B, A]`` int64: the token (column of the one-hot ``atom_to_token[B, A, N]``) of every atom,
    -1 for an atom mapped to no token."""
    mapped = atom_to_token.ne(0).any(-1)
    return torch.where(
        mapped, atom_to_token.ne(0).to(torch.uint8).argmax(-1), torch.full_like(mapped, -1, dtype=torch.long)
    )


def token_pair_gather(zp: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor) -> torch.Tensor:
    """``out[b, k, w, h] = zp[b, iq[b, k, w], ik[b, k, h]]`` (``zp[B, N1, N2, d]``), zero where
    either index is negative: Boltz-2's ``einsum("bijd,bwki,bwlj->bwkld", z, A2T_q, A2T_k)`` with
    one-hot maps, as a gather (the same values exactly: a one-hot product adds exact zeros)."""
    vq, vk = iq >= 0, ik >= 0
    bi = torch.arange(zp.shape[0], device=zp.device).view(-1, 1, 1, 1)
    out = zp[bi, iq.clamp(min=0)[:, :, :, None], ik.clamp(min=0)[:, :, None, :]]
    valid = (vq[:, :, :, None] & vk[:, :, None, :]).unsqueeze(-1)
    return out.masked_fill(~valid, 0)


class AtomEncoder(nn.Module):
    """Per-atom and per-window-pair embeddings of the reference conformer (module docstring)."""

    def __init__(
        self,
        atom_s: int,
        atom_z: int,
        token_s: int,
        token_z: int,
        atoms_per_window_queries: int,
        atoms_per_window_keys: int,
        atom_feature_dim: int,
        structure_prediction: bool = True,
        use_no_atom_char: bool = False,
        use_atom_backbone_feat: bool = False,
        use_residue_feats_atoms: bool = False,
    ):
        super().__init__()
        self.embed_atom_features = Linear(atom_feature_dim, atom_s)
        self.embed_atompair_ref_pos = Linear(3, atom_z, bias=False)
        self.embed_atompair_ref_dist = Linear(1, atom_z, bias=False)
        self.embed_atompair_mask = Linear(1, atom_z, bias=False)
        self.atoms_per_window_queries = atoms_per_window_queries
        self.atoms_per_window_keys = atoms_per_window_keys
        self.use_no_atom_char = use_no_atom_char
        self.use_atom_backbone_feat = use_atom_backbone_feat
        self.use_residue_feats_atoms = use_residue_feats_atoms
        self.structure_prediction = structure_prediction
        if structure_prediction:
            self.s_to_c_trans = nn.Sequential(
                LayerNorm(token_s), Linear(token_s, atom_s, bias=False, init="final")
            )
            self.z_to_p_trans = nn.Sequential(
                LayerNorm(token_z), Linear(token_z, atom_z, bias=False, init="final")
            )
        self.c_to_p_trans_k = nn.Sequential(nn.ReLU(), Linear(atom_s, atom_z, bias=False, init="final"))
        self.c_to_p_trans_q = nn.Sequential(nn.ReLU(), Linear(atom_s, atom_z, bias=False, init="final"))
        self.p_mlp = nn.Sequential(
            nn.ReLU(),
            Linear(atom_z, atom_z, bias=False),
            nn.ReLU(),
            Linear(atom_z, atom_z, bias=False),
            nn.ReLU(),
            Linear(atom_z, atom_z, bias=False, init="final"),
        )

    def atom_features(self, feats: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``[B, A, atom_feature_dim]`` in the parameters' dtype. ``feats["atom_to_token"]`` and
        the token features need only cover the tokens of these atoms (the CP twin's tiles)."""
        dt = self.embed_atom_features.weight.dtype
        pos = feats["ref_pos"]
        b, a = pos.shape[:2]
        parts = [pos.to(dt), feats["ref_charge"].to(dt).unsqueeze(-1), feats["ref_element"].to(dt)]
        if not self.use_no_atom_char:
            parts.append(feats["ref_atom_name_chars"].to(dt).reshape(b, a, -1))
        if self.use_atom_backbone_feat:
            parts.append(feats["atom_backbone_feat"].to(dt))
        if self.use_residue_feats_atoms:
            res = torch.cat(
                [
                    feats["res_type"].to(dt),
                    feats["modified"].to(dt).unsqueeze(-1),
                    F.one_hot(feats["mol_type"].long(), NUM_MOL_TYPES).to(dt),
                ],
                dim=-1,
            )
            parts.append(torch.bmm(feats["atom_to_token"].to(dt), res))
        return torch.cat(parts, dim=-1)

    def pair_features(
        self,
        pos_q: torch.Tensor,
        pos_k: torch.Tensor,
        valid: torch.Tensor,
        c_q: torch.Tensor,
        c_k: torch.Tensor,
        z_to_p: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``p[B, K, W, H, atom_z]`` from the windows' queries (``pos_q[B, K, W, 3]``,
        ``c_q[B, K, W, atom_s]``), keys (``pos_k[B, K, H, 3]``, ``c_k[B, K, H, atom_s]``) and
        ``valid[B, K, W, H]`` (both real atoms of one reference-conformer space); ``z_to_p``
        (structure prediction: the trunk pair's term, ``[B, K, W, H, atom_z]``) is added before
        the ``c_to_p`` terms."""
        d = pos_k[:, :, None] - pos_q[:, :, :, None]
        d_norm = 1 / (1 + (d * d).sum(dim=-1, keepdim=True))
        v = valid.to(d.dtype).unsqueeze(-1)
        p = self.embed_atompair_ref_pos(d) * v
        p = p + self.embed_atompair_ref_dist(d_norm) * v
        p = p + self.embed_atompair_mask(v) * v
        if z_to_p is not None:
            p = p + z_to_p
        p = p + self.c_to_p_trans_q(c_q[:, :, :, None])
        p = p + self.c_to_p_trans_k(c_k[:, :, None])
        return p + self.p_mlp(p)

    @staticmethod
    def valid_pairs(mask_q, mask_k, uid_q, uid_k) -> torch.Tensor:
        """``[B, K, W, H]``: both atoms real, same ``ref_space_uid``."""
        return (
            (mask_q[:, :, :, None] != 0)
            & (mask_k[:, :, None] != 0)
            & (uid_q[:, :, :, None] == uid_k[:, :, None])
        )

    def condition_on_trunk(
        self, c: torch.Tensor, atom_to_token: torch.Tensor, s_trunk: torch.Tensor
    ) -> torch.Tensor:
        """``c + A2T s_to_c_trans(s_trunk)`` (``atom_to_token`` may be a tile: my atoms x my tokens)."""
        s_to_c = self.s_to_c_trans(s_trunk)
        return c + torch.bmm(atom_to_token.to(s_to_c.dtype), s_to_c).to(c.dtype)

    def _check_trunk(self, s_trunk, z) -> None:
        if self.structure_prediction and (s_trunk is None or z is None):
            raise ValueError("AtomEncoder(structure_prediction=True) conditions on s_trunk and z: pass both")
        if not self.structure_prediction and (s_trunk is not None or z is not None):
            raise ValueError("AtomEncoder(structure_prediction=False) takes no s_trunk / z")

    def forward(self, feats: Mapping[str, torch.Tensor], s_trunk=None, z=None) -> tuple:
        """``feats`` (Boltz-2 names) -> ``(q, c, p, to_keys)`` (module docstring); with
        ``structure_prediction``, ``s_trunk[B, N, token_s]`` and ``z[B, N, N, token_z]``."""
        self._check_trunk(s_trunk, z)
        w, h = self.atoms_per_window_queries, self.atoms_per_window_keys
        c = self.embed_atom_features(self.atom_features(feats))
        q = c
        b, a = c.shape[:2]
        if a % w:
            raise ValueError(f"{a} atoms are not a whole number of windows of {w}: pad A (Boltz pads it)")
        k = a // w
        to_keys = serial_to_keys(w, h)
        pos = feats["ref_pos"].to(c.dtype)
        mask = feats["atom_pad_mask"].to(c.dtype)
        uid = feats["ref_space_uid"].to(c.dtype)
        valid = self.valid_pairs(
            mask.view(b, k, w),
            to_keys(mask[..., None])[..., 0],
            uid.view(b, k, w),
            to_keys(uid[..., None])[..., 0],
        )
        z_to_p = None
        if self.structure_prediction:
            c = self.condition_on_trunk(c, feats["atom_to_token"], s_trunk)
            tok = atom_tokens(feats["atom_to_token"])
            ik = to_keys((tok + 1).to(c.dtype)[..., None])[..., 0].round().long() - 1  # zero keys: -1
            z_to_p = token_pair_gather(self.z_to_p_trans(z), tok.view(b, k, w), ik)
        p = self.pair_features(
            pos.view(b, k, w, 3), to_keys(pos), valid, c.view(b, k, w, -1), to_keys(c), z_to_p
        )
        return q, c, p, to_keys


class AtomAttentionEncoder(nn.Module):
    """The atom transformer on the encoded atoms, then the mean over each token's atoms."""

    _transformer_cls: type[AtomTransformer] = AtomTransformer

    def __init__(
        self,
        atom_s: int,
        token_s: int,
        atoms_per_window_queries: int,
        atoms_per_window_keys: int,
        atom_encoder_depth: int = 3,
        atom_encoder_heads: int = 4,
        structure_prediction: bool = True,
        activation_checkpointing: bool = False,
        transformer_post_layer_norm: bool = False,
    ):
        super().__init__()
        self.structure_prediction = structure_prediction
        if structure_prediction:
            self.r_to_q_trans = Linear(3, atom_s, bias=False, init="final")
        self.atom_encoder = self._transformer_cls(
            attn_window_queries=atoms_per_window_queries,
            attn_window_keys=atoms_per_window_keys,
            dim=atom_s,
            dim_single_cond=atom_s,
            depth=atom_encoder_depth,
            heads=atom_encoder_heads,
            activation_checkpointing=activation_checkpointing,
            post_layer_norm=transformer_post_layer_norm,
        )
        out = 2 * token_s if structure_prediction else token_s
        self.atom_to_token_trans = nn.Sequential(Linear(atom_s, out, bias=False), nn.ReLU())

    def condition_on_coords(self, q: torch.Tensor, c: torch.Tensor, r, multiplicity: int) -> tuple:
        """``(repeat(q, m) + r_to_q_trans(r), repeat(c, m))`` (structure prediction; else the check)."""
        if not self.structure_prediction:
            if r is not None or multiplicity != 1:
                raise ValueError("AtomAttentionEncoder(structure_prediction=False) takes no r / multiplicity")
            return q, c
        if r is None:
            raise ValueError(
                "AtomAttentionEncoder(structure_prediction=True) needs the coordinates r[B m, A, 3]"
            )
        q = q.repeat_interleave(multiplicity, 0) + self.r_to_q_trans(r.to(q.dtype))
        return q, c.repeat_interleave(multiplicity, 0)

    def forward(self, feats, q, c, atom_enc_bias, to_keys, r=None, multiplicity: int = 1) -> tuple:
        """``-> (a[B m, N, c_a], q, c, to_keys)`` (module docstring; m = 1 and ``r = None`` unless
        ``structure_prediction``)."""
        q, c = self.condition_on_coords(q, c, r, multiplicity)
        mask = feats["atom_pad_mask"].repeat_interleave(multiplicity, 0)
        q = self.atom_encoder(
            q=q, c=c, bias=atom_enc_bias, to_keys=to_keys, mask=mask, multiplicity=multiplicity
        )
        a2t = feats["atom_to_token"].repeat_interleave(multiplicity, 0)
        a = token_mean(a2t, self.atom_to_token_trans(q))
        return a, q, c, to_keys
