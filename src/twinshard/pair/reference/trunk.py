"""The Boltz-2 trunk (AlphaFold3 supplement, Algorithm 1 lines 1-14; Boltz-2's ``Boltz2.forward`` up to
the distogram), serial: the oracle of ``twinshard.pair.layers.trunk.CPBoltz2Trunk``.

From a Boltz-2 feature dict (``twinshard.pair.feature_contract``)::

    s_inputs <- input_embedder(feats)                                  # atoms -> tokens
    s_init   <- s_init(s_inputs)
    z_init   <- z_init_1(s_inputs)_i + z_init_2(s_inputs)_j + rel_pos(feats)
                + token_bonds(token_bonds) [+ token_bonds_type(type_bonds)] + contact_conditioning(feats)
    s, z     <- 0, 0
    for cycle in 0..recycling_steps:                                   # gradients in the last only
        s <- s_init + s_recycle(s_norm(s))
        z <- z_init + z_recycle(z_norm(z))
        z <- z + template_module(z, feats, pair_mask)                   # if use_templates
        z <- z + msa_module(z, s_inputs, feats)
        s, z <- pairformer_module(s, z, mask, pair_mask)
    pdistogram <- distogram_module(z)

Names and registration order are Boltz2's top-level ones (``input_embedder, s_init, z_init_1,
z_init_2, rel_pos, token_bonds, [token_bonds_type], contact_conditioning, s_norm, z_norm,
s_recycle, z_recycle, [template_module], msa_module, pairformer_module, distogram_module``), so the
trunk part of a Boltz-2 ``state_dict`` (:func:`trunk_state_dict`) loads unchanged (strict). As in
Boltz, only the last recycling cycle carries gradients (the earlier cycles run under ``no_grad``);
``recycling_steps`` is a control scalar.

The parts come from :class:`TrunkParts` (the serial classes here, their CP twins in
``pair.layers.trunk``), so the serial trunk and its twin are built by one function.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "TRUNK_PREFIXES",
    "Boltz2Trunk",
    "TrunkConfig",
    "TrunkParts",
    "build_trunk",
    "serial_parts",
    "trunk_state_dict",
]

# Boltz2's top-level modules that make up the trunk, in registration order.
TRUNK_PREFIXES = (
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


@dataclass(frozen=True)
class TrunkConfig:
    """The trunk part of Boltz2's hyperparameters (the keyword arguments of ``Boltz2.__init__``;
    :meth:`from_hparams` reads them from a model's ``hparams``). Defaults are Boltz2's."""

    atom_s: int
    atom_z: int
    token_s: int
    token_z: int
    num_bins: int = 64
    atom_feature_dim: int = 128
    atoms_per_window_queries: int = 32
    atoms_per_window_keys: int = 128
    embedder_args: dict[str, Any] = field(default_factory=dict)
    msa_args: dict[str, Any] = field(default_factory=dict)
    pairformer_args: dict[str, Any] = field(default_factory=dict)
    template_args: dict[str, Any] | None = None
    use_templates: bool = False
    use_templates_v2: bool = False
    fix_sym_check: bool = False
    cyclic_pos_enc: bool = False
    bond_type_feature: bool = False
    use_no_atom_char: bool = False
    use_atom_backbone_feat: bool = False
    use_residue_feats_atoms: bool = False
    conditioning_cutoff_min: float = 4.0
    conditioning_cutoff_max: float = 20.0

    @classmethod
    def from_hparams(cls, hparams: Mapping[str, Any]) -> TrunkConfig:
        """The trunk's settings from a ``Boltz2`` model's ``hparams`` (other keys are ignored)."""
        names = cls.__dataclass_fields__
        got = {k: hparams[k] for k in names if k in hparams}
        for k in ("embedder_args", "msa_args", "pairformer_args", "template_args"):
            if got.get(k) is not None:
                got[k] = dict(got[k])
        return cls(**got)


@dataclass(frozen=True)
class TrunkParts:
    """The classes a trunk is built from: the serial ones (:func:`serial_parts`) or their CP twins
    (``pair.layers.trunk``), so both register the same names in one order."""

    input_embedder: type[nn.Module]
    linear: type[nn.Module]
    layer_norm: type[nn.Module]
    pair_init: Mapping[str, type]  # ``add_pair_init``'s parts: linear, rel_pos, embedding, contact
    template_v1: type[nn.Module]
    template_v2: type[nn.Module]
    msa_module: type[nn.Module]
    pairformer: type[nn.Module]
    distogram: type[nn.Module]


def serial_parts() -> TrunkParts:
    from twinshard.pair.reference.distogram import DistogramHead
    from twinshard.pair.reference.input_embedder import InputEmbedder
    from twinshard.pair.reference.linear import Linear
    from twinshard.pair.reference.msa import MSAModule
    from twinshard.pair.reference.norm import LayerNorm
    from twinshard.pair.reference.pairformer import PairformerStack
    from twinshard.pair.reference.template import TemplateModule, TemplateV2Module

    return TrunkParts(
        InputEmbedder,
        Linear,
        LayerNorm,
        {},
        TemplateModule,
        TemplateV2Module,
        MSAModule,
        PairformerStack,
        DistogramHead,
    )


def build_trunk(
    trunk: nn.Module, parts: TrunkParts, cfg: TrunkConfig, convention: str = "boltz", distogram: bool = True
) -> None:
    """Register the trunk's modules on ``trunk`` with Boltz2's names, in Boltz2's order.
    ``distogram=False`` leaves ``distogram_module`` out (the whole model registers it after the
    structure module, where Boltz2 does)."""
    from twinshard.pair.reference.pair_init import add_pair_init

    trunk.config = cfg
    ts, tz = cfg.token_s, cfg.token_z
    trunk.input_embedder = parts.input_embedder(
        atom_s=cfg.atom_s,
        atom_z=cfg.atom_z,
        token_s=ts,
        token_z=tz,
        atoms_per_window_queries=cfg.atoms_per_window_queries,
        atoms_per_window_keys=cfg.atoms_per_window_keys,
        atom_feature_dim=cfg.atom_feature_dim,
        use_no_atom_char=cfg.use_no_atom_char,
        use_atom_backbone_feat=cfg.use_atom_backbone_feat,
        use_residue_feats_atoms=cfg.use_residue_feats_atoms,
        **cfg.embedder_args,
    )
    add_pair_init(
        trunk,
        ts,
        tz,
        bond_type_feature=cfg.bond_type_feature,
        fix_sym_check=cfg.fix_sym_check,
        cyclic_pos_enc=cfg.cyclic_pos_enc,
        conditioning_cutoff_min=cfg.conditioning_cutoff_min,
        conditioning_cutoff_max=cfg.conditioning_cutoff_max,
        parts=parts.pair_init,
    )
    trunk.s_norm = parts.layer_norm(ts)
    trunk.z_norm = parts.layer_norm(tz)
    trunk.s_recycle = parts.linear(ts, ts, bias=False)
    trunk.z_recycle = parts.linear(tz, tz, bias=False)
    if cfg.use_templates:
        template = parts.template_v2 if cfg.use_templates_v2 else parts.template_v1
        trunk.template_module = template(tz, **(cfg.template_args or {}), convention=convention)
    trunk.msa_module = parts.msa_module(token_z=tz, token_s=ts, **cfg.msa_args, convention=convention)
    pairformer_args = dict(cfg.pairformer_args)
    if not pairformer_args.pop("v2", True):
        raise ValueError(
            "a Boltz-1 Pairformer (pairformer_args v2=False) is not Boltz-2's trunk: use v2=True"
        )
    trunk.pairformer_module = parts.pairformer(ts, tz, **pairformer_args, convention=convention)
    if distogram:
        trunk.distogram_module = parts.distogram(tz, cfg.num_bins)


def recycling_error(recycling_steps: Any, seed: int | None) -> ValueError | None:
    """What is wrong with a recycling count, or None (an integer >= 0; < 64 with a dropout seed:
    :func:`cycle_seed` keys 64 cycles per seed)."""
    if not isinstance(recycling_steps, int) or isinstance(recycling_steps, bool) or recycling_steps < 0:
        return ValueError(f"recycling_steps must be an integer >= 0, got {recycling_steps!r}")
    if seed is not None and recycling_steps >= 64:
        return ValueError("with a dropout seed, recycling_steps must be < 64 (cycle_seed keys 64 per seed)")
    return None


def cycle_seed(seed: int | None, cycle: int) -> int | None:
    """The dropout seed of recycling cycle ``cycle`` (fresh masks every cycle, as Boltz's fresh
    ``torch.rand`` draws; counter-based, so the same on every grid). None stays None."""
    return None if seed is None else int(seed) * 64 + cycle  # Boltz-2 never recycles 64 times


def trunk_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trunk part of a whole Boltz-2 ``state_dict`` (keys under :data:`TRUNK_PREFIXES`),
    unchanged; the structure module, confidence and affinity keys are left out."""
    return {k: v for k, v in state.items() if k.split(".", 1)[0] in TRUNK_PREFIXES}


