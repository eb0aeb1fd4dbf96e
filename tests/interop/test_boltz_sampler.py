"""The sampler against the ``boltz`` package's own ``AtomDiffusion.sample`` (Boltz-2, boltz 2.2.1),
fp64, with the same random draws.

Boltz draws with ``torch.randn``: one ``[m, A, 3]`` initial noise, then per step a ``[m, 4]``
quaternion draw and a ``[m, 1, 3]`` translation (``compute_random_augmentation``) and a ``[m, A, 3]``
step noise. Here ``torch.randn`` is patched, in the test process only and while Boltz samples, to
hand out a callback's draws in that order (each call's shape checked against its kind); our sampler
takes the same callback as a :class:`GivenDraws` source (the ``"boltz"`` convention). Boltz runs
with ``Tensor.float()`` kept in fp64 and the default dtype fp64 (its ``torch.full`` noise levels);
its schedule stays fp32 (an explicit ``dtype``) and so does ours; its alignment SVD runs in fp32,
ours too (``align_svd_dtype``).

What each test proves:
- ``test_sample_vs_boltz``: the sampled coordinates equal Boltz's (B = 1, N = 11, uneven atoms per
  token, Boltz's padding atoms included; 3 steps; 1 and 3 samples, the latter in Boltz's chunks of
  ``max_parallel_samples`` 2; ``boltz predict``'s Boltz-2 parameters with the alignment on, and
  off), for two draw sources: a callback of seeded ``torch`` draws, and the counter-based draws of
  :class:`CounterDraws` materialised in full (so the default twinshard convention is Boltz's
  sampler with other numbers). The conditioning, score model and sampler state dicts load strict
  both ways (``structure_module.*`` names).
- ``test_cp_sample_vs_boltz``: the CP sampler on 2x2 and 2x3 grids, handed the same callback
  (``GivenDraws``), equals Boltz's coordinates.
- ``test_cp_twin_of_atom_diffusion``: ``cp_twin_of`` of Boltz's ``AtomDiffusion`` (and of its
  ``DiffusionConditioning``) is the CP sampler with Boltz's scalars (alignment on) and weights; on
  2x2 it samples Boltz's coordinates.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("boltz", reason="the boltz package is not installed (see tests/interop/README.md)")

from boltz.model.modules.diffusion_conditioning import (  # noqa: E402
    DiffusionConditioning as BoltzDiffusionConditioning,
)
from boltz.model.modules.diffusionv2 import AtomDiffusion as BoltzAtomDiffusion  # noqa: E402
from torch import nn  # noqa: E402

from twinshard.pair.features import collect_tensor, distribute, shard_tensor  # noqa: E402
from twinshard.pair.interop.boltz import cp_twin_of  # noqa: E402
from twinshard.pair.layers.diffusion import CPDiffusionConditioning  # noqa: E402
from twinshard.pair.layers.sampler import CPAtomDiffusion  # noqa: E402
from twinshard.pair.reference.diffusion import DiffusionConditioning  # noqa: E402
from twinshard.pair.reference.sampler import (  # noqa: E402
    BOLTZ2_DIFFUSION_PARAMS,
    AtomDiffusion,
    CounterDraws,
    GivenDraws,
)
from twinshard.testing import assert_parity, grid_id, randomize_parameters, run_on_grid  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "pair"))
from diffusion_inputs import conditioning_config, diffusion_case, module_config  # noqa: E402

F64 = torch.float64
STEPS = 3
NO_STEERING = {"fk_steering": False, "physical_guidance_update": False, "contact_guidance_update": False}
_RANDN = torch.randn  # the real one (the patch below replaces torch.randn while Boltz samples)
KINDS = {"s_inputs": "single", "s_trunk": "single", "z_trunk": "pair", "relpos": "pair"}


def torch_draws(kind: str, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Seeded torch draws, a pure function of (kind, step, shape)."""
    salt = {"init": 1, "rotation": 2, "translation": 3, "noise": 4}[kind]
    g = torch.Generator().manual_seed(1000 * salt + step)
    return _RANDN(shape, generator=g, dtype=F64)


