"""Data x context parallel training steps (``twinshard.pair.data_parallel``) and the sharded AdamW
(``twinshard.optim.ShardedAdamW``) against the serial step on the whole batch.

What each test proves:
- ``test_dp_cp_step_matches_serial`` ((dp, rows, cols) in 1x1x1, 2x1x1, 1x2x2, 2x2x1 with an
  uneven batch B = 3, 2x1x2 with an uneven N = 5 (padding), 3x1x1 with B = 3; two steps, random
  masks, Boltz-convention dropout p = 0.25 keyed by each element's index in the WHOLE batch): the
  loss of each step (the serial batch mean), every parameter gradient of the first step (after the
  dp reduction) and every weight after each AdamW update equal serial (fp64, round-off gate) and
  are identical on every rank of the world.
- ``test_sharded_adamw_matches_serial`` (2x1x2 B = 3 with the step's reduce-scatter and
  all-gather in rounds of 37 elements per rank, 1x2x2, 2x1x1, 1x1x1, all with the gradients
  sharded in backward, and 2x1x2 B = 3 with them sharded after it): the same with the AdamW state
  and gradients sharded over the world (reduce-scatter over dp, chunk step, all-gather); every
  rank holds only its 1/P chunk of the moments.
- ``test_zero2_backward_leaves_no_full_gradient`` (2x1x2 B = 3, 1x2x2): right after
  ``loss.backward()`` every ``p.grad`` is None and the ShardedAdamW's send buffer holds exactly
  this rank's ranges (chunks ``d * rows * cols + pos``) of the replica's full gradient, taken
  independently (the same backward on the after-backward path, flattened and cut); a second
  in-backward ShardedAdamW over the same parameters raises.
- ``test_zero2_gradient_accumulation`` (2x1x2 B = 3, 1x1x1): two backward passes (two dropout
  seeds) before one step equal one serial backward on the summed loss (gradients via
  ``keep_grads``, weights after the update).
- ``test_split_must_agree``: a rank asking for another dp (mesh), a rank passing another batch
  split, a rank holding a batch of another size than its replica, a batch smaller than dp: the
  same error on every rank (no hang, no silent result).
"""

from __future__ import annotations

import pytest
import torch

from twinshard.pair.reference import distogram_target
from twinshard.pair.train import CPTrunk, Trunk, train_step
from twinshard.testing import (
    assert_parity,
    assert_replicated,
    perturb_zero_parameters,
    random_mask,
    run_on_world,
    synthetic,
)

CS, CZ, BINS, LAYERS = 8, 6, 8, 2
KW = dict(num_heads=2, dropout=0.25, pairwise_head_width=4, pairwise_num_heads=2, convention="boltz")
FROZEN = "attention.proj_z.0.bias"  # analytically zero gradient (test_train_step's docstring)


def _build(cls, seed=17):
    torch.manual_seed(seed)
    m = cls(CS, CZ, LAYERS, num_bins=BINS, **KW).double()
    perturb_zero_parameters(m)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    for k, p in m.named_parameters():
        p.requires_grad_(not k.endswith(FROZEN))
    return m.train()


def _batch(b, n):
    s = synthetic(b, n, CS, seed=3)
    z = synthetic(b, n, n, CZ, seed=4)
    mask = random_mask(b, n, seed=8, keep=0.75)
    mask[:, 0] = 1
    pair_mask = mask[:, :, None] * mask[:, None, :] * random_mask(b, n, n, seed=9, keep=0.9)
    target = distogram_target(synthetic(b, n, 2, 3, seed=10, scale=6.0), num_bins=BINS, max_dist=12.0)
    return dict(s=s, z=z, target=target, mask=mask, pair_mask=pair_mask)


# AdamW divides by sqrt(v) + eps: an element whose gradient is ~eps has its gradient round-off
# amplified by up to lr / eps in the update (1e6 at eps = 1e-8: a 1e-18 gradient difference became
# 0.9 of the weights' round-off budget). eps = 1e-6 bounds the amplification at 1e4; the gradients
# themselves are compared separately, at round-off.
ADAMW = dict(lr=1e-2, weight_decay=0.05, eps=1e-6)


def _adamw(params):
    return torch.optim.AdamW(params, **ADAMW)


