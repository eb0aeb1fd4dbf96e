"""The structure module's first part, serial, against the ``boltz`` package's own modules (Boltz-2,
boltz 2.2.1) in fp64: ``DiffusionConditioning`` and the score model ``DiffusionModule`` (with its
``SingleConditioning``, ``AtomAttentionEncoder``/``AtomEncoder`` with ``structure_prediction=True``,
token-level ``DiffusionTransformer`` and ``AtomAttentionDecoder``), every parameter randomised,
state dicts loaded strict both ways, B = 2 with a padding token, uneven atoms per token, windows
32 x 128 and 8 x 32, multiplicity 1 and 3.

What each test proves:
- ``test_diffusion_conditioning_vs_boltz``: the six outputs (``q, c``, the three biases; ``to_keys``
  applied to a random atom tensor) equal Boltz's, and the gradients of ``s_trunk``, ``z_trunk``,
  the relative position encoding, ``ref_pos`` and every parameter, by name.
- ``test_diffusion_module_vs_boltz``: conditioning and score model chained as ``Boltz2`` chains
  them: ``r_update`` equals Boltz's, and the gradients of ``s_inputs``, ``s_trunk``, ``z_trunk``,
  the relative position encoding, the noisy coordinates and every parameter of both modules.
  The projections' LayerNorm biases (``*_proj_z.{l}.0.bias``) shift a whole softmax row: their
  gradient is zero in exact arithmetic and is checked against zero.
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
from boltz.model.modules.diffusionv2 import DiffusionModule as BoltzDiffusionModule  # noqa: E402

from twinshard.pair.reference.diffusion import DiffusionConditioning, DiffusionModule  # noqa: E402
from twinshard.testing import assert_parity, random_grad_output, randomize_parameters  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "pair"))
from diffusion_inputs import conditioning_config, diffusion_case, module_config  # noqa: E402

F64 = torch.float64


@contextlib.contextmanager
def boltz_fp64():
    orig = torch.Tensor.float
    torch.Tensor.float = lambda self, *a, **k: self.double()
    try:
        yield
    finally:
        torch.Tensor.float = orig


def _pair(ours, theirs, seed):
    theirs.double()
    randomize_parameters(theirs, seed=seed)
    ours.double()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]


def _grads(out, leaves, modules, go):
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    return torch.autograd.grad(out, list(leaves) + params, go)


def _compare(what, out_o, out_t, leaves_o, leaves_t, mods_o, mods_t, names, zero=()):
    assert out_o.dtype == F64 and out_t.dtype == F64
    assert_parity(out_o, out_t, what=f"{what} vs boltz out")
    go = random_grad_output(out_t, seed=5)
    g_o = _grads(out_o, leaves_o, mods_o, go)
    with boltz_fp64():
        g_t = _grads(out_t, leaves_t, mods_t, go)
    assert len(names) == len(g_t)
    scale = max(float(g.abs().max()) for g in g_t)
    for name, a, e in zip(names, g_o, g_t):
        if any(name.endswith(z) for z in zero):
            tol = 1e-12 * scale
            why = f"analytically zero (a softmax row shift): 1e-12 x max|grad| {scale:.3g}"
            for side, g in (("ours", a), ("boltz", e)):
                assert_parity(
                    g, torch.zeros_like(g), what=f"{what} {side} grad {name}", rtol=0.0, atol=tol, why=why
                )
            continue
        assert bool(e.abs().max() > 0), f"{what}: vacuous gradient for {name}"
        assert_parity(a, e, what=f"{what} vs boltz grad {name}")


WINDOWS = [(32, 128), (8, 32)]


@pytest.mark.parametrize("w,h", WINDOWS, ids=[f"{w}x{h}" for w, h in WINDOWS])
def test_diffusion_conditioning_vs_boltz(w, h):
    cfg = conditioning_config(w, h)
    theirs, ours = BoltzDiffusionConditioning(**cfg), DiffusionConditioning(**cfg)
    _pair(ours, theirs, seed=3)
    case = diffusion_case(2, 11, cfg, seed=4, w=w)
    feats = case["feats"]
    keys = ("s_trunk", "z_trunk", "relpos", "ref_pos")
    lo = {k: case[k].clone().requires_grad_() for k in keys[:3]} | {
        "ref_pos": feats["ref_pos"].clone().requires_grad_()
    }
    lt = {k: v.detach().clone().requires_grad_() for k, v in lo.items()}
    probe = torch.randn(
        feats["ref_pos"].shape[:2] + (3,), generator=torch.Generator().manual_seed(9), dtype=F64
    )

    def flat(outs):
        q, c, to_keys, eb, db, tb = outs
        return torch.cat([t.reshape(-1) for t in (q, c, to_keys(probe), eb, db, tb)])

    out_o = flat(ours(lo["s_trunk"], lo["z_trunk"], lo["relpos"], feats | {"ref_pos": lo["ref_pos"]}))
    with boltz_fp64():
        out_t = flat(theirs(lt["s_trunk"], lt["z_trunk"], lt["relpos"], feats | {"ref_pos": lt["ref_pos"]}))
    names = [f"d/d{k}" for k in keys] + [n for n, p in theirs.named_parameters() if p.requires_grad]
    _compare(
        f"DiffusionConditioning {w}x{h}", out_o, out_t, lo.values(), lt.values(), [ours], [theirs], names
    )


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("w,h", WINDOWS, ids=[f"{w}x{h}" for w, h in WINDOWS])
def test_diffusion_module_vs_boltz(w, h, m):
    cfg = conditioning_config(w, h)
    cond_t, cond_o = BoltzDiffusionConditioning(**cfg), DiffusionConditioning(**cfg)
    _pair(cond_o, cond_t, seed=3)
    mcfg = module_config(cfg)
    sm_t, sm_o = BoltzDiffusionModule(**mcfg), DiffusionModule(**mcfg)
    _pair(sm_o, sm_t, seed=6)
    case = diffusion_case(2, 11, cfg, seed=4, w=w, multiplicity=m)
    feats = case["feats"]
    keys = ("s_inputs", "s_trunk", "z_trunk", "relpos", "r")
    lo = {k: case[k].clone().requires_grad_() for k in keys}
    lt = {k: v.detach().clone().requires_grad_() for k, v in lo.items()}

    def run(cond, sm, x):
        q, c, to_keys, eb, db, tb = cond(x["s_trunk"], x["z_trunk"], x["relpos"], feats)
        dc = {
            "q": q,
            "c": c,
            "to_keys": to_keys,
            "atom_enc_bias": eb,
            "atom_dec_bias": db,
            "token_trans_bias": tb,
        }
        return sm(
            s_inputs=x["s_inputs"],
            s_trunk=x["s_trunk"],
            r_noisy=x["r"],
            times=case["times"],
            feats=feats,
            diffusion_conditioning=dc,
            multiplicity=m,
        )

    out_o = run(cond_o, sm_o, lo)
    with boltz_fp64():
        out_t = run(cond_t, sm_t, lt)
    assert out_o.shape == (2 * m, feats["ref_pos"].shape[1], 3)
    names = (
        [f"d/d{k}" for k in keys]
        + [f"cond.{n}" for n, p in cond_t.named_parameters() if p.requires_grad]
        + [f"score.{n}" for n, p in sm_t.named_parameters() if p.requires_grad]
    )
    zero = tuple(f"proj_z.{i}.0.bias" for i in range(4))
    _compare(
        f"DiffusionModule {w}x{h} m={m}",
        out_o,
        out_t,
        lo.values(),
        lt.values(),
        [cond_o, sm_o],
        [cond_t, sm_t],
        names,
        zero,
    )
