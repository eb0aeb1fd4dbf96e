"""The harness's own checks, with no world: each one passes honest data and fails its planted bug
with a message that says why."""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from twinshard.testing import (
    TwinResult,
    assert_parity,
    assert_shards_cover,
    check_twin,
    random_grad_output,
    synthetic,
    tolerance,
)
from twinshard.testing.evidence import LINES


def _reordered_sum(x: torch.Tensor, chunks: int) -> torch.Tensor:
    """The sum over the last dim in another order: what a distributed reduction computes."""
    return torch.stack([c.sum(-1) for c in x.chunk(chunks, -1)], -1).sum(-1)


def test_roundoff_passes_and_states_its_budget():
    x = synthetic(64, 4096, seed=1)
    ev = assert_parity(_reordered_sum(x, 7), x.sum(-1), what="reordered sum")
    assert 0 < ev.max_abs < ev.budget
    assert "round-off" in ev.tolerance and "n=4096" in ev.tolerance and "float64" in ev.tolerance


def test_budget_derivation():
    eps64, eps32 = torch.finfo(torch.float64).eps, torch.finfo(torch.float32).eps
    assert tolerance(torch.float64, 1.0).atol == pytest.approx(2 * eps64 + 16 * 64 * eps64)
    assert tolerance(torch.float64, 10.0, reduction=100).atol == pytest.approx(10 * (2 + 160) * eps64)
    # float32 and bfloat16 accumulate in float32 (DESIGN rule 5) and round once to their dtype
    assert tolerance(torch.float32, 1.0).atol == pytest.approx((2 + 16 * 64) * eps32)
    bf = tolerance(torch.bfloat16, 1.0)
    assert bf.atol == pytest.approx(2 * torch.finfo(torch.bfloat16).eps + 16 * 64 * eps32)
    assert tolerance(torch.int64, 5.0).atol == 0.0
    assert tolerance(torch.float64, 1.0).atol < 1e-12  # the DESIGN's round-off gate


# Negative controls of assert_parity: what the old default (rtol = atol = 1e-7) let through.
def test_negative_planted_relative_error():
    x = synthetic(8, 16, seed=2)
    with pytest.raises(
        AssertionError, match=r"parity of planted 5e-6 on grid 2x2 fails against rtol=0 atol="
    ):
        assert_parity(x * (1 + 5e-6), x, what="planted 5e-6", grid="2x2")


def test_negative_hidden_float32_cast():
    x = synthetic(8, 256, seed=3)
    w = synthetic(256, 8, seed=4)
    with pytest.raises(AssertionError, match=r"parity of fp32 matmul on grid - fails against rtol=0"):
        assert_parity((x.float() @ w.float()).double(), x @ w, what="fp32 matmul")


def test_negative_dtype_changed_on_the_way():
    x = synthetic(4, 4, seed=5)
    with pytest.raises(AssertionError, match=r"distributed result is torch.float32, serial is torch.float64"):
        assert_parity(x.float(), x, what="cast")


def test_given_tolerance_needs_its_derivation():
    x = synthetic(4, 4, seed=6)
    with pytest.raises(ValueError, match=r"must say how it was derived: pass why="):
        assert_parity(x, x, what="x", rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="give both rtol and atol"):
        assert_parity(x, x, what="x", atol=1e-6)
    ev = assert_parity(x, x, what="x", rtol=0, atol=1e-9, why="1e-9: CIF keeps 9 decimals")
    assert "CIF keeps 9 decimals" in ev.tolerance and LINES[-1].endswith("checks: parity")
    assert "CIF keeps 9 decimals" in LINES[-1]


# Sharding evidence.
def _tiles(full: torch.Tensor, rows: int, cols: int) -> list[tuple[torch.Tensor, tuple[slice, ...]]]:
    out = []
    rb = [math.ceil(full.shape[0] * i / rows) for i in range(rows + 1)]
    cb = [math.ceil(full.shape[1] * j / cols) for j in range(cols + 1)]
    for i in range(rows):
        for j in range(cols):
            idx = (slice(rb[i], rb[i + 1]), slice(cb[j], cb[j + 1]))
            out.append((full[idx], idx))
    return out