def _snapshot(model):
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return grads, {k: p.detach().clone() for k, p in model.named_parameters()}


def _serial(b, n, steps):
    model = _build(Trunk)
    opt = _adamw([p for p in model.parameters() if p.requires_grad])
    batch = _batch(b, n)
    out = []
    for step in range(steps):
        loss = train_step(model, opt, batch, seed=100 + step)
        out.append((loss, *_snapshot(model)))
    return out


def _rank_dp(shape, b, n, steps, sharded=False, in_backward=True, gather=None):
    from twinshard.optim import ShardedAdamW
    from twinshard.pair.data_parallel import distribute_batch, dp_train_step
    from twinshard.runtime.mesh import make_dp_mesh

    mesh = make_dp_mesh(*shape)
    model = CPTrunk(CS, CZ, LAYERS, num_bins=BINS, **KW).double()
    model.load_state_dict(_build(Trunk).state_dict())
    for k, p in model.named_parameters():
        p.requires_grad_(not k.endswith(FROZEN))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    if sharded:
        opt = ShardedAdamW(
            params,
            mesh,
            keep_grads=True,
            shard_grads_in_backward=in_backward,
            bucket_elements=gather,
            **ADAMW,
        )
    else:
        opt = _adamw(params)
    batch = distribute_batch(_batch(b, n), mesh)
    assert sum(batch.split) == b and batch["s"].shape[0] == batch.split[mesh.dp_index]
    out = []
    for step in range(steps):
        loss = dp_train_step(model, opt, batch, seed=100 + step, mesh=mesh, split=batch.split)
        out.append((loss, *_snapshot(model)))
    held = None
    if sharded:  # the moments a rank holds: its chunk only
        held = (
            sum(opt.state[q]["exp_avg"].numel() for q in opt.pieces),
            opt.numel,
            mesh.size,
            opt.bucket_elements,
        )
    return out, batch.split, held


def _compare(ranks, serial, what):
    for i, (s_loss, _, s_weights) in enumerate(serial):
        assert_replicated([r[i][0] for r in ranks], f"{what}: loss step {i}")
        assert_replicated([r[i][2] for r in ranks], f"{what}: weights step {i}")
        assert_parity(ranks[0][i][0], s_loss, what=f"{what} loss step {i}", grid=what)
        for k, w in s_weights.items():
            assert_parity(ranks[0][i][2][k], w, what=f"{what} weight {k} after step {i}", grid=what)
    s_grads = serial[0][1]
    assert_replicated([r[0][1] for r in ranks], f"{what}: grads step 0")
    assert set(ranks[0][0][1]) == set(s_grads), f"{what}: gradients of other parameters"
    for k, g in s_grads.items():
        assert bool(g.abs().max() > 0), f"serial gradient of {k} is zero: vacuous"
        assert_parity(ranks[0][0][1][k], g, what=f"{what} param grad {k} step 0", grid=what)


CASES = [  # (dp, rows, cols), B, N
    ((1, 1, 1), 2, 6),
    ((2, 1, 1), 2, 6),
    ((1, 2, 2), 2, 6),
    ((2, 2, 1), 3, 6),
    ((2, 1, 2), 2, 5),
    ((3, 1, 1), 3, 6),
]


def _id(case):
    (dp, r, c), b, n = case
    return f"dp{dp}x{r}x{c}-B{b}-N{n}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_dp_cp_step_matches_serial(case):
    shape, b, n = case
    out = run_on_world(_rank_dp, shape[0] * shape[1] * shape[2], shape, b, n, 2)
    _compare([o[0] for o in out], _serial(b, n, 2), _id(case))


SHARDED = [  # (case, gradients sharded in backward (ZeRO-2) or after it, gather_elements)
    (((2, 1, 2), 3, 5), True, 37),  # the step's collectives in rounds across parameter boundaries
    (((1, 2, 2), 2, 6), True, None),
    (((2, 1, 1), 2, 6), True, None),
    (((1, 1, 1), 2, 6), True, None),
    (((2, 1, 2), 3, 5), False, None),
]


def _sid(c, w, g):
    return f"{_id(c)}-{'during' if w else 'after'}" + (f"-gather{g}" if g else "")


