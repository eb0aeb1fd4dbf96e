"""The CP Boltz-2 model (``CPBoltz2Model``: trunk, diffusion conditioning, sampler, confidence)
against its serial reference (``Boltz2Model``), inference, fp64, in the main environment (the
comparison with boltz's own ``Boltz2.forward`` is tests/interop/test_boltz2_model.py).

- ``test_cp_model_matches_serial``: 1x1, 2x2, 2x3 and 3x3, uneven N (9, 11, 10, 13) and atom counts (2-6
  atoms per protein token, one-atom ligand tokens, Boltz's padding atoms), batch 1 and 2 (padding
  tokens in element 1), 1, 2 and 3 diffusion samples (3 in Boltz's chunks of ``max_parallel_samples``
  2), recycling 0 and 1, 3 sampling steps, both sides drawing with the counter-based source of one
  seed (``CounterDraws``): every output equal at round-off: ``sample_atom_coords``, ``pdistogram``,
  ``s``, ``z``, the confidence logits, ``plddt``, ``pae``, ``pde`` (collected) and every summary
  figure (complex pLDDT / ipLDDT / PDE / iPDE, pTM, ipTM, ligand / protein ipTM, per-chain-pair
  ipTM), the figures identical on every rank. Sharding active (a rank of a 2-row grid holds a
  strict part of the atoms; pair outputs are strict tiles); the samples differ from each other
  (so a sample-to-coordinate mispairing shows) and the ipTM is not vacuous.
- ``test_model_is_its_parts``: the serial model's forward equals its parts composed by hand, as
  ``Boltz2.forward`` composes them (a trunk loaded with the model's trunk weights; the relative
  position encoding computed again by ``rel_pos``; the conditioning, sampler and confidence called
  directly with sample j's coordinates for sample j), 3 samples, recycling 1: the wiring (what is
  passed where) checked in the main environment, without boltz.
- ``test_model_names_and_training_raise``: the model registers Boltz2's top-level modules in
  Boltz2's order (the structure modules after the Pairformer, the distogram after the structure
  module); the training forward raises; ranks asked for different sample counts raise the same
  error on every rank.
"""

from __future__ import annotations

import pytest
import torch
from confidence_inputs import FIGURES, chain_pairs
from model_inputs import model_config, model_features

from twinshard.pair.atoms import atom_parts
from twinshard.pair.features import collect_tensor, distribute
from twinshard.pair.layers.model import CPBoltz2Model
from twinshard.pair.reference.model import Boltz2Model
from twinshard.testing import assert_parity, assert_replicated, grid_id, randomize_parameters, run_on_grid

F64 = torch.float64
SEED = 99
STEPS = 3
GATHERED = (
    "sample_atom_coords",
    "pdistogram",
    "s",
    "z",
    "pae_logits",
    "pde_logits",
    "plddt_logits",
    "resolved_logits",
    "plddt",
    "pae",
    "pde",
)
SHARDED = ("z", "pae_logits", "pae")


def build(cls: type) -> torch.nn.Module:
    m = cls(model_config()).to(F64)
    randomize_parameters(m, seed=3, scale=0.3, shift=0.05)
    return m.eval()


def run(model, feats, c):
    with torch.no_grad():
        return model(
            feats,
            recycling_steps=c["recycling"],
            num_sampling_steps=STEPS,
            diffusion_samples=c["m"],
            max_parallel_samples=c.get("mps"),
            seed=SEED,
        )


def figures(out: dict) -> torch.Tensor:
    return torch.cat([out[k].reshape(-1) for k in FIGURES[3:]] + [chain_pairs(out).reshape(-1)])


def _rank(grid, c):
    model = build(CPBoltz2Model)
    fd = distribute(model_features(c["n"], c["b"], seed=c["n"]), grid)
    out = run(model, fd, c)
    full = {k: collect_tensor(out[k]) for k in GATHERED}
    strict = {}
    if grid.size > 1:
        for k in SHARDED:
            strict[k] = out[k].to_local().numel() < out[k].numel()
    parts = atom_parts(out["sample_atom_coords"]) if grid.rows > 1 else []
    return full, figures(out), strict, parts


CASES = [
    ((1, 1), dict(n=9, b=1, m=1, recycling=1)),
    ((2, 2), dict(n=11, b=1, m=3, mps=2, recycling=0)),
    ((2, 3), dict(n=10, b=2, m=1, recycling=1)),
    ((2, 3), dict(n=11, b=1, m=3, recycling=0)),
    ((3, 3), dict(n=13, b=1, m=2, recycling=0)),
]


