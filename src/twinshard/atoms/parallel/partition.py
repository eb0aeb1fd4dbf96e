"""Partitioners: which rank owns which atom.

Two partitioners share one small interface (``owner_of``, ``frame_center``,
``region``), used by the halo planner (:mod:`twinshard.atoms.parallel.halo`) and the
sharded system (:mod:`twinshard.atoms.parallel.sharded`):

- :class:`SpatialPartition` splits the cell into ``g0 x g1 x g2`` slabs of
  equal *fractional* width, so triclinic cells work unchanged, or, balanced
  (:mod:`twinshard.atoms.parallel.balance`), into boxes whose cut planes sit
  where the atoms are. Given the positions, the rank grid is chosen among those
  whose max / mean owned atoms is within 10% of the best grid's, then by the
  halo atoms (density-weighted), then by the least halo-carrying subdomain
  surface. Periodic axes
  wrap (the last domain borders the first; with one rank along an axis a rank
  borders itself); along open axes the outer domains extend to infinity.
- :class:`BlockPartition` gives each rank a contiguous range of global ids;
  it needs no geometry, and its halo is whatever lies within the ghost width of
  the bounding box of the atoms it owns (small only if ids are spatially
  ordered).

Everything here is pure geometry on replicated inputs: every rank computes the
same answer, no communication happens.

Along a *wrap axis* (:meth:`SpatialPartition.wrap_axes`: periodic with one rank
along it) the halo-padded block stays periodic: images along it are edge shifts of
the block's neighbour list, not halo rows.

Positions are kept *unwrapped* (so trajectories compare to serial ones without
lattice jumps). Each rank evaluates its block in its own *frame*: along a
periodic axis, fractional coordinates are mapped into
``[centre - 1/2, centre + 1/2)`` by a whole lattice shift.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from twinshard.atoms.data.cells import cell_problem, complete_cell, is_singular
from twinshard.atoms.parallel.balance import Cuts, balanced_cuts, cut_widths, imbalance, slab_coords

__all__ = [
    "PartitionError",
    "SpatialPartition",
    "BlockPartition",
    "cell_heights",
    "ghost_fraction",
    "fractional",
    "rank_grid_shapes",
]


class PartitionError(ValueError):
    """The system cannot be partitioned as asked (e.g. subdomains thinner than the ghost width)."""


def _as_cell(cell: torch.Tensor) -> torch.Tensor:
    cell = torch.as_tensor(cell, dtype=torch.float64, device="cpu")
    if cell.shape != (3, 3):
        raise PartitionError(f"cell must be 3x3 (rows are lattice vectors), got {tuple(cell.shape)}")
    return cell


def cell_heights(cell: torch.Tensor) -> torch.Tensor:
    """Perpendicular distance between opposite faces of the cell, per axis.

    ``h_a = V / |b x c|`` = ``1 / |row a of inv(cell).T|``. Slab widths and
    ghost widths along a triclinic axis are measured in these units.
    """
    cell = _as_cell(cell)
    inv = torch.linalg.inv(cell)
    return 1.0 / torch.linalg.vector_norm(inv, dim=0)


def fractional(
    positions: torch.Tensor, cell: torch.Tensor, origin: torch.Tensor | None = None
) -> torch.Tensor:
    """Fractional coordinates ``(x - origin) @ inv(cell)`` in fp64 (unwrapped)."""
    cell = _as_cell(cell)
    x = torch.as_tensor(positions, device="cpu").to(torch.float64)
    if origin is not None:
        x = x - origin.to(torch.float64)
    return x @ torch.linalg.inv(cell)


def rank_grid_shapes(nranks: int) -> list[tuple[int, int, int]]:
    """All ordered factorisations ``(g0, g1, g2)`` with ``g0 * g1 * g2 == nranks``."""
    if nranks < 1:
        raise PartitionError(f"need at least one rank, got {nranks}")
    out = []
    for g0 in range(1, nranks + 1):
        if nranks % g0:
            continue
        rest = nranks // g0
        for g1 in range(1, rest + 1):
            if rest % g1 == 0:
                out.append((g0, g1, rest // g1))
    return out


def ghost_fraction(
    heights: Sequence[float], grid: Sequence[int], width: float, pbc: Sequence[bool] | None = None
) -> float:
    """Halo volume of one slab subdomain as a fraction of the cell: ``prod_a (1/g_a + f_a w / h_a
    [g_a > 1]) - 1/P``. Only split axes import atoms: along an unsplit axis (periodic: its
    images are edge shifts of the block's list; open: nothing beyond) the subdomain is whole.
    ``f_a`` faces import along a split axis: 2 (the largest subdomain's halo; ``pbc=None``), or
    with ``pbc`` given the mean over ranks: 2 if periodic, ``2 (g_a - 1) / g_a`` if open (the
    end slabs have one inner face)."""
    frac = 1.0
    for a in range(3):
        g = grid[a]
        faces = 2.0 if pbc is None or pbc[a] else 2.0 * (g - 1) / g
        frac *= 1.0 / g + (faces * width / float(heights[a]) if g > 1 else 0.0)
    return frac - 1.0 / math.prod(grid)


GRID_TOLERANCE = 1.1  # automatic grid: within this factor of the best grid's imbalance, then halo
SCORE_SAMPLE = 20_000  # atoms the automatic grid's score is computed on (an even sample)


@dataclass(frozen=True)
class SpatialPartition:
    """Fractional boxes on a ``grid = (g0, g1, g2)`` of ranks.

    Rank ``r`` has grid coordinates ``(i, j, k)`` with ``r = (i * g1 + j) * g2 + k``
    and owns the fractional region ``[i/g0, (i+1)/g0) x ...`` (equal slabs, ``cuts is
    None``), or with balanced ``cuts`` (:mod:`twinshard.atoms.parallel.balance`) the box
    ``[X_i, X_i+1) x [Y_ij, Y_ij+1) x [Z_ijk, Z_ijk+1)`` of its jagged cut planes; along an
    open axis the first and last slab extend to -inf / +inf.

    Build it with :meth:`build`, which also checks the ghost width; :meth:`rebalance` moves
    the cuts (same grid) from histograms summed over the ranks.
    """

    cell: torch.Tensor
    pbc: tuple[bool, bool, bool]
    grid: tuple[int, int, int]
    origin: torch.Tensor
    ghost_width: float
    cuts: Cuts | None = None

    @property
    def nranks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @staticmethod
    def build(
        cell: torch.Tensor,
        pbc: tuple[bool, bool, bool] | list[bool] | torch.Tensor,
        nranks: int,
        ghost_width: float,
        grid: tuple[int, int, int] | None = None,
        positions: torch.Tensor | None = None,
        balance: float | None = None,
    ) -> SpatialPartition:
        """Choose (or check) the rank grid for ``cell`` and return the partition.

        Args:
            cell: 3x3 lattice vectors as rows (triclinic allowed).
            pbc: periodicity per axis.
            nranks: number of ranks P.
            ghost_width: cutoff + skin (+ hysteresis); every cut axis must have
                subdomains at least this thick, so halos come from adjacent
                slabs only.
            grid: force a rank grid; default: among the factorisations of P that fit,
                with ``positions``, those whose max / mean owned atoms (equal slabs, or
                balanced cuts with ``balance``) is within ``GRID_TOLERANCE`` of the best
                grid's, of those the ones whose largest halo (atoms within the ghost width,
                :meth:`work`) is within ``GRID_TOLERANCE`` of the least, and of those the
                smallest halo-carrying surface (without ``positions``: the smallest surface).
            positions: the atoms (all of them): weigh the grid choice, and needed when the
                cell lacks rows (zero rows along open axes: a molecule in vacuum, a slab's
                ``cell[2]``): each is replaced by the normal to the other rows, spanning the
                atoms (a molecule: the box around them).
            balance: a threshold on max / mean owned atoms (>= 1): where the equal slabs of
                the grid exceed it, the cut planes are balanced on ``positions``
                (:func:`~twinshard.atoms.parallel.balance.balanced_cuts`); ``None``: equal slabs.

        Raises:
            PartitionError: names the axis, the slab and ghost widths, and how
                many ranks would fit along it.
        """
        pbc_t = tuple(bool(p) for p in (pbc.tolist() if isinstance(pbc, torch.Tensor) else pbc))
        if len(pbc_t) != 3:
            raise PartitionError(f"pbc must have 3 entries, got {pbc_t}")
        cell = _as_cell(cell).clone()
        problem = cell_problem(cell, pbc_t)
        if problem is not None:
            raise PartitionError(problem)
        origin = torch.zeros(3, dtype=torch.float64, device="cpu")
        if is_singular(cell):
            # Missing non-periodic rows (a molecule in vacuum, a slab's zero cell[2]): each is
            # replaced by the normal to the others, spanning the atoms from an origin at their
            # lowest projection (a molecule: the box around them). The axis is open, so nothing
            # leaves it for good (its outer slabs extend to infinity).
            if positions is None:
                raise PartitionError(
                    "the cell has a zero lattice vector along an open axis: a spatial partition "
                    "needs the positions to span the atoms along it (pass positions=...)"
                )
            cell, origin = complete_cell(cell, pbc_t, torch.as_tensor(positions, device="cpu"))
        if abs(float(torch.linalg.det(cell))) < 1e-12:
            raise PartitionError("the cell is singular (its lattice vectors are coplanar)")
        w = float(ghost_width)
        if not (w > 0 and math.isfinite(w)):
            raise PartitionError(f"ghost width must be positive and finite, got {ghost_width}")
        heights = cell_heights(cell)

        def misfit(g: tuple[int, int, int]) -> str | None:
            for a in range(3):
                if g[a] > 1 and float(heights[a]) / g[a] < w:
                    fit = max(1, int(float(heights[a]) // w))
                    return (
                        f"rank grid {g[0]}x{g[1]}x{g[2]} cuts axis {a} into slabs "
                        f"{float(heights[a]) / g[a]:.4g} thick, thinner than the ghost width "
                        f"{w:.4g} (cutoff + skin); the cell is {float(heights[a]):.4g} thick along "
                        f"axis {a}, so at most {fit} rank(s) fit along it"
                    )
            return None

        if balance is not None and not (balance >= 1.0 and math.isfinite(balance)):
            raise PartitionError(f"balance is a threshold on max/mean owned atoms, >= 1; got {balance}")
        if grid is not None:
            grid = tuple(int(g) for g in grid)
            if len(grid) != 3 or grid[0] * grid[1] * grid[2] != nranks or min(grid) < 1:
                raise PartitionError(f"grid {grid} does not multiply to {nranks} ranks")
            msg = misfit(grid)
            if msg:
                raise PartitionError(msg)
            part = SpatialPartition(cell, pbc_t, grid, origin, w)
            return part if positions is None else part._weighed(positions, balance)[0]
        shapes = rank_grid_shapes(nranks)
        fitting = [g for g in shapes if misfit(g) is None]
        if not fitting:
            per_axis = [max(1, int(float(heights[a]) // w)) for a in range(3)]
            best = min(shapes, key=lambda g: ghost_fraction(heights.tolist(), g, w, pbc_t))
            raise PartitionError(
                f"the box is too small for {nranks} ranks: {misfit(best)}; no grid of {nranks} "
                f"ranks fits: at most {per_axis} ranks fit along the three axes (so at most "
                f"{per_axis[0] * per_axis[1] * per_axis[2]} ranks, as a grid within those); use "
                "fewer ranks, a smaller cutoff or skin, or a bigger box"
            )
        surface = {g: ghost_fraction(heights.tolist(), g, w, pbc_t) for g in fitting}
        if positions is None or torch.as_tensor(positions).shape[0] == 0:
            return SpatialPartition(cell, pbc_t, min(fitting, key=surface.__getitem__), origin, w)
        # weigh where the atoms are: a grid that leaves ranks empty (a slab cut along its vacuum)
        # loses to one that spreads the owned atoms; among those, the least halo atoms on the
        # busiest rank (density-weighted), then the least box surface (as without positions)
        weighed = [SpatialPartition(cell, pbc_t, g, origin, w)._weighed(positions, balance) for g in fitting]
        best = min(v[1] for v in weighed)
        even = [v for v in weighed if v[1] <= GRID_TOLERANCE * best]
        least = min(v[2] for v in even)
        ok = [v[0] for v in even if v[2] <= GRID_TOLERANCE * least + 1]
        return min(ok, key=lambda p: surface[p.grid])

    def _weighed(
        self, positions: torch.Tensor, balance: float | None
    ) -> tuple[SpatialPartition, float, float]:
        """This grid with equal slabs, or balanced cuts where those exceed ``balance``; its
        max / mean owned atoms and the most halo atoms of a rank (:meth:`work` - owned), on an
        even sample of at most ``SCORE_SAMPLE`` of ``positions``."""
        frac = self.fractional(torch.as_tensor(positions, device="cpu"))
        part = self
        if balance is not None and self.nranks > 1 and self.imbalance(frac) > balance:
            part = self.rebalance(frac)
        sample = frac[:: max(1, frac.shape[0] // SCORE_SAMPLE)]
        owned = torch.bincount(part.owner_of(sample), minlength=self.nranks)
        return part, imbalance(owned), float((part.work(sample) - owned).max())

    def work(self, frac: torch.Tensor) -> torch.Tensor:
        """``[P]`` atoms each rank holds, owned + halo (atoms within the ghost width of its box
        along its split axes, each atom once, periodic images not counted twice): the estimate
        that weighs the automatic grid. ``frac``: all atoms (or an even sample of them)."""
        f = frac.detach().to("cpu", torch.float64)
        boxes = torch.stack([torch.stack(self.region(r), 1) for r in range(self.nranks)])  # [P, 3, 2]
        margin = (self.ghost_width / self.heights()).tolist()
        inside = torch.ones(self.nranks, f.shape[0], dtype=torch.bool, device=f.device)
        for a in range(3):
            if self.grid[a] == 1:
                continue
            lo, hi = boxes[:, a, 0:1], boxes[:, a, 1:2]  # [P, 1]
            x = f[None, :, a]
            if self.pbc[a]:
                d = (x - lo) - torch.floor(x - lo)  # distance past lo, mod 1
                inside &= (d < hi - lo + margin[a]) | (d > 1.0 - margin[a])
            else:
                inside &= (x >= lo - margin[a]) & (x < hi + margin[a])
        return inside.sum(1)

    def imbalance(self, frac: torch.Tensor) -> float:
        """``max / mean`` owned atoms per rank of the atoms at ``frac`` (all of them)."""
        owners = self.owner_of(frac)
        return imbalance(torch.bincount(owners, minlength=self.nranks))

    def rebalance(
        self, frac: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> SpatialPartition:
        """The same grid with cut planes that balance the atoms at ``frac``
        (:func:`~twinshard.atoms.parallel.balance.balanced_cuts`). ``frac``: all atoms
        (``reduce=None``), or this rank's owned atoms with ``reduce`` an all_reduce (sum) of
        int64 histograms: collective then, one call per split axis; every rank gets the same
        cuts. Every slab along a split axis keeps at least the ghost width."""
        margin = (self.ghost_width / self.heights()).tolist()
        cuts = balanced_cuts(frac, self.grid, self.pbc, margin, reduce)
        return replace(self, cuts=cuts)

    def with_cell(self, cell: torch.Tensor) -> SpatialPartition:
        """The same rank grid on a new cell (a barostat's): the slabs keep their fractional
        bounds. Raises :class:`PartitionError` if a cut axis became thinner than the ghost width
        (every rank computes the same cell, so every rank raises it)."""
        if not all(self.pbc):
            raise PartitionError("a partition follows a changing cell only when periodic along all axes")
        try:
            part = SpatialPartition.build(cell, self.pbc, self.nranks, self.ghost_width, grid=self.grid)
            part = replace(part, cuts=self.cuts)
            part.check_cuts()
            return part
        except PartitionError as exc:
            raise PartitionError(
                f"the cell shrank below what the rank grid needs: {exc}; use fewer ranks or a "
                "larger system for this pressure"
            ) from None

    def check_cuts(self) -> None:
        """Raise :class:`PartitionError` if a balanced slab is thinner than the ghost width."""
        if self.cuts is None:
            return
        h = self.heights()
        for a, width in cut_widths(self.cuts, self.pbc):
            if width * float(h[a]) < self.ghost_width * (1 - 1e-9):
                raise PartitionError(
                    f"a balanced slab along axis {a} is {width * float(h[a]):.4g} thick, thinner "
                    f"than the ghost width {self.ghost_width:.4g} (cutoff + skin)"
                )

    # --- geometry -------------------------------------------------------
    def heights(self) -> torch.Tensor:
        """Face-to-face thickness of the (effective) cell per axis."""
        return cell_heights(self.cell)

    def wrap_axes(self) -> tuple[bool, bool, bool]:
        """Periodic axes with one rank along them: a block stays periodic there (edges carry the
        lattice shift) instead of holding its atoms' images as halo rows."""
        return tuple(self.pbc[a] and self.grid[a] == 1 for a in range(3))  # type: ignore[return-value]

    def coords_of(self, rank: int) -> tuple[int, int, int]:
        g0, g1, g2 = self.grid
        return (rank // (g1 * g2), (rank // g2) % g1, rank % g2)

    def rank_of(self, coords: tuple[int, int, int]) -> int:
        return (coords[0] * self.grid[1] + coords[1]) * self.grid[2] + coords[2]

    def fractional(self, positions: torch.Tensor) -> torch.Tensor:
        return fractional(positions, self.cell, self.origin)

    def region(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fractional ``(lo, hi)`` of rank's slab, in its own frame (open ends are +-inf)."""
        c = self.coords_of(rank)
        lo = torch.empty(3, dtype=torch.float64, device="cpu")
        hi = torch.empty(3, dtype=torch.float64, device="cpu")
        for a in range(3):
            lo[a], hi[a] = self._interval(c, a)
            if not self.pbc[a]:
                if c[a] == 0:
                    lo[a] = -math.inf
                if c[a] == self.grid[a] - 1:
                    hi[a] = math.inf
        return lo, hi

    def _interval(self, c: tuple[int, int, int], a: int) -> tuple[float, float]:
        """Fractional ``[lo, hi)`` of the slab at grid coordinates ``c`` along axis ``a``
        (finite: the open ends are applied by :meth:`region`)."""
        if self.cuts is None:
            return c[a] / self.grid[a], (c[a] + 1) / self.grid[a]
        group = (0, c[0], c[0] * self.grid[1] + c[1])[a]
        e = self.cuts[a][group]
        return e[c[a]], e[c[a] + 1]

    def frame_center(self, rank: int) -> torch.Tensor:
        """Centre of rank's frame per axis: the slab midpoint (periodic axes only matter)."""
        c = self.coords_of(rank)
        if self.cuts is not None:
            mid = [sum(self._interval(c, a)) / 2 for a in range(3)]
            return torch.tensor(mid, dtype=torch.float64, device="cpu")
        return torch.tensor(
            [(c[a] + 0.5) / self.grid[a] for a in range(3)], dtype=torch.float64, device="cpu"
        )

    def slab_index(self, frac: torch.Tensor) -> torch.Tensor:
        """Grid coordinates ``[n, 3]`` of the slab holding each (unwrapped) fractional point."""
        if self.cuts is not None:
            return slab_coords(frac, self.grid, self.pbc, self.cuts).to(frac.device)
        f = frac.clone()
        for a in range(3):
            if self.pbc[a]:
                f[:, a] = f[:, a] - torch.floor(f[:, a])
        g = torch.tensor(self.grid, dtype=torch.int64, device=frac.device)
        idx = torch.floor(f * g.to(torch.float64))
        # Open axes: outer slabs extend to infinity; periodic: guard f == 1 - ulp rounding.
        return torch.minimum(torch.clamp(idx, min=0).to(torch.int64), g - 1)

    def owner_of(
        self,
        frac: torch.Tensor,
        ids: torch.Tensor | None = None,
        current: torch.Tensor | None = None,
        hysteresis: float = 0.0,
    ) -> torch.Tensor:
        """Owning rank of each atom from its fractional coordinates.

        With ``current`` owners and ``hysteresis > 0`` (a distance), an atom
        stays with its current owner while it lies within ``hysteresis`` of that
        owner's slab, so atoms on a face do not flip at every rebuild.
        """
        del ids  # ownership is geometric
        s = self.slab_index(frac)
        g1, g2 = self.grid[1], self.grid[2]
        new = (s[:, 0] * g1 + s[:, 1]) * g2 + s[:, 2]
        if current is None or hysteresis <= 0 or frac.shape[0] == 0:
            return new
        current = current.to(torch.int64)
        margin = hysteresis / cell_heights(self.cell)
        keep = torch.ones(frac.shape[0], dtype=torch.bool, device=frac.device)
        g = torch.tensor(self.grid, dtype=torch.int64, device=frac.device)
        cc = torch.stack([current // (g1 * g2), (current // g2) % g1, current % g2], dim=1)
        if self.cuts is not None:  # each rank's box from its cuts
            box = torch.tensor(
                [[self._interval(self.coords_of(r), a) for a in range(3)] for r in range(self.nranks)],
                dtype=torch.float64,
                device=frac.device,
            )  # [P, 3, 2]
        for a in range(3):
            if self.cuts is None:
                lo = cc[:, a].to(torch.float64) / self.grid[a]
                hi = (cc[:, a] + 1).to(torch.float64) / self.grid[a]
            else:
                lo, hi = box[current, a, 0], box[current, a, 1]
            f = frac[:, a]
            if self.pbc[a]:
                centre = (lo + hi) / 2
                f = f - torch.floor(f - centre + 0.5)
            else:
                lo = torch.where(cc[:, a] == 0, torch.full_like(lo, -math.inf), lo)
                hi = torch.where(cc[:, a] == g[a] - 1, torch.full_like(hi, math.inf), hi)
            keep &= (f >= lo - margin[a]) & (f < hi + margin[a])
        return torch.where(keep, current, new)


@dataclass(frozen=True)
class BlockPartition:
    """Contiguous blocks of global ids: rank r owns ids ``[offsets[r], offsets[r+1])``.

    Geometry-free: atoms never migrate. Each rank's halo region is the
    bounding box of the atoms it owns (frame ``[0, 1)`` on periodic axes), so
    the halo is small only when ids are spatially ordered.
    """

    cell: torch.Tensor
    pbc: tuple[bool, bool, bool]
    offsets: tuple[int, ...]
    origin: torch.Tensor
    ghost_width: float

    @property
    def nranks(self) -> int:
        return len(self.offsets) - 1

    @staticmethod
    def build(
        cell: torch.Tensor,
        pbc: tuple[bool, bool, bool] | list[bool] | torch.Tensor,
        nranks: int,
        ghost_width: float,
        natoms: int,
    ) -> BlockPartition:
        """Split ``natoms`` ids into ``nranks`` blocks whose sizes differ by at most one."""
        pbc_t = tuple(bool(p) for p in (pbc.tolist() if isinstance(pbc, torch.Tensor) else pbc))
        cell = _as_cell(cell)
        problem = cell_problem(cell, pbc_t)
        if problem is not None:
            raise PartitionError(problem)
        if any(pbc_t) and is_singular(cell):  # a slab or wire: its missing rows by unit normals
            cell = complete_cell(cell, pbc_t)[0]
        if nranks < 1:
            raise PartitionError(f"need at least one rank, got {nranks}")
        base, extra = divmod(int(natoms), nranks)
        offsets = [0]
        for r in range(nranks):
            offsets.append(offsets[-1] + base + (1 if r < extra else 0))
        return BlockPartition(
            cell, pbc_t, tuple(offsets), torch.zeros(3, dtype=torch.float64, device="cpu"), float(ghost_width)
        )

    def with_cell(self, cell: torch.Tensor) -> BlockPartition:
        """The same id blocks on a new cell (a barostat's)."""
        if not all(self.pbc):
            raise PartitionError("a partition follows a changing cell only when periodic along all axes")
        return BlockPartition(_as_cell(cell).clone(), self.pbc, self.offsets, self.origin, self.ghost_width)

    def fractional(self, positions: torch.Tensor) -> torch.Tensor:
        if abs(float(torch.linalg.det(self.cell))) < 1e-12:
            # Open system with no cell: fractional == cartesian (unit "cell").
            return torch.as_tensor(positions, device="cpu").to(torch.float64)
        return fractional(positions, self.cell, self.origin)

    def heights(self) -> torch.Tensor:
        """Face-to-face thickness per axis (unit lengths when there is no cell)."""
        if abs(float(torch.linalg.det(self.cell))) < 1e-12:
            return torch.ones(3, dtype=torch.float64, device="cpu")
        return cell_heights(self.cell)

    def wrap_axes(self) -> tuple[bool, bool, bool]:
        """One rank: every periodic axis stays periodic in the block (no image rows); several
        ranks: none (their bounding boxes may overlap anywhere, images are halo rows)."""
        return self.pbc if self.nranks == 1 else (False, False, False)

    def region(self, rank: int) -> None:
        """No geometric region: the halo box is the owned atoms' bounding box."""
        del rank
        return None

    def frame_center(self, rank: int) -> torch.Tensor:
        del rank
        return torch.full((3,), 0.5, dtype=torch.float64, device="cpu")

    def owner_of(
        self,
        frac: torch.Tensor,
        ids: torch.Tensor | None = None,
        current: torch.Tensor | None = None,
        hysteresis: float = 0.0,
    ) -> torch.Tensor:
        """Owner from the global id alone."""
        del frac, current, hysteresis
        if ids is None:
            raise PartitionError("a block partition needs global ids to assign owners")
        bounds = torch.tensor(self.offsets[1:], dtype=torch.int64, device=ids.device)
        return torch.searchsorted(bounds, ids.to(torch.int64), right=True)
