"""CP template module (``CPTemplateV2Module``, ``CPTemplateModule``) against the serial reference.

What each test proves:
- ``test_cp_template_matches_serial``: the update of z equals serial on 1x1, 2x2, 2x3, 3x2 with
  uneven N, forward and backward (the gradient of z and every parameter gradient by name, the
  template Pairformer's included), with three templates of which the last is padded (all
  ``template_mask`` zero: it must not count in the average), a random pair mask, CB distances over
  the distogram range and random frames; version 2 (visibility ids) and version 1 (asym_id).
- ``test_cp_template_single_and_zero_templates``: T = 1 equals serial; T = 0 gives exactly zero
  on every grid tried, as the serial reference does.
"""

from __future__ import annotations

import pytest
import torch

from twinshard.pair.features import collect_grad, collect_tensor, distribute, real_part, shard_tensor
from twinshard.pair.layers.template import CPTemplateModule, CPTemplateV2Module
from twinshard.pair.reference.template import TemplateModule, TemplateV2Module
from twinshard.testing import (
    TwinResult,
    check_twin,
    grid_id,
    parameter_signature,
    random_grad_output,
    random_mask,
    randomize_parameters,
    run_on_grid,
    serial_reference,
    synthetic,
)
from twinshard.testing.pair_features import template_features, token_pair_features

CZ, TD = 4, 4
KW = dict(template_blocks=1, dropout=0.0, pairwise_head_width=2, pairwise_num_heads=2)


def _serial(version: int):
    torch.manual_seed(3)
    cls = TemplateV2Module if version == 2 else TemplateModule
    m = cls(CZ, TD, **KW).double()
    randomize_parameters(m, seed=31, scale=0.3)
    return m


def _inputs(b: int, t: int, n: int):
    feats = template_features(b, t, n, seed=7)
    feats["asym_id"] = token_pair_features(b, n, seed=7)["asym_id"]
    pm = random_mask(b, n, n, seed=9, keep=0.85)
    pm[:, torch.arange(n), torch.arange(n)] = 1
    feats["pair_mask"] = pm
    return feats, synthetic(b, n, n, CZ, seed=8)


def _rank_template(grid, version, b, t, n):
    serial = _serial(version)
    twin = (CPTemplateV2Module if version == 2 else CPTemplateModule)(CZ, TD, **KW).double()
    twin.load_state_dict(serial.state_dict())
    feats, z = _inputs(b, t, n)
    fd = distribute(feats, grid)
    z = z.requires_grad_(True)
    zd = shard_tensor(z, "pair", grid, fd.layout)
    out = twin(zd, fd, fd["pair_mask"])
    full = collect_tensor(out)
    if t == 0:
        return full.detach()
    full.backward(random_grad_output(full, seed=6))
    return TwinResult(
        out=full.detach(),
        grads_in={"z": collect_grad(z.grad, "pair", grid)},
        param_grads={k: p.grad for k, p in twin.named_parameters()},
        shards={"z": real_part(zd), "out": real_part(out)},
        params=parameter_signature(twin),
    )


def _check(grid, version, b, t, n, ranks):
    serial = _serial(version)
    feats, z = _inputs(b, t, n)
    ref = serial_reference(serial, lambda z: serial(z, feats, feats["pair_mask"]), {"z": z}, grad_seed=6)
    check_twin(what=f"template v{version} T={t} N={n} B={b}", grid=grid_id(grid), ranks=ranks, **ref)


CASES = [((1, 1), 7, 2), ((2, 2), 7, 2), ((2, 3), 8, 1), ((3, 2), 7, 2)]


@pytest.mark.parametrize("version", [2, 1])
@pytest.mark.parametrize("grid,n,b", CASES, ids=[f"{grid_id(g)}-N{n}" for g, n, _ in CASES])
def test_cp_template_matches_serial(grid, n, b, version):
    if version == 1 and grid not in ((1, 1), (2, 3)):
        pytest.skip("version 1 differs only in the visibility: two grids suffice")
    ranks = run_on_grid(_rank_template, grid, version, b, 3, n)
    _check(grid, version, b, 3, n, ranks)


