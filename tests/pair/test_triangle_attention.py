"""CP triangle attention (starting and ending node) against the serial reference.

What each test proves:
- ``test_transpose_tiles_*``: the general tile transposition (any grid shape) moves every
  element to its transposed place, and its backward is its exact adjoint
  (``<dy, f(x)> = <f*(dy), x>`` at round-off).
- ``test_cp_triangle_attention_matches_serial``: forward, input gradient and every parameter
  gradient equal serial (fp64, the harness's round-off gate) on 1x1, 2x2, 3x3, 1x2, 2x3 grids,
  even and uneven N, with a random mask holding a fully masked row and a fully masked column
  (the reference's no-mask-bias rule, in both frames), and with ``mask=None`` on padded input.
- ``test_query_rows_in_chunks_match_serial``: with the logits budget cut to a few rows, the
  query rows of each ring step run in chunks (one row, and uneven chunks) and still equal serial.
- ``test_cp_triangle_attention_fp32``: the same in fp32 against the fp32 serial module, under a
  budget derived in ``FP32_WHY``.
- ``test_saved_bytes_per_rank``: saved-for-backward bytes per rank <= 1.25 x serial / P at 2x2
  and 3x3.
- ``test_negative_controls_fail_parity``: a dropped log-sum-exp rescale, a ring shifted the wrong
  way and a missing bias-gradient send in backward, each planted from the test, fail parity with
  the message named.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from twinshard.comm import transpose_tiles
from twinshard.comm.adjoint import adjoint_pair
from twinshard.memory import SavedBytes
from twinshard.pair.features import (
    PairLayout,
    collect_grad,
    collect_tensor,
    layout_of,
    padding_keep,
    real_part,
    shard_tensor,
)
from twinshard.pair.layers import triangle_attention as cp_ta
from twinshard.pair.layers.triangle_attention import (
    CPTriangleAttentionEndingNode,
    CPTriangleAttentionStartingNode,
)
from twinshard.pair.reference.triangle_attention import (
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
)
from twinshard.pair.tiling import PAIR, tile_slices
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

C, CH, HEADS = 6, 4, 2  # pair channels, per-head width, heads
NODES = ("start", "end")
_DTYPES = {"float64": torch.float64, "float32": torch.float32}


# -- the general tile transposition ------------------------------------------------------------


def _rank_transpose(grid, n):
    full = synthetic(2, n, n, 3, seed=5)
    idx = tile_slices(full.shape, grid, PAIR)
    mine = full[idx].contiguous()
    got = transpose_tiles(mine, grid)
    want = full.transpose(1, 2)[idx]
    lhs, rhs = adjoint_pair(lambda t: transpose_tiles(t, grid), mine, seed=11 + grid.rank)
    return bool(torch.equal(got, want)), lhs, rhs


@pytest.mark.parametrize(
    "grid,n", [((1, 1), 3), ((2, 2), 4), ((1, 2), 4), ((2, 3), 6), ((3, 2), 12), ((3, 3), 6)]
)
def test_transpose_tiles_moves_and_is_its_own_adjoint(grid, n):
    ranks = run_on_grid(_rank_transpose, grid, n)
    assert all(ok for ok, _, _ in ranks), "a tile of X^T differs from the transposed full tensor"
    lhs, rhs = ranks[0][1], ranks[0][2]
    assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), (lhs, rhs)


# -- twins against serial ------------------------------------------------------------------------


def _serial(node: str, dtype: torch.dtype = torch.float64):
    torch.manual_seed(31)
    cls = TriangleAttentionStartingNode if node == "start" else TriangleAttentionEndingNode
    m = cls(C, c_hidden=CH, no_heads=HEADS).double()
    perturb_zero_parameters(m)  # linear_o ("final") and linear_g ("gating") start at zero
    with torch.no_grad():  # LayerNorm starts at (1, 0): move off it so every term matters
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m.to(dtype)


def _twin(node: str, serial):
    cls = CPTriangleAttentionStartingNode if node == "start" else CPTriangleAttentionEndingNode
    twin = cls(C, c_hidden=CH, no_heads=HEADS).to(next(serial.parameters()).dtype)
    twin.load_state_dict(serial.state_dict())
    return twin


def _inputs(b: int, n: int, dtype: torch.dtype):
    z = synthetic(b, n, n, C, seed=1, dtype=dtype)
    mask = random_mask(b, n, n, seed=7, keep=0.75).to(dtype)
    mask[0, 1, :] = 0  # a fully masked row: no mask bias there (starting-node frame)
    mask[-1, :, n - 2] = 0  # a fully masked column: the same rule in the ending-node frame
    return z, mask


def _padding_is_zero(y) -> bool:
    keep = padding_keep(y, layout_of(y), "pair")
    if keep is None:
        return True
    local = y.to_local()
    return bool((local.masked_select(~keep.view(keep.shape + (1,)).expand(local.shape)) == 0).all())


_MERGE, _RING_PEERS, _GRAD_MOVES = cp_ta._merge, cp_ta._ring_peers, cp_ta._bias_grad_moves


def _merge_without_rescale(m, l, acc, s, v):
    """Planted: the numerator summed so far is not rescaled when the running max grows."""
    if m is None:
        return _MERGE(m, l, acc, s, v)
    m_new = torch.maximum(m, s.amax(-1))
    p = torch.exp(s - m_new.unsqueeze(-1))
    return m_new, l * torch.exp(m - m_new) + p.sum(-1), acc + torch.einsum("bihjk,bihkd->bihjd", p, v)


def _ring_wrong_way(grid, t):
    """Planted: the ring shifts right instead of left (the skew and the delivery are unchanged)."""
    to, frm = _RING_PEERS(grid, t)
    return (frm, to) if 0 < t < grid.cols else (to, frm)


def _no_remote_bias_grads(grid, n, t):
    """Planted: backward never sends the bias gradients to other ranks (only the self piece stays)."""
    sends, recvs = _GRAD_MOVES(grid, n, t)
    return [x for x in sends if x[0] == grid.rank], [x for x in recvs if x[0] == grid.rank]


@contextlib.contextmanager
def planted(bug):
    """Plant one bug in the ring attention for the duration of a rank function."""
    saved = (cp_ta._merge, cp_ta._ring_peers, cp_ta._bias_grad_moves)
    if bug == "lse_rescale":
        cp_ta._merge = _merge_without_rescale
    elif bug == "ring_direction":
        cp_ta._ring_peers = _ring_wrong_way
    elif bug == "bias_grad_send":
        cp_ta._bias_grad_moves = _no_remote_bias_grads
    elif bug is not None:
        raise ValueError(f"unknown planted bug {bug!r}")
    try:
        yield
    finally:
        cp_ta._merge, cp_ta._ring_peers, cp_ta._bias_grad_moves = saved


def _rank_attention(grid, nodes, modes, b, n, dtype_name="float64", bug=None):
    """Every rank: the twin on its padded tiles (mask given, or mask=None from the layout),
    output gathered, a random grad_output backpropagated, per-tile input gradients summed."""
    dtype = _DTYPES[dtype_name]
    results, pad_zero = {}, {}
    layout = PairLayout.for_sizes(n, grid)
    with planted(bug):
        for node in nodes:
            for mode in modes:
                twin = _twin(node, _serial(node, dtype))
                z, mask = _inputs(b, n, dtype)
                z.requires_grad_(True)
                zd = shard_tensor(z, "pair", grid, layout)
                out = twin(zd, shard_tensor(mask, "pair", grid, layout)) if mode == "mask" else twin(zd)
                full = collect_tensor(out)
                full.backward(random_grad_output(full, seed=2))
                pad_zero[(node, mode)] = _padding_is_zero(out)
                results[(node, mode)] = TwinResult(
                    out=full.detach(),
                    grads_in={"z": collect_grad(z.grad, "pair", grid)},
                    param_grads={k: p.grad for k, p in twin.named_parameters()},
                    shards={"z": real_part(zd), "out": real_part(out)},
                    params=parameter_signature(twin),
                )
    return results, pad_zero


FP32_WHY = (
    "fp32: the harness round-off formula 2 eps + 16 sqrt(n) eps (eps = 1.2e-7, sums in fp32) with "
    "n = B N^2, the longest sum behind any compared value (a parameter gradient over every pair "
    "entry), times the largest reference magnitude over output and gradients"
)


def _fp32_budget(b: int, n: int) -> float:
    eps = torch.finfo(torch.float32).eps
    return 2 * eps + 16 * (b * n * n) ** 0.5 * eps


def _check(grid, node, mode, b, n, ranks, dtype_name="float64"):
    dtype = _DTYPES[dtype_name]
    serial = _serial(node, dtype)
    z, mask = _inputs(b, n, dtype)
    ref = serial_reference(
        serial, lambda z: serial(z, mask if mode == "mask" else None), {"z": z}, grad_seed=2
    )
    tol = {}
    if dtype == torch.float32:
        k = _fp32_budget(b, n)
        scale = max(
            float(t.abs().max())
            for t in [
                ref["serial_out"],
                *ref["serial_grads_in"].values(),
                *ref["serial_param_grads"].values(),
            ]
        )
        tol = {"rtol": 0.0, "atol": k * scale, "why": f"{FP32_WHY} = {k:.2g} x {scale:.3g}"}
    check_twin(
        what=f"tri-attn-{node} {mode} {dtype_name} N={n} B={b}",
        grid=grid_id(grid),
        ranks=[r[0][(node, mode)] for r in ranks],
        **tol,
        **ref,
    )


# (grid, N, B): even N (no padding) and uneven N (padding) on each grid; no grid row or column
# of padding only, so every rank holds real data.
CASES = [
    ((1, 1), 5, 2),
    ((2, 2), 6, 2),
    ((2, 2), 7, 1),
    ((3, 3), 6, 1),
    ((3, 3), 7, 1),
    ((1, 2), 4, 2),
    ((1, 2), 5, 1),
    ((2, 3), 6, 1),
    ((2, 3), 9, 1),
    ((3, 2), 7, 1),
]


@pytest.mark.parametrize("grid,n,b", CASES, ids=[f"{grid_id(g)}-N{n}" for g, n, _ in CASES])
def test_cp_triangle_attention_matches_serial(grid, n, b):
    ranks = run_on_grid(_rank_attention, grid, NODES, ("mask", "none"), b, n)
    for node in NODES:
        for mode in ("mask", "none"):
            _check(grid, node, mode, b, n, ranks)
    for r, (_, pad_zero) in enumerate(ranks):
        assert all(pad_zero.values()), f"rank {r}: padding of the output is not zero: {pad_zero}"


def _rank_chunked(grid, b, n, budget):
    """``_rank_attention`` with the logits budget cut to a few query rows per chunk; also returns
    the chunkings the ring used (forward and backward), so the test sees them cut."""
    saved, used = (cp_ta.LOGITS_BUDGET, cp_ta.row_chunks), []

    def spy(shape, keys):
        used.append(saved[1](shape, keys))
        return used[-1]

    cp_ta.LOGITS_BUDGET, cp_ta.row_chunks = budget, spy
    try:
        return _rank_attention(grid, NODES, ("mask", "none"), b, n), used
    finally:
        cp_ta.LOGITS_BUDGET, cp_ta.row_chunks = saved


# (grid, N, budget in logits elements): one row per chunk on 2x2 (tile rows 4, 32 elements a row);
# uneven chunks on 2x3 (N = 9 padded to 10 x 9: 5 rows in 3 + 2, 18 elements a row) and 3x3
# (3 rows in 2 + 1, 18 elements a row).
CHUNKED = [((2, 2), 7, 32), ((2, 3), 9, 54), ((3, 3), 7, 36)]


@pytest.mark.parametrize("grid,n,budget", CHUNKED, ids=[grid_id(g) for g, _, _ in CHUNKED])
def test_query_rows_in_chunks_match_serial(grid, n, budget):
    """The logits block held per ring step is bounded by cutting the tile's query rows into
    chunks (``LOGITS_BUDGET``); forward and backward still equal serial at round-off."""
    ranks = run_on_grid(_rank_chunked, grid, 1, n, budget)
    for node in NODES:
        for mode in ("mask", "none"):
            _check(grid, node, mode, 1, n, [r[0] for r in ranks])
    rows = PairLayout.for_sizes(n, grid).padded[0] // grid[0]
    for r, (_, used) in enumerate(ranks):
        assert used, f"rank {r}: the ring never chose its row chunks"
        for chunks in used:
            sizes = [b - a for a, b in chunks]
            assert len(chunks) > 1 and sum(sizes) == rows and chunks[0][0] == 0, (
                f"rank {r}: rows {chunks} do not cut the tile's {rows} query rows into several chunks"
            )
            assert all(a1 == b0 for (_, b0), (a1, _) in zip(chunks, chunks[1:])), f"rank {r}: gap in {chunks}"


@pytest.mark.parametrize("grid,n", [((2, 3), 9), ((3, 3), 7)], ids=["2x3-N9", "3x3-N7"])
def test_cp_triangle_attention_fp32(grid, n):
    ranks = run_on_grid(_rank_attention, grid, NODES, ("mask",), 1, n, "float32")
    for node in NODES:
        _check(grid, node, "mask", 1, n, ranks, "float32")


# -- memory saved for backward -----------------------------------------------------------------


def _saved_bytes(forward) -> int:
    with SavedBytes() as saved:
        out = forward()
    del out
    return saved.bytes


def _rank_saved(grid, node, n, b):
    layout = PairLayout.for_sizes(n, grid)
    serial = _serial(node)
    twin = _twin(node, serial)
    z, mask = _inputs(b, n, torch.float64)
    zs = z.clone().requires_grad_(True)
    serial_bytes = _saved_bytes(lambda: serial(zs, mask))
    zd = shard_tensor(z, "pair", grid, layout).detach().requires_grad_(True)
    md = shard_tensor(mask, "pair", grid, layout)
    twin_bytes = _saved_bytes(lambda: twin(zd, md))
    return serial_bytes, twin_bytes, sum(p.nbytes for p in serial.parameters())


@pytest.mark.parametrize("grid,n", [((2, 2), 8), ((3, 3), 9)], ids=["2x2-N8", "3x3-N9"])
@pytest.mark.parametrize("node", NODES)
def test_saved_bytes_per_rank(grid, n, node):
    """Distinct storages packed by saved_tensors_hooks in the forward, parameters included on
    both sides (the rule of ``twinshard bench pair``): every rank holds all parameters, which
    do not divide by P, so B = 2 keeps them a small part at these tiny sizes. The ratio without
    them (parameter bytes subtracted on both sides) is checked too."""
    b = 2
    ranks = run_on_grid(_rank_saved, grid, node, n, b)
    p = grid[0] * grid[1]
    serial, _, params = ranks[0]
    worst = max(t for _, t, _ in ranks)
    ratio = worst / (serial / p)
    ratio_act = (worst - params) / ((serial - params) / p)
    print(
        f"saved bytes {node} {grid_id(grid)} N={n} B={b}: serial {serial}, max per rank {worst}, "
        f"ratio {ratio:.3f}; without the {params} parameter bytes {ratio_act:.3f}"
    )
    assert ratio <= 1.25, f"saved bytes per rank {worst} > 1.25 x serial/P ({serial}/{p}): ratio {ratio:.3f}"
    assert ratio_act <= 1.25, f"saved activation bytes per rank: ratio {ratio_act:.3f} > 1.25"


# -- negative controls ---------------------------------------------------------------------------

CONTROLS = [
    ("lse_rescale", (2, 2), 6, "start", r"tri-attn-start mask float64 N=6 B=1: out: rank \d's piece differs"),
    (
        "ring_direction",
        (3, 3),
        6,
        "start",
        r"tri-attn-start mask float64 N=6 B=1: out: rank \d's piece differs",
    ),
    ("ring_direction", (2, 3), 6, "end", r"tri-attn-end mask float64 N=6 B=1: out: rank \d's piece differs"),
    (
        "bias_grad_send",
        (2, 2),
        6,
        "start",
        r"parity of tri-attn-start mask float64 N=6 B=1 d/dz on grid 2x2 fails",
    ),
]


@pytest.mark.parametrize(
    "bug,grid,n,node,match", CONTROLS, ids=[f"{c[0]}-{grid_id(c[1])}-{c[3]}" for c in CONTROLS]
)
def test_negative_controls_fail_parity(bug, grid, n, node, match):
    ranks = run_on_grid(_rank_attention, grid, (node,), ("mask",), 1, n, "float64", bug)
    with pytest.raises(AssertionError, match=match):
        _check(grid, node, "mask", 1, n, ranks)
