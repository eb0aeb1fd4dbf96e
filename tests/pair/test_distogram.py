"""The CP distogram loss (``DistogramLossFunction``) against the serial reference where some
targets have no mass: token pairs whose bin counts are all zero (an unresolved token's row, one
pair without its mirror, both orientations of a pair), on some tiles only.

Convention (Boltz-2's ``distogramv2.distogram_loss``, which the reference follows): the target
is normalised as ``P_ij = t_ij / max(1, sum_bins t_ij)``, so an empty pair has ``P_ij = 0``: it
adds zero error and zero logit gradient, yet still counts in the denominator ``1e-5 + sum_ij
m_ij`` (the mask comes from the tokens, not from the target). No 0 / 0.

What each test proves:
- ``test_reference_empty_targets_follow_boltz``: the serial loss equals the convention written
  out pair by pair (a Python loop over (b, i, j), independent of the reference's tensor code).
- ``test_empty_targets_match_serial`` (2x2 and 2x3, N = 7: uneven on both, token mask given or
  taken from the layout): per-sample losses, the gradient of ``z`` (random grad_output on the
  per-sample losses) and the head's parameter gradients equal serial at round-off (fp64), all
  finite; the gradient of ``z`` at a pair empty in both orientations is exactly zero on every grid.
"""

from __future__ import annotations

import pytest
import torch

from twinshard.pair.features import PairLayout, collect_grad, real_part, shard_tensor
from twinshard.pair.layers.distogram import CPDistogramHead
from twinshard.pair.reference import DistogramHead, distogram_loss, distogram_target
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

CZ, BINS, B, N = 6, 8, 2, 7
# (b, i, j) pairs with both orientations empty: their logits get no gradient, so neither does z
BOTH_EMPTY = [(1, 4, 6), (1, 6, 4)]


def _inputs(mask: bool):
    z = synthetic(B, N, N, CZ, seed=4)
    target = distogram_target(synthetic(B, N, 2, 3, seed=10, scale=6.0), num_bins=BINS, max_dist=12.0)
    target[0, 1, :] = 0  # token 1's row (not its column): grid row 0's tiles only
    target[0, 5, 2] = 0  # one pair without its mirror (2, 5): tile (1, 0)
    target[1, 0, 3] = 0  # tile (0, 0) (on 2x3: tile (0, 1))
    for b, i, j in BOTH_EMPTY:  # rows 4 and 6 (grid row 1) x columns 6 and 4
        target[b, i, j] = 0
    m = random_mask(B, N, seed=8, keep=0.8)
    m[0, [1, 2, 5]] = m[1, [0, 3, 4, 6]] = 1  # the empty pairs are real: they count in the mask
    m[0, 6] = 0  # and one masked token
    return z, target, (m if mask else None)


def _head(cls):
    torch.manual_seed(17)
    head = cls(CZ, BINS).double()
    perturb_zero_parameters(head)
    with torch.no_grad():
        head.distogram.bias.add_(synthetic(BINS, seed=5, scale=0.3))
    return head


def _serial_per_sample(head, z, target, mask):
    m = mask if mask is not None else z.new_ones(z.shape[:2])
    return distogram_loss(head(z), target, m)[1]


def test_reference_empty_targets_follow_boltz():
    head = _head(DistogramHead)
    z, target, mask = _inputs(True)
    with torch.no_grad():
        got = _serial_per_sample(head, z, target, mask)
        logq = torch.log_softmax(head(z).squeeze(3), dim=-1)
    counts = target.sum(3)
    want = []
    for b in range(B):
        num, den, empty = 0.0, 0.0, 0
        for i in range(N):
            for j in range(N):
                if i == j or not (mask[b, i] and mask[b, j]):
                    continue
                den += 1.0  # an empty pair counts here too
                mass = float(counts[b, i, j].sum())
                if mass == 0:
                    empty += 1
                    continue
                num -= float((counts[b, i, j] / mass * logq[b, i, j]).sum())
        assert empty >= 3, f"sample {b}: only {empty} empty real pairs: vacuous"
        want.append(num / (1e-5 + den))
    assert bool(torch.isfinite(got).all()), got
    assert_parity(got, torch.tensor(want, dtype=got.dtype), what="reference distogram loss, empty targets")


def _rank_loss(grid, mask: bool):
    layout = PairLayout.for_sizes(N, grid)
    head = _head(CPDistogramHead)
    z, target, m = _inputs(mask)
    z.requires_grad_(True)
    zd = shard_tensor(z, "pair", grid, layout)
    md = None if m is None else shard_tensor(m, "single", grid, layout)
    _, per_sample = head.loss(zd, shard_tensor(target, "pair", grid, layout), md)
    per_sample.backward(random_grad_output(per_sample, seed=6))
    return TwinResult(
        out=per_sample.detach(),
        grads_in={"z": collect_grad(z.grad, "pair", grid)},
        param_grads={k: p.grad for k, p in head.named_parameters()},
        shards={"z": real_part(zd)},
        params=parameter_signature(head),
    )


CASES = [((2, 2), True), ((2, 3), True), ((2, 3), False)]


@pytest.mark.parametrize(
    "grid,mask", CASES, ids=[f"{grid_id(g)}-{'mask' if m else 'layout'}" for g, m in CASES]
)
def test_empty_targets_match_serial(grid, mask):
    ranks = run_on_grid(_rank_loss, grid, mask)
    serial = _head(DistogramHead)
    z, target, m = _inputs(mask)
    ref = serial_reference(serial, lambda z: _serial_per_sample(serial, z, target, m), {"z": z}, 6)
    check_twin(what=f"distogram empty targets N={N}", grid=grid_id(grid), ranks=ranks, **ref)
    for r, res in enumerate(ranks):
        assert bool(torch.isfinite(res.out).all()), f"rank {r}: per-sample loss {res.out}"
        for b, i, j in BOTH_EMPTY:
            g = res.grads_in["z"][b, i, j]
            assert bool((g == 0).all()), f"rank {r}: d/dz at the empty pair {(b, i, j)} is {g}, not 0"