def test_tiles_and_rows_cover():
    full = synthetic(7, 5, seed=7)
    assert assert_shards_cover(_tiles(full, 2, 3), full, "z")
    ids = torch.tensor([4, 0, 6, 2, 1, 5, 3])
    pieces = [(full[ids[:3]], ids[:3]), (full[ids[3:]], ids[3:])]
    assert assert_shards_cover(pieces, full, "atoms", disjoint=True)
    assert not assert_shards_cover([(full, (slice(None),))], full, "one rank")


def test_negative_piece_is_the_whole_tensor():
    full = synthetic(6, 6, seed=8)
    with pytest.raises(
        AssertionError, match=r"z is not sharded: rank 0 holds 36 elements, as many as the full"
    ):
        assert_shards_cover([(full, (slice(None),))] * 4, full, "z")


def test_negative_pieces_leave_a_tile_out():
    full = synthetic(6, 6, seed=9)
    tiles = _tiles(full, 2, 2)
    tiles[3] = tiles[2]  # rank 3 returns rank 2's tile: the corner tile is held by nobody
    with pytest.raises(
        AssertionError, match=r"do not cover the full tensor: 9 of 36 elements are held by no rank"
    ):
        assert_shards_cover(tiles, full, "z")


def test_negative_duplicated_and_empty_rows():
    full = synthetic(5, 3, seed=10)
    a, b = torch.tensor([0, 1, 2]), torch.tensor([2, 3, 4])
    with pytest.raises(
        AssertionError, match=r"3 elements are held by more than one rank \(first at \(2, 0\)\)"
    ):
        assert_shards_cover([(full[a], a), (full[b], b)], full, "atoms", disjoint=True)
    e = torch.tensor([], dtype=torch.int64)
    with pytest.raises(AssertionError, match=r"rank 1 holds no element of it"):
        assert_shards_cover([(full[a[:2]], a[:2]), (full[e], e), (full[b], b)], full, "atoms")


def test_negative_piece_values_differ_from_its_index():
    full = synthetic(6, 6, seed=11)
    tiles = _tiles(full, 2, 2)
    tiles[1] = (tiles[1][0].t().contiguous(), tiles[1][1])  # a transposed tile
    with pytest.raises(AssertionError, match=r"rank 1's piece differs from the full tensor at its index"):
        assert_shards_cover(tiles, full, "z")
    with pytest.raises(TypeError, match=r"not a \(local, index\) piece"):
        assert_shards_cover([t[0] for t in tiles], full, "z")


def _serial_side(n: int = 6):
    z = synthetic(n, n, seed=12)
    w = torch.nn.Linear(n, n, dtype=torch.float64)
    zl = z.clone().requires_grad_(True)
    out = w(zl)
    g = random_grad_output(out)
    out.backward(g)
    return z, w, out.detach(), zl.grad, {k: p.grad for k, p in w.named_parameters()}, g


def test_negative_every_rank_runs_the_serial_module():
    """The vacuous twin of the issue: 4 ranks each run the serial module and return no shards."""
    z, w, out, gz, gp, g = _serial_side()
    params = [(k, tuple(p.shape)) for k, p in w.named_parameters()]
    ranks = [TwinResult(out=out, grads_in={"z": gz}, param_grads=gp, params=params) for _ in range(4)]
    side = dict(serial_module=w, serial_out=out, serial_grads_in={"z": gz}, serial_param_grads=gp)
    with pytest.raises(
        AssertionError, match=r"no sharding evidence: on a grid of 4 ranks each rank must return"
    ):
        check_twin(what="vacuous", grid="2x2", ranks=ranks, grad_output=g, serial_inputs={"z": z}, **side)
    # the same ranks returning the full input as their "shard" fail too
    for r in ranks:
        r.shards = {"z": (z, (slice(None),))}
    with pytest.raises(AssertionError, match=r"vacuous: z is not sharded: rank 0 holds 36 elements"):
        check_twin(what="vacuous", grid="2x2", ranks=ranks, grad_output=g, serial_inputs={"z": z}, **side)
    # honest row blocks pass, and the evidence says the sharding was proven
    for r, (piece, idx) in zip(ranks, _tiles(z, 4, 1)):
        r.shards = {"z": (piece, idx)}
    evs = check_twin(what="rows", grid="4x1", ranks=ranks, grad_output=g, serial_inputs={"z": z}, **side)
    assert all("sharded" in e.checks for e in evs)
    ranks[0].shards = {"h": (z[:1], (slice(0, 1),))}
    with pytest.raises(AssertionError, match=r"rank 0 returns shards \['h'\], rank 1 \['z'\]|rank 1 returns"):
        check_twin(what="rows", grid="4x1", ranks=ranks, grad_output=g, serial_inputs={"z": z}, **side)


