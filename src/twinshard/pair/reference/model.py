"""The whole Boltz-2 inference forward (Boltz-2's ``Boltz2.forward`` in evaluation mode; AlphaFold3
supplement, Algorithm 1), serial: the oracle of ``twinshard.pair.layers.model.CPBoltz2Model``.

From a Boltz-2 feature dict (``twinshard.pair.feature_contract``, plus ``frames_idx`` for the
confidence module)::

    s_inputs, s, z, pdistogram, relpos <- trunk(feats, recycling_steps)     # Boltz2Trunk.run_trunk
    q, c, to_keys, atom_enc_bias, atom_dec_bias, token_trans_bias
          <- diffusion_conditioning(s, z, relpos, feats)
    sample_atom_coords [B m, A, 3]
          <- structure_module.sample(atom_mask, num_sampling_steps, multiplicity = diffusion_samples,
                                     max_parallel_samples, s_trunk = s, s_inputs, feats, conditioning)
    confidence <- confidence_module(s_inputs, s, z, x_pred = sample_atom_coords, feats,
                                    pdistogram[:, :, :, 0], multiplicity = diffusion_samples)

as ``Boltz2.forward`` runs it with ``model.eval()``: the trunk, the conditioning and the sampler
without gradients; the confidence module in the caller's grad mode on detached inputs (``s_inputs``,
``s``, ``z``, the coordinates and the first distogram's logits), ``run_sequentially`` False.
Boltz's ``s.float()`` / ``s_inputs.float()`` casts in front of the sampler are identities for an
fp32 model; here the sampler runs in the trunk's dtype (an fp64 model stays fp64).

Random draws: the sampler's (``reference.sampler``): ``draws=None`` the counter-based
:class:`~twinshard.pair.reference.sampler.CounterDraws` of ``seed`` (equal on every grid), or a
draw source such as :class:`~twinshard.pair.reference.sampler.GivenDraws` (Boltz's ``torch.randn``
draws handed in, the ``"boltz"`` convention of the parity tests).

Names and registration order are Boltz2's (``input_embedder ... pairformer_module`` of the trunk,
then ``diffusion_conditioning``, ``structure_module``, ``distogram_module``, ``confidence_module``),
so a whole Boltz-2 ``state_dict`` loads strict. Not supported (``ModelConfig.from_hparams`` raises):
the affinity modules (``affinity_prediction``), the B-factor head (``predict_bfactor``),
``skip_run_structure`` / ``run_trunk_and_structure=False``, compiled modules, atom-level confidence,
steering (the sampler raises). In training mode ``forward`` is Boltz's training forward
(:meth:`Boltz2Model.training_forward`: ``multiplicity_diffusion_train``, the true ``coords``); the
losses, the optimizer and the EMA are ``twinshard.pair.train_boltz2``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from twinshard.comm.amp import fp32_region
from twinshard.pair.reference.trunk import Boltz2Trunk, TrunkConfig, build_trunk

__all__ = ["MODEL_PREFIXES", "Boltz2Model", "ModelConfig", "model_parts"]

# Boltz2's top-level modules after the trunk's ``pairformer_module``, in registration order
# (boltz/model/models/boltz2.py __init__); ``bfactor_module`` and the affinity modules are not
# supported.
MODEL_PREFIXES = ("diffusion_conditioning", "structure_module", "distogram_module", "confidence_module")

_UNSUPPORTED = {
    "affinity_prediction": "the affinity modules are not supported: build the model with affinity_prediction=False",
    "predict_bfactor": "the B-factor head is not supported: build the model with predict_bfactor=False",
    "skip_run_structure": "skip_run_structure (confidence on given coordinates) is not supported",
    "compile_structure": "a compiled structure module is not supported: compile_structure=False",
    "compile_confidence": "a compiled confidence module is not supported: compile_confidence=False",
    "compile_pairformer": "a compiled Pairformer is not supported: compile_pairformer=False",
    "compile_msa": "a compiled MSA module is not supported: compile_msa=False",
    "compile_templates": "a compiled template module is not supported: compile_templates=False",
}


@dataclass(frozen=True)
class ModelConfig:
    """Boltz2's hyperparameters that the inference forward reads (``Boltz2.__init__``'s keyword
    arguments; :meth:`from_hparams` reads them from a model's ``hparams``)."""

    trunk: TrunkConfig
    score_model_args: dict[str, Any]
    diffusion_process_args: dict[str, Any] = field(default_factory=dict)
    confidence_prediction: bool = True
    confidence_model_args: dict[str, Any] | None = None
    token_level_confidence: bool = True
    steering_args: dict[str, Any] | None = None

    @classmethod
    def from_hparams(cls, hparams: Mapping[str, Any]) -> ModelConfig:
        """The model's settings from a ``Boltz2`` model's ``hparams``; raises ``NotImplementedError``
        naming a setting the model does not support (affinity, B-factors, compiled modules, ...)."""
        for key, why in _UNSUPPORTED.items():
            if hparams.get(key):
                raise NotImplementedError(f"Boltz2Model: {key}=True: {why}")
        if not hparams.get("run_trunk_and_structure", True):
            raise NotImplementedError("Boltz2Model: run_trunk_and_structure=False is not supported")
        conf = hparams.get("confidence_model_args")
        return cls(
            trunk=TrunkConfig.from_hparams(hparams),
            score_model_args=dict(hparams["score_model_args"]),
            diffusion_process_args=dict(hparams.get("diffusion_process_args") or {}),
            confidence_prediction=bool(hparams.get("confidence_prediction", True)),
            confidence_model_args=None if conf is None else dict(conf),
            token_level_confidence=bool(hparams.get("token_level_confidence", True)),
            steering_args=None if hparams.get("steering_args") is None else dict(hparams["steering_args"]),
        )


