"""Serial reference modules of the pair trunk, written from the published algorithms.

These are the oracles: every CP twin in ``twinshard.pair.layers`` registers the
same parameters in the same order and must match them to fp64 round-off.
"""

from twinshard.pair.reference.dropout import Dropout, assign_dropout_streams, dropout_mask, stream_id
from twinshard.pair.reference.linear import Linear, init_linear
from twinshard.pair.reference.norm import LayerNorm, compute_dtype
from twinshard.pair.reference.outer_product import OuterProductMean
from twinshard.pair.reference.transition import Transition
from twinshard.pair.reference.triangle import (
    TriangleMultiplication,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)

__all__ = [
    "Dropout",
    "LayerNorm",
    "Linear",
    "OuterProductMean",
    "Transition",
    "TriangleMultiplication",
    "TriangleMultiplicationIncoming",
    "TriangleMultiplicationOutgoing",
    "assign_dropout_streams",
    "compute_dtype",
    "dropout_mask",
    "init_linear",
    "stream_id",
]
