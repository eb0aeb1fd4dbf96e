"""The serial references against the ``boltz`` package's own modules (Boltz-2, boltz 2.2.1).

Each test builds a Boltz module, randomises its parameters, loads its ``state_dict`` unchanged
(``strict=True``) into our reference and compares forward, the input gradients and every
parameter gradient (by name) in fp64, for one random grad_output, B = 2, uneven N and random
masks. Boltz casts some operands with ``.float()``; inside :func:`boltz_fp64` (only while a Boltz
module runs) ``Tensor.float`` keeps fp64 as fp64, so both sides compute in fp64 and the
round-off gate of ``assert_parity`` applies. Our references never run under that patch.

``boltz`` lives in its own environment (its pins conflict with the main one); see
``tests/interop/README.md`` for the install commands. Without it these tests are skipped.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("boltz", reason="the boltz package is not installed (see tests/interop/README.md)")

from boltz.model.layers import pairformer as boltz_pairformer  # noqa: E402
from boltz.model.layers.attentionv2 import AttentionPairBias as BoltzAttentionPairBias  # noqa: E402
from boltz.model.layers.outer_product_mean import OuterProductMean as BoltzOuterProductMean  # noqa: E402
from boltz.model.layers.transition import Transition as BoltzTransition  # noqa: E402
from boltz.model.layers.triangular_attention.attention import (  # noqa: E402
    TriangleAttentionEndingNode as BoltzTriAttEnd,
)
from boltz.model.layers.triangular_attention.attention import (  # noqa: E402
    TriangleAttentionStartingNode as BoltzTriAttStart,
)
from boltz.model.layers.triangular_mult import (  # noqa: E402
    TriangleMultiplicationIncoming as BoltzTriMulIn,
)
from boltz.model.layers.triangular_mult import (  # noqa: E402
    TriangleMultiplicationOutgoing as BoltzTriMulOut,
)
from boltz.model.loss.distogramv2 import distogram_loss as boltz_distogram_loss  # noqa: E402
from boltz.model.modules.trunkv2 import DistogramModule as BoltzDistogram  # noqa: E402

from twinshard.pair.reference import (  # noqa: E402
    AttentionPairBias,
    DistogramHead,
    Dropout,
    OuterProductMean,
    PairformerLayer,
    PairformerStack,
    Transition,
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
    assign_dropout_streams,
    distogram_loss,
    distogram_target,
)
from twinshard.testing import assert_parity, random_grad_output, random_mask, randomize_parameters, synthetic  # noqa: E402

B = 2
F64 = torch.float64
ANALYTIC_ZERO = ("proj_z.0.bias",)  # the pair-bias LayerNorm's bias shifts a whole softmax row


@pytest.fixture
def boltz_fp64(monkeypatch):
    """A context manager: while it is open, ``Tensor.float()`` keeps fp64 (and casts lower
    precisions to fp32 as before). Boltz's modules run inside it, ours outside."""

    orig = torch.Tensor.float

    def keep64(self, *args, **kwargs):
        return self if self.dtype == F64 else orig(self, *args, **kwargs)

    @contextlib.contextmanager
    def ctx():
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "float", keep64)
            yield

    return ctx


def load_into(ours: torch.nn.Module, theirs: torch.nn.Module, seed: int) -> None:
    """Random parameters in Boltz's module, loaded unchanged (strict) into ours."""
    theirs.double()
    randomize_parameters(theirs, seed=seed)
    ours.double()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]


