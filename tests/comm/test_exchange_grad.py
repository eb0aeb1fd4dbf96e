"""comm.exchange never drops a gradient: ranks that only send or only receive run the adjoint too,
and the autograd path is one replicated decision (a mismatch raises on every rank, no hang)."""

import pytest
import torch
import torch.distributed as dist

from twinshard import comm
from twinshard.testing import assert_parity, run_on_world


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# rank 0 only sends (3 rows to 1, 2 rows to 2), rank 1 sends 4 rows to 2 and receives from 0,
# rank 2 only receives; rank 3 (on 4 ranks) takes part in nothing
SENDS = {0: {1: 3, 2: 2}, 1: {2: 4}}


def _plan(r):
    sends = SENDS.get(r, {})
    recvs = {s: k[r] for s, k in sorted(SENDS.items()) if r in k}
    return sends, recvs


def _rank_send_recv_only():
    r = dist.get_rank()
    sends, recvs = _plan(r)
    x = _rand(sum(sends.values()), 3, seed=10 + r).requires_grad_(bool(sends))
    parts, i = [], 0
    for p, k in sorted(sends.items()):
        parts.append((p, x[i : i + k]))
        i += k
    got = comm.exchange(parts, [(s, (k, 3)) for s, k in recvs.items()])
    y = torch.cat(got) if got else x.new_zeros(0, 3)
    dy = _rand(*y.shape, seed=20 + r)
    out = {"y_requires_grad": y.requires_grad, "n_out": len(got), "y_rows": y.shape[0]}
    if y.requires_grad:
        y.backward(dy)  # the send-only rank's output has no rows, yet its backward must run
    gx = x.grad if x.grad is not None else torch.zeros_like(x)
    sums = torch.tensor([float((dy * y).sum()), float((gx * x).sum())], dtype=torch.float64)
    dist.all_reduce(sums)
    out.update(sums=sums, grad_rows=int(gx.abs().sum(1).gt(0).sum()))
    return out


@pytest.mark.parametrize("nranks", [3, 4])
def test_send_only_and_receive_only_ranks_run_the_adjoint(nranks):
    res = run_on_world(_rank_send_recv_only, nranks, timeout=60)
    # rank 2 only receives: its output must still be differentiable (else its gradient is lost)
    assert res[2]["y_requires_grad"] and res[2]["y_rows"] == 6
    # rank 0 only sends: one empty output carries the node, and its backward delivered gradients
    assert res[0]["n_out"] == 1 and res[0]["y_rows"] == 0 and res[0]["y_requires_grad"]
    assert res[0]["grad_rows"] == 5 and res[1]["grad_rows"] == 4
    if nranks == 4:
        assert res[3]["n_out"] == 0
    lhs, rhs = res[0]["sums"].unbind()
    assert_parity(
        rhs, lhs, what=f"<dy, E x> = <E* dy, x>, send-only and receive-only ranks, P={nranks}", reduction=30
    )


def _rank_mismatch():
    r = dist.get_rank()
    peer = (r + 1) % dist.get_world_size()
    src = (r - 1) % dist.get_world_size()
    x = _rand(2, 3, seed=r).requires_grad_(r != 1)  # rank 1 sends a detached tensor
    try:
        comm.exchange([(peer, x)], [(src, (2, 3))])
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_requires_grad_on_some_ranks_only_fails_on_every_rank():
    for r, msg in enumerate(run_on_world(_rank_mismatch, 3, timeout=30)):
        assert "requires grad on ranks [0, 2] but not on ranks [1]" in msg, f"rank {r}: {msg}"


def _rank_recv_dtype():
    r = dist.get_rank()
    if r == 0:
        got = comm.exchange([(1, torch.arange(6, dtype=torch.float32).reshape(2, 3))], [])
    else:
        got = comm.exchange([], [(0, (2, 3))])  # the receiver learns the dtype from the sender
    return [g.dtype for g in got], [g.sum().item() for g in got]


