"""Serial reference modules of the pair trunk, written from the published algorithms.

These are the oracles: every CP twin in ``twinshard.pair.layers`` registers the
same parameters in the same order and must match them to fp64 round-off.
"""

from twinshard.pair.reference.atom_encoder import AtomAttentionEncoder, AtomEncoder
from twinshard.pair.reference.atom_transformer import AtomTransformer, DiffusionTransformer
from twinshard.pair.reference.attention import AttentionPairBias
from twinshard.pair.reference.confidence import ConfidenceModule
from twinshard.pair.reference.diffusion import DiffusionConditioning, DiffusionModule
from twinshard.pair.reference.distogram import DistogramHead, distogram_loss, distogram_target
from twinshard.pair.reference.dropout import (
    CONVENTIONS,
    Dropout,
    assign_dropout_streams,
    dropout_mask,
    stream_id,
)
from twinshard.pair.reference.input_embedder import InputEmbedder
from twinshard.pair.reference.linear import Linear, init_linear
from twinshard.pair.reference.msa import MSALayer, MSAModule
from twinshard.pair.reference.norm import LayerNorm, compute_dtype
from twinshard.pair.reference.outer_product import OuterProductMean
from twinshard.pair.reference.pair_averaging import PairWeightedAveraging
from twinshard.pair.reference.pair_init import (
    ContactConditioning,
    FourierEmbedding,
    PairInit,
    RelativePositionEncoder,
)
from twinshard.pair.reference.pairformer import (
    PairformerLayer,
    PairformerNoSeqLayer,
    PairformerNoSeqModule,
    PairformerStack,
)
from twinshard.pair.reference.sampler import AtomDiffusion, CounterDraws, GivenDraws
from twinshard.pair.reference.template import TemplateModule, TemplateV2Module
from twinshard.pair.reference.transition import Transition
from twinshard.pair.reference.triangle import (
    TriangleMultiplication,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)
from twinshard.pair.reference.triangle_attention import (
    TriangleAttention,
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
)

__all__ = [
    "ContactConditioning",
    "FourierEmbedding",
    "PairInit",
    "RelativePositionEncoder",
    "TemplateModule",
    "TemplateV2Module",
    "AtomAttentionEncoder",
    "AtomEncoder",
    "AtomTransformer",
    "DiffusionTransformer",
    "InputEmbedder",
    "CONVENTIONS",
    "AttentionPairBias",
    "DistogramHead",
    "Dropout",
    "LayerNorm",
    "Linear",
    "MSALayer",
    "MSAModule",
    "OuterProductMean",
    "PairWeightedAveraging",
    "PairformerLayer",
    "PairformerNoSeqLayer",
    "PairformerNoSeqModule",
    "PairformerStack",
    "Transition",
    "TriangleAttention",
    "TriangleAttentionEndingNode",
    "TriangleAttentionStartingNode",
    "TriangleMultiplication",
    "TriangleMultiplicationIncoming",
    "TriangleMultiplicationOutgoing",
    "assign_dropout_streams",
    "compute_dtype",
    "distogram_loss",
    "distogram_target",
    "dropout_mask",
    "init_linear",
    "stream_id",
    "DiffusionConditioning",
    "DiffusionModule",
    "AtomDiffusion",
    "ConfidenceModule",
    "CounterDraws",
    "GivenDraws",
]
