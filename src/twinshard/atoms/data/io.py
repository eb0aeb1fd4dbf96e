"""Structure files through ``ase.io`` (extxyz, xyz, cif, POSCAR, ... any format ASE reads).

Errors are turned into one :class:`StructureReadError` whose message names the
file, the format tried and the underlying reason, so a distributed run can
agree on it and raise the same message on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from twinshard.atoms.data.system import System

__all__ = ["StructureReadError", "as_system", "read", "read_trajectory", "write"]


def as_system(source: Any, dtype: torch.dtype | None = None, what: str = "the structure") -> System:
    """The one way an input becomes a :class:`System`: a System (cast to ``dtype`` when given), an
    ``ase.Atoms`` (anything with ``get_positions`` and ``get_atomic_numbers``), or a structure file
    path (:func:`read`). ``None`` or another type raises a ``ValueError`` / ``TypeError`` naming
    ``what`` and what to give instead."""
    if isinstance(source, System):
        system = source
    elif isinstance(source, (str, os.PathLike)):
        system = read(source)
    elif hasattr(source, "get_positions") and hasattr(source, "get_atomic_numbers"):
        system = System.from_ase(source)
    elif source is None:
        raise ValueError(f"{what}: passed None; give a System, an ase.Atoms or a structure file path")
    else:
        raise TypeError(
            f"{what}: cannot use a {type(source).__name__}; give a System, an ase.Atoms or a path"
        )
    if dtype is not None and system.dtype != dtype:
        system = system.to(dtype=dtype)
    return system


class StructureReadError(ValueError):
    """A structure file could not be read (missing, unknown format, or malformed)."""


def _read_ase(path: str | os.PathLike, index: Any, format: str | None) -> Any:
    import ase.io

    path = os.fspath(path)
    if not os.path.exists(path):
        raise StructureReadError(
            f"structure file {path!r} does not exist; give a path to an extxyz/xyz/cif/POSCAR "
            "file, or leave STRUCTURE out to use an embedded default structure"
        )
    if os.path.isdir(path):
        raise StructureReadError(f"structure path {path!r} is a directory, not a file")
    try:
        return ase.io.read(path, index=index, format=format)
    except Exception as exc:  # ASE raises many types; re-raise one clear error
        fmt = format or "guessed from the name/content"
        raise StructureReadError(
            f"cannot read structure file {path!r} (format: {fmt}): {type(exc).__name__}: {exc}. "
            "Check the file is complete and pass format=... (e.g. 'extxyz', 'cif', 'vasp') if the "
            "extension does not say it"
        ) from exc


def read(
    path: str | os.PathLike,
    index: int | str = -1,
    format: str | None = None,
    dtype: torch.dtype = torch.float64,
) -> System:
    """Read one frame (default: the last) as a :class:`System`."""
    atoms = _read_ase(path, index, format)
    if isinstance(atoms, list):
        if not atoms:
            raise StructureReadError(f"structure file {os.fspath(path)!r} holds no frames")
        atoms = atoms[-1]
    if len(atoms) == 0:
        raise StructureReadError(f"structure file {os.fspath(path)!r} holds a frame with no atoms")
    try:
        return System.from_ase(atoms, dtype=dtype)
    except ValueError as exc:
        raise StructureReadError(f"structure file {os.fspath(path)!r}: {exc}") from exc


def read_trajectory(
    path: str | os.PathLike, format: str | None = None, dtype: torch.dtype = torch.float64
) -> list[System]:
    """Read every frame."""
    frames = _read_ase(path, ":", format)
    return [System.from_ase(a, dtype=dtype) for a in frames]


def write(
    path: str | os.PathLike,
    systems: System | Sequence[System],
    format: str | None = None,
    append: bool = False,
    wrap: bool = False,
    info: dict[str, Any] | None = None,
    **properties: Any,
) -> None:
    """Write one system or a list of frames through ``ase.io.write``.

    ``properties`` (e.g. ``energy=``, ``forces=``) are attached to a single
    frame through a SinglePointCalculator, so extxyz stores them; ``info``
    (e.g. ``{"step": 10}``) goes to every frame's ``atoms.info`` (the extxyz
    comment line).
    """
    import ase.io

    frames = [systems] if isinstance(systems, System) else list(systems)
    atoms = [s.to_ase(wrap=wrap) for s in frames]
    for a in atoms:
        a.info.update(info or {})
    if properties:
        if len(atoms) != 1:
            raise ValueError("properties can only be attached when writing one frame")
        from ase.calculators.singlepoint import SinglePointCalculator

        props = {
            k: (v.detach().cpu().double().numpy() if torch.is_tensor(v) else v) for k, v in properties.items()
        }
        atoms[0].calc = SinglePointCalculator(atoms[0], **props)
    ase.io.write(os.fspath(path), atoms if len(atoms) > 1 else atoms[0], format=format, append=append)
