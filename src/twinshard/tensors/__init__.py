"""Old home of three unrelated things, kept for one release: its modules moved.

- ``twinshard.tensors.rng`` -> :mod:`twinshard.rng` (counter-based RNG, both verticals);
- ``twinshard.tensors.memory`` -> :mod:`twinshard.memory` (memory measurement, both verticals);
- ``twinshard.tensors.dtensor`` -> :mod:`twinshard.pair.tiling` (the DTensor tiling of pairs);
- ``twinshard.tensors.{placements, shard_tensor, dispatch, rowwise, small_blocks, custom_ops}``
  -> :mod:`twinshard.shard` (the ShardTensor engine of particles).

Each old module name is the new module itself (an alias in ``sys.modules``), so old imports,
attribute access and monkeypatches keep working; import the new names in new code.
"""

import importlib
import importlib.util
import sys

MOVED = {
    "rng": "twinshard.rng",
    "memory": "twinshard.memory",
    "dtensor": "twinshard.pair.tiling",
    **{
        m: f"twinshard.shard.{m}"
        for m in ("placements", "shard_tensor", "dispatch", "rowwise", "small_blocks", "custom_ops")
    },
}


def __getattr__(name: str):  # noqa: ANN202  (``from twinshard.tensors import rng``)
    if name in MOVED:
        return importlib.import_module(MOVED[name])
    raise AttributeError(f"module 'twinshard.tensors' has no attribute {name!r}")


class _Moved:
    """Finds ``twinshard.tensors.<old>`` as the very module it moved to (not a second copy)."""

    @staticmethod
    def find_spec(fullname: str, path: object = None, target: object = None):  # noqa: ANN205
        prefix, _, name = fullname.rpartition(".")
        if prefix != __name__ or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _Moved())

    @staticmethod
    def create_module(spec: object):  # noqa: ANN205
        return importlib.import_module(MOVED[spec.name.rpartition(".")[2]])  # type: ignore[attr-defined]

    @staticmethod
    def exec_module(module: object) -> None:  # already executed under its new name
        return None


sys.meta_path.insert(0, _Moved())
