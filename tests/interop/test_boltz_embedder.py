"""The input embedder's serial references against the ``boltz`` package's own modules (Boltz-2,
boltz 2.2.1): ``InputEmbedder``, ``AtomEncoder`` (+ ``AtomAttentionEncoder``) in fp64, every
parameter randomised (the zero-initialised ones included), forward and backward (every parameter
gradient by name, the gradient of ``ref_pos``), B = 2, uneven atoms per token, Boltz's default
windows (32 x 128) and small ones (8 x 32) that make many windows.

Boltz casts integer one-hots and masks with ``.float()`` (and builds its window indexing matrix
so); :func:`boltz_all_fp64` turns every ``.float()`` into ``.double()`` while a Boltz module runs
(integer values are exact either way), so both sides compute in fp64.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("boltz", reason="the boltz package is not installed (see tests/interop/README.md)")

from boltz.model.modules.encodersv2 import AtomAttentionEncoder as BoltzAtomAttentionEncoder  # noqa: E402
from boltz.model.modules.encodersv2 import AtomEncoder as BoltzAtomEncoder  # noqa: E402
from boltz.model.modules.trunkv2 import InputEmbedder as BoltzInputEmbedder  # noqa: E402

from twinshard.pair.reference.atom_encoder import AtomAttentionEncoder, AtomEncoder  # noqa: E402
from twinshard.pair.reference.input_embedder import InputEmbedder  # noqa: E402
from twinshard.testing import assert_parity, random_grad_output, randomize_parameters  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "pair"))
from embed_inputs import atom_complex, embedder_config  # noqa: E402

F64 = torch.float64
# atom_enc_proj_z's LayerNorm bias adds one constant to every logit of a window row (per layer and
# head), which the softmax cancels: its gradient is zero in exact arithmetic.
ANALYTIC_ZERO = ("atom_enc_proj_z.0.bias",)


@pytest.fixture
def boltz_all_fp64(monkeypatch):
    """While open, ``Tensor.float()`` returns fp64 (Boltz's modules run inside it, ours outside)."""

    @contextlib.contextmanager
    def ctx():
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "float", lambda self, *a, **k: self.double())
            yield

    return ctx


def encoder_kwargs(cfg: dict) -> dict:
    keys = ("atom_s", "atom_z", "token_s", "token_z", "atoms_per_window_queries", "atoms_per_window_keys")
    out = {k: cfg[k] for k in keys} | {
        "atom_feature_dim": cfg["atom_feature_dim"],
        "structure_prediction": False,
    }
    return out | {
        k: cfg[k] for k in ("use_no_atom_char", "use_atom_backbone_feat", "use_residue_feats_atoms")
    }


def grads_match(what, out_o, out_t, ours, theirs, leaves_o, leaves_t, ctx, seed=5, zero_ok=ANALYTIC_ZERO):
    assert out_o.dtype == F64 and out_t.dtype == F64
    assert_parity(out_o, out_t, what=f"{what} vs boltz out")
    go = random_grad_output(out_t, seed=seed)
    names = [f"d/d{k}" for k in leaves_o] + [n for n, _ in theirs.named_parameters()]
    g_o = torch.autograd.grad(out_o, list(leaves_o.values()) + list(ours.parameters()), go)
    with ctx():
        g_t = torch.autograd.grad(out_t, list(leaves_t.values()) + list(theirs.parameters()), go)
    scale = max(float(g.abs().max()) for g in g_t)
    for name, a, e in zip(names, g_o, g_t):
        if name.endswith(zero_ok):
            tol = 2.3e-13 * scale
            why = f"analytically zero: round-off of cancelling terms, 2.3e-13 x max|grad| {scale:.3g}"
            assert_parity(a, torch.zeros_like(a), what=f"{what} grad {name}", rtol=0.0, atol=tol, why=why)
            continue
        assert bool(e.abs().max() > 0), f"{what}: vacuous gradient for {name}"
        assert_parity(a, e, what=f"{what} vs boltz grad {name}")


def load(ours, theirs, seed):
    theirs.double()
    randomize_parameters(theirs, seed=seed)
    ours.double()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]


