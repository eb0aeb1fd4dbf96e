"""Default structures built in code, so nothing is downloaded.

- :func:`fcc_argon`: an fcc argon supercell (4000 atoms by default; ``n_atoms=``
  picks the smallest cubic supercell holding at least that many, e.g. 32768 for
  the benchmark);
- :func:`random_packing`: a liquid-like random packing (uniform points pushed
  apart to a minimum distance) in a periodic cube;
- :func:`triclinic_argon`: a rattled supercell of the primitive (rhombohedral)
  fcc cell, a fully triclinic periodic example;
- :func:`lj_mixture`: a two-species LJ liquid (Ar/Kr, 80:20) with matching
  per-species parameters from :func:`lj_mixture_parameters`;
- inhomogeneous systems for load balance: :func:`argon_slab` (an fcc slab filling half a
  periodic box along z, 50% vacuum), :func:`argon_droplet` (a sphere of fcc argon in the middle
  of a periodic box), :func:`argon_corner` (the same sphere in one corner of a larger box).

Every builder takes a ``seed`` and is deterministic.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from twinshard.atoms.data.system import System

__all__ = [
    "ARGON_LATTICE",
    "ARGON_LIQUID_DENSITY",
    "fcc_argon",
    "random_packing",
    "triclinic_argon",
    "lj_mixture",
    "lj_mixture_parameters",
    "argon_slab",
    "argon_droplet",
    "argon_corner",
    "STRUCTURES",
    "build",
]

ARGON_LATTICE = 5.26  # Angstrom, solid argon near its LJ minimum (sigma = 3.405)
ARGON_LIQUID_DENSITY = 0.021  # atoms / Angstrom^3 near the triple point
_FCC_BASIS = np.array([[0, 0, 0], [0, 0.5, 0.5], [0.5, 0, 0.5], [0.5, 0.5, 0]])


def _rattle(pos: np.ndarray, amount: float, seed: int) -> np.ndarray:
    if amount <= 0:
        return pos
    return pos + np.random.default_rng(seed).normal(scale=amount, size=pos.shape)


def fcc_argon(
    repeat: int | tuple[int, int, int] | None = None,
    n_atoms: int | None = None,
    a: float = ARGON_LATTICE,
    rattle: float = 0.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> System:
    """Cubic fcc argon supercell of ``repeat`` conventional cells (4 atoms each).

    Give ``repeat`` (int or 3 ints) or ``n_atoms`` (smallest cube with at least
    that many atoms); default 10x10x10 = 4000 atoms. ``rattle`` adds Gaussian
    displacements (Angstrom) so forces are not zero by symmetry.
    """
    if repeat is None:
        repeat = 10 if n_atoms is None else max(1, math.ceil((n_atoms / 4) ** (1 / 3) - 1e-9))
    reps = (repeat,) * 3 if isinstance(repeat, int) else tuple(repeat)
    if len(reps) != 3 or min(reps) < 1:
        raise ValueError(f"repeat must be a positive int or three, got {repeat}")
    grid = np.stack(np.meshgrid(*[np.arange(r) for r in reps], indexing="ij"), -1).reshape(-1, 3)
    frac = (grid[:, None, :] + _FCC_BASIS[None]).reshape(-1, 3)
    pos = _rattle(frac * a, rattle, seed)
    return System(
        positions=torch.as_tensor(pos, dtype=dtype),
        numbers=torch.full((len(pos),), 18, dtype=torch.int64),
        cell=torch.diag(torch.tensor([a * r for r in reps], dtype=dtype)),
        pbc=True,
        info={"name": "fcc_argon"},
    )


def _push_apart(
    n: int, cell: np.ndarray, min_distance: float, rng: np.random.Generator, max_iter: int = 500
) -> np.ndarray:
    """Uniform random points in a periodic cell, then pushed apart until no pair is closer
    than ``min_distance`` (each overlapping pair moves apart by its overlap, shared equally).

    This converges quickly well below random close packing and leaves a disordered,
    liquid-like arrangement without the hard overlaps that would blow up an MD start.
    """
    from vesin import NeighborList

    pos = rng.random((n, 3)) @ cell
    # Pushing to exactly min_distance stalls (pairs creep at the boundary); aim 5% wider.
    target = 1.05 * min_distance
    nl = NeighborList(cutoff=target, full_list=False)
    for _ in range(max_iter):
        i, j, d = nl.compute(pos, cell, True, "ijD")
        r = np.linalg.norm(d, axis=1, keepdims=True)
        if len(i) == 0 or float(r.min()) >= min_distance:
            return pos
        step = 0.5 * (target - r) * d / np.maximum(r, 1e-12)
        disp = np.zeros_like(pos)
        np.add.at(disp, i, -step)
        np.add.at(disp, j, step)
        pos = pos + disp
    raise ValueError(
        f"random packing: atoms still closer than min_distance={min_distance} after {max_iter} "
        "iterations; lower the density or min_distance"
    )


def random_packing(
    n_atoms: int = 2000,
    density: float = ARGON_LIQUID_DENSITY,
    min_distance: float = 3.0,
    number: int = 18,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> System:
    """Liquid-like random packing of ``n_atoms`` in a periodic cube at ``density``."""
    side = (n_atoms / density) ** (1 / 3)
    cell = np.eye(3) * side
    pos = _push_apart(n_atoms, cell, min_distance, np.random.default_rng(seed))
    return System(
        positions=torch.as_tensor(pos, dtype=dtype),
        numbers=torch.full((n_atoms,), number, dtype=torch.int64),
        cell=torch.as_tensor(cell, dtype=dtype),
        pbc=True,
        info={"name": "random_packing"},
    )


def triclinic_argon(
    repeat: int | tuple[int, int, int] = 6,
    a: float = ARGON_LATTICE,
    rattle: float = 0.1,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> System:
    """Rattled supercell of the primitive fcc cell (60 degree rhombohedron), 1 atom per cell."""
    prim = 0.5 * a * np.array([[0.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    reps = (repeat,) * 3 if isinstance(repeat, int) else tuple(repeat)
    grid = np.stack(np.meshgrid(*[np.arange(r) for r in reps], indexing="ij"), -1).reshape(-1, 3)
    pos = _rattle(grid @ prim, rattle, seed)
    cell = prim * np.array(reps)[:, None]
    return System(
        positions=torch.as_tensor(pos, dtype=dtype),
        numbers=torch.full((len(pos),), 18, dtype=torch.int64),
        cell=torch.as_tensor(cell, dtype=dtype),
        pbc=True,
        info={"name": "triclinic_argon"},
    )


def lj_mixture_parameters() -> dict[int, tuple[float, float]]:
    """Per-species LJ (epsilon eV, sigma Angstrom) for the Ar/Kr mixture."""
    return {18: (0.0104, 3.405), 36: (0.0140, 3.65)}


def lj_mixture(
    n_atoms: int = 1000,
    fraction_b: float = 0.2,
    density: float = 0.019,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> System:
    """Two-species liquid: random packing with a ``fraction_b`` share of Kr among Ar."""
    s = random_packing(n_atoms, density=density, min_distance=3.0, seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    n_b = int(round(fraction_b * n_atoms))
    numbers = np.full(n_atoms, 18)
    numbers[rng.choice(n_atoms, size=n_b, replace=False)] = 36
    s = System(
        positions=s.positions,
        numbers=torch.as_tensor(numbers),
        cell=s.cell,
        pbc=True,
        info={"name": "lj_mixture"},
    )
    return s


def argon_slab(
    n_atoms: int | None = None,
    repeat: tuple[int, int, int] | None = None,
    vacuum: float = 0.5,
    rattle: float = 0.1,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> System:
    """An fcc argon slab of ``repeat`` conventional cells (default 4 x 4 x 3: 192 atoms; with
    ``n_atoms``, an n x n x 3 slab of at least that many) centred in a periodic box whose z
    length is the slab's / (1 - ``vacuum``): 50% vacuum by default, all axes periodic."""
    if repeat is None:
        n = 4 if n_atoms is None else max(1, math.ceil(math.sqrt(n_atoms / 12) - 1e-9))
        repeat = (n, n, 3)
    s = fcc_argon(repeat=repeat, rattle=rattle, seed=seed, dtype=dtype)
    if not 0 <= vacuum < 1:
        raise ValueError(f"vacuum is the box's empty fraction along z, in [0, 1); got {vacuum}")
    cell = s.cell.clone()
    thick = float(cell[2, 2])
    cell[2, 2] = thick / (1 - vacuum)
    pos = s.positions.clone()
    pos[:, 2] += (float(cell[2, 2]) - thick) / 2
    return System(positions=pos, numbers=s.numbers, cell=cell, pbc=True, info={"name": "argon_slab"})


