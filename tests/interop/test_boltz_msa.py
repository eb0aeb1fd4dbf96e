"""The MSA module's parts against the ``boltz`` package's own modules (Boltz-2, boltz 2.2.1).

Serial references (``twinshard.pair.reference``) and CP twins (``cp_twin_of``) against Boltz's
modules, fp64 (Boltz's ``.float()`` casts kept fp64 by the ``boltz_fp64`` fixture of
``test_boltz_reference``), forward, every input gradient and every parameter gradient by name.

What each test proves:
- ``test_noseq_reference_vs_boltz``: ``PairformerNoSeqLayer`` / ``PairformerNoSeqModule`` (2
  layers) equal Boltz's with dropout off (eval mode: Boltz's chunked triangle attention) and with
  Boltz's dropout on (p = 0.25; Boltz's ``get_dropout_mask`` patched to hand out our sites'
  masks, their shapes checked), Boltz's ``state_dict`` loaded strict.
- ``test_noseq_twin_vs_boltz``: ``cp_twin_of`` (Boltz's NoSeq layer / module) on 2x2 (N=7) and
  2x3 (N=9) equals Boltz's module, training mode with dropout.

Without ``boltz`` importable (the main environment) the file is skipped.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("boltz", reason="the boltz package is not installed (see tests/interop/README.md)")

from boltz.model.layers import pairformer as boltz_pairformer  # noqa: E402
from test_boltz_reference import (  # noqa: E402,F401  (fixtures)
    boltz_fp64,
    boltz_uses_our_masks,
    compare,
    load_into,
    pair_mask_with_diagonal,
)

from twinshard.pair.features import PairLayout, collect_grad, collect_tensor, real_part, shard_tensor  # noqa: E402
from twinshard.pair.interop.boltz import cp_twin_of  # noqa: E402
from twinshard.pair.reference import (  # noqa: E402
    Dropout,
    PairformerNoSeqLayer,
    PairformerNoSeqModule,
    assign_dropout_streams,
)
from twinshard.testing import (  # noqa: E402
    TwinResult,
    check_twin,
    grid_id,
    parameter_signature,
    random_grad_output,
    randomize_parameters,
    run_on_grid,
    serial_reference,
    synthetic,
)

B = 2
CZ = 4
DROPOUT_SEED = 77
TIMEOUT = 900.0
NOSEQ_KW = dict(pairwise_head_width=2, pairwise_num_heads=2)


def _noseq_pair(blocks: int, dropout: float):
    if blocks == 1:
        theirs = boltz_pairformer.PairformerNoSeqLayer(CZ, dropout=dropout, **NOSEQ_KW)
        ours = PairformerNoSeqLayer(CZ, dropout=dropout, **NOSEQ_KW)
        assign_dropout_streams(ours)
    else:
        theirs = boltz_pairformer.PairformerNoSeqModule(CZ, blocks, dropout=dropout, **NOSEQ_KW)
        ours = PairformerNoSeqModule(CZ, blocks, dropout=dropout, **NOSEQ_KW)
    return theirs, ours


@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["eval", "boltz-dropout"])
@pytest.mark.parametrize("blocks", [1, 2], ids=["layer", "module2"])
def test_noseq_reference_vs_boltz(blocks, dropout, boltz_fp64, monkeypatch):  # noqa: F811
    n = 7
    theirs, ours = _noseq_pair(blocks, dropout)
    load_into(ours, theirs, seed=31 + blocks)
    training = dropout > 0
    theirs.train(training)
    ours.train(training)
    z = synthetic(B, n, n, CZ, seed=32).requires_grad_()
    pair_mask = pair_mask_with_diagonal(n, seed=33)  # [B, N, N]
    sites = [m for m in ours.modules() if isinstance(m, Dropout)]
    assert len(sites) == 4 * blocks

    def run_theirs(z):
        if not training:
            return theirs(z, pair_mask)
        with boltz_uses_our_masks(monkeypatch, sites, DROPOUT_SEED):
            return theirs(z, pair_mask)

    compare(
        ours,
        theirs,
        lambda z: ours(z, pair_mask, seed=DROPOUT_SEED),
        run_theirs,
        [z],
        f"noseq-{'layer' if blocks == 1 else 'module'}",
        boltz_fp64,
    )


# -- CP twins of Boltz's modules ------------------------------------------------------------------


def _boltz_noseq(blocks: int) -> torch.nn.Module:
    if blocks == 1:
        m = boltz_pairformer.PairformerNoSeqLayer(CZ, dropout=0.25, **NOSEQ_KW)
    else:
        m = boltz_pairformer.PairformerNoSeqModule(CZ, blocks, dropout=0.25, **NOSEQ_KW)
    m = m.double()
    randomize_parameters(m, seed=40 + blocks)
    return m.train()


def _noseq_inputs(b: int, n: int):
    z = synthetic(b, n, n, CZ, seed=41)
    pm = pair_mask_with_diagonal(n, seed=42)[:b]
    return z, pm


def _rank_noseq(grid, b, n, blocks):
    layout = PairLayout.for_sizes(n, grid)
    theirs = _boltz_noseq(blocks)
    twin = cp_twin_of(theirs)
    assert type(twin).__module__ == "twinshard.pair.layers.pairformer", type(twin)
    z, pm = _noseq_inputs(b, n)
    z.requires_grad_(True)
    zd = shard_tensor(z, "pair", grid, layout)
    out = collect_tensor(twin(zd, shard_tensor(pm, "pair", grid, layout), seed=DROPOUT_SEED))
    out.backward(random_grad_output(out, seed=5))
    return TwinResult(
        out=out.detach(),
        grads_in={"z": collect_grad(z.grad, "pair", grid)},
        param_grads={k: p.grad for k, p in twin.named_parameters()},
        shards={"z": real_part(zd)},
        params=parameter_signature(twin),
    )


@pytest.mark.parametrize("blocks", [1, 2], ids=["layer", "module2"])
@pytest.mark.parametrize("grid,n", [((2, 2), 7), ((2, 3), 9)], ids=["2x2-N7", "2x3-N9"])
def test_noseq_twin_vs_boltz(grid, n, blocks, boltz_fp64, monkeypatch):  # noqa: F811
    b = 1
    ranks = run_on_grid(_rank_noseq, grid, b, n, blocks, timeout=TIMEOUT)
    theirs = _boltz_noseq(blocks)
    ref_sites = _noseq_pair(blocks, 0.25)[1]
    sites = [m for m in ref_sites.modules() if isinstance(m, Dropout)]
    z, pm = _noseq_inputs(b, n)

    def run(z):
        with boltz_fp64(), boltz_uses_our_masks(monkeypatch, sites, DROPOUT_SEED):
            return theirs(z, pm)

    ref = serial_reference(theirs, run, {"z": z}, grad_seed=5)
    check_twin(what=f"noseq blocks={blocks} vs boltz N={n}", grid=grid_id(grid), ranks=ranks, **ref)


# -- pair-weighted averaging, the MSA layer and module: references vs Boltz ----------------------

from boltz.model.layers import pair_averaging as boltz_pwa  # noqa: E402
from boltz.model.modules import trunkv2 as boltz_trunk  # noqa: E402

from twinshard.pair.reference import MSALayer, MSAModule, PairWeightedAveraging  # noqa: E402
from twinshard.testing import random_mask  # noqa: E402

CM, CS = 6, 5  # MSA and single channels
# norm_z's bias adds one constant per head to every logit of a softmax row: its gradient is zero
# in exact arithmetic (round-off in both runs), checked against zero at the gradients' scale
PWA_ZERO = ("norm_z.bias",)


@pytest.mark.parametrize("chunk_heads", [False, True], ids=["heads-together", "chunk-heads"])
@pytest.mark.parametrize("s,n", [(1, 5), (4, 7)], ids=["S1-N5", "S4-N7"])
def test_pwa_reference_vs_boltz(s, n, chunk_heads, boltz_fp64):  # noqa: F811
    theirs = boltz_pwa.PairWeightedAveraging(CM, CZ, 3, 2)
    ours = PairWeightedAveraging(CM, CZ, 3, 2)
    load_into(ours, theirs, seed=51)
    theirs.train(not chunk_heads)  # Boltz chunks the heads in eval mode only
    m = synthetic(B, s, n, CM, seed=52).requires_grad_()
    z = synthetic(B, n, n, CZ, seed=53).requires_grad_()
    mask = pair_mask_with_diagonal(n, seed=54)  # every row keeps a valid entry
    compare(
        ours,
        theirs,
        lambda m, z: ours(m, z, mask),
        lambda m, z: theirs(m, z, mask, chunk_heads),
        [m, z],
        f"pwa S={s} chunk_heads={chunk_heads}",
        boltz_fp64,
        zero_ok=PWA_ZERO,
    )


def msa_feats(
    b: int, s: int, n: int, seed: int, paired: bool = True, pad_token: bool = False
) -> dict[str, torch.Tensor]:
    """Boltz-2 MSA features (fp64 floats): residue classes, deletions, pairing, masks (some MSA
    entries masked). ``pad_token``: the last token of batch 0 is padding (token_pad_mask 0). Not
    against Boltz: a padded token's pair row is fully masked, and Boltz's triangle attention
    rounds such a row's logits to ulp(1e9) ~ 1e-7 (test_boltz_reference's fully-masked-row test;
    its pair-weighted averaging to ulp(1e6)), which is not round-off of the function."""
    g = torch.Generator().manual_seed(seed)
    tok = torch.ones(b, n, dtype=torch.float64)
    if pad_token:
        tok[0, -1] = 0
    msa_mask = random_mask(b, s, n, seed=seed + 1, keep=0.85) * tok[:, None, :]
    msa_mask[:, 0] = tok  # the query sequence is whole
    feats = {
        "msa": torch.randint(0, 33, (b, s, n), generator=g),
        "has_deletion": (torch.rand(b, s, n, generator=g) < 0.3).double(),
        "deletion_value": torch.rand(b, s, n, generator=g, dtype=torch.float64),
        "msa_mask": msa_mask,
        "token_pad_mask": tok,
    }
    if paired:
        feats["msa_paired"] = (torch.rand(b, s, n, generator=g) < 0.5).double()
    return feats


def boltz_msa_sites(module) -> list[Dropout]:
    """Our MSA layers' dropout sites in Boltz's call order: per layer the MSA site, then the
    pair stack's four."""
    layers = [module] if isinstance(module, MSALayer) else list(module.layers)
    out = []
    for layer in layers:
        out.append(layer.dropout_msa)
        out += [m for m in layer.pairformer_layer.modules() if isinstance(m, Dropout)]
    return out


