"""The whole-model training step, serial (``Boltz2Model`` + ``Boltz2Training``) and CP
(``cp_model_of``), against the ``boltz`` package's own ``Boltz2.training_step`` (boltz 2.2.1),
fp64, the same random draws; then Boltz's own AdamW (``Boltz2.configure_optimizers``) steps.

The oracle: a random-weight ``Boltz2`` (``build_boltz2`` with the confidence module: Boltz2's
training forward computes the diffusion conditioning only when it predicts confidence) whose
``training_step`` runs ITSELF on the synthetic complex with Boltz's training features
(``synthetic_training_features``: ``coords``, ``atom_resolved_mask``, ``frames_idx``,
``frame_resolved_mask``, ``r_set_to_rep_atom``, ``token_to_center_atom``, ``disto_target``,
``token_disto_mask``). Losses: distogram (0.7), confidence (0.3, ``alpha_pae`` 1: pLDDT, PDE,
resolved, PAE) and diffusion (4.0: boltz's ``AtomDiffusion.compute_loss``, the weighted rigid
alignment and the smooth lDDT, against ``AtomDiffusion.compute_loss``). What is stubbed, and why:

- ``Boltz2.log``, ``training_log`` and the confidence loggers are no-ops (they need a Lightning
  trainer; they only log); without a trainer ``global_step`` is 0, so random recycling draws
  ``np.random.default_rng(0)`` on both sides;
- ``get_true_coordinates`` (without symmetry correction) returns the true coordinates of the
  batch's first element repeated ``diffusion_samples`` times and ``atom_resolved_mask`` repeated
  likewise, what boltz's own function computes for B = 1, K = 1: boltz 2.2.1's training forward
  reshapes the batch's ``coords`` to ``[B m, A, 3]`` in place, after which its own
  ``get_true_coordinates`` reads ``K, L = coords.shape[1:3]`` as ``(A, 3)`` and raises (the step
  then returns None, "Skipping batch").

Cases: serial (two complexes, fixed and random recycling, 1 and 3 samples) and ``cp_model_of`` on
1x1, 2x2, 2x3 and 3x3 (uneven N and A, 1 to 3 samples).

Compared: the loss; the structure module's training forward (``denoised_atom_coords``, ``sigmas``,
``aligned_true_atom_coords``, captured from boltz's ``structure_module`` call); every parameter
gradient by name (the trunk's, the conditioning's and the structure module's from the diffusion
and distogram losses, the confidence module's from the confidence loss); the AdamW-updated weights (boltz's own ``configure_optimizers``: its two
parameter groups, weight decay 0.01 with ``weight_decay_exclude``); exact-zero gradients against
zero, their weights within the derived bound ``lr (|g_ours| + |g_boltz|) / eps``.
- ``torch.randn`` / ``torch.randn_like`` hand out seeded draws in boltz's order (the sampler's
  init and three per step, then the noise levels, the augmentation's rotation and translation,
  the training noise); our side takes the same draws (``GivenDraws``).
"""

from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("boltz", reason="the boltz package is not installed (see tests/interop/README.md)")

from boltz2_model import boltz_float_is, build_boltz2  # noqa: E402
from test_boltz2_trunk_cp import zero_grads  # noqa: E402

from twinshard.pair.features import collect_tensor, distribute  # noqa: E402
from twinshard.pair.interop.boltz import cp_twin_of  # noqa: E402
from twinshard.pair.reference.model import Boltz2Model, ModelConfig  # noqa: E402
from twinshard.pair.reference.sampler import BOLTZ2_DIFFUSION_PARAMS, GivenDraws  # noqa: E402
from twinshard.pair.synthetic import synthetic_training_features  # noqa: E402
from twinshard.pair.train_boltz2 import Boltz2Training, TrainingArgs  # noqa: E402
from twinshard.testing import assert_parity, assert_replicated, grid_id, run_on_grid  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "pair"))
from model_inputs import confidence_model_args, model_features  # noqa: E402

