"""A small local generator of Boltz-2 atom and token features for the input-embedder tests (until the
shared ``twinshard.pair.synthetic.synthetic_complex`` lands).

``atom_complex(b, n, atoms=(3, 8), seed=0, w=32)``: B samples of N tokens, each real token with a
random number of atoms in ``atoms`` (contiguous, in token order), A = the most real atoms of any
sample padded up to a multiple of ``w`` (Boltz's padding atoms: zero features, mask 0, mapped to no
token). Sample 1 (when B > 1) has its last token padding (no atoms, ``token_pad_mask`` 0). Atoms of
one token share a ``ref_space_uid``; every second token shares it with the token before (so the
``uid`` test of the pair features has both outcomes).
"""

from __future__ import annotations

import torch

ELEMENTS, CHARS, BACKBONE, RES = 128, 64, 17, 33


def atom_complex(b: int, n: int, atoms: tuple[int, int] = (3, 8), seed: int = 0, w: int = 32) -> dict:
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    per = torch.randint(atoms[0], atoms[1] + 1, (b, n), generator=g)
    tok_mask = torch.ones(b, n, dtype=f64)
    if b > 1:
        per[1, -1] = 0
        tok_mask[1, -1] = 0
    real = per.sum(1)
    a = int(-(-int(real.max()) // w) * w)
    a2t = torch.zeros(b, a, n, dtype=torch.long)
    rep = torch.zeros(b, n, a, dtype=torch.long)
    uid = torch.zeros(b, a, dtype=torch.long)
    mask = torch.zeros(b, a, dtype=f64)
    for s in range(b):
        at = 0
        for t in range(n):
            k = int(per[s, t])
            if k == 0:
                continue
            a2t[s, at : at + k, t] = 1
            rep[s, t, at + int(torch.randint(0, k, (1,), generator=g))] = 1
            uid[s, at : at + k] = t - (t % 2) + 1
            mask[s, at : at + k] = 1
            at += k
    m = mask[..., None]
    feats = {
        "ref_pos": 2.0 * torch.randn(b, a, 3, generator=g, dtype=f64) * m,
        "ref_charge": torch.randint(-1, 2, (b, a), generator=g).to(f64) * mask,
        "ref_element": torch.nn.functional.one_hot(torch.randint(0, ELEMENTS, (b, a), generator=g), ELEMENTS)
        * m.long(),
        "ref_atom_name_chars": torch.nn.functional.one_hot(
            torch.randint(0, CHARS, (b, a, 4), generator=g), CHARS
        )
        * m[..., None].long(),
        "ref_space_uid": uid,
        "atom_pad_mask": mask,
        "atom_backbone_feat": torch.nn.functional.one_hot(
            torch.randint(0, BACKBONE, (b, a), generator=g), BACKBONE
        )
        * m.long(),
        "atom_to_token": a2t,
        "token_to_rep_atom": rep,
        "res_type": torch.nn.functional.one_hot(torch.randint(0, RES, (b, n), generator=g), RES)
        * tok_mask[..., None].long(),
        "profile": torch.rand(b, n, RES, generator=g, dtype=f64) * tok_mask[..., None],
        "deletion_mean": torch.rand(b, n, generator=g, dtype=f64) * tok_mask,
        "method_feature": torch.randint(0, 12, (b, n), generator=g) * tok_mask.long(),
        "modified": torch.randint(0, 2, (b, n), generator=g) * tok_mask.long(),
        "cyclic_period": (torch.randint(0, 3, (b, n), generator=g) * 5).to(f64) * tok_mask,
        "mol_type": torch.randint(0, 4, (b, n), generator=g) * tok_mask.long(),
        "token_pad_mask": tok_mask,
    }
    return feats


def embedder_config(w: int = 32, h: int = 128, **flags) -> dict:
    """Small InputEmbedder sizes; every optional path on unless ``flags`` say otherwise."""
    cfg = dict(
        atom_s=8,
        atom_z=4,
        token_s=6,
        token_z=4,
        atoms_per_window_queries=w,
        atoms_per_window_keys=h,
        atom_encoder_depth=2,
        atom_encoder_heads=2,
        add_method_conditioning=True,
        add_modified_flag=True,
        add_cyclic_flag=True,
        add_mol_type_feat=True,
        use_no_atom_char=False,
        use_atom_backbone_feat=True,
        use_residue_feats_atoms=True,
    )
    cfg.update(flags)
    dim = 3 + 1 + ELEMENTS
    dim += 0 if cfg["use_no_atom_char"] else 4 * CHARS
    dim += BACKBONE if cfg["use_atom_backbone_feat"] else 0
    dim += RES + 1 + 4 if cfg["use_residue_feats_atoms"] else 0
    cfg["atom_feature_dim"] = dim
    return cfg