WINDOWS = [(32, 128), (8, 32)]


@pytest.mark.parametrize("w,h", WINDOWS, ids=[f"{w}x{h}" for w, h in WINDOWS])
@pytest.mark.parametrize(
    "flags",
    [
        {},
        {
            "use_no_atom_char": True,
            "use_atom_backbone_feat": False,
            "use_residue_feats_atoms": False,
            "add_method_conditioning": False,
            "add_cyclic_flag": False,
        },
    ],
    ids=["all", "plain"],
)
def test_input_embedder_vs_boltz(w, h, flags, boltz_all_fp64):
    cfg = embedder_config(w, h, **flags)
    theirs, ours = BoltzInputEmbedder(**cfg), InputEmbedder(**cfg)
    load(ours, theirs, seed=1)
    feats = atom_complex(2, 11, (3, 8), seed=2, w=w)
    pos_o = feats["ref_pos"].clone().requires_grad_()
    pos_t = feats["ref_pos"].clone().requires_grad_()
    out_o = ours(feats | {"ref_pos": pos_o})
    with boltz_all_fp64():
        out_t = theirs(feats | {"ref_pos": pos_t})
    grads_match(
        f"InputEmbedder {w}x{h}",
        out_o,
        out_t,
        ours,
        theirs,
        {"ref_pos": pos_o},
        {"ref_pos": pos_t},
        boltz_all_fp64,
    )


def test_atom_encoders_vs_boltz(boltz_all_fp64):
    """AtomEncoder's (q, c, p) and AtomAttentionEncoder's (a, q) with Boltz's, as Boltz chains them."""
    cfg = embedder_config(8, 32)
    enc_t, enc_o = BoltzAtomEncoder(**encoder_kwargs(cfg)), AtomEncoder(**encoder_kwargs(cfg))
    load(enc_o, enc_t, seed=3)
    kw = dict(
        atom_s=8,
        token_s=6,
        atoms_per_window_queries=8,
        atoms_per_window_keys=32,
        atom_encoder_depth=2,
        atom_encoder_heads=2,
        structure_prediction=False,
    )
    att_t, att_o = BoltzAtomAttentionEncoder(**kw), AtomAttentionEncoder(**kw)
    load(att_o, att_t, seed=4)
    feats = atom_complex(2, 10, (3, 8), seed=5, w=8)
    proj = torch.nn.Linear(cfg["atom_z"], 4, bias=False).double()  # p -> the 2 layers x 2 heads bias

    def run(enc, att, pos):
        q, c, p, to_keys = enc(feats | {"ref_pos": pos})
        a, q2, _, _ = att(feats=feats | {"ref_pos": pos}, q=q, c=c, atom_enc_bias=proj(p), to_keys=to_keys)
        return torch.cat([q.flatten(), p.flatten(), a.flatten(), q2.flatten()])

    pos_o = feats["ref_pos"].clone().requires_grad_()
    pos_t = feats["ref_pos"].clone().requires_grad_()
    out_o = run(enc_o, att_o, pos_o)
    with boltz_all_fp64():
        out_t = run(enc_t, att_t, pos_t)
    both_o, both_t = torch.nn.ModuleList([enc_o, att_o]), torch.nn.ModuleList([enc_t, att_t])
    grads_match(
        "AtomEncoder+AtomAttentionEncoder",
        out_o,
        out_t,
        both_o,
        both_t,
        {"ref_pos": pos_o},
        {"ref_pos": pos_t},
        boltz_all_fp64,
        zero_ok=(),
    )


# -- cp_twin_of(boltz module) against the boltz module, on a grid ---------------------------------


def _boltz_embedder(w, h):
    m = BoltzInputEmbedder(**embedder_config(w, h)).double()
    randomize_parameters(m, seed=21)
    return m


def _boltz_encoders():
    cfg = embedder_config(8, 32)
    enc = BoltzAtomEncoder(**encoder_kwargs(cfg)).double()
    att = BoltzAtomAttentionEncoder(
        atom_s=8,
        token_s=6,
        atoms_per_window_queries=8,
        atoms_per_window_keys=32,
        atom_encoder_depth=2,
        atom_encoder_heads=2,
        structure_prediction=False,
    ).double()
    proj = torch.nn.Linear(cfg["atom_z"], 4, bias=False).double()
    for k, m in enumerate((enc, att, proj)):
        randomize_parameters(m, seed=30 + k)
    return enc, att, proj