def compare(ours, theirs, run_ours, run_theirs, inputs, what, boltz_fp64, zero_ok=ANALYTIC_ZERO):
    """Forward parity and the gradients of every input and (same-named) parameter."""
    out_o = run_ours(*inputs)
    with boltz_fp64():
        out_t = run_theirs(*inputs)
    out_o = out_o if isinstance(out_o, tuple) else (out_o,)
    out_t = out_t if isinstance(out_t, tuple) else (out_t,)
    for k, (a, e) in enumerate(zip(out_o, out_t)):
        assert a.dtype == F64 and e.dtype == F64, (a.dtype, e.dtype)
        assert_parity(a, e, what=f"{what} vs boltz out{k}")
    gos = [random_grad_output(o.reshape(-1), seed=300 + k).reshape(o.shape) for k, o in enumerate(out_t)]
    names = [f"input{k}" for k in range(len(inputs))] + [n for n, _ in theirs.named_parameters()]
    g_o = torch.autograd.grad(out_o, list(inputs) + list(ours.parameters()), gos, allow_unused=True)
    with boltz_fp64():
        g_t = torch.autograd.grad(out_t, list(inputs) + list(theirs.parameters()), gos, allow_unused=True)
    scale = max(float(g.abs().max()) for g in g_t if g is not None)
    for name, a, e in zip(names, g_o, g_t):
        assert a is not None and e is not None, f"{what}: no gradient for {name}"
        if name.endswith(zero_ok):
            tol = 2.3e-13 * scale
            why = f"analytically zero: round-off of cancelling terms, 2.3e-13 x max|grad| {scale:.3g}"
            assert_parity(a, torch.zeros_like(a), what=f"{what} grad {name}", rtol=0.0, atol=tol, why=why)
            continue
        assert bool(e.abs().max() > 0), f"{what}: vacuous gradient for {name}"
        assert_parity(a, e, what=f"{what} vs boltz grad {name}")


def pair_mask_with_diagonal(n: int, seed: int) -> torch.Tensor:
    """A random pair mask whose diagonal is kept: every row and column has a valid key."""
    m = random_mask(B, n, n, seed=seed)
    m[:, torch.arange(n), torch.arange(n)] = 1.0
    return m


# -- parts ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
@pytest.mark.parametrize("n", [5, 7])
def test_triangle_multiplication_vs_boltz(direction, n, boltz_fp64):
    c = 4
    theirs = BoltzTriMulOut(c) if direction == "outgoing" else BoltzTriMulIn(c)
    ours = TriangleMultiplicationOutgoing(c) if direction == "outgoing" else TriangleMultiplicationIncoming(c)
    load_into(ours, theirs, seed=1)
    z = synthetic(B, n, n, c, seed=2).requires_grad_()
    mask = random_mask(B, n, n, seed=3)
    compare(
        ours,
        theirs,
        lambda z: ours(z, mask),
        lambda z: theirs(z, mask),
        [z],
        f"trimul-{direction}",
        boltz_fp64,
    )


@pytest.mark.parametrize("starting", [True, False], ids=["start", "end"])
@pytest.mark.parametrize("n", [5, 7])
def test_triangle_attention_vs_boltz(starting, n, boltz_fp64):
    c = 4
    theirs = BoltzTriAttStart(c, 3, 2, inf=1e9) if starting else BoltzTriAttEnd(c, 3, 2, inf=1e9)
    ours = (TriangleAttentionStartingNode if starting else TriangleAttentionEndingNode)(c, 3, 2)
    load_into(ours, theirs, seed=4)
    z = synthetic(B, n, n, c, seed=5).requires_grad_()
    mask = pair_mask_with_diagonal(n, seed=6)
    compare(ours, theirs, lambda z: ours(z, mask), lambda z: theirs(z, mask=mask), [z], "triatt", boltz_fp64)


def test_triangle_attention_fully_masked_row_vs_boltz(boltz_fp64):
    """A row without a valid key: Boltz adds -1e9 to every logit, which the softmax cancels up to
    the rounding of each logit to ulp(1e9); we drop the shift. Other rows match at round-off."""
    n, c = 6, 4
    theirs, ours = BoltzTriAttStart(c, 3, 2, inf=1e9), TriangleAttentionStartingNode(c, 3, 2)
    load_into(ours, theirs, seed=7)
    z = synthetic(B, n, n, c, seed=8)
    mask = pair_mask_with_diagonal(n, seed=9)
    mask[0, 2, :] = 0
    out_o = ours(z, mask)
    with boltz_fp64():
        out_t = theirs(z, mask=mask)
    dead = mask.amax(-1) == 0
    assert int(dead.sum()) == 1
    assert_parity(out_o[~dead], out_t[~dead], what="triatt valid rows vs boltz")
    ulp = float(torch.finfo(F64).eps) * 2.0**30  # ulp(1e9) = 2^-52 * 2^29 = 1.19e-7; doubled
    tol = 4 * ulp * float(out_t[dead].detach().abs().max() + 1)
    assert_parity(
        out_o[dead],
        out_t[dead],
        what="triatt fully masked row vs boltz",
        rtol=0.0,
        atol=tol,
        why=f"Boltz rounds each logit of the row to ulp(1e9)~1.2e-7: softmax weights carry relative error "
        f"<= 2.4e-7, the gated, projected output <= 4 x 2.4e-7 x (max|out| + 1) = {tol:.2g}",
    )


