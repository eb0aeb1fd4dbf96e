"""<dy, f(x)> = <f*(dy), x> in fp64 for every comm op, on worlds and grids, uneven sizes."""

import pytest
import torch
import torch.distributed as dist

from twinshard import comm
from twinshard.testing import run_on_grid, run_on_world
from twinshard.testing.checks import adjoint_pair, assert_parity


def _rand(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _pair(f, x, seed):
    return adjoint_pair(f, x, seed)


def _world_ops(n_unused=None):
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    x = _rand(3, 4, seed=100 + r)
    out["all_reduce"] = _pair(comm.all_reduce, x, 1 + r)
    sizes = [(i % 3) + 1 for i in range(n)]  # uneven blocks, a one-row block included
    xs = _rand(2, sizes[r], 3, seed=200 + r)
    out["all_gather"] = _pair(lambda t: comm.all_gather(t, 1, sizes=sizes), xs, 2 + r)
    xf = _rand(2, sum(sizes), 3, seed=300 + r)
    out["reduce_scatter"] = _pair(lambda t: comm.reduce_scatter(t, 1, sizes=sizes), xf, 3 + r)
    send = [(r + 2 * s) % 3 for s in range(n)]  # zero-row messages included
    recv = [(s + 2 * r) % 3 for s in range(n)]
    xa = _rand(sum(send), 5, seed=400 + r)
    out["all_to_all"] = _pair(lambda t: comm.all_to_all(t, send, recv), xa, 4 + r)
    out["broadcast"] = _pair(lambda t: comm.broadcast(t, n - 1), _rand(4, seed=500 + r), 5 + r)
    # sparse exchange: r sends (r + 1) rows to r + 1 and 2 rows to r + 2 (self when n is small)
    peers = sorted({(r + 1) % n, (r + 2) % n})
    rows = {(r + 1) % n: r + 1, (r + 2) % n: 2}
    if (r + 1) % n == (r + 2) % n:
        rows = {(r + 1) % n: r + 1}
    src_rows = {}
    for s in range(n):
        for d, k in (
            {(s + 1) % n: s + 1, (s + 2) % n: 2} if (s + 1) % n != (s + 2) % n else {(s + 1) % n: s + 1}
        ).items():
            if d == r:
                src_rows[s] = k
    xe = _rand(sum(rows[p] for p in peers), 3, seed=600 + r)

    def ex(t):
        parts, i = [], 0
        for p in peers:
            parts.append((p, t[i : i + rows[p]]))
            i += rows[p]
        got = comm.exchange(parts, [(s, (k, 3)) for s, k in sorted(src_rows.items())])
        return torch.cat(got)

    out["exchange"] = _pair(ex, xe, 6 + r)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(n)).tolist()
    inv = [perm.index(i) for i in range(n)]
    out["permute"] = _pair(lambda t: comm.permute(t, perm[r], inv[r]), _rand(2, 2, seed=700 + r), 7 + r)
    # sync_grad: identity on a replicated value; its adjoint sums the gradients (counted once)
    xr = _rand(3, seed=800).requires_grad_(True)
    y = comm.sync_grad(xr)
    dy = _rand(3, seed=8 + r)
    (g,) = torch.autograd.grad(y, xr, dy)
    t = torch.tensor([float((dy * y).sum())], dtype=torch.float64)
    dist.all_reduce(t)
    out["sync_grad"] = [t.item(), float((g * xr).sum())]
    return out


@pytest.mark.grids((1,), (2,), (3,), (4,))
def test_world_ops_are_adjoint(grid):
    (n,) = grid
    res = run_on_world(_world_ops, n)
    for op, (lhs, rhs) in res[0].items():
        assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-12), (
            f"{op} on {n} ranks is not adjoint: {lhs} vs {rhs}"
        )
    for r in res[1:]:  # the sums were all-reduced: identical everywhere
        assert r == res[0]


def _grid_ops(grid):
    r = grid.rank
    out = {}
    for axis in ("rows", "cols"):
        for k in (1, 2, -1):
            out[f"ring_shift {axis} {k}"] = _pair(
                lambda t, a=axis, k=k: comm.ring_shift(t, grid, a, k), _rand(2, 3, seed=10 + r), 20 + r
            )
    if grid.rows == grid.cols:
        out["grid_transpose"] = _pair(
            lambda t: comm.grid_transpose(t, grid), _rand(2, 2, seed=30 + r), 40 + r
        )
    sizes = [i + 1 for i in range(grid.cols)]
    out["all_gather row"] = _pair(
        lambda t: comm.all_gather(t, 0, grid.row_group, sizes),
        _rand(sizes[grid.coords[1]], 2, seed=50 + r),
        60 + r,
    )
    csz = [2 * i + 1 for i in range(grid.rows)]
    out["reduce_scatter col"] = _pair(
        lambda t: comm.reduce_scatter(t, 1, grid.col_group, csz), _rand(2, sum(csz), seed=70 + r), 80 + r
    )
    out["all_reduce row"] = _pair(lambda t: comm.all_reduce(t, grid.row_group), _rand(4, seed=90 + r), 95 + r)
    return out


