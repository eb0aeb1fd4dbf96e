"""A worked example of a twin: a residual pair MLP on tiles of z[N, N, c].

Serial: ``PairMLP`` (z + linear_2(gelu(linear_1(z)))), applied to every (i, j) entry.
Twin: the same module run on this rank's tile, its replicated parameters entered through
``comm.sync_grad`` so their gradients are summed over the grid. This is the template the README's
porting guide walks through; the harness's negative controls (tests/testing/test_harness.py) plant
their bugs in subclasses of its twin, from the test.

Placements: z tile (r, c) = rows block r x cols block c in and out; parameters replicated.
Any N, by the library's padding policy (``twinshard.pair.tiling``): z is padded at the end
to Nr x Nc (N up to a multiple of rows along dim 0, of cols along dim 1), so every tile has the
same shape
(``tile_slices``); the padded entries are zeros and stay inert (the MLP is token-local, so they
never reach a real entry, and their gradient is cut away); ``collect_tiles`` gathers the equal
tiles and cuts the padding off, giving the caller's N back. Collectives: none forward; backward
one all-reduce per parameter (in >= fp32). Memory saved per rank: the tile's activations,
Nr Nc / P of serial.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from twinshard import comm
from twinshard.pair.tiling import pad_dim, padded_tokens, real_tile, tile_slices, unpad
from twinshard.runtime import ProcessGrid
from twinshard.testing.checks import TwinResult, parameter_signature, serial_reference
from twinshard.testing.inputs import random_grad_output, synthetic


class PairMLP(nn.Module):
    """Serial residual MLP over the channel dim of a pair tensor."""

    def __init__(self, c: int, hidden: int):
        super().__init__()
        self.linear_1 = nn.Linear(c, hidden, dtype=torch.float64)
        self.linear_2 = nn.Linear(hidden, c, dtype=torch.float64)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z + self.linear_2(F.gelu(self.linear_1(z)))


class TiledPairMLP(PairMLP):
    """Twin of PairMLP on a rows x cols grid (same parameter names and order)."""

    def __init__(self, c: int, hidden: int, grid: ProcessGrid):
        super().__init__(c, hidden)
        self.grid = grid

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        # replicated parameters enter through sync_grad: identity forward, all-reduce backward
        p = {n: comm.sync_grad(w) for n, w in self.named_parameters()}
        h = F.gelu(F.linear(z, p["linear_1.weight"], p["linear_1.bias"]))
        return z + F.linear(h, p["linear_2.weight"], p["linear_2.bias"])


PLACEMENTS = (Shard(0), Shard(1))  # z[N, N, c]: rows over grid rows, columns over grid columns


def tile_of(z: torch.Tensor, grid: ProcessGrid) -> torch.Tensor:
    """This rank's tile of a full z[N, N, ...], padded with zeros to Nr x Nc (slices, no comm)."""
    nr, nc = padded_tokens(z.shape[0], grid)
    zp = pad_dim(pad_dim(z, 0, nr), 1, nc)
    return zp[tile_slices(zp.shape, grid, PLACEMENTS)]


def collect_tiles(t: torch.Tensor, grid: ProcessGrid, n: int) -> torch.Tensor:
    """Gather the equal tiles into the full z on every rank (all-gather along the row, then the
    column) and cut the padding off: the caller's N back."""
    row = comm.all_gather(t, 1, grid.row_group)
    return unpad(comm.all_gather(row, 0, grid.col_group), {0: n, 1: n})


def run_example_twin(
    grid: ProcessGrid,
    n: int = 13,
    c: int = 4,
    hidden: int = 6,
    zero_param: bool = False,
    twin: type[TiledPairMLP] = TiledPairMLP,
) -> TwinResult:
    """One rank's side of the example parity test (the serial inputs are rebuilt from seeds).

    ``n`` = 13 is uneven on every grid of the tests and still gives every rank real entries (on
    2 x 3 it pads to 14 x 15, tiles of 7 x 5)."""
    torch.manual_seed(0)
    model = twin(c, hidden, grid)
    if zero_param:
        with torch.no_grad():
            model.linear_2.weight.zero_()
    z = synthetic(n, n, c, seed=1)
    gy = random_grad_output((n, n, c))  # the default seed, which serial_reference draws too
    zt = tile_of(z, grid).clone().requires_grad_(True)
    y = model(zt)
    y_full = collect_tiles(y, grid, n)
    # Evidence: this rank's real (unpadded) blocks of the input and output, and where they sit.
    shards = {
        "z": real_tile(zt.detach(), grid, PLACEMENTS, (n, n, c)),
        "out": real_tile(y.detach(), grid, PLACEMENTS, (n, n, c)),
    }
    y.backward(tile_of(gy, grid))
    return TwinResult(
        out=y_full.detach(),
        grads_in={"z": collect_tiles(zt.grad, grid, n)},
        param_grads={k: v.grad for k, v in model.named_parameters()},
        shards=shards,
        params=parameter_signature(model),
    )


def serial_example(
    n: int = 13, c: int = 4, hidden: int = 6, zero_param: bool = False, uniform_grad: bool = False
) -> dict:
    """The serial run of the example: module, output, input and parameter gradients, grad_output."""
    torch.manual_seed(0)
    model = PairMLP(c, hidden)
    if zero_param:
        with torch.no_grad():
            model.linear_2.weight.zero_()
    gy = torch.ones(n, n, c, dtype=torch.float64) if uniform_grad else random_grad_output((n, n, c))
    return serial_reference(model, model, {"z": synthetic(n, n, c, seed=1)}, grad_output=gy)
