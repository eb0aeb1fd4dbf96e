"""A training step of the CP trunk (2-layer Pairformer stack + distogram loss + AdamW) against serial,
checkpoints, and a CP twin dropped into a serial training loop through plain tensors.

What each test proves:
- ``test_train_step_matches_serial`` (2x2 and 3x3, uneven N, random masks, Boltz-convention
  dropout p = 0.25, two steps): the loss of each step, every parameter gradient of the first step
  and every weight after each update equal serial (fp64, round-off gate), and are identical on
  every rank.
- ``test_checkpoint_resume``: a CP run stopped after 2 steps, saved (plain tensors, serial names),
  loaded into a freshly initialised CP model and optimizer and run 1 more step equals the
  uninterrupted 3-step run; the file loads with ``torch.load(weights_only=True)`` into the SERIAL
  trunk and optimizer, whose next step equals the CP one.
- ``test_plain_boundary_serial_loop``: a serial script (serial trunk, its stack swapped for
  ``plain(CPPairformerStack)``, plain tensors, AdamW) equals the all-serial run: losses, full
  input gradients of ``s`` and ``z`` on every rank, weights after 2 steps.
- ``test_trunk_control_scalars_must_agree`` (one case per agreed scalar: the step's seed, optimizer
  step counts and hyperparameters; the trunk's ``single_weight`` and target shape; the checkpoint's
  step and parameter checksum): the scalar differing on the last rank raises the same error on
  every rank, naming that scalar alone, before any collective of the step.
- ``test_negative_control_unsynced_head``: planted, the distogram Function's parameter-gradient
  all-reduce skipped: the ranks' weights after the update are no longer replicated (caught by
  ``assert_replicated`` before any parity check), message named.

The pair-bias LayerNorm bias of attention with pair bias has an analytically zero gradient
(round-off noise); AdamW's first step turns any noise into +-lr, so it is frozen in both runs.
"""

from __future__ import annotations

import re

import pytest
import torch

from twinshard.pair.features import PairLayout, shard_tensor
from twinshard.pair.layers import distogram as cp_dist
from twinshard.pair.layers.boundary import plain
from twinshard.pair.layers.pairformer import CPPairformerStack
from twinshard.pair.reference import distogram_target
from twinshard.pair.train import CPTrunk, Trunk, load_checkpoint, save_checkpoint, train_step
from twinshard.testing import (
    assert_parity,
    assert_replicated,
    grid_id,
    perturb_zero_parameters,
    random_mask,
    run_on_grid,
    synthetic,
)

CS, CZ, BINS, LAYERS = 8, 6, 8, 2
KW = dict(num_heads=2, dropout=0.25, pairwise_head_width=4, pairwise_num_heads=2, convention="boltz")
FROZEN = "attention.proj_z.0.bias"
B = 1


def _build(cls, seed=17):
    torch.manual_seed(seed)
    m = cls(CS, CZ, LAYERS, num_bins=BINS, **KW).double()
    perturb_zero_parameters(m)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    for k, p in m.named_parameters():
        if k.endswith(FROZEN):
            p.requires_grad_(False)
    return m.train()


def _optimizer(m):
    return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.05)


def _batch(n):
    s = synthetic(B, n, CS, seed=3)
    z = synthetic(B, n, n, CZ, seed=4)
    mask = random_mask(B, n, seed=8, keep=0.75)
    mask[:, 0] = 1
    pair_mask = mask[:, :, None] * mask[:, None, :] * random_mask(B, n, n, seed=9, keep=0.9)
    target = distogram_target(synthetic(B, n, 2, 3, seed=10, scale=6.0), num_bins=BINS, max_dist=12.0)
    return dict(s=s, z=z, target=target, mask=mask, pair_mask=pair_mask)


def _sharded(batch, grid, n):
    layout = PairLayout.for_sizes(n, grid)
    kinds = dict(s="single", z="pair", target="pair", mask="single", pair_mask="pair")
    return {k: shard_tensor(v, kinds[k], grid, layout) for k, v in batch.items()}


def _grads(m):
    return {k: p.grad.clone() for k, p in m.named_parameters() if p.requires_grad}


