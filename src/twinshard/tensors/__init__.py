"""Old home of three unrelated things, kept for one release: its modules moved.

- ``twinshard.tensors.rng`` -> :mod:`twinshard.rng` (counter-based RNG, both verticals);
- ``twinshard.tensors.memory`` -> :mod:`twinshard.memory` (memory measurement, both verticals);
- ``twinshard.tensors.dtensor`` -> :mod:`twinshard.pair.tiling` (the DTensor tiling of pairs);
- ``twinshard.tensors.{placements, shard_tensor, dispatch, rowwise, small_blocks, custom_ops}``
  -> :mod:`twinshard.shard` (the ShardTensor engine of particles).

Each old module name is the new module itself (an alias in ``sys.modules``), so old imports,
attribute access and monkeypatches keep working; import the new names in new code.
"""

from twinshard._moved import alias

MOVED = {
    "rng": "twinshard.rng",
    "memory": "twinshard.memory",
    "dtensor": "twinshard.pair.tiling",
    **{
        m: f"twinshard.shard.{m}"
        for m in ("placements", "shard_tensor", "dispatch", "rowwise", "small_blocks", "custom_ops")
    },
}
alias(__name__, MOVED)
