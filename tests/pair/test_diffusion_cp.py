"""CP diffusion conditioning + score model against the serial references (fp64, round-off gate).

What each test proves:
- ``test_cp_diffusion_matches_serial``: ``CPDiffusionConditioning`` chained into ``CPDiffusionModule``
  as ``Boltz2`` chains them: ``r_update[B m, A, 3]``, the gradients of ``s_inputs``, ``s_trunk``,
  ``z_trunk``, the relative position encoding and the noisy coordinates ``r``, and every parameter
  gradient of both modules (by name) equal serial on 1x1, 2x2, 2x3, 3x2, uneven N (11, 12 tokens,
  3-8 atoms per token, a padding token in element 1), multiplicity 1 and 2, windows 8 x 32
  (windows straddle row blocks) and Boltz's 32 x 128. The projections' LayerNorm biases shift a
  softmax row: checked against zero.
- ``test_z_band_bytes``: the z band's forward bytes per rank equal the band (the tokens of the
  key atoms of the rank's windows, counted here from the window definition) minus the columns the
  rank owns, x Nr/R x atom_z x 8; its backward sends nothing; at least one band is narrower than N.
"""

from __future__ import annotations

import pytest
import torch
from diffusion_inputs import conditioning_config, diffusion_case, module_config
from torch import nn

from twinshard.comm import CommLedger
from twinshard.pair.atoms import atom_parts, atom_tile
from twinshard.pair.features import collect_grad, collect_tensor, distribute, real_part, shard_tensor
from twinshard.pair.layers.diffusion import CPDiffusionConditioning, CPDiffusionModule, sample_layout
from twinshard.pair.layout import with_layout
from twinshard.pair.reference.diffusion import DiffusionConditioning, DiffusionModule
from twinshard.pair.tiling import SINGLE, from_local
from twinshard.testing import (
    TwinResult,
    check_twin,
    grid_id,
    parameter_signature,
    random_grad_output,
    randomize_parameters,
    run_on_grid,
    serial_reference,
)

KINDS = {"s_inputs": "single", "s_trunk": "single", "z_trunk": "pair", "relpos": "pair", "r": "atom"}
ZERO = tuple(f"cond.{p}_proj_z.{i}.0.bias" for p in ("atom_enc", "atom_dec", "token_trans") for i in range(2))


def _serial(cfg: dict) -> nn.ModuleDict:
    cond = DiffusionConditioning(**cfg).double()
    randomize_parameters(cond, seed=3)
    score = DiffusionModule(**module_config(cfg)).double()
    randomize_parameters(score, seed=6)
    return nn.ModuleDict({"cond": cond, "score": score})


def _chain(mods, feats, x, times, m):
    q, c, to_keys, eb, db, tb = mods["cond"](x["s_trunk"], x["z_trunk"], x["relpos"], feats)
    dc = {
        "q": q,
        "c": c,
        "to_keys": to_keys,
        "atom_enc_bias": eb,
        "atom_dec_bias": db,
        "token_trans_bias": tb,
    }
    return mods["score"](x["s_inputs"], x["s_trunk"], x["r"], x.get("times", times), feats, dc, m)


def _case(w, h, n, m, seed):
    cfg = conditioning_config(w, h)
    return cfg, diffusion_case(2, n, cfg, seed=seed, w=w, multiplicity=m)


def _rank(grid, w, h, n, m, seed):
    cfg, case = _case(w, h, n, m, seed)
    serial = _serial(cfg)
    twin = nn.ModuleDict(
        {
            "cond": CPDiffusionConditioning(**cfg).double(),
            "score": CPDiffusionModule(**module_config(cfg)).double(),
        }
    )
    twin.load_state_dict(serial.state_dict(), strict=True)
    return run_twin(grid, twin, case, m)