@pytest.mark.parametrize("case,in_backward,gather", SHARDED, ids=[_sid(*c) for c in SHARDED])
def test_sharded_adamw_matches_serial(case, in_backward, gather):
    shape, b, n = case
    out = run_on_world(
        _rank_dp,
        shape[0] * shape[1] * shape[2],
        shape,
        b,
        n,
        2,
        sharded=True,
        in_backward=in_backward,
        gather=gather,
    )
    _compare([o[0] for o in out], _serial(b, n, 2), f"zero {_id(case)}")
    for _, _, (held, total, p, b) in out:
        # its buckets of b: ceil(L / (P b)) rounds, at most one bucket of padding above L / P
        assert held == -(-total // (p * b)) * b and held < total / p + b, (
            f"a rank holds {held} moments of {total} on {p} ranks in buckets of {b}"
        )
        if p > 1:
            assert held < total


# -- disagreement --------------------------------------------------------------------------------


def _rank_disagree(how, n=5):
    import torch.distributed as dist

    from twinshard.pair.data_parallel import distribute_batch, dp_train_step
    from twinshard.runtime.mesh import make_dp_mesh

    last = dist.get_rank() == dist.get_world_size() - 1
    try:
        shape = (4, 1, 1) if how == "dp" and last else (2, 1, 2)
        mesh = make_dp_mesh(*shape)
        b = 1 if how == "tiny" else 3
        model = CPTrunk(CS, CZ, LAYERS, num_bins=BINS, **KW).double()
        model.load_state_dict(_build(Trunk).state_dict())
        opt = _adamw(model.parameters())
        batch = distribute_batch(_batch(b, n), mesh)
        split = batch.split
        if how == "split" and last:
            split = split[::-1]
        if how == "size" and last:  # this rank took one element fewer than its replica peers
            batch = distribute_batch(_batch(b + 1, n), mesh)
            split = None
        dp_train_step(model, opt, batch, seed=100, mesh=mesh, split=None if how == "size" else split)
        return "no error: the step ran"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


DISAGREE = {
    "dp": r"make_dp_mesh: control-flow scalars differ across ranks \('dp_rows_cols': \(2, 1, 2\) on ranks "
    r"\[0, 1, 2\], \(4, 1, 1\) on ranks \[3\]\)",
    "split": r"the batches held \(2, 1\) are not the split \(1, 2\) passed",
    "size": r"the ranks of a replica hold batches of different sizes \(\{1: \[1, 2\]\}\)",
    "tiny": r"a batch of 1 structures cannot be split over dp = 2 replicas",
}


@pytest.mark.parametrize("how", sorted(DISAGREE))
def test_split_must_agree(how):
    msgs = run_on_world(_rank_disagree, 4, how, timeout=60)
    assert len({m.split(": ", 1)[0] for m in msgs}) == 1 and all("no error" not in m for m in msgs), msgs
    for m in msgs:
        assert __import__("re").search(DISAGREE[how], m), f"{how}: {m}"


# -- gradients sharded during backward (ZeRO-2) --------------------------------------------------


def _rank_cp_model(mesh):
    model = CPTrunk(CS, CZ, LAYERS, num_bins=BINS, **KW).double()
    model.load_state_dict(_build(Trunk).state_dict())
    for k, p in model.named_parameters():
        p.requires_grad_(not k.endswith(FROZEN))
    return model.train()


