"""The whole-trunk oracle: boltz's own ``Boltz2`` (boltz 2.2.1), built offline, run up to the distogram.

Importable by the tests in this folder (``from boltz2_model import build_boltz2, boltz2_trunk``);
needs the ``boltz`` package (``.venv-boltz``, tests/interop/README.md).

- :func:`build_boltz2` constructs ``boltz.model.models.boltz2.Boltz2`` with small sizes, the
  released Boltz-2 checkpoint's trunk flags (:data:`twinshard.pair.feature_contract.RELEASED_BOLTZ2`:
  fix_sym_check, cyclic_pos_enc, bond_type_feature, the four embedder ``add_*`` flags, paired MSA
  feature, v2 Pairformer, ``TemplateV2Module``; the three atom-feature flags default False as in
  the release, each can be switched on), dropout 0 everywhere (Pairformer, MSA and its pair
  stack, templates), no affinity heads (the confidence module on request), no validators; then every parameter (the
  zero-initialised ones too, and the structure module's, which the trunk never reads) is
  overwritten with seeded ``shift + scale * N(0, 1)`` values, and the model is cast to ``dtype``.
- :func:`boltz2_trunk` runs ``Boltz2.forward`` ITSELF (nothing re-implemented) in training mode,
  so that ``forward``'s ``torch.set_grad_enabled(self.training and
  self.structure_prediction_training)`` keeps autograd on (only the last recycling cycle carries
  gradients, as in Boltz), and stops it right after the distogram: a forward hook on
  ``distogram_module`` raises a private exception carrying the logits; ``s`` and ``z`` are the
  last ``pairformer_module`` output (z is also the distogram's input), ``s_inputs`` the
  ``input_embedder`` output. Training mode differs from Boltz's evaluation path only in what is
  off here: dropout (p = 0, its masks are exact ones), MSA subsampling (off), activation
  checkpointing (off), and the inference chunking that Boltz enables for N > 384 (equal up to
  round-off; our sizes are below it). In fp64 Boltz's ``.float()`` casts are kept in fp64 for the
  duration of the call (the ``boltz_fp64`` idea of test_boltz_reference.py, extended to integer
  and bool tensors, which Boltz turns into activations with ``.float()``: ``res_type``,
  ``atom_to_token``, masks). Zero templates (T = 0, valid in our contract) make boltz 2.2.1's
  template module raise (its Pairformer cannot reshape an empty batch) and never reach it from
  Boltz's featuriser, which emits one dummy template instead; so for T = 0 :func:`boltz2_trunk`
  hands ``Boltz2`` exactly that: the tensors of boltz's ``load_dummy_templates_features(1, N)``
  (featurizerv2; written out here because that module imports numba), batched and in the model's
  dtype (a dummy template adds exactly zero to z).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import Any

import torch
from boltz.model.models.boltz2 import Boltz2

from twinshard.pair.feature_contract import (
    ATOM_NAME_CHARS,
    ATOM_NAME_CLASSES,
    NUM_BACKBONE_FEATS,
    NUM_ELEMENTS,
    NUM_MOL_TYPES,
    NUM_TOKENS,
    RELEASED_BOLTZ2,
)

__all__ = [
    "TRUNK_MODULES",
    "boltz2_trunk",
    "boltz_dummy_templates",
    "boltz_float_is",
    "build_boltz2",
    "trunk_parameters",
]

# Boltz2's top-level submodules that the trunk (forward up to the distogram) runs. Written here
# from Boltz2.forward, not imported from twinshard.pair.reference.trunk.TRUNK_PREFIXES: the oracle
# keeps no code of what it checks (the tests compare the two name lists).
TRUNK_MODULES = (
    "input_embedder",
    "s_init",
    "z_init_1",
    "z_init_2",
    "rel_pos",
    "token_bonds",
    "token_bonds_type",
    "contact_conditioning",
    "s_norm",
    "z_norm",
    "s_recycle",
    "z_recycle",
    "template_module",
    "msa_module",
    "pairformer_module",
    "distogram_module",
)


def _atom_feature_dim(
    use_no_atom_char: bool, use_atom_backbone_feat: bool, use_residue_feats_atoms: bool
) -> int:
    dim = 3 + 1 + NUM_ELEMENTS
    if not use_no_atom_char:
        dim += ATOM_NAME_CHARS * ATOM_NAME_CLASSES
    if use_atom_backbone_feat:
        dim += NUM_BACKBONE_FEATS
    if use_residue_feats_atoms:
        dim += NUM_TOKENS + 1 + NUM_MOL_TYPES
    return dim


def build_boltz2(
    seed: int = 0,
    token_s: int = 8,
    token_z: int = 8,
    atom_s: int = 8,
    atom_z: int = 4,
    msa_blocks: int = 1,
    pairformer_blocks: int = 1,
    template_blocks: int = 1,
    use_templates: bool = True,
    *,
    msa_s: int = 8,
    template_dim: int = 8,
    num_bins: int = 8,
    atom_encoder_depth: int = 1,
    atom_encoder_heads: int = 2,
    pairformer_heads: int = 2,
    pairwise_head_width: int = 4,
    pairwise_num_heads: int = 2,
    flags: Mapping[str, Any] | None = None,
    confidence_model_args: Mapping[str, Any] | None = None,
    diffusion_process_args: Mapping[str, Any] | None = None,
    scale: float = 0.3,
    shift: float = 0.05,
    dtype: torch.dtype = torch.float64,
) -> Boltz2:
    """boltz's own ``Boltz2``, small, offline, dropout 0, all parameters random from ``seed``.

    ``flags`` overrides the released checkpoint's flags (keys of :data:`RELEASED_BOLTZ2`: e.g.
    ``{"use_atom_backbone_feat": True}``, ``{"use_templates_v2": False}``, or nested
    ``{"embedder_args": {"add_cyclic_flag": False}}``); ``atom_feature_dim`` follows the atom flags.
    Parameters: ``shift + scale * N(0, 1)``, seeded, then cast to ``dtype``.

    ``confidence_model_args`` (Boltz2's keyword of that name) builds the confidence module too
    (``confidence_prediction=True``; without it there is none); ``diffusion_process_args`` are the
    sampler's (``AtomDiffusion``'s keywords, e.g. ``boltz predict``'s Boltz-2 parameters). Steering
    is off (``steering_args`` with its three flags False: Boltz's sampler reads them).
    """
    cfg: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in RELEASED_BOLTZ2.items()}
    for key, value in (flags or {}).items():
        if isinstance(value, Mapping):
            cfg[key] = {**cfg.get(key, {}), **value}
        else:
            cfg[key] = value
    cfg["use_templates"] = use_templates
    atom_flags = {
        k: bool(cfg[k]) for k in ("use_no_atom_char", "use_atom_backbone_feat", "use_residue_feats_atoms")
    }
    model = Boltz2(
        atom_s=atom_s,
        atom_z=atom_z,
        token_s=token_s,
        token_z=token_z,
        num_bins=num_bins,
        training_args={},
        validation_args={},
        embedder_args={
            "atom_encoder_depth": atom_encoder_depth,
            "atom_encoder_heads": atom_encoder_heads,
            **cfg["embedder_args"],
        },
        msa_args={
            "msa_s": msa_s,
            "msa_blocks": msa_blocks,
            "msa_dropout": 0.0,
            "z_dropout": 0.0,
            "pairwise_head_width": pairwise_head_width,
            "pairwise_num_heads": pairwise_num_heads,
            **cfg["msa_args"],
        },
        pairformer_args={
            "num_blocks": pairformer_blocks,
            "num_heads": pairformer_heads,
            "dropout": 0.0,
            "pairwise_head_width": pairwise_head_width,
            "pairwise_num_heads": pairwise_num_heads,
            "post_layer_norm": False,
            "v2": True,
        },
        template_args={
            "template_dim": template_dim,
            "template_blocks": template_blocks,
            "dropout": 0.0,
            "pairwise_head_width": pairwise_head_width,
            "pairwise_num_heads": pairwise_num_heads,
        },
        score_model_args={
            "sigma_data": 16,
            "dim_fourier": 4,
            "atom_encoder_depth": 1,
            "atom_encoder_heads": 1,
            "token_transformer_depth": 1,
            "token_transformer_heads": 1,
            "atom_decoder_depth": 1,
            "atom_decoder_heads": 1,
            "conditioning_transition_layers": 1,
        },
        diffusion_process_args=dict(diffusion_process_args or {}),
        diffusion_loss_args={},
        confidence_prediction=confidence_model_args is not None,
        confidence_model_args=None if confidence_model_args is None else dict(confidence_model_args),
        steering_args={
            "fk_steering": False,
            "physical_guidance_update": False,
            "contact_guidance_update": False,
        },
        validate_structure=False,
        atom_feature_dim=_atom_feature_dim(**atom_flags),
        atoms_per_window_queries=cfg["atoms_per_window_queries"],
        atoms_per_window_keys=cfg["atoms_per_window_keys"],
        fix_sym_check=cfg["fix_sym_check"],
        cyclic_pos_enc=cfg["cyclic_pos_enc"],
        bond_type_feature=cfg["bond_type_feature"],
        use_templates=use_templates,
        use_templates_v2=cfg["use_templates_v2"],
        **atom_flags,
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * scale + shift)
    return model.to(dtype)


def trunk_parameters(model: Boltz2) -> dict[str, torch.nn.Parameter]:
    """The trainable parameters of the trunk modules, by name (FourierEmbedding's frozen one excluded)."""
    return {
        name: p
        for name, p in model.named_parameters()
        if name.split(".", 1)[0] in TRUNK_MODULES and p.requires_grad
    }


@contextlib.contextmanager
def boltz_float_is(dtype: torch.dtype):
    """While open, ``Tensor.float()`` casts to ``dtype`` (fp64: Boltz's casts keep fp64; integer
    and bool tensors, which Boltz turns into activations with ``.float()``, become fp64 too)."""
    if dtype == torch.float32:
        yield
        return
    orig = torch.Tensor.float

    def to_dtype(self, *args, **kwargs):
        return self.to(dtype)

    torch.Tensor.float = to_dtype
    try:
        yield
    finally:
        torch.Tensor.float = orig


def boltz_dummy_templates(token_shape: tuple[int, int], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Boltz's "no templates" input, batched: featurizerv2.load_dummy_templates_features(tdim=1, N)
    is every template feature zero (T = 1) except ``template_restype``, the one-hot of class 0."""
    b, n = token_shape
    z = functools.partial(torch.zeros, dtype=dtype)
    restype = torch.zeros(b, 1, n, NUM_TOKENS, dtype=torch.int64)
    restype[..., 0] = 1
    return {
        "template_restype": restype,
        "template_frame_rot": z(b, 1, n, 3, 3),
        "template_frame_t": z(b, 1, n, 3),
        "template_cb": z(b, 1, n, 3),
        "template_ca": z(b, 1, n, 3),
        "template_mask_cb": z(b, 1, n),
        "template_mask_frame": z(b, 1, n),
        "template_mask": z(b, 1, n),
        "query_to_template": torch.zeros(b, 1, n, dtype=torch.int64),
        "visibility_ids": z(b, 1, n),
    }


class _Stop(Exception):
    """Raised by the distogram hook to leave Boltz2.forward right after the distogram."""

    def __init__(self, pdistogram: torch.Tensor):
        super().__init__("stopped after the distogram")
        self.pdistogram = pdistogram


def boltz2_trunk(
    model: Boltz2, feats: Mapping[str, torch.Tensor], recycling_steps: int = 0, *, eval_mode: bool = False
) -> dict[str, torch.Tensor]:
    """Run ``Boltz2.forward`` itself up to the distogram; return ``s``, ``z``, ``pdistogram``, ``s_inputs``.

    Gradients are on (training mode with dropout 0; only the last recycling cycle carries them,
    Boltz's own rule). ``eval_mode=True`` runs Boltz's evaluation path instead (no gradients,
    inference chunking), to show both agree. ``feats`` is passed to Boltz as given (a dict
    subclass that records reads works), except that T = 0 templates become Boltz's dummy. The
    model's dtype decides the ``.float()`` policy (:func:`boltz_float_is`).
    """
    captured: dict[str, Any] = {}

    def on_embed(_m, _args, out):
        captured["s_inputs"] = out

    def on_pairformer(_m, _args, out):
        captured["s"], captured["z"] = out

    def on_distogram(_m, args, out):
        captured["z_disto"] = args[0]
        raise _Stop(out)

    dtype = next(model.parameters()).dtype
    if model.use_templates and feats["template_restype"].shape[1] == 0:
        feats = {**feats, **boltz_dummy_templates(tuple(feats["token_pad_mask"].shape), dtype)}
    hooks = [
        model.input_embedder.register_forward_hook(on_embed),
        model.pairformer_module.register_forward_hook(on_pairformer),
        model.distogram_module.register_forward_hook(on_distogram),
    ]
    was_training = model.training
    model.train(not eval_mode)
    try:
        with boltz_float_is(dtype):
            model(feats, recycling_steps=recycling_steps)
    except _Stop as stop:
        pdistogram = stop.pdistogram
    else:  # pragma: no cover - forward always reaches the distogram
        raise RuntimeError("Boltz2.forward returned without running distogram_module")
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    if captured["z_disto"] is not captured["z"]:
        raise RuntimeError("the distogram did not read the last Pairformer output")
    return {
        "s": captured["s"],
        "z": captured["z"],
        "pdistogram": pdistogram,
        "s_inputs": captured["s_inputs"],
    }
