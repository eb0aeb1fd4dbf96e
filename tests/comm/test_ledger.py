"""Ledger byte counts equal the analytic sizes of each op."""

import torch
import torch.distributed as dist

from twinshard import comm
from twinshard.testing import run_on_grid


def _ops(grid):
    r, n = grid.rank, grid.size
    f8 = 8  # fp64 bytes
    x = torch.ones(6, 5, dtype=torch.float64, requires_grad=True)
    expect = {}
    with comm.CommLedger() as led:
        comm.all_reduce(x)
        expect["all_reduce"] = (2 * (n - 1) * 30 * f8 // n,) * 2
        sizes = [1, 2, 3, 4][:n]
        comm.all_gather(torch.ones(sizes[r], 5, dtype=torch.float64), 0, sizes=sizes)
        expect["all_gather"] = (max(sizes) * 5 * f8 * (n - 1),) * 2
        comm.reduce_scatter(torch.ones(sum(sizes), 5, dtype=torch.float64), 0, sizes=sizes)
        expect["reduce_scatter"] = (max(sizes) * 5 * f8 * (n - 1),) * 2
        send = [s + 1 for s in range(n)]
        recv = [r + 1] * n
        comm.all_to_all(torch.ones(sum(send), 5, dtype=torch.float64), send, recv)
        expect["all_to_all"] = ((sum(send) - send[r]) * 5 * f8, (sum(recv) - recv[r]) * 5 * f8)
        comm.broadcast(torch.ones(7, dtype=torch.float32), 1)
        expect["broadcast"] = (7 * 4 * (n - 1) if r == 1 else 0, 0 if r == 1 else 7 * 4)
        comm.ring_shift(torch.ones(3, 3, dtype=torch.float64), grid, "cols", 1)
        expect["ring_shift"] = (9 * f8, 9 * f8)
        comm.grid_transpose(torch.ones(2, 2, dtype=torch.float64), grid)
        diag = grid.coords[0] == grid.coords[1]
        expect["grid_transpose"] = (0, 0) if diag else (4 * f8, 4 * f8)
        y = comm.all_gather(x, 1)
        y.backward(torch.ones_like(y) * 2)  # backward bytes recorded under "<op>:backward"
        expect["all_gather"] = tuple(a + b for a, b in zip(expect["all_gather"], (30 * f8 * (n - 1),) * 2))
        expect["all_gather:backward"] = (30 * f8 * (n - 1),) * 2
    got = {k: (v.bytes_sent, v.bytes_recv) for k, v in led.ops.items()}
    calls = {k: v.calls for k, v in led.ops.items()}
    dist.barrier()
    return got, expect, calls


def test_ledger_bytes_match_analytic_sizes():
    for got, expect, calls in run_on_grid(_ops, (2, 2)):
        for op, e in expect.items():
            if e == (0, 0):
                assert op not in got
            else:
                assert got[op] == e, op
        assert calls["all_gather"] == 2 and calls["all_reduce"] == 1


def test_one_rank_groups_issue_nothing():
    ((got, expect, calls),) = run_on_grid(_ops, (1, 1))
    assert got == {}