def model_parts() -> dict[str, type]:
    """The serial classes of the modules after the trunk."""
    from twinshard.pair.reference.confidence import ConfidenceModule
    from twinshard.pair.reference.diffusion import DiffusionConditioning
    from twinshard.pair.reference.sampler import AtomDiffusion

    return {"conditioning": DiffusionConditioning, "sampler": AtomDiffusion, "confidence": ConfidenceModule}


class Boltz2Model(Boltz2Trunk):
    """The serial Boltz-2 model, inference (module docstring). ``forward(feats, recycling_steps=0,
    num_sampling_steps=None, diffusion_samples=1, max_parallel_samples=None,
    run_confidence_sequentially=False, *, draws=None, seed=0) -> dict`` with Boltz's keys:
    ``pdistogram``, ``s``, ``z``, ``sample_atom_coords [B m, A, 3]``, ``diff_token_repr`` (None) and,
    with confidence, ``pae_logits``, ``pde_logits``, ``plddt_logits``, ``resolved_logits``, ``pae``,
    ``pde``, ``plddt``, ``complex_plddt``, ``complex_iplddt``, ``complex_pde``, ``complex_ipde``,
    ``ptm``, ``iptm``, ``ligand_iptm``, ``protein_iptm``, ``pair_chains_iptm``."""

    def __init__(self, config: ModelConfig, convention: str = "boltz"):
        nn.Module.__init__(self)
        cfg = config.trunk
        parts = self.model_parts()
        build_trunk(self, self.parts(), cfg, convention, distogram=False)
        self.model_config = config
        sm = config.score_model_args
        self.diffusion_conditioning = parts["conditioning"](
            token_s=cfg.token_s,
            token_z=cfg.token_z,
            atom_s=cfg.atom_s,
            atom_z=cfg.atom_z,
            atoms_per_window_queries=cfg.atoms_per_window_queries,
            atoms_per_window_keys=cfg.atoms_per_window_keys,
            atom_encoder_depth=sm["atom_encoder_depth"],
            atom_encoder_heads=sm["atom_encoder_heads"],
            token_transformer_depth=sm["token_transformer_depth"],
            token_transformer_heads=sm["token_transformer_heads"],
            atom_decoder_depth=sm["atom_decoder_depth"],
            atom_decoder_heads=sm["atom_decoder_heads"],
            atom_feature_dim=cfg.atom_feature_dim,
            conditioning_transition_layers=sm["conditioning_transition_layers"],
            use_no_atom_char=cfg.use_no_atom_char,
            use_atom_backbone_feat=cfg.use_atom_backbone_feat,
            use_residue_feats_atoms=cfg.use_residue_feats_atoms,
        )
        self.structure_module = parts["sampler"](
            score_model_args={
                "token_s": cfg.token_s,
                "atom_s": cfg.atom_s,
                "atoms_per_window_queries": cfg.atoms_per_window_queries,
                "atoms_per_window_keys": cfg.atoms_per_window_keys,
                **sm,
            },
            **config.diffusion_process_args,
        )
        self.distogram_module = self.parts().distogram(cfg.token_z, cfg.num_bins)
        if config.confidence_prediction:
            self.confidence_module = parts["confidence"](
                cfg.token_s,
                cfg.token_z,
                token_level_confidence=config.token_level_confidence,
                bond_type_feature=cfg.bond_type_feature,
                fix_sym_check=cfg.fix_sym_check,
                cyclic_pos_enc=cfg.cyclic_pos_enc,
                conditioning_cutoff_min=cfg.conditioning_cutoff_min,
                conditioning_cutoff_max=cfg.conditioning_cutoff_max,
                convention=convention,
                **(config.confidence_model_args or {}),
            )

    @classmethod
    def model_parts(cls) -> dict[str, type]:
        return model_parts()

    # -- the few operations that differ between the serial model and its twin ---------------------
    def detached(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    def cast(self, x: Any, dtype: torch.dtype) -> Any:
        """``x`` in ``dtype`` when it is a floating tensor (other values as they are)."""
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    def first_distogram(self, pdistogram: torch.Tensor) -> torch.Tensor:
        """``pdistogram[:, :, :, 0]`` (Boltz: the confidence reads the first distogram only)."""
        return pdistogram[:, :, :, 0]

    def model_scalars(self, scalars: dict[str, Any]) -> None:
        """Serial: nothing to agree on (the twin checks these are equal on every rank first)."""

    def training_coords(self, coords: torch.Tensor, multiplicity: int) -> torch.Tensor:
        """Boltz's ``coords [B, K, A, 3] -> [B K, A, 3]``, each conformer repeated ``m / K`` times
        (``K`` in ``(1, m)``): the rows ``b m + j`` of the training forward."""
        b, k = coords.shape[:2]
        return coords.reshape((b * k,) + tuple(coords.shape[2:])).repeat_interleave(multiplicity // k, 0)

    def with_feature(self, feats: Mapping[str, Any], name: str, value: Any) -> dict[str, Any]:
        """A copy of ``feats`` with ``name`` replaced (Boltz mutates its batch in place)."""
        return {**feats, name: value}

    def conditioning(self, s: Any, z: Any, rel: Any, feats: Mapping[str, Any]) -> dict[str, Any]:
        """The diffusion conditioning of the trunk's ``s``, ``z`` and relative positions ``rel``, as
        Boltz's dict (``q, c, to_keys, atom_enc_bias, atom_dec_bias, token_trans_bias``)."""
        parts = self.diffusion_conditioning(s, z, rel, feats)
        return dict(zip(("q", "c", "to_keys", "atom_enc_bias", "atom_dec_bias", "token_trans_bias"), parts))

    def sample(
        self,
        s: Any,
        s_inputs: Any,
        feats: Mapping[str, Any],
        conditioning: Mapping[str, Any],
        num_sampling_steps: int | None,
        diffusion_samples: int,
        max_parallel_samples: int | None,
        draws: Any,
        seed: int,
    ) -> dict[str, Any]:
        """The sampler as ``Boltz2.forward`` runs it: autocast off, on ``.float()`` inputs (``s``,
        ``s_inputs``, the conditioning); here in the structure module's parameter dtype (fp32
        under bf16-mixed, as Boltz; the model's dtype otherwise, so fp64 stays fp64)."""
        sd = next(self.structure_module.parameters()).dtype
        with fp32_region(s.device.type):
            return self.structure_module.sample(
                feats["atom_pad_mask"],
                num_sampling_steps,
                int(diffusion_samples),
                max_parallel_samples,
                self.model_config.steering_args,
                draws=draws,
                seed=seed,
                s_trunk=self.cast(s, sd),
                s_inputs=self.cast(s_inputs, sd),
                feats=feats,
                diffusion_conditioning={k: self.cast(v, sd) for k, v in conditioning.items()},
            )

    def confidence(
        self,
        s_inputs: Any,
        s: Any,
        z: Any,
        result: Mapping[str, Any],
        feats: Mapping[str, Any],
        diffusion_samples: int,
        run_sequentially: bool,
    ) -> dict[str, Any]:
        """The confidence module on detached inputs (the samples' coordinates, the first
        distogram's logits), as ``Boltz2.forward``; ``{}`` without confidence prediction."""
        if not self.model_config.confidence_prediction:
            return {}
        return self.confidence_module(
            self.detached(s_inputs),
            self.detached(s),
            self.detached(z),
            self.detached(result["sample_atom_coords"]),
            feats,
            self.detached(self.first_distogram(result["pdistogram"])),
            multiplicity=int(diffusion_samples),
            run_sequentially=run_sequentially,
        )

    def training_forward(
        self,
        feats: Mapping[str, torch.Tensor],
        recycling_steps: int,
        num_sampling_steps: int | None,
        multiplicity_diffusion_train: int,
        diffusion_samples: int,
        max_parallel_samples: int | None,
        run_confidence_sequentially: bool,
        draws: Any,
        seed: int,
        dropout_seed: int | None,
    ) -> dict[str, Any]:
        """``Boltz2.forward`` in training mode (``structure_prediction_training``): the trunk (the
        last recycling cycle with gradients), the diffusion conditioning with gradients, with
        confidence a ``sample`` without gradients (its confidence inputs), the structure module's
        training forward on the true coordinates (``multiplicity_diffusion_train`` samples per
        element) and the confidence module on detached inputs. Returns Boltz's keys plus
        ``"feats_train"``: ``feats`` with ``coords`` as Boltz leaves its batch (``[B m, A, 3]``),
        what the diffusion loss reads."""
        name = type(self).__name__
        m = int(multiplicity_diffusion_train)
        coords = feats.get("coords")
        if coords is None or coords.dim() != 4:
            raise ValueError(f"{name}: training needs feats['coords'] [B, K, A, 3] (the true coordinates)")
        k = int(coords.shape[1])
        if m < 1 or k not in (1, m):
            raise ValueError(
                f"{name}: coords has K = {k} conformers; multiplicity_diffusion_train = {m} needs K in (1, m)"
            )
        if self.model_config.confidence_prediction and k != 1:
            raise ValueError(f"{name}: confidence training supports one conformer (K = 1), got K = {k}")
        out = self.run_trunk(feats, recycling_steps, dropout_seed, keep_rel_pos=True)
        s_inputs, s, z = out["s_inputs"], out["s"], out["z"]  # the last cycle's, with gradients
        conditioning = self.conditioning(s, z, out["relative_position_encoding"], feats)
        result: dict[str, Any] = {"pdistogram": out["pdistogram"], "s": s, "z": z}
        sample_kw = (num_sampling_steps, diffusion_samples, max_parallel_samples, draws, seed)
        if self.model_config.confidence_prediction:
            with torch.no_grad():
                result.update(self.sample(s, s_inputs, feats, conditioning, *sample_kw))
        feats_train = self.with_feature(feats, "coords", self.training_coords(coords, m))
        sd = next(self.structure_module.parameters()).dtype
        with fp32_region(s.device.type):  # Boltz: autocast off, s.float() and s_inputs.float()
            result.update(
                self.structure_module(
                    self.cast(s_inputs, sd),
                    self.cast(s, sd),
                    feats_train,
                    {k: self.cast(v, sd) for k, v in conditioning.items()},
                    m,
                    draws=draws,
                    seed=seed,
                )
            )
        result["feats_train"] = feats_train
        result.update(
            self.confidence(s_inputs, s, z, result, feats, diffusion_samples, run_confidence_sequentially)
        )
        return result

    def forward(  # type: ignore[override]
        self,
        feats: Mapping[str, torch.Tensor],
        recycling_steps: int = 0,
        num_sampling_steps: int | None = None,
        diffusion_samples: int = 1,
        max_parallel_samples: int | None = None,
        run_confidence_sequentially: bool = False,
        *,
        draws: Any = None,
        seed: int = 0,
        multiplicity_diffusion_train: int = 1,
        dropout_seed: int | None = None,
    ) -> dict[str, Any]:
        name = type(self).__name__
        self.model_scalars(
            {
                "multiplicity_diffusion_train": int(multiplicity_diffusion_train),
                "dropout_seed": dropout_seed,
                "training": self.training,
                "recycling_steps": int(recycling_steps),
                "num_sampling_steps": num_sampling_steps,
                "diffusion_samples": int(diffusion_samples),
                "max_parallel_samples": max_parallel_samples,
                "run_confidence_sequentially": bool(run_confidence_sequentially),
            }
        )
        if int(diffusion_samples) != diffusion_samples or diffusion_samples < 1:
            raise ValueError(f"{name}: diffusion_samples must be an integer >= 1, got {diffusion_samples!r}")
        if self.training:  # Boltz2.forward in training mode (training_forward)
            return self.training_forward(
                feats,
                recycling_steps,
                num_sampling_steps,
                multiplicity_diffusion_train,
                diffusion_samples,
                max_parallel_samples,
                run_confidence_sequentially,
                draws,
                seed,
                dropout_seed,
            )
        with torch.no_grad():  # Boltz2.forward: set_grad_enabled(training and ...) is off in eval
            out = self.run_trunk(feats, recycling_steps, None, keep_rel_pos=True)
            s_inputs, s, z = out["s_inputs"], out["s"], out["z"]
            rel = out["relative_position_encoding"]
            conditioning = self.conditioning(s, z, rel, feats)
            result: dict[str, Any] = {"pdistogram": out["pdistogram"], "s": s, "z": z}
            result.update(
                self.sample(
                    s,
                    s_inputs,
                    feats,
                    conditioning,
                    num_sampling_steps,
                    diffusion_samples,
                    max_parallel_samples,
                    draws,
                    seed,
                )
            )
        result.update(
            self.confidence(s_inputs, s, z, result, feats, diffusion_samples, run_confidence_sequentially)
        )
        return result
