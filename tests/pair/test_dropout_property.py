"""RNG property: the dropout masks a CP run draws equal the serial masks, on every grid, in both
conventions, for every site of a Pairformer stack.

What each test proves:
- ``test_masks_equal_serial_on_every_grid``: on 1x1, 2x2, 3x3, 1x2 and 2x3 grids with uneven N,
  for the ``"boltz"`` and ``"af3"`` conventions, row-wise and column-wise, each rank's tile mask
  (applied to ones, collected) equals the serial mask bit for bit, for two seeds; the masks are
  not degenerate (both kept and dropped entries) and differ between seeds.
- ``test_stack_sites_draw_the_serial_streams``: every dropout site of a CP Pairformer stack has
  the stream of the serial site of the same name, and the streams are distinct.
- ``test_negative_control_per_rank_seed``: planted from the test, a per-rank seed (seed + rank)
  makes the property fail with the message named, on every grid of more than one rank.
"""

from __future__ import annotations

import pytest
import torch

from twinshard.pair.features import PairLayout, collect_tensor, shard_tensor
from twinshard.pair.layers import CPDropout
from twinshard.pair.layers.pairformer import CPPairformerStack
from twinshard.pair.reference import Dropout, PairformerStack
from twinshard.testing import grid_id, run_on_grid

B, C, P_DROP = 2, 3, 0.4
SEEDS = (5, 2**32 - 3)
GRIDS = [((1, 1), 5), ((2, 2), 7), ((3, 3), 7), ((1, 2), 5), ((2, 3), 9)]
SITES = [(conv, col) for conv in ("boltz", "af3") for col in (False, True)]


def _site(cls, convention, columnwise):
    return cls(
        P_DROP, columnwise=columnwise, stream=f"site.{convention}.{columnwise}", convention=convention
    ).train()


def _rank_masks(grid, n, per_rank_seed=False):
    layout = PairLayout.for_sizes(n, grid)
    x = shard_tensor(torch.ones(B, n, n, C, dtype=torch.float64), "pair", grid, layout)
    out = {}
    for convention, columnwise in SITES:
        site = _site(CPDropout, convention, columnwise)
        for seed in SEEDS:
            s = (seed + grid.rank) % 2**32 if per_rank_seed else seed  # the planted bug
            out[(convention, columnwise, seed)] = collect_tensor(site(x, seed=s))
    return out


def _check(ranks, n, grid):
    ones = torch.ones(B, n, n, C, dtype=torch.float64)
    for (convention, columnwise, seed), got in ranks[0].items():
        for r, rank in enumerate(ranks[1:], start=1):
            assert torch.equal(rank[(convention, columnwise, seed)], got), f"rank {r} collected another mask"
        want = _site(Dropout, convention, columnwise)(ones, seed=seed)
        name = (
            f"{convention} {'column' if columnwise else 'row'}-wise seed {seed} on grid {grid_id(grid)} N={n}"
        )
        if not torch.equal(got, want):
            bad = (got != want).nonzero()[0].tolist()
            raise AssertionError(f"dropout mask {name} differs from serial (first at {bad})")
        assert bool((want == 0).any()) and bool((want > 0).any()), f"degenerate mask {name}"
    for convention, columnwise in SITES:
        a, b = (ranks[0][(convention, columnwise, s)] for s in SEEDS)
        assert not torch.equal(a, b), f"{convention} masks do not change with the seed"


@pytest.mark.parametrize("grid,n", GRIDS, ids=[f"{grid_id(g)}-N{n}" for g, n in GRIDS])
def test_masks_equal_serial_on_every_grid(grid, n):
    _check(run_on_grid(_rank_masks, grid, n), n, grid)


def test_stack_sites_draw_the_serial_streams():
    kw = dict(num_heads=2, pairwise_head_width=4, pairwise_num_heads=2)
    for convention in ("boltz", "af3"):
        serial = PairformerStack(8, 6, 3, convention=convention, **kw)
        twin = CPPairformerStack(8, 6, 3, convention=convention, **kw)
        want = {
            k: (m.stream, m.columnwise, m.convention)
            for k, m in serial.named_modules()
            if isinstance(m, Dropout)
        }
        got = {
            k: (m.stream, m.columnwise, m.convention)
            for k, m in twin.named_modules()
            if isinstance(m, Dropout)
        }
        assert got == want and len(want) == 12
        assert len({v[0] for v in want.values()}) == 12, "two sites share a stream"


@pytest.mark.parametrize("grid,n", GRIDS[1:], ids=[f"{grid_id(g)}-N{n}" for g, n in GRIDS[1:]])
def test_negative_control_per_rank_seed(grid, n):
    ranks = run_on_grid(_rank_masks, grid, n, per_rank_seed=True)
    with pytest.raises(
        AssertionError, match=r"dropout mask boltz row-wise seed 5 on grid .* differs from serial"
    ):
        _check(ranks, n, grid)
