"""``cp_twin_of`` of boltz's ``DiffusionConditioning`` and score model ``DiffusionModule`` (boltz
2.2.1) against those modules themselves, on grids, fp64.

- ``test_cp_twin_of_diffusion_vs_boltz``: each rank builds boltz's modules (parameters randomised
  from one seed), turns them into CP twins with ``cp_twin_of`` (state dicts strict), runs them
  chained as ``Boltz2`` chains them on its tiles (B = 2, uneven atoms per token, a padding token,
  multiplicity 2); the test process runs boltz's modules on the full inputs (``.float()`` kept in
  fp64). ``check_twin`` compares ``r_update``, the gradients of ``s_inputs``, ``s_trunk``,
  ``z_trunk``, the relative position encoding and the noisy coordinates, and every parameter
  gradient by name, at the round-off gate (the projections' LayerNorm biases against zero).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("boltz", reason="the boltz package is not installed (see tests/interop/README.md)")

from boltz.model.modules.diffusion_conditioning import (  # noqa: E402
    DiffusionConditioning as BoltzDiffusionConditioning,
)
from boltz.model.modules.diffusionv2 import DiffusionModule as BoltzDiffusionModule  # noqa: E402

from twinshard.pair.interop.boltz import cp_twin_of  # noqa: E402
from twinshard.testing import check_twin, grid_id, randomize_parameters, run_on_grid, serial_reference  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "pair"))
from diffusion_inputs import conditioning_config, diffusion_case, module_config  # noqa: E402
from test_diffusion_cp import KINDS, ZERO, run_twin  # noqa: E402


def _boltz(cfg):
    cond = BoltzDiffusionConditioning(**cfg).double()
    randomize_parameters(cond, seed=3)
    score = BoltzDiffusionModule(**module_config(cfg)).double()
    randomize_parameters(score, seed=6)
    return nn.ModuleDict({"cond": cond, "score": score})


def _case(w, h, n, m, seed):
    cfg = conditioning_config(w, h)
    return cfg, diffusion_case(2, n, cfg, seed=seed, w=w, multiplicity=m)


def _rank(grid, w, h, n, m, seed):
    cfg, case = _case(w, h, n, m, seed)
    theirs = _boltz(cfg)
    twin = nn.ModuleDict({"cond": cp_twin_of(theirs["cond"]), "score": cp_twin_of(theirs["score"])})
    return run_twin(grid, twin, case, m)


def _boltz_chain(mods, feats, x, times, m):
    orig = torch.Tensor.float
    torch.Tensor.float = lambda self, *a, **k: self.double()
    try:
        q, c, to_keys, eb, db, tb = mods["cond"](x["s_trunk"], x["z_trunk"], x["relpos"], feats)
        dc = {
            "q": q,
            "c": c,
            "to_keys": to_keys,
            "atom_enc_bias": eb,
            "atom_dec_bias": db,
            "token_trans_bias": tb,
        }
        return mods["score"](
            s_inputs=x["s_inputs"],
            s_trunk=x["s_trunk"],
            r_noisy=x["r"],
            times=times,
            feats=feats,
            diffusion_conditioning=dc,
            multiplicity=m,
        )
    finally:
        torch.Tensor.float = orig


CASES = [((2, 2), 8, 32, 11, 2, 1), ((2, 3), 8, 32, 12, 2, 2)]


@pytest.mark.parametrize("grid,w,h,n,m,seed", CASES, ids=[grid_id(c[0]) for c in CASES])
def test_cp_twin_of_diffusion_vs_boltz(grid, w, h, n, m, seed):
    ranks = run_on_grid(_rank, grid, w, h, n, m, seed)
    cfg, case = _case(w, h, n, m, seed)
    theirs = _boltz(cfg)
    ref = serial_reference(
        theirs,
        lambda **x: _boltz_chain(theirs, case["feats"], x, case["times"], m),
        {k: case[k] for k in KINDS},
        6,
    )
    ref["serial_param_grads"] = {k: p.grad for k, p in theirs.named_parameters() if p.requires_grad}
    what = f"cp_twin_of(boltz diffusion) {w}x{h} N={n} m={m}"
    check_twin(what=what, grid=grid_id(grid), ranks=[r[0] for r in ranks], zero_grads=ZERO, **ref)