F64 = torch.float64
STEPS = 2
_RANDN, _RANDN_LIKE = torch.randn, torch.randn_like
SALT = {
    "init": 1,
    "rotation": 2,
    "translation": 3,
    "noise": 4,
    "sigma": 5,
    "aug_rotation": 6,
    "aug_translation": 7,
    "train_noise": 8,
}


def draws_fn(kind: str, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * SALT[kind] + step)
    return _RANDN(shape, generator=g, dtype=F64)


@contextlib.contextmanager
def boltz_train_draws(steps: int):
    """boltz's ``torch.randn`` / ``randn_like`` calls of one training step -> :func:`draws_fn`'s."""
    order = [("init", 0)] + [(k, s) for s in range(steps) for k in ("rotation", "translation", "noise")]
    order += [("sigma", 0), ("aug_rotation", 0), ("aug_translation", 0), ("train_noise", 0)]
    calls: list = []

    def nxt(shape):
        kind, step = order[len(calls)]
        calls.append((kind, step, tuple(shape)))
        return draws_fn(kind, step, tuple(shape))

    def randn(*size, **kw):
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        return nxt(shape).to(kw.get("dtype") or torch.get_default_dtype())

    def randn_like(x, **kw):
        return nxt(x.shape).to(kw.get("dtype") or x.dtype)

    default = torch.get_default_dtype()
    torch.randn, torch.randn_like = randn, randn_like
    torch.set_default_dtype(F64)  # boltz's sampler builds its schedule in the default dtype
    try:
        yield calls
    finally:
        torch.randn, torch.randn_like = _RANDN, _RANDN_LIKE
        torch.set_default_dtype(default)
    assert len(calls) == len(order), calls


class _Args(dict):
    __getattr__ = dict.__getitem__


def training_args(c: dict) -> TrainingArgs:
    return TrainingArgs(
        recycling_steps=c["recycling"],
        sampling_steps=STEPS,
        diffusion_multiplicity=c["m"],
        diffusion_samples=c.get("samples", 1),
        confidence_loss_weight=0.3,
        alpha_pae=1.0,
        diffusion_loss_weight=4.0,
        distogram_loss_weight=0.7,
        base_lr=1e-3,
        weight_decay=0.01,
        weight_decay_exclude=True,
        no_random_recycling_training=c["fixed_recycling"],
        use_ema=True,
        ema_decay=0.999,
    )


def boltz_model(c: dict):
    model = build_boltz2(
        seed=c["seed"],
        num_bins=64,
        confidence_model_args=confidence_model_args(),
        diffusion_process_args=dict(BOLTZ2_DIFFUSION_PARAMS, sigma_max=0.5),
    )
    a = training_args(c)
    model.training_args = _Args(a.as_training_args())
    model.no_random_recycling_training = a.no_random_recycling_training
    model.alpha_pae = a.alpha_pae
    model.diffusion_loss_args = {}
    return model


def features(c: dict) -> dict:
    """The synthetic complex with Boltz's training features (the frames' K = 1 axis squeezed)."""
    f = model_features(c["n"], 1, seed=c["n"], msa=3, templates=1, window=32)
    f.update(synthetic_training_features(f, seed=c["seed"]))
    f["frames_idx"], f["frame_resolved_mask"] = f["frames_idx"][:, 0], f["frame_resolved_mask"][:, 0]
    f["coords"] = f["coords"].to(F64)
    return f


class _NoLogger:
    def update(self, *a, **k):
        pass


