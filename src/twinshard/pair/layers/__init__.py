"""Context-parallel (CP) twins of the pair trunk's layers on a rows x cols grid.

Each twin registers the same parameters, in the same order, as its serial module
in ``twinshard.pair.reference``, so a serial ``state_dict`` loads unchanged.
Inputs and outputs are DTensors at the placements of ``twinshard.pair.tiling``.
"""

from twinshard.pair.layers.atom_encoder import CPAtomAttentionEncoder, CPAtomEncoder
from twinshard.pair.layers.atom_transformer import CPAtomTransformer
from twinshard.pair.layers.attention import CPAttentionPairBias
from twinshard.pair.layers.distogram import CPDistogramHead
from twinshard.pair.layers.dropout import CPDropout
from twinshard.pair.layers.input_embedder import CPInputEmbedder
from twinshard.pair.layers.linear import CPLinear
from twinshard.pair.layers.norm import CPLayerNorm
from twinshard.pair.layers.outer_product import CPOuterProductMean
from twinshard.pair.layers.pairformer import CPPairformerLayer, CPPairformerStack
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
    "CPAtomAttentionEncoder",
    "CPAtomEncoder",
    "CPAtomTransformer",
    "CPInputEmbedder",
    "CPAttentionPairBias",
    "CPDistogramHead",
    "CPDropout",
    "CPLayerNorm",
    "CPLinear",
    "CPOuterProductMean",
    "CPPairformerLayer",
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
]
