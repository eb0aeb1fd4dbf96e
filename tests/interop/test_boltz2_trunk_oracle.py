"""The whole-trunk oracle (``boltz2_model``): boltz's own ``Boltz2`` run to the distogram, fp64.

What each test proves:
- ``test_trunk_runs``: on the synthetic complex (templates T = 2 / 1 / 0, MSA depth 1 and 5,
  recycling 0 and 2, batch 1 and 2, with and without the template module) the trunk's outputs
  are finite fp64 of the right shapes, and a random grad_output reaches EVERY trainable trunk
  parameter with a finite non-zero gradient, except exactly the ones that must get an exact zero
  and do: the template module when no template is real (T = 0), ``cyclic_conditioning_init``
  when no token is cyclic, the ``s_norm`` / ``z_norm`` weights at recycling 0 (they normalise
  zeros).
- ``test_recycling_changes_output``: recycling 2 differs from 0 (by far more than round-off).
- ``test_oracle_is_boltz_own_path``: ``s_inputs`` equals ``model.input_embedder(feats)`` called
  directly, bit for bit, and the logits equal ``model.distogram_module(z)``; Boltz's evaluation
  path (eval mode, no gradients) gives the same s, z and logits at round-off.
- ``test_zero_templates_add_nothing``: T = 0 (Boltz's dummy template behind the scenes) gives
  bit-identical outputs to T = 2 templates whose masks are all zero.
- ``test_features_read_are_the_contract``: the features ``Boltz2.forward`` reads up to the
  distogram are exactly ``trunk_feature_names`` of its configuration (released flags, all atom
  flags on, v1 templates, no templates).

Each case builds a small model (token_s = token_z = 8, one block per stack) and takes well under
a second here.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("boltz", reason="the boltz package is not installed (see tests/interop/README.md)")

from boltz2_model import boltz2_trunk, boltz_float_is, build_boltz2, trunk_parameters  # noqa: E402

from twinshard.pair.feature_contract import check_features, trunk_feature_names  # noqa: E402
from twinshard.pair.synthetic import synthetic_complex  # noqa: E402
from twinshard.testing import assert_parity, random_grad_output  # noqa: E402

F64 = torch.float64
N = 10

CASES = {
    # id: (templates, msa_depth, recycling, batch, use_templates)
    "T2_S5_R2_B1": (2, 5, 2, 1, True),
    "T0_S1_R0_B2": (0, 1, 0, 2, True),
    "T1_S5_R0_B2_notpl": (1, 5, 0, 2, False),
    "T2_S1_R2_B2": (2, 1, 2, 2, True),
}


def _feats(t, s, b, seed=11):
    f = synthetic_complex(N, atoms_per_token=(2, 4), msa_depth=s, templates=t, chains=3, batch=b, seed=seed)
    check_features(f)
    return f


def _backward(out, params):
    outs = [out[k] for k in ("s", "z", "pdistogram", "s_inputs")]
    gos = [random_grad_output(o, seed=500 + k) for k, o in enumerate(outs)]
    grads = torch.autograd.grad(outs, list(params.values()), gos, allow_unused=True)
    return dict(zip(params, grads))


@pytest.mark.parametrize("case", sorted(CASES))
def test_trunk_runs(case):
    t, s, recycling, b, use_templates = CASES[case]
    model = build_boltz2(seed=1, use_templates=use_templates)
    f = _feats(t, s, b)
    check_features(f, need=trunk_feature_names(model))
    out = boltz2_trunk(model, f, recycling_steps=recycling)
    shapes = {"s": (b, N, 8), "z": (b, N, N, 8), "pdistogram": (b, N, N, 1, 8), "s_inputs": (b, N, 8)}
    for k, shape in shapes.items():
        assert out[k].dtype == F64 and tuple(out[k].shape) == shape, (k, out[k].dtype, out[k].shape)
        assert bool(torch.isfinite(out[k]).all()) and bool(out[k].abs().max() > 0), k
    params = trunk_parameters(model)
    grads = _backward(out, params)
    zero = set()
    if use_templates and not bool(f["template_mask"].any()):
        zero |= {n for n in params if n.startswith("template_module.")}
    if not bool((f["cyclic_period"] > 0).any()):
        zero.add("input_embedder.cyclic_conditioning_init.weight")
    if recycling == 0:
        zero |= {"s_norm.weight", "z_norm.weight"}
    for name, g in grads.items():
        assert g is not None, f"{case}: no gradient reaches {name}"
        assert bool(torch.isfinite(g).all()), f"{case}: non-finite gradient for {name}"
        if name in zero:
            assert not bool(g.any()), f"{case}: {name} should get an exact zero gradient"
        else:
            assert bool(g.abs().max() > 0), f"{case}: vacuous (zero) gradient for {name}"
    assert len(grads) - len(zero) > 100


def test_recycling_changes_output():
    model = build_boltz2(seed=2)
    f = _feats(2, 3, 1)
    r0 = boltz2_trunk(model, f, recycling_steps=0)
    r2 = boltz2_trunk(model, f, recycling_steps=2)
    for k in ("s", "z", "pdistogram"):
        diff = float((r0[k] - r2[k]).detach().abs().max())
        assert diff > 1e-3 * float(r0[k].detach().abs().max()), (k, diff)
    assert torch.equal(r0["s_inputs"], r2["s_inputs"])  # the embedding runs once, before recycling


def test_oracle_is_boltz_own_path():
    model = build_boltz2(seed=3)
    f = _feats(2, 5, 2)
    out = boltz2_trunk(model, f, recycling_steps=1)
    with boltz_float_is(F64):
        direct = model.input_embedder(f)
        logits = model.distogram_module(out["z"])
    assert torch.equal(out["s_inputs"], direct)
    assert torch.equal(out["pdistogram"], logits)
    ev = boltz2_trunk(model, f, recycling_steps=1, eval_mode=True)
    assert not ev["z"].requires_grad and out["z"].requires_grad
    for k in ("s", "z", "pdistogram", "s_inputs"):
        assert_parity(out[k].detach(), ev[k], what=f"Boltz2 trunk train-mode (dropout 0) vs eval path: {k}")


def test_zero_templates_add_nothing():
    model = build_boltz2(seed=4)
    f0 = _feats(0, 3, 2)
    tpl = synthetic_complex(N, atoms_per_token=(2, 4), msa_depth=3, templates=2, chains=3, batch=2, seed=12)
    f2 = {**f0, **{k: v for k, v in tpl.items() if k.startswith("template_") or k == "visibility_ids"}}
    assert f2["template_mask"].shape[1] == 2 and bool(f2["template_mask"].any())
    f2["template_mask"] = torch.zeros_like(f2["template_mask"])
    a, b = boltz2_trunk(model, f0, 1), boltz2_trunk(model, f2, 1)
    for k in a:
        assert torch.equal(a[k], b[k]), k


class _Reads(dict):
    def __init__(self, *args):
        super().__init__(*args)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


@pytest.mark.parametrize(
    "flags, use_templates",
    [
        ({}, True),
        ({"use_atom_backbone_feat": True, "use_residue_feats_atoms": True, "use_no_atom_char": True}, True),
        ({"use_templates_v2": False}, True),
        (
            {
                "cyclic_pos_enc": False,
                "bond_type_feature": False,
                "embedder_args": {"add_cyclic_flag": False},
            },
            False,
        ),
    ],
    ids=["released", "atom_flags", "templates_v1", "fewer_flags"],
)
def test_features_read_are_the_contract(flags, use_templates):
    model = build_boltz2(seed=5, flags=flags, use_templates=use_templates)
    feats = _Reads(_feats(1, 2, 1))
    boltz2_trunk(model, feats, recycling_steps=0)
    assert feats.read == set(trunk_feature_names(model)), (
        sorted(feats.read - set(trunk_feature_names(model))),
        sorted(set(trunk_feature_names(model)) - feats.read),
    )