class Boltz2Trunk(nn.Module):
    """The serial Boltz-2 trunk (module docstring): ``forward(feats, recycling_steps=0) -> dict``
    with ``s_inputs [B, N, token_s]``, ``s [B, N, token_s]``, ``z [B, N, N, token_z]`` and
    ``pdistogram [B, N, N, 1, num_bins]``. ``seed`` keys the dropout masks in training mode."""

    def __init__(self, config: TrunkConfig, convention: str = "boltz"):
        super().__init__()
        build_trunk(self, self.parts(), config, convention)

    @classmethod
    def parts(cls) -> TrunkParts:
        return serial_parts()

    # -- the few operations that differ between the serial trunk and its twin --------------------
    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    def pair_init(
        self, s_inputs: torch.Tensor, feats: Mapping[str, torch.Tensor], keep: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s_init, z_init)`` (``pair_init.pair_init_forward``: Boltz2's additions in its order;
        ``keep`` receives the relative position encoding)."""
        from twinshard.pair.reference.pair_init import pair_init_forward

        return pair_init_forward(self, s_inputs, feats, keep)

    def masks(self, feats: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mask [B, N], pair_mask [B, N, N])`` from ``token_pad_mask``, as Boltz2 forms them."""
        mask = feats["token_pad_mask"]
        mask = mask if mask.is_floating_point() else mask.float()
        return mask, mask[:, :, None] * mask[:, None, :]

    def control_scalars(self, feats: Mapping[str, Any], recycling_steps: int, seed: int | None) -> None:
        """Serial: nothing to agree on (the twin checks these are equal on every rank)."""

    def check_features(self, feats: Mapping[str, Any], recycling_steps: int, seed: int | None) -> None:
        """Serial: the recycling count (:func:`recycling_error`) and the whole feature contract
        (``feature_contract.check_features``) with every feature this configuration reads
        (:func:`trunk_feature_names`) required and the atom window of the configuration. Raises
        ``ValueError`` naming what is wrong."""
        from twinshard.pair.feature_contract import check_features, trunk_feature_names

        err = recycling_error(recycling_steps, seed)
        if err is not None:
            raise err
        check_features(
            feats, need=trunk_feature_names(self.config), window=self.config.atoms_per_window_queries
        )

    def forward(
        self, feats: Mapping[str, torch.Tensor], recycling_steps: int = 0, seed: int | None = None
    ) -> dict[str, torch.Tensor]:
        return self.run_trunk(feats, recycling_steps, seed)

    def run_trunk(
        self,
        feats: Mapping[str, torch.Tensor],
        recycling_steps: int = 0,
        seed: int | None = None,
        keep_rel_pos: bool = False,
    ) -> dict[str, torch.Tensor]:
        """The trunk's forward; ``keep_rel_pos`` adds the relative position encoding it computed
        (``"relative_position_encoding"``, the diffusion conditioning's input in Boltz2)."""
        self.check_features(feats, recycling_steps, seed)
        self.control_scalars(feats, recycling_steps, seed)
        s_inputs = self.input_embedder(feats)
        keep: dict[str, torch.Tensor] = {}
        s_init, z_init = self.pair_init(s_inputs, feats, keep if keep_rel_pos else None)
        mask, pair_mask = self.masks(feats)
        s, z = torch.zeros_like(s_init), torch.zeros_like(z_init)
        grad = torch.is_grad_enabled()
        for cycle in range(recycling_steps + 1):
            step = cycle_seed(seed, cycle)
            with torch.set_grad_enabled(grad and cycle == recycling_steps):
                s = self.add(s_init, self.s_recycle(self.s_norm(s)))
                z = self.add(z_init, self.z_recycle(self.z_norm(z)))
                if self.config.use_templates:
                    z = self.add(z, self.template_module(z, feats, pair_mask, seed=step))
                z = self.add(z, self.msa_module(z, s_inputs, feats, seed=step))
                s, z = self.pairformer_module(s, z, mask, pair_mask, step)
        return {"s_inputs": s_inputs, "s": s, "z": z, "pdistogram": self.distogram_module(z), **keep}