def _rank_cp(grid, part, n):
    from twinshard.pair.features import collect_grad, collect_tensor, distribute
    from twinshard.pair.interop.boltz import cp_twin_of
    from twinshard.pair.layers.atom_encoder import synced_call

    feats = atom_complex(2, n, (3, 8), seed=22, w=8)
    pos = feats["ref_pos"].clone().requires_grad_()
    d = distribute(feats | {"ref_pos": pos}, grid)
    if part == "InputEmbedder":
        twin = cp_twin_of(_boltz_embedder(8, 32))
        out = collect_tensor(twin(d))
        mods = [twin]
    else:
        enc, att, proj = _boltz_encoders()
        t_enc, t_att = cp_twin_of(enc), cp_twin_of(att)
        q, c, p, to_keys = t_enc(d)
        # p holds this rank's windows: a module on it is replicated along the grid row like the
        # twins, so its parameter gradient is summed over the grid column (synced_call)
        a, q2, _, _ = t_att(d, q, c, synced_call(proj, d["ref_pos"], (p,)), to_keys)
        out = torch.cat([collect_tensor(a).flatten(), collect_tensor(q2).flatten()])
        mods = [t_enc, t_att, proj]
    out.backward(random_grad_output(out, seed=23))
    grads = {f"{i}.{k}": p.grad for i, m in enumerate(mods) for k, p in m.named_parameters()}
    return out.detach(), collect_grad(pos.grad, "atom", grid), grads


@pytest.mark.parametrize("part", ["InputEmbedder", "AtomEncoder+AtomAttentionEncoder"])
def test_cp_twin_of_vs_boltz(part, boltz_all_fp64):
    from twinshard.testing import grid_id, run_on_grid

    grid, n = (2, 2), 11
    ranks = run_on_grid(_rank_cp, grid, part, n)
    feats = atom_complex(2, n, (3, 8), seed=22, w=8)
    pos = feats["ref_pos"].clone().requires_grad_()
    with boltz_all_fp64():
        if part == "InputEmbedder":
            mods = [_boltz_embedder(8, 32)]
            out = mods[0](feats | {"ref_pos": pos})
        else:
            mods = list(_boltz_encoders())
            enc, att, proj = mods
            q, c, p, to_keys = enc(feats | {"ref_pos": pos})
            a, q2, _, _ = att(
                feats=feats | {"ref_pos": pos}, q=q, c=c, atom_enc_bias=proj(p), to_keys=to_keys
            )
            out = torch.cat([a.flatten(), q2.flatten()])
        out.backward(random_grad_output(out, seed=23))
    what = f"cp_twin_of({part}) {grid_id(grid)}"
    for rank, (o, g_pos, grads) in enumerate(ranks):
        assert_parity(o, out.detach(), what=f"{what} out (rank {rank})", grid=grid_id(grid))
        assert_parity(g_pos, pos.grad, what=f"{what} d/dref_pos (rank {rank})", grid=grid_id(grid))
        want = {f"{i}.{k}": p.grad for i, m in enumerate(mods) for k, p in m.named_parameters()}
        assert set(grads) == set(want)
        scale = max(float(g.abs().max()) for g in want.values())
        for k, g in want.items():
            if k.endswith(ANALYTIC_ZERO):
                why = f"analytically zero: round-off of cancelling terms, 2.3e-13 x max|grad| {scale:.3g}"
                assert_parity(
                    grads[k],
                    torch.zeros_like(g),
                    what=f"{what} grad {k}",
                    rtol=0.0,
                    atol=2.3e-13 * scale,
                    why=why,
                )
                continue
            assert bool(g.abs().max() > 0), f"{what}: vacuous gradient for {k}"
            assert_parity(grads[k], g, what=f"{what} grad {k} (rank {rank})", grid=grid_id(grid))
