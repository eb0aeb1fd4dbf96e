"""The pair section of ``twinshard demo``: triangle multiplications, outer product mean and a
2-layer Pairformer trunk on 2x2.

``demo_rows()`` runs on every rank of a 4-rank world. Each row runs the CP twin forward and
backward on a small uneven problem (N = 13 tokens padded to 14, S = 5 sequences padded to 6,
random masked entries) against the serial module on the same seeded inputs and parameters,
and reports the worst absolute error over the output, the input gradient and every parameter
gradient, and the most bytes any rank moved (forward + backward, from the CommLedger).

The trunk row runs a 2-layer CP Pairformer stack (``CPPairformerStack``) in training mode with
Boltz-2's dropout (p = 0.25, row and column masks keyed by global index) against the serial
``PairformerStack`` with the same weights and seed: output ``s`` and ``z``, both input
gradients and every parameter gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from twinshard.comm import CommLedger
from twinshard.comm import primitives as P
from twinshard.pair.features import PairLayout, collect_grad, collect_tensor, shard_tensor
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


def _trunk_row(grid_shape: tuple[int, int], layers: int = 2) -> dict[str, Any]:
    from twinshard.pair.layers.pairformer import CPPairformerStack
    from twinshard.pair.reference.pairformer import PairformerStack

    grid = make_grid(grid_shape)
    cs, cz = 8, 8
    kw = dict(num_heads=2, dropout=0.25, pairwise_head_width=4, pairwise_num_heads=2)
    torch.manual_seed(5)  # the same initial weights on every rank
    serial = PairformerStack(cs, cz, layers, **kw).double()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # move off the zero and unit inits so every term matters
        for p in serial.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    twin = CPPairformerStack(cs, cz, layers, **kw).double()
    twin.load_state_dict(serial.state_dict())
    serial.train()
    twin.train()
    s = torch.randn(1, N, cs, generator=g, dtype=torch.float64)
    z = torch.randn(1, N, N, cz, generator=g, dtype=torch.float64)
    mask = (torch.rand(1, N, generator=g) > 0.2).double()
    pair_mask = mask[:, :, None] * mask[:, None, :]
    gs = torch.randn(1, N, cs, generator=g, dtype=torch.float64)
    gz = torch.randn(1, N, N, cz, generator=g, dtype=torch.float64)
    seed = 7

    ss, zs = s.clone().requires_grad_(True), z.clone().requires_grad_(True)
    s_ref, z_ref = serial(ss, zs, mask, pair_mask, seed=seed)
    torch.autograd.backward([s_ref, z_ref], [gs, gz])

    layout = PairLayout.for_sizes(N, grid)
    sc, zc = s.clone().requires_grad_(True), z.clone().requires_grad_(True)
    with CommLedger() as ledger:
        s_out, z_out = twin(
            shard_tensor(sc, "single", grid, layout),
            shard_tensor(zc, "pair", grid, layout),
            shard_tensor(mask, "single", grid, layout),
            shard_tensor(pair_mask, "pair", grid, layout),
            seed=seed,
        )
        torch.autograd.backward(
            [s_out.to_local(), z_out.to_local()],
            [
                shard_tensor(gs, "single", grid, layout).to_local(),
                shard_tensor(gz, "pair", grid, layout).to_local(),
            ],
        )
    moved = max(ledger.bytes_sent, ledger.bytes_recv)
    s_full = collect_tensor(s_out.detach(), layout, "single")
    z_full = collect_tensor(z_out.detach(), layout, "pair")
    gz_in, gs_in = collect_grad(zc.grad, "pair", grid), collect_grad(sc.grad, "single", grid)
    err = max(
        (s_full - s_ref.detach()).abs().max().item(),
        (z_full - z_ref.detach()).abs().max().item(),
        (gs_in - ss.grad).abs().max().item(),
        (gz_in - zs.grad).abs().max().item(),
        *((a.grad - b.grad).abs().max().item() for a, b in zip(serial.parameters(), twin.parameters())),
    )
    both = P.all_gather(torch.tensor([[err, float(moved)]], dtype=torch.float64), 0)
    return {
        "what": f"Pairformer trunk, {layers} layers, N={N}, masked, Boltz dropout",
        "grid": f"{grid_shape[0]}x{grid_shape[1]}",
        "max_abs_error": float(both[:, 0].max()),
        "bytes_per_rank": int(both[:, 1].max()),
    }


def demo_rows() -> list[dict[str, Any]]:
    """Rows {what, grid, max_abs_error, bytes_per_rank}, identical on every rank of a 4-rank world."""
    return [_row(op, (2, 2)) for op in ("outgoing", "incoming", "opm")] + [_trunk_row((2, 2))]
