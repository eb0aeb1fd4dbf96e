"""Old module paths kept for one release after a module moved: :func:`alias` makes
``<package>.<old>`` the moved module itself (one object in ``sys.modules``, not a second copy),
so old imports, attribute access and monkeypatches keep working."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType

__all__ = ["alias"]


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, package: str, moved: dict[str, str]) -> None:
        self.package, self.moved = package, dict(moved)

    def find_spec(self, fullname: str, path: object = None, target: object = None):  # noqa: ANN201
        prefix, _, name = fullname.rpartition(".")
        if prefix != self.package or name not in self.moved:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.moved[spec.name.rpartition(".")[2]])

    def exec_module(self, module: ModuleType) -> None:  # already executed under its new name
        return None


def alias(package: str, moved: dict[str, str]) -> None:
    """Serve ``package.<old>`` as the module ``moved[old]`` names."""
    sys.meta_path.insert(0, _Finder(package, moved))
