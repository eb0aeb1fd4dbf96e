"""Bad Boltz-2 input (issue 19, section 5): a clear error on every rank, or handled exactly.

- ``distribute`` of a synthetic complex with one feature broken (inconsistent N, A, S or T between
  features, an ``atom_to_token`` mapping an atom beyond N, a real atom on no token, an MSA of
  depth 0): every rank raises the SAME ``RankFailure`` in step ``pair.features.distribute``,
  naming the feature and what is wrong, none stuck, with ``src=None`` and with ``src=k`` (only
  rank k holds the data and runs the feature contract's checks);
- a feature the trunk reads but the dict lacks: ``CPBoltz2Trunk.forward`` names the missing ones
  on every rank (the serial ``Boltz2Trunk`` the same way);
- zero templates (T = 0) is valid: the serial trunk and ``CPBoltz2Trunk`` on 1x1 and 2x2 give
  EXACTLY what they give with the same templates all masked (the template module adds exactly
  zero), forward and the ``ref_pos`` gradient;
- ``synthetic_sharded``: one generator, placed by the production ``distribute``; ``collect``
  gives the serial dict back exactly (names, dtypes, values) on 1x1, 2x2, 2x3, ``src=None`` and
  ``src=k``.
"""

from __future__ import annotations

import re

import pytest
import torch

from twinshard.pair.feature_contract import check_features
from twinshard.pair.features import collect, collect_grad, collect_tensor, distribute
from twinshard.pair.layers.trunk import CPBoltz2Trunk
from twinshard.pair.reference.trunk import Boltz2Trunk, TrunkConfig
from twinshard.pair.synthetic import synthetic_complex, synthetic_sharded
from twinshard.runtime import RankFailure
from twinshard.testing import assert_parity, grid_id, random_grad_output, randomize_parameters, run_on_grid

# a small complex: 2 chains (a protein, a ligand), 2-3 atoms per protein token, A = 32
SIZES = dict(atoms_per_token=(2, 3), msa_depth=3, templates=2, chains=2)


def _good(n: int = 7, batch: int = 2, seed: int = 5) -> dict[str, torch.Tensor]:
    return synthetic_complex(n, **SIZES, batch=batch, seed=seed)


def _cat_first(x: torch.Tensor, dim: int) -> torch.Tensor:  # one more entry along dim (a copy)
    return torch.cat([x, x.narrow(dim, 0, 1)], dim)


def _broken(case: str) -> dict[str, torch.Tensor]:
    f = _good()
    if case == "n_inconsistent":
        f["residue_index"] = _cat_first(f["residue_index"], 1)
    elif case == "a_inconsistent":
        f["ref_charge"] = torch.cat([f["ref_charge"], torch.zeros_like(f["ref_charge"])], 1)
    elif case == "s_inconsistent":
        f["deletion_value"] = f["deletion_value"][:, :2]
    elif case == "t_inconsistent":
        f["template_ca"] = f["template_ca"][:, :1]
    elif case == "atom_beyond_n":  # atom 2 of element 0 moved to a token column N
        a2t = f["atom_to_token"]
        extra = torch.zeros_like(a2t[..., :1])
        extra[0, 2, 0], a2t[0, 2] = 1, 0
        f["atom_to_token"] = torch.cat([a2t, extra], -1)
    elif case == "atom_no_token":  # atom 1 (of token 0): without the check the placement is silently wrong
        f["atom_to_token"][1, 1] = 0
    elif case == "msa_depth_0":
        for k in ("msa", "has_deletion", "deletion_value", "msa_paired", "msa_mask"):
            f[k] = f[k][:, :0]
    else:
        raise AssertionError(case)
    return f