def boltz_step(model, feats: dict, c: dict):
    """``Boltz2.training_step`` itself, fp64, seeded draws; its structure-module output captured;
    then ``loss.backward()``; returns (loss, captured structure output)."""
    got: dict = {}

    def hook(_m, _args, out):
        got.update(out)

    model.log = lambda *a, **k: None
    model.training_log = lambda: None
    model.validate_structure = False  # logging only (not set by Boltz2 without validators)
    model.train_confidence_loss_logger = _NoLogger()
    model.train_confidence_loss_dict_logger = {}
    model.get_true_coordinates = lambda batch, out, diffusion_samples, symmetry_correction: {
        "true_coords": batch["coords"][:1, None].repeat(diffusion_samples, 1, 1, 1),
        "true_coords_resolved_mask": batch["atom_resolved_mask"].repeat_interleave(diffusion_samples, 0),
    }
    handle = model.structure_module.register_forward_hook(hook)
    model.train()
    try:
        with boltz_float_is(F64), boltz_train_draws(STEPS):
            loss = model.training_step(dict(feats), 0)
    finally:
        handle.remove()
    assert loss is not None, "Boltz2.training_step skipped the batch"
    return loss, got


def ours_training(model, c: dict) -> Boltz2Training:
    return Boltz2Training(model, training_args(c), seed=0)


STRUCT = ("denoised_atom_coords", "aligned_true_atom_coords")


SOFTMAX_SHIFT = (".attention.proj_z.0.bias", ".pair_weighted_averaging.norm_z.bias")
# the conditioning's per-layer bias projections (LayerNorm + linear) feed softmaxes too
COND_BIAS = re.compile(r"diffusion_conditioning\.(atom_enc|atom_dec|token_trans)_proj_z\.\d+\.0\.bias$")
# the diffusion loss is translation invariant (the alignment matches the weighted centroids, the
# lDDT reads distances): the LayerNorm bias in front of the position projection gets an exact zero
TRANSLATION = "atom_feat_to_atom_pos_update.0.bias"


def exact_zero(model, feats: dict, recycling: int) -> set:
    """The trunk's exact-zero gradients (``zero_grads``) and, outside the trunk, the LayerNorm
    biases in front of a softmax (the confidence Pairformer's pair-bias ``proj_z.0``, the
    conditioning's bias projections) and in front of the translation-invariant position update."""
    names = [n for n, _ in model.named_parameters()]
    shifts = {n for n in names if n.endswith(SOFTMAX_SHIFT) or COND_BIAS.search(n) or n.endswith(TRANSLATION)}
    return set(zero_grads(model, feats, recycling)) | shifts


def check_grads_and_update(grads_o, params_o, grads_t, params_t, zero, what, grid="-") -> None:
    """Every gradient by name (None on our side: a loss of weight 0 that is not ours yet, where
    boltz's is exactly zero), the exact-zero ones (``zero``, the trunk's: ``test_boltz2_trunk_cp.
    zero_grads``) against zero at the scale of the largest gradient, and the AdamW-updated weights.
    An exact-zero gradient's round-off noise ``g`` moves a weight by up to ``lr |g| / eps`` under
    Adam's normalisation (the first step's update is ``lr g / (|g| + eps)``), so those weights are
    compared within that bound (derived, stated in the evidence)."""
    scale = max(float(g.abs().max()) for g in grads_o.values() if g is not None)
    lr, eps = 1e-3, 1e-8
    n_grad = 0
    for n, g in grads_o.items():
        gt = grads_t[n]
        if g is None:
            assert gt is None or not bool(gt.any()), f"{n}: boltz has a non-zero gradient, ours none"
            continue
        n_grad += 1
        if n in zero:
            bound = 1e-13 * scale
            assert float(g.abs().max()) <= bound and float(gt.abs().max()) <= bound, (n, scale)
            noise = float(g.abs().max() + gt.abs().max())
            assert_parity(
                params_o[n],
                params_t[n].detach(),
                what=f"{what} AdamW-updated {n} (exact-zero gradient)",
                grid=grid,
                rtol=0.0,
                atol=lr * noise / eps + 1e-15,
                why="lr (|g_ours| + |g_boltz|) / eps: Adam's first step on a round-off gradient",
            )
            continue
        assert_parity(g, gt, what=f"{what} grad {n}", grid=grid)
        assert_parity(params_o[n], params_t[n].detach(), what=f"{what} AdamW-updated {n}", grid=grid)
    assert n_grad > 50, n_grad


