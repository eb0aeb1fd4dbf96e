"""The serial confidence losses (``twinshard.pair.reference.confidence_loss``) against boltz's own
``boltz.model.loss.confidencev2`` (boltz 2.2.1), fp64 (Boltz's ``.float()`` casts kept fp64).

- ``test_confidence_loss_matches_boltz``: ``confidence_loss`` and each part (pLDDT, PDE, resolved,
  PAE) on random logits, true coordinates with unresolved atoms (a ligand chain of >= 3 atoms
  whose frames are recomputed from the true and the predicted coordinates, one of 4 unresolved
  in the N = 20 case), a chain relabelled RNA (the 30 A lDDT cut-off), padding tokens in element
  1; B = 2, m = 1 and B = 1, m = 3 (boltz's training step has B = 1; its frame recomputation
  indexes the resolved mask by the batch element, the same then), alpha_pae 0 and 1. Values and
  the gradient of every logits tensor under a random projection of the losses.
- ``test_targets_match_boltz``: the targets and masks themselves (lDDT, PDE, PAE) equal boltz's,
  and the cases are not vacuous (nucleotide cut-off decisive, a recomputed ligand frame valid,
  unresolved atoms masked).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("boltz", reason="the boltz package is not installed (see tests/interop/README.md)")

from boltz.model.loss import confidencev2 as bc  # noqa: E402

from twinshard.pair.reference import confidence_loss as ours  # noqa: E402
from twinshard.testing import assert_parity, random_grad_output  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "pair"))
from boltz2_model import boltz_float_is  # noqa: E402
from confidence_loss_inputs import LOGIT_KEYS, flat_losses, loss_case  # noqa: E402

F64 = torch.float64


@contextlib.contextmanager
def boltz64():
    """Boltz's ``.float()`` casts keep fp64, and its ``torch.eye`` (the lDDT pair mask) is fp64."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        with boltz_float_is(F64):
            yield
    finally:
        torch.set_default_dtype(before)


CASES = [
    dict(b=2, n=11, m=1, alpha=1.0, seed=11),
    dict(b=1, n=11, m=3, alpha=0.0, seed=12),
    dict(b=1, n=20, m=3, alpha=1.0, seed=13),
    dict(b=2, n=12, m=1, alpha=0.0, seed=14),
]


def _run(fn, case, alpha, ctx):
    logits = {k: v.clone().requires_grad_() for k, v in case["logits"].items()}
    out_in = dict(logits, sample_atom_coords=case["x_pred"])
    with ctx:
        out = fn(
            out_in,
            dict(case["feats"]),
            case["true_coords"],
            case["true_mask"],
            token_level_confidence=True,
            multiplicity=case["m"],
            alpha_pae=alpha,
        )
    flat = flat_losses(out)
    flat.backward(random_grad_output(flat, seed=3))
    return flat.detach(), {k: logits[k].grad for k in LOGIT_KEYS if logits[k].grad is not None}


@pytest.mark.parametrize("c", CASES, ids=[f"B{c['b']}-N{c['n']}-m{c['m']}-pae{c['alpha']}" for c in CASES])
def test_confidence_loss_matches_boltz(c):
    case = loss_case(c["b"], c["n"], c["m"], seed=c["seed"])
    got, got_g = _run(ours.confidence_loss, case, c["alpha"], contextlib.nullcontext())
    want, want_g = _run(bc.confidence_loss, case, c["alpha"], boltz64())
    assert_parity(got, want, what=f"confidence_loss [loss, plddt, pde, resolved, pae] {c}")
    assert set(got_g) == set(want_g), (sorted(got_g), sorted(want_g))
    if c["alpha"] == 0:
        assert "pae_logits" not in got_g
    for k in want_g:
        assert float(want_g[k].abs().max()) > 0, f"vacuous gradient of {k}"
        assert_parity(got_g[k], want_g[k], what=f"d loss / d {k} {c}")


@pytest.mark.parametrize("c", CASES[1:3], ids=["N11-m3", "N20-m3"])
def test_targets_match_boltz(c):
    case = loss_case(c["b"], c["n"], c["m"], seed=c["seed"])
    f, x, t, r, m = case["feats"], case["x_pred"], case["true_coords"], case["true_mask"], case["m"]
    with boltz64():
        want_l = bc.get_target_lddt(x, dict(f), t, r, token_level_confidence=True, multiplicity=m)
        want_pde = bc.get_target_pde(x, dict(f), t, r, multiplicity=m)
        want_pae = bc.get_target_pae(x, dict(f), t, r, multiplicity=m)
    got_l = ours.get_target_lddt(x, f, t, r, True, m)
    got_pde = ours.get_target_pde(x, f, t, r, m)
    got_pae = ours.get_target_pae(x, f, t, r, m)
    for name, a, w in zip(("lddt", "no_match", "atom_mask"), got_l, want_l):
        assert_parity(a, w.reshape(a.shape).to(F64), what=f"lDDT target {name}")
    assert_parity(got_pde[0], want_pde[0], what="PDE target")
    assert torch.equal(got_pde[1], want_pde[1].to(F64)), "PDE mask"
    bm, n = x.shape[0], f["token_pad_mask"].shape[1]
    assert_parity(got_pae[0], want_pae[0].reshape(bm, n, n), what="PAE target")
    assert torch.equal(got_pae[1], want_pae[1].reshape(bm, n, n).to(F64)), "PAE mask"
    # not vacuous: the PAE mask keeps a ligand row with a recomputed frame; unresolved atoms drop
    lig = (f["mol_type"] == 3).repeat_interleave(m, 0)
    assert bool((got_pae[1].sum(-1)[lig] > 0).any()), "no valid recomputed ligand frame"
    assert bool((got_l[2] == 0).any() & (f["token_pad_mask"] > 0).any()), "no unresolved representative atom"
    # the 30 A nucleotide cut-off decides some pair: the 15 A one everywhere gives another target
    f15 = dict(f, mol_type=torch.where(f["mol_type"] == 2, 0, f["mol_type"]))
    assert not torch.equal(ours.get_target_lddt(x, f15, t, r, True, m)[0], got_l[0]), (
        "nucleotide cut-off idle"
    )
