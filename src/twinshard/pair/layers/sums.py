"""Replicated sums of per-rank partials on the pair grid: the same bits on every rank.

A global sum over atoms (or atom pairs) is a sum of per-rank partials. ``P.all_reduce`` leaves
the order of the additions to the backend; here the partials are all-gathered and added in
rank order of the group, so every rank holds the same bits whatever the backend does.

- :func:`column_sum`: partials of the grid ROWS, summed along the grid column. For tensors
  replicated along the grid row (the ``atom`` and ``single`` kinds): every rank of a row holds
  the same partial, and the column holds one rank of each row, so each row is counted once.
- :func:`grid_sum`: partials of every rank (disjoint parts, e.g. the atom-pair tiles of
  the smooth lDDT), summed along the grid row, then along the grid column (two ordered stages:
  every rank ends with the same bits).

Placements. In: ``part`` any local tensor (the same shape and dtype on every rank of the
group). Out: the sum, replicated (identical on every rank of the grid for :func:`grid_sum`,
of the grid column for :func:`column_sum`, and of the grid when the partials are replicated
along the row).

Collectives. Forward: one all-gather of ``part`` per stage (``[group size, *part.shape]``).
Backward: none. The sum is used identically by every rank (a replicated value), so the
gradient reaching it is the same on every rank, and the adjoint of "gather then add" is the
slice of my own part's gradient, which is that gradient itself (DESIGN rule 7: reducing it
would count it once per rank). Callers that feed a non-replicated computation with the sum
must not use these.

Memory: the gathered partials, ``group size x part`` (tiny: per-sample scalars, 3 x 3
matrices); nothing saved for backward.
"""

from __future__ import annotations

from typing import Any

import torch

from twinshard.comm import primitives as P
from twinshard.comm.amp import autocast_rule
from twinshard.runtime.grid import ProcessGrid

__all__ = ["column_sum", "grid_sum", "ordered_sum"]


def _gathered_sum(part: torch.Tensor, group: Any, op: str) -> torch.Tensor:
    every = P.all_gather(part.unsqueeze(0).contiguous(), 0, group=group, op=op)
    total = every[0]
    for i in range(1, every.shape[0]):  # rank order: the same bits on every rank
        total = total + every[i]
    return total


@autocast_rule()
class _OrderedSum(torch.autograd.Function):
    """Gather the partials of ``group``, add them in rank order; backward: the (replicated)
    gradient of the sum is my part's gradient (module docstring). Dtype path: the partials' dtype
    throughout (the callers' sums are >= fp32); the wire carries it."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, group: Any, op: str) -> torch.Tensor:
        return _gathered_sum(part, group, op)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return g, None, None


def ordered_sum(part: torch.Tensor, group: Any, op: str) -> torch.Tensor:
    """Sum of ``part`` over ``group``, added in rank order (differentiable, module docstring)."""
    if torch.is_grad_enabled() and part.requires_grad:
        return _OrderedSum.apply(part, group, op)
    return _gathered_sum(part, group, op)


def column_sum(part: torch.Tensor, grid: ProcessGrid, op: str) -> torch.Tensor:
    """Sum over the grid rows of partials replicated along each grid row (module docstring)."""
    return ordered_sum(part, grid.col_group, op)


def grid_sum(part: torch.Tensor, grid: ProcessGrid, op: str) -> torch.Tensor:
    """Sum over every rank of the grid: along the grid row, then along the grid column."""
    return ordered_sum(ordered_sum(part, grid.row_group, f"{op}:row"), grid.col_group, f"{op}:col")