def _weights(m):
    return {k: p.detach().clone() for k, p in m.named_parameters()}


def _run(model, opt, batch, steps, first=0):
    losses, grads, weights = [], [], []
    for step in range(first, first + steps):
        losses.append(train_step(model, opt, batch, seed=100 + step))
        grads.append(_grads(model))
        weights.append(_weights(model))
    return losses, grads, weights


def _rank_train(grid, n, steps, plant=None):
    model = CPTrunk(CS, CZ, LAYERS, num_bins=BINS, **KW).double()
    model.load_state_dict(_build(Trunk).state_dict())
    for k, p in model.named_parameters():
        p.requires_grad_(not k.endswith(FROZEN))
    model.train()
    if plant == "unsynced_head":
        cp_dist.P.all_reduce, saved = (
            _all_reduce_unless_param_grads(cp_dist.P.all_reduce),
            cp_dist.P.all_reduce,
        )
    try:
        return _run(model, _optimizer(model), _sharded(_batch(n), grid, n), steps)
    finally:
        if plant == "unsynced_head":
            cp_dist.P.all_reduce = saved


def _all_reduce_unless_param_grads(real):
    def all_reduce(x, group=None, op="all_reduce", **kw):
        return x.clone() if op == "distogram:param_grads" else real(x, group, op=op, **kw)

    return all_reduce


def _serial_run(n, steps):
    model = _build(Trunk)
    return _run(model, _optimizer(model), _batch(n), steps)


def _compare(ranks, serial, what, grid):
    s_losses, s_grads, s_weights = serial
    for i in range(len(s_losses)):
        assert_replicated([r[0][i] for r in ranks], f"{what}: loss step {i}")
        assert_replicated([r[2][i] for r in ranks], f"{what}: weights step {i}")
        assert_parity(ranks[0][0][i], s_losses[i], what=f"{what} loss step {i}", grid=grid)
        for k, w in s_weights[i].items():
            assert_parity(ranks[0][2][i][k], w, what=f"{what} weight {k} after step {i}", grid=grid)
    assert_replicated([r[1][0] for r in ranks], f"{what}: grads step 0")
    assert set(ranks[0][1][0]) == set(s_grads[0])
    for k, g in s_grads[0].items():
        assert bool(g.abs().max() > 0), f"serial gradient of {k} is zero: vacuous"
        assert_parity(ranks[0][1][0][k], g, what=f"{what} param grad {k} step 0", grid=grid)


@pytest.mark.parametrize(
    "grid,n", [((2, 2), 7), ((3, 3), 7), ((2, 3), 7)], ids=["2x2-N7", "3x3-N7", "2x3-N7"]
)  # 2x3: z padded to 8 x 9 (the distogram's z + z^T across unequal token axes)
def test_train_step_matches_serial(grid, n):
    ranks = run_on_grid(_rank_train, grid, n, 2)
    _compare(ranks, _serial_run(n, 2), f"train-step N={n}", grid_id(grid))


def test_negative_control_unsynced_head():
    grid, n = (2, 2), 6
    ranks = run_on_grid(_rank_train, grid, n, 1, plant="unsynced_head")
    with pytest.raises(
        AssertionError,
        match=r"train-step N=6: weights step 0\[distogram_module\.distogram\.weight\] is not replicated",
    ):
        _compare(ranks, _serial_run(n, 1), f"train-step N={n}", grid_id(grid))


# -- checkpoints -----------------------------------------------------------------------------------


def _rank_resume(grid, n, path):
    batch = _sharded(_batch(n), grid, n)
    model = CPTrunk(CS, CZ, LAYERS, num_bins=BINS, **KW).double()
    model.load_state_dict(_build(Trunk).state_dict())
    for k, p in model.named_parameters():
        p.requires_grad_(not k.endswith(FROZEN))
    opt = _optimizer(model)
    _run(model, opt, batch, 2)
    save_checkpoint(path, model, opt, step=2)
    whole = _run(model, opt, batch, 1, first=2)
    fresh = CPTrunk(CS, CZ, LAYERS, num_bins=BINS, **KW).double()  # other weights, no state
    for k, p in fresh.named_parameters():
        p.requires_grad_(not k.endswith(FROZEN))
    opt2 = _optimizer(fresh)
    step = load_checkpoint(path, fresh, opt2)
    resumed = _run(fresh, opt2, batch, 1, first=step)
    return whole, resumed, step


