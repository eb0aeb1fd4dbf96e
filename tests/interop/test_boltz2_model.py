"""The whole Boltz-2 inference forward, serial (``Boltz2Model``) and CP (``cp_model_of``), against
the ``boltz`` package's own ``Boltz2.forward`` in evaluation mode (boltz 2.2.1), fp64, the same
random draws.

The oracle is ``Boltz2.forward`` itself with ``model.eval()`` (its own path: the trunk, the
diffusion conditioning and the sampler under its ``set_grad_enabled(False)``, the confidence module
on the detached outputs), on a random-weight model built offline (``build_boltz2`` with the
confidence module: the released flags, every parameter randomised, 64 distogram bins) and the
synthetic complex with ``frames_idx``. Boltz's ``.float()`` casts keep fp64 (``boltz_float_is``);
while its sampler runs, ``torch.randn`` hands out seeded draws in Boltz's order and the default dtype
is fp64 (``test_boltz_sampler.boltz_randn_from``, this process only); our side takes the same draws
(``GivenDraws``). Sampler parameters: ``boltz predict``'s Boltz-2 ones (alignment on) with
``sigma_max`` 0.5, so the random-weight samples stay a few angstrom across and the confidence's
distance bins differ between samples. Batch 1 (Boltz's sampler draws ``[m, ...]``), no padding
tokens: every entry of every output is compared.

- ``test_serial_model_vs_boltz2``: the whole ``state_dict`` loads strict into ``Boltz2Model`` (the
  same parameter names in the same order); ``sample_atom_coords``, ``pdistogram``, ``s``, ``z``, the
  four confidence logits, ``plddt``, ``pae``, ``pde``, complex pLDDT / ipLDDT / PDE / iPDE, pTM,
  ipTM, ligand / protein ipTM and every per-chain-pair ipTM at round-off; 1 and 3 samples (3 in
  Boltz's chunks of ``max_parallel_samples`` 2), recycling 0 and 1, 3 sampling steps.
- ``test_cp_model_vs_boltz2``: ``cp_model_of(model)`` (the whole ``state_dict`` strict) on 1x1, 2x2,
  2x3 and 3x3, uneven N and A, 1, 2 and 3 samples, recycling 0 and 1: the same outputs, collected.
- ``test_cp_model_of_refuses_what_it_lacks``: affinity and B-factor heads raise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("boltz", reason="the boltz package is not installed (see tests/interop/README.md)")

from boltz2_model import boltz_float_is, build_boltz2  # noqa: E402
from test_boltz_sampler import boltz_randn_from, torch_draws  # noqa: E402

from twinshard.pair.features import collect_tensor, distribute  # noqa: E402
from twinshard.pair.interop.boltz import cp_model_of, cp_twin_of  # noqa: E402
from twinshard.pair.reference.model import Boltz2Model, ModelConfig  # noqa: E402
from twinshard.pair.reference.sampler import BOLTZ2_DIFFUSION_PARAMS, GivenDraws  # noqa: E402
from twinshard.testing import assert_parity, assert_replicated, grid_id, run_on_grid  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "pair"))
from confidence_inputs import FIGURES, chain_pairs  # noqa: E402
from model_inputs import confidence_model_args, model_features  # noqa: E402

F64 = torch.float64
STEPS = 3
OUTPUTS = (
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


def boltz_model(seed: int) -> torch.nn.Module:
    return build_boltz2(
        seed=seed,
        num_bins=64,
        confidence_model_args=confidence_model_args(),
        diffusion_process_args=dict(BOLTZ2_DIFFUSION_PARAMS, sigma_max=0.5),
    )


def features(c: dict) -> dict:
    return model_features(c["n"], 1, seed=c["n"], msa=3, templates=1, window=32)


def boltz_forward(model, feats: dict, c: dict) -> dict:
    """``Boltz2.forward`` itself, evaluation mode, fp64, with :func:`torch_draws` for its sampler."""
    sampler = model.structure_module
    plain = sampler.sample

    def sample(*args, **kwargs):
        with boltz_randn_from(torch_draws) as calls:
            out = plain(*args, **kwargs)
        assert len(calls) == 1 + 3 * STEPS, f"Boltz drew {len(calls)} times: {calls}"
        return out

    sampler.sample = sample  # this instance only, for this call
    model.eval()
    try:
        with torch.no_grad(), boltz_float_is(F64):
            return model(
                feats,
                recycling_steps=c["recycling"],
                num_sampling_steps=STEPS,
                diffusion_samples=c["m"],
                max_parallel_samples=c.get("mps"),
            )
    finally:
        del sampler.sample


def ours_forward(model, feats, c: dict) -> dict:
    with torch.no_grad():
        return model.eval()(
            feats,
            recycling_steps=c["recycling"],
            num_sampling_steps=STEPS,
            diffusion_samples=c["m"],
            max_parallel_samples=c.get("mps"),
            draws=GivenDraws(torch_draws),
        )


def figures(out: dict) -> torch.Tensor:
    return torch.cat([out[k].reshape(-1) for k in FIGURES[3:]] + [chain_pairs(out).reshape(-1)])


def compare(got: dict, figs: torch.Tensor, want: dict, what: str, grid: str = "-") -> None:
    for k in OUTPUTS:
        assert got[k].dtype == F64 and want[k].dtype == F64, (k, got[k].dtype, want[k].dtype)
        assert_parity(got[k], want[k], what=f"{what} {k} vs Boltz2", grid=grid)
    assert_parity(figs, figures(want), what=f"{what} figures vs Boltz2", grid=grid)


def check_oracle(want: dict, c: dict) -> None:
    x = want["sample_atom_coords"]
    assert bool(torch.isfinite(x).all()) and x.shape[0] == c["m"]
    assert float(want["iptm"].max()) > 0, "vacuous ipTM"
    if c["m"] > 1:  # the samples and their confidences differ: a sample mispairing shows
        assert not torch.allclose(x[0], x[1]) and not torch.allclose(want["pae"][0], want["pae"][1])


SERIAL_CASES = [
    dict(n=9, m=1, recycling=0, seed=1),
    dict(n=11, m=3, mps=2, recycling=1, seed=2),
]


@pytest.mark.parametrize("c", SERIAL_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_serial_model_vs_boltz2(c):
    theirs = boltz_model(c["seed"])
    feats = features(c)
    want = boltz_forward(theirs, feats, c)
    check_oracle(want, c)
    ours = Boltz2Model(ModelConfig.from_hparams(theirs.hparams)).to(F64)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert list(ours.state_dict()) == list(theirs.state_dict())
    got = ours_forward(ours, features(c), c)
    compare(got, figures(got), want, f"Boltz2Model {c}")


def _rank(grid, c):
    twin = cp_twin_of(boltz_model(c["seed"]), whole=True)
    assert type(twin).__name__ == "CPBoltz2Model"
    out = ours_forward(twin, distribute(features(c), grid), c)
    return {k: collect_tensor(out[k]) for k in OUTPUTS}, figures(out)


CP_CASES = [
    ((1, 1), dict(n=9, m=3, recycling=1, seed=3)),
    ((2, 2), dict(n=11, m=3, mps=2, recycling=0, seed=4)),
    ((2, 3), dict(n=10, m=1, recycling=1, seed=5)),
    ((2, 3), dict(n=13, m=3, recycling=0, seed=6)),
    ((3, 3), dict(n=14, m=2, recycling=0, seed=7)),
]


@pytest.mark.parametrize(
    "grid,c", CP_CASES, ids=[f"{grid_id(g)}-N{c['n']}-m{c['m']}-r{c['recycling']}" for g, c in CP_CASES]
)
def test_cp_model_vs_boltz2(grid, c):
    want = boltz_forward(boltz_model(c["seed"]), features(c), c)
    check_oracle(want, c)
    ranks = run_on_grid(_rank, grid, c)
    for r, (got, figs) in enumerate(ranks):
        compare(got, figs, want, f"cp_model_of(Boltz2) rank {r} {c}", grid_id(grid))
    assert_replicated([f for _, f in ranks], "model confidence figures")


def test_cp_model_of_refuses_what_it_lacks():
    model = boltz_model(7)
    for key in ("affinity_prediction", "predict_bfactor"):
        model.hparams[key] = True
        with pytest.raises(NotImplementedError, match=key):
            cp_model_of(model)
        model.hparams[key] = False
