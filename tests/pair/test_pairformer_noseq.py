"""CP no-sequence Pairformer layer and module (Boltz-2's PairformerNoSeq*) against the serial references.

What each test proves:
- ``test_noseq_names``: the reference registers Boltz-2's names in Boltz-2's order
  (``tri_mul_out, tri_mul_in, tri_att_start, tri_att_end, transition_z``) and the twin the same.
- ``test_cp_noseq_matches_serial``: one layer (and a 2-layer module, plain and checkpointed) in
  training mode with Boltz-convention dropout (p = 0.25) and a random pair mask: output, the
  gradient of ``z`` and every parameter gradient equal serial (fp64, round-off gate) on 1x1, 2x2,
  2x3, 3x2, even and uneven N; the output's padding stays exactly zero. Layer and module share
  one pair half with the full Pairformer (``pair_stack``), so the dropout masks are the serial ones.
- ``test_cp_noseq_no_mask``: masks from the layout only (pair_mask=None) on padded input.
- ``test_noseq_wrong_stream_fails``: a dropout site with another stream than serial fails parity
  (negative control).
"""

from __future__ import annotations

import pytest
import torch

from twinshard.pair.features import (
    PairLayout,
    collect_grad,
    collect_tensor,
    layout_of,
    padding_keep,
    real_part,
    shard_tensor,
)
from twinshard.pair.layers.pairformer import CPPairformerNoSeqLayer, CPPairformerNoSeqModule
from twinshard.pair.reference import PairformerNoSeqLayer, PairformerNoSeqModule, assign_dropout_streams
from twinshard.testing import (
    TwinResult,
    check_twin,
    grid_id,
    parameter_signature,
    perturb_zero_parameters,
    random_grad_output,
    random_mask,
    run_on_grid,
    serial_reference,
    synthetic,
)

CZ, PHW, PHEADS = 6, 4, 2
SEED = 13
P_DROP = 0.25


def _kw(p=P_DROP):
    return dict(dropout=p, pairwise_head_width=PHW, pairwise_num_heads=PHEADS)


def _serial(layers):
    torch.manual_seed(19)
    if layers is None:
        m = PairformerNoSeqLayer(CZ, **_kw()).double()
        assign_dropout_streams(m)
    else:
        m = PairformerNoSeqModule(CZ, layers, **_kw()).double()
    perturb_zero_parameters(m)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m.train()


def _twin(serial, layers, checkpointing=False):
    if layers is None:
        twin = CPPairformerNoSeqLayer(CZ, **_kw()).double()
        assign_dropout_streams(twin)
    else:
        twin = CPPairformerNoSeqModule(CZ, layers, activation_checkpointing=checkpointing, **_kw()).double()
    twin.load_state_dict(serial.state_dict(), strict=True)
    return twin.train()


def _inputs(b, n):
    z = synthetic(b, n, n, CZ, seed=4)
    mask = random_mask(b, n, seed=8, keep=0.8)
    mask[:, 0] = 1
    pair_mask = mask[:, :, None] * mask[:, None, :] * random_mask(b, n, n, seed=9, keep=0.9)
    return z, pair_mask


def _padding_is_zero(y) -> bool:
    keep = padding_keep(y, layout_of(y), "pair")
    if keep is None:
        return True
    local = y.to_local()
    keep = keep.view(keep.shape + (1,) * (local.dim() - keep.dim())).expand(local.shape)
    return bool((local.masked_select(~keep) == 0).all())


def _rank(grid, b, n, layers=None, masks=True, checkpointing=False, plant=None):
    layout = PairLayout.for_sizes(n, grid)
    twin = _twin(_serial(layers), layers, checkpointing)
    if plant == "stream":
        site = (twin if layers is None else twin.layers[0]).dropout_tri_mul_in
        site.stream = site.stream + 1
    z, pair_mask = _inputs(b, n)
    z.requires_grad_(True)
    zd = shard_tensor(z, "pair", grid, layout)
    pmd = shard_tensor(pair_mask, "pair", grid, layout) if masks else None
    zo = twin(zd, pmd, seed=SEED)
    full = collect_tensor(zo)
    full.backward(random_grad_output(full, seed=6))
    return TwinResult(
        out=full.detach(),
        grads_in={"z": collect_grad(z.grad, "pair", grid)},
        param_grads={k: p.grad for k, p in twin.named_parameters()},
        shards={"z": real_part(zd)},
        params=parameter_signature(twin),
    ), _padding_is_zero(zo)


def _check(grid, b, n, ranks, layers=None, masks=True, what="noseq"):
    serial = _serial(layers)
    z, pair_mask = _inputs(b, n)
    pm = pair_mask if masks else None
    ref = serial_reference(serial, lambda z: serial(z, pm, seed=SEED), {"z": z}, 6)
    check_twin(what=f"{what} N={n} B={b}", grid=grid_id(grid), ranks=[r for r, _ in ranks], **ref)
    for r, (_, pad_zero) in enumerate(ranks):
        assert pad_zero, f"rank {r}: padding of the output is not exactly zero"


def test_noseq_names():
    boltz_order = ["tri_mul_out", "tri_mul_in", "tri_att_start", "tri_att_end", "transition_z"]
    ref = PairformerNoSeqLayer(CZ, **_kw())
    assert [n for n, _ in ref.named_children() if not n.startswith("dropout")] == boltz_order
    assert [n for n, _ in ref.named_parameters()] == [
        n for n, _ in CPPairformerNoSeqLayer(CZ, **_kw()).named_parameters()
    ]
    mod = PairformerNoSeqModule(CZ, 2, **_kw())
    assert [n for n, _ in mod.named_parameters()] == [
        n for n, _ in CPPairformerNoSeqModule(CZ, 2, **_kw()).named_parameters()
    ]
    assert all(n.startswith("layers.") for n, _ in mod.named_parameters())


CASES = [
    ((1, 1), 5, 2, None),
    ((2, 2), 7, 1, None),
    ((2, 3), 9, 1, None),
    ((3, 2), 8, 1, None),
    ((2, 2), 7, 1, 2),
]


@pytest.mark.parametrize(
    "grid,n,b,layers",
    CASES,
    ids=[f"{grid_id(g)}-N{n}-{'layer' if L is None else f'stack{L}'}" for g, n, _, L in CASES],
)
def test_cp_noseq_matches_serial(grid, n, b, layers):
    ranks = run_on_grid(_rank, grid, b, n, layers)
    _check(grid, b, n, ranks, layers, what=f"noseq-{'layer' if layers is None else 'stack'} boltz-dropout")


def test_cp_noseq_checkpointed_stack():
    grid, n = (2, 2), 7
    ranks = run_on_grid(_rank, grid, 1, n, 2, True, True)
    _check(grid, 1, n, ranks, 2, what="noseq-stack checkpointed")


def test_cp_noseq_no_mask():
    grid, n = (2, 3), 8
    ranks = run_on_grid(_rank, grid, 1, n, None, False)
    _check(grid, 1, n, ranks, None, masks=False, what="noseq-layer no-mask")


def test_noseq_wrong_stream_fails():
    grid, n = (2, 2), 6
    ranks = run_on_grid(_rank, grid, 1, n, None, True, False, "stream")
    with pytest.raises(AssertionError, match="noseq-layer planted"):
        _check(grid, 1, n, ranks, None, what="noseq-layer planted")