@contextlib.contextmanager
def boltz_msa_uses_our_masks(monkeypatch, sites: list[Dropout], seed: int):
    """Boltz's ``get_dropout_mask`` (in its pairformer and trunk modules) hands out our sites'
    masks call by call, checking axis, rate and Boltz's broadcast shape."""
    calls = iter(sites)

    def get_dropout_mask(dropout, z, training, columnwise=False):
        site = next(calls)
        assert site.columnwise == columnwise and site.p == dropout and training
        v = z[:, 0:1, :, 0:1] if columnwise else z[:, :, 0:1, 0:1]
        mask = site.mask(z.shape, seed, z.dtype, z.device)
        assert mask.shape == v.shape, (mask.shape, v.shape)
        return mask

    with monkeypatch.context() as mp:
        mp.setattr(boltz_pairformer, "get_dropout_mask", get_dropout_mask)
        mp.setattr(boltz_trunk, "get_dropout_mask", get_dropout_mask)
        yield
    assert next(calls, None) is None, "Boltz drew fewer dropout masks than our sites"


MSA_KW = dict(pairwise_head_width=2, pairwise_num_heads=2)


@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["eval", "boltz-dropout"])
def test_msa_layer_reference_vs_boltz(dropout, boltz_fp64, monkeypatch):  # noqa: F811
    s, n = 3, 6
    theirs = boltz_trunk.MSALayer(CM, CZ, dropout, dropout, **MSA_KW)
    ours = MSALayer(CM, CZ, dropout, dropout, **MSA_KW)
    assign_dropout_streams(ours)
    load_into(ours, theirs, seed=61)
    theirs.train(dropout > 0)
    ours.train(dropout > 0)
    feats = msa_feats(B, s, n, seed=62)
    tok = feats["token_pad_mask"]
    token_mask = tok[:, :, None] * tok[:, None, :]
    z = synthetic(B, n, n, CZ, seed=63).requires_grad_()
    m = synthetic(B, s, n, CM, seed=64).requires_grad_()
    sites = boltz_msa_sites(ours)

    def run_theirs(z, m):
        with (
            boltz_msa_uses_our_masks(monkeypatch, sites if dropout else [], DROPOUT_SEED)
            if dropout
            else (contextlib.nullcontext())
        ):
            return theirs(z, m, token_mask, feats["msa_mask"])

    compare(
        ours,
        theirs,
        lambda z, m: ours(z, m, token_mask, feats["msa_mask"], seed=DROPOUT_SEED),
        run_theirs,
        [z, m],
        f"msa-layer dropout={dropout}",
        boltz_fp64,
        zero_ok=PWA_ZERO,
    )


