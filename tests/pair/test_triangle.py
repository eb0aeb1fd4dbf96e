"""Triangle multiplication: serial reference against naive loops, CP twin against serial."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from twinshard.comm import primitives as P
from twinshard.pair.features import PairLayout, collect_tensor, shard_tensor
from twinshard.pair.layers import contraction, tokenwise
from twinshard.pair.layers.triangle import CPTriangleMultiplication
from twinshard.pair.reference.triangle import (
    TriangleMultiplication,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
    triangle_contract,
)
from twinshard.testing import (
    TwinResult,
    check_twin,
    grid_id,
    parameter_signature,
    perturb_zero_parameters,
    random_grad_output,
    random_mask,
    randomize_parameters,
    run_on_grid,
    serial_reference,
    synthetic,
)


def _naive_trimul(mod: TriangleMultiplication, z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Triple loop over (i, j, k) straight from AF3 Alg. 12/13, no einsum, no chunk."""
    B, N, _, c = z.shape
    h = mod.hidden
    ln_in, ln_out = mod.norm_in, mod.norm_out

    def ln(v, mod_ln):
        mu = v.mean(-1, keepdim=True)
        var = ((v - mu) ** 2).mean(-1, keepdim=True)
        return (v - mu) / torch.sqrt(var + mod_ln.eps) * mod_ln.weight + mod_ln.bias

    out = torch.zeros_like(z)
    for bb in range(B):
        x = ln(z[bb], ln_in)
        p = x @ mod.p_in.weight.T
        g = torch.sigmoid(x @ mod.g_in.weight.T)
        ab = p * g * mask[bb][..., None]
        a, b = ab[..., :h], ab[..., h:]
        o = torch.zeros(N, N, h, dtype=z.dtype)
        for i in range(N):
            for j in range(N):
                for k in range(N):
                    if mod.direction == "outgoing":
                        o[i, j] += a[i, k] * b[j, k]
                    else:
                        o[i, j] += a[k, i] * b[k, j]
        out[bb] = (ln(o, ln_out) @ mod.p_out.weight.T) * torch.sigmoid(x @ mod.g_out.weight.T)
    return out


@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
def test_trimul_matches_naive_loops(direction):
    torch.manual_seed(0)
    mod = TriangleMultiplication(6, direction, hidden=4).double()
    randomize_parameters(mod, 1)
    z = torch.randn(2, 5, 5, 6, dtype=torch.float64)
    mask = (torch.rand(2, 5, 5) > 0.3).double()
    assert_close(mod(z, mask), _naive_trimul(mod, z, mask))


def test_trimul_parameter_names_and_order():
    names = [n for n, _ in TriangleMultiplicationOutgoing(8).named_parameters()]
    assert names == [
        "norm_in.weight",
        "norm_in.bias",
        "p_in.weight",
        "g_in.weight",
        "norm_out.weight",
        "norm_out.bias",
        "p_out.weight",
        "g_out.weight",
    ]
    mod = TriangleMultiplicationIncoming(8, hidden=3)
    assert mod.p_in.weight.shape == (6, 8) and mod.p_out.weight.shape == (8, 3)


def test_incoming_contraction_is_outgoing_of_transpose():
    # Alg. 13's contraction is Alg. 12's on transposed operands (the CP twin relies on it).
    torch.manual_seed(2)
    a, b = torch.randn(2, 2, 7, 7, 3, dtype=torch.float64)
    expect = triangle_contract(a.transpose(1, 2), b.transpose(1, 2), "outgoing")
    assert_close(triangle_contract(a, b, "incoming"), expect)


def test_trimul_masked_rows_do_not_contribute():
    torch.manual_seed(4)
    mod = TriangleMultiplicationOutgoing(4).double()
    randomize_parameters(mod, 5)
    z = torch.randn(1, 6, 6, 4, dtype=torch.float64)
    mask = torch.ones(1, 6, 6, dtype=torch.float64)
    mask[:, :, 5] = 0  # column k = 5 dropped: changing z there must not move any output with j != 5
    base = mod(z, mask)
    z2 = z.clone()
    z2[:, :, 5] += torch.randn(6, 4, dtype=torch.float64)
    other = mod(z2, mask)
    assert_close(other[:, :, :5], base[:, :, :5])
    assert not torch.allclose(other[:, :, 5], base[:, :, 5])


def test_fp64_stays_fp64_and_fp32_accumulates():
    mod = TriangleMultiplicationOutgoing(4).double()
    randomize_parameters(mod, 6)
    z = torch.randn(1, 3, 3, 4, dtype=torch.float64)
    a, _, _ = mod.project_in(z, None)
    assert a.dtype == torch.float64 and mod(z).dtype == torch.float64
    mod16 = TriangleMultiplicationOutgoing(4).to(torch.bfloat16)
    a16, _, _ = mod16.project_in(z.to(torch.bfloat16), None)
    assert a16.dtype == torch.float32 and mod16(z.to(torch.bfloat16)).dtype == torch.bfloat16


def test_shape_errors():
    with pytest.raises(ValueError, match="pair tensor"):
        TriangleMultiplicationOutgoing(4)(torch.randn(1, 3, 4, 4))
    with pytest.raises(ValueError, match="mask"):
        TriangleMultiplicationOutgoing(4)(torch.randn(1, 3, 3, 4), torch.ones(1, 3, 2))
    with pytest.raises(ValueError, match="direction"):
        TriangleMultiplication(4, "sideways")


