"""A whole-model Boltz-2 training step (boltz's ``Boltz2.training_step``), serial and CP, with
Boltz's AdamW parameter groups, its EMA callback and its Lightning checkpoint layout.

:class:`Boltz2Training` holds a model (``Boltz2Model`` or its twin ``CPBoltz2Model``), its
``torch.optim.AdamW`` (:func:`configure_optimizer`: Boltz2.configure_optimizers' groups), an
:class:`EMA` (boltz.model.optim.ema.EMA's semantics) and the counters ``global_step`` / ``epoch``.
``step(feats)`` is one ``Boltz2.training_step`` followed by what Lightning does around it::

    recycling_steps <- training_args.recycling_steps                    if no_random_recycling_training
                       np.random.default_rng(global_step).integers(0, recycling_steps + 1)  otherwise
    sampling_steps  <- np.random.default_rng(global_step).choice(sampling_steps_random) or sampling_steps
    out  <- model(feats, recycling_steps, sampling_steps, multiplicity_diffusion_train, diffusion_samples)
    loss <- confidence_loss_weight * confidence + diffusion_loss_weight * diffusion
            + distogram_loss_weight * distogram                           (bfactor: not supported)
    zero_grad; loss.backward(); optimizer.step(); global_step += 1
    ema.update(model, global_step)                                      (on_train_batch_end)

The losses are :class:`LossHooks`: ``distogram`` (here: ``reference.distogram.distogram_loss`` on
``pdistogram`` with ``disto_target`` / ``token_disto_mask``, serial; the fused
``CPDistogramHead.loss`` on ``z`` under CP), ``diffusion`` (default: the structure module's
``compute_loss(feats_train, out, multiplicity=m, **diffusion_loss_args)``, Boltz's signature,
when the structure module has one) and ``confidence`` (:func:`confidence_term`: the confidence
losses of ``reference.confidence_loss`` / ``layers.confidence_loss`` on the true coordinates). A loss whose weight is 0
and which has no hook is skipped (it adds exactly zero, as Boltz's ``0 * loss``); a loss with a
positive weight and no hook raises.

Random draws: ``draws=None`` keys every draw of step ``global_step`` by (seed, global step, row,
step, global atom index) (:class:`~twinshard.pair.reference.sampler.CounterDraws` with
``global_step``): the same on every grid, and a resumed run draws what the uninterrupted one
drew. Dropout masks are keyed by :func:`dropout_seed` (seed, global step).

CP: the model's parameters are plain tensors replicated on every rank whose gradients each twin
completes (all-reduces) itself, so a stock AdamW on every rank keeps the replicas identical; the
step's control scalars (global step, recycling and sampling steps, weights, the optimizer's
step counts and hyperparameters) are agreed first (``agree_scalars``).

Data x context parallelism (``mesh``: a :class:`twinshard.runtime.mesh.DPCPMesh` of ``dp``
replicas, each a rows x cols grid). Replica ``d`` holds the contiguous elements ``[k_d, k_d +
B_d)`` of the whole batch of ``B`` (``split_sizes``: uneven ``B`` allowed, ``B < dp`` raises on
every rank); the caller distributes them (``data_parallel.distribute_features(full_feats, mesh)``
for ``CPBoltz2Model``, ``data_parallel.split_batch`` for a serial model on 1 x 1 replicas).
``step(feats)`` agrees over the whole world the step's control scalars (global step, seed, args,
optimizer step counts and hyperparameters, the EMA's step, the mesh shape, the parameter names,
shapes, dtypes and trainable flags, a checksum of the weights, the draw source) and the batch
split (``data_parallel.agree_split``: each replica's ``B_d``, the same on its ranks), then runs
the forward, the losses and the backward inside ``mesh.replica()`` and ``batch_offset(k_d)``:
dropout masks and the structure module's draws (noise levels, augmentation, noise, the
confidence's samples: ``reference.sampler.global_rows``) are keyed by each element's index in
the whole batch, so the replicas draw the serial step's numbers; recycling and sampling steps
come from ``global_step``, the same everywhere. Every loss term is a plain mean over the batch's
elements or its ``B m`` sample rows (the distogram's per-element mean, the diffusion loss' mean
over rows of the weighted MSE and the smooth lDDT, the confidence losses' per-sample means; their
epsilons are per element), so the serial loss is ``sum_d (B_d / B) L_d`` and its gradient the same
weighted sum of the replicas': ``data_parallel.reduce_gradients`` with ``replica_weight`` sums the
weighted gradients over ``mesh.dp_group`` (one all-reduce per dtype, >= fp32; a parameter gets a
gradient where any replica has one, as serial), then AdamW and the EMA step on identical
replicas. The returned ``loss`` and per-term values are the whole batch's (one weighted
all-reduce over ``dp_group``). Collectives per step beyond the replica's CP ones: two object
all-gathers over the world (agreement, split), one flag all-reduce (which parameters have
gradients), the gradient all-reduce(s) and one 4-scalar all-reduce over ``dp_group``. Memory per
rank: the replica's CP step's, plus one flat gradient buffer per dtype during the reduction.

Checkpoints (:meth:`Boltz2Training.save` / :meth:`load`): Lightning's ``.ckpt`` layout
(``epoch``, ``global_step``, ``pytorch-lightning_version``, ``state_dict`` with Boltz2's names,
``loops`` (None), ``callbacks`` ``{"EMA": ema state}``, ``optimizer_states [AdamW state_dict]``,
``lr_schedulers []``, ``hyper_parameters``) plus ``"ema"`` (where boltz's EMA callback writes and
reads its state) and ``"twinshard"`` (the draw seed). Rank 0 writes (atomically), every rank
reads; the state loads strict into boltz's ``Boltz2`` and its AdamW.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from twinshard.comm import primitives as P
from twinshard.runtime.agree import agree_scalars
from twinshard.runtime.files import atomic_write
from twinshard.runtime.scope import current_scope

__all__ = [
    "EMA",
    "Boltz2Training",
    "LossHooks",
    "TrainingArgs",
    "configure_optimizer",
    "confidence_term",
    "dropout_seed",
    "nodecay_names",
    "recycling_steps_at",
    "sampling_steps_at",
]

LIGHTNING_VERSION = "2.5.0"  # the layout written (Lightning 2.x .ckpt keys)


@dataclass(frozen=True)
class TrainingArgs:
    """Boltz2's ``training_args`` that the step reads (names and meaning as in boltz 2.2.1's
    ``Boltz2.training_step`` / ``configure_optimizers``), plus the model-level flags
    ``no_random_recycling_training``, ``use_ema``, ``ema_decay``, ``diffusion_loss_args``,
    ``alpha_pae`` and ``token_level_confidence`` (Boltz2 init arguments)."""

    recycling_steps: int = 0
    sampling_steps: int = 3
    sampling_steps_random: tuple[int, ...] | None = None
    diffusion_multiplicity: int = 1
    diffusion_samples: int = 1
    confidence_loss_weight: float = 0.0
    diffusion_loss_weight: float = 0.0
    distogram_loss_weight: float = 1.0
    bfactor_loss_weight: float = 0.0
    symmetry_correction: bool = False
    adam_beta_1: float = 0.9
    adam_beta_2: float = 0.95
    adam_eps: float = 1e-8
    base_lr: float = 1e-3
    weight_decay: float = 0.0
    weight_decay_exclude: bool = False
    lr_scheduler: str | None = None
    no_random_recycling_training: bool = True
    use_ema: bool = True
    ema_decay: float = 0.999
    diffusion_loss_args: dict[str, Any] = field(default_factory=dict)
    alpha_pae: float = 0.0
    token_level_confidence: bool = True

    def __post_init__(self):
        if self.bfactor_loss_weight:
            raise NotImplementedError(
                "TrainingArgs: the B-factor loss is not supported (bfactor_loss_weight 0)"
            )
        if self.symmetry_correction:
            raise NotImplementedError("TrainingArgs: symmetry_correction is not supported (set it False)")
        if self.lr_scheduler not in (None, "", "none"):
            raise NotImplementedError(
                f"TrainingArgs: lr_scheduler {self.lr_scheduler!r} is not supported (a constant base_lr)"
            )

    @classmethod
    def from_hparams(cls, hparams: Mapping[str, Any]) -> TrainingArgs:
        """From a ``Boltz2`` model's ``hparams`` (``training_args`` and the model-level flags)."""
        ta = dict(hparams.get("training_args") or {})
        names = {f.name for f in fields(cls)}
        got = {k: v for k, v in ta.items() if k in names}
        for k in (
            "no_random_recycling_training",
            "use_ema",
            "ema_decay",
            "alpha_pae",
            "token_level_confidence",
        ):
            if k in hparams:
                got[k] = hparams[k]
        if hparams.get("diffusion_loss_args") is not None:
            got["diffusion_loss_args"] = dict(hparams["diffusion_loss_args"])
        if got.get("sampling_steps_random") is not None:
            got["sampling_steps_random"] = tuple(got["sampling_steps_random"])
        return cls(**got)

    def as_training_args(self) -> dict[str, Any]:
        """The ``training_args`` dict of Boltz2's hyperparameters."""
        skip = {"no_random_recycling_training", "use_ema", "ema_decay", "diffusion_loss_args", "alpha_pae"}
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        out.pop("token_level_confidence")
        if out["sampling_steps_random"] is not None:
            out["sampling_steps_random"] = list(out["sampling_steps_random"])
        return out


