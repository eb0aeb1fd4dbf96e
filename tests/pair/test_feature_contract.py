"""The Boltz-2 feature contract and the synthetic complex (main environment, no boltz).

- the synthetic complex passes ``check_features`` for every trunk feature, at the exact sizes
  asked for, deterministically, with batch elements that differ (atoms, padding) and MSA
  statistics consistent with the MSA;
- ``check_features`` raises a ValueError naming the feature for every kind of bad input the
  contract lists (and accepts T = 0 templates);
- ``trunk_feature_names`` follows the configuration flags.
"""

from __future__ import annotations

import math

import pytest
import torch

from twinshard.pair.feature_contract import (
    CONTRACT,
    NUM_TOKENS,
    RELEASED_BOLTZ2,
    TRAINING_FEATURES,
    check_features,
    contract_kinds,
    trunk_feature_names,
)
from twinshard.pair.synthetic import synthetic_complex

ALL_FLAGS = {**RELEASED_BOLTZ2, "use_atom_backbone_feat": True, "use_residue_feats_atoms": True}
KINDS = {"single", "pair", "msa", "sample", "atom", "atom_token", "token_atom", "template", "atom_conf"}


@pytest.mark.parametrize(
    "n, apt, s, t, chains, batch",
    [
        (12, (2, 4), 5, 2, 3, 2),
        (7, 1, 1, 0, 2, 1),
        (5, (5, 14), 3, 1, 1, 3),
        (16, (3, 6), 2, 3, 4, 2),
    ],
)
def test_synthetic_is_valid_and_exact(n, apt, s, t, chains, batch):
    f = synthetic_complex(
        n, atoms_per_token=apt, msa_depth=s, templates=t, chains=chains, batch=batch, seed=3
    )
    check_features(f, need=trunk_feature_names(ALL_FLAGS))
    assert set(f) == set(CONTRACT) - set(TRAINING_FEATURES)
    a = f["ref_pos"].shape[1]
    assert a % 32 == 0 and a >= 32
    assert f["res_type"].shape == (batch, n, NUM_TOKENS)
    assert f["msa"].shape == (batch, s, n) and f["template_mask"].shape == (batch, t, n)
    for name, x in f.items():
        spec = CONTRACT[name]
        assert x.dtype == (torch.float64 if spec.dtype.is_floating_point else spec.dtype), name
    real_atoms = f["atom_pad_mask"].sum(-1)
    if batch > 1:
        assert len(set(real_atoms.tolist())) > 1, "batch elements should be different complexes"
        assert f["token_pad_mask"][1:].sum() < (batch - 1) * n, "elements b > 0 carry padding tokens"
    assert f["token_pad_mask"][0].all() and f["msa_mask"][0].sum() == s * n


def test_synthetic_deterministic_and_seeded():
    a = synthetic_complex(9, atoms_per_token=(2, 5), msa_depth=3, templates=2, batch=2, seed=5)
    b = synthetic_complex(9, atoms_per_token=(2, 5), msa_depth=3, templates=2, batch=2, seed=5)
    c = synthetic_complex(9, atoms_per_token=(2, 5), msa_depth=3, templates=2, batch=2, seed=6)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["ref_pos"], c["ref_pos"])
    f32 = synthetic_complex(
        9, atoms_per_token=(2, 5), msa_depth=3, templates=2, batch=2, seed=5, dtype=torch.float32
    )
    assert f32["ref_pos"].dtype == torch.float32 and f32["msa"].dtype == torch.int64
    assert torch.equal(f32["ref_pos"], a["ref_pos"].float())


