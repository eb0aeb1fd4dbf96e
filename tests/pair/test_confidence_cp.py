"""The CP confidence module (``CPConfidenceModule``) against its serial reference
(``ConfidenceModule``; the comparison with boltz's own module is tests/interop/test_boltz_confidence.py).

- ``test_cp_confidence_matches_serial``: 1x1, 2x2, 2x3 with uneven N (11-13 tokens, 3-6 atoms per
  protein token, a ligand chain of one-atom tokens whose frames are recomputed from the
  coordinates, padding tokens in element 1), multiplicity 1 and 2, the released flags (separate
  heads, s_to_z product, z inputs) and the plain ones. Forward: the logits (pae, pde as sharded
  pair DTensors, plddt, resolved), pae, pde, plddt, and every derived figure (complex pLDDT /
  ipLDDT / PDE / iPDE, pTM, ipTM, ligand / protein ipTM, every per-chain-pair ipTM) identical
  on every rank; backward of a random projection of the logits: the gradients of ``s_inputs``,
  ``s``, ``z`` and every parameter by name. Sharding proven (each rank's pae tile is a strict
  part); the figures are non-vacuous (some ipTM and ligand ipTM > 0, a recomputed ligand frame
  valid).
- ``test_frame_atom_off_the_row_raises``: a frames_idx naming an atom of another grid row raises
  the same error on every rank.
"""

from __future__ import annotations

import pytest
import torch
from confidence_inputs import FIGURES, LOGITS, chain_pairs, confidence_case, confidence_config
from torch import nn

from twinshard.pair.atoms import atom_tile
from twinshard.pair.features import collect_grad, collect_tensor, distribute, real_part, shard_tensor
from twinshard.pair.layers.confidence import CPConfidenceModule
from twinshard.pair.layers.diffusion import sample_layout
from twinshard.pair.layout import with_layout
from twinshard.pair.reference.confidence import ConfidenceModule, frame_mask
from twinshard.pair.tiling import PAIR, SINGLE, from_local
from twinshard.testing import (
    TwinResult,
    assert_replicated,
    check_twin,
    grid_id,
    parameter_signature,
    random_grad_output,
    randomize_parameters,
    run_on_grid,
    serial_reference,
)

KINDS = {"s_inputs": "single", "s": "single", "z": "pair"}
DIFF = LOGITS + ("pae", "pde", "plddt")  # the outputs that carry gradients
# LayerNorm biases in front of a softmax (the Pairformer's pair-bias projections): exactly zero
ZERO = ("pairformer_stack.layers.0.attention.proj_z.0.bias",)


def _build(cls: type, flags: dict) -> nn.Module:
    m = cls(**confidence_config(**flags)).double()
    with torch.no_grad():
        randomize_parameters(m, seed=5, scale=0.3, shift=0.05)
    return m


def _case(c: dict) -> dict:
    return confidence_case(c["b"], c["n"], confidence_config(**c["flags"]), m=c["m"], seed=c["n"])


def _flat(out: dict, collect) -> tuple[torch.Tensor, torch.Tensor]:
    diff = torch.cat([collect(out[k]).reshape(-1) for k in DIFF])
    figs = torch.cat([out[k].reshape(-1) for k in FIGURES[3:]] + [chain_pairs(out).reshape(-1)])
    return diff, figs


def _rank(grid, c):
    return run_twin(grid, _build(CPConfidenceModule, c["flags"]), c)


def run_twin(grid, twin, c):
    """This rank's ``(TwinResult, derived figures)`` of ``twin`` on case ``c``."""
    case = _case(c)
    leaves = {k: case[k].clone().requires_grad_() for k in KINDS}
    fd = distribute(case["feats"] | {"pdist": case["pdist"]}, grid, kinds={"pdist": "pair"})
    x = {k: shard_tensor(leaves[k], KINDS[k], grid, fd.layout) for k in KINDS}
    lay_m = sample_layout(fd.layout, c["m"])
    xp = with_layout(
        from_local(atom_tile(case["x_pred"], "atom", lay_m, grid.coords[0]), grid.mesh, SINGLE), lay_m, "atom"
    )
    out = twin(x["s_inputs"], x["s"], x["z"], xp, fd, fd["pdist"], multiplicity=c["m"])
    diff, figs = _flat(out, collect_tensor)
    full = torch.cat([diff, figs.detach()])
    diff.backward(random_grad_output(diff, seed=8))
    shards = {"z": real_part(x["z"])} if grid.size > 1 else {}
    for k in ("pae_logits", "pde_logits", "pae", "pde"):  # kept sharded: a strict tile on every rank
        t = out[k]
        assert tuple(t.placements) == tuple(PAIR), (k, t.placements)
        assert grid.size == 1 or t.to_local().numel() * min(grid.rows, grid.cols) <= t.numel(), (k, t.shape)
    return TwinResult(
        out=full.detach(),
        grads_in={k: collect_grad(leaves[k].grad, KINDS[k], grid) for k in KINDS},
        param_grads={k: p.grad for k, p in twin.named_parameters() if p.requires_grad},
        shards=shards,
        params=parameter_signature(twin),
    ), figs


