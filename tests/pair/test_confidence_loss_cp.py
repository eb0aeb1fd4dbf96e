"""The CP confidence losses (``twinshard.pair.layers.confidence_loss``) against the serial reference
(``twinshard.pair.reference.confidence_loss``; the comparison with boltz's own losses is
tests/interop/test_boltz_confidence_loss.py).

- ``test_cp_confidence_loss_matches_serial``: 1x1, 2x2, 2x3, 3x2 and one 3x3; uneven N (11-13, 20)
  and A (3-6 atoms per protein token), padding tokens in element 1, a ligand chain of 3 atoms (its
  recomputed frame valid) or 4 (one unresolved), a chain relabelled RNA (30 A cut-off),
  multiplicity 1 and 3, alpha_pae 0 and 1. Forward: [loss, plddt, pde, resolved, pae], identical
  bits on every rank; backward of a random projection: the gradient of every logits tensor
  (collected with ``collect_grad``); each rank's pair logits a strict tile. The true structure
  comes the training step's way: ``coords`` distributed as an atom feature, ``cp_true_coordinates``.
- ``test_bad_r_set_raises_on_every_rank``: an R set with two rows on one token, and one off the
  centre atom, raise the same error on every rank (``distribute``).
"""

from __future__ import annotations

import pytest
import torch
from confidence_loss_inputs import LOGIT_KEYS, flat_losses, loss_case

from twinshard.pair.atoms import atom_tile
from twinshard.pair.features import collect_grad, distribute, real_part, shard_tensor
from twinshard.pair.layers.confidence_loss import confidence_loss as cp_loss
from twinshard.pair.layers.confidence_loss import cp_true_coordinates
from twinshard.pair.layers.diffusion import sample_layout
from twinshard.pair.layout import with_layout
from twinshard.pair.reference.confidence_loss import confidence_loss as ref_loss
from twinshard.pair.tiling import SINGLE, from_local
from twinshard.testing import (
    TwinResult,
    assert_replicated,
    check_twin,
    grid_id,
    random_grad_output,
    run_on_grid,
    serial_reference,
)

KIND = {"plddt_logits": "single", "resolved_logits": "single", "pde_logits": "pair", "pae_logits": "pair"}
FEATS = (
    "token_to_rep_atom", "r_set_to_rep_atom", "atom_to_token", "atom_pad_mask", "mol_type", "asym_id",
    "token_pad_mask", "frames_idx", "frame_resolved_mask", "atom_resolved_mask", "token_to_center_atom",
)  # fmt: skip


def _case(c: dict) -> dict:
    return loss_case(c["b"], c["n"], c["m"], seed=c["seed"])


def atom_dtensor(x: torch.Tensor, lay, grid):
    """A ``[B m, A, ...]`` serial atom tensor as its kind-``atom`` DTensor on ``lay``."""
    return with_layout(from_local(atom_tile(x, "atom", lay, grid.coords[0]), grid.mesh, SINGLE), lay, "atom")


def _rank(grid, c):
    case = _case(c)
    m = c["m"]
    # the true structure as the training step places it: coords [B, A, 3] (K squeezed) distributed
    # as an atom feature, then cp_true_coordinates repeats each element m times
    coords = case["true_coords"][::m]
    fd = distribute({k: case["feats"][k] for k in FEATS} | {"coords": coords}, grid, kinds={"coords": "atom"})
    lay = sample_layout(fd.layout, m)
    true, true_mask = cp_true_coordinates(fd["coords"], fd["atom_resolved_mask"], m)
    leaves = {k: v.clone().requires_grad_() for k, v in case["logits"].items()}
    logits = {k: shard_tensor(leaves[k], KIND[k], grid, fd.layout) for k in LOGIT_KEYS}
    out_in = dict(logits, sample_atom_coords=atom_dtensor(case["x_pred"], lay, grid))
    out = cp_loss(
        out_in,
        fd,
        true,
        true_mask,
        multiplicity=m,
        alpha_pae=c["alpha"],
    )
    flat = flat_losses(out)
    flat.backward(random_grad_output(flat, seed=4))
    used = [k for k in LOGIT_KEYS if leaves[k].grad is not None]
    shards = (
        {k: real_part(logits[k]) for k in ("pde_logits", "pae_logits") if k in used} if grid.size > 1 else {}
    )
    assert torch.equal(true.to_local(), atom_dtensor(case["true_coords"], lay, grid).to_local())
    return TwinResult(
        out=flat.detach(),
        grads_in={k: collect_grad(leaves[k].grad, KIND[k], grid) for k in used},
        shards=shards,
    )


CASES = [
    ((1, 1), dict(b=2, n=11, m=1, alpha=1.0, seed=11)),
    ((2, 2), dict(b=2, n=11, m=1, alpha=1.0, seed=11)),
    ((2, 2), dict(b=1, n=20, m=3, alpha=1.0, seed=13)),
    ((2, 3), dict(b=2, n=13, m=1, alpha=0.0, seed=15)),
    ((3, 2), dict(b=1, n=12, m=3, alpha=1.0, seed=12)),
    ((3, 3), dict(b=2, n=11, m=1, alpha=1.0, seed=16)),
]


@pytest.mark.parametrize(
    "grid,c", CASES, ids=[f"{grid_id(g)}-B{c['b']}-N{c['n']}-m{c['m']}-pae{c['alpha']}" for g, c in CASES]
)
def test_cp_confidence_loss_matches_serial(grid, c):
    ranks = run_on_grid(_rank, grid, c)
    assert_replicated([r.out for r in ranks], "confidence losses")
    case = _case(c)
    used = [k for k in LOGIT_KEYS if c["alpha"] > 0 or k != "pae_logits"]

    def run(**lg):
        out = ref_loss(
            dict(lg, sample_atom_coords=case["x_pred"]),
            case["feats"],
            case["true_coords"],
            case["true_mask"],
            multiplicity=c["m"],
            alpha_pae=c["alpha"],
        )
        return flat_losses(out)

    ref = serial_reference(None, run, {k: case["logits"][k] for k in used}, grad_seed=4)
    ref["serial_grads_in"] = {k: g for k, g in ref["serial_grads_in"].items() if g is not None}
    ref["serial_inputs"] = {k: v for k, v in ref["serial_inputs"].items() if k in ref["serial_grads_in"]}
    check_twin(what=f"CP confidence_loss {c}", grid=grid_id(grid), ranks=ranks, **ref)


def _bad(grid, which):
    case = _case(dict(b=1, n=11, m=1, seed=11))
    f = {k: case["feats"][k] for k in FEATS}
    r = f["r_set_to_rep_atom"].clone()
    if which == "twice":
        r[0, 1] = r[0, 0]
    else:
        a = int(r[0, 0].argmax())
        r[0, 0, a], r[0, 0, a + 1] = 0, 1
    f["r_set_to_rep_atom"] = r
    try:
        distribute(f, grid)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.parametrize("which", ["twice", "off_centre"])
def test_bad_r_set_raises_on_every_rank(which):
    errors = run_on_grid(_bad, (2, 2), which)
    assert all(e is not None and "r_set_to_rep_atom" in e for e in errors), errors
    assert len(set(errors)) == 1, errors