def test_synthetic_structure_mirrors_boltz():
    f = synthetic_complex(12, atoms_per_token=(2, 4), msa_depth=6, templates=2, chains=3, batch=2, seed=1)
    # MSA statistics from the MSA itself (real sequences only)
    mask = f["msa_mask"].double()
    s_real = mask.sum(1).clamp(min=1)
    prof = (torch.nn.functional.one_hot(f["msa"], NUM_TOKENS).double() * mask[..., None]).sum(1) / s_real[
        ..., None
    ]
    tok = f["token_pad_mask"].bool()
    assert torch.allclose(f["profile"][tok], prof[tok], rtol=0, atol=1e-15)
    dm = (f["deletion_value"] * mask).sum(1) / s_real
    assert torch.allclose(f["deletion_mean"][tok], dm[tok], rtol=0, atol=1e-15)
    assert torch.equal(f["has_deletion"], f["deletion_value"] > 0)
    assert float(f["deletion_value"].max()) <= math.pi**2 / 4
    assert f["has_deletion"].any(), "the MSA carries deletions"
    assert torch.equal(f["msa"][:, 0][tok], f["res_type"].argmax(-1)[tok]), "row 0 is the query"
    # a repeated entity: two chains with one entity id and sym ids 0, 1; a ligand of single-atom tokens
    e0 = f["entity_id"][0] == 0
    assert set(f["asym_id"][0][e0].tolist()) == {0, 1} and set(f["sym_id"][0][e0].tolist()) == {0, 1}
    lig = f["mol_type"][0] == 3
    assert lig.any() and (f["res_type"][0][lig].argmax(-1) == 22).all()
    counts = f["atom_to_token"][0].sum(0)
    assert (counts[lig] == 1).all() and (counts[~lig] >= 2).all()
    # bonds and contacts symmetric, padding zero
    assert torch.equal(f["type_bonds"], f["type_bonds"].transpose(1, 2))
    assert torch.equal(f["token_bonds"][..., 0], (f["type_bonds"] > 0).double())
    cc = f["contact_conditioning"].argmax(-1)
    assert {0, 1, 2, 3, 4} <= set(cc[0].unique().tolist())
    assert torch.equal(f["contact_threshold"], f["contact_threshold"].transpose(1, 2))
    pad = ~tok[1]
    assert f["contact_conditioning"][1][pad].sum() == 0 and f["res_type"][1][pad].sum() == 0
    # templates: a real one and a padding one (the last template of element 0)
    assert f["template_mask"][0, 0].any() and not f["template_mask"][0, 1].any()
    assert f["template_mask"][1].any(-1).all()
    rot = f["template_frame_rot"][f["template_mask"].bool()]
    eye = torch.eye(3, dtype=rot.dtype).expand_as(rot)
    assert torch.allclose(rot.transpose(-1, -2) @ rot, eye, atol=1e-12)


def test_synthetic_n_atoms_and_cyclic():
    f = synthetic_complex(8, atoms_per_token=3, msa_depth=2, templates=1, batch=1, seed=2, n_atoms=64)
    assert f["ref_pos"].shape[1] == 64
    check_features(f)
    assert (f["cyclic_period"] > 0).any()
    f2 = synthetic_complex(8, atoms_per_token=3, msa_depth=2, templates=1, batch=2, seed=2)
    assert not (f2["cyclic_period"] > 0).any(), "Boltz's cyclic encoding breaks for B > 1: off by default"
    with pytest.raises(ValueError, match="n_atoms"):
        synthetic_complex(8, atoms_per_token=3, n_atoms=40)


def test_contract_table():
    assert set(contract_kinds().values()) <= KINDS
    for spec in CONTRACT.values():
        assert spec.shape.startswith("[B") and spec.meaning and spec.valid and spec.read_by
    assert CONTRACT["atom_to_token"].shape == "[B, A, N]"
    assert CONTRACT["method_feature"].kind == "single", "Boltz's method_feature is per token"


def test_trunk_feature_names_follow_flags():
    base = set(trunk_feature_names())
    assert {"ref_atom_name_chars", "msa_paired", "token_pad_mask"} <= base
    assert not base & {"type_bonds", "cyclic_period", "method_feature", "template_cb", "atom_backbone_feat"}
    rel = set(trunk_feature_names(RELEASED_BOLTZ2))
    assert rel - base == {
        "type_bonds", "cyclic_period", "method_feature", "modified", "mol_type", "visibility_ids",
        "template_restype", "template_frame_rot", "template_frame_t", "template_mask_frame",
        "template_cb", "template_ca", "template_mask_cb", "template_mask",
    }  # fmt: skip
    assert "token_to_rep_atom" not in rel  # not read by the trunk forward
    v1 = set(trunk_feature_names({**RELEASED_BOLTZ2, "use_templates_v2": False}))
    assert rel - v1 == {"visibility_ids"}
    no_char = set(trunk_feature_names({"use_no_atom_char": True, "use_atom_backbone_feat": True}))
    assert "ref_atom_name_chars" not in no_char and "atom_backbone_feat" in no_char


