"""CP MSA module (and its layers) against the serial reference.

What each test proves:
- ``test_msa_names``: the reference and the twin register Boltz-2's names in Boltz-2's order
  (``s_proj, msa_proj, layers.<i>.{msa_transition, pair_weighted_averaging, pairformer_layer,
  outer_product_mean}``) and the same dropout streams.
- ``test_cp_msa_module_matches_serial``: training mode, Boltz-convention MSA and pair dropout
  (p = 0.25), features through the production ``distribute`` (a padded token inside N, masked
  MSA entries): the output ``z``, the gradients of ``z`` and ``emb`` (= s_inputs) and every
  parameter gradient equal serial (fp64, round-off gate) on 1x1, 2x2, 2x3, 3x2, MSA depth 1 and
  deeper than the grid rows, uneven N, paired and unpaired features, 2 blocks with activation
  checkpointing.
- ``test_cp_msa_bad_input``: ``subsample_msa=True``, an MSA of depth 0 and a missing feature raise
  the same clear error on every rank (no hang).
- ``test_cp_msa_negative_controls``: ``s_proj`` broadcast from the row token block instead of the
  column block, and an MSA dropout mask keyed by local sequence index, each fail parity.
"""

from __future__ import annotations

import pytest
import torch

from twinshard.pair.features import collect_grad, collect_tensor, distribute, real_part, shard_tensor
from twinshard.pair.layers import dropout as cp_dropout
from twinshard.pair.layers import msa as cp_msa
from twinshard.pair.layers.msa import CPMSAModule
from twinshard.pair.reference import Dropout, MSAModule
from twinshard.testing import (
    TwinResult,
    assert_parity,
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

CM, CZ, CS = 6, 4, 5
KW = dict(pairwise_head_width=2, pairwise_num_heads=2, pwa_heads=2, pwa_head_width=3, opm_hidden=3)
P_DROP = 0.25
SEED = 23
F64 = torch.float64
ANALYTIC_ZERO = "pair_weighted_averaging.norm_z.bias"  # shifts a whole softmax row


def _serial(blocks, paired=True, checkpointing=False):
    torch.manual_seed(29)
    mod = MSAModule(
        CM,
        CZ,
        CS,
        blocks,
        P_DROP,
        P_DROP,
        use_paired_feature=paired,
        activation_checkpointing=checkpointing,
        **KW,
    ).double()
    perturb_zero_parameters(mod)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return mod.train()


def _twin(blocks, paired=True, checkpointing=False):
    twin = CPMSAModule(
        CM,
        CZ,
        CS,
        blocks,
        P_DROP,
        P_DROP,
        use_paired_feature=paired,
        activation_checkpointing=checkpointing,
        **KW,
    ).double()
    twin.load_state_dict(_serial(blocks, paired).state_dict(), strict=True)
    return twin.train()


def _feats(b, s, n):
    g = torch.Generator().manual_seed(41)
    tok = torch.ones(b, n, dtype=F64)
    tok[0, n - 2] = 0  # a padded token inside N (Boltz's own padding)
    msa_mask = random_mask(b, s, n, seed=42, keep=0.8) * tok[:, None, :]
    msa_mask[:, 0] = tok
    return {
        "msa": torch.randint(0, 33, (b, s, n), generator=g),
        "has_deletion": (torch.rand(b, s, n, generator=g) < 0.3).to(F64),
        "deletion_value": torch.rand(b, s, n, generator=g, dtype=F64),
        "msa_paired": (torch.rand(b, s, n, generator=g) < 0.5).to(F64),
        "msa_mask": msa_mask,
        "token_pad_mask": tok,
    }


def _inputs(b, s, n):
    return synthetic(b, n, n, CZ, seed=43), synthetic(b, n, CS, seed=44), _feats(b, s, n)


def _s_proj_from_rows(x, grid, n):  # planted: the row token block, not the column block
    return x


def _local_key_mask(self, shape, seed, dtype, device=None, row_offset=0, col_offset=0):  # planted
    return Dropout.mask(self, shape, seed, dtype, device, 0, 0)


def _rank(grid, b, s, n, blocks=1, paired=True, checkpointing=False, plant=None):
    saved = cp_msa.column_block, cp_dropout.CPDropout.mask
    if plant == "s_proj_rows":
        move = cp_msa.column_block

        def planted(x, grid, n, op, **kw):  # the token mask keeps its move; s_proj's rows do not
            return _s_proj_from_rows(x, grid, n) if op == "msa:s_proj" else move(x, grid, n, op, **kw)

        cp_msa.column_block = planted
    elif plant == "dropout_local":
        cp_dropout.CPDropout.mask = _local_key_mask
    try:
        twin = _twin(blocks, paired, checkpointing)
        z, emb, feats = _inputs(b, s, n)
        fs = distribute(feats, grid)
        z.requires_grad_(True)
        emb.requires_grad_(True)
        zd, ed = shard_tensor(z, "pair", grid, fs.layout), shard_tensor(emb, "single", grid, fs.layout)
        out = collect_tensor(twin(zd, ed, fs, seed=SEED))
        out.backward(random_grad_output(out, seed=8))
        return TwinResult(
            out=out.detach(),
            grads_in={"z": collect_grad(z.grad, "pair", grid), "emb": collect_grad(emb.grad, "single", grid)},
            param_grads={k: p.grad for k, p in twin.named_parameters()},
            shards={"z": real_part(zd)} | ({"emb": real_part(ed)} if grid.rows > 1 else {}),
            params=parameter_signature(twin),
        )
    finally:
        cp_msa.column_block, cp_dropout.CPDropout.mask = saved


def _check(grid, b, s, n, ranks, blocks=1, paired=True, what=None):
    serial = _serial(blocks, paired)
    z, emb, feats = _inputs(b, s, n)
    ref = serial_reference(serial, lambda z, emb: serial(z, emb, feats, seed=SEED), {"z": z, "emb": emb}, 8)
    what = what or f"msa-module S={s} N={n} B={b} blocks={blocks} paired={paired}"
    zero = [k for k in ref["serial_param_grads"] if k.endswith(ANALYTIC_ZERO)]
    serial_zero = {k: ref["serial_param_grads"].pop(k) for k in zero}
    twin_zero = {k: ranks[0].param_grads[k] for k in zero}
    for r in ranks:
        for k in zero:
            r.param_grads.pop(k)
    check_twin(what=what, grid=grid_id(grid), ranks=ranks, **ref)
    scale = max(float(t.abs().max()) for t in ref["serial_param_grads"].values())
    eps = torch.finfo(F64).eps
    k0 = 2 * eps + 16 * 4096**0.5 * eps
    for k in zero:
        for side, g in (("distributed", twin_zero[k]), ("serial", serial_zero[k])):
            assert_parity(
                g,
                torch.zeros_like(g),
                what=f"{what} {side} grad {k}",
                grid=grid_id(grid),
                rtol=0.0,
                atol=k0 * scale,
                why=f"analytically zero: round-off of cancelling terms, {k0:.2g} x max|grad| {scale:.3g}",
            )


def test_msa_names():
    ref, twin = MSAModule(CM, CZ, CS, 2, 0.1, 0.1, **KW), CPMSAModule(CM, CZ, CS, 2, 0.1, 0.1, **KW)
    names = [n for n, _ in ref.named_parameters()]
    assert names == [n for n, _ in twin.named_parameters()]
    assert names[:2] == ["s_proj.weight", "msa_proj.weight"]
    order = []
    for n in names:
        part = n.split(".")[2] if n.startswith("layers.0.") else None
        if part and part not in order:
            order.append(part)
    assert order == ["msa_transition", "pair_weighted_averaging", "pairformer_layer", "outer_product_mean"]
    streams = {k: m.stream for k, m in ref.named_modules() if isinstance(m, Dropout)}
    assert streams == {k: m.stream for k, m in twin.named_modules() if isinstance(m, Dropout)}
    assert len(streams) == 10 and "layers.1.dropout_msa" in streams


# (grid, S, N, B, blocks, paired)
CASES = [
    ((1, 1), 3, 5, 2, 1, True),
    ((2, 2), 5, 7, 1, 1, True),
    ((2, 2), 1, 6, 1, 1, True),
    ((2, 3), 3, 9, 1, 1, False),
    ((3, 2), 5, 8, 1, 1, True),
]


@pytest.mark.parametrize(
    "grid,s,n,b,blocks,paired",
    CASES,
    ids=[f"{grid_id(g)}-S{s}-N{n}-{'paired' if p else 'unpaired'}" for g, s, n, _, _, p in CASES],
)
def test_cp_msa_module_matches_serial(grid, s, n, b, blocks, paired):
    ranks = run_on_grid(_rank, grid, b, s, n, blocks, paired)
    _check(grid, b, s, n, ranks, blocks, paired)


def test_cp_msa_module_two_blocks_checkpointed():
    grid, s, n = (2, 2), 3, 7
    ranks = run_on_grid(_rank, grid, 1, s, n, 2, True, True)
    _check(grid, 1, s, n, ranks, 2, True, what="msa-module 2 blocks checkpointed")


@pytest.mark.parametrize("plant", ["s_proj_rows", "dropout_local"])
def test_cp_msa_negative_controls(plant):
    grid, s, n = (2, 2), 4, 6
    ranks = run_on_grid(_rank, grid, 1, s, n, 1, True, False, plant)
    with pytest.raises(AssertionError, match="msa planted"):
        _check(grid, 1, s, n, ranks, what=f"msa planted {plant}")


def _rank_bad(grid, case):
    twin = _twin(1)
    n, s = 6, 3
    z, emb, feats = _inputs(1, s, n)
    if case == "subsample":
        twin.subsample_msa = True
    elif case == "depth0":
        feats = {k: (v[:, :0] if v.dim() == 3 else v) for k, v in feats.items()}
    elif case == "missing":
        feats.pop("deletion_value")
    try:  # an MSA of depth 0 is refused by distribute already (every rank: RankFailure)
        fs = distribute(feats, grid)
        zd, ed = shard_tensor(z, "pair", grid, fs.layout), shard_tensor(emb, "single", grid, fs.layout)
        twin(zd, ed, fs, seed=SEED)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.parametrize(
    "case,match",
    [("subsample", "subsample_msa=True"), ("depth0", "depth S = 0"), ("missing", "deletion_value")],
)
def test_cp_msa_bad_input(case, match):
    msgs = run_on_grid(_rank_bad, (2, 2), case)
    assert all(m is not None and match in m for m in msgs), msgs
    assert len(set(msgs)) == 1, msgs