@pytest.mark.parametrize(
    "s,blocks,paired,dropout",
    [(1, 1, True, 0.0), (5, 2, True, 0.25), (4, 2, False, 0.25)],
    ids=["S1-1block-eval", "S5-2blocks-dropout", "S4-unpaired-dropout"],
)
def test_msa_module_reference_vs_boltz(s, blocks, paired, dropout, boltz_fp64, monkeypatch):  # noqa: F811
    n = 7
    kw = dict(use_paired_feature=paired, **MSA_KW)
    theirs = boltz_trunk.MSAModule(CM, CZ, CS, blocks, dropout, dropout, **kw)
    ours = MSAModule(CM, CZ, CS, blocks, dropout, dropout, **kw)
    load_into(ours, theirs, seed=71 + blocks)
    theirs.train(dropout > 0)
    ours.train(dropout > 0)
    feats = msa_feats(B, s, n, seed=72)  # Boltz reads msa_paired even when it does not use it
    z = synthetic(B, n, n, CZ, seed=73).requires_grad_()
    emb = synthetic(B, n, CS, seed=74).requires_grad_()
    sites = boltz_msa_sites(ours)

    def run_theirs(z, emb):
        ctx = (
            boltz_msa_uses_our_masks(monkeypatch, sites, DROPOUT_SEED)
            if dropout
            else contextlib.nullcontext()
        )
        with ctx:
            return theirs(z, emb, feats)

    compare(
        ours,
        theirs,
        lambda z, emb: ours(z, emb, feats, seed=DROPOUT_SEED),
        run_theirs,
        [z, emb],
        f"msa-module S={s} blocks={blocks} paired={paired}",
        boltz_fp64,
        zero_ok=PWA_ZERO,
    )


