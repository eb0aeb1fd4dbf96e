"""Serial references of the pair initialisation against the ``boltz`` package's own modules (fp64).

What each test proves:
- ``test_relpos_vs_boltz``: ``RelativePositionEncoder`` equals Boltz-2's (``encodersv2``) forward
  and weight gradient with Boltz-2's r_max = 32, s_max = 2 and with r_max = 4, s_max = 1 (clipping
  at both ends), with ``fix_sym_check`` and ``cyclic_pos_enc`` (batch 1: Boltz broadcasts the
  ``[B, N]`` period against ``[B, N, N]``, which is defined for one sample only), on a complex with
  a homomer, a ligand whose tokens share a residue, a numbering gap and a cyclic chain.
- ``test_contact_conditioning_vs_boltz``: ``ContactConditioning`` (with its frozen Fourier
  embedding) equals Boltz-2's (``trunkv2``) forward, parameter gradients and the gradient of the
  threshold.
- ``test_pair_init_names_are_boltz2``: ``PairInit``'s ``state_dict`` keys are exactly ``Boltz2``'s
  keys of the same top-level modules, in Boltz2's order, and a Boltz2 slice loads strict.
- ``test_pair_init_vs_boltz2_forward``: ``PairInit`` equals the lines of ``Boltz2.forward`` that
  build ``s_init`` and ``z_init`` (written out below from Boltz2's own submodules), with and
  without ``bond_type_feature``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("boltz", reason="the boltz package is not installed (see tests/interop/README.md)")

from boltz.model.modules.encodersv2 import RelativePositionEncoder as BoltzRelPos  # noqa: E402
from boltz.model.modules.trunkv2 import ContactConditioning as BoltzContact  # noqa: E402
from boltz2_model import build_boltz2  # noqa: E402

from twinshard.pair.reference.pair_init import (  # noqa: E402
    ContactConditioning,
    PairInit,
    RelativePositionEncoder,
)
from twinshard.testing import assert_parity, randomize_parameters, synthetic  # noqa: E402
from twinshard.testing.pair_features import token_pair_features  # noqa: E402

F64 = torch.float64
CZ, CS = 6, 5


@pytest.fixture
def boltz_all_fp64(monkeypatch):
    """While open, ``Tensor.float()`` gives fp64 (Boltz casts one-hot integer and bool tensors to
    activations with ``.float()``; fp64 parameters need fp64 operands). Boltz runs inside only."""
    orig = torch.Tensor.float

    def to64(self, *args, **kwargs):
        return self if self.dtype == F64 else orig(self, *args, **kwargs).double()

    @contextlib.contextmanager
    def ctx():
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "float", to64)
            yield

    return ctx


def _load(ours, theirs, seed):
    theirs.double()
    randomize_parameters(theirs, seed=seed)
    ours.double()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]


def _compare_params(ours, theirs, what):
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
        if not q.requires_grad:
            assert p.grad is None and not p.requires_grad, f"{what}: {name} must stay frozen"
            continue
        assert_parity(p.grad, q.grad, what=f"{what} param grad {name}", grid="serial")


RELPOS = [
    dict(r_max=32, s_max=2, fix_sym_check=False, cyclic_pos_enc=False, b=2),
    dict(r_max=4, s_max=1, fix_sym_check=True, cyclic_pos_enc=False, b=2),
    dict(r_max=4, s_max=1, fix_sym_check=True, cyclic_pos_enc=True, b=1),
    dict(r_max=32, s_max=2, fix_sym_check=True, cyclic_pos_enc=True, b=1),
]


@pytest.mark.parametrize("cfg", RELPOS, ids=lambda c: "-".join(f"{k}{int(v)}" for k, v in c.items()))
def test_relpos_vs_boltz(cfg, boltz_all_fp64):
    cfg = dict(cfg)
    b = cfg.pop("b")
    theirs, ours = BoltzRelPos(CZ, **cfg), RelativePositionEncoder(CZ, **cfg)
    _load(ours, theirs, seed=3)
    feats = token_pair_features(b, 11, seed=5)
    g = synthetic(b, 11, 11, CZ, seed=6)
    with boltz_all_fp64():
        ref = theirs(feats)
    ref.backward(g)
    out = ours(feats)
    out.backward(g)
    what = f"relpos {cfg}"
    assert_parity(out, ref, what=f"{what} output", grid="serial")
    _compare_params(ours, theirs, what)
    # the features are not vacuous: several distinct relative positions, chains and entities
    x = ours.encode(feats, feats, cfg["cyclic_pos_enc"])
    assert int((x.sum((0, 1, 2)) > 0).sum()) >= 8


def test_contact_conditioning_vs_boltz(boltz_all_fp64):
    theirs, ours = BoltzContact(CZ, 4.0, 20.0), ContactConditioning(CZ, 4.0, 20.0)
    _load(ours, theirs, seed=7)
    assert not ours.fourier_embedding.proj.weight.requires_grad
    f = token_pair_features(2, 9, seed=8)
    thr = f["contact_threshold"]
    t1, t2 = thr.clone().requires_grad_(True), thr.clone().requires_grad_(True)
    g = synthetic(2, 9, 9, CZ, seed=9)
    with boltz_all_fp64():
        ref = theirs({"contact_conditioning": f["contact_conditioning"], "contact_threshold": t1})
    ref.backward(g)
    out = ours({"contact_conditioning": f["contact_conditioning"], "contact_threshold": t2})
    out.backward(g)
    assert_parity(out, ref, what="contact conditioning output", grid="serial")
    assert_parity(t2.grad, t1.grad, what="contact conditioning d/dthreshold", grid="serial")
    _compare_params(ours, theirs, "contact conditioning")


def _boltz2(bond_type_feature: bool):
    """A small Boltz2 built offline (the trunk oracle's builder), parameters randomised, fp64."""
    return build_boltz2(
        seed=11, token_s=CS, token_z=CZ, pairformer_heads=1, flags={"bond_type_feature": bond_type_feature}
    )


@pytest.mark.parametrize("bond_type_feature", [True, False])
def test_pair_init_names_are_boltz2(bond_type_feature):
    model = _boltz2(bond_type_feature)
    ours = PairInit(CS, CZ, bond_type_feature=bond_type_feature, fix_sym_check=True, cyclic_pos_enc=True)
    tops = [k for k in dict(model.named_children()) if hasattr(ours, k)]
    theirs = [k for k in model.state_dict() if k.split(".")[0] in tops]
    assert list(ours.state_dict()) == theirs
    ours.load_state_dict({k: model.state_dict()[k] for k in theirs}, strict=True)
    assert tops == [
        "s_init",
        "z_init_1",
        "z_init_2",
        "rel_pos",
        "token_bonds",
        *(["token_bonds_type"] if bond_type_feature else []),
        "contact_conditioning",
    ]


@pytest.mark.parametrize("bond_type_feature", [True, False])
def test_pair_init_vs_boltz2_forward(bond_type_feature, boltz_all_fp64):
    model = _boltz2(bond_type_feature)
    ours = PairInit(CS, CZ, bond_type_feature=bond_type_feature, fix_sym_check=True, cyclic_pos_enc=True)
    ours.double()
    ours.load_state_dict({k: v for k, v in model.state_dict().items() if k in ours.state_dict()}, strict=True)
    feats = token_pair_features(1, 10, seed=12)
    s_in = synthetic(1, 10, CS, seed=13)
    s1, s2 = s_in.clone().requires_grad_(True), s_in.clone().requires_grad_(True)
    with boltz_all_fp64():  # Boltz2.forward's lines, with Boltz2's own submodules
        s_ref = model.s_init(s1)
        z_ref = model.z_init_1(s1)[:, :, None] + model.z_init_2(s1)[:, None, :]
        z_ref = z_ref + model.rel_pos(feats)
        z_ref = z_ref + model.token_bonds(feats["token_bonds"].float())
        if model.bond_type_feature:
            z_ref = z_ref + model.token_bonds_type(feats["type_bonds"].long())
        z_ref = z_ref + model.contact_conditioning(feats)
    gs, gz = synthetic(*s_ref.shape, seed=14), synthetic(*z_ref.shape, seed=15)
    torch.autograd.backward([s_ref, z_ref], [gs, gz])
    s_out, z_out = ours(s2, feats)
    torch.autograd.backward([s_out, z_out], [gs, gz])
    what = f"pair init (bond types {bond_type_feature})"
    assert_parity(s_out, s_ref, what=f"{what} s_init", grid="serial")
    assert_parity(z_out, z_ref, what=f"{what} z_init", grid="serial")
    assert_parity(s2.grad, s1.grad, what=f"{what} d/ds_inputs", grid="serial")
    theirs = dict(model.named_parameters())
    for name, p in ours.named_parameters():
        if p.requires_grad:
            assert_parity(p.grad, theirs[name].grad, what=f"{what} param grad {name}", grid="serial")


# -- the template module ---------------------------------------------------------------------------

TKW = dict(template_blocks=1, dropout=0.0, pairwise_head_width=2, pairwise_num_heads=2)


def _template_case(version: int, t: int, b: int = 2, n: int = 9):
    from boltz.model.modules.trunkv2 import TemplateModule as BoltzV1
    from boltz.model.modules.trunkv2 import TemplateV2Module as BoltzV2

    from twinshard.pair.reference.template import TemplateModule, TemplateV2Module
    from twinshard.testing import random_mask
    from twinshard.testing.pair_features import template_features

    theirs = (BoltzV2 if version == 2 else BoltzV1)(CZ, 5, **TKW)
    ours = (TemplateV2Module if version == 2 else TemplateModule)(CZ, 5, **TKW)
    _load(ours, theirs, seed=40 + version)
    theirs.eval()
    ours.eval()
    feats = template_features(b, t, n, seed=41)
    feats["asym_id"] = token_pair_features(b, n, seed=41)["asym_id"]
    pm = random_mask(b, n, n, seed=42, keep=0.85)
    pm[:, torch.arange(n), torch.arange(n)] = 1
    return ours, theirs, feats, pm, synthetic(b, n, n, CZ, seed=43)


@pytest.mark.parametrize("version", [2, 1])
def test_template_vs_boltz(version, boltz_all_fp64):
    """TemplateV2Module / TemplateModule equal Boltz-2's: output, d/dz, every parameter gradient,
    with three templates (the last padded), the distogram range covered and random frames."""
    ours, theirs, feats, pm, z = _template_case(version, 3)
    z1, z2 = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    g = synthetic(*z.shape, seed=44)
    with boltz_all_fp64():
        ref = theirs(z1, feats, pm)
    ref.backward(g)
    out = ours(z2, feats, pm)
    out.backward(g)
    what = f"template v{version}"
    assert_parity(out, ref, what=f"{what} output", grid="serial")
    assert_parity(z2.grad, z1.grad, what=f"{what} d/dz", grid="serial")
    _compare_params(ours, theirs, what)
    a = ours.pair_features(feats, feats, z.shape[1])
    assert int((a[..., : ours.num_bins].sum((0, 1, 2, 3)) > 0).sum()) >= 5, "too few distance bins hit"


def test_template_no_templates_is_zero(boltz_all_fp64):
    """Boltz's featuriser gives one all-masked dummy template when there are none: Boltz's output
    is then exactly zero, and ours for that input and for T = 0 is the same zero."""
    ours, theirs, feats, pm, z = _template_case(2, 1)
    feats["template_mask"] = torch.zeros_like(feats["template_mask"])
    with boltz_all_fp64():
        ref = theirs(z, feats, pm)
    assert not bool(ref.any())
    assert torch.equal(ours(z, feats, pm), ref)
    _, _, feats0, pm0, _ = _template_case(2, 0)
    assert torch.equal(ours(z, feats0, pm0), ref)
