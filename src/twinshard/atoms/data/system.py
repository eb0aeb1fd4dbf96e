"""Atomic systems: one periodic (or open) box of atoms held as torch tensors.

A :class:`System` is the serial, whole-box object. The distributed code (the
sharded system) keeps the same field names for its owned rows, so anything
written against ``System`` fields (``positions``, ``velocities``, ``masses``,
``ids``, ...) reads the same on one rank's block.

Conventions (those of ASE): lengths in Angstrom, masses in amu, energies in
eV, time in ASE units (``ase.units.fs`` per femtosecond), velocities in
Angstrom per ASE time unit. ``cell`` rows are the lattice vectors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from twinshard.atoms.data.cells import check_cell, complete_cell, is_singular

__all__ = ["System", "default_masses"]

_N_ELEMENTS = 118


def default_masses(numbers: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Standard atomic masses (amu) for atomic numbers 1..118, from ASE's table.

    Atomic number 0 (ASE's dummy atom "X") or anything outside 1..118 has no
    standard mass: a ValueError names the first offending atoms and says how to
    pass masses explicitly.
    """
    from ase.data import atomic_masses

    numbers = torch.as_tensor(numbers, dtype=torch.int64)
    bad = torch.nonzero((numbers < 1) | (numbers > _N_ELEMENTS)).flatten()
    if bad.numel():
        first = bad[:5].tolist()
        raise ValueError(
            f"missing mass: atoms {first} (of {bad.numel()}) have atomic numbers "
            f"{numbers[bad[:5]].tolist()} with no standard mass; pass masses=... "
            "explicitly (one positive value per atom, in amu)"
        )
    table = torch.as_tensor(atomic_masses, dtype=dtype)
    return table[numbers]


