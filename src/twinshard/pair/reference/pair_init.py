"""The pair initialisation of the Boltz-2 trunk (AF3 supplement Alg. 1 lines 1-5, Alg. 3; Boltz-2's
``Boltz2.forward`` lines "Initialize the sequence / pairwise embeddings", ``RelativePositionEncoder``
of ``encodersv2`` and ``ContactConditioning`` of ``trunkv2``), with Boltz-2's parameter names.

From the single input embedding ``s_inputs[B, N, c_s]`` and the token features::

    s_init  <- s_init(s_inputs)                                       # Linear, no bias
    z_init  <- z_init_1(s_inputs)_i + z_init_2(s_inputs)_j            # outer sum, no biases
    z_init  <- z_init + rel_pos(feats)                                # Alg. 3 (below)
    z_init  <- z_init + token_bonds(token_bonds)                      # Linear(1, c_z), no bias
    z_init  <- z_init + token_bonds_type(type_bonds)                  # Embedding(7, c_z), if used
    z_init  <- z_init + contact_conditioning(feats)

Relative position encoding (AF3 Alg. 3 with Boltz-2's ``r_max = 32``, ``s_max = 2``), per pair (i, j)
of tokens::

    same_chain = asym_i == asym_j;  same_res = residue_i == residue_j;  same_ent = entity_i == entity_j
    d_res   = residue_i - residue_j    (cyclic: d - p_j round(d / p_j), p_j = period of token j, or
                                        10000 where it has none; only when some token of the batch
                                        has a period > 0, as Boltz tests it)
    d_res   = clip(d_res + r_max, 0, 2 r_max) if same_chain else 2 r_max + 1
    d_tok   = clip(token_i - token_j + r_max, 0, 2 r_max) if same_chain and same_res else 2 r_max + 1
    d_chain = clip(sym_i - sym_j + s_max, 0, 2 s_max), set to 2 s_max + 1 where same_chain
              (``fix_sym_check``: where not same_ent instead)
    p_ij    = linear_layer([onehot(d_res), onehot(d_tok), same_ent, onehot(d_chain)])

Boltz writes the cyclic period as a ``[B, N]`` tensor broadcast against ``[B, N, N]``, which for
its batch size of one is the period of token j (the column); here it is token j's period in
every sample.

Contact conditioning (Boltz-2): ``contact_conditioning[B, N, N, 5]`` one-hot over (UNSPECIFIED,
UNSELECTED, POCKET>BINDER, BINDER>POCKET, CONTACT), ``contact_threshold[B, N, N]``::

    t    = (threshold - cutoff_min) / (cutoff_max - cutoff_min)
    e    = encoder([cc[..., 2:], t, cos(2 pi (w t + b))])            # FourierEmbedding: w, b frozen
    out  = e (1 - cc_0 - cc_1) + encoding_unspecified cc_0 + encoding_unselected cc_1

Every map here acts on one pair (i, j) from the features of i and of j alone, so the serial
modules take ``row`` and ``col`` feature dicts (here the same full features) and the CP twins
(``twinshard.pair.layers.pair_init``) call the same code on a tile's rows and columns.
One-hot features are cast to the parameters' dtype (Boltz's ``.float()``: fp32 models compute the
same; an fp64 model stays fp64).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from twinshard.pair.reference.linear import Linear

__all__ = [
    "BOND_TYPES",
    "CONTACT_CLASSES",
    "RELPOS_KEYS",
    "ContactConditioning",
    "Embedding",
    "FourierEmbedding",
    "PairInit",
    "RelativePositionEncoder",
    "add_pair_init",
    "outer_sum",
    "pair_init_forward",
]

# Boltz-2's data constants (boltz.data.const): the contact-conditioning classes, of which 0
# (UNSPECIFIED) and 1 (UNSELECTED) have learnt encodings, and the bond types (+1: no bond).
CONTACT_CLASSES = ("UNSPECIFIED", "UNSELECTED", "POCKET>BINDER", "BINDER>POCKET", "CONTACT")
BOND_TYPES = ("OTHER", "SINGLE", "DOUBLE", "TRIPLE", "AROMATIC", "COVALENT")

RELPOS_KEYS = ("asym_id", "residue_index", "entity_id", "token_index", "sym_id")


def _need(feats: Mapping[str, torch.Tensor], keys: tuple[str, ...], what: str) -> None:
    missing = [k for k in keys if k not in feats]
    if missing:
        raise KeyError(f"{what} needs the features {missing} (Boltz-2 names), which are missing")


class RelativePositionEncoder(nn.Module):
    """AF3 Alg. 3 with Boltz-2's options (module docstring); parameter ``linear_layer.weight``."""

    def __init__(
        self,
        token_z: int,
        r_max: int = 32,
        s_max: int = 2,
        fix_sym_check: bool = False,
        cyclic_pos_enc: bool = False,
    ):
        super().__init__()
        self.r_max = r_max
        self.s_max = s_max
        self.linear_layer = Linear(4 * (r_max + 1) + 2 * (s_max + 1) + 1, token_z, bias=False)
        self.fix_sym_check = fix_sym_check
        self.cyclic_pos_enc = cyclic_pos_enc

    def keys(self) -> tuple[str, ...]:
        return RELPOS_KEYS + (("cyclic_period",) if self.cyclic_pos_enc else ())

    def encode(
        self, row: Mapping[str, torch.Tensor], col: Mapping[str, torch.Tensor], cyclic: bool
    ) -> torch.Tensor:
        """``[B, n_i, n_j, F]`` one-hot features of the pairs (rows of ``row``) x (rows of ``col``),
        each a dict of ``[B, n]`` token features; ``cyclic``: apply the cyclic periods (Boltz:
        ``cyclic_pos_enc`` and some period > 0 in the batch)."""
        r_max, s_max = self.r_max, self.s_max

        def pair(key: str) -> tuple[torch.Tensor, torch.Tensor]:
            return row[key][:, :, None], col[key][:, None, :]

        a_i, a_j = pair("asym_id")
        res_i, res_j = pair("residue_index")
        e_i, e_j = pair("entity_id")
        same_chain, same_res, same_ent = a_i == a_j, res_i == res_j, e_i == e_j
        d_res = res_i - res_j
        if cyclic:
            period = col["cyclic_period"]
            period = torch.where(period > 0, period, torch.zeros_like(period) + 10000)[:, None, :]
            d_res = (d_res - period * torch.round(d_res / period)).long()
        d_res = torch.clip(d_res + r_max, 0, 2 * r_max)
        d_res = torch.where(same_chain, d_res, torch.zeros_like(d_res) + 2 * r_max + 1)
        t_i, t_j = pair("token_index")
        d_tok = torch.clip(t_i - t_j + r_max, 0, 2 * r_max)
        d_tok = torch.where(same_chain & same_res, d_tok, torch.zeros_like(d_tok) + 2 * r_max + 1)
        y_i, y_j = pair("sym_id")
        d_chain = torch.clip(y_i - y_j + s_max, 0, 2 * s_max)
        other = ~same_ent if self.fix_sym_check else same_chain
        d_chain = torch.where(other, torch.zeros_like(d_chain) + 2 * s_max + 1, d_chain)
        dt = self.linear_layer.weight.dtype
        return torch.cat(
            [
                F.one_hot(d_res.long(), 2 * r_max + 2).to(dt),
                F.one_hot(d_tok.long(), 2 * r_max + 2).to(dt),
                same_ent.unsqueeze(-1).to(dt),
                F.one_hot(d_chain.long(), 2 * s_max + 2).to(dt),
            ],
            dim=-1,
        )

    def forward(self, feats: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``feats`` (Boltz-2 names, ``[B, N]`` each) -> ``[B, N, N, token_z]``."""
        _need(feats, self.keys(), type(self).__name__)
        cyclic = self.cyclic_pos_enc and bool(torch.any(feats["cyclic_period"] > 0))
        return self.linear_layer(self.encode(feats, feats, cyclic))


class FourierEmbedding(nn.Module):
    """``cos(2 pi (w t + b))`` (AF3 Alg. 22) with frozen ``proj`` ~ N(0, 1) (Boltz-2's names)."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(1, dim)
        nn.init.normal_(self.proj.weight, mean=0.0, std=1.0)
        nn.init.normal_(self.proj.bias, mean=0.0, std=1.0)
        self.proj.requires_grad_(False)

    def forward(self, times: torch.Tensor) -> torch.Tensor:
        """``times[b] -> [b, dim]`` (the contact thresholds' and the diffusion times' embedding)."""
        return torch.cos(2 * math.pi * self.proj(times[:, None].to(self.proj.weight.dtype)))


class ContactConditioning(nn.Module):
    """Boltz-2's contact conditioning (module docstring); ``forward(feats) -> [B, N, N, token_z]``.

    Parameters (Boltz-2's order): ``fourier_embedding.proj.{weight,bias}`` (frozen),
    ``encoder.{weight,bias}``, ``encoding_unspecified``, ``encoding_unselected``."""

    KEYS = ("contact_conditioning", "contact_threshold")

    def __init__(self, token_z: int, cutoff_min: float = 4.0, cutoff_max: float = 20.0):
        super().__init__()
        self.fourier_embedding = FourierEmbedding(token_z)
        self.encoder = nn.Linear(token_z + len(CONTACT_CLASSES) - 1, token_z)
        self.encoding_unspecified = nn.Parameter(torch.zeros(token_z))
        self.encoding_unselected = nn.Parameter(torch.zeros(token_z))
        self.cutoff_min = cutoff_min
        self.cutoff_max = cutoff_max

    def encode(self, cc: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
        """The map per pair: ``cc[..., 5]`` one-hot classes, ``threshold[...]`` -> ``[..., token_z]``."""
        if cc.shape[-1] != len(CONTACT_CLASSES):
            raise ValueError(
                f"contact_conditioning must be one-hot over {len(CONTACT_CLASSES)} classes "
                f"{CONTACT_CLASSES}, got last dim {cc.shape[-1]}"
            )
        dt = self.encoder.weight.dtype
        t = (threshold.to(dt) - self.cutoff_min) / (self.cutoff_max - self.cutoff_min)
        fourier = self.fourier_embedding(t.flatten()).reshape(t.shape + (-1,))
        x = self.encoder(torch.cat([cc[..., 2:].to(dt), t.unsqueeze(-1), fourier], dim=-1))
        cc = cc.to(dt)
        return (
            x * (1 - cc[..., 0:2].sum(dim=-1, keepdim=True))
            + self.encoding_unspecified * cc[..., 0:1]
            + self.encoding_unselected * cc[..., 1:2]
        )

    def forward(self, feats: Mapping[str, torch.Tensor]) -> torch.Tensor:
        _need(feats, self.KEYS, type(self).__name__)
        return self.encode(feats["contact_conditioning"], feats["contact_threshold"])


class Embedding(nn.Embedding):
    """``nn.Embedding`` (parameter ``weight``) that takes any integer-valued tensor (Boltz calls
    ``.long()`` on ``type_bonds`` first)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx.long())


def outer_sum(lin_i: nn.Module, lin_j: nn.Module, s_i: torch.Tensor, s_j: torch.Tensor) -> torch.Tensor:
    """``lin_i(s_i)[:, :, None] + lin_j(s_j)[:, None, :]``: ``[B, n_i, n_j, c]`` (Boltz's z_init)."""
    return lin_i(s_i)[:, :, None] + lin_j(s_j)[:, None, :]


def add_pair_init(
    module: nn.Module,
    token_s: int,
    token_z: int,
    *,
    bond_type_feature: bool = False,
    fix_sym_check: bool = False,
    cyclic_pos_enc: bool = False,
    conditioning_cutoff_min: float = 4.0,
    conditioning_cutoff_max: float = 20.0,
    parts: Mapping[str, type] | None = None,
) -> None:
    """Register the pair-initialisation parts on ``module`` under Boltz-2's top-level names, in
    Boltz-2's order: ``s_init, z_init_1, z_init_2, rel_pos, token_bonds, [token_bonds_type],
    contact_conditioning``. A whole trunk registers ``input_embedder`` first, then calls this,
    so its ``state_dict`` keys are ``Boltz2``'s. ``parts`` overrides the classes (the CP twin
    passes its own): keys ``linear``, ``rel_pos``, ``embedding``, ``contact``."""
    p = {
        "linear": Linear,
        "rel_pos": RelativePositionEncoder,
        "embedding": Embedding,
        "contact": ContactConditioning,
        **(parts or {}),
    }
    module.s_init = p["linear"](token_s, token_s, bias=False)
    module.z_init_1 = p["linear"](token_s, token_z, bias=False)
    module.z_init_2 = p["linear"](token_s, token_z, bias=False)
    module.rel_pos = p["rel_pos"](token_z, fix_sym_check=fix_sym_check, cyclic_pos_enc=cyclic_pos_enc)
    module.token_bonds = p["linear"](1, token_z, bias=False)
    module.bond_type_feature = bond_type_feature
    if bond_type_feature:
        module.token_bonds_type = p["embedding"](len(BOND_TYPES) + 1, token_z)
    module.contact_conditioning = p["contact"](
        token_z, cutoff_min=conditioning_cutoff_min, cutoff_max=conditioning_cutoff_max
    )


def pair_init_forward(
    module: nn.Module,
    s_inputs: torch.Tensor,
    feats: Mapping[str, torch.Tensor],
    keep: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s_init, z_init)`` from the parts :func:`add_pair_init` registered on ``module``, in
    Boltz-2's order of additions (module docstring). ``keep``: a dict that receives the relative
    position encoding as ``"relative_position_encoding"`` (Boltz2 hands it to the diffusion
    conditioning)."""
    _need(feats, ("token_bonds",) + (("type_bonds",) if module.bond_type_feature else ()), "pair init")
    s_init = module.s_init(s_inputs)
    z_init = outer_sum(module.z_init_1, module.z_init_2, s_inputs, s_inputs)
    rel = module.rel_pos(feats)
    if keep is not None:
        keep["relative_position_encoding"] = rel
    z_init = z_init + rel
    bonds = feats["token_bonds"]
    z_init = z_init + module.token_bonds(bonds.to(module.token_bonds.weight.dtype))
    if module.bond_type_feature:
        z_init = z_init + module.token_bonds_type(feats["type_bonds"])
    z_init = z_init + module.contact_conditioning(feats)
    return s_init, z_init


class PairInit(nn.Module):
    """The pair initialisation alone: ``forward(s_inputs, feats) -> (s_init, z_init)``. Its
    ``state_dict`` keys are exactly ``Boltz2``'s for these parts (``s_init.weight``,
    ``rel_pos.linear_layer.weight``, ``contact_conditioning.encoder.weight``, ...), so the slice of
    a Boltz-2 checkpoint loads strict. Arguments: ``Boltz2``'s of the same names."""

    def __init__(self, token_s: int, token_z: int, **kwargs: object):
        super().__init__()
        add_pair_init(self, token_s, token_z, **kwargs)  # type: ignore[arg-type]

    def forward(
        self, s_inputs: torch.Tensor, feats: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return pair_init_forward(self, s_inputs, feats)