# (case, message): every message names the feature (the contract's "feature 'name': ...")
BAD = [
    (
        "n_inconsistent",
        r"feature 'residue_index': dim 1 \(N\) is 8 but 'token_pad_mask' has N=7: inconsistent N",
    ),
    (
        "a_inconsistent",
        r"feature 'ref_charge': dim 1 \(A\) is 64 but 'atom_pad_mask' has A=32: inconsistent A",
    ),
    ("s_inconsistent", r"feature 'deletion_value': dim 1 \(S\) is 2 but 'msa' has S=3: inconsistent S"),
    (
        "t_inconsistent",
        r"feature 'template_ca': dim 1 \(T\) is 1 but 'template_restype' has T=2: inconsistent T",
    ),
    (
        "atom_beyond_n",
        r"feature 'atom_to_token': dim 2 \(N\) is 8 .*; atom 2 of batch element 0 is mapped to token 7 >= N = 7",
    ),
    (
        "atom_no_token",
        r"feature 'atom_to_token': real atom 1 of batch element 1 maps to no token \(atom_pad_mask is 1\)",
    ),
    ("msa_depth_0", r"feature 'msa': MSA depth S = 0: Boltz needs at least the query sequence"),
]


def _rank_bad(grid, case, src):
    f = _broken(case) if src is None or grid.rank == src else None
    try:
        distribute(f, grid, src=src)
    except RankFailure as exc:
        return exc.step, exc.message(), exc.stuck
    return None


@pytest.mark.parametrize(
    "shape,src", [((2, 2), None), ((2, 2), 3), ((2, 3), 4)], ids=["2x2-all", "2x2-src3", "2x3-src4"]
)
@pytest.mark.parametrize("case,match", BAD, ids=[c[0] for c in BAD])
def test_bad_feature_fails_on_every_rank(case, match, shape, src):
    got = run_on_grid(_rank_bad, shape, case, src)
    assert got[0] is not None, f"{case}: distribute accepted it silently"
    assert all(g == got[0] for g in got), f"{case}: ranks raised different errors: {got}"
    step, message, stuck = got[0]
    assert step == "pair.features.distribute" and not stuck, got[0]
    assert message.startswith("ValueError: "), message
    assert re.search(match, message), f"{case}: {message!r} does not match {match!r}"


def test_the_same_messages_serially():
    """The serial checker (``check_features``, which the serial trunk runs) says the same."""
    for case, match in BAD:
        with pytest.raises(ValueError, match=match):
            check_features(_broken(case))


# -- the trunk: missing features; zero templates ------------------------------------------------

CFG = TrunkConfig(
    atom_s=4,
    atom_z=4,
    token_s=4,
    token_z=4,
    num_bins=4,
    atom_feature_dim=388,
    embedder_args={
        "atom_encoder_depth": 1,
        "atom_encoder_heads": 2,
        "add_method_conditioning": True,
        "add_modified_flag": True,
        "add_cyclic_flag": True,
        "add_mol_type_feat": True,
    },
    msa_args={
        "msa_s": 4,
        "msa_blocks": 1,
        "msa_dropout": 0.0,
        "z_dropout": 0.0,
        "pairwise_head_width": 2,
        "pairwise_num_heads": 2,
        "use_paired_feature": True,
    },
    pairformer_args={
        "num_blocks": 1,
        "num_heads": 2,
        "dropout": 0.0,
        "pairwise_head_width": 2,
        "pairwise_num_heads": 2,
        "post_layer_norm": False,
        "v2": True,
    },
    template_args={
        "template_dim": 4,
        "template_blocks": 1,
        "dropout": 0.0,
        "pairwise_head_width": 2,
        "pairwise_num_heads": 2,
    },
    use_templates=True,
    use_templates_v2=True,
    fix_sym_check=True,
    cyclic_pos_enc=True,
    bond_type_feature=True,
)
MISSING = ("method_feature", "msa_paired", "template_mask")


def _trunk(cls):
    m = cls(CFG).to(torch.float64)
    randomize_parameters(m, seed=3, scale=0.3, shift=0.05)
    return m


def _rank_missing(grid):
    f = {k: v for k, v in _good(batch=1).items() if k not in MISSING}
    try:
        _trunk(CPBoltz2Trunk)(distribute(f, grid))
    except RankFailure as exc:
        return exc.step, exc.message(), exc.stuck
    return None


@pytest.mark.parametrize("shape", [(1, 1), (2, 2)], ids=grid_id)
def test_trunk_names_missing_features_on_every_rank(shape):
    want = (
        f"ValueError: feature 'method_feature': is missing (the trunk reads it); all missing: {list(MISSING)}"
    )
    got = run_on_grid(_rank_missing, shape)
    assert got[0] is not None and all(g == got[0] for g in got), got
    step, message, stuck = got[0]
    assert step == "CPBoltz2Trunk.forward (features)" and not stuck
    assert message.startswith(want), message
    f = {k: v for k, v in _good(batch=1).items() if k not in MISSING}
    with pytest.raises(ValueError, match=r"feature 'method_feature': is missing .*'template_mask'"):
        _trunk(Boltz2Trunk)(f)