def test_checkpoint_resume(tmp_path):
    grid, n = (2, 2), 7
    path = str(tmp_path / "trunk.pt")
    ranks = run_on_grid(_rank_resume, grid, n, path)
    assert all(r[2] == 2 for r in ranks)
    for r, (whole, resumed, _) in enumerate(ranks):
        assert_parity(resumed[0][0], whole[0][0], what=f"resumed loss rank {r}", grid=grid_id(grid))
        for k, w in whole[2][0].items():
            assert_parity(resumed[2][0][k], w, what=f"resumed weight {k} rank {r}", grid=grid_id(grid))
    # the serial trunk reads the same file and takes the same step
    state = torch.load(path, weights_only=True)
    assert not any(type(v) is not torch.Tensor for v in state["model"].values())
    serial = _build(Trunk, seed=3)
    opt = _optimizer(serial)
    serial.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    losses, _, weights = _run(serial, opt, _batch(n), 1, first=state["step"])
    whole = ranks[0][0]
    assert_parity(whole[0][0], losses[0], what="serial from checkpoint: loss", grid=grid_id(grid))
    for k, w in weights[0].items():
        assert_parity(whole[2][0][k], w, what=f"serial from checkpoint: weight {k}", grid=grid_id(grid))


# -- plain tensors at the boundary: a serial training loop -------------------------------------------


def _loop_with_inputs(model, n, steps):
    opt = _optimizer(model)
    batch = _batch(n)
    batch["s"].requires_grad_(True)
    batch["z"].requires_grad_(True)
    losses, grads_in, weights = [], [], []
    for step in range(steps):
        batch["s"].grad = batch["z"].grad = None
        losses.append(train_step(model, opt, batch, seed=100 + step))
        grads_in.append({"s": batch["s"].grad.clone(), "z": batch["z"].grad.clone()})
        weights.append(_weights(model))
    return losses, grads_in, weights


def _rank_plain(grid, n, steps):
    model = _build(Trunk)  # the serial script's model ...
    stack = CPPairformerStack(CS, CZ, LAYERS, **KW).double()
    stack.load_state_dict(model.pairformer_module.state_dict())
    for k, p in stack.named_parameters():
        p.requires_grad_(not k.endswith(FROZEN))
    model.pairformer_module = plain(stack.train(), grid)  # ... with the CP twin dropped in
    return _loop_with_inputs(model, n, steps)


def test_plain_boundary_serial_loop():
    grid, n, steps = (2, 2), 7, 2
    ranks = run_on_grid(_rank_plain, grid, n, steps)
    serial = _loop_with_inputs(_build(Trunk), n, steps)
    what = f"plain-boundary N={n}"
    for i in range(steps):
        assert_replicated([r[0][i] for r in ranks], f"{what}: loss step {i}")
        assert_replicated([r[1][i] for r in ranks], f"{what}: input grads step {i}")
        assert_replicated([r[2][i] for r in ranks], f"{what}: weights step {i}")
        assert_parity(ranks[0][0][i], serial[0][i], what=f"{what} loss step {i}", grid=grid_id(grid))
        for k in ("s", "z"):
            assert_parity(
                ranks[0][1][i][k], serial[1][i][k], what=f"{what} d/d{k} step {i}", grid=grid_id(grid)
            )
        for k, w in serial[2][i].items():
            assert_parity(ranks[0][2][i][k], w, what=f"{what} weight {k} step {i}", grid=grid_id(grid))


# -- control-flow scalars of the trunk, the step and the checkpoint: agreed before use ------------

