"""The diffusion loss against the ``boltz`` package's own (Boltz-2, boltz 2.2.1), fp64.

Boltz's ``AtomDiffusion.compute_loss`` casts with ``.float()``; it runs inside
``boltz_float_is(torch.float64)`` (``.float()`` keeps fp64). Its alignment SVD runs in fp32, ours
too (``align_svd_dtype``, the default). Inputs (``tests/pair/structure_loss_inputs.py``): B = 2,
N = 10 tokens of 1-4 atoms with protein, DNA, RNA and ligand tokens, a padding token, Boltz's
padding atoms (noisy denoised coordinates there), unresolved atoms, true coordinates with pairs
below 15 A, between 15 and 30 A and beyond.

What each test proves:
- ``test_compute_loss_vs_boltz``: ``AtomDiffusion.compute_loss`` equals Boltz's in the loss, both
  parts (``mse_loss``, ``smooth_lddt_loss``) and the gradient w.r.t. the denoised coordinates, at
  multiplicity 1 and 3, with the smooth lDDT on and off, with the pLDDT filter, and with true
  coordinates on an integer lattice (pairs exactly at 15 A and 30 A: the strict ``<``).
- ``test_parts_vs_boltz``: ``weighted_rigid_align`` (Boltz's weights and mask) and
  ``smooth_lddt_loss`` (value and gradient) equal Boltz's functions.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("boltz", reason="the boltz package is not installed (see tests/interop/README.md)")

from boltz.model.loss.diffusionv2 import smooth_lddt_loss as boltz_smooth_lddt  # noqa: E402
from boltz.model.loss.diffusionv2 import weighted_rigid_align as boltz_align  # noqa: E402
from boltz.model.modules.diffusionv2 import AtomDiffusion as BoltzAtomDiffusion  # noqa: E402

from twinshard.pair.reference.sampler import AtomDiffusion, weighted_rigid_align  # noqa: E402
from twinshard.pair.reference.structure_loss import smooth_lddt_loss  # noqa: E402
from twinshard.testing import assert_parity  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "pair"))
from boltz2_model import boltz_float_is  # noqa: E402
from diffusion_inputs import conditioning_config, module_config  # noqa: E402
from structure_loss_inputs import exact_cutoff_pairs, loss_case  # noqa: E402

F64 = torch.float64


def _modules():
    cfg = module_config(conditioning_config(8, 32))
    theirs = BoltzAtomDiffusion(cfg).double()
    ours = AtomDiffusion(cfg).double()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs, ours


def _run(module, case, boltz: bool, **kw):
    den = case["out"]["denoised_atom_coords"].clone().requires_grad_()
    out = dict(case["out"], denoised_atom_coords=den)
    feats = dict(case["feats"], coords=case["coords"])
    if boltz:
        with boltz_float_is(F64):
            got = module.compute_loss(feats, out, **kw)
    else:
        got = module.compute_loss(feats, out, **kw)
    got["loss"].backward()
    parts = got["loss_breakdown"]
    return got["loss"].detach(), parts["mse_loss"].detach(), parts["smooth_lddt_loss"].detach(), den.grad


CASES = [
    dict(m=1, seed=1, kw={}),
    dict(m=3, seed=2, kw={}),
    dict(m=3, seed=3, kw=dict(add_smooth_lddt_loss=False)),
    dict(m=1, seed=4, kw=dict(filter_by_plddt=0.3, nucleotide_loss_weight=2.0, ligand_loss_weight=7.0)),
    dict(m=3, seed=5, kw={}, lattice=True),
]


@pytest.mark.parametrize(
    "c", CASES, ids=[f"m{c['m']}-s{c['seed']}{'-lattice' if c.get('lattice') else ''}" for c in CASES]
)
def test_compute_loss_vs_boltz(c):
    case = loss_case(2, 10, c["m"], seed=c["seed"], lattice=c.get("lattice", False))
    if c.get("lattice"):
        assert exact_cutoff_pairs(case, 15.0) > 0 and exact_cutoff_pairs(case, 30.0) > 0, (
            "no pair at a cutoff"
        )
    theirs, ours = _modules()
    kw = dict(c["kw"], multiplicity=c["m"])
    want = _run(theirs, case, True, **kw)
    got = _run(ours, case, False, **kw)
    what = f"compute_loss vs boltz ({c})"
    assert got[0].dtype == F64 and want[0].dtype == F64
    for name, g, w in zip(("loss", "mse_loss", "smooth_lddt_loss", "d loss / d denoised"), got, want):
        if name == "smooth_lddt_loss" and not kw.get("add_smooth_lddt_loss", True):
            assert float(g) == 0.0 and float(w) == 0.0
            continue
        assert_parity(g.to(F64), w.to(F64), what=f"{what}: {name}")
    assert float(got[3].abs().max()) > 0, "vacuous gradient"


def test_parts_vs_boltz():
    m = 3
    case = loss_case(2, 10, m, seed=9)
    f = case["feats"]
    weights = torch.rand(2 * m, f["atom_pad_mask"].shape[1], dtype=F64) * 10 + 1
    mask = f["atom_resolved_mask"].repeat_interleave(m, 0)
    true, den = case["out"]["aligned_true_atom_coords"], case["out"]["denoised_atom_coords"]
    with boltz_float_is(F64):
        want = boltz_align(true, den, weights, mask)
    got = weighted_rigid_align(true, den, weights, mask)
    assert_parity(got, want, what="weighted_rigid_align vs boltz (m=3, random weights, unresolved atoms)")

    nuc = (torch.rand(2, f["atom_pad_mask"].shape[1]) > 0.5).to(F64)
    grads = []
    for fn in (boltz_smooth_lddt, smooth_lddt_loss):
        x = den.clone().requires_grad_()
        val = fn(x, case["coords"], nuc, coords_mask=f["atom_resolved_mask"], multiplicity=m)
        val.backward()
        grads.append((val.detach(), x.grad))
    assert_parity(grads[1][0], grads[0][0], what="smooth_lddt_loss vs boltz (m=3)")
    assert_parity(grads[1][1], grads[0][1], what="d smooth_lddt_loss / d pred vs boltz (m=3)")