def counter_draws(kind: str, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    rows = torch.arange(shape[0])
    atoms = torch.arange(shape[1]).expand(shape[0], shape[1]) if kind in ("init", "noise") else None
    return CounterDraws(77)(kind, step, shape, rows, atoms, F64, None)


SOURCES = {"torch": torch_draws, "counter": counter_draws}


@contextlib.contextmanager
def boltz_randn_from(fn):
    """``torch.randn`` hands out ``fn``'s draws in Boltz's order: init, then (rotation,
    translation, noise) per step; the order of the kinds is checked by their shapes."""
    orig_randn, orig_float, orig_default = torch.randn, torch.Tensor.float, torch.get_default_dtype()
    calls = []

    def fake(*size, **kwargs):
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        i = len(calls)
        kind, step = (
            ("init", 0) if i == 0 else (("rotation", "translation", "noise")[(i - 1) % 3], (i - 1) // 3)
        )
        want = {"rotation": 2, "translation": 3}.get(kind, 3)
        assert len(shape) == want, f"Boltz's randn call {i} ({kind}) has shape {shape}"
        calls.append((kind, step, shape))
        return fn(kind, step, shape).to(kwargs.get("dtype") or torch.get_default_dtype())

    torch.randn = fake
    torch.Tensor.float = lambda self, *a, **k: self.double()
    torch.set_default_dtype(F64)
    try:
        yield calls
    finally:
        torch.randn, torch.Tensor.float = orig_randn, orig_float
        torch.set_default_dtype(orig_default)


def _params(align: bool) -> dict:
    return BOLTZ2_DIFFUSION_PARAMS | {"alignment_reverse_diff": align}


def _boltz_pair(cfg, align):
    cond_t = BoltzDiffusionConditioning(**cfg).double()
    samp_t = BoltzAtomDiffusion(module_config(cfg), **_params(align)).double()
    randomize_parameters(cond_t, seed=3)
    randomize_parameters(samp_t, seed=6, scale=0.3, shift=0.02)
    cond_o = DiffusionConditioning(**cfg).double()
    samp_o = AtomDiffusion(module_config(cfg), **_params(align)).double()
    for ours, theirs in ((cond_o, cond_t), (samp_o, samp_t)):
        ours.load_state_dict(theirs.state_dict(), strict=True)
        theirs.load_state_dict(ours.state_dict(), strict=True)
        assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    return nn.ModuleDict({"cond": cond_t, "sampler": samp_t}).eval(), nn.ModuleDict(
        {"cond": cond_o, "sampler": samp_o}
    ).eval()


def _conditioning(cond, x, feats):
    q, c, to_keys, eb, db, tb = cond(x["s_trunk"], x["z_trunk"], x["relpos"], feats)
    return {
        "q": q,
        "c": c,
        "to_keys": to_keys,
        "atom_enc_bias": eb,
        "atom_dec_bias": db,
        "token_trans_bias": tb,
    }


def _boltz_sample(mods, case, m, mps, source):
    feats = case["feats"]
    with torch.no_grad(), boltz_randn_from(source) as calls:
        dc = _conditioning(mods["cond"], case, feats)
        out = mods["sampler"].sample(
            atom_mask=feats["atom_pad_mask"].float(),
            num_sampling_steps=STEPS,
            multiplicity=m,
            max_parallel_samples=mps,
            steering_args=NO_STEERING,
            s_trunk=case["s_trunk"],
            s_inputs=case["s_inputs"],
            feats=feats,
            diffusion_conditioning=dc,
        )["sample_atom_coords"]
    assert len(calls) == 1 + 3 * STEPS, f"Boltz drew {len(calls)} times: {calls}"
    return out


def _ours(mods, feats, x, m, mps, draws):
    dc = _conditioning(mods["cond"], x, feats)
    return mods["sampler"].sample(
        feats["atom_pad_mask"],
        STEPS,
        m,
        mps,
        NO_STEERING,
        draws=draws,
        s_inputs=x["s_inputs"],
        s_trunk=x["s_trunk"],
        feats=feats,
        diffusion_conditioning=dc,
    )["sample_atom_coords"]


def _case(m):
    cfg = conditioning_config(8, 32)
    return cfg, diffusion_case(1, 11, cfg, seed=4, w=8, multiplicity=m)


CASES = [(1, None, True), (3, 2, True), (3, None, False)]


@pytest.mark.parametrize("source", sorted(SOURCES))
@pytest.mark.parametrize(
    "m,mps,align", CASES, ids=[f"m{c[0]}-mps{c[1]}-{'align' if c[2] else 'noalign'}" for c in CASES]
)
def test_sample_vs_boltz(m, mps, align, source):
    cfg, case = _case(m)
    theirs, ours = _boltz_pair(cfg, align)
    want = _boltz_sample(theirs, case, m, mps, SOURCES[source])
    got = _ours(ours, case["feats"], case, m, mps, GivenDraws(SOURCES[source]))
    assert got.dtype == F64 and want.dtype == F64 and got.shape == (m, case["feats"]["ref_pos"].shape[1], 3)
    assert_parity(
        got, want, what=f"sampled coords vs boltz ({source} draws, m={m}, mps={mps}, align={align})"
    )
    if source == "counter":  # the default source of our sampler is this one
        again = _ours(ours, case["feats"], case, m, mps, CounterDraws(77))
        assert torch.equal(again, got)


def _cp_rank(grid, m, mps, align):
    cfg, case = _case(m)
    _, serial = _boltz_pair(cfg, align)
    twin = nn.ModuleDict(
        {
            "cond": CPDiffusionConditioning(**cfg).double(),
            "sampler": CPAtomDiffusion(module_config(cfg), **_params(align)).double(),
        }
    )
    twin.load_state_dict(serial.state_dict(), strict=True)
    d = distribute(case["feats"], grid)
    x = {k: shard_tensor(case[k], KINDS[k], grid, d.layout) for k in KINDS}
    return collect_tensor(_ours(twin.eval(), d, x, m, mps, GivenDraws(torch_draws)))


@pytest.mark.parametrize("grid,m,mps", [((2, 2), 3, 2), ((2, 3), 1, None)], ids=["2x2-m3", "2x3-m1"])
def test_cp_sample_vs_boltz(grid, m, mps):
    cfg, case = _case(m)
    theirs, _ = _boltz_pair(cfg, True)
    want = _boltz_sample(theirs, case, m, mps, torch_draws)
    for r, got in enumerate(run_on_grid(_cp_rank, grid, m, mps, True)):
        assert_parity(got, want, what=f"CP sampled coords vs boltz rank {r} (m={m})", grid=grid_id(grid))


def _twin_rank(grid):
    cfg, case = _case(3)
    theirs, _ = _boltz_pair(cfg, True)
    twin = cp_twin_of(theirs["sampler"])
    assert type(twin).__name__ == "CPAtomDiffusion" and twin.alignment_reverse_diff
    cond = cp_twin_of(theirs["cond"])
    d = distribute(case["feats"], grid)
    x = {k: shard_tensor(case[k], KINDS[k], grid, d.layout) for k in KINDS}
    mods = nn.ModuleDict({"cond": cond, "sampler": twin}).eval()
    return collect_tensor(_ours(mods, d, x, 3, None, GivenDraws(torch_draws)))


def test_cp_twin_of_atom_diffusion():
    """``cp_twin_of(Boltz2.structure_module)`` is the CP sampler with Boltz's scalars and weights."""
    cfg, case = _case(3)
    theirs, _ = _boltz_pair(cfg, True)
    want = _boltz_sample(theirs, case, 3, None, torch_draws)
    for r, got in enumerate(run_on_grid(_twin_rank, (2, 2))):
        assert_parity(got, want, what=f"cp_twin_of(AtomDiffusion) sample vs boltz rank {r}", grid="2x2")
