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
