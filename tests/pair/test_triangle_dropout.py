"""AF3 pair-stack residual blocks with dropout: z + Dropout(TriangleMultiplication(z)).

AF3 Alg. 6 applies row-wise dropout (p = 0.25) after the triangle multiplications; here the
outgoing block uses row-wise and the incoming block column-wise dropout, so both mask variants
compose with a CP layer. The twin draws each tile's mask from global indices, so the block equals
the serial block. Dropout on and off, square and rectangular grids, N not divisible by the grid.
"""

from __future__ import annotations

import pytest
import torch

from twinshard.pair.features import PairLayout, collect_grad, collect_tensor, real_part, shard_tensor
from twinshard.pair.layers import CPDropout, pointwise
from twinshard.pair.layers.triangle import CPTriangleMultiplication
from twinshard.pair.reference import Dropout
from twinshard.pair.reference.triangle import TriangleMultiplication
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

C, H, STEP = 4, 3, 11  # channels, hidden channels, the training step that seeds the masks


def _serial(direction: str, p: float, columnwise: bool) -> tuple[TriangleMultiplication, Dropout]:
    torch.manual_seed(3)
    tri = TriangleMultiplication(C, direction, hidden=H).double()
    perturb_zero_parameters(tri)
    with torch.no_grad():
        for prm in tri.parameters():
            prm.add_(0.1 * torch.randn_like(prm))
    return tri, Dropout(p, columnwise=columnwise, stream=1 + (direction == "incoming")).train()


def _inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic(1, n, n, C, seed=4), random_mask(1, n, n, seed=8, keep=0.8)


def _rank(grid, n, direction, p, columnwise):
    tri, drop = _serial(direction, p, columnwise)
    twin = CPTriangleMultiplication(C, direction, hidden=H).double()
    twin.load_state_dict(tri.state_dict())
    cdrop = CPDropout(p, columnwise=columnwise, stream=drop.stream).train()
    layout = PairLayout.for_sizes(n, grid)
    z, mask = _inputs(n)
    z.requires_grad_(True)
    zd, md = shard_tensor(z, "pair", grid, layout), shard_tensor(mask, "pair", grid, layout)
    upd = cdrop(twin(zd, md), seed=STEP)
    out = pointwise(lambda a, b: a + b, zd, upd)
    full = collect_tensor(out, layout, "pair")
    full.backward(random_grad_output(full, seed=5))
    return TwinResult(
        out=full.detach(),
        grads_in={"z": collect_grad(z.grad, "pair", grid)},  # each rank's z.grad: its own tile
        param_grads={k: v.grad for k, v in twin.named_parameters()},
        shards={"z": real_part(zd), "out": real_part(out)},
        params=parameter_signature(twin),
    )


CASES = [((2, 2), 13), ((2, 3), 13), ((3, 3), 7)]  # padding on each; every rank holds real data


@pytest.mark.parametrize("direction,columnwise", [("outgoing", False), ("incoming", True)])
@pytest.mark.parametrize("p", [0.25, 0.0], ids=["dropout-on", "dropout-off"])
@pytest.mark.parametrize("grid,n", CASES, ids=[f"{grid_id(g)}-N{n}" for g, n in CASES])
def test_residual_trimul_with_dropout_matches_serial(grid, n, direction, columnwise, p):
    ranks = run_on_grid(_rank, grid, n, direction, p, columnwise)
    tri, drop = _serial(direction, p, columnwise)
    z, mask = _inputs(n)
    check_twin(
        what=f"z + dropout(trimul-{direction}) p={p}",
        grid=grid_id(grid),
        ranks=ranks,
        **serial_reference(tri, lambda z: z + drop(tri(z, mask), seed=STEP), {"z": z}, grad_seed=5),
    )
    if p > 0:  # the mask really dropped entries (else the "on" case would be the "off" case)
        assert bool((drop.mask(z.shape, STEP, z.dtype) == 0).any())