def test_cp_template_single_and_zero_templates():
    ranks = run_on_grid(_rank_template, (2, 2), 2, 2, 1, 7)
    _check((2, 2), 2, 2, 1, 7, ranks)
    feats, z = _inputs(2, 0, 7)
    serial = _serial(2)
    ref = serial(z, feats, feats["pair_mask"])
    assert ref.shape == (2, 7, 7, CZ) and not bool(ref.any()), "T = 0 must give an exactly zero update"
    for grid in ((1, 1), (2, 3)):
        for r, out in enumerate(run_on_grid(_rank_template, grid, 2, 2, 0, 7)):
            assert torch.equal(out, ref), f"grid {grid_id(grid)} rank {r}: T = 0 update is not zero"


def test_template_pair_features_vs_loops():
    """The reference's a_tij against a loop over (t, i, j) written from the formula: bins of the
    CB distance, masks, the 'unit vector' R_j^T (ca_i - t_j) in the frame of j as Boltz-2 computes
    it (each component divided by its own absolute value: its sign), visibility."""
    b, t, n = 1, 2, 5
    m = _serial(2)
    feats, _ = _inputs(b, t, n)
    a = m.pair_features(feats, feats, n)
    edges = torch.linspace(m.min_dist, m.max_dist, m.num_bins - 1).double()
    for tt in range(t):
        for i in range(n):
            for j in range(n):
                f = {k: v[0, tt] for k, v in feats.items() if k.startswith(("template", "visibility"))}
                d = float((f["template_cb"][i] - f["template_cb"][j]).norm())
                bins = torch.zeros(m.num_bins, dtype=torch.float64)
                bins[int((d > edges).sum())] = 1
                vec = f["template_frame_rot"][j].T @ (f["template_ca"][i] - f["template_frame_t"][j])
                unit = torch.sign(vec)  # Boltz normalises each component by its own |.| (module doc)
                cbm = f["template_mask_cb"][i] * f["template_mask_cb"][j]
                fm = f["template_mask_frame"][i] * f["template_mask_frame"][j]
                vis = float(f["visibility_ids"][i] == f["visibility_ids"][j])
                want = torch.cat([bins, cbm.view(1), unit, fm.view(1)]) * vis
                want = torch.cat([want, f["template_restype"][i].double(), f["template_restype"][j].double()])
                torch.testing.assert_close(a[0, tt, i, j], want, rtol=1e-13, atol=1e-13)
    assert float(a[..., : m.num_bins].argmax(-1).float().std()) > 0  # several bins are hit


def _rank_dropout(grid, n):
    serial = _serial(2)
    kw = dict(KW, dropout=0.25)
    twin = CPTemplateV2Module(CZ, TD, **kw).double()
    twin.load_state_dict(serial.state_dict())
    twin.train()
    feats, z = _inputs(2, 3, n)
    fd = distribute(feats, grid)
    z = z.requires_grad_(True)
    zd = shard_tensor(z, "pair", grid, fd.layout)
    out = collect_tensor(twin(zd, fd, fd["pair_mask"], seed=11))
    out.backward(random_grad_output(out, seed=6))
    return TwinResult(
        out=out.detach(),
        grads_in={"z": collect_grad(z.grad, "pair", grid)},
        param_grads={k: p.grad for k, p in twin.named_parameters()},
        shards={"z": real_part(zd)},
        params=parameter_signature(twin),
    )


def test_cp_template_dropout_matches_serial():
    """Training mode with Boltz's template dropout (p = 0.25): the template Pairformer's masks on
    the B*T pair tensors are keyed by global index, so the twin equals serial (2x2, N = 7)."""
    ranks = run_on_grid(_rank_dropout, (2, 2), 7)
    torch.manual_seed(3)
    serial = TemplateV2Module(CZ, TD, **dict(KW, dropout=0.25)).double()
    serial.load_state_dict(_serial(2).state_dict())
    serial.train()
    feats, z = _inputs(2, 3, 7)
    ref = serial_reference(
        serial, lambda z: serial(z, feats, feats["pair_mask"], seed=11), {"z": z}, grad_seed=6
    )
    check_twin(what="template v2 dropout 0.25 N=7", grid="2x2", ranks=ranks, **ref)
    assert not torch.equal(ref["serial_out"], _serial(2).eval()(z, feats, feats["pair_mask"]).detach())