def recycling_steps_at(args: TrainingArgs, global_step: int) -> int:
    """Boltz's recycling count of a step: ``training_args.recycling_steps`` with
    ``no_random_recycling_training``, else ``np.random.default_rng(global_step).integers(0,
    recycling_steps + 1)``."""
    if args.no_random_recycling_training:
        return int(args.recycling_steps)
    return int(np.random.default_rng(int(global_step)).integers(0, int(args.recycling_steps) + 1).item())


def sampling_steps_at(args: TrainingArgs, global_step: int) -> int:
    """Boltz's sampling steps of a step: ``np.random.default_rng(global_step).choice(
    sampling_steps_random)`` if given, else ``sampling_steps``."""
    if args.sampling_steps_random is not None:
        return int(np.random.default_rng(int(global_step)).choice(list(args.sampling_steps_random)))
    return int(args.sampling_steps)


def dropout_seed(seed: int, global_step: int) -> int:
    """The dropout seed of a training step (counter-based masks: the same on every grid)."""
    return (int(seed) * 1_000_003 + int(global_step)) % (1 << 26)


# -- the optimizer ------------------------------------------------------------------------------

_NODECAY = (
    "norm",
    "rel_pos",
    ".s_init",
    ".z_init_",
    "token_bonds",
    "embed_atom_features",
    "dist_bin_pairwise_embed",
)


