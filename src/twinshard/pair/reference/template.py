"""The template module of Boltz-2 (``trunkv2.TemplateV2Module``; version 1 ``TemplateModule``), a
serial reference with Boltz-2's parameter names and order (AF3 supplement Alg. 16 as Boltz-2 runs it).

Inputs: the pair representation ``z[B, N, N, c_z]``, ``pair_mask[B, N, N]`` and the template
features ``[B, T, N, ...]`` (Boltz-2 names): ``template_restype`` (one-hot over 33 token types),
``template_frame_rot [.., 3, 3]``, ``template_frame_t``, ``template_ca``, ``template_cb``
(``[.., 3]``), ``template_mask_frame``, ``template_mask_cb``, ``template_mask`` and (version 2)
``visibility_ids``; version 1 reads ``asym_id [B, N]`` instead. For template t and tokens (i, j)::

    d_ij    = |cb_i - cb_j|                  (torch.cdist: as Boltz, the |x|^2 + |y|^2 - 2 x.y form
                                              beyond 25 tokens, differences below; N the caller's)
    bins    = onehot(sum_b [d_ij > edge_b]),  edges = linspace(min_dist, max_dist, num_bins - 1)
    u_ij    = sign(R_j^T (ca_i - t_j))        (frame of token j, CA of i; see below)
    a_tij   = [bins, cbm_i cbm_j, u_ij, fm_i fm_j] * [vis_i == vis_j]   (v1: asym_i == asym_j)
    a_tij   = a_proj([a_tij, restype_i, restype_j])
    v       = z_proj(z_norm(z)) + a_tij                                  # [B, T, N, N, d]
    v       = v + pairformer(v, pair_mask)                               # on B*T pair tensors
    v       = v_norm(v)
    u       = sum_t m_t v_t / max(1, sum_t m_t),  m_t = any_i template_mask[t, i]
    out     = u_proj(relu(u))                                            # [B, N, N, c_z]

Boltz-2's "unit vector": it forms ``v = R_j^T (ca_i - t_j)`` as a ``[..., 3, 1]`` column and takes
``torch.norm(v, dim=-1, keepdim=True)`` over the trailing axis of length 1, so each component is
divided by its own absolute value (0 where it is 0): the feature is the componentwise sign of
``v``, not ``v / |v|``. The reference computes it the same way (the checkpoint was trained on it).

The features of a pair are those of token i and of token j alone: ``pair_features(row, col,
n_tokens)`` takes the two sides as dicts of ``[B, T, n, ...]`` tensors (here both are the full
features), and the CP twin (``twinshard.pair.layers.template``) calls it on a tile's row and column
blocks. Zero templates (T = 0): no template counts, so the average is 0 / 1 and the output is
exactly zero; here the Pairformer is not called on an empty batch (boltz 2.2.1's triangle
attention cannot reshape one), and Boltz's own featuriser never gives T = 0 (it adds one
all-masked dummy template, whose output is the same zero). The one-hot and mask features are
cast to ``a_proj``'s dtype (Boltz computes them in the features' dtype, fp32 from its featuriser;
equal there).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from twinshard.pair.reference.linear import Linear
from twinshard.pair.reference.norm import LayerNorm, compute_dtype
from twinshard.pair.reference.pairformer import PairformerNoSeqModule

__all__ = [
    "NUM_TOKEN_TYPES",
    "TEMPLATE_KEYS",
    "TemplateModule",
    "TemplateV2Module",
    "cdist_mode",
]

NUM_TOKEN_TYPES = 33  # len(boltz.data.const.tokens)
TEMPLATE_KEYS = (
    "template_restype",
    "template_frame_rot",
    "template_frame_t",
    "template_mask_frame",
    "template_cb",
    "template_ca",
    "template_mask_cb",
    "template_mask",
)


def cdist_mode(n_tokens: int) -> str:
    """The ``compute_mode`` torch.cdist picks by default for an N x N distance matrix (the
    matrix-product form when either side has more than 25 points), to be used on a tile too."""
    return "use_mm_for_euclid_dist" if n_tokens > 25 else "donot_use_mm_for_euclid_dist"


class _Template(nn.Module):
    """Shared body of versions 1 and 2 (they differ in the pair visibility: ``_visible``)."""

    def __init__(
        self,
        token_z: int,
        template_dim: int,
        template_blocks: int,
        dropout: float = 0.25,
        pairwise_head_width: int = 32,
        pairwise_num_heads: int = 4,
        post_layer_norm: bool = False,
        activation_checkpointing: bool = False,
        min_dist: float = 3.25,
        max_dist: float = 50.75,
        num_bins: int = 38,
        convention: str = "boltz",
        pairformer_cls: type[nn.Module] = PairformerNoSeqModule,
        **kwargs: object,
    ):
        super().__init__()
        self.min_dist = min_dist
        self.max_dist = max_dist
        self.num_bins = num_bins
        self.relu = nn.ReLU()
        self.z_norm = LayerNorm(token_z)
        self.v_norm = LayerNorm(template_dim)
        self.z_proj = Linear(token_z, template_dim, bias=False)
        self.a_proj = Linear(NUM_TOKEN_TYPES * 2 + num_bins + 5, template_dim, bias=False)
        self.u_proj = Linear(template_dim, token_z, bias=False)
        self.pairformer = pairformer_cls(
            template_dim,
            num_blocks=template_blocks,
            dropout=dropout,
            pairwise_head_width=pairwise_head_width,
            pairwise_num_heads=pairwise_num_heads,
            post_layer_norm=post_layer_norm,
            activation_checkpointing=activation_checkpointing,
            convention=convention,
        )

    # which features a pair's visibility reads, and how: version-specific
    VISIBILITY_KEY = "visibility_ids"

    def keys(self) -> tuple[str, ...]:
        return TEMPLATE_KEYS + (self.VISIBILITY_KEY,)

    def _visible(self, row: Mapping[str, torch.Tensor], col: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``[B, T, n_i, n_j]`` bool: may template features of (i, j) be seen."""
        return row["visibility_ids"][:, :, :, None] == col["visibility_ids"][:, :, None, :]

    def pair_features(
        self, row: Mapping[str, torch.Tensor], col: Mapping[str, torch.Tensor], n_tokens: int
    ) -> torch.Tensor:
        """``a_tij [B, T, n_i, n_j, 2 * 33 + num_bins + 5]`` before ``a_proj`` (module docstring);
        ``n_tokens``: the caller's N (it picks torch.cdist's formula)."""
        dt = self.a_proj.weight.dtype
        cbm = (row["template_mask_cb"][:, :, :, None] * col["template_mask_cb"][:, :, None, :])[..., None]
        fm = (row["template_mask_frame"][:, :, :, None] * col["template_mask_frame"][:, :, None, :])[
            ..., None
        ]
        visible = self._visible(row, col).to(dt)
        ct = compute_dtype(row["template_cb"].dtype)  # distances in >= fp32 (bf16 has no CPU cdist)
        d = torch.cdist(
            row["template_cb"].to(ct), col["template_cb"].to(ct), compute_mode=cdist_mode(n_tokens)
        )
        edges = torch.linspace(self.min_dist, self.max_dist, self.num_bins - 1).to(d.device)
        bins = F.one_hot((d[..., None] > edges).sum(dim=-1).long(), num_classes=self.num_bins)
        rot_t = col["template_frame_rot"].unsqueeze(2).transpose(-1, -2)  # R_j^T: [B, T, 1, n_j, 3, 3]
        t_j = col["template_frame_t"].unsqueeze(2).unsqueeze(-1)
        ca_i = row["template_ca"].unsqueeze(3).unsqueeze(-1)
        vec = torch.matmul(rot_t, ca_i - t_j)
        norm = torch.norm(vec, dim=-1, keepdim=True)
        unit = torch.where(norm > 0, vec / norm, torch.zeros_like(vec)).squeeze(-1)
        a = torch.cat([bins.to(dt), cbm.to(dt), unit.to(dt), fm.to(dt)], dim=-1) * visible.unsqueeze(-1)
        ni, nj = a.shape[2], a.shape[3]
        res_i = row["template_restype"][:, :, :, None].expand(-1, -1, -1, nj, -1)
        res_j = col["template_restype"][:, :, None, :].expand(-1, -1, ni, -1, -1)
        return torch.cat([a, res_i.to(dt), res_j.to(dt)], dim=-1)

    def project_in(self, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """``v = z_proj(z_norm(z)) + a_proj(a)``: ``z[B, n_i, n_j, c_z]``, ``a[B, T, n_i, n_j, F]``."""
        return self.z_proj(self.z_norm(z[:, None])) + self.a_proj(a)

    def project_out(self, v: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
        """``u_proj(relu(sum_t m_t v_norm(v_t) / max(1, sum_t m_t)))``; ``counted[B, T]`` = m_t."""
        v = self.v_norm(v)
        num = counted.sum(dim=1).clamp(min=1)
        u = (v * counted[:, :, None, None, None].to(v)).sum(dim=1) / num[:, None, None, None].to(v)
        return self.u_proj(self.relu(u))

    def forward(
        self,
        z: torch.Tensor,
        feats: Mapping[str, torch.Tensor],
        pair_mask: torch.Tensor,
        use_kernels: bool = False,
        seed: int | None = None,
    ) -> torch.Tensor:
        """The update of ``z``, ``[B, N, N, c_z]`` (``use_kernels``: Boltz's flag, ignored)."""
        missing = [k for k in self.keys() if k not in feats]
        if missing:
            raise KeyError(
                f"{type(self).__name__} needs the features {missing} (Boltz-2 names), which are missing"
            )
        b, n = z.shape[:2]
        t = feats["template_mask"].shape[1]
        counted = feats["template_mask"].any(dim=2)
        v = self.project_in(z, self.pair_features(feats, feats, n))
        if t > 0:  # the Pairformer of no template is nothing (and boltz's cannot run on none)
            flat = v.reshape(b * t, *v.shape[2:])
            pm = pair_mask[:, None].expand(-1, t, -1, -1).reshape(b * t, *pair_mask.shape[1:])
            v = (flat + self.pairformer(flat, pm, seed)).view(v.shape)
        return self.project_out(v, counted)


class TemplateV2Module(_Template):
    """Boltz-2's ``TemplateV2Module`` (module docstring): pair features visible where
    ``visibility_ids`` agree. Parameters in Boltz's order: ``z_norm, v_norm, z_proj, a_proj,
    u_proj, pairformer``."""


class TemplateModule(_Template):
    """Boltz-2's version-1 ``TemplateModule``: pair features visible within a chain
    (``asym_id``), otherwise as :class:`TemplateV2Module`."""

    VISIBILITY_KEY = "asym_id"

    def _visible(self, row: Mapping[str, torch.Tensor], col: Mapping[str, torch.Tensor]) -> torch.Tensor:
        same = row["asym_id"][:, :, None] == col["asym_id"][:, None, :]  # [B, n_i, n_j]
        return same[:, None].expand(-1, row["template_mask"].shape[1], -1, -1)
