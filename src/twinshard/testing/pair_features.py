"""Small seeded Boltz-2 token, pair and template features for the pair-initialisation and template
tests (a stand-in until the shared synthetic complex generator covers them; Boltz-2's names,
dtypes and value ranges).

:func:`token_pair_features` gives a complex of several chains: a protein-like chain, a homomer
copy of it (same entity, next ``sym_id``), a ligand-like chain whose tokens share residue indices
(``same_res`` with different ``token_index``), residue numbering with a gap larger than
``gap`` (clipping at ``r_max``), ``cyclic_period`` on one chain, symmetric ``token_bonds`` with
``type_bonds`` in 1..6 where bonded (0 = no bond), one-hot ``contact_conditioning`` over the five
classes and ``contact_threshold`` in [2, 22] A. :func:`template_features` gives ``T`` templates:
random frames (proper rotations), CA/CB coordinates spread over the distogram's 3.25-50.75 A
range, random masks, ``visibility_ids`` per chain, and (with ``T >= 2``) one padded template (all
``template_mask`` zero) that must not count in the average.
"""

from __future__ import annotations

import torch

__all__ = ["template_features", "token_pair_features"]


def _chains(n: int) -> list[int]:
    """Chain lengths summing to n: two equal 'protein' chains, a ligand, the rest."""
    a = max(1, n // 3)
    lig = max(1, min(3, n - 2 * a)) if n - 2 * a > 0 else 0
    lens = [a, a] + ([lig] if lig else [])
    rest = n - sum(lens)
    if rest > 0:
        lens.append(rest)
    while sum(lens) > n:
        lens[-1] -= 1
    return [x for x in lens if x > 0]


def token_pair_features(
    b: int, n: int, seed: int = 0, dtype: torch.dtype = torch.float64, gap: int = 40
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = _chains(n)
    asym, entity, sym, res = [], [], [], []
    for c, m in enumerate(lens):
        asym += [c] * m
        entity += [0 if c < 2 else c] * m  # chains 0 and 1: one entity (a homomer)
        sym += [c if c < 2 else 0] * m
        if c == 2:  # ligand-like: its tokens share one residue index
            res += [0] * m
        else:
            r = list(range(m))
            if m > 2:  # a numbering gap beyond r_max
                r = r[: m // 2] + [x + gap for x in r[m // 2 :]]
            res += r
    feats = {
        "asym_id": torch.tensor(asym).repeat(b, 1),
        "entity_id": torch.tensor(entity).repeat(b, 1),
        "sym_id": torch.tensor(sym).repeat(b, 1),
        "residue_index": torch.tensor(res).repeat(b, 1),
        "token_index": torch.arange(n).repeat(b, 1),
    }
    period = torch.zeros(n, dtype=torch.float32)
    period[: lens[0]] = float(lens[0])  # chain 0 is cyclic
    feats["cyclic_period"] = period.repeat(b, 1)
    bonds = (torch.rand(b, n, n, generator=g) < 0.3).to(dtype)
    bonds = torch.maximum(bonds, bonds.transpose(1, 2))
    types = torch.randint(1, 7, (b, n, n), generator=g)
    types = torch.where(bonds > 0, torch.minimum(types, types.transpose(1, 2)), torch.zeros_like(types))
    feats["token_bonds"] = bonds.unsqueeze(-1)
    feats["type_bonds"] = types
    cls = torch.randint(0, 5, (b, n, n), generator=g)
    feats["contact_conditioning"] = torch.nn.functional.one_hot(cls, 5)
    feats["contact_threshold"] = (2 + 20 * torch.rand(b, n, n, generator=g, dtype=torch.float64)).to(dtype)
    return feats


def _rotations(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(shape + (3, 3), generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    det = torch.linalg.det(q)
    q[..., :, 0] *= det.sign().unsqueeze(-1)
    return q


def template_features(
    b: int, t: int, n: int, seed: int = 0, dtype: torch.dtype = torch.float64, num_tokens: int = 33
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    lens = _chains(n)
    chain = torch.cat([torch.full((m,), c) for c, m in enumerate(lens)])
    ca = torch.randn(b, t, n, 3, generator=g, dtype=torch.float64) * 15
    cb = ca + torch.randn(b, t, n, 3, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, n, generator=g) < 0.85).to(dtype)
    if t >= 2:
        mask[:, -1] = 0  # a padded template
    vis = chain.to(dtype).repeat(b, t, 1)
    if t >= 1:  # template 0 sees chains 0 and 1 as one (one PDB entry), the rest by chain
        vis[:, 0] = torch.where(chain < 2, torch.zeros_like(chain), chain).to(dtype)
    return {
        "template_restype": torch.nn.functional.one_hot(
            torch.randint(0, num_tokens, (b, t, n), generator=g), num_tokens
        ),
        "template_frame_rot": _rotations((b, t, n), g).to(dtype),
        "template_frame_t": (ca + 0.5 * torch.randn(b, t, n, 3, generator=g, dtype=torch.float64)).to(dtype),
        "template_mask_frame": (torch.rand(b, t, n, generator=g) < 0.8).to(dtype) * mask,
        "template_cb": cb.to(dtype),
        "template_ca": ca.to(dtype),
        "template_mask_cb": (torch.rand(b, t, n, generator=g) < 0.8).to(dtype) * mask,
        "template_mask": mask,
        "visibility_ids": vis,
    }
