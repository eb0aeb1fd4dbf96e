"""The pair section of ``twinshard demo``: triangle multiplications and outer product mean on 2x2.

``demo_rows()`` runs on every rank of a 4-rank world. Each row runs the CP twin forward and
backward on a small uneven problem (N = 13 tokens padded to 14, S = 5 sequences padded to 6,
random masked entries) against the serial module on the same seeded inputs and parameters,
and reports the worst absolute error over the output, the input gradient and every parameter
gradient, and the most bytes any rank moved (forward + backward, from the CommLedger).
"""

from __future__ import annotations

from typing import Any

import torch

from twinshard.comm import CommLedger
from twinshard.comm import primitives as P
from twinshard.pair.features import PairLayout, collect_tensor, shard_tensor
from twinshard.pair.layers.outer_product import CPOuterProductMean
from twinshard.pair.layers.triangle import CPTriangleMultiplication
from twinshard.pair.reference.outer_product import OuterProductMean
from twinshard.pair.reference.triangle import TriangleMultiplication
from twinshard.runtime import make_grid

__all__ = ["demo_rows"]

N, S, C, H = 13, 5, 8, 4


def _modules(op: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    if op == "opm":
        serial, twin = OuterProductMean(C, H, C), CPOuterProductMean(C, H, C)
    else:
        serial = TriangleMultiplication(C, op, hidden=H)
        twin = CPTriangleMultiplication(C, op, hidden=H)
    serial, twin = serial.double(), twin.double()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # AF3 zero inits would hide most of the backward: randomise all
        for p in serial.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5 + 0.1)
    twin.load_state_dict(serial.state_dict())
    return serial, twin


def _row(op: str, grid_shape: tuple[int, int]) -> dict[str, Any]:
    grid = make_grid(grid_shape)
    serial, twin = _modules(op)
    kind = "msa" if op == "opm" else "pair"
    lead = (1, S, N) if op == "opm" else (1, N, N)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(*lead, C, generator=g, dtype=torch.float64)
    mask = (torch.rand(*lead, generator=g) > 0.2).double()
    gout = torch.randn(1, N, N, C, generator=g, dtype=torch.float64)

    xs = x.clone().requires_grad_(True)
    out_s = serial(xs, mask)
    out_s.backward(gout)

    layout = PairLayout.for_sizes(N, grid, n_seqs=S if op == "opm" else None)
    xc = x.clone().requires_grad_(True)
    with CommLedger() as ledger:
        out = twin(shard_tensor(xc, kind, grid, layout), shard_tensor(mask, kind, grid, layout))
        local = out.to_local()
        full = collect_tensor(out.detach(), layout, "pair")  # for the error only, no grad
        local.backward(shard_tensor(gout, "pair", grid, layout).to_local())
    moved = max(ledger.bytes_sent, ledger.bytes_recv)
    grad_in = P.all_reduce(xc.grad)  # each rank's gradient covers its own tile
    err = max(
        (full - out_s.detach()).abs().max().item(),
        (grad_in - xs.grad).abs().max().item(),
        *((a.grad - b.grad).abs().max().item() for a, b in zip(serial.parameters(), twin.parameters())),
    )
    # The same row on every rank: worst error and most bytes over the ranks.
    both = P.all_gather(torch.tensor([[err, float(moved)]], dtype=torch.float64), 0)
    names = {
        "outgoing": "triangle multiplication (outgoing)",
        "incoming": "triangle multiplication (incoming)",
        "opm": "outer product mean",
    }
    sizes = f"N={N}" + (f", S={S}" if op == "opm" else "")
    return {
        "what": f"{names[op]}, {sizes}, masked",
        "grid": f"{grid_shape[0]}x{grid_shape[1]}",
        "max_abs_error": float(both[:, 0].max()),
        "bytes_per_rank": int(both[:, 1].max()),
    }


def demo_rows() -> list[dict[str, Any]]:
    """Rows {what, grid, max_abs_error, bytes_per_rank}, identical on every rank of a 4-rank world."""
    return [_row(op, (2, 2)) for op in ("outgoing", "incoming", "opm")]