def run_twin(grid, twin, case, m):
    """This rank's ``TwinResult`` (and ledgers) of ``twin`` (``{"cond", "score"}``) on ``case``."""
    leaves = {k: case[k].clone().requires_grad_() for k in KINDS}
    d = distribute(case["feats"], grid)
    lay = d.layout
    x = {k: shard_tensor(leaves[k], KINDS[k], grid, lay) for k in KINDS if k != "r"}
    lay_m = sample_layout(lay, m)
    r_tile = atom_tile(leaves["r"], "atom", lay_m, grid.coords[0])
    x["r"] = with_layout(from_local(r_tile, grid.mesh, SINGLE), lay_m, "atom")
    with CommLedger() as fwd:
        out = _chain(twin, d, x, case["times"], m)
    full = collect_tensor(out)
    with CommLedger() as bwd:
        full.backward(random_grad_output(full, seed=6))
    shards = {"z_trunk": real_part(x["z_trunk"])}
    if grid.rows > 1:
        shards["out"] = atom_parts(out)
    res = TwinResult(
        out=full.detach(),
        grads_in={k: collect_grad(leaves[k].grad, KINDS[k], grid) for k in KINDS},
        param_grads={k: p.grad for k, p in twin.named_parameters() if p.requires_grad},
        shards=shards,
        params=parameter_signature(twin),
    )
    return res, fwd.summary(), bwd.summary(), grid.coords, (lay.atom_starts, lay.atom_counts, lay.padded)


def _check(grid, w, h, n, m, seed, ranks):
    cfg, case = _case(w, h, n, m, seed)
    serial = _serial(cfg)
    ref = serial_reference(
        serial, lambda **x: _chain(serial, case["feats"], x, case["times"], m), {k: case[k] for k in KINDS}, 6
    )
    ref["serial_param_grads"] = {k: p.grad for k, p in serial.named_parameters() if p.requires_grad}
    what = f"diffusion cond+score {w}x{h} N={n} m={m}"
    check_twin(what=what, grid=grid_id(grid), ranks=[r[0] for r in ranks], zero_grads=ZERO, **ref)


CASES = [
    ((1, 1), 8, 32, 11, 2, 1),
    ((2, 2), 8, 32, 11, 2, 2),
    ((2, 3), 8, 32, 12, 1, 3),
    ((3, 2), 8, 32, 11, 2, 4),
    ((2, 2), 32, 128, 12, 2, 5),
]


@pytest.mark.parametrize(
    "grid,w,h,n,m,seed", CASES, ids=[f"{grid_id(c[0])}-W{c[1]}-N{c[3]}-m{c[4]}" for c in CASES]
)
def test_cp_diffusion_matches_serial(grid, w, h, n, m, seed):
    ranks = run_on_grid(_rank, grid, w, h, n, m, seed)
    _check(grid, w, h, n, m, seed, ranks)


def _band_bytes(case, starts, counts, padded, coords, grid, w, h, atom_z):
    """Expected received bytes of the z band on the rank at ``coords``, and the widest band."""
    a2t = case["feats"]["atom_to_token"]
    tok = torch.where(a2t.ne(0).any(-1), a2t.ne(0).to(torch.uint8).argmax(-1), torch.full(a2t.shape[:2], -1))
    r, c = coords
    n_i, n_j = padded[0] // grid[0], padded[1] // grid[1]
    mg, a = (h - w) // 2, a2t.shape[1]
    total, widest = 0, 0
    for b in range(a2t.shape[0]):
        s, k = starts[b][r], counts[b][r]
        if k == 0:
            continue
        lo_k, hi_k = s // w, (s + k - 1) // w
        keys = tok[b, max(0, w * lo_k - mg) : min(a, w * hi_k + w + mg)]
        keys = keys[keys >= 0]
        lo, hi = int(keys.min()), int(keys.max()) + 1
        mine = max(0, min(hi, (c + 1) * n_j) - max(lo, c * n_j))
        total += n_i * (hi - lo - mine) * atom_z * 8
        widest = max(widest, hi - lo)
    return total, widest


def test_z_band_bytes():
    grid, w, h, n, m, seed = (3, 2), 8, 32, 12, 1, 7
    ranks = run_on_grid(_rank, grid, w, h, n, m, seed)
    cfg, case = _case(w, h, n, m, seed)
    narrow = False
    for rank, (_, fwd, bwd, coords, (starts, counts, padded)) in enumerate(ranks):
        want, widest = _band_bytes(case, starts, counts, padded, coords, grid, w, h, cfg["atom_z"])
        got = fwd["ops"].get("diffcond:z_band", {}).get("bytes_recv", 0)
        assert got == want, f"rank {rank} {coords}: the z band received {got} bytes, the band is {want}"
        assert "diffcond:z_band:backward" not in bwd["ops"], f"rank {rank}: the band's adjoint communicated"
        narrow |= widest < n
    assert narrow, "every band spans all N tokens: the case does not show the band is narrow"