# each case changes exactly one agreed scalar on the LAST rank of a 2x2 grid (N = 5):
# (where, the error's one part: a regex it must match whole)
E = re.escape
TRUNK_SCALARS = {
    "seed": ("train_step", E("'seed': 100 on ranks [0, 1, 2], 101 on ranks [3]")),
    # a rank whose optimizer already stepped
    "optimizer_steps": ("train_step", E("'optimizer_steps': () on ranks [0, 1, 2], (1,) on ranks [3]")),
    # a learning rate changed on one rank, shown at its entry of the first group
    "param_groups": (
        "train_step",
        r"'param_groups' at \[0\]\[\d+\]: " + E("('lr', 0.01) on ranks [0, 1, 2], ('lr', 0.02) on ranks [3]"),
    ),
    # 0 skips the single-track term and its all-reduce (this hung the step)
    "single_weight": ("CPTrunk", E("'single_weight': 0.1 on ranks [0, 1, 2], 0.0 on ranks [3]")),
    # one conformer, not two (this changed the loss silently)
    "target_shape": (
        "CPTrunk",
        E(f"'target_shape': (1, 6, 6, 2, {BINS}) on ranks [0, 1, 2], (1, 6, 6, 1, {BINS}) on ranks [3]"),
    ),
    "step": ("load_checkpoint", E("'step': 2 on ranks [0, 1, 2], 3 on ranks [3]")),
    # one rank's weights differ after loading: shown at the first parameter whose sum differs
    "checksum": ("load_checkpoint", r"'checksum' at \[\d+\]: \S+ on ranks \[0, 1, 2\], \S+ on ranks \[3\]"),
}


def _rank_trunk_disagree(grid, scalar, path):
    import twinshard.pair.train as train_mod

    odd = grid.rank == grid.size - 1

    def pick(name, normal, other):
        return other if odd and scalar == name else normal

    n = 5
    model = CPTrunk(CS, CZ, LAYERS, num_bins=BINS, single_weight=pick("single_weight", 0.1, 0.0), **KW)
    model = model.double()
    model.load_state_dict(_build(Trunk).state_dict())
    model.train()
    opt = _optimizer(model)
    batch = _batch(n)
    batch["target"] = pick("target_shape", batch["target"], batch["target"][:, :, :, :1])
    batch = _sharded(batch, grid, n)
    if pick("optimizer_steps", False, True):
        opt.state[next(iter(model.parameters()))]["step"] = torch.tensor(1.0)
    opt.param_groups[0]["lr"] = pick("param_groups", 1e-2, 2e-2)
    real = train_mod.dist.broadcast_object_list
    try:
        if TRUNK_SCALARS[scalar][0] != "load_checkpoint":
            train_step(model, opt, batch, seed=pick("seed", 100, 101))
            return "no error: the step ran"
        save_checkpoint(path, model, opt, step=2)
        if pick("step", False, True):  # the broadcast state arrives with another step count

            def broadcast_object_list(box, src=0, **kw):
                real(box, src=src, **kw)
                box[0]["step"] += 1

            train_mod.dist.broadcast_object_list = broadcast_object_list
        if pick("checksum", False, True):  # e.g. a rank whose load hook edits a weight

            def bump(module, keys):
                with torch.no_grad():
                    module.distogram_module.distogram.bias[0] += 1e-3

            model.register_load_state_dict_post_hook(bump)
        load_checkpoint(path, model, opt)
        return "no error: the checkpoint loaded"
    except ValueError as e:
        return str(e)
    finally:
        train_mod.dist.broadcast_object_list = real


@pytest.mark.parametrize("scalar", sorted(TRUNK_SCALARS))
def test_trunk_control_scalars_must_agree(scalar, tmp_path):
    """One agreed scalar differs on the last rank: every rank raises the same error naming it, before
    any collective of the step (never a hang, never a silent result; without agreement a differing
    single_weight hung the step, a differing target silently changed the loss)."""
    where, part = TRUNK_SCALARS[scalar]
    msgs = run_on_grid(_rank_trunk_disagree, (2, 2), scalar, str(tmp_path / "trunk.pt"), timeout=30)
    assert len(set(msgs)) == 1, f"{scalar}: the ranks raised different errors (or none): {msgs}"
    head, tail = (
        f"{where}: control-flow scalars differ across ranks (",
        "); every rank must pass the same values",
    )
    assert re.fullmatch(E(head) + part + E(tail), msgs[0]), f"{msgs[0]}\nexpected the part {part!r}"
