"""Neighbour lists with ``vesin``: directed edges with cartesian periodic shifts.

Convention (the potential contract, see :mod:`twinshard.atoms.potentials.base`):
edge ``e`` goes from ``senders[e] = j`` to ``receivers[e] = i`` and

    r_ij = positions[j] + shifts[e] - positions[i],     shifts[e] = cell_shifts[e] @ cell

Both directions of every pair are listed (a full list). Periodic axes use the
cell; non-periodic axes never shift (a halo-padded block is open along the axes
split over several ranks, periodic along its wrap axes: ``pbc`` per axis).
Positions need not be wrapped into the cell: the shifts are computed for the
positions as given, so unwrapped MD coordinates stay valid.

:class:`VerletList` adds a skin: the list is built with ``cutoff + skin`` and
reused until some atom moved more than ``skin / 2`` since the build (the pair
distance then changed by less than ``skin``, so no pair within ``cutoff`` can
be missing). A Graph-contract potential ignores edges longer than its cutoff itself;
a plain (third-party) model gets the radius graph its own code would build,
``r < cutoff`` exactly (:class:`RadiusGraph` drops the skin edges before the call).

A *half* list (``half=True``) holds each pair once, as the edge ``i -> j`` with
``(i, cell_shift)`` canonical: ``i < j``, or ``i == j`` (an atom and its own
periodic image) with the shift lexicographically positive. It is exactly the
subset of the full list that :func:`half_of` keeps, so analytic pair potentials
can evaluate each pair once and apply the force to both atoms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from twinshard.atoms.data.cells import cell_problem, complete_cell

__all__ = ["Edges", "RadiusGraph", "neighbor_list", "half_of", "lex_positive", "VerletList", "within_cutoff"]


@dataclass
class Edges:
    """A directed edge list: senders ``j`` -> receivers ``i``, with shifts."""

    senders: torch.Tensor  # [E] int64
    receivers: torch.Tensor  # [E] int64
    shifts: torch.Tensor  # [E, 3] cartesian, positions' dtype
    cell_shifts: torch.Tensor  # [E, 3] int64, integer lattice translations

    @property
    def n_edges(self) -> int:
        return int(self.senders.shape[0])

    def vectors(self, positions: torch.Tensor) -> torch.Tensor:
        """r_ij = positions[senders] + shifts - positions[receivers] (differentiable)."""
        return positions[self.senders] + self.shifts - positions[self.receivers]


def neighbor_list(
    positions: torch.Tensor,
    cutoff: float,
    cell: torch.Tensor | None = None,
    pbc: torch.Tensor | bool | tuple[bool, bool, bool] = False,
    sort: bool = True,
    half: bool = False,
) -> Edges:
    """All directed pairs closer than ``cutoff`` (vesin; full list, or each pair once with ``half``).

    Args:
        positions: ``[n, 3]`` float tensor (detached internally; the list is
            integer data, gradients flow through :meth:`Edges.vectors`).
        cutoff: interaction range in Angstrom (> 0).
        cell: ``[3, 3]`` rows = lattice vectors; may be ``None``/zero when no
            axis is periodic; rows of non-periodic axes may be zero (a slab's ``cell[2]``).
        pbc: per-axis periodicity (bool or 3 bools).
        sort: order edges by (receiver, sender, shift) so the list is
            independent of vesin's internal traversal order.
        half: each pair once, in the canonical orientation of the module docstring.
    """
    if not cutoff > 0:
        raise ValueError(f"cutoff must be positive, got {cutoff}")
    dtype, device = positions.dtype, positions.device
    pbc_t = torch.as_tensor(pbc, dtype=torch.bool, device="cpu").flatten()
    if pbc_t.numel() == 1:
        pbc_t = pbc_t.expand(3)
    if cell is None:
        cell = torch.zeros(3, 3, dtype=dtype, device=device)
    periodic = [bool(p) for p in pbc_t.tolist()]
    if any(periodic):
        problem = cell_problem(cell, periodic)
        if problem is not None:
            raise ValueError(f"periodic neighbour list: {problem}")
        # a slab's or wire's zero (non-periodic) rows completed by normals: no shift along them
        cell_np = complete_cell(cell, periodic)[0].numpy()
    else:
        cell_np = np.zeros((3, 3))
    pos_np = positions.detach().cpu().double().numpy()
    n = pos_np.shape[0]
    if n == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return Edges(
            empty,
            empty.clone(),
            torch.zeros(0, 3, dtype=dtype, device=device),
            torch.zeros(0, 3, dtype=torch.int64, device=device),
        )
    from vesin import NeighborList

    nl = NeighborList(cutoff=float(cutoff), full_list=not half)
    i, j, s = nl.compute(pos_np, cell_np, periodic, "ijS")
    i = i.astype(np.int64)
    j = j.astype(np.int64)
    s = s.astype(np.int64)
    if half and len(i):
        # canonical orientation: i < j, or i == j with a lexicographically positive shift
        flip = (i > j) | ((i == j) & ~_lex_positive_np(s))
        i, j = np.where(flip, j, i), np.where(flip, i, j)
        s = np.where(flip[:, None], -s, s)
    if sort and len(i):
        # one integer key (receiver, sender) sorts much faster than a 5-key lexsort; shifts of the
        # same (i, j) pair (small cells only) break the tie in order
        key = i * n + j
        order = np.argsort(key, kind="stable")
        ks = key[order]
        if bool((ks[1:] == ks[:-1]).any()):  # duplicates: sorted neighbours tell (np.unique is ~50x slower)
            order = np.lexsort((s[:, 2], s[:, 1], s[:, 0], key))
        i, j, s = i[order], j[order], s[order]
    cell_shifts = torch.as_tensor(s, device=device)
    shifts = cell_shifts.to(dtype) @ cell.to(dtype=dtype, device=device).detach()
    if not any(periodic):
        shifts = torch.zeros_like(shifts)
    return Edges(
        senders=torch.as_tensor(j, device=device),
        receivers=torch.as_tensor(i, device=device),
        shifts=shifts,
        cell_shifts=cell_shifts,
    )


def _lex_positive_np(s: np.ndarray) -> np.ndarray:
    first = np.where(s[:, 0] != 0, s[:, 0], np.where(s[:, 1] != 0, s[:, 1], s[:, 2]))
    return first > 0


def lex_positive(s: torch.Tensor) -> torch.Tensor:
    """``[k, 3]`` integer vectors -> ``[k]`` bool: the first non-zero component is positive."""
    first = torch.where(s[:, 0] != 0, s[:, 0], torch.where(s[:, 1] != 0, s[:, 1], s[:, 2]))
    return first > 0


def half_of(edges: Edges) -> Edges:
    """The half list of a full list: each pair once, in the canonical orientation
    (``receiver < sender``, or an atom and its own image with a lexicographically positive shift)."""
    i, j = edges.receivers, edges.senders
    keep = (i < j) | ((i == j) & lex_positive(edges.cell_shifts))
    return Edges(j[keep], i[keep], edges.shifts[keep], edges.cell_shifts[keep])


class VerletList:
    """A neighbour list with a skin, rebuilt when any atom moved more than skin/2.

    ``update(positions, cell, pbc)`` returns the current :class:`Edges` and
    whether it rebuilt. ``n_builds`` counts builds. The cell is assumed fixed
    between builds (a changed cell forces a rebuild). ``half=True`` keeps a half
    list (each pair once; analytic pair potentials); asking for the other kind
    rebuilds. ``build_seconds`` sums the wall time of the builds.
    """

    def __init__(self, cutoff: float, skin: float = 1.0) -> None:
        if skin < 0:
            raise ValueError(f"skin must be >= 0, got {skin}")
        self.cutoff = float(cutoff)
        self.skin = float(skin)
        self.edges: Edges | None = None
        self.n_builds = 0
        self._ref: torch.Tensor | None = None
        self._cell: torch.Tensor | None = None
        self.half = False
        self.build_seconds = 0.0

    def needs_rebuild(
        self, positions: torch.Tensor, cell: torch.Tensor | None = None, half: bool | None = None
    ) -> bool:
        if self.edges is None or self._ref is None or self._ref.shape != positions.shape:
            return True
        if half is not None and bool(half) != self.half:
            return True
        if cell is not None and (self._cell is None or not torch.equal(cell, self._cell)):
            return True
        disp = (positions.detach() - self._ref).norm(dim=1)
        return bool(disp.numel()) and float(disp.max()) > 0.5 * self.skin

    def build(
        self,
        positions: torch.Tensor,
        cell: torch.Tensor | None = None,
        pbc: torch.Tensor | bool = False,
        half: bool = False,
    ) -> Edges:
        import time

        t0 = time.perf_counter()
        self.edges = None  # drop the old list before building the new one (peak memory)
        self.edges = neighbor_list(positions, self.cutoff + self.skin, cell, pbc, half=half)
        self.build_seconds += time.perf_counter() - t0
        self.half = bool(half)
        self._ref = positions.detach().clone()
        self._cell = None if cell is None else cell.detach().clone()
        self.n_builds += 1
        return self.edges

    def update(
        self,
        positions: torch.Tensor,
        cell: torch.Tensor | None = None,
        pbc: torch.Tensor | bool = False,
        half: bool = False,
    ) -> tuple[Edges, bool]:
        if self.needs_rebuild(positions, cell, half):
            return self.build(positions, cell, pbc, half), True
        assert self.edges is not None
        return self.edges, False


def within_cutoff(
    positions: torch.Tensor,
    senders: torch.Tensor,
    receivers: torch.Tensor,
    shifts: torch.Tensor,
    cutoff: float,
) -> torch.Tensor:
    """``[E]`` bool: the edges with ``|r_ij| < cutoff`` at these positions (``r_ij =
    positions[j] + shifts - positions[i]``; the norm as MACE takes it, so an edge is kept exactly
    when the model's own neighbour list, ``d < cutoff``, would hold it). No gradient.

    An edge naming a row outside ``[0, n)`` (the dispatch's ``PAD``, or a corrupt id) is kept:
    it is the model's inputs' business, and the dispatch raises on every rank for it, where an
    index error here would raise on one rank only."""
    n = positions.shape[0]
    with torch.no_grad():
        ok = (senders >= 0) & (senders < n) & (receivers >= 0) & (receivers < n)
        x = positions.detach()
        s, r = torch.where(ok, senders, 0), torch.where(ok, receivers, 0)
        d = torch.linalg.vector_norm(x[s] + shifts.detach() - x[r], dim=-1)
        return ~ok | (d < float(cutoff))


class RadiusGraph:
    """The radius graph ``r < cutoff`` of a Verlet list (built with ``cutoff + skin``): what a plain
    model sees, so the skin only decides when lists are rebuilt, never which edges enter the model.

    ``__call__(positions, senders, receivers, shifts, cutoff) -> (senders, receivers, shifts)``
    returns the kept edges. While the list and the kept set are unchanged it returns the very
    same tensors as last time, so anything keyed on their identity (the dispatch's routing of a
    sharded gather, reused while every rank's index is the same tensor) is reused; the set
    changes only when a pair crosses the cutoff. Per-call cost: one edge-length pass."""

    def __init__(self) -> None:
        self._last: tuple[Any, ...] | None = None

    def __call__(
        self,
        positions: torch.Tensor,
        senders: torch.Tensor,
        receivers: torch.Tensor,
        shifts: torch.Tensor,
        cutoff: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        keep = within_cutoff(positions, senders, receivers, shifts, cutoff)
        last = self._last
        if (
            last is not None
            and last[0] is senders
            and last[1] is receivers
            and last[2] is shifts
            and last[2]._version == last[3]
            and torch.equal(last[4], keep)
        ):
            return last[5], last[6], last[7]
        out = (senders[keep], receivers[keep], shifts[keep])
        self._last = (senders, receivers, shifts, shifts._version, keep, *out)
        return out