def nodecay_names(names: list[str]) -> list[str]:
    """Boltz2.configure_optimizers' ``weight_decay_exclude`` names (substring rules, as Boltz)."""
    return [n for n in names if any(p in n for p in _NODECAY)]


def configure_optimizer(model: nn.Module, args: TrainingArgs) -> torch.optim.AdamW:
    """``Boltz2.configure_optimizers`` (``structure_prediction_training``, no scheduler): AdamW
    over the trainable parameters in ``named_parameters`` order; with ``weight_decay > 0`` and
    ``weight_decay_exclude`` two groups (decay, then the no-decay names of :func:`nodecay_names`),
    else one group with ``weight_decay``."""
    params = dict(model.named_parameters())
    names = [n for n, p in params.items() if p.requires_grad]
    kw = {"betas": (args.adam_beta_1, args.adam_beta_2), "eps": args.adam_eps, "lr": args.base_lr}
    if args.weight_decay > 0 and args.weight_decay_exclude:
        nodecay = set(nodecay_names(names))
        groups = [
            {"params": [params[n] for n in names if n not in nodecay], "weight_decay": args.weight_decay},
            {"params": [params[n] for n in names if n in nodecay], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, **kw)
    return torch.optim.AdamW([params[n] for n in names], weight_decay=args.weight_decay, **kw)


# -- EMA ----------------------------------------------------------------------------------------


class EMA:
    """boltz.model.optim.ema.EMA (the Lightning callback), without Lightning: ``init(model)`` at
    train start (a copy of ``model.state_dict()`` unless loaded), ``update(model, global_step)``
    after each optimizer step (Lightning's ``on_train_batch_end``, ``global_step`` already
    incremented): if ``global_step != cur_step``, ``>= start_step`` and a multiple of
    ``apply_ema_every_n_steps``: ``cur_step = global_step``, ``decay = min(decay, (1 + cur_step) /
    (10 + cur_step))`` (warm start), and for every state-dict entry that is not int64
    ``ema -= (1 - decay) (ema - weight)``. ``state_dict()`` is ``{"cur_step", "ema_weights"}``."""

    def __init__(
        self,
        decay: float = 0.999,
        apply_ema_every_n_steps: int = 1,
        start_step: int = 0,
        warm_start: bool = True,
    ):
        if not 0 <= decay <= 1:
            raise ValueError("EMA decay value must be between 0 and 1")
        self.decay, self.apply_ema_every_n_steps = float(decay), int(apply_ema_every_n_steps)
        self.start_step, self.warm_start = int(start_step), bool(warm_start)
        self.cur_step: int | None = None
        self.ema_weights: dict[str, torch.Tensor] | None = None

    def init(self, model: nn.Module) -> None:
        if self.ema_weights is None:
            self.ema_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def should_apply(self, step: int) -> bool:
        return step != self.cur_step and step >= self.start_step and step % self.apply_ema_every_n_steps == 0

    @torch.no_grad()
    def update(self, model: nn.Module, global_step: int) -> None:
        if self.ema_weights is None:
            raise RuntimeError("EMA.update before EMA.init")
        if not self.should_apply(int(global_step)):
            return
        self.cur_step = int(global_step)
        decay = self.decay
        if self.warm_start:
            decay = min(decay, (1 + self.cur_step) / (10 + self.cur_step))
        for k, w in model.state_dict().items():
            e = self.ema_weights[k]
            if e.dtype != torch.long and w.dtype != torch.long:
                e.sub_((e - w).mul_(1.0 - decay))

    def state_dict(self) -> dict[str, Any]:
        return {"cur_step": self.cur_step, "ema_weights": self.ema_weights}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.cur_step = state["cur_step"]
        self.ema_weights = {k: v.clone() for k, v in state["ema_weights"].items()}


# -- losses -------------------------------------------------------------------------------------

LossFn = Callable[..., Mapping[str, Any]]


def _is_cp(model: nn.Module) -> bool:
    return type(model).__name__.startswith("CP")


def distogram_term(model: nn.Module, out: Mapping[str, Any], feats: Mapping[str, Any], args: TrainingArgs):
    """Boltz's ``distogram_loss(out, batch, aggregate_distogram=True)``: the loss on
    ``pdistogram`` against ``disto_target`` with the pair mask of ``token_disto_mask``."""
    if _is_cp(model):
        loss, per = model.distogram_module.loss(out["z"], feats["disto_target"], feats["token_disto_mask"])
        return {"loss": loss, "loss_breakdown": {}}
    from twinshard.pair.reference.distogram import distogram_loss

    loss, _ = distogram_loss(out["pdistogram"], feats["disto_target"], feats["token_disto_mask"])
    return {"loss": loss, "loss_breakdown": {}}


def structure_compute_loss(
    model: nn.Module, out: Mapping[str, Any], feats: Mapping[str, Any], args: TrainingArgs
):
    """The diffusion loss hook: ``model.structure_module.compute_loss(feats_train, out,
    multiplicity=diffusion_multiplicity, **diffusion_loss_args)`` (Boltz's call)."""
    return model.structure_module.compute_loss(
        out["feats_train"], out, multiplicity=args.diffusion_multiplicity, **args.diffusion_loss_args
    )


def confidence_term(
    model: nn.Module, out: Mapping[str, Any], feats: Mapping[str, Any], args: TrainingArgs
) -> Mapping[str, Any]:
    """Boltz's ``confidence_loss(out, batch, true_coords, true_coords_resolved_mask,
    token_level_confidence, alpha_pae, multiplicity=diffusion_samples)`` with the true coordinates
    of ``get_true_coordinates`` without symmetry correction (``coords`` K = 1 and
    ``atom_resolved_mask``, each element repeated ``diffusion_samples`` times): the serial
    ``reference.confidence_loss`` or, under CP, ``layers.confidence_loss`` (``coords``'s K = 1
    axis dropped locally, ``cp_true_coordinates``)."""
    m = int(args.diffusion_samples)
    kw = {
        "token_level_confidence": args.token_level_confidence,
        "multiplicity": m,
        "alpha_pae": args.alpha_pae,
    }
    if _is_cp(model):
        from twinshard.pair.layers.confidence_loss import confidence_loss, cp_true_coordinates
        from twinshard.pair.layout import layout_of, with_layout
        from twinshard.pair.tiling import SINGLE, from_local

        c = feats["coords"]
        if c.shape[1] != 1:
            raise ValueError(f"the confidence loss takes one conformer (K = 1), coords has K = {c.shape[1]}")
        one = from_local(c.to_local()[:, 0].contiguous(), c.device_mesh, SINGLE)
        true, mask = cp_true_coordinates(
            with_layout(one, layout_of(c), "atom"), feats["atom_resolved_mask"], m
        )
        return confidence_loss(out, feats, true, mask, **kw)
    from twinshard.pair.reference.confidence_loss import confidence_loss, true_coordinates

    true, mask = true_coordinates(feats, m)
    return confidence_loss(out, feats, true, mask, **kw)


@dataclass
class LossHooks:
    """The three losses of the step, each ``fn(model, out, feats, args) -> {"loss", "loss_breakdown"}``
    (``out``: the training forward's dict, ``out["feats_train"]`` the features as Boltz's forward
    leaves them); None: not available (allowed only with weight 0; a hook runs at weight 0 too,
    as Boltz computes every loss: its parameters then get exact-zero gradients, which AdamW's
    weight decay still acts on). :meth:`default` fills ``diffusion`` when the structure module
    has ``compute_loss`` and ``confidence`` when the model has a confidence module."""

    distogram: LossFn | None = distogram_term
    diffusion: LossFn | None = None
    confidence: LossFn | None = confidence_term

    @classmethod
    def default(cls, model: nn.Module) -> LossHooks:
        hooks = cls()
        if callable(getattr(model.structure_module, "compute_loss", None)):
            hooks.diffusion = structure_compute_loss
        if getattr(model, "confidence_module", None) is not None:
            hooks.confidence = confidence_term
        return hooks


# -- the step -----------------------------------------------------------------------------------


_TERMS = ("distogram", "diffusion", "confidence")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class Boltz2Training:
    """One Boltz-2 training run (module docstring): ``step(feats, draws=None) -> dict`` with
    ``loss`` (detached), the per-loss values, ``recycling_steps`` and ``sampling_steps``;
    ``save(path)``, ``load(path)``. ``feats``: the serial feature dict (``Boltz2Model``) or
    ``distribute``'s ``ShardedFeatures`` (``CPBoltz2Model``), with ``coords [B, K, A, 3]``,
    ``disto_target`` and ``token_disto_mask`` (and the confidence loss' features).

    ``mesh`` (a ``DPCPMesh``): data x context parallel (module docstring); ``feats`` is then this
    replica's elements (``data_parallel.distribute_features``), ``step`` runs over the whole world
    (not inside ``mesh.replica()``) and returns the whole batch's losses; ``out`` is the
    replica's (its DTensors live on ``mesh.grid``)."""

    def __init__(
        self,
        model: nn.Module,
        args: TrainingArgs,
        *,
        seed: int = 0,
        hparams: Mapping[str, Any] | None = None,
        losses: LossHooks | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        mesh: Any = None,
    ):
        self.model, self.args, self.seed = model, args, int(seed)
        self.mesh = mesh
        self.hparams = dict(hparams) if hparams is not None else None
        self.losses = losses or LossHooks.default(model)
        self.optimizer = optimizer or configure_optimizer(model, args)
        self.ema = EMA(args.ema_decay) if args.use_ema else None
        self.global_step, self.epoch = 0, 0
        if self.ema is not None:
            self.ema.init(model)

    # the step --------------------------------------------------------------------------------
    def _settings(self) -> dict[str, Any]:
        steps = sorted(int(st["step"]) for st in self.optimizer.state.values() if "step" in st)
        groups = tuple(
            tuple(sorted((k, v) for k, v in g.items() if k != "params")) for g in self.optimizer.param_groups
        )
        return {
            "global_step": self.global_step,
            "seed": self.seed,
            "args": repr(self.args),
            "optimizer_steps": tuple(steps),
            "param_groups": groups,
            "ema": None if self.ema is None else self.ema.cur_step,
        }

    def _agree(self, feats: Mapping[str, Any]) -> None:
        if not any(isinstance(v, DTensor) for v in feats.values()):
            return
        agree_scalars(self._settings(), "Boltz2Training.step")

    def _agree_world(self, draws: Any) -> None:
        """The dp step's agreement over the whole world (module docstring)."""
        with torch.no_grad():
            params = tuple(
                (k, tuple(p.shape), str(p.dtype), bool(p.requires_grad))
                for k, p in self.model.named_parameters()
            )
            sums = [p.double().sum() for p in self.model.parameters()]
            checksum = tuple(torch.stack(sums).tolist()) if sums else ()  # one device sync
        agree_scalars(
            {
                **self._settings(),
                "mesh": tuple(self.mesh.shape),
                "model": type(self.model).__name__,
                "parameters": params,
                "weights_checksum": checksum,
                "draws": "counter" if draws is None else type(draws).__name__,
            },
            "Boltz2Training.step",
        )

    def _term(self, name: str, weight: float, out, feats) -> torch.Tensor | float:
        fn = getattr(self.losses, name)
        if fn is None:
            if weight:
                raise NotImplementedError(
                    f"Boltz2Training: {name}_loss_weight = {weight} but no {name} loss is available "
                    f"(LossHooks.{name} is None): set the weight to 0 or pass the hook"
                )
            return 0.0
        return fn(self.model, out, feats, self.args)["loss"]

    def step(self, feats: Mapping[str, Any], draws: Any = None) -> dict[str, Any]:
        """One training step (module docstring); with ``mesh``, the data x context parallel one."""
        if self.mesh is not None:
            return self._dp_step(feats, draws)
        self._agree(feats)
        res = self._forward_backward(feats, draws)
        self._update()
        return res

    def _update(self) -> None:
        self.optimizer.step()
        self.global_step += 1
        if self.ema is not None:
            self.ema.update(self.model, self.global_step)

    def _dp_step(self, feats: Mapping[str, Any], draws: Any) -> dict[str, Any]:
        from twinshard.pair.data_parallel import agree_split, batch_size, reduce_gradients, replica_weight
        from twinshard.pair.reference.dropout import batch_offset

        mesh, who = self.mesh, "Boltz2Training.step"
        if current_scope() is not None:
            raise ValueError(
                f"{who} with a dp mesh runs over the whole world, not inside a replica's sub-world"
            )
        err: BaseException | None = None
        local_b = None
        try:
            local_b = batch_size(feats, who)
        except Exception as exc:  # raised on every rank by agree_split
            err = exc
        self.model.train()
        self._agree_world(draws)
        split = agree_split(local_b, err, None, mesh, who)
        weight = replica_weight(split, mesh)
        with mesh.replica(), batch_offset(sum(split[: mesh.dp_index])):
            res = self._forward_backward(feats, draws)
        params = [p for p in self.model.parameters() if p.requires_grad]
        dev = params[0].device if params else torch.device("cpu")
        flags = torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float64, device=dev)
        held = P.all_reduce(flags, mesh.dp_group, op="dp:has_grad").tolist()  # a gradient on any replica
        reduce_gradients([p for p, h in zip(params, held) if h > 0], weight, mesh)
        self._update()
        loss = res["loss"]
        parts = [loss] + [torch.as_tensor(res[k], dtype=loss.dtype, device=loss.device) for k in _TERMS]
        total = P.all_reduce(torch.stack(parts) * weight, mesh.dp_group, op="dp:loss")
        res["loss"] = total[0]
        res.update({k: float(v) for k, v in zip(_TERMS, total[1:])})
        return res

    def _forward_backward(self, feats: Mapping[str, Any], draws: Any) -> dict[str, Any]:
        from twinshard.pair.reference.sampler import CounterDraws

        args, model = self.args, self.model
        rec = recycling_steps_at(args, self.global_step)
        steps = sampling_steps_at(args, self.global_step)
        draws = CounterDraws(self.seed, global_step=self.global_step) if draws is None else draws
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        out = model(
            feats,
            recycling_steps=rec,
            num_sampling_steps=steps,
            multiplicity_diffusion_train=args.diffusion_multiplicity,
            diffusion_samples=args.diffusion_samples,
            draws=draws,
            dropout_seed=dropout_seed(self.seed, self.global_step),
        )
        disto = self._term("distogram", args.distogram_loss_weight, out, feats)
        diff = self._term("diffusion", args.diffusion_loss_weight, out, feats)
        conf = self._term("confidence", args.confidence_loss_weight, out, feats)
        loss = (
            args.confidence_loss_weight * conf
            + args.diffusion_loss_weight * diff
            + args.distogram_loss_weight * disto
        )
        loss.backward()

        def val(x):
            return float(x.detach()) if torch.is_tensor(x) else float(x)

        return {
            "loss": loss.detach(),
            "distogram": val(disto),
            "diffusion": val(diff),
            "confidence": val(conf),
            "recycling_steps": rec,
            "sampling_steps": steps,
            "out": out,
        }

    # checkpoints ------------------------------------------------------------------------------
    def checkpoint(self) -> dict[str, Any]:
        """The Lightning checkpoint dict (module docstring)."""
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        for k, v in state.items():
            if isinstance(v, DTensor):
                raise TypeError(
                    f"checkpoint entry {k!r} is a DTensor: parameters must be replicated plain tensors"
                )
        hp = dict(self.hparams or {})
        hp["training_args"] = {**dict(hp.get("training_args") or {}), **self.args.as_training_args()}
        for k in ("no_random_recycling_training", "use_ema", "ema_decay"):
            hp[k] = getattr(self.args, k)
        ckpt: dict[str, Any] = {
            "epoch": self.epoch,
            "global_step": self.global_step,
            "pytorch-lightning_version": LIGHTNING_VERSION,
            "state_dict": state,
            "loops": None,
            "callbacks": {},
            "optimizer_states": [self.optimizer.state_dict()],
            "lr_schedulers": [],
            "hyper_parameters": hp,
            "twinshard": {"seed": self.seed},
        }
        if self.ema is not None and self.ema.ema_weights is not None:
            ema = self.ema.state_dict()
            ckpt["callbacks"]["EMA"] = ema
            ckpt["ema"] = ema  # where boltz's EMA.on_save_checkpoint writes (and on_load reads) it
        return ckpt

    def save(self, path: str | os.PathLike) -> None:
        """Rank 0 writes :meth:`checkpoint` atomically; every rank waits for it."""
        ckpt = self.checkpoint()
        if _rank() == 0:
            atomic_write(path, lambda f: torch.save(ckpt, f))
        if dist.is_initialized():
            dist.barrier()

    def load_checkpoint(self, ckpt: Mapping[str, Any]) -> None:
        """Load a Lightning checkpoint dict (ours or boltz's): the weights strict, the AdamW state,
        the EMA state (``"ema"``, else ``callbacks["EMA"]``), ``global_step``, ``epoch``, the seed."""
        self.model.load_state_dict(ckpt["state_dict"], strict=True)
        opt = ckpt.get("optimizer_states") or []
        if len(opt) != 1:
            raise ValueError(f"a checkpoint with one optimizer state expected, got {len(opt)}")
        self.optimizer.load_state_dict(opt[0])
        ema = ckpt.get("ema") or (ckpt.get("callbacks") or {}).get("EMA")
        if self.ema is not None:
            if ema is None:
                raise ValueError("the checkpoint holds no EMA state but the run uses EMA (use_ema)")
            self.ema.load_state_dict(ema)
        self.global_step, self.epoch = int(ckpt["global_step"]), int(ckpt.get("epoch", 0))
        self.seed = int((ckpt.get("twinshard") or {}).get("seed", self.seed))
        with torch.no_grad():
            checksum = tuple(float(p.double().sum()) for p in self.model.parameters())
        if dist.is_initialized() and dist.get_world_size() > 1:
            agree_scalars({"global_step": self.global_step, "checksum": checksum}, "Boltz2Training.load")

    def load(self, path: str | os.PathLike) -> None:
        """Rank 0 reads ``path``, broadcasts it; every rank loads it (:meth:`load_checkpoint`)."""
        box: list[Any] = [None]
        if _rank() == 0:
            box[0] = torch.load(path, map_location="cpu", weights_only=False)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        self.load_checkpoint(box[0])