def test_msa_module_subsample_and_depth_errors():
    ours = MSAModule(CM, CZ, CS, 1, 0.0, 0.0, subsample_msa=True, **MSA_KW).double()
    feats = msa_feats(1, 3, 5, seed=81)
    z, emb = synthetic(1, 5, 5, CZ, seed=82), synthetic(1, 5, CS, seed=83)
    with pytest.raises(ValueError, match="subsample_msa=True draws a random subset"):
        ours(z, emb, feats)
    # the caller's draw: the same as subsampling the features first
    idx = torch.tensor([2, 0])
    plain = MSAModule(CM, CZ, CS, 1, 0.0, 0.0, **MSA_KW).double()
    plain.load_state_dict(ours.state_dict())
    sub = {k: (v[:, idx] if v.dim() == 3 else v) for k, v in feats.items()}
    torch.testing.assert_close(ours(z, emb, feats, msa_indices=idx), plain(z, emb, sub), rtol=0, atol=0)
    empty = {k: (v[:, :0] if v.dim() == 3 else v) for k, v in feats.items()}
    with pytest.raises(ValueError, match="S >= 1"):
        plain(z, emb, empty)
    with pytest.raises(KeyError, match="msa_paired"):
        plain(z, emb, {k: v for k, v in feats.items() if k != "msa_paired"})