def test_identical_nan_is_replicated_and_fails_where_it_is_wrong():
    """A bug that reads uninitialized memory gathers the same NaN onto every rank (the CI
    failure of the chunk control): replication holds, and the output's pieces name the fault."""
    z, w, out, gz, gp, g = _serial_side()
    params = [(k, tuple(p.shape)) for k, p in w.named_parameters()]
    bad = out.clone()
    bad[4, 2] = float("nan")
    ranks = []
    for piece, idx in _tiles(bad, 2, 2):
        gz_nan = gz.clone()
        gz_nan[0, 0] = float("nan")
        ranks.append(
            TwinResult(
                out=bad.clone(),
                grads_in={"z": gz_nan},
                param_grads=gp,
                params=params,
                shards={"out": (piece, idx)},
            )
        )
    side = dict(serial_module=w, serial_out=out, serial_grads_in={"z": gz}, serial_param_grads=gp)
    with pytest.raises(AssertionError, match=r"nan: out: rank 2's piece differs from the full tensor"):
        check_twin(what="nan", grid="2x2", ranks=ranks, grad_output=g, **side)
    # a NaN on one rank only is a replication fault, and the message says where the NaN is
    ranks[1].out = out.clone()
    with pytest.raises(
        AssertionError,
        match=r"collected output is not replicated: rank 1 differs from rank 0 \(max diff 0 where "
        r"neither is NaN; NaN at 1 elements on one rank only\)",
    ):
        check_twin(what="nan", grid="2x2", ranks=ranks, grad_output=g, **side)
    # a rank whose value has another dtype is not a replica, even when the values agree
    ranks[1].out = bad.float()
    with pytest.raises(AssertionError, match=r"rank 0 has torch.float64 \(6, 6\), this rank torch.float32"):
        check_twin(what="nan", grid="2x2", ranks=ranks, grad_output=g, **side)


_PLUGIN_TEST = """
import torch
from twinshard.testing import assert_parity

def test_a():
    assert_parity(torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), what="ones")

def test_b():
    assert_parity(torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64), what="zeros")
"""


def _pytest(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if k != "TWINSHARD_EVIDENCE"}  # the outer run's choice
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_plugin_leaves_other_projects_alone(tmp_path):
    (tmp_path / "test_other.py").write_text("def test_plain():\n    assert 1 + 1 == 2\n")
    (tmp_path / "parity-evidence.log").write_text("someone else's file\n")
    res = _pytest(tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "parity-evidence.log").read_text() == "someone else's file\n"
    assert "twinshard parity evidence" not in res.stdout


def test_plugin_summary_is_one_line_per_module(tmp_path):
    (tmp_path / "test_uses.py").write_text(textwrap.dedent(_PLUGIN_TEST))
    (tmp_path / "parity-evidence.log").write_text("stale line from an earlier session\n")
    res = _pytest(tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    log = (tmp_path / "parity-evidence.log").read_text().splitlines()
    assert len(log) == 2 and "stale" not in log[0] and "test_uses.py::test_a | grid - | ones" in log[0]
    assert "test_uses.py: 2 checks | worst max_abs 0.00e+00" in res.stdout
    assert "| ones |" not in res.stdout and "every line:" in res.stdout
    verbose = _pytest(tmp_path, "-vv")  # -q -vv: verbose 1
    assert "test_uses.py::test_a | grid - | ones |" in verbose.stdout
