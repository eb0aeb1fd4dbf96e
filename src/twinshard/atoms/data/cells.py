"""Cells with missing lattice vectors (slabs, wires, molecules): the check and the completion.

ASE (and MACE, through it) accepts a cell whose rows along *non-periodic* axes are zero: a
molecule has no cell, a slab ``pbc = (True, True, False)`` may leave ``cell[2] = 0``, a wire
``pbc = (True, False, False)`` may give ``cell[0]`` alone. Only the periodic vectors carry
physics (the images); a non-periodic axis never shifts, so its row enters no energy, force or
virial. Such a cell has no 3-D volume: its stress is undefined (None, or NaN in a batch, as for
an open cluster) while its virial is defined (``-dE/d strain``; mace's calculator divides the same
virial by the volume of a cell it pads with a vector of arbitrary length, see ``test_slab.py``).

:func:`check_cell` accepts any cell whose periodic rows are non-zero and linearly independent,
and says what is wrong otherwise (a zero vector or parallel vectors along periodic axes).

:func:`complete_cell` gives the code that needs a full basis (fractional coordinates, the spatial
partition's slabs, wrapping) a non-singular cell with the same periodic rows: each non-periodic
row that is zero or dependent on the others is replaced by a unit vector orthogonal to the rows
kept (as ASE's ``complete_cell``), or, given positions, by that direction scaled to span the
atoms (at least 1 A) with an origin at the atoms' lowest projection on it, so their fractional
coordinate along it lies in ``[0, 1]``. A periodic row is never changed; nothing here changes
any energy, force or virial.
"""

from __future__ import annotations

import torch

__all__ = ["cell_problem", "check_cell", "complete_cell", "is_singular"]

# a lattice vector shorter than this (Angstrom) is "zero"; periodic rows whose smallest singular
# value is below REL times their largest are "linearly dependent"
ZERO = 1e-9
REL = 1e-9


def _pbc(pbc: torch.Tensor | bool | tuple | list) -> list[bool]:
    t = torch.as_tensor(pbc, dtype=torch.bool, device="cpu").flatten()
    if t.numel() == 1:
        t = t.expand(3)
    return [bool(p) for p in t.tolist()]


def is_singular(cell: torch.Tensor) -> bool:
    """``|det cell| < 1e-12`` (no 3-D volume)."""
    return abs(float(torch.linalg.det(cell.detach().to("cpu", torch.float64)))) < 1e-12


def cell_problem(cell: torch.Tensor, pbc: torch.Tensor | bool | tuple | list) -> str | None:
    """What is wrong with ``cell`` for periodicity ``pbc`` (None if nothing): a periodic axis with
    a zero lattice vector, or periodic lattice vectors that are linearly dependent."""
    c = cell.detach().to("cpu", torch.float64)
    per = [a for a, p in enumerate(_pbc(pbc)) if p]
    if not per:
        return None
    lengths = torch.linalg.vector_norm(c, dim=1)
    zero = [a for a in per if float(lengths[a]) < ZERO]
    if zero:
        which = ", ".join(f"cell[{a}]" for a in zero)
        flags = ", ".join(f"pbc[{a}]" for a in zero)
        return (
            f"axes {zero} are periodic but their lattice vectors ({which}) are zero: a periodic axis "
            "needs a non-zero lattice vector (the cell of the periodic axes needs a non-zero volume "
            f"in them). Give {which}, or set {flags} = False for an open axis (a slab, "
            "pbc = (True, True, False), may leave cell[2] zero; a molecule needs no cell)"
        )
    s = torch.linalg.svdvals(c[per])
    if float(s.min()) <= REL * float(s.max()):
        return (
            f"the lattice vectors of the periodic axes {per} are linearly dependent (parallel or "
            f"coplanar): cell = {c.tolist()}; periodic axes need independent lattice vectors "
            "(give non-parallel ones, or set pbc = False along the redundant axis)"
        )
    return None


def check_cell(cell: torch.Tensor, pbc: torch.Tensor | bool | tuple | list) -> None:
    """Raise ``ValueError`` (what is wrong, how to fix it) unless ``cell`` suits ``pbc``."""
    problem = cell_problem(cell, pbc)
    if problem is not None:
        raise ValueError(problem)


def complete_cell(
    cell: torch.Tensor,
    pbc: torch.Tensor | bool | tuple | list,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(full cell [3, 3], origin [3])`` in fp64 on the CPU: ``cell`` itself (origin 0) when it is
    non-singular, else its periodic rows (and the non-periodic rows independent of them) kept and
    every other row replaced (see the module docstring). Assumes :func:`check_cell` passed."""
    c = cell.detach().to("cpu", torch.float64).clone()
    origin = torch.zeros(3, dtype=torch.float64)
    if not is_singular(c):
        return c, origin
    periodic = _pbc(pbc)
    kept: list[torch.Tensor] = []  # orthonormal basis of the rows kept so far
    order = [a for a in range(3) if periodic[a]] + [a for a in range(3) if not periodic[a]]
    missing = []
    for a in order:
        v = c[a]
        rest = v - sum((torch.dot(v, e) * e for e in kept), torch.zeros(3, dtype=torch.float64))
        if periodic[a] or float(rest.norm()) > max(ZERO, REL * float(v.norm())):
            kept.append(rest / rest.norm())
        else:
            missing.append(a)
    x = None if positions is None else positions.detach().to("cpu", torch.float64)
    for a in missing:
        e = _orthogonal(kept)
        kept.append(e)
        length, lo = 1.0, 0.0
        if x is not None and x.shape[0]:
            proj = x @ e
            lo = float(proj.min())
            length = max(float(proj.max()) - lo, 1.0)
        c[a] = length * e
        origin = origin + lo * e
    return c, origin


def _orthogonal(basis: list[torch.Tensor]) -> torch.Tensor:
    """A unit vector orthogonal to the orthonormal ``basis`` (fewer than 3 vectors): the normal of
    two, or the coordinate axis least aligned with them, orthogonalised."""
    if len(basis) == 2:
        n = torch.linalg.cross(basis[0], basis[1])
        return n / n.norm()
    eye = torch.eye(3, dtype=torch.float64)
    best = None
    for k in range(3):
        v = eye[k] - sum((torch.dot(eye[k], e) * e for e in basis), torch.zeros(3, dtype=torch.float64))
        if best is None or float(v.norm()) > float(best.norm()) + 1e-12:
            best = v
    assert best is not None
    return best / best.norm()
