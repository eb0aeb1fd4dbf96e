"""Explicit, autograd-aware communication and the communication ledger.

``twinshard.comm`` ops are autograd Functions with exact adjoints (for module code);
``twinshard.comm.primitives`` holds the same moves on plain tensors, for use inside
hand-written autograd Functions. Both record into ``CommLedger``.
"""

from twinshard.comm.ledger import CommLedger, OpStats
from twinshard.comm.ops import (
    agree_requires_grad,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    exchange,
    grid_transpose,
    permute,
    reduce_scatter,
    ring_shift,
    sync_grad,
    sync_params,
    transpose_tiles,
)
from twinshard.comm.primitives import reduce_dtype

__all__ = [
    "CommLedger",
    "agree_requires_grad",
    "OpStats",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "exchange",
    "grid_transpose",
    "permute",
    "reduce_dtype",
    "reduce_scatter",
    "ring_shift",
    "sync_grad",
    "sync_params",
    "transpose_tiles",
]
