"""CP twins built from the ``boltz`` package's own modules (Boltz-2, boltz 2.2.1).

``cp_twin_of(module)`` reads the configuration of a Boltz-2 module from its attributes and
parameter shapes, builds the CP twin from ``twinshard.pair.layers`` with the same parameter names
in the same order, and loads the module's ``state_dict`` unchanged (``strict=True``), in the
module's dtype and on its device. Supported (``SUPPORTED``):

======================================================  =========================================
boltz                                                   twin
======================================================  =========================================
``layers.triangular_mult.TriangleMultiplicationOutgoing``  ``CPTriangleMultiplicationOutgoing``
``layers.triangular_mult.TriangleMultiplicationIncoming``  ``CPTriangleMultiplicationIncoming``
``layers.triangular_attention.attention.TriangleAttention{Starting,Ending}Node``
                                                        ``CPTriangleAttention{Starting,Ending}Node``
``layers.attentionv2.AttentionPairBias``                ``CPAttentionPairBias``
``layers.transition.Transition``                        ``CPTransition``
``layers.outer_product_mean.OuterProductMean``          ``CPOuterProductMean``
``layers.pairformer.PairformerLayer`` (``v2=True``)     ``CPPairformerLayer``
``layers.pairformer.PairformerModule`` (``v2=True``)    ``CPPairformerStack``
``layers.pairformer.PairformerNoSeqLayer``              ``CPPairformerNoSeqLayer``
``layers.pairformer.PairformerNoSeqModule``             ``CPPairformerNoSeqModule``
``layers.pair_averaging.PairWeightedAveraging``          ``CPPairWeightedAveraging``
``modules.trunkv2.MSALayer``                            ``CPMSALayer``
``modules.trunkv2.MSAModule``                           ``CPMSAModule`` (``subsample_msa=False``)
``modules.trunkv2.InputEmbedder``                       ``CPInputEmbedder``
``modules.encodersv2.AtomEncoder``                      ``CPAtomEncoder`` (``structure_prediction=False``)
``modules.encodersv2.AtomAttentionEncoder``             ``CPAtomAttentionEncoder`` (likewise)
``modules.encodersv2.RelativePositionEncoder``          ``CPRelativePositionEncoder``
``modules.trunkv2.ContactConditioning``                 ``CPContactConditioning``
``modules.trunkv2.TemplateV2Module`` / ``TemplateModule``  ``CPTemplateV2Module`` / ``CPTemplateModule``
``modules.trunkv2.DistogramModule``                     ``CPDistogramHead``
``models.boltz2.Boltz2`` (its trunk)                    ``CPBoltz2Trunk`` (:func:`cp_trunk_of`)
``models.boltz2.Boltz2`` (whole, inference)             ``CPBoltz2Model`` (:func:`cp_model_of`)
======================================================  =========================================

The twins' dropout follows Boltz's convention (``convention="boltz"``: row-wise masks
``[B, N, 1, 1]``, column-wise ``[B, 1, N, 1]``), keyed by global index, so their masks are not
Boltz's ``torch.rand`` draws but the same on every grid as in serial; Boltz's ``inf`` of the
triangle attention and of the attention with pair bias is carried over.

Not supported (a ``TypeError`` that says so): the version-1 ``AttentionPairBias`` (Boltz-1's
Pairformer, ``v2=False``), ``AttentionPairBias(compute_pair_bias=False)``, the trifast/cuEquivariance
kernels (a twin has its own kernels; the weights are the same), an ``MSAModule`` with
``subsample_msa=True`` (its ``torch.randperm`` draw in forward: subsample the MSA features before
``distribute`` instead), and any module not listed. Boltz's eval-mode chunking (``chunk_heads``,
chunked transitions and triangle attention) computes the same functions and needs nothing. The
MSA twins' dropout (MSA rows ``[B, S, 1, 1]`` and the pair stack's) follows the same convention.

``boltz`` is imported lazily inside the functions: importing twinshard never requires it, and a
call without it raises an ``ImportError`` that says how to install it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["SUPPORTED", "boltz_modules", "cp_model_of", "cp_trunk_of", "cp_twin_of", "twin_config"]

SUPPORTED = (
    "TriangleMultiplicationOutgoing",
    "TriangleMultiplicationIncoming",
    "TriangleAttentionStartingNode",
    "TriangleAttentionEndingNode",
    "AttentionPairBias",
    "Transition",
    "OuterProductMean",
    "PairformerLayer",
    "PairformerModule",
    "PairformerNoSeqLayer",
    "PairformerNoSeqModule",
    "PairWeightedAveraging",
    "MSALayer",
    "MSAModule",
    # the pair initialisation, the template module and the distogram head (issue 19)
    "RelativePositionEncoder",
    "ContactConditioning",
    "TemplateV2Module",
    "TemplateModule",
    "DistogramModule",
    "InputEmbedder",
    "AtomEncoder",
    "AtomAttentionEncoder",
    # the structure module's first part (issue 20): Boltz2.diffusion_conditioning and
    # Boltz2.structure_module.score_model
    "DiffusionConditioning",
    "DiffusionModule",
    # Boltz2.structure_module (its sampler; issue 20 section 2)
    "AtomDiffusion",
    # the confidence module (issue 20 section 3): Boltz2.confidence_module
    "ConfidenceModule",
)


def boltz_modules() -> dict[str, type]:
    """The supported ``boltz`` classes by name (imports ``boltz``; a clear error without it)."""
    try:
        from boltz.model.layers import pairformer
        from boltz.model.layers.attentionv2 import AttentionPairBias
        from boltz.model.layers.outer_product_mean import OuterProductMean
        from boltz.model.layers.pair_averaging import PairWeightedAveraging
        from boltz.model.layers.transition import Transition
        from boltz.model.layers.triangular_attention.attention import (
            TriangleAttentionEndingNode,
            TriangleAttentionStartingNode,
        )
        from boltz.model.layers.triangular_mult import (
            TriangleMultiplicationIncoming,
            TriangleMultiplicationOutgoing,
        )
        from boltz.model.modules.encodersv2 import AtomAttentionEncoder, AtomEncoder
        from boltz.model.modules.trunkv2 import InputEmbedder, MSALayer, MSAModule
    except ImportError as exc:
        raise ImportError(
            "twinshard.pair.interop.boltz needs the boltz package (Boltz-2, tested with boltz 2.2.1); "
            "install it in its own environment as tests/interop/README.md shows "
            f"(pip install --no-deps boltz==2.2.1 numpy<2 scipy einops): {exc}"
        ) from exc
    return {
        "TriangleMultiplicationOutgoing": TriangleMultiplicationOutgoing,
        "TriangleMultiplicationIncoming": TriangleMultiplicationIncoming,
        "TriangleAttentionStartingNode": TriangleAttentionStartingNode,
        "TriangleAttentionEndingNode": TriangleAttentionEndingNode,
        "AttentionPairBias": AttentionPairBias,
        "Transition": Transition,
        "OuterProductMean": OuterProductMean,
        "PairformerLayer": pairformer.PairformerLayer,
        "PairformerModule": pairformer.PairformerModule,
        "PairformerNoSeqLayer": pairformer.PairformerNoSeqLayer,
        "PairformerNoSeqModule": pairformer.PairformerNoSeqModule,
        "PairWeightedAveraging": PairWeightedAveraging,
        "MSALayer": MSALayer,
        "MSAModule": MSAModule,
        **_pair_init_modules(),
        "InputEmbedder": InputEmbedder,
        "AtomEncoder": AtomEncoder,
        "AtomAttentionEncoder": AtomAttentionEncoder,
        **_diffusion_modules(),
        **_confidence_modules(),
    }


def _kind(module: nn.Module) -> str:
    classes = boltz_modules()
    for name, cls in classes.items():
        if type(module) is cls:
            return name
    v1 = None
    try:
        from boltz.model.layers.attention import AttentionPairBias as v1
    except ImportError:  # pragma: no cover - an older or trimmed boltz
        pass
    if v1 is not None and type(module) is v1:
        raise TypeError(
            "boltz.model.layers.attention.AttentionPairBias is Boltz-1's (v1) attention: only the "
            "version-2 AttentionPairBias (boltz.model.layers.attentionv2) has a CP twin"
        )
    raise TypeError(
        f"no CP twin for {type(module).__module__}.{type(module).__qualname__}; supported boltz modules: "
        + ", ".join(SUPPORTED)
    )


def _width(norm: nn.Module) -> int:
    return int(norm.normalized_shape[0])


def _layer_config(layer: nn.Module) -> dict[str, Any]:
    classes = boltz_modules()
    if type(layer.attention) is not classes["AttentionPairBias"]:
        raise TypeError(
            "a boltz PairformerLayer built with v2=False (Boltz-1's attention) has no CP twin: "
            "build it with v2=True"
        )
    _check_pair_bias(layer.attention)
    start = layer.tri_att_start
    return {
        "token_s": _width(layer.pre_norm_s),
        "token_z": int(layer.token_z),
        "num_heads": int(layer.num_heads),
        "dropout": float(layer.dropout),
        "pairwise_head_width": int(start.c_hidden),
        "pairwise_num_heads": int(start.no_heads),
        "post_layer_norm": bool(layer.post_layer_norm),
    }


def _noseq_layer_config(layer: nn.Module) -> dict[str, Any]:
    start = layer.tri_att_start
    return {
        "token_z": int(layer.token_z),
        "dropout": float(layer.dropout),
        "pairwise_head_width": int(start.c_hidden),
        "pairwise_num_heads": int(start.no_heads),
        "post_layer_norm": bool(layer.post_layer_norm),
    }


def _noseq_module_config(module: nn.Module) -> dict[str, Any]:
    if len(module.layers) == 0:
        raise TypeError("a boltz PairformerNoSeqModule with no layers has nothing to twin")
    cfg = _noseq_layer_config(module.layers[0])
    for i, layer in enumerate(module.layers):
        if _noseq_layer_config(layer) != cfg:
            raise TypeError(f"boltz PairformerNoSeqModule layer {i} differs in configuration from layer 0")
    cfg.update(num_blocks=len(module.layers), activation_checkpointing=bool(module.activation_checkpointing))
    return cfg


def _pwa_config(pwa: nn.Module) -> dict[str, Any]:
    return {
        "c_m": int(pwa.c_m),
        "c_z": int(pwa.c_z),
        "c_h": int(pwa.c_h),
        "num_heads": int(pwa.num_heads),
        "inf": float(pwa.inf),
    }


def _msa_layer_config(layer: nn.Module) -> dict[str, Any]:
    msa_s = _width(layer.msa_transition.norm)
    if int(layer.msa_transition.fc1.out_features) != 4 * msa_s:
        raise TypeError("a boltz MSALayer whose MSA transition is not 4 x msa_s wide has no CP twin")
    pwa, noseq = layer.pair_weighted_averaging, layer.pairformer_layer
    return {
        "msa_s": msa_s,
        "token_z": int(noseq.token_z),
        "msa_dropout": float(layer.msa_dropout),
        "z_dropout": float(noseq.dropout),
        "pairwise_head_width": int(noseq.tri_att_start.c_hidden),
        "pairwise_num_heads": int(noseq.tri_att_start.no_heads),
        "pwa_heads": int(pwa.num_heads),
        "pwa_head_width": int(pwa.c_h),
        "opm_hidden": int(layer.outer_product_mean.c_hidden),
    }


def _msa_module_config(module: nn.Module) -> dict[str, Any]:
    if len(module.layers) == 0:
        raise TypeError("a boltz MSAModule with no layers has nothing to twin")
    cfg = _msa_layer_config(module.layers[0])
    for i, layer in enumerate(module.layers):
        if _msa_layer_config(layer) != cfg:
            raise TypeError(f"boltz MSAModule layer {i} differs in configuration from layer 0")
    if bool(module.subsample_msa):
        raise TypeError(
            "a boltz MSAModule with subsample_msa=True draws torch.randperm in forward; its CP twin "
            "needs the draw made before distribute: subsample the MSA features, and twin a module "
            "with subsample_msa=False"
        )
    cfg.update(
        token_s=int(module.s_proj.in_features),
        msa_blocks=len(module.layers),
        activation_checkpointing=bool(module.activation_checkpointing),
        use_paired_feature=bool(module.use_paired_feature),
        subsample_msa=False,
        num_subsampled_msa=int(module.num_subsampled_msa),
    )
    return cfg


def _check_pair_bias(att: nn.Module) -> None:
    if not getattr(att, "compute_pair_bias", True):
        raise TypeError(
            "boltz AttentionPairBias(compute_pair_bias=False) takes a precomputed bias; its CP twin "
            "computes the bias from z (compute_pair_bias=True)"
        )


def _atom_encoder_config(enc: nn.Module) -> dict[str, Any]:
    if enc.structure_prediction:
        raise TypeError(
            "a boltz AtomEncoder built with structure_prediction=True (the structure module's) has no "
            "CP twin yet: only the input embedder's (structure_prediction=False)"
        )
    return {
        "atom_s": int(enc.embed_atom_features.out_features),
        "atom_z": int(enc.embed_atompair_ref_pos.out_features),
        "atoms_per_window_queries": int(enc.atoms_per_window_queries),
        "atoms_per_window_keys": int(enc.atoms_per_window_keys),
        "atom_feature_dim": int(enc.embed_atom_features.in_features),
        "use_no_atom_char": bool(enc.use_no_atom_char),
        "use_atom_backbone_feat": bool(enc.use_atom_backbone_feat),
        "use_residue_feats_atoms": bool(enc.use_residue_feats_atoms),
    }


def _attention_encoder_config(att: nn.Module) -> dict[str, Any]:
    if att.structure_prediction:
        raise TypeError(
            "a boltz AtomAttentionEncoder built with structure_prediction=True (the structure module's) "
            "has no CP twin yet"
        )
    dt = att.atom_encoder.diffusion_transformer
    return {
        "atom_s": _width(dt.layers[0].adaln.a_norm),
        "token_s": int(att.atom_to_token_trans[0].out_features),
        "atoms_per_window_queries": int(att.atom_encoder.attn_window_queries),
        "atoms_per_window_keys": int(att.atom_encoder.attn_window_keys),
        "atom_encoder_depth": len(dt.layers),
        "atom_encoder_heads": int(dt.layers[0].pair_bias_attn.num_heads),
        "structure_prediction": False,
        "activation_checkpointing": bool(dt.activation_checkpointing),
        "transformer_post_layer_norm": isinstance(dt.layers[0].post_lnorm, nn.LayerNorm),
    }


def _embedder_config(emb: nn.Module) -> dict[str, Any]:
    enc = _atom_encoder_config(emb.atom_encoder)
    att = _attention_encoder_config(emb.atom_attention_encoder)
    if att["transformer_post_layer_norm"]:
        raise TypeError("a boltz InputEmbedder's atom transformer has no post layer norm (as built by boltz)")
    return enc | {
        "token_s": int(emb.token_s),
        "token_z": 1,  # read only with structure_prediction=True
        "atom_encoder_depth": att["atom_encoder_depth"],
        "atom_encoder_heads": att["atom_encoder_heads"],
        "activation_checkpointing": att["activation_checkpointing"],
        "add_method_conditioning": bool(emb.add_method_conditioning),
        "add_modified_flag": bool(emb.add_modified_flag),
        "add_cyclic_flag": bool(emb.add_cyclic_flag),
        "add_mol_type_feat": bool(emb.add_mol_type_feat),
    }


def twin_config(module: nn.Module) -> tuple[str, dict[str, Any]]:
    """``(boltz class name, keyword arguments of the twin's constructor)`` for a boltz module."""
    kind = _kind(module)
    if kind.startswith("TriangleMultiplication"):
        return kind, {"dim": _width(module.norm_in)}
    if kind.startswith("TriangleAttention"):
        return kind, {
            "c_in": int(module.c_in),
            "c_hidden": int(module.c_hidden),
            "no_heads": int(module.no_heads),
            "inf": float(module.inf),
        }
    if kind == "AttentionPairBias":
        _check_pair_bias(module)
        c_z = _width(module.proj_z[0])
        return kind, {
            "c_s": int(module.c_s),
            "c_z": c_z,
            "num_heads": int(module.num_heads),
            "inf": float(module.inf),
        }
    if kind == "Transition":
        return kind, {
            "dim": _width(module.norm),
            "hidden": int(module.fc1.out_features),
            "out_dim": int(module.fc3.out_features),
        }
    if kind == "OuterProductMean":
        return kind, {
            "c_in": _width(module.norm),
            "c_hidden": int(module.c_hidden),
            "c_out": int(module.proj_o.out_features),
        }
    if kind == "PairformerLayer":
        return kind, _layer_config(module)
    if kind == "PairformerNoSeqLayer":
        return kind, _noseq_layer_config(module)
    if kind == "PairformerNoSeqModule":
        return kind, _noseq_module_config(module)
    if kind == "PairWeightedAveraging":
        return kind, _pwa_config(module)
    if kind == "MSALayer":
        return kind, _msa_layer_config(module)
    if kind == "MSAModule":
        return kind, _msa_module_config(module)
    if kind in _PAIR_INIT_KINDS:
        return kind, _pair_init_config(kind, module)
    if kind in _DIFFUSION_KINDS:
        return kind, _diffusion_config(kind, module)
    if kind == "InputEmbedder":
        return kind, _embedder_config(module)
    if kind == "AtomEncoder":
        return kind, _atom_encoder_config(module) | {
            "token_s": 1,
            "token_z": 1,
            "structure_prediction": False,
        }
    if kind == "AtomAttentionEncoder":
        return kind, _attention_encoder_config(module)
    if kind == "ConfidenceModule":
        return kind, _confidence_config(module)
    # PairformerModule
    if len(module.layers) == 0:
        raise TypeError("a boltz PairformerModule with no layers has nothing to twin")
    cfg = _layer_config(module.layers[0])
    for i, layer in enumerate(module.layers):
        if _layer_config(layer) != cfg:
            raise TypeError(f"boltz PairformerModule layer {i} differs in configuration from layer 0")
    cfg.update(num_blocks=len(module.layers), activation_checkpointing=bool(module.activation_checkpointing))
    return kind, cfg


def _twin_class(kind: str) -> type:
    from twinshard.pair import layers as L

    if kind in ("PairformerLayer", "PairformerModule"):
        try:
            from twinshard.pair.layers.pairformer import CPPairformerLayer, CPPairformerStack
        except ImportError as exc:  # pragma: no cover - until the CP Pairformer lands
            raise ImportError(
                f"the CP Pairformer (twinshard.pair.layers.pairformer) is not available: {exc}"
            ) from exc
        return CPPairformerLayer if kind == "PairformerLayer" else CPPairformerStack
    if kind in _PAIR_INIT_KINDS:
        return _pair_init_class(kind)
    if kind == "ConfidenceModule":
        from twinshard.pair.layers.confidence import CPConfidenceModule

        return CPConfidenceModule
    if kind in _DIFFUSION_KINDS:
        from twinshard.pair.layers.diffusion import CPDiffusionConditioning, CPDiffusionModule
        from twinshard.pair.layers.sampler import CPAtomDiffusion

        return {
            "DiffusionConditioning": CPDiffusionConditioning,
            "DiffusionModule": CPDiffusionModule,
            "AtomDiffusion": CPAtomDiffusion,
        }[kind]
    if kind in ("PairformerNoSeqLayer", "PairformerNoSeqModule"):
        from twinshard.pair.layers.pairformer import CPPairformerNoSeqLayer, CPPairformerNoSeqModule

        return CPPairformerNoSeqLayer if kind == "PairformerNoSeqLayer" else CPPairformerNoSeqModule
    if kind in ("PairWeightedAveraging", "MSALayer", "MSAModule"):
        from twinshard.pair.layers.msa import CPMSALayer, CPMSAModule
        from twinshard.pair.layers.pair_averaging import CPPairWeightedAveraging

        return {
            "PairWeightedAveraging": CPPairWeightedAveraging,
            "MSALayer": CPMSALayer,
            "MSAModule": CPMSAModule,
        }[kind]
    if kind in ("InputEmbedder", "AtomEncoder", "AtomAttentionEncoder"):
        from twinshard.pair.layers.atom_encoder import CPAtomAttentionEncoder, CPAtomEncoder
        from twinshard.pair.layers.input_embedder import CPInputEmbedder

        return {
            "InputEmbedder": CPInputEmbedder,
            "AtomEncoder": CPAtomEncoder,
            "AtomAttentionEncoder": CPAtomAttentionEncoder,
        }[kind]
    return {
        "TriangleMultiplicationOutgoing": L.CPTriangleMultiplicationOutgoing,
        "TriangleMultiplicationIncoming": L.CPTriangleMultiplicationIncoming,
        "TriangleAttentionStartingNode": L.CPTriangleAttentionStartingNode,
        "TriangleAttentionEndingNode": L.CPTriangleAttentionEndingNode,
        "AttentionPairBias": L.CPAttentionPairBias,
        "Transition": L.CPTransition,
        "OuterProductMean": L.CPOuterProductMean,
    }[kind]


# twins with dropout sites (they take ``convention``), and the lone layers among them (whose sites
# get the serial layer's streams from ``assign_dropout_streams``)
DROPOUT_KINDS = (
    "PairformerLayer",
    "PairformerModule",
    "PairformerNoSeqLayer",
    "PairformerNoSeqModule",
    "MSALayer",
    "MSAModule",
    "TemplateV2Module",
    "TemplateModule",
    "ConfidenceModule",
)
LONE_LAYERS = ("PairformerLayer", "PairformerNoSeqLayer", "MSALayer")


def cp_twin_of(module: nn.Module, convention: str = "boltz", whole: bool = False) -> nn.Module:
    """The CP twin of a boltz module with its ``state_dict`` loaded unchanged (strict), in the
    module's dtype, on its device, in its training mode. ``convention`` picks the twin's dropout
    masks (Pairformer layer and stack only; Boltz's own by default). A lone layer's dropout
    sites get the streams ``assign_dropout_streams`` gives the serial ``PairformerLayer``; a
    stack's are assigned by the stack from the sites' qualified names, as in serial. A whole
    ``Boltz2`` model gives its trunk (:func:`cp_trunk_of`), or with ``whole=True`` the whole
    inference model (:func:`cp_model_of`)."""
    if _is_boltz2(module):
        return cp_model_of(module, convention) if whole else cp_trunk_of(module, convention)
    kind, cfg = twin_config(module)
    if kind in DROPOUT_KINDS:
        cfg["convention"] = convention
    twin = _twin_class(kind)(**cfg)
    if kind in LONE_LAYERS:  # a lone layer's dropout sites get the serial layer's streams
        from twinshard.pair.reference.dropout import assign_dropout_streams

        assign_dropout_streams(twin)
    ref = next(iter(module.parameters()), None)
    if ref is not None:
        twin = twin.to(device=ref.device, dtype=ref.dtype)
    twin.load_state_dict(module.state_dict(), strict=True)
    ours = [n for n, _ in twin.named_parameters()]
    theirs = [n for n, _ in module.named_parameters()]
    if ours != theirs:  # the rule of every twin: same names, same order
        raise RuntimeError(f"{type(twin).__name__} registers parameters {ours}, boltz {theirs}")
    twin.train(module.training)
    return twin


# -- the pair initialisation, the template module and the distogram head (issue 19) --------------

_PAIR_INIT_KINDS = (
    "RelativePositionEncoder",
    "ContactConditioning",
    "TemplateV2Module",
    "TemplateModule",
    "DistogramModule",
)


def _pair_init_modules() -> dict[str, type]:
    from boltz.model.modules.encodersv2 import RelativePositionEncoder
    from boltz.model.modules.trunkv2 import (
        ContactConditioning,
        DistogramModule,
        TemplateModule,
        TemplateV2Module,
    )

    return {
        "RelativePositionEncoder": RelativePositionEncoder,
        "ContactConditioning": ContactConditioning,
        "TemplateV2Module": TemplateV2Module,
        "TemplateModule": TemplateModule,
        "DistogramModule": DistogramModule,
    }


def _pair_init_config(kind: str, module: nn.Module) -> dict[str, Any]:
    if kind == "RelativePositionEncoder":
        return {
            "token_z": int(module.linear_layer.out_features),
            "r_max": int(module.r_max),
            "s_max": int(module.s_max),
            "fix_sym_check": bool(module.fix_sym_check),
            "cyclic_pos_enc": bool(module.cyclic_pos_enc),
        }
    if kind == "ContactConditioning":
        return {
            "token_z": int(module.encoder.out_features),
            "cutoff_min": float(module.cutoff_min),
            "cutoff_max": float(module.cutoff_max),
        }
    if kind == "DistogramModule":
        # Boltz: distogram(z + z^T) reshaped to [B, N, N, num_distograms, num_bins]: the head's map
        return {
            "token_z": int(module.distogram.in_features),
            "num_bins": int(module.num_bins),
            "num_distograms": int(module.num_distograms),
        }
    # TemplateV2Module / TemplateModule
    stack = _noseq_module_config(module.pairformer)
    return {
        "token_z": _width(module.z_norm),
        "template_dim": _width(module.v_norm),
        "template_blocks": stack["num_blocks"],
        "dropout": stack["dropout"],
        "pairwise_head_width": stack["pairwise_head_width"],
        "pairwise_num_heads": stack["pairwise_num_heads"],
        "post_layer_norm": stack["post_layer_norm"],
        "activation_checkpointing": stack["activation_checkpointing"],
        "min_dist": float(module.min_dist),
        "max_dist": float(module.max_dist),
        "num_bins": int(module.num_bins),
    }


def _pair_init_class(kind: str) -> type:
    from twinshard.pair.layers.distogram import CPDistogramHead
    from twinshard.pair.layers.pair_init import CPContactConditioning, CPRelativePositionEncoder
    from twinshard.pair.layers.template import CPTemplateModule, CPTemplateV2Module

    return {
        "RelativePositionEncoder": CPRelativePositionEncoder,
        "ContactConditioning": CPContactConditioning,
        "TemplateV2Module": CPTemplateV2Module,
        "TemplateModule": CPTemplateModule,
        "DistogramModule": CPDistogramHead,
    }[kind]


# -- the whole trunk of a Boltz-2 model (issue 19) -------------------------------------------------


def _is_boltz2(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "Boltz2" and cls.__module__ == "boltz.model.models.boltz2"


def cp_trunk_of(model: nn.Module, convention: str = "boltz") -> nn.Module:
    """The CP trunk (``twinshard.pair.layers.trunk.CPBoltz2Trunk``) of a boltz ``Boltz2`` model:
    its settings from the model's ``hparams`` (``TrunkConfig.from_hparams``), the trunk part of its
    ``state_dict`` (``trunk_state_dict``: input embedder to distogram head) loaded unchanged and
    strict, in the model's dtype, on its device, in its training mode; the parameter names and
    their order are checked equal to the model's trunk parameters. The structure module,
    confidence and affinity heads are not part of it (the structure issue adds them)."""
    from twinshard.pair.layers.trunk import CPBoltz2Trunk
    from twinshard.pair.reference.trunk import TRUNK_PREFIXES, TrunkConfig, trunk_state_dict

    if not _is_boltz2(model):
        raise TypeError(f"cp_trunk_of takes a boltz Boltz2 model, got {type(model).__qualname__}")
    if getattr(model, "is_pairformer_compiled", False) or getattr(model, "is_msa_compiled", False):
        raise TypeError("a Boltz2 with compiled trunk modules: build it with compile_* = False")
    twin = CPBoltz2Trunk(TrunkConfig.from_hparams(model.hparams), convention=convention)
    ref = next(iter(model.parameters()), None)
    if ref is not None:
        twin = twin.to(device=ref.device, dtype=ref.dtype)
    twin.load_state_dict(trunk_state_dict(model.state_dict()), strict=True)
    ours = [n for n, _ in twin.named_parameters()]
    theirs = [n for n, _ in model.named_parameters() if n.split(".", 1)[0] in TRUNK_PREFIXES]
    if ours != theirs:
        raise RuntimeError(f"CPBoltz2Trunk registers parameters {ours}, Boltz2's trunk {theirs}")
    twin.train(model.training)
    return twin


# -- the structure module's conditioning and score model (issue 20) -------------------------------

_DIFFUSION_KINDS = ("DiffusionConditioning", "DiffusionModule", "AtomDiffusion")


def _diffusion_modules() -> dict[str, type]:
    from boltz.model.modules.diffusion_conditioning import DiffusionConditioning
    from boltz.model.modules.diffusionv2 import AtomDiffusion, DiffusionModule

    return {
        "DiffusionConditioning": DiffusionConditioning,
        "DiffusionModule": DiffusionModule,
        "AtomDiffusion": AtomDiffusion,
    }


def _transitions(ts: nn.ModuleList, dim: int, what: str) -> int:
    for t in ts:
        if int(t.fc1.out_features) != 2 * dim:
            raise TypeError(f"a boltz {what} whose transitions are not 2 x {dim} wide has no CP twin")
    return len(ts)


def _heads(projs: nn.ModuleList) -> tuple[int, int]:
    return len(projs), int(projs[0][1].out_features)


_SAMPLER_SCALARS = (
    "num_sampling_steps",
    "sigma_min",
    "sigma_max",
    "sigma_data",
    "rho",
    "P_mean",
    "P_std",
    "gamma_0",
    "gamma_min",
    "noise_scale",
    "step_scale",
    "step_scale_random",
    "coordinate_augmentation",
    "coordinate_augmentation_inference",
    "alignment_reverse_diff",
    "synchronize_sigmas",
)


def _diffusion_config(kind: str, module: nn.Module) -> dict[str, Any]:
    if kind == "AtomDiffusion":
        if not isinstance(module.score_model, _diffusion_modules()["DiffusionModule"]):
            raise TypeError(
                "a boltz AtomDiffusion with a compiled score model (compile_score) has no CP twin"
            )
        return {
            "score_model_args": _diffusion_config("DiffusionModule", module.score_model),
            **{k: getattr(module, k) for k in _SAMPLER_SCALARS},
        }
    if kind == "DiffusionConditioning":
        enc = module.atom_encoder
        tz = int(module.pairwise_conditioner.dim_pairwise_init_proj[1].out_features)
        e_d, e_h = _heads(module.atom_enc_proj_z)
        d_d, d_h = _heads(module.atom_dec_proj_z)
        t_d, t_h = _heads(module.token_trans_proj_z)
        return {
            "token_s": _width(enc.s_to_c_trans[0]),
            "token_z": tz,
            "atom_s": int(enc.embed_atom_features.out_features),
            "atom_z": int(enc.embed_atompair_ref_pos.out_features),
            "atoms_per_window_queries": int(enc.atoms_per_window_queries),
            "atoms_per_window_keys": int(enc.atoms_per_window_keys),
            "atom_encoder_depth": e_d,
            "atom_encoder_heads": e_h,
            "token_transformer_depth": t_d,
            "token_transformer_heads": t_h,
            "atom_decoder_depth": d_d,
            "atom_decoder_heads": d_h,
            "atom_feature_dim": int(enc.embed_atom_features.in_features),
            "conditioning_transition_layers": _transitions(
                module.pairwise_conditioner.transitions, tz, "PairwiseConditioning"
            ),
            "use_no_atom_char": bool(enc.use_no_atom_char),
            "use_atom_backbone_feat": bool(enc.use_atom_backbone_feat),
            "use_residue_feats_atoms": bool(enc.use_residue_feats_atoms),
        }
    sc = module.single_conditioner
    if sc.disable_times:
        raise TypeError("a boltz SingleConditioning with disable_times=True has no CP twin")
    enc = module.atom_attention_encoder.atom_encoder
    dec = module.atom_attention_decoder.atom_decoder
    ts2 = _width(sc.norm_single)
    return {
        "token_s": ts2 // 2,
        "atom_s": int(module.atom_attention_encoder.r_to_q_trans.out_features),
        "atoms_per_window_queries": int(module.atoms_per_window_queries),
        "atoms_per_window_keys": int(module.atoms_per_window_keys),
        "sigma_data": module.sigma_data,
        "dim_fourier": int(sc.fourier_embed.proj.out_features),
        "atom_encoder_depth": len(enc.diffusion_transformer.layers),
        "atom_encoder_heads": int(enc.diffusion_transformer.layers[0].pair_bias_attn.num_heads),
        "token_transformer_depth": len(module.token_transformer.layers),
        "token_transformer_heads": int(module.token_transformer.layers[0].pair_bias_attn.num_heads),
        "atom_decoder_depth": len(dec.diffusion_transformer.layers),
        "atom_decoder_heads": int(dec.diffusion_transformer.layers[0].pair_bias_attn.num_heads),
        "conditioning_transition_layers": _transitions(sc.transitions, ts2, "SingleConditioning"),
        "activation_checkpointing": bool(module.activation_checkpointing),
        "transformer_post_ln": isinstance(enc.diffusion_transformer.layers[0].post_lnorm, nn.LayerNorm),
    }


# -- the confidence module (issue 20 section 3) ---------------------------------------------------


def _confidence_modules() -> dict[str, type]:
    from boltz.model.modules.confidencev2 import ConfidenceModule

    return {"ConfidenceModule": ConfidenceModule}


def _confidence_config(module: nn.Module) -> dict[str, Any]:
    """The ``CPConfidenceModule`` arguments of a boltz ``ConfidenceModule`` (v2), from its parts."""
    heads = module.confidence_heads
    if not heads.token_level_confidence:
        raise TypeError(
            "a boltz ConfidenceModule with atom-level confidence has no CP twin (token level only)"
        )
    _, stack = twin_config(module.pairformer_stack)
    stack = {k: v for k, v in stack.items() if k not in ("token_s", "token_z")}
    sep = bool(heads.use_separate_heads)
    pae = heads.to_pae_intra_logits if sep else heads.to_pae_logits
    pde = heads.to_pde_intra_logits if sep else heads.to_pde_logits
    cfg: dict[str, Any] = {
        "token_s": int(module.s_to_z.in_features),
        "token_z": int(module.s_to_z.out_features),
        "pairformer_args": {**stack, "no_update_s": bool(module.no_update_s)},
        "num_dist_bins": int(module.dist_bin_pairwise_embed.num_embeddings),
        "max_dist": float(module.boundaries[-1]),  # the buffer itself is loaded from the state_dict
        "add_s_to_z_prod": bool(module.add_s_to_z_prod),
        "add_s_input_to_s": bool(module.add_s_input_to_s),
        "add_z_input_to_z": bool(module.add_z_input_to_z),
        "return_latent_feats": bool(module.return_latent_feats),
        "confidence_args": {
            "num_plddt_bins": int(heads.to_plddt_logits.out_features),
            "num_pde_bins": int(pde.out_features),
            "num_pae_bins": int(pae.out_features),
            "use_separate_heads": sep,
        },
    }
    if module.add_z_input_to_z:
        bonds = int(module.token_bonds.in_features)
        cfg.update(
            maximum_bond_distance=0 if bonds == 1 else bonds - 2,
            bond_type_feature=bool(module.bond_type_feature),
            fix_sym_check=bool(module.rel_pos.fix_sym_check),
            cyclic_pos_enc=bool(module.rel_pos.cyclic_pos_enc),
            conditioning_cutoff_min=float(module.contact_conditioning.cutoff_min),
            conditioning_cutoff_max=float(module.contact_conditioning.cutoff_max),
        )
    return cfg


# -- the whole Boltz-2 model, inference (issue 20) -------------------------------------------------


def cp_model_of(model: nn.Module, convention: str = "boltz") -> nn.Module:
    """The CP Boltz-2 model (``twinshard.pair.layers.model.CPBoltz2Model``: trunk, diffusion
    conditioning, sampler, distogram, confidence) of a boltz ``Boltz2`` model: its settings from
    the model's ``hparams`` (``ModelConfig.from_hparams``, which raises ``NotImplementedError`` for
    what it does not support: affinity, B-factors, compiled modules, ``skip_run_structure``), the
    WHOLE ``state_dict`` loaded unchanged and strict, in the model's dtype, on its device, in its
    training mode; the parameter names and their order are checked equal to the model's."""
    from twinshard.pair.layers.model import CPBoltz2Model
    from twinshard.pair.reference.model import ModelConfig

    if not _is_boltz2(model):
        raise TypeError(f"cp_model_of takes a boltz Boltz2 model, got {type(model).__qualname__}")
    twin = CPBoltz2Model(ModelConfig.from_hparams(model.hparams), convention=convention)
    ref = next(iter(model.parameters()), None)
    if ref is not None:
        twin = twin.to(device=ref.device, dtype=ref.dtype)
    twin.load_state_dict(model.state_dict(), strict=True)
    ours = [n for n, _ in twin.named_parameters()]
    theirs = [n for n, _ in model.named_parameters()]
    if ours != theirs:
        raise RuntimeError(f"CPBoltz2Model registers parameters {ours}, Boltz2 {theirs}")
    twin.train(model.training)
    return twin