@pytest.mark.parametrize("n", [5, 7])
def test_attention_pair_bias_vs_boltz(n, boltz_fp64):
    cs, cz, h = 6, 4, 2
    theirs, ours = BoltzAttentionPairBias(cs, cz, h), AttentionPairBias(cs, cz, h)
    load_into(ours, theirs, seed=10)
    s = synthetic(B, n, cs, seed=11).requires_grad_()
    kin = synthetic(B, n, cs, seed=12).requires_grad_()
    z = synthetic(B, n, n, cz, seed=13).requires_grad_()
    mask = random_mask(B, n, seed=14)
    compare(
        ours,
        theirs,
        lambda s, z, kin: ours(s, z, mask, k_in=kin),
        lambda s, z, kin: theirs(s=s, z=z, mask=mask, k_in=kin),
        [s, z, kin],
        "attn-pair-bias",
        boltz_fp64,
    )


def test_transition_vs_boltz(boltz_fp64):
    theirs, ours = BoltzTransition(4, 12), Transition(4, 12)
    load_into(ours, theirs, seed=15)
    x = synthetic(B, 5, 3, 4, seed=16).requires_grad_()
    compare(ours, theirs, ours, theirs, [x], "transition", boltz_fp64)


@pytest.mark.parametrize("n", [5, 7])
def test_outer_product_mean_vs_boltz(n, boltz_fp64):
    theirs, ours = BoltzOuterProductMean(4, 3, 5), OuterProductMean(4, 3, 5)
    load_into(ours, theirs, seed=17)
    m = synthetic(B, 3, n, 4, seed=18).requires_grad_()
    mask = random_mask(B, 3, n, seed=19)
    compare(ours, theirs, lambda m: ours(m, mask), lambda m: theirs(m, mask), [m], "opm", boltz_fp64)


def test_distogram_head_and_loss_vs_boltz(boltz_fp64):
    n, nb = 7, 8
    theirs, ours = BoltzDistogram(4, nb), DistogramHead(4, nb)
    load_into(ours, theirs, seed=20)
    z = synthetic(B, n, n, 4, seed=21).requires_grad_()
    target = distogram_target(synthetic(B, n, 2, 3, seed=22, scale=8.0), num_bins=nb)  # two conformers
    mask = random_mask(B, n, seed=23)

    def run_theirs(z):
        feats = {"disto_target": target, "token_disto_mask": mask}
        return boltz_distogram_loss({"pdistogram": theirs(z)}, feats)

    compare(
        ours,
        theirs,
        lambda z: distogram_loss(ours(z), target, mask),
        run_theirs,
        [z],
        "distogram",
        boltz_fp64,
    )


def test_distogram_loss_empty_targets_vs_boltz(boltz_fp64):
    """Token pairs with no target mass (a token's row, one pair, both conformers' counts zero) on
    real tokens: Boltz normalises by max(1, mass), so they add nothing yet count in the mean's
    denominator; the reference (and through tests/pair/test_distogram.py its CP twin) does the same."""
    n, nb = 7, 8
    theirs, ours = BoltzDistogram(4, nb), DistogramHead(4, nb)
    load_into(ours, theirs, seed=24)
    z = synthetic(B, n, n, 4, seed=25).requires_grad_()
    target = distogram_target(synthetic(B, n, 2, 3, seed=26, scale=8.0), num_bins=nb)
    target[0, 1, :] = 0
    target[0, 5, 2] = target[1, 4, 6] = target[1, 6, 4] = 0
    mask = torch.ones(B, n, dtype=F64)
    mask[1, 0] = 0

    def run_theirs(z):
        feats = {"disto_target": target, "token_disto_mask": mask}
        return boltz_distogram_loss({"pdistogram": theirs(z)}, feats)

    compare(
        ours,
        theirs,
        lambda z: distogram_loss(ours(z), target, mask),
        run_theirs,
        [z],
        "distogram empty targets",
        boltz_fp64,
    )


# -- the Pairformer layer and stack ---------------------------------------------------------------
def trunk_inputs(n: int, cs: int, cz: int, seed: int):
    s = synthetic(B, n, cs, seed=seed).requires_grad_()
    z = synthetic(B, n, n, cz, seed=seed + 1).requires_grad_()
    mask = random_mask(B, n, seed=seed + 2)
    pair_mask = pair_mask_with_diagonal(n, seed=seed + 3)
    return s, z, mask, pair_mask