def _as_pbc(pbc: bool | Sequence[bool] | torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(pbc, dtype=torch.bool, device="cpu").flatten()
    if t.numel() == 1:
        t = t.expand(3).clone()
    if t.numel() != 3:
        raise ValueError(f"pbc must be one bool or three (one per axis), got {t.numel()} values")
    return t


@dataclass
class System:
    """A box of atoms.

    Attributes:
        positions: ``[n, 3]`` float (fp64 recommended); need not be wrapped
            into the cell (MD never wraps; wrap with :meth:`wrapped` for output).
        numbers: ``[n]`` int64 atomic numbers.
        cell: ``[3, 3]`` lattice vectors as rows; any triclinic cell. Rows of
            non-periodic axes may be zero (open box; a slab ``pbc = (T, T, F)`` with
            ``cell[2] = 0``); periodic rows must be non-zero and independent.
        pbc: ``[3]`` bool, periodic boundary per axis.
        masses: ``[n]`` amu; ``None`` means the standard mass of each element.
        velocities: ``[n, 3]``; ``None`` means zeros.
        ids: ``[n]`` int64 global atom ids, unique; ``None`` means ``arange(n)``.
            Ids are kept through sharding and migration, and key the random
            streams of the Langevin thermostat.
        arrays: extra per-atom tensors (first dimension ``n``): charges, tags, ...
        info: extra per-system values (replicated on every rank when sharded).
    """

    positions: torch.Tensor
    numbers: torch.Tensor
    cell: torch.Tensor | None = None
    pbc: torch.Tensor | bool | Sequence[bool] = False
    masses: torch.Tensor | None = None
    velocities: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    arrays: dict[str, torch.Tensor] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # a tensor stays where it is (as_tensor would move it to a non-CPU default device)
        pos = self.positions if isinstance(self.positions, torch.Tensor) else torch.as_tensor(self.positions)
        if not pos.is_floating_point():
            pos = pos.to(torch.float64)
        self.positions = pos
        dtype, device = pos.dtype, pos.device
        self.numbers = torch.as_tensor(self.numbers, dtype=torch.int64, device=device)
        if self.cell is None:
            self.cell = torch.zeros(3, 3, dtype=dtype, device=device)
        self.cell = torch.as_tensor(self.cell, dtype=dtype, device=device)
        if self.cell.shape == (3,):
            self.cell = torch.diag(self.cell)
        self.pbc = _as_pbc(self.pbc).to(device)
        n = pos.shape[0] if pos.dim() >= 1 else 0
        if self.masses is None and self.numbers.dim() == 1 and self.numbers.shape[0] == n:
            self.masses = default_masses(self.numbers, dtype).to(device)
        elif self.masses is not None:
            self.masses = torch.as_tensor(self.masses, dtype=dtype, device=device)
        if self.velocities is None:
            self.velocities = torch.zeros_like(pos)
        else:
            self.velocities = torch.as_tensor(self.velocities, dtype=dtype, device=device)
        if self.ids is None:
            self.ids = torch.arange(n, dtype=torch.int64, device=device)
        else:
            self.ids = torch.as_tensor(self.ids, dtype=torch.int64, device=device)
        self.arrays = {k: torch.as_tensor(v, device=device) for k, v in self.arrays.items()}
        self.info = dict(self.info)
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise a ValueError that says what is wrong and how to fix it."""
        pos = self.positions
        if pos.dim() != 2 or pos.shape[1] != 3:
            raise ValueError(
                f"positions must have shape [n_atoms, 3], got {list(pos.shape)}; "
                "reshape to one row of x, y, z per atom"
            )
        n = pos.shape[0]
        bad = torch.nonzero(~torch.isfinite(pos).all(dim=1)).flatten()
        if bad.numel():
            raise ValueError(
                f"positions contain NaN/inf for {bad.numel()} atoms (first: {bad[:5].tolist()}); "
                "fix the structure (a diverged MD step or a broken file?) before running"
            )
        for name, t, shape in (
            ("numbers", self.numbers, (n,)),
            ("masses", self.masses, (n,)),
            ("velocities", self.velocities, (n, 3)),
            ("ids", self.ids, (n,)),
        ):
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must have shape {list(shape)} for {n} atoms, got {list(t.shape)}")
        bad = torch.nonzero(~torch.isfinite(self.masses) | (self.masses <= 0)).flatten()
        if bad.numel():
            raise ValueError(
                f"missing mass: atoms {bad[:5].tolist()} (of {bad.numel()}) have masses "
                f"{self.masses[bad[:5]].tolist()}; give every atom a positive finite mass in amu"
            )
        if not torch.isfinite(self.velocities).all():
            raise ValueError("velocities contain NaN/inf; reset them (e.g. maxwell_boltzmann)")
        if n and torch.unique(self.ids).numel() != n:
            raise ValueError("ids must be unique global atom ids; leave ids=None for arange(n)")
        if n and int(self.ids.min()) < 0:
            raise ValueError("ids must be non-negative")
        if self.cell.shape != (3, 3) or not torch.isfinite(self.cell).all():
            raise ValueError(
                f"cell must be a finite 3x3 matrix (rows = lattice vectors), "
                f"got shape {list(self.cell.shape)}"
            )
        check_cell(self.cell, self.pbc)  # periodic rows non-zero and independent; open rows may be zero
        for k, v in self.arrays.items():
            if v.dim() == 0 or v.shape[0] != n:
                raise ValueError(
                    f"per-atom array {k!r} must have first dimension {n}, got "
                    f"{list(v.shape)}; per-system values belong in info"
                )

    # -------------------------------------------------------------- properties
    @property
    def n_atoms(self) -> int:
        return int(self.positions.shape[0])

    def __len__(self) -> int:
        return self.n_atoms

    @property
    def dtype(self) -> torch.dtype:
        return self.positions.dtype

    @property
    def volume(self) -> float:
        """Cell volume (|det cell|); 0 for an open box without a cell, or a slab / wire whose
        non-periodic rows are zero (no 3-D volume: no stress, see :mod:`twinshard.atoms.data.cells`)."""
        return abs(float(torch.linalg.det(self.cell)))

    def kinetic_energy(self) -> torch.Tensor:
        return 0.5 * (self.masses[:, None] * self.velocities**2).sum()

    def _full_cell(self) -> torch.Tensor:
        """The cell with missing (zero, non-periodic) rows completed by unit normals, as ASE's
        ``complete_cell``: the basis of :meth:`scaled_positions` (the cell itself when it has a volume)."""
        if not is_singular(self.cell):
            return self.cell
        return complete_cell(self.cell, self.pbc)[0].to(self.positions.device, self.positions.dtype)

    def scaled_positions(self) -> torch.Tensor:
        """Fractional coordinates (not wrapped); along a missing non-periodic row (a slab's zero
        ``cell[2]``), the cartesian distance along its unit normal, as ASE gives them."""
        return torch.linalg.solve(self._full_cell().T, self.positions.T).T

    def wrapped(self) -> torch.Tensor:
        """Positions wrapped into the cell along periodic axes."""
        frac = self.scaled_positions()
        frac = torch.where(self.pbc, frac - torch.floor(frac), frac)
        return frac @ self._full_cell()

    # ------------------------------------------------------------- transforms
    def select(self, index: torch.Tensor | Sequence[int] | slice) -> System:
        """The atoms at ``index`` (global ids, per-system info and cell kept)."""
        if isinstance(index, slice):
            index = torch.arange(self.n_atoms)[index]
        index = torch.as_tensor(index, dtype=torch.int64, device=self.positions.device)
        return System(
            positions=self.positions[index],
            numbers=self.numbers[index],
            cell=self.cell,
            pbc=self.pbc,
            masses=self.masses[index],
            velocities=self.velocities[index],
            ids=self.ids[index],
            arrays={k: v[index] for k, v in self.arrays.items()},
            info=dict(self.info),
        )

    def clone(self) -> System:
        return System(
            positions=self.positions.clone(),
            numbers=self.numbers.clone(),
            cell=self.cell.clone(),
            pbc=self.pbc.clone(),
            masses=self.masses.clone(),
            velocities=self.velocities.clone(),
            ids=self.ids.clone(),
            arrays={k: v.clone() for k, v in self.arrays.items()},
            info=dict(self.info),
        )

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> System:
        """Float fields cast to ``dtype`` and everything moved to ``device``."""

        def cast(t: torch.Tensor) -> torch.Tensor:
            if dtype is not None and t.is_floating_point():
                return t.to(dtype=dtype, device=device)
            return t.to(device=device) if device is not None else t

        return System(
            positions=cast(self.positions),
            numbers=cast(self.numbers),
            cell=cast(self.cell),
            pbc=cast(self.pbc),
            masses=cast(self.masses),
            velocities=cast(self.velocities),
            ids=cast(self.ids),
            arrays={k: cast(v) for k, v in self.arrays.items()},
            info=dict(self.info),
        )

    # -------------------------------------------------------------------- ASE
    @classmethod
    def from_ase(cls, atoms: Any, dtype: torch.dtype = torch.float64) -> System:
        """Build from an ``ase.Atoms``; extra ``atoms.arrays`` become ``arrays``.

        ASE's ``momenta`` become velocities; an ``ids`` array, if present, gives
        global ids (so a written-and-read trajectory keeps them).
        """
        n = len(atoms)
        skip = {"positions", "numbers", "momenta", "masses", "ids"}
        arrays = {}
        for k, v in atoms.arrays.items():
            if k in skip:
                continue
            a = np.asarray(v)
            if a.dtype.kind in "fiub":
                arrays[k] = torch.as_tensor(a.copy())
        masses = None
        if "masses" in atoms.arrays:
            masses = torch.as_tensor(atoms.get_masses(), dtype=dtype)
        ids = atoms.arrays.get("ids")
        info = {k: v for k, v in atoms.info.items()}
        return cls(
            positions=torch.as_tensor(np.asarray(atoms.get_positions()), dtype=dtype),
            numbers=torch.as_tensor(np.asarray(atoms.get_atomic_numbers()), dtype=torch.int64),
            cell=torch.as_tensor(np.asarray(atoms.get_cell()), dtype=dtype),
            pbc=torch.as_tensor(np.asarray(atoms.get_pbc(), dtype=bool)),
            masses=masses,
            velocities=torch.as_tensor(np.asarray(atoms.get_velocities()), dtype=dtype) if n else None,
            ids=None if ids is None else torch.as_tensor(np.asarray(ids), dtype=torch.int64),
            arrays=arrays,
            info=info,
        )

    def to_ase(self, wrap: bool = False, with_ids: bool = True) -> Any:
        """An ``ase.Atoms`` copy (float64 numpy). ``ids`` travel as an array."""
        import ase

        pos = self.wrapped() if wrap else self.positions
        atoms = ase.Atoms(
            numbers=self.numbers.cpu().numpy(),
            positions=pos.detach().cpu().double().numpy(),
            cell=self.cell.detach().cpu().double().numpy(),
            pbc=self.pbc.cpu().numpy(),
            masses=self.masses.detach().cpu().double().numpy(),
        )
        atoms.set_velocities(self.velocities.detach().cpu().double().numpy())
        if with_ids:
            atoms.arrays["ids"] = self.ids.cpu().numpy().copy()
        for k, v in self.arrays.items():
            atoms.arrays[k] = v.detach().cpu().numpy().copy()
        atoms.info.update(self.info)
        return atoms

    def __repr__(self) -> str:
        pbc = "".join("T" if p else "F" for p in self.pbc.tolist())
        return (
            f"System(n_atoms={self.n_atoms}, dtype={self.dtype}, pbc={pbc}, "
            f"volume={self.volume:.4g}, arrays={sorted(self.arrays)}, info={sorted(self.info)})"
        )