def _rank_backward_sharded(shape, b, n):
    import torch.distributed as dist

    from twinshard.optim import ShardedAdamW
    from twinshard.pair.data_parallel import distribute_batch
    from twinshard.pair.reference.dropout import batch_offset
    from twinshard.runtime.mesh import make_dp_mesh

    mesh = make_dp_mesh(*shape)
    model = _rank_cp_model(mesh)
    params = [p for p in model.parameters() if p.requires_grad]
    batch = distribute_batch(_batch(b, n), mesh)

    def backward():
        with mesh.replica(), batch_offset(batch.offset):
            loss, _ = model(**batch, seed=100)
            loss.backward()

    opt = ShardedAdamW(params, mesh, bucket_elements=37, **ADAMW)  # several rounds: the dealt buckets
    try:
        ShardedAdamW(params, mesh, **ADAMW)
        second = "no error"
    except ValueError as e:
        second = str(e)
    opt.zero_grad()
    backward()
    left = [k for k, p in model.named_parameters() if p.requires_grad and p.grad is not None]
    buffer = opt.send_buffer()
    # the same backward on the after-backward path: the replica's full gradient, cut independently
    opt.remove_hooks()
    opt.zero_grad()
    backward()
    # buckets of b dealt round-robin over the world: bucket t is rank t % P's
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    b, world = opt.bucket_elements, mesh.size
    rounds = -(-flat.numel() // (b * world))
    flat = torch.cat([flat, flat.new_zeros(rounds * b * world - flat.numel())])
    per = shape[1] * shape[2]
    pos = dist.get_rank() % per
    mine = [[flat[(r * world + d * per + pos) * b :][:b] for r in range(rounds)] for d in range(shape[0])]
    expected = torch.cat([x for slot in mine for x in slot])
    return left, buffer, expected, second, (opt.chunk, rounds * b), rounds


@pytest.mark.parametrize("case", [((2, 1, 2), 3, 5), ((1, 2, 2), 2, 6)], ids=_id)
def test_zero2_backward_leaves_no_full_gradient(case):
    shape, b, n = case
    out = run_on_world(_rank_backward_sharded, shape[0] * shape[1] * shape[2], shape, b, n)
    for rank, (left, buffer, expected, second, (chunk, m), rounds) in enumerate(out):
        assert rounds > 1, "vacuous: one round does not exercise the round-robin buckets"
        assert not left, f"rank {rank}: p.grad still held after backward for {left}"
        assert chunk == m and buffer.shape == (shape[0] * chunk,), (
            f"rank {rank}: buffer {tuple(buffer.shape)}"
        )
        assert bool(expected.abs().max() > 0), "vacuous: the rank's gradient ranges are zero"
        assert_parity(
            buffer,
            expected,
            what=f"rank {rank} send buffer vs its ranges of the full gradient",
            grid=_id(case),
        )
        assert "already sharded in backward by another live ShardedAdamW" in second, second


def _rank_accumulate(shape, b, n):
    from twinshard.optim import ShardedAdamW
    from twinshard.pair.data_parallel import distribute_batch, replica_weight
    from twinshard.pair.reference.dropout import batch_offset
    from twinshard.runtime.mesh import make_dp_mesh

    mesh = make_dp_mesh(*shape)
    model = _rank_cp_model(mesh)
    opt = ShardedAdamW([p for p in model.parameters() if p.requires_grad], mesh, keep_grads=True, **ADAMW)
    batch = distribute_batch(_batch(b, n), mesh)
    opt.zero_grad()
    for seed in (100, 101):  # two backward passes accumulate before one step
        with mesh.replica(), batch_offset(batch.offset):
            loss, _ = model(**batch, seed=seed)
            loss.backward()
    opt.reduce_and_step(replica_weight(batch.split, mesh))
    return _snapshot(model)


def _serial_accumulate(b, n):
    model = _build(Trunk)
    opt = _adamw([p for p in model.parameters() if p.requires_grad])
    batch = _batch(b, n)
    opt.zero_grad()
    loss = model(**batch, seed=100)[0] + model(**batch, seed=101)[0]
    loss.backward()
    opt.step()
    return _snapshot(model)


@pytest.mark.parametrize("case", [((2, 1, 2), 3, 5), ((1, 1, 1), 2, 6)], ids=_id)
def test_zero2_gradient_accumulation(case):
    shape, b, n = case
    out = run_on_world(_rank_accumulate, shape[0] * shape[1] * shape[2], shape, b, n)
    grads, weights = _serial_accumulate(b, n)
    what = f"zero2 accumulation {_id(case)}"
    assert_replicated([o[0] for o in out], f"{what}: grads")
    assert_replicated([o[1] for o in out], f"{what}: weights")
    assert set(out[0][0]) == set(grads), f"{what}: gradients of other parameters"
    for k, g in grads.items():
        assert_parity(out[0][0][k], g, what=f"{what} param grad {k}", grid=what)
    for k, w in weights.items():
        assert_parity(out[0][1][k], w, what=f"{what} weight {k}", grid=what)