def _sphere(
    radius: float, centre: np.ndarray, box: float, rattle: float, seed: int, dtype: torch.dtype
) -> System:
    reps = math.ceil(2 * radius / ARGON_LATTICE) + 1
    s = fcc_argon(repeat=reps)
    pos = s.positions.numpy()
    pos = pos - pos.mean(0)
    keep = np.linalg.norm(pos, axis=1) <= radius
    pos = _rattle(pos[keep] + centre, rattle, seed)
    return System(
        positions=torch.as_tensor(pos, dtype=dtype),
        numbers=torch.full((len(pos),), 18, dtype=torch.int64),
        cell=torch.eye(3, dtype=dtype) * box,
        pbc=True,
    )


def _radius(n_atoms: int | None) -> float:
    """The radius of an fcc argon sphere of about ``n_atoms`` (default 11 A: ~180 atoms)."""
    if n_atoms is None:
        return 11.0
    return (3 * n_atoms * ARGON_LATTICE**3 / (16 * math.pi)) ** (1 / 3)


def argon_droplet(
    n_atoms: int | None = None, rattle: float = 0.1, seed: int = 0, dtype: torch.dtype = torch.float64
) -> System:
    """A sphere of fcc argon (about ``n_atoms``; default radius 11 A) centred in a periodic cube
    of side 3.2 radii (vacuum around it)."""
    r = _radius(n_atoms)
    box = 3.2 * r
    s = _sphere(r, np.full(3, box / 2), box, rattle, seed, dtype)
    s.info = {"name": "argon_droplet"}
    return s


def argon_corner(
    n_atoms: int | None = None, rattle: float = 0.1, seed: int = 0, dtype: torch.dtype = torch.float64
) -> System:
    """The droplet's sphere in one corner of a periodic cube of side 4 radii: its centre at 1.2
    radii from three faces (a cluster in one corner)."""
    r = _radius(n_atoms)
    s = _sphere(r, np.full(3, 1.2 * r), 4.0 * r, rattle, seed, dtype)
    s.info = {"name": "argon_corner"}
    return s


STRUCTURES = {
    "fcc_argon": fcc_argon,
    "random_packing": random_packing,
    "triclinic_argon": triclinic_argon,
    "lj_mixture": lj_mixture,
    "argon_slab": argon_slab,
    "argon_droplet": argon_droplet,
    "argon_corner": argon_corner,
}


def build(name: str, **kwargs: object) -> System:
    """An embedded structure by name (see ``STRUCTURES``)."""
    if name not in STRUCTURES:
        raise ValueError(
            f"unknown embedded structure {name!r}; choose one of {sorted(STRUCTURES)} "
            "or give a structure file"
        )
    return STRUCTURES[name](**kwargs)
