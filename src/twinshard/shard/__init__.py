"""The ShardTensor engine of particles: per-atom tensors sharded by rank, whose op dispatch makes
unmodified model code (``index_select``, ``index_add_``, ``scatter_add_``, ``torch.autograd.grad``)
distributed.

- :mod:`~twinshard.shard.placements`: where a tensor's rows live (owned, halo-padded, per system);
- :mod:`~twinshard.shard.shard_tensor`: the tensor subclass and its propagation rules;
- :mod:`~twinshard.shard.dispatch`: the handler registry, call parsing and the handlers of
  gathers and scatters (:mod:`~twinshard.shard.rowwise`: row-wise ops;
  :mod:`~twinshard.shard.small_blocks`: one-atom and empty blocks);
- :mod:`~twinshard.shard.custom_ops`: the one halo exchange (``twinshard::halo_forward`` /
  ``halo_reverse``) and adapters for opaque ``torch.library`` custom ops.
"""

from twinshard.shard.custom_ops import (
    Adapter,
    Move,
    adapt,
    adapter_of,
    distributed_scope,
    halo_forward,
    halo_reverse,
    remove_adapter,
)
from twinshard.shard.dispatch import REGISTRY, Handler, register
from twinshard.shard.placements import PAD, HaloPadded, HaloState, Owned, PerSystem, ShardSpec
from twinshard.shard.shard_tensor import ShardTensor, UnhandledAtomOp, from_local, to_local

__all__ = [
    "PAD",
    "REGISTRY",
    "Adapter",
    "HaloPadded",
    "HaloState",
    "Handler",
    "Move",
    "Owned",
    "PerSystem",
    "ShardSpec",
    "ShardTensor",
    "UnhandledAtomOp",
    "adapt",
    "adapter_of",
    "distributed_scope",
    "from_local",
    "halo_forward",
    "halo_reverse",
    "register",
    "remove_adapter",
    "to_local",
]