CASES = [
    dict(n=9, m=1, recycling=1, fixed_recycling=True, seed=1),
    dict(n=10, m=3, recycling=2, fixed_recycling=False, seed=2, samples=2),
]


@pytest.mark.parametrize("c", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_serial_training_step_vs_boltz2(c):
    theirs = boltz_model(c)
    ours = Boltz2Model(ModelConfig.from_hparams(theirs.hparams)).to(F64)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    feats = features(c)
    # the structure module's training forward, from boltz's own training_step
    loss_t, sout_t = boltz_step(theirs, feats, c)
    loss_t.backward()
    opt_t = theirs.configure_optimizers()
    grads_t = {n: p.grad for n, p in theirs.named_parameters()}
    opt_t.step()

    run = ours_training(ours, c)
    got = run.step(features(c), draws=GivenDraws(draws_fn))
    out = got["out"]
    assert got["recycling_steps"] == (
        c["recycling"]
        if c["fixed_recycling"]
        else int(np.random.default_rng(0).integers(0, c["recycling"] + 1))
    )
    what = f"Boltz2Training {c}"
    assert_parity(got["loss"], loss_t.detach(), what=f"{what} loss vs Boltz2.training_step")
    for k in STRUCT + ("sigmas",):
        assert_parity(out[k], sout_t[k].detach(), what=f"{what} {k}")
    struct = [n for n, p in ours.named_parameters() if n.startswith("structure_module.") and p.requires_grad]
    assert all(ours.get_parameter(n).grad is not None for n in struct), (
        "the diffusion loss missed a parameter"
    )
    check_grads_and_update(
        {n: p.grad for n, p in ours.named_parameters()},
        {n: p.detach() for n, p in ours.named_parameters()},
        grads_t,
        dict(theirs.named_parameters()),
        exact_zero(theirs, feats, got["recycling_steps"]),
        what,
    )
    # Boltz's parameter groups: the same names with and without decay
    groups_t = [[id(p) for p in g["params"]] for g in opt_t.param_groups]
    names_t = {id(p): n for n, p in theirs.named_parameters()}
    names_o = {id(p): n for n, p in ours.named_parameters()}
    groups_o = [[names_o[id(p)] for p in g["params"]] for g in run.optimizer.param_groups]
    assert groups_o == [[names_t[i] for i in g] for g in groups_t]
    assert [g["weight_decay"] for g in run.optimizer.param_groups] == [
        g["weight_decay"] for g in opt_t.param_groups
    ]


def _rank(grid, c):
    twin = cp_twin_of(boltz_model(c), whole=True).to(F64)
    run = ours_training(twin, c)
    got = run.step(distribute(features(c), grid), draws=GivenDraws(draws_fn))
    out = got["out"]
    coll = {k: collect_tensor(out[k]) for k in STRUCT}
    coll["sigmas"] = out["sigmas"]
    grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in twin.named_parameters()}
    params = {n: p.detach().clone() for n, p in twin.named_parameters()}
    return got["loss"], coll, grads, params


CP_CASES = [
    ((1, 1), dict(n=9, m=2, recycling=0, fixed_recycling=True, seed=3)),
    ((2, 2), dict(n=11, m=3, recycling=1, fixed_recycling=True, seed=4, samples=2)),
    ((2, 3), dict(n=10, m=1, recycling=1, fixed_recycling=False, seed=5)),
    ((3, 3), dict(n=13, m=2, recycling=0, fixed_recycling=True, seed=6)),
]


