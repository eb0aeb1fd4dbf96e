"""The adjoint identity of the comm ops: a check (``adjoint_pair``) and the foundation rows of
``twinshard demo``.

For an op linear in x, backward is the exact adjoint of forward iff
sum_r <dy_r, f(x)_r> = sum_r <f*(dy)_r, x_r> for every dy; one random dy tests it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from twinshard.comm import ops
from twinshard.comm import primitives as P
from twinshard.comm.ledger import CommLedger
from twinshard.runtime.grid import make_grid


def adjoint_pair(
    f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, seed: int, group: Any = None
) -> tuple[float, float]:
    """In-rank: (sum_r <dy_r, f(x)_r>, sum_r <f*(dy)_r, x_r>) for a random dy, summed over
    ``group`` in fp64. Equal up to round-off iff backward is the adjoint of forward (for an op
    linear in x). Every rank gets the same pair. Collectives: f's, then one all-reduce."""
    x = x.detach().clone().requires_grad_(True)
    y = f(x)
    gen = torch.Generator().manual_seed(seed)  # a host draw: the same numbers on any device
    dy = torch.randn(y.shape, generator=gen, dtype=y.dtype, device=gen.device).to(y.device)
    (gx,) = torch.autograd.grad(y, x, dy)
    sums = torch.stack([(dy * y).sum(), (gx * x).sum()]).detach().to(torch.float64)
    sums = P.all_reduce(sums, group, op="adjoint_pair")
    return float(sums[0]), float(sums[1])


def demo_rows() -> list[dict[str, Any]]:
    """Foundation section of ``twinshard demo`` (every rank of a 4-rank world): the adjoint gap
    |<dy, f(x)> - <f*(dy), x>| of each comm op on a 2 x 2 grid, and the bytes each rank moved."""
    from twinshard.runtime import require_world

    dev = require_world("comm demo rows").device  # inputs and payloads on the world's device
    grid = make_grid((2, 2))
    r = grid.rank
    gen = torch.Generator().manual_seed(10 + r)
    x = torch.randn(3, 5, generator=gen, dtype=torch.float64, device=gen.device).to(dev)
    splits = [(r + s) % 3 for s in range(grid.size)]  # symmetric, uneven, with empty messages
    cases: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]] = {
        "all_reduce (world)": (ops.all_reduce, x),
        "all_gather dim 1 (row)": (lambda t: ops.all_gather(t, 1, grid.row_group), x),
        "reduce_scatter dim 0 (col, uneven)": (lambda t: ops.reduce_scatter(t, 0, grid.col_group, [1, 2]), x),
        "all_to_all (uneven splits)": (
            lambda t: ops.all_to_all(t, splits, splits),
            torch.randn(sum(splits), 5, generator=gen, dtype=torch.float64, device=gen.device).to(dev),
        ),
        "ring_shift cols k=1": (lambda t: ops.ring_shift(t, grid, "cols", 1), x),
        "grid_transpose": (lambda t: ops.grid_transpose(t, grid), x),
    }
    rows = []
    for name, (f, xin) in cases.items():
        with CommLedger() as led:
            lhs, rhs = adjoint_pair(f, xin, seed=20 + r)
        moved = led.bytes_sent - led.ops["adjoint_pair"].bytes_sent  # the op's own bytes
        both = P.all_gather(
            torch.tensor([[abs(lhs - rhs), float(moved)]], dtype=torch.float64, device=dev), 0
        ).cpu()
        rows.append(
            {
                "what": f"adjoint <dy,f(x)> = <f*(dy),x>: {name}",
                "grid": "2x2",
                "max_abs_error": float(both[:, 0].max()),
                "bytes_per_rank": int(both[:, 1].max()),
            }
        )
    return rows
