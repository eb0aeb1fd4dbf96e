"""The serial ``ConfidenceModule`` (twinshard.pair.reference.confidence) against boltz's own
``boltz.model.modules.confidencev2.ConfidenceModule`` (boltz 2.2.1), fp64.

- ``test_confidence_matches_boltz``: Boltz's module with random parameters, its ``state_dict``
  loaded strict into ours (same names, same order, the ``boundaries`` buffer included); every
  output equal at round-off (the four logits, pae, pde, plddt, complex pLDDT / ipLDDT / PDE /
  iPDE, pTM, ipTM, ligand and protein ipTM, every per-chain-pair ipTM), and the gradients of
  ``s_inputs``, ``s``, ``z`` and of every parameter by name under a random projection of the
  logits. Cases: the released flags (separate heads, s_to_z product, z inputs) with B = 2,
  m = 1 and B = 1, m = 3 (Boltz's separate heads broadcast the chain mask of one element over
  the samples); shared heads without product and z inputs, B = 2, m = 2.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("boltz", reason="the boltz package is not installed (see tests/interop/README.md)")

from boltz.model.modules.confidencev2 import ConfidenceModule as BoltzConfidence  # noqa: E402

from twinshard.pair.reference.confidence import ConfidenceModule  # noqa: E402
from twinshard.testing import assert_parity, random_grad_output, randomize_parameters  # noqa: E402
from twinshard.testing.checks import tolerance  # noqa: E402

ANALYTIC_ZERO = "attention.proj_z.0.bias"  # the pair-bias LayerNorm's bias shifts a whole softmax row

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "pair"))
from confidence_inputs import FIGURES, LOGITS, chain_pairs, confidence_case, confidence_config  # noqa: E402

F64 = torch.float64


@contextlib.contextmanager
def boltz_fp64():
    """``Tensor.float()`` keeps fp64 (and makes integer/bool tensors fp64) while Boltz runs."""
    orig = torch.Tensor.float
    torch.Tensor.float = lambda self, *a, **k: self.to(F64)
    try:
        yield
    finally:
        torch.Tensor.float = orig


def _build(cfg: dict):
    theirs = BoltzConfidence(**{**cfg, "pairformer_args": dict(cfg["pairformer_args"])}).double()
    with torch.no_grad():
        randomize_parameters(theirs, seed=11, scale=0.3, shift=0.05)
    ours = ConfidenceModule(**cfg).double()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    return ours, theirs


def _run(module, case, ctx=contextlib.nullcontext):
    leaves = {k: case[k].clone().requires_grad_() for k in ("s_inputs", "s", "z")}
    with ctx():
        out = module(
            leaves["s_inputs"],
            leaves["s"],
            leaves["z"],
            case["x_pred"],
            case["feats"],
            case["pdist"],
            multiplicity=case["m"],
        )
    return out, leaves


def real_mask(token_pad_mask: torch.Tensor, m: int) -> dict[str, torch.Tensor]:
    """Bool masks of the real entries of the logits and per-token figures. Boltz's padding tokens
    (``token_pad_mask`` 0) are masked in the Pairformer's attention; their rows are fully masked
    softmaxes whose values are round-off sensitive (Boltz's -1e9 mask bias), and Boltz's derived
    figures never read them: the comparison covers the real tokens (every real pair)."""
    t = token_pad_mask.repeat_interleave(m, 0) > 0
    pair = t[:, :, None] & t[:, None, :]
    return {
        "pae_logits": pair,
        "pde_logits": pair,
        "pae": pair,
        "pde": pair,
        "plddt_logits": t,
        "resolved_logits": t,
        "plddt": t,
    }


def grad_on_real(out: torch.Tensor, keep: torch.Tensor, seed: int) -> torch.Tensor:
    """A random grad_output on the real entries, zero on Boltz's padding tokens."""
    g = random_grad_output(out.reshape(-1), seed=seed).reshape(out.shape)
    return g * keep.reshape(keep.shape + (1,) * (g.dim() - keep.dim())).to(g.dtype)


CASES = [
    dict(b=2, n=11, m=1, flags={}),
    dict(b=1, n=10, m=3, flags={}),
    dict(b=2, n=9, m=2, flags=dict(separate=False, prod=False, z_inputs=False)),
]


@pytest.mark.parametrize("case", CASES, ids=[f"B{c['b']}-N{c['n']}-m{c['m']}" for c in CASES])
def test_confidence_matches_boltz(case):
    cfg = confidence_config(**case["flags"])
    ours, theirs = _build(cfg)
    inp = confidence_case(case["b"], case["n"], cfg, m=case["m"], seed=case["n"])
    out_o, leaves_o = _run(ours, inp)
    out_t, leaves_t = _run(theirs, inp, boltz_fp64)
    what = f"ConfidenceModule B={case['b']} N={case['n']} m={case['m']} {case['flags']}"
    real = real_mask(inp["feats"]["token_pad_mask"], case["m"])
    for k in LOGITS + FIGURES:
        assert out_o[k].dtype == F64 and out_t[k].dtype == F64, (k, out_o[k].dtype, out_t[k].dtype)
        keep = real[k] if k in real else slice(None)
        assert_parity(out_o[k][keep], out_t[k][keep], what=f"{what} {k} vs boltz")
    assert sorted(out_o["pair_chains_iptm"]) == sorted(out_t["pair_chains_iptm"])
    assert_parity(chain_pairs(out_o), chain_pairs(out_t), what=f"{what} pair_chains_iptm vs boltz")
    assert float(out_t["iptm"].max()) > 0 and float(out_t["ligand_iptm"].max()) > 0, "vacuous ipTM"

    gos = [grad_on_real(out_t[k], real[k], 300 + i) for i, k in enumerate(LOGITS)]
    names = ["s_inputs", "s", "z"] + [n for n, p in theirs.named_parameters() if p.requires_grad]
    p_o = [p for p in ours.parameters() if p.requires_grad]
    p_t = [p for p in theirs.parameters() if p.requires_grad]
    g_o = torch.autograd.grad([out_o[k] for k in LOGITS], list(leaves_o.values()) + p_o, gos)
    with boltz_fp64():
        g_t = torch.autograd.grad([out_t[k] for k in LOGITS], list(leaves_t.values()) + p_t, gos)
    scale = max(float(e.abs().max()) for e in g_t)
    for name, a, e in zip(names, g_o, g_t):
        if name.endswith(ANALYTIC_ZERO):  # a softmax shift: zero in exact arithmetic, round-off here
            t = tolerance(e.dtype, scale)
            for side, g in (("ours", a), ("boltz", e)):
                assert_parity(
                    g,
                    torch.zeros_like(g),
                    what=f"{what} {side} grad {name} (zero)",
                    rtol=0.0,
                    atol=t.atol,
                    why=f"analytically zero; {t.why}",
                )
            continue
        assert_parity(a, e, what=f"{what} grad {name} vs boltz")


# -- cp_twin_of(boltz ConfidenceModule) on a grid against boltz's module itself -------------------

from test_confidence_cp import DIFF, KINDS, ZERO, run_twin  # noqa: E402

from twinshard.pair.interop.boltz import cp_twin_of  # noqa: E402
from twinshard.testing import check_twin, grid_id, run_on_grid, serial_reference  # noqa: E402

CP_CASES = [((2, 2), dict(b=1, n=11, m=2, flags={})), ((2, 3), dict(b=1, n=13, m=1, flags={}))]


def _boltz_rank(grid, c):
    _, theirs = _build(confidence_config(**c["flags"]))
    twin = cp_twin_of(theirs)
    assert type(twin).__name__ == "CPConfidenceModule"
    return run_twin(grid, twin, c)


@pytest.mark.parametrize("grid,c", CP_CASES, ids=[grid_id(g) for g, _ in CP_CASES])
def test_cp_twin_of_confidence_vs_boltz(grid, c):
    """One element without padding tokens (Boltz's padding rows are round-off sensitive, see
    ``real_mask``), so every entry of every output is compared."""
    got = run_on_grid(_boltz_rank, grid, c)
    _, theirs = _build(confidence_config(**c["flags"]))
    case = confidence_case(c["b"], c["n"], confidence_config(**c["flags"]), m=c["m"], seed=c["n"])
    assert bool((case["feats"]["token_pad_mask"] > 0).all())

    def run(**x):
        with boltz_fp64():
            out = theirs(
                x["s_inputs"],
                x["s"],
                x["z"],
                case["x_pred"],
                case["feats"],
                case["pdist"],
                multiplicity=c["m"],
            )
        run.out = out
        return torch.cat([out[k].reshape(-1) for k in DIFF])

    ref = serial_reference(theirs, run, {k: case[k] for k in KINDS}, grad_seed=8)
    out = run.out
    figs = torch.cat([out[k].reshape(-1) for k in FIGURES[3:]] + [chain_pairs(out).reshape(-1)])
    ref["serial_out"] = torch.cat([ref["serial_out"], figs.detach()])
    ref["serial_param_grads"] = {k: p.grad for k, p in theirs.named_parameters() if p.requires_grad}
    what = f"cp_twin_of(boltz ConfidenceModule) {c}"
    check_twin(what=what, grid=grid_id(grid), ranks=[g[0] for g in got], zero_grads=ZERO, **ref)
