"""The whole-model Boltz-2 training step (``twinshard.pair.train_boltz2``), CP against serial, and
its checkpoints (main env; the step against boltz's own ``Boltz2.training_step`` is
tests/interop/test_boltz2_training.py).

- ``test_cp_step_matches_serial`` (2x2 N 11 m 3; 2x3 N 10 m 1; 1x1 and 3x3 run against boltz
  itself in tests/interop; counter-based draws keyed by global atom index): two steps on 2x2, one on 2x3; the loss of each step, the structure module's training outputs
  (``denoised_atom_coords``, ``aligned_true_atom_coords``, ``sigmas``), every parameter gradient
  of the first step by name, every weight after each AdamW update and the EMA weights equal serial
  (fp64, round-off gate), identical on every rank. The losses: the distogram loss, the confidence
  losses (``layers.confidence_loss`` vs ``reference.confidence_loss``, 2 samples, PAE on) and the
  diffusion loss (``CPAtomDiffusion.compute_loss`` vs ``AtomDiffusion.compute_loss``: the weighted
  rigid alignment and the smooth lDDT), so the structure module, the conditioning and the trunk's
  last cycle get gradients through the training forward.
- ``test_resume_equals_uninterrupted``: 2 steps straight vs 1 step + save + load into a freshly
  initialised model + 1 step: weights, optimizer state, EMA state and step counters bit-identical
  (serial, random recycling drawn from ``np.random.default_rng(global_step)``); and across grids:
  saved by a 2x2 run, resumed on 1x2, equal to the serial uninterrupted run.
- ``test_sigmas_synchronized``, ``test_structure_gradient_reaches_trunk``,
  ``test_ema_follows_the_optimizer_step``: properties of Boltz's semantics (one noise level per
  element over its m samples; the structure loss reaches the trunk's last recycling cycle; the EMA
  averages the weights after the update, warm-start decay ``2/11`` at step 1).

The analytically zero gradients (LayerNorm biases in front of a softmax) are frozen on both sides:
Adam's first step turns their round-off noise into +-lr.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_inputs import model_config, model_features

from twinshard.pair.features import collect_tensor, distribute
from twinshard.pair.layers.model import CPBoltz2Model
from twinshard.pair.reference.model import Boltz2Model
from twinshard.pair.synthetic import synthetic_training_features
from twinshard.pair.train_boltz2 import (
    Boltz2Training,
    LossHooks,
    TrainingArgs,
    distogram_term,
    recycling_steps_at,
    structure_compute_loss,
)
from twinshard.testing import assert_parity, assert_replicated, grid_id, randomize_parameters, run_on_grid

F64 = torch.float64
TIMEOUT = 600.0  # the whole model, two steps, on shared cores
FROZEN = (
    ".attention.proj_z.0.bias",
    ".pair_weighted_averaging.norm_z.bias",
    "atom_enc_proj_z.0.bias",
    "_proj_z.0.0.bias",  # the conditioning's atom encoder/decoder and token transformer biases
    # the diffusion loss is translation invariant (the alignment matches the weighted centroids,
    # the lDDT reads distances): the bias before the position projection gets an exact zero
    "atom_feat_to_atom_pos_update.0.bias",
)


def _model(cls, seed: int = 3, config=None):
    torch.manual_seed(0)
    model = cls(model_config() if config is None else config).to(F64)
    randomize_parameters(model, seed=seed)
    for n, p in model.named_parameters():
        if n.endswith(FROZEN):
            p.requires_grad_(False)
    return model


def _feats(n: int, seed: int, batch: int = 1) -> dict:
    """The synthetic complex (``batch`` elements) with Boltz's training features
    (``synthetic_training_features``; the frames' conformer axis K = 1 squeezed, as
    Boltz2.training_step does)."""
    f = model_features(n, batch, seed=n)
    f.update(synthetic_training_features(f, seed=seed))
    f["frames_idx"], f["frame_resolved_mask"] = f["frames_idx"][:, 0], f["frame_resolved_mask"][:, 0]
    f["coords"] = f["coords"].to(F64)
    return f


HOOKS = LossHooks(distogram=distogram_term, diffusion=structure_compute_loss)


def _args(c: dict) -> TrainingArgs:
    return TrainingArgs(
        recycling_steps=c.get("recycling", 1),
        sampling_steps=2,
        diffusion_multiplicity=c["m"],
        diffusion_samples=2,
        diffusion_loss_weight=0.5,
        distogram_loss_weight=0.3,
        confidence_loss_weight=0.2,
        alpha_pae=1.0,
        weight_decay=0.01,
        weight_decay_exclude=True,
        no_random_recycling_training=c.get("fixed", True),
        ema_decay=0.99,
    )


def _run(model, feats, c, steps=2):
    run = Boltz2Training(model, _args(c), seed=c["seed"], losses=HOOKS)
    res = []
    for i in range(steps):
        got = run.step(feats)
        out = got["out"]
        rec = {"loss": got["loss"]}
        if i == 0:
            rec["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            for k in ("denoised_atom_coords", "aligned_true_atom_coords"):
                x = out[k]
                rec[k] = collect_tensor(x) if isinstance(x, torch.distributed.tensor.DTensor) else x.detach()
            rec["sigmas"] = out["sigmas"].detach()
        rec["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        rec["ema"] = {k: v.clone() for k, v in run.ema.ema_weights.items()}
        res.append(rec)
    return res


def _rank(grid, c):
    model = _model(CPBoltz2Model, c["seed"])
    return _run(model, distribute(_feats(c["n"], c["seed"]), grid), c, c["steps"])


# the second step (AdamW state, EMA over steps) on 2x2; 2x3 one step
CASES = [((2, 2), dict(n=11, m=3, seed=4, steps=2)), ((2, 3), dict(n=10, m=1, seed=5, steps=1))]


def compare_steps(got: list, want: list, steps: int, what: str, grid: str) -> None:
    """One rank's recorded steps (``_run``) against the serial ones: the loss, every weight after
    AdamW and every EMA weight of each step, and every parameter gradient of the first by name."""
    for i in range(steps):
        at = f"{what} step {i}"
        assert_parity(got[i]["loss"], want[i]["loss"], what=f"{at} loss", grid=grid)
        for n, w in want[i]["params"].items():
            assert_parity(got[i]["params"][n], w, what=f"{at} AdamW-updated {n}", grid=grid)
        for n, w in want[i]["ema"].items():
            assert_parity(got[i]["ema"][n], w, what=f"{at} EMA {n}", grid=grid)
    assert set(got[0]["grads"]) == set(want[0]["grads"]), f"{what}: parameters with gradients"
    for n, w in want[0]["grads"].items():
        assert_parity(got[0]["grads"][n], w, what=f"{what} grad {n}", grid=grid)


@pytest.mark.parametrize("grid,c", CASES, ids=[f"{grid_id(g)}-N{c['n']}-m{c['m']}" for g, c in CASES])
def test_cp_step_matches_serial(grid, c):
    want = _run(_model(Boltz2Model, c["seed"]), _feats(c["n"], c["seed"]), c, c["steps"])
    assert len(want[0]["grads"]) > 200
    ranks = run_on_grid(_rank, grid, c, timeout=TIMEOUT)
    g = grid_id(grid)
    for r, got in enumerate(ranks):
        compare_steps(got, want, c["steps"], f"CP training rank {r} {c}", g)
        for k in ("denoised_atom_coords", "aligned_true_atom_coords", "sigmas"):
            assert_parity(got[0][k], want[0][k], what=f"rank {r} {k}", grid=g)
    assert_replicated([got[-1]["params"] for got in ranks], f"CP weights after {c['steps']} steps")
    assert_replicated([got[-1]["ema"] for got in ranks], f"CP EMA weights after {c['steps']} steps")


def _state(run: Boltz2Training) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in run.model.named_parameters()},
        "opt": run.optimizer.state_dict(),
        "ema": run.ema.state_dict(),
        "global_step": run.global_step,
    }


def _equal_states(a: dict, b: dict, what: str) -> None:
    assert a["global_step"] == b["global_step"], what
    for n, v in a["params"].items():
        assert torch.equal(v, b["params"][n]), f"{what}: weight {n}"
    assert a["ema"]["cur_step"] == b["ema"]["cur_step"], what
    for n, v in a["ema"]["ema_weights"].items():
        assert torch.equal(v, b["ema"]["ema_weights"][n]), f"{what}: EMA {n}"
    for i, st in a["opt"]["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["opt"]["state"][i][k])), (
                f"{what}: optimizer {i} {k}"
            )


RESUME = dict(n=9, m=2, seed=6, recycling=2, fixed=False)


def test_resume_equals_uninterrupted(tmp_path):
    c = RESUME
    assert [recycling_steps_at(_args(c), s) for s in range(2)] == [
        int(np.random.default_rng(s).integers(0, 3)) for s in range(2)
    ]
    feats = _feats(c["n"], c["seed"])
    straight = Boltz2Training(_model(Boltz2Model, c["seed"]), _args(c), seed=c["seed"], losses=HOOKS)
    straight.step(feats)
    straight.step(feats)
    first = Boltz2Training(_model(Boltz2Model, c["seed"]), _args(c), seed=c["seed"], losses=HOOKS)
    first.step(feats)
    path = tmp_path / "step1.ckpt"
    first.save(path)
    ckpt = torch.load(path, weights_only=False)
    assert set(ckpt) >= {
        "state_dict",
        "optimizer_states",
        "callbacks",
        "ema",
        "global_step",
        "epoch",
        "hyper_parameters",
    }
    assert list(ckpt["state_dict"]) == list(first.model.state_dict())
    resumed = Boltz2Training(_model(Boltz2Model, 99), _args(c), seed=0, losses=HOOKS)
    resumed.load(path)
    assert resumed.global_step == 1 and resumed.seed == c["seed"]
    resumed.step(feats)
    _equal_states(_state(resumed), _state(straight), "resumed vs uninterrupted")


def _first_half(grid, c, path):
    run = Boltz2Training(_model(CPBoltz2Model, c["seed"]), _args(c), seed=c["seed"], losses=HOOKS)
    run.step(distribute(_feats(c["n"], c["seed"]), grid))
    run.save(path)


def _second_half(grid, c, path):
    run = Boltz2Training(_model(CPBoltz2Model, 99), _args(c), seed=0, losses=HOOKS)
    run.load(path)
    run.step(distribute(_feats(c["n"], c["seed"]), grid))
    return _state(run)


def test_resume_on_another_grid(tmp_path):
    c = RESUME
    straight = Boltz2Training(_model(Boltz2Model, c["seed"]), _args(c), seed=c["seed"], losses=HOOKS)
    feats = _feats(c["n"], c["seed"])
    straight.step(feats)
    straight.step(feats)
    want = _state(straight)
    path = tmp_path / "cp.ckpt"
    run_on_grid(_first_half, (2, 2), c, str(path), timeout=TIMEOUT)
    ranks = run_on_grid(_second_half, (1, 2), c, str(path), timeout=TIMEOUT)
    for r, got in enumerate(ranks):
        assert got["global_step"] == 2 and got["ema"]["cur_step"] == 2
        for n, w in want["params"].items():
            assert_parity(
                got["params"][n], w, what=f"resumed 2x2 -> 1x2 rank {r} weight {n}", grid="2x2->1x2"
            )
        for n, w in want["ema"]["ema_weights"].items():
            assert_parity(got["ema"]["ema_weights"][n], w, what=f"resumed rank {r} EMA {n}", grid="2x2->1x2")
    assert_replicated([got["params"] for got in ranks], "resumed CP weights")


def test_sigmas_synchronized():
    model = _model(Boltz2Model).train()
    feats = _feats(9, 1)
    for sync in (True, False):
        model.structure_module.synchronize_sigmas = sync
        with torch.no_grad():
            out = model(feats, recycling_steps=0, num_sampling_steps=2, multiplicity_diffusion_train=3)
        sig = out["sigmas"]
        assert sig.shape == (3,)
        if sync:
            assert torch.equal(sig, sig[:1].expand(3)), (
                f"synchronize_sigmas: one noise level per element, got {sig}"
            )
        else:
            assert len(set(sig.tolist())) == 3, sig


def test_structure_gradient_reaches_trunk():
    c = dict(m=2, seed=7)
    model = _model(Boltz2Model, c["seed"])
    args = _args(c)
    run = Boltz2Training(
        model, args, seed=1, losses=LossHooks(distogram=None, diffusion=structure_compute_loss)
    )
    run.args = TrainingArgs(**{**args.__dict__, "distogram_loss_weight": 0.0})
    run.step(_feats(9, 1))
    grads = {n: p.grad for n, p in model.named_parameters()}
    for prefix in (
        "pairformer_module.",
        "msa_module.",
        "s_recycle",
        "z_recycle",
        "diffusion_conditioning.",
        "structure_module.",
    ):
        got = [g for n, g in grads.items() if n.startswith(prefix) and g is not None and bool(g.any())]
        assert got, f"the structure loss gives no gradient to {prefix}* (the training forward detached it?)"


def test_ema_follows_the_optimizer_step():
    c = dict(m=1, seed=8)
    model = _model(Boltz2Model, c["seed"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run = Boltz2Training(model, _args(c), seed=1, losses=HOOKS)
    run.step(_feats(9, 1))
    decay = min(0.99, 2 / 11)  # Boltz's warm start at global step 1
    assert run.ema.cur_step == 1
    moved = 0
    for k, w in model.state_dict().items():
        want = before[k] - (1 - decay) * (before[k] - w)
        assert torch.allclose(run.ema.ema_weights[k], want, rtol=0, atol=1e-15), (
            f"EMA of {k} is not the average of the weights after the optimizer step"
        )
        moved += int(not torch.equal(w, before[k]))
    assert moved > 100


def _coords_rank(grid, n):
    from twinshard.pair.atoms import atom_parts

    feats = _feats(n, 2)
    feats["coords"] = torch.cat([feats["coords"], feats["coords"] + 1.0], 1)  # K = 2 conformers
    feats["disto_target"] = feats["disto_target"].repeat(1, 1, 1, 2, 1)  # the contract: one K
    fd = distribute(feats, grid)
    x = fd["coords"]
    parts = atom_parts(x)
    for local, idx in parts:  # each real piece sits where the serial tensor has it
        assert torch.equal(local, feats["coords"][idx])
    return collect_tensor(x), sum(p[0].numel() for p in parts)


def test_coords_placement_round_trip():
    """``coords [B, K, A, 3]`` (kind ``atom_conf``, the atom placement along dim 2) distributes and
    collects back exactly on 2x3 (uneven N and A); every rank holds a strict part."""
    n = 10
    full = _feats(n, 2)["coords"]
    full = torch.cat([full, full + 1.0], 1)
    for got, held in run_on_grid(_coords_rank, (2, 3), n):
        assert torch.equal(got, full)
        assert 0 < held < full.numel()