@pytest.mark.parametrize(
    "grid,c", CASES, ids=[f"{grid_id(g)}-N{c['n']}-B{c['b']}-m{c['m']}-r{c['recycling']}" for g, c in CASES]
)
def test_cp_model_matches_serial(grid, c):
    serial = build(Boltz2Model)
    want = run(serial, model_features(c["n"], c["b"], seed=c["n"]), c)
    x = want["sample_atom_coords"]
    assert bool(torch.isfinite(x).all())
    if c["m"] > 1:  # the samples differ, and so do their confidences: a mispairing would show
        assert not torch.allclose(x[0], x[1]) and not torch.allclose(want["pae"][0], want["pae"][1])
    assert float(want["iptm"].max()) > 0, "vacuous ipTM"
    ranks = run_on_grid(_rank, grid, c)
    what = f"CPBoltz2Model {c}"
    for r, (full, figs, strict, parts) in enumerate(ranks):
        for k in GATHERED:
            assert_parity(full[k], want[k], what=f"{what} {k} rank {r}", grid=grid_id(grid))
        assert_parity(figs, figures(want), what=f"{what} figures rank {r}", grid=grid_id(grid))
        assert all(strict.values()), f"rank {r}: a pair output is not a strict tile: {strict}"
        for local, index in parts:
            assert local.shape[1] < x.shape[1], f"rank {r} holds every atom: sharding is not active"
            assert_parity(local.reshape(-1), x[index].reshape(-1), what=f"{what} coords shard rank {r}")
    assert_replicated([f for _, f, _, _ in ranks], "model confidence figures")


def test_model_is_its_parts():
    from twinshard.pair.reference.trunk import Boltz2Trunk, trunk_state_dict

    c = dict(n=10, b=1, m=3, recycling=1)
    model = build(Boltz2Model)
    feats = model_features(c["n"], c["b"], seed=4)
    got = run(model, feats, c)
    trunk = Boltz2Trunk(model.config).to(F64).eval()
    trunk.load_state_dict(trunk_state_dict(model.state_dict()), strict=True)
    with torch.no_grad():
        t = trunk(feats, c["recycling"])
        cond = model.diffusion_conditioning(t["s"], t["z"], model.rel_pos(feats), feats)
        keys = ("q", "c", "to_keys", "atom_enc_bias", "atom_dec_bias", "token_trans_bias")
        x = model.structure_module.sample(
            feats["atom_pad_mask"],
            STEPS,
            c["m"],
            None,
            None,
            seed=SEED,
            s_trunk=t["s"],
            s_inputs=t["s_inputs"],
            feats=feats,
            diffusion_conditioning=dict(zip(keys, cond)),
        )["sample_atom_coords"]
        conf = model.confidence_module(
            t["s_inputs"], t["s"], t["z"], x, feats, t["pdistogram"][:, :, :, 0], multiplicity=c["m"]
        )
    want = {"sample_atom_coords": x, "pdistogram": t["pdistogram"], "s": t["s"], "z": t["z"], **conf}
    for k in GATHERED:
        assert_parity(got[k], want[k], what=f"Boltz2Model {k} vs its parts composed by hand")
    assert_parity(figures(got), figures(want), what="Boltz2Model figures vs its parts composed by hand")


def _disagree(grid):
    model = build(CPBoltz2Model)
    fd = distribute(model_features(9, 1, seed=9), grid)
    try:
        run(model, fd, dict(recycling=0, m=1 + grid.rank % 2))
    except Exception as exc:  # the same error, on every rank
        return f"{type(exc).__name__}: {exc}"
    return None


def test_model_names_and_training_raise():
    model = build(Boltz2Model)
    tops = list(dict.fromkeys(n.split(".", 1)[0] for n, _ in model.named_parameters()))
    assert tops[-4:] == [
        "diffusion_conditioning",
        "structure_module",
        "distogram_module",
        "confidence_module",
    ]
    assert tops[tops.index("pairformer_module") + 1] == "diffusion_conditioning"
    assert [n for n, _ in build(CPBoltz2Model).named_parameters()] == [n for n, _ in model.named_parameters()]
    with pytest.raises(
        ValueError, match="coords"
    ):  # training mode is the training forward: it needs the targets
        model.train()(model_features(9), num_sampling_steps=STEPS)
    errors = run_on_grid(_disagree, (2, 2))
    assert all(e is not None and "diffusion_samples" in e for e in errors), errors
    assert len({e.split("rank")[0] for e in errors}) == 1, errors