CASES = [
    ((1, 1), dict(b=2, n=11, m=1, flags={})),
    ((2, 2), dict(b=2, n=11, m=1, flags={})),
    ((2, 2), dict(b=1, n=11, m=2, flags={})),
    ((2, 3), dict(b=2, n=12, m=2, flags=dict(separate=False, prod=False, z_inputs=False))),
    ((2, 3), dict(b=1, n=13, m=1, flags={})),
]


@pytest.mark.parametrize(
    "grid,c", CASES, ids=[f"{grid_id(g)}-B{c['b']}-N{c['n']}-m{c['m']}" for g, c in CASES]
)
def test_cp_confidence_matches_serial(grid, c):
    got = run_on_grid(_rank, grid, c)
    ranks, figs = [g[0] for g in got], [g[1] for g in got]
    assert_replicated(figs, "confidence figures (complex_*, pTM family, pair_chains_iptm)")
    case = _case(c)
    serial = _build(ConfidenceModule, c["flags"])

    def run(**x):
        out = serial(
            x["s_inputs"], x["s"], x["z"], case["x_pred"], case["feats"], case["pdist"], multiplicity=c["m"]
        )
        run.out = out
        return _flat(out, lambda t: t)[0]

    ref = serial_reference(serial, run, {k: case[k] for k in KINDS}, grad_seed=8)
    ref["serial_out"] = torch.cat([ref["serial_out"], _flat(run.out, lambda t: t)[1].detach()])
    ref["serial_param_grads"] = {k: p.grad for k, p in serial.named_parameters() if p.requires_grad}
    out = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in run.out.items()}
    assert float(out["iptm"].max()) > 0 and float(out["ligand_iptm"].max()) > 0, "vacuous ipTM"
    check_twin(what=f"CPConfidenceModule {c}", grid=grid_id(grid), ranks=ranks, zero_grads=ZERO, **ref)


def test_ligand_frames_are_recomputed():
    """The synthetic ligand chain (>= 3 one-atom tokens) gets frames from the coordinates, some valid."""
    case = _case(dict(b=1, n=11, m=1, flags={}))
    f = case["feats"]
    lig = f["mol_type"][0] == 3
    assert int(lig.sum()) >= 3, "the case needs a ligand chain of >= 3 atoms"
    mask = frame_mask(case["x_pred"], f, 1)
    assert bool(mask[0, lig].any()), "no valid recomputed ligand frame: the recomputation is untested"


def _bad_frames(grid):
    case = _case(dict(b=1, n=10, m=1, flags={}))
    f = dict(case["feats"])
    fr = f["frames_idx"].clone()
    fr[0, 0, 2] = int(f["atom_pad_mask"][0].sum()) - 1  # token 0 (row block 0) names the last real atom
    f["frames_idx"] = fr
    twin = _build(CPConfidenceModule, {})
    fd = distribute(f | {"pdist": case["pdist"]}, grid, kinds={"pdist": "pair"})
    x = {k: shard_tensor(case[k], KINDS[k], grid, fd.layout) for k in KINDS}
    lay = sample_layout(fd.layout, 1)
    xp = with_layout(
        from_local(atom_tile(case["x_pred"], "atom", lay, grid.coords[0]), grid.mesh, SINGLE), lay, "atom"
    )
    try:
        twin(x["s_inputs"], x["s"], x["z"], xp, fd, fd["pdist"])
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def test_frame_atom_off_the_row_raises():
    errors = run_on_grid(_bad_frames, (2, 2))
    assert all(e is not None and "frames_idx" in e for e in errors), errors