# -- CP twin against serial ---------------------------------------------------------------------

C, H = 4, 3  # pair channels, channels of a and b (H != C exercises every projection shape)
DIRECTIONS = ("outgoing", "incoming")


def _serial_trimul(direction: str) -> TriangleMultiplication:
    torch.manual_seed(21)
    m = TriangleMultiplication(C, direction, hidden=H).double()
    perturb_zero_parameters(m)  # p_out, g_in, g_out start at zero (AF3 "final"/"gating")
    with torch.no_grad():  # LayerNorms start at (1, 0): move off it so every term matters
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def _inputs(b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    z = synthetic(b, n, n, C, seed=1)
    mask = random_mask(b, n, n, seed=7, keep=0.8)  # random masked entries (plus padding on CP)
    return z, mask


_BUGS = ("skew", "transpose", "grad_reduce")


def _rank_trimul(grid, directions, b, n, bug=None):
    """Every rank: twin on its padded tiles, output gathered, random grad_output backpropagated."""
    saved = (contraction._SKEW_OFFSET, contraction._TRANSPOSE_TILES, tokenwise.replicated_params)
    if bug == "skew":  # negative control: the first operand skewed one step too far
        contraction._SKEW_OFFSET = 1
    elif bug == "transpose":  # negative control: a mirrored tile used untransposed
        contraction._TRANSPOSE_TILES = False
    elif bug == "grad_reduce":  # negative control: parameter gradients never summed
        tokenwise.replicated_params = lambda params, like: list(params)
    try:
        results = {}
        layout = PairLayout.for_sizes(n, grid)
        for direction in directions:
            serial = _serial_trimul(direction)
            twin = CPTriangleMultiplication(C, direction, hidden=H).double()
            twin.load_state_dict(serial.state_dict())
            z, mask = _inputs(b, n)
            z.requires_grad_(True)
            zd = shard_tensor(z, "pair", grid, layout)
            md = shard_tensor(mask, "pair", grid, layout)
            out = twin(zd, md)
            full = collect_tensor(out, layout, "pair")
            full.backward(random_grad_output(full, seed=2))
            results[direction] = TwinResult(
                out=full.detach(),
                grads_in={"z": P.all_reduce(z.grad)},  # each rank's z.grad covers its tile only
                param_grads={k: v.grad for k, v in twin.named_parameters()},
                shards={"z": zd.to_local().detach(), "out": out.to_local().detach()},
                params=parameter_signature(twin),
            )
        return results
    finally:
        contraction._SKEW_OFFSET, contraction._TRANSPOSE_TILES = saved[:2]
        tokenwise.replicated_params = saved[2]


def _check(grid, direction, b, n, ranks):
    serial = _serial_trimul(direction)
    z, mask = _inputs(b, n)
    check_twin(
        what=f"trimul-{direction} N={n} B={b}",
        grid=grid_id(grid),
        ranks=[r[direction] for r in ranks],
        **serial_reference(serial, lambda z: serial(z, mask), {"z": z}, grad_seed=2),
    )


# (grid, N, B): N divisible by the grid and not (13 on 2x2, 7 on 3x3, 7 on 2x3 -> 12).
CASES = [
    ((1, 1), 5, 1),
    ((2, 2), 8, 2),
    ((2, 2), 13, 1),
    ((3, 3), 7, 1),
    ((1, 2), 6, 1),
    ((2, 3), 7, 1),
]


@pytest.mark.parametrize("grid,n,b", CASES, ids=[f"{grid_id(g)}-N{n}" for g, n, _ in CASES])
def test_cp_trimul_matches_serial(grid, n, b):
    ranks = run_on_grid(_rank_trimul, grid, DIRECTIONS, b, n)
    for direction in DIRECTIONS:
        _check(grid, direction, b, n, ranks)


@pytest.mark.parametrize("bug", _BUGS)
def test_negative_controls_fail_parity(bug):
    # Each planted bug must break parity (a harness that passes them proves nothing).
    grid, n = (2, 2), 6
    direction = "incoming" if bug == "transpose" else "outgoing"  # incoming moves A transposed
    ranks = run_on_grid(_rank_trimul, grid, (direction,), 1, n, bug)
    # A missing gradient sum is caught first by the replication check, the others by parity.
    caught = "is not replicated" if bug == "grad_reduce" else "parity of trimul"
    with pytest.raises(AssertionError, match=caught):
        _check(grid, direction, 1, n, ranks)


def _rank_errors(grid):
    z = torch.zeros(1, 4, 4, C, dtype=torch.float64)
    twin = CPTriangleMultiplication(C).double()
    layout = PairLayout.for_sizes(4, grid)
    messages = []
    for call in (
        lambda: twin(z),
        lambda: twin(shard_tensor(z, "single", grid, layout)),
        lambda: twin(
            shard_tensor(z, "pair", grid, layout),
            shard_tensor(z[..., 0], "pair", grid, PairLayout.for_sizes(4, grid)).to_local(),
        ),
    ):
        try:
            call()
            messages.append(None)
        except (TypeError, ValueError) as e:
            messages.append(str(e))
    return messages


def test_cp_trimul_rejects_bad_inputs_on_every_rank():
    per_rank = run_on_grid(_rank_errors, (1, 2))
    assert per_rank[0] == per_rank[1]
    plain, single, _ = per_rank[0]
    assert plain is not None and "DTensor" in plain
    assert single is not None and "placements" in single
