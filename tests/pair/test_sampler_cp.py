"""The CP sampler against the serial one (fp64, round-off gate): ``CPAtomDiffusion.sample`` after
``CPDiffusionConditioning`` equals ``AtomDiffusion.sample`` after ``DiffusionConditioning``.

What each test proves:
- ``test_cp_sample_matches_serial``: the sampled coordinates ``[B m, A, 3]`` (B = 2, a padding
  token in element 1, 3-8 atoms per token, so A and every grid row's atom count are uneven; N = 11
  or 12) equal serial on 1x1, 2x2, 2x3, with 1 and 3 samples, 3 denoising steps, Boltz-2's
  predict parameters (alignment on) and with alignment off, Boltz's sample chunking
  (``max_parallel_samples`` 2 of 3: chunks [0, 1], [2]); both sides draw with the counter-based
  source (one seed), so equal coordinates prove every draw is keyed by global (sample, step,
  atom). Sharding is active (each rank of a 2-row grid holds a strict part of the atoms) and the
  replicated coordinates are identical along each grid row; Boltz's padding atoms (A above the
  real atoms) carry noise and are compared too.
- ``test_draws_keyed_by_global_index``: the counter-based draws of a rank's atoms equal the serial
  draws at those atoms, and a different seed gives different draws (the seed reaches them).
- ``test_sample_control_scalars_agree``: ranks passing different seeds or step counts raise the
  same ValueError on every rank, naming the scalar; steering flags raise NotImplementedError.
"""

from __future__ import annotations

import pytest
import torch
from diffusion_inputs import conditioning_config, diffusion_case, module_config
from torch import nn

from twinshard.pair.atoms import atom_parts
from twinshard.pair.features import collect_tensor, distribute, shard_tensor
from twinshard.pair.layers.diffusion import CPDiffusionConditioning
from twinshard.pair.layers.sampler import CPAtomDiffusion, atom_frame
from twinshard.pair.reference.diffusion import DiffusionConditioning
from twinshard.pair.reference.sampler import BOLTZ2_DIFFUSION_PARAMS, AtomDiffusion, CounterDraws
from twinshard.testing import assert_parity, assert_replicated, grid_id, randomize_parameters, run_on_grid

KINDS = {"s_inputs": "single", "s_trunk": "single", "z_trunk": "pair", "relpos": "pair"}
SEED = 1234


def _params(align: bool) -> dict:
    return BOLTZ2_DIFFUSION_PARAMS | {"alignment_reverse_diff": align}


def _modules(cfg, align, cp=False):
    cond = (CPDiffusionConditioning if cp else DiffusionConditioning)(**cfg).double()
    samp = (CPAtomDiffusion if cp else AtomDiffusion)(module_config(cfg), **_params(align)).double()
    if not cp:
        randomize_parameters(cond, seed=3)
        randomize_parameters(samp, seed=6, scale=0.3, shift=0.02)
    return nn.ModuleDict({"cond": cond, "sampler": samp})


def _sample(mods, feats, x, m, mps, steps=3, seed=SEED, steering=None):
    q, c, to_keys, eb, db, tb = mods["cond"](x["s_trunk"], x["z_trunk"], x["relpos"], feats)
    dc = {
        "q": q,
        "c": c,
        "to_keys": to_keys,
        "atom_enc_bias": eb,
        "atom_dec_bias": db,
        "token_trans_bias": tb,
    }
    return mods["sampler"].sample(
        atom_mask=feats["atom_pad_mask"],
        num_sampling_steps=steps,
        multiplicity=m,
        max_parallel_samples=mps,
        steering_args=steering,
        seed=seed,
        s_inputs=x["s_inputs"],
        s_trunk=x["s_trunk"],
        feats=feats,
        diffusion_conditioning=dc,
    )["sample_atom_coords"]


def _case(n, m, seed):
    cfg = conditioning_config(8, 32)
    return cfg, diffusion_case(2, n, cfg, seed=seed, w=8, multiplicity=m)


def _rank(grid, n, m, mps, align, seed):
    cfg, case = _case(n, m, seed)
    serial = _modules(cfg, align)
    twin = _modules(cfg, align, cp=True)
    twin.load_state_dict(serial.state_dict(), strict=True)
    d = distribute(case["feats"], grid)
    x = {k: shard_tensor(case[k], KINDS[k], grid, d.layout) for k in KINDS}
    out = _sample(twin, d, x, m, mps)
    full = collect_tensor(out)
    parts = atom_parts(out) if grid.rows > 1 else []
    return full, out.to_local(), grid.coords, parts


