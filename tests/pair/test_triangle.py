"""Triangle multiplication: serial reference against naive loops, CP twin against serial."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.testing import assert_close

from twinshard.pair.features import PairLayout, collect_grad, collect_tensor, real_part, shard_tensor
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


class _SkewedFetch(contraction._Fetch):
    """Planted bug: Cannon's skew hands X the tile one block too far along its columns."""

    def __init__(self, grid, ops, wants, op):
        if op.endswith(":skew") and len(ops) == 2:
            want_x, cols = wants[0], ops[0].cols

            def shifted(rank):
                rows, (c0, c1) = want_x(rank)
                lo = (c1 % cols) if c1 - c0 < cols else c0
                return rows, (lo, lo + (c1 - c0))

            wants = [shifted, *wants[1:]]
        super().__init__(grid, ops, wants, op)


_K_SEGMENTS = contraction.k_segments
_CHUNKS = contraction._chunks


def _last_chunk_dropped(n, parts):
    """Planted bug: the ring's last channel chunk is never multiplied nor moved (Cannon, bmm)."""
    return _CHUNKS(n, parts)[:-1]


class _PiecesAtOrigin(contraction._Fetch):
    """Planted bug: every SUMMA piece lands at the start of its block (offsets dropped)."""

    def wait_pieces(self):
        return [[(0, 0, p) for _, _, p in pieces] for pieces in super().wait_pieces()]


def _segments_off_by_one(k, kx, ky):
    """Planted bug: SUMMA's first k-segment starts at 1, so k = 0 (a real token) never counts."""
    segs = _K_SEGMENTS(k, kx, ky)
    return [(segs[0][0] + 1, segs[0][1]), *segs[1:]]


def _skip_grad_reduce(params, like):
    return list(params)


@contextlib.contextmanager
def planted(bug):
    """Plant one bug in the contraction or gradient code for the duration of a rank function
    (test scope: the module attributes are restored afterwards, even on error)."""
    saved = (
        contraction._Fetch,
        contraction._orient,
        contraction.k_segments,
        tokenwise.replicated_params,
        contraction._chunks,
    )
    if bug == "skew":  # the first operand skewed one step too far
        contraction._Fetch = _SkewedFetch
    elif bug == "transpose":  # a mirrored tile used untransposed
        contraction._orient = lambda t, trans: t
    elif bug == "segment":  # an off-by-one SUMMA k-segment (rectangular grids)
        contraction.k_segments = _segments_off_by_one
    elif bug == "chunk":  # the Cannon ring's last channel chunk skipped
        contraction._chunks = _last_chunk_dropped
    elif bug == "pieces":  # SUMMA pieces accumulated at the wrong block
        contraction._Fetch = _PiecesAtOrigin
    elif bug == "grad_reduce":  # parameter gradients never summed
        tokenwise.replicated_params = _skip_grad_reduce
    elif bug is not None:
        raise ValueError(f"unknown planted bug {bug!r}")
    try:
        yield
    finally:
        contraction._Fetch, contraction._orient, contraction.k_segments = saved[:3]
        tokenwise.replicated_params, contraction._chunks = saved[3:]


def _rank_trimul(grid, directions, b, n, bug=None):
    """Every rank: twin on its padded tiles, output gathered, random grad_output backpropagated."""
    with planted(bug):
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
            full = collect_tensor(out)
            full.backward(random_grad_output(full, seed=2))
            results[direction] = TwinResult(
                out=full.detach(),
                grads_in={"z": collect_grad(z.grad, "pair", grid)},  # each rank's z.grad: its tile
                param_grads={k: v.grad for k, v in twin.named_parameters()},
                shards={"z": real_part(zd), "out": real_part(out)},
                params=parameter_signature(twin),
            )
        return results


def _check(grid, direction, b, n, ranks):
    serial = _serial_trimul(direction)
    z, mask = _inputs(b, n)
    check_twin(
        what=f"trimul-{direction} N={n} B={b}",
        grid=grid_id(grid),
        ranks=[r[direction] for r in ranks],
        **serial_reference(serial, lambda z: serial(z, mask), {"z": z}, grad_seed=2),
    )


# (grid, N, B): N divisible by the grid and not (13 on 2x2 and 2x3, 7 on 3x3: one-token
# blocks); no grid row or column left with padding only (every rank holds real data).
CASES = [
    ((1, 1), 5, 1),
    ((2, 2), 8, 2),
    ((2, 2), 13, 1),
    ((3, 3), 7, 1),
    ((1, 2), 6, 1),
    ((2, 3), 13, 1),
    ((3, 2), 13, 1),
]


@pytest.mark.parametrize("grid,n,b", CASES, ids=[f"{grid_id(g)}-N{n}" for g, n, _ in CASES])
def test_cp_trimul_matches_serial(grid, n, b):
    ranks = run_on_grid(_rank_trimul, grid, DIRECTIONS, b, n)
    for direction in DIRECTIONS:
        _check(grid, direction, b, n, ranks)


# (bug, grid, N, direction, message): a forward bug first shows in the output's shards
# (each rank's block against the serial output), a missing gradient sum in the replication.
CONTROLS = [
    ("skew", (2, 2), 6, "outgoing", r"trimul-outgoing N=6 B=1: out: rank \d's piece differs"),
    ("transpose", (2, 2), 6, "incoming", r"trimul-incoming N=6 B=1: out: rank \d's piece differs"),
    ("segment", (2, 3), 13, "outgoing", r"trimul-outgoing N=13 B=1: out: rank \d's piece differs"),
    ("segment", (2, 3), 13, "incoming", r"trimul-incoming N=13 B=1: out: rank \d's piece differs"),
    ("chunk", (2, 2), 6, "outgoing", r"trimul-outgoing N=6 B=1: out: rank \d's piece differs"),
    ("pieces", (2, 3), 13, "incoming", r"trimul-incoming N=13 B=1: out: rank \d's piece differs"),
    ("grad_reduce", (2, 2), 6, "outgoing", r"parameter gradients\[norm_in.weight\] is not replicated"),
]


@pytest.mark.parametrize("bug,grid,n,direction,match", CONTROLS, ids=[f"{c[0]}-{c[3]}" for c in CONTROLS])
def test_negative_controls_fail_parity(bug, grid, n, direction, match):
    # Each planted bug must break parity (a harness that passes them proves nothing).
    ranks = run_on_grid(_rank_trimul, grid, (direction,), 1, n, bug)
    with pytest.raises(AssertionError, match=match):
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