@pytest.mark.grids((1, 1), (2, 2), (1, 3), (2, 3), (3, 3))
def test_grid_ops_are_adjoint(grid):
    res = run_on_grid(_grid_ops, grid)
    assert ("grid_transpose" in res[0]) == (grid[0] == grid[1])
    for op, (lhs, rhs) in res[0].items():
        assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-12), (
            f"{op} on {grid} is not adjoint: {lhs} vs {rhs}"
        )


def _ring_values(grid):
    x = torch.tensor([float(grid.rank)])
    return comm.ring_shift(x, grid, "cols", 1).item(), grid.rank_of((grid.coords[0], grid.coords[1] - 1))


@pytest.mark.grids((2, 3))
def test_ring_shift_moves_blocks_forward(grid):
    for got, expected_src in run_on_grid(_ring_values, grid):
        assert got == expected_src


def _low_precision(dtype):
    r, n = dist.get_rank(), dist.get_world_size()
    # values whose bf16 sum loses bits unless accumulated in fp32
    x = (torch.full((64,), 1.0) + _rand(64, seed=r, dtype=torch.float32) * 1e-2).to(dtype)
    with comm.CommLedger() as led:
        y = comm.all_reduce(x)
    allx = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(allx, x)
    ref = torch.stack([a.float() for a in allx]).sum(0).to(dtype)
    xg = x.clone().requires_grad_(True)
    z = comm.all_gather(xg, 0)
    dz = _rand(*z.shape, seed=5 + r, dtype=torch.float32).to(dtype)
    (g,) = torch.autograd.grad(z, xg, dz)
    alld = [torch.empty_like(dz) for _ in range(n)]
    dist.all_gather(alld, dz)
    gref = torch.stack([d.float() for d in alld]).sum(0).view(n, -1)[r].to(dtype)
    return y, ref, g, gref, led.ops["all_reduce"].bytes_sent


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_reductions_accumulate_in_fp32(dtype):
    for y, ref, g, gref, sent in run_on_world(_low_precision, 3, dtype):
        assert y.dtype == g.dtype == dtype
        # bf16: an fp32 sum rounded once equals the result exactly; fp32: up to summation order
        torch.testing.assert_close(y, ref, **({"rtol": 0, "atol": 0} if dtype == torch.bfloat16 else {}))
        torch.testing.assert_close(g, gref, **({"rtol": 0, "atol": 0} if dtype == torch.bfloat16 else {}))
        assert sent == 2 * 2 * 64 * 4 // 3  # travels as fp32


def _sync_params():
    r, n = dist.get_rank(), dist.get_world_size()
    # two dtypes (two buckets), uneven shapes, one parameter the computation never uses
    params = [
        _rand(3, 2, seed=900).requires_grad_(True),
        _rand(4, seed=901, dtype=torch.float32).requires_grad_(True),
        _rand(5, seed=902).requires_grad_(True),
        _rand(2, seed=903).requires_grad_(True),  # unused: its gradient is zero, still summed
    ]
    with comm.CommLedger() as led:
        used = comm.sync_params(params)
        shared = [
            u.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for u, p in zip(used, params)
        ]
        dys = [_rand(*u.shape, seed=10 * r + i, dtype=u.dtype) for i, u in enumerate(used[:3])]
        loss = sum((dy * u).sum() for dy, u in zip(dys, used[:3]))  # each rank's partial gradient
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    alld = []
    for dy in dys:  # the complete gradient: every rank's partial summed
        parts = [torch.empty_like(dy) for _ in range(n)]
        dist.all_gather(parts, dy)
        alld.append(torch.stack(parts).sum(0))
    calls = led.ops["sync_grad:backward"].calls if "sync_grad:backward" in led.ops else 0
    return shared, grads, alld, calls


@pytest.mark.grids((1,), (2,), (3,))
def test_sync_params_sums_gradients_per_dtype_without_copying(grid):
    (n,) = grid
    for shared, grads, alld, calls in run_on_world(_sync_params, n):
        assert all(shared), "sync_params must hand out views of the parameters, not a copy"
        for i, (g, ref) in enumerate(zip(grads[:3], alld)):
            assert_parity(g, ref, what=f"sync_params gradient of parameter {i}", grid=str(n), reduction=n)
        assert grads[3] is None or torch.count_nonzero(grads[3]) == 0
        assert calls == (0 if n == 1 else 2), f"one all-reduce per dtype bucket expected, got {calls}"