CASES = [
    ((1, 1), 11, 1, None, True, 1),
    ((2, 2), 11, 3, 2, True, 2),
    ((2, 3), 12, 1, None, True, 3),
    ((2, 3), 11, 3, None, False, 4),
]


@pytest.mark.parametrize(
    "grid,n,m,mps,align,seed",
    CASES,
    ids=[f"{grid_id(c[0])}-N{c[1]}-m{c[2]}-mps{c[3]}-{'align' if c[4] else 'noalign'}" for c in CASES],
)
def test_cp_sample_matches_serial(grid, n, m, mps, align, seed):
    cfg, case = _case(n, m, seed)
    serial = _modules(cfg, align)
    want = _sample(serial, case["feats"], case, m, mps)
    assert want.dtype == torch.float64 and bool(torch.isfinite(want).all())
    ranks = run_on_grid(_rank, grid, n, m, mps, align, seed)
    what = f"sampled coords N={n} m={m} mps={mps} align={align} (3 steps)"
    for r, (full, _, coords, parts) in enumerate(ranks):
        assert_parity(full, want, what=f"{what} rank {r} {coords}", grid=grid_id(grid))
        for local, index in parts:  # sharding active: a strict part of the atoms, equal to serial there
            assert local.shape[1] < want.shape[1], f"rank {r} holds every atom: sharding is not active"
            assert_parity(
                local.reshape(-1), want[index].reshape(-1), what=f"{what} shard rank {r}", grid=grid_id(grid)
            )
    for row in range(grid[0]):
        same_row = [loc for _, loc, c, _ in ranks if c[0] == row]
        assert_replicated(same_row, f"sampled coords along grid row {row}")


def _draw_rank(grid, n):
    _, case = _case(n, 2, 7)
    d = distribute(case["feats"], grid)
    frame = atom_frame(d.layout, grid.coords[0], 2, torch.device("cpu"))
    got = CounterDraws(SEED)("noise", 1, None, frame.rows, frame.atoms, torch.float64, None)
    return frame.mask(got), frame.atoms, frame.valid


def test_draws_keyed_by_global_index():
    _, case = _case(11, 2, 7)
    bm, a = 4, case["feats"]["ref_pos"].shape[1]
    serial = CounterDraws(SEED)(
        "noise", 1, None, torch.arange(bm), torch.arange(a).expand(bm, a), torch.float64, None
    )
    other = CounterDraws(SEED + 1)(
        "noise", 1, None, torch.arange(bm), torch.arange(a).expand(bm, a), torch.float64, None
    )
    assert not torch.equal(serial, other), "the seed does not reach the draws"
    for got, atoms, valid in run_on_grid(_draw_rank, (2, 2), 11):
        want = serial[torch.arange(bm)[:, None], atoms] * valid[..., None]
        assert torch.equal(got, want), "a rank's noise differs from the serial noise at its global atoms"
        assert bool(valid.any()) and not bool(valid.all())


def _bad_rank(grid, which):
    cfg, case = _case(11, 1, 5)
    twin = _modules(cfg, True, cp=True)
    d = distribute(case["feats"], grid)
    x = {k: shard_tensor(case[k], KINDS[k], grid, d.layout) for k in KINDS}
    try:
        if which == "seed":
            _sample(twin, d, x, 1, None, seed=SEED + grid.rank)
        elif which == "steps":
            _sample(twin, d, x, 1, None, steps=3 + (grid.rank == 1))
        else:
            _sample(twin, d, x, 1, None, steering={"fk_steering": True, "physical_guidance_update": False})
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("which", ["seed", "steps", "steering"])
def test_sample_control_scalars_agree(which):
    got = run_on_grid(_bad_rank, (2, 2), which)
    assert got[0] is not None, f"{which}: the sampler ran on"
    assert all(g == got[0] for g in got), f"{which}: ranks raised different errors: {got}"
    kind, text = got[0]
    want = {
        "seed": "'seed': 1234 on ranks [0]",
        "steps": "'num_sampling_steps'",
        "steering": "steering is not implemented",
    }
    assert want[which] in text, text
    assert kind == ("NotImplementedError" if which == "steering" else "ValueError"), got[0]