# ---- bad input -----------------------------------------------------------------------------------


def _good():
    return synthetic_complex(10, atoms_per_token=(2, 4), msa_depth=3, templates=2, batch=2, seed=4)


def _edit(**changes):
    f = _good()
    for name, fn in changes.items():
        f[name] = fn(f[name].clone())
    return f


def _real_atoms(f, b=0):
    return int(f["atom_pad_mask"][b].sum())


def _swap_rows(x, i, j):
    x[0, [i, j]] = x[0, [j, i]]
    return x


def _set(x, index, value):
    x[index] = value
    return x


BAD = {
    "missing": (lambda: {k: v for k, v in _good().items() if k != "msa_paired"}, "msa_paired", "missing"),
    "n_inconsistent": (
        lambda: _edit(asym_id=lambda x: torch.cat([x, x[:, :1]], 1)),
        "asym_id",
        r"inconsistent N",
    ),
    "a_inconsistent": (
        lambda: _edit(ref_charge=lambda x: torch.cat([x, torch.zeros_like(x)], 1)),
        "ref_charge",
        r"inconsistent A",
    ),
    "s_inconsistent": (lambda: _edit(msa_mask=lambda x: x[:, :2]), "msa_mask", r"inconsistent S"),
    "t_inconsistent": (lambda: _edit(template_cb=lambda x: x[:, :1]), "template_cb", r"inconsistent T"),
    "b_inconsistent": (lambda: _edit(profile=lambda x: x[:1]), "profile", r"inconsistent B"),
    "no_batch_dim": (lambda: _edit(ref_pos=lambda x: x[0]), "ref_pos", "batch dimension"),
    "msa_float": (lambda: _edit(msa=lambda x: x.double()), "msa", "integer dtype"),
    "ref_pos_int": (lambda: _edit(ref_pos=lambda x: x.long()), "ref_pos", "floating dtype"),
    "atom_beyond_n": (
        lambda: _edit(atom_to_token=lambda x: torch.cat([x, torch.zeros_like(x[..., :1])], -1)),
        "atom_to_token",
        r"dim 2 \(N\) is 11",
    ),
    "atom_no_token": (
        lambda: _edit(atom_to_token=lambda x: _set(x, (0, 3), 0)),
        "atom_to_token",
        "real atom 3 of batch element 0 maps to no token",
    ),
    "atom_two_tokens": (
        lambda: _edit(atom_to_token=lambda x: _set(x, (0, 0, 5), 1)),
        "atom_to_token",
        "maps to 2 tokens",
    ),
    "padding_atom_mapped": (
        lambda: (
            lambda f: {**f, "atom_to_token": _set(f["atom_to_token"].clone(), (0, _real_atoms(f), 0), 1)}
        )(_good()),
        "atom_to_token",
        "padding atom",
    ),
    "atoms_not_contiguous": (
        lambda: (
            lambda f: {
                **f,
                "atom_to_token": _swap_rows(f["atom_to_token"].clone(), 0, _real_atoms(f) - 1),
            }
        )(_good()),
        "atom_to_token",
        "contiguous",
    ),
    "padding_not_last": (
        lambda: _edit(atom_pad_mask=lambda x: _set(x, (0, 2), 0)),
        "atom_pad_mask",
        "padding atoms must come last",
    ),
    "atoms_not_window_multiple": (
        lambda: {
            k: (v[:, :-1] if CONTRACT[k].kind in ("atom", "atom_token") else v[..., :-1])
            if CONTRACT[k].kind in ("atom", "atom_token", "token_atom")
            else v
            for k, v in _good().items()
        },
        "atom_pad_mask",
        "multiple of 32",
    ),
    "msa_depth_0": (
        lambda: {k: (v[:, :0] if CONTRACT[k].kind == "msa" else v) for k, v in _good().items()},
        "msa",
        "S = 0",
    ),
    "res_type_classes": (
        lambda: _edit(res_type=lambda x: torch.cat([x, torch.zeros_like(x[..., :1])], -1)),
        "res_type",
        "dim 2 must be 33",
    ),
    "res_type_none": (lambda: _edit(res_type=lambda x: _set(x, (0, 1), 0)), "res_type", "no residue class"),
    "msa_id_range": (lambda: _edit(msa=lambda x: _set(x, (0, 1, 2), 33)), "msa", "out of range"),
    "method_range": (
        lambda: _edit(method_feature=lambda x: _set(x, (0, 0), 12)),
        "method_feature",
        "out of range",
    ),
    "type_bonds_range": (
        lambda: _edit(type_bonds=lambda x: _set(x, (0, 0, 1), 7)),
        "type_bonds",
        "out of range",
    ),
    "mol_type_negative": (lambda: _edit(mol_type=lambda x: _set(x, (0, 0), -1)), "mol_type", "below"),
    "not_binary": (
        lambda: _edit(token_pad_mask=lambda x: _set(x, (0, 0), 0.5)),
        "token_pad_mask",
        "only 0 and 1",
    ),
    "not_one_hot": (
        lambda: _edit(ref_element=lambda x: _set(x, (0, 0, 100), 1)),
        "ref_element",
        "not one-hot",
    ),
    "nan_ref_pos": (
        lambda: _edit(ref_pos=lambda x: _set(x, (1, 0, 2), float("nan"))),
        "ref_pos",
        "non-finite",
    ),
    "rep_atom_foreign": (
        lambda: _edit(token_to_rep_atom=lambda x: _swap_rows(x, 0, 1)),
        "token_to_rep_atom",
        "not one of its own",
    ),
    "atom_on_padding_token": (
        lambda: (lambda f: {**f, "token_pad_mask": _set(f["token_pad_mask"].clone(), (0, 9), 0)})(_good()),
        "atom_to_token",
        "maps to padding token 9",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_raises_naming_the_feature(case):
    make, name, what = BAD[case]
    f = make()
    with pytest.raises(ValueError, match=rf"feature '{name}'.*{what}"):
        check_features(f, need=trunk_feature_names(RELEASED_BOLTZ2))


def test_good_and_zero_templates_accepted():
    check_features(_good(), need=trunk_feature_names(ALL_FLAGS))
    f = synthetic_complex(6, atoms_per_token=2, msa_depth=1, templates=0, batch=2, seed=0)
    assert f["template_mask"].shape[1] == 0
    check_features(f, need=trunk_feature_names(RELEASED_BOLTZ2))
    before = {k: v.clone() for k, v in f.items()}
    check_features(f)
    assert all(torch.equal(before[k], f[k]) for k in f), "check_features must not modify its input"


def test_synthetic_training_features_are_valid():
    """``synthetic_training_features``: Boltz's shapes and dtypes, the contract's checks pass
    (K = 1 squeezed), the R set is token-ordered resolved polymer centre atoms, the resolved mask
    has unresolved real atoms and no padding, frames name real atoms, distribute places it all."""
    from twinshard.pair.feature_contract import r_set_token_form
    from twinshard.pair.synthetic import synthetic_training_features

    f = synthetic_complex(20, atoms_per_token=(3, 6), msa_depth=1, templates=0, chains=3, batch=2, seed=5)
    t = synthetic_training_features(f, seed=1)
    b, a, n = f["atom_to_token"].shape
    assert t["coords"].shape == (b, 1, a, 3) and t["frames_idx"].shape == (b, 1, n, 3)
    assert t["frame_resolved_mask"].shape == (b, 1, n) and t["disto_target"].shape == (b, n, n, 1, 64)
    g = dict(f) | {k: t[k] for k in ("atom_resolved_mask", "token_to_center_atom", "r_set_to_rep_atom")}
    g["frame_resolved_mask"] = t["frame_resolved_mask"][:, 0]
    check_features(g, window=None)
    res, real = t["atom_resolved_mask"], f["atom_pad_mask"] > 0
    assert bool((~res & real).any()) and not bool((res & ~real).any())
    assert bool(t["frame_resolved_mask"].any()) and bool(
        (t["frames_idx"] < real.sum(-1)[:, None, None, None]).all()
    )
    aligned = r_set_token_form(t["r_set_to_rep_atom"], f["atom_to_token"])
    assert torch.equal(aligned, t["token_to_center_atom"] * aligned.any(-1, keepdim=True))
    rows = t["r_set_to_rep_atom"].any(-1)
    assert bool((rows[:, 1:] <= rows[:, :-1]).all()), "R-set rows first, zero rows after"
    assert (t["disto_target"].sum(-1) <= 1).all() and t["token_disto_mask"].sum() > 0