@pytest.mark.parametrize("grid,c", CP_CASES, ids=[f"{grid_id(g)}-N{c['n']}-m{c['m']}" for g, c in CP_CASES])
def test_cp_training_step_vs_boltz2(grid, c):
    theirs = boltz_model(c)
    loss_t, sout_t = boltz_step(theirs, features(c), c)
    rec = (
        c["recycling"]
        if c["fixed_recycling"]
        else int(np.random.default_rng(0).integers(0, c["recycling"] + 1))
    )
    zero = exact_zero(theirs, features(c), rec)
    loss_t.backward()
    opt_t = theirs.configure_optimizers()
    grads_t = {n: p.grad for n, p in theirs.named_parameters()}
    opt_t.step()
    params_t = dict(theirs.named_parameters())
    ranks = run_on_grid(_rank, grid, c)
    what = f"cp Boltz2Training {c}"
    g = grid_id(grid)
    for r, (loss, coll, grads, params) in enumerate(ranks):
        assert_parity(loss, loss_t.detach(), what=f"{what} rank {r} loss", grid=g)
        for k in STRUCT + ("sigmas",):
            assert_parity(coll[k], sout_t[k].detach(), what=f"{what} rank {r} {k}", grid=g)
        check_grads_and_update(grads, params, grads_t, params_t, zero, f"{what} rank {r}", g)
    assert_replicated([p for *_, p in ranks], "updated parameters")


def test_checkpoint_round_trip_with_boltz2(tmp_path):
    """Our checkpoint after a step loads strict into boltz's ``Boltz2`` (``load_state_dict``), its
    AdamW (``configure_optimizers().load_state_dict``) and its EMA callback (``on_load_checkpoint``
    reads ``"ema"``); and a checkpoint written from boltz's side (the model's ``state_dict``, its
    AdamW after a step, the EMA callback's ``state_dict`` under ``"ema"`` and ``callbacks``) loads
    into ``Boltz2Training`` with every tensor equal."""
    from boltz.model.optim.ema import EMA as BoltzEMA

    c = dict(n=9, m=1, recycling=1, fixed_recycling=True, seed=3)
    theirs = boltz_model(c)
    ours = Boltz2Model(ModelConfig.from_hparams(theirs.hparams)).to(F64)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    run = Boltz2Training(ours, training_args(c), seed=0, hparams=theirs.hparams)
    run.step(features(c), draws=GivenDraws(draws_fn))
    path = tmp_path / "ours.ckpt"
    run.save(path)
    ckpt = torch.load(path, weights_only=False)
    theirs.load_state_dict(ckpt["state_dict"], strict=True)
    opt_t = theirs.configure_optimizers()
    opt_t.load_state_dict(ckpt["optimizer_states"][0])
    ema_t = BoltzEMA(0.999)
    ema_t.on_load_checkpoint(None, theirs, ckpt)
    assert ema_t._cur_step == 1  # noqa: SLF001 - boltz's callback state
    for k, v in ours.state_dict().items():
        assert torch.equal(theirs.state_dict()[k], v), k
        assert torch.equal(ema_t._ema_weights[k], run.ema.ema_weights[k]), k  # noqa: SLF001
    st_o, st_t = run.optimizer.state_dict(), opt_t.state_dict()
    assert st_o["param_groups"] == st_t["param_groups"]
    for i, s in st_o["state"].items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(st_t["state"][i][k])), (i, k)
    # boltz-written -> ours: perturb boltz's weights, optimizer and EMA, write Lightning's layout
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.01)
    for s in opt_t.state.values():
        s["exp_avg"].mul_(2.0)
    ema_t._cur_step = 5  # noqa: SLF001
    ckpt_t = {
        "epoch": 0,
        "global_step": 5,
        "state_dict": theirs.state_dict(),
        "optimizer_states": [opt_t.state_dict()],
        "lr_schedulers": [],
        "callbacks": {"EMA": ema_t.state_dict()},
        "ema": ema_t.state_dict(),
        "hyper_parameters": dict(theirs.hparams),
    }
    torch.save(ckpt_t, tmp_path / "boltz.ckpt")
    fresh = Boltz2Training(Boltz2Model(ModelConfig.from_hparams(theirs.hparams)).to(F64), training_args(c))
    fresh.load(tmp_path / "boltz.ckpt")
    assert fresh.global_step == 5 and fresh.ema.cur_step == 5
    for k, v in theirs.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[k], v), k
    for i, s in opt_t.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(
                torch.as_tensor(v), torch.as_tensor(fresh.optimizer.state_dict()["state"][i][k])
            )
