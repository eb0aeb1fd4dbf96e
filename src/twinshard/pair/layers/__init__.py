"""Context-parallel (CP) twins of the pair trunk's layers on a rows x cols grid.

Each twin registers the same parameters, in the same order, as its serial module
in ``twinshard.pair.reference``, so a serial ``state_dict`` loads unchanged.
Inputs and outputs are DTensors at the placements of ``twinshard.pair.tiling``.
"""

from twinshard.pair.layers.atom_encoder import CPAtomAttentionEncoder, CPAtomEncoder
from twinshard.pair.layers.atom_transformer import CPAtomTransformer
from twinshard.pair.layers.attention import CPAttentionPairBias
from twinshard.pair.layers.confidence import CPConfidenceModule
from twinshard.pair.layers.diffusion import CPDiffusionConditioning, CPDiffusionModule
from twinshard.pair.layers.distogram import CPDistogramHead
from twinshard.pair.layers.dropout import CPDropout
from twinshard.pair.layers.input_embedder import CPInputEmbedder
from twinshard.pair.layers.linear import CPLinear
from twinshard.pair.layers.msa import CPMSALayer, CPMSAModule
from twinshard.pair.layers.norm import CPLayerNorm
from twinshard.pair.layers.outer_product import CPOuterProductMean
from twinshard.pair.layers.pair_averaging import CPPairWeightedAveraging
from twinshard.pair.layers.pair_init import (
    CPContactConditioning,
    CPEmbedding,
    CPPairInit,
    CPRelativePositionEncoder,
    cp_outer_sum,
)
from twinshard.pair.layers.pairformer import (
    CPPairformerLayer,
    CPPairformerNoSeqLayer,
    CPPairformerNoSeqModule,
    CPPairformerStack,
)
from twinshard.pair.layers.sampler import CPAtomDiffusion
from twinshard.pair.layers.template import CPTemplateModule, CPTemplateV2Module
from twinshard.pair.layers.tokenwise import TokenwiseTwin, grad_group, pointwise, replicated_params
from twinshard.pair.layers.transition import CPTransition
from twinshard.pair.layers.triangle import (
    CPTriangleMultiplication,
    CPTriangleMultiplicationIncoming,
    CPTriangleMultiplicationOutgoing,
)
from twinshard.pair.layers.triangle_attention import (
    CPTriangleAttention,
    CPTriangleAttentionEndingNode,
    CPTriangleAttentionStartingNode,
)

__all__ = [
    "CPContactConditioning",
    "CPEmbedding",
    "CPPairInit",
    "CPRelativePositionEncoder",
    "CPTemplateModule",
    "CPTemplateV2Module",
    "cp_outer_sum",
    "CPAtomAttentionEncoder",
    "CPAtomEncoder",
    "CPAtomTransformer",
    "CPInputEmbedder",
    "CPAttentionPairBias",
    "CPDistogramHead",
    "CPDropout",
    "CPLayerNorm",
    "CPLinear",
    "CPMSALayer",
    "CPMSAModule",
    "CPOuterProductMean",
    "CPPairWeightedAveraging",
    "CPPairformerLayer",
    "CPPairformerNoSeqLayer",
    "CPPairformerNoSeqModule",
    "CPPairformerStack",
    "CPTransition",
    "CPTriangleAttention",
    "CPTriangleAttentionEndingNode",
    "CPTriangleAttentionStartingNode",
    "CPTriangleMultiplication",
    "CPTriangleMultiplicationIncoming",
    "CPTriangleMultiplicationOutgoing",
    "TokenwiseTwin",
    "grad_group",
    "pointwise",
    "replicated_params",
    "CPDiffusionConditioning",
    "CPDiffusionModule",
    "CPAtomDiffusion",
    "CPConfidenceModule",
]