@contextlib.contextmanager
def boltz_uses_our_masks(monkeypatch, sites: list[Dropout], seed: int):
    """Boltz's ``get_dropout_mask`` returns, call by call, our sites' masks (the same sites in
    the same order); it checks that Boltz asks for the same axis and broadcast shape."""
    calls = iter(sites)
    dropped: list[bool] = []

    def get_dropout_mask(dropout, z, training, columnwise=False):
        site = next(calls)
        assert site.columnwise == columnwise and site.p == dropout and training
        v = z[:, 0:1, :, 0:1] if columnwise else z[:, :, 0:1, 0:1]
        mask = site.mask(z.shape, seed, z.dtype, z.device)
        assert mask.shape == v.shape, (mask.shape, v.shape)
        dropped.append(bool((mask == 0).any()))
        return mask

    with monkeypatch.context() as m:
        m.setattr(boltz_pairformer, "get_dropout_mask", get_dropout_mask)
        yield
    assert next(calls, None) is None, "Boltz drew fewer dropout masks than our sites"
    assert any(dropped) == any(site.p > 0 for site in sites), "dropout on, yet no entry dropped"


@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no-dropout", "boltz-dropout"])
@pytest.mark.parametrize("blocks", [1, 2], ids=["layer", "stack2"])
def test_pairformer_vs_boltz(dropout, blocks, boltz_fp64, monkeypatch):
    cs, cz, n = 4, 4, 6
    kw = dict(num_heads=2, dropout=dropout, pairwise_head_width=2, pairwise_num_heads=2)
    if blocks == 1:
        theirs = boltz_pairformer.PairformerLayer(cs, cz, v2=True, **kw)
        ours = PairformerLayer(cs, cz, **kw)
        assign_dropout_streams(ours)
    else:
        theirs = boltz_pairformer.PairformerModule(cs, cz, blocks, v2=True, **kw)
        ours = PairformerStack(cs, cz, blocks, **kw)
    load_into(ours, theirs, seed=24)
    theirs.train()
    ours.train()
    s, z, mask, pair_mask = trunk_inputs(n, cs, cz, seed=25)
    seed = 99
    sites = [m for m in ours.modules() if isinstance(m, Dropout)]
    assert len(sites) == 4 * blocks

    def run_theirs(s, z):
        with boltz_uses_our_masks(monkeypatch, sites, seed):
            return theirs(s, z, mask, pair_mask)

    compare(
        ours,
        theirs,
        lambda s, z: ours(s, z, mask, pair_mask, seed=seed),
        run_theirs,
        [s, z],
        "pairformer",
        boltz_fp64,
    )


def test_trunk_checkpoint_loads_into_boltz(tmp_path, boltz_fp64):
    """A checkpoint of twinshard's trunk (``pair.train.save_checkpoint``: plain tensors with the
    serial names) loads unchanged (strict) into Boltz's ``PairformerModule``, which then computes
    what our stack computes (eval mode, fp64)."""
    from twinshard.pair.train import Trunk, save_checkpoint

    cs, cz, n, blocks = 4, 4, 6, 2
    kw = dict(num_heads=2, dropout=0.0, pairwise_head_width=2, pairwise_num_heads=2)
    trunk = Trunk(cs, cz, blocks, num_bins=8, **kw).double()
    randomize_parameters(trunk, seed=31)
    path = tmp_path / "trunk.pt"
    save_checkpoint(path, trunk)
    state = torch.load(path, weights_only=True)["model"]
    prefix = "pairformer_module."
    theirs = boltz_pairformer.PairformerModule(cs, cz, blocks, v2=True, **kw).double()
    theirs.load_state_dict(
        {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}, strict=True
    )
    theirs.eval()
    ours = trunk.pairformer_module.eval()
    s, z, mask, pair_mask = trunk_inputs(n, cs, cz, seed=41)
    out_o = ours(s, z, mask, pair_mask)
    with boltz_fp64():
        out_t = theirs(s, z, mask, pair_mask)
    for k, (a, e) in enumerate(zip(out_o, out_t)):
        assert_parity(a, e, what=f"trunk checkpoint in boltz PairformerModule: out{k}")
