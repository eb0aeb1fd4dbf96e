"""A worked example of a twin: a residual pair MLP on tiles of z[N, N, c].

Serial: ``PairMLP`` (z + linear_2(gelu(linear_1(z)))), applied to every (i, j) entry.
Twin: the same module run on this rank's tile, its replicated parameters entered through
``comm.sync_grad`` so their gradients are summed over the grid. This is the template the README's
porting guide walks through, the twin the harness's negative controls plant bugs in, and the
foundation section of ``twinshard demo``.

Placements: z tile (r, c) = rows block r x cols block c in and out; parameters replicated.
Any N, by the library's padding policy (``twinshard.tensors.dtensor``): z is padded at the end
to Np, a multiple of lcm(rows, cols), so every tile has the same shape
(``tile_slices``); the padded entries are zeros and stay inert (the MLP is token-local, so they
never reach a real entry, and their gradient is cut away); ``collect_tiles`` gathers the equal
tiles and cuts the padding off, giving the caller's N back. Collectives: none forward; backward
one all-reduce per parameter (in >= fp32). Memory saved per rank: the tile's activations,
Np^2 / P of serial.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from twinshard import comm
from twinshard.runtime import ProcessGrid
from twinshard.tensors.dtensor import pad_dim, padded_tokens, real_tile, tile_slices, unpad
from twinshard.testing.checks import TwinResult, parameter_signature, serial_reference
from twinshard.testing.inputs import random_grad_output, synthetic

BUGS = ("missing_grad_reduce", "transposed_tile", "replicated_input", "raise_on_rank_1")


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

    def __init__(self, c: int, hidden: int, grid: ProcessGrid, bug: str | None = None):
        super().__init__(c, hidden)
        self.grid, self.bug = grid, bug

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        p = {
            n: (w if self.bug == "missing_grad_reduce" else comm.sync_grad(w))
            for n, w in self.named_parameters()
        }
        h = F.gelu(F.linear(z, p["linear_1.weight"], p["linear_1.bias"]))
        out = z + F.linear(h, p["linear_2.weight"], p["linear_2.bias"])
        return out.transpose(0, 1) if self.bug == "transposed_tile" else out


PLACEMENTS = (Shard(0), Shard(1))  # z[N, N, c]: rows over grid rows, columns over grid columns


def tile_of(z: torch.Tensor, grid: ProcessGrid) -> torch.Tensor:
    """This rank's tile of a full z[N, N, ...], padded with zeros to Np (slices, no comm)."""
    n_padded = padded_tokens(z.shape[0], grid)
    zp = pad_dim(pad_dim(z, 0, n_padded), 1, n_padded)
    return zp[tile_slices(zp.shape, grid, PLACEMENTS)]


def collect_tiles(t: torch.Tensor, grid: ProcessGrid, n: int) -> torch.Tensor:
    """Gather the equal tiles into the full z on every rank (all-gather along the row, then the
    column) and cut the padding off: the caller's N back."""
    row = comm.all_gather(t, 1, grid.row_group)
    return unpad(comm.all_gather(row, 0, grid.col_group), {0: n, 1: n})