def test_receive_only_rank_gets_the_senders_dtype():
    res = run_on_world(_rank_recv_dtype, 2)
    assert res[1] == ([torch.float32], [15.0])
    assert res[0][0] == [torch.float32]  # the send-only rank's empty output


# -- the wire dtype: one agreed dtype on every rank (DESIGN rule 4) -----------------------------

# rank 1's send buffers differ from the others' float64; 'mixed': rank 1 sends two buffers of two
# dtypes (float32 first: taken as the wire, the float64 one would be cut to float32 silently);
# 'uncarried': a dtype outside the exchange's vote table (the vote used to fail on rank 1 alone)
DTYPE_CASES = {
    "float32": "exchange: ranks send different dtypes (torch.float64 on ranks [0, 2]; torch.float32 on "
    "ranks [1]); the wire dtype must be one dtype on every rank: cast the send buffers to one dtype, or "
    "pass the same dtype= on every rank",
    "mixed": "exchange: the send buffers of ranks [1] have several dtypes; cast them to one dtype, or pass "
    "dtype= (the wire dtype) on every rank",
    "uncarried": "exchange: ranks [1] send a dtype the exchange does not carry; cast the send buffers to "
    "one of",
}


def _rank_dtypes(case, grad):
    """Ring of 3 plus, on rank 1, a second message to rank 0 in the 'mixed' case."""
    r, n = dist.get_rank(), dist.get_world_size()
    peer, src = (r + 1) % n, (r - 1) % n
    x = _rand(2, 3, seed=r)
    sends, recvs = [], [(src, (2, 3))]
    if r == 1:
        dt = {"float32": torch.float32, "mixed": torch.float32, "uncarried": torch.uint16}[case]
        sends.append((peer, x.to(dt)))
        if case == "mixed":
            sends.append((0, x.clone()))  # float64
    else:
        sends.append((peer, x))
    if r == 0 and case == "mixed":
        recvs.append((1, (2, 3)))
    for _, t in sends:
        t.requires_grad_(grad and t.is_floating_point())
    try:
        got = comm.exchange(sends, recvs)
    except ValueError as exc:
        return str(exc)
    return f"no error: received {[(g.dtype, tuple(g.shape)) for g in got]}"


@pytest.mark.parametrize("grad", [False, True], ids=["plain", "autograd"])
@pytest.mark.parametrize("case", sorted(DTYPE_CASES))
def test_senders_of_different_dtypes_fail_on_every_rank(case, grad):
    """Every rank raises the same ValueError, which names the ranks and dtypes and says how to fix
    it, before anything is sent: never a hang, a transport error on some ranks, or a silent cast."""
    msgs = run_on_world(_rank_dtypes, 3, case, grad and case != "uncarried", timeout=30)
    assert len(set(msgs)) == 1, f"ranks raised different errors: {msgs}"
    assert msgs[0].startswith(DTYPE_CASES[case]), msgs[0]


def _rank_wire_dtype():
    """The documented way to mix: pass the wire dtype on every rank; the casts are exact here
    (float32 values widened to float64) and each sender's gradient comes back in its own dtype."""
    r, n = dist.get_rank(), dist.get_world_size()
    x = _rand(2, 3, seed=r).to(torch.float32 if r == 1 else torch.float64).requires_grad_(True)
    (y,) = comm.exchange([((r + 1) % n, x)], [((r - 1) % n, (2, 3))], dtype=torch.float64)
    dy = _rand(2, 3, seed=20 + r)
    y.backward(dy)
    return x.detach().double(), y.detach(), dy, x.grad


def test_explicit_wire_dtype_mixes_exactly():
    res = run_on_world(_rank_wire_dtype, 3)
    for r, (_, y, _, gx) in enumerate(res):
        src, dst = res[(r - 1) % 3], res[(r + 1) % 3]
        assert y.dtype == torch.float64 and torch.equal(y, src[0]), f"rank {r}: received {y}"
        assert gx.dtype == (torch.float32 if r == 1 else torch.float64), f"rank {r}: grad dtype {gx.dtype}"
        assert torch.equal(gx, dst[2].to(gx.dtype)), f"rank {r}: gradient is not the receiver's dy"