def _templates(f: dict[str, torch.Tensor], how: str) -> dict[str, torch.Tensor]:
    """``none``: T = 0; ``masked``: the same templates with every mask zero."""
    tpl = [k for k in f if k.startswith("template_") or k == "visibility_ids"]
    if how == "none":
        return {k: (v[:, :0] if k in tpl else v) for k, v in f.items()}
    masks = ("template_mask", "template_mask_frame", "template_mask_cb")
    return {k: (torch.zeros_like(v) if k in masks else v) for k, v in f.items()}


def _outputs(trunk, feats, pos, shape=None):
    out = trunk(feats)
    if shape is not None:
        out = {k: collect_tensor(v) for k, v in out.items()}
    loss = sum((v * random_grad_output(v, seed=i)).sum() for i, (_, v) in enumerate(sorted(out.items())))
    (grad,) = torch.autograd.grad(loss, pos)
    return {k: v.detach() for k, v in out.items()}, grad


def _rank_templates(grid, how):
    f = _templates(_good(batch=2), how)
    pos = f["ref_pos"].clone().requires_grad_(True)
    out, grad = _outputs(_trunk(CPBoltz2Trunk), distribute(f | {"ref_pos": pos}, grid), pos, grid.shape)
    return out, collect_grad(grad, "atom", grid)


@pytest.mark.parametrize("shape", [None, (1, 1), (2, 2)], ids=["serial", "1x1", "2x2"])
def test_zero_templates_equal_all_masked_templates(shape):
    got = {}
    for how in ("none", "masked"):
        if shape is None:
            f = _templates(_good(batch=2), how)
            pos = f["ref_pos"].clone().requires_grad_(True)
            got[how] = _outputs(_trunk(Boltz2Trunk), f | {"ref_pos": pos}, pos)
        else:
            got[how] = run_on_grid(_rank_templates, shape, how)[0]
    (out0, g0), (out1, g1) = got["none"], got["masked"]
    assert out0.keys() == out1.keys() == {"s_inputs", "s", "z", "pdistogram"}
    for k in out0:
        assert torch.equal(out0[k], out1[k]), f"{k}: T = 0 differs from all-masked templates"
    assert torch.equal(g0, g1), "ref_pos gradient: T = 0 differs from all-masked templates"
    if shape is not None:  # and the twin is the serial trunk (round-off gate)
        f = _templates(_good(batch=2), "none")
        pos = f["ref_pos"].clone().requires_grad_(True)
        ref, gref = _outputs(_trunk(Boltz2Trunk), f | {"ref_pos": pos}, pos)
        for k in ref:
            assert_parity(out0[k], ref[k], what=f"T = 0 trunk {k}", grid=grid_id(shape))
        assert_parity(g0, gref, what="T = 0 trunk ref_pos gradient", grid=grid_id(shape))


# -- synthetic_sharded: one generator, the production placement ---------------------------------

KW = dict(**SIZES, batch=2, seed=9)


def _rank_sharded(grid, src):
    serial, sharded = synthetic_sharded(grid, 7, src=src, **KW)
    held = serial is not None
    return held, collect(sharded), sharded.layout.n_tokens


@pytest.mark.parametrize(
    "shape,src", [((1, 1), None), ((2, 2), None), ((2, 2), 1), ((2, 3), None), ((2, 3), 5)], ids=str
)
def test_synthetic_sharded_round_trip(shape, src):
    want = synthetic_complex(7, **KW)
    for rank, (held, back, n) in enumerate(run_on_grid(_rank_sharded, shape, src)):
        assert held == (src is None or rank == src), f"rank {rank} holds the serial dict: {held}"
        assert n == 7 and back.keys() == want.keys(), sorted(set(back) ^ set(want))
        for k in want:
            assert back[k].dtype == want[k].dtype and torch.equal(back[k], want[k]), f"rank {rank}: {k}"