def run_example_twin(
    grid: ProcessGrid,
    n: int = 7,
    c: int = 4,
    hidden: int = 6,
    bug: str | None = None,
    zero_param: bool = False,
) -> TwinResult:
    """One rank's side of the example parity test (the serial inputs are rebuilt from seeds)."""
    torch.manual_seed(0)
    model = TiledPairMLP(c, hidden, grid, bug)
    if zero_param:
        with torch.no_grad():
            model.linear_2.weight.zero_()
    z = synthetic(n, n, c, seed=1)
    gy = random_grad_output((n, n, c), seed=2)
    if bug == "raise_on_rank_1" and grid.rank == 1:
        raise ValueError("planted failure on rank 1 before the first collective")
    zt = (z if bug == "replicated_input" else tile_of(z, grid)).clone().requires_grad_(True)
    y = model(zt)
    if bug == "replicated_input":
        y_full = y
        everything = (slice(0, n), slice(0, n), slice(0, c))
        shards = {"z": (zt.detach(), everything), "out": (y.detach(), everything)}
    else:
        y_full = collect_tiles(y, grid, n)
        # Evidence: this rank's real (unpadded) blocks of the input and output, and where they sit.
        shards = {
            "z": real_tile(zt.detach(), grid, PLACEMENTS, (n, n, c)),
            "out": real_tile(y.detach(), grid, PLACEMENTS, (n, n, c)),
        }
    y.backward(gy if bug == "replicated_input" else tile_of(gy, grid))
    gz = zt.grad if bug == "replicated_input" else collect_tiles(zt.grad, grid, n)
    return TwinResult(
        out=y_full.detach(),
        grads_in={"z": gz},
        param_grads={k: v.grad for k, v in model.named_parameters()},
        shards=shards,
        params=parameter_signature(model),
    )


def serial_example(
    n: int = 7, c: int = 4, hidden: int = 6, zero_param: bool = False, uniform_grad: bool = False
) -> dict:
    """The serial run of the example: module, output, input and parameter gradients, grad_output."""
    torch.manual_seed(0)
    model = PairMLP(c, hidden)
    if zero_param:
        with torch.no_grad():
            model.linear_2.weight.zero_()
    gy = torch.ones(n, n, c, dtype=torch.float64) if uniform_grad else random_grad_output((n, n, c), seed=2)
    return serial_reference(model, model, {"z": synthetic(n, n, c, seed=1)}, grad_output=gy)


def _max_over_ranks(value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def demo_rows() -> list[dict]:
    """Foundation section of ``twinshard demo`` (run on every rank of a 4-rank world): the
    adjoint gap of each comm op, and the example twin's parity on a 2 x 2 grid, with bytes."""
    from twinshard.runtime import make_grid
    from twinshard.testing.checks import adjoint_pair

    grid = make_grid((2, 2))
    r = grid.rank
    x = synthetic(3, 5, seed=10 + r)
    splits = [(r + s) % 3 for s in range(grid.size)]  # symmetric, uneven, with empty messages
    ops = {
        "all_reduce (world)": (comm.all_reduce, x),
        "all_gather dim 1 (row)": (lambda t: comm.all_gather(t, 1, grid.row_group), x),
        "reduce_scatter dim 0 (col, uneven)": (
            lambda t: comm.reduce_scatter(t, 0, grid.col_group, [1, 2]),
            x,
        ),
        "all_to_all (uneven splits)": (
            lambda t: comm.all_to_all(t, splits, splits),
            synthetic(sum(splits), 5, seed=r),
        ),
        "ring_shift cols k=1": (lambda t: comm.ring_shift(t, grid, "cols", 1), x),
        "grid_transpose": (lambda t: comm.grid_transpose(t, grid), x),
    }
    rows = []
    for name, (f, xin) in ops.items():
        with comm.CommLedger() as led:
            lhs, rhs = adjoint_pair(f, xin, seed=20 + r)
        rows.append(
            {
                "what": f"adjoint <dy,f(x)> = <f*(dy),x>: {name}",
                "grid": "2x2",
                "max_abs_error": abs(lhs - rhs),
                "bytes_per_rank": _max_over_ranks(led.bytes_sent),
            }
        )
    with comm.CommLedger() as led:
        res = run_example_twin(grid, n=7)
    ser = serial_example(n=7)
    err = max(
        [
            float((res.out - ser["serial_out"]).abs().max()),
            float((res.grads_in["z"] - ser["serial_grads_in"]["z"]).abs().max()),
        ]
        + [float((res.param_grads[k] - g).abs().max()) for k, g in ser["serial_param_grads"].items()]
    )
    rows.append(
        {
            "what": "pair MLP twin (N=7, fwd + bwd + param grads)",
            "grid": "2x2",
            "max_abs_error": _max_over_ranks(err),
            "bytes_per_rank": _max_over_ranks(led.bytes_sent),
        }
    )
    return rows
