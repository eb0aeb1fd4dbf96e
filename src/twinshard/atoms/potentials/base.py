"""The potential contract, shared by the serial evaluator and the distributed wrapper.

A potential is an ``nn.Module`` with a float attribute ``cutoff`` and

    forward(graph: Graph) -> per-atom energies, shape [n]

where ``graph`` describes a block of ``n`` atoms, owned atoms first then halo
atoms (serially: all atoms are owned, no halo):

- ``positions [n, 3]``, ``numbers [n]`` (int64 atomic numbers);
- directed edges ``senders [E]`` (j) -> ``receivers [E]`` (i); an edge j->i
  contributes to atom i. Both directions of a pair are present (full list);
- ``shifts [E, 3]`` cartesian, so ``r_ij = positions[senders] + shifts -
  positions[receivers]`` (:meth:`Graph.edge_vectors`); edges may be longer than
  ``cutoff`` (neighbour lists carry a skin) and must then contribute nothing;
- ``n_owned``: the first ``n_owned`` rows are owned;
- ``refresh(x) -> x``: identity serially. A message-passing model MUST call it
  on its node features before each interaction layer; distributed, it
  overwrites the halo rows with the owners' current values (a one-cutoff halo
  refreshed per layer instead of a layers x cutoff halo).

The energy of a block is ``per_atom[:n_owned].sum()``; summed over ranks it is
the total energy with every edge and every atom counted exactly once (a pair
potential gives each directed edge 1/2 of the pair energy). Forces are
``-dE/dpositions`` by autograd. Energies keep the dtype of the positions (fp64
stays fp64).

Stress and virial, one sign convention for the whole package (serial evaluator,
distributed evaluator, MD results, ASE calculator): for a symmetric strain
``eps`` applied to positions and shifts alike (``x -> x (I + eps)``),

    stress = (1/V) dE/d(eps)       (eV/A^3; ASE's sign: positive = tensile)
    virial = -dE/d(eps) = -V stress  (eV; = sum over pairs of r_ij (x) f_ij)

Both are ``[3, 3]``; the virial exists for any box, the stress only for a cell
with a volume (``None`` for an open box without one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
from torch import nn

from twinshard.atoms.data.neighbors import Edges, VerletList, half_of, neighbor_list
from twinshard.atoms.data.system import System

__all__ = [
    "Graph",
    "Potential",
    "Results",
    "identity",
    "graph_from_system",
    "strained",
    "energy_forces_stress",
    "error_figures",
    "evaluate",
    "has_analytic",
    "lookup_species",
]


def error_figures(
    energy: Any,
    forces: torch.Tensor,
    ref_energy: Any,
    ref_forces: torch.Tensor,
    *,
    stress: torch.Tensor | None = None,
    ref_stress: torch.Tensor | None = None,
    virial: torch.Tensor | None = None,
    ref_virial: torch.Tensor | None = None,
) -> dict[str, float | None]:
    """The parity figures every report prints (``md --check-serial``, ``validate``, ``bench
    atoms``): ``energy_rel_error`` (relative to ``|ref_energy|``, floored at 1e-300 so a zero
    reference energy gives a large figure, not a division error), ``max_force_error`` (forces
    in the same atom order), ``max_stress_error`` and ``max_virial_error`` (None where either
    side has none)."""

    def worst(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
        if a is None or b is None:
            return None
        return float((a - b).abs().max()) if a.numel() else 0.0

    e, e_ref = float(energy), float(ref_energy)
    return {
        "energy_rel_error": abs(e - e_ref) / max(abs(e_ref), 1e-300),
        "max_force_error": worst(forces, ref_forces),
        "max_stress_error": worst(stress, ref_stress),
        "max_virial_error": worst(virial, ref_virial),
    }


def has_analytic(potential: object) -> bool:
    """Whether ``potential`` has a closed-form pair path ``analytic(...)`` (each pair once, no
    autograd: see :meth:`twinshard.atoms.potentials.lj.LennardJones.analytic`)."""
    return callable(getattr(potential, "analytic", None))


def lookup_species(table: torch.Tensor, numbers: torch.Tensor, who: str, species: list[int]) -> torch.Tensor:
    """The parameter row of each atomic number (``table[z]``, -1 for a number without parameters),
    raising a clear ``ValueError`` for an unknown one. Written for plain models whose ``numbers``
    may be a ShardTensor: elementwise ops and one global ``any`` (no ``max``/``tolist`` of local
    rows), so every rank takes the same decision."""
    known = numbers < table.numel()
    rows = table[torch.where(known, numbers, torch.zeros_like(numbers))]
    if bool(((rows < 0) | ~known).any()):
        raise ValueError(f"{who} has no parameters for some atomic numbers; it knows {species}")
    return rows


def identity(x: torch.Tensor) -> torch.Tensor:
    """The serial ``refresh``: every row is owned, nothing to overwrite."""
    return x


@dataclass
class Graph:
    """One block of atoms with its directed edges (see the module docstring)."""

    positions: torch.Tensor
    numbers: torch.Tensor
    senders: torch.Tensor
    receivers: torch.Tensor
    shifts: torch.Tensor
    n_owned: int | None = None
    refresh: Callable[[torch.Tensor], torch.Tensor] = field(default=identity)

    def __post_init__(self) -> None:
        n = self.positions.shape[0]
        if self.n_owned is None:
            self.n_owned = n
        if not 0 <= self.n_owned <= n:
            raise ValueError(f"n_owned={self.n_owned} must be within [0, {n}]")
        if self.senders.shape != self.receivers.shape or self.shifts.shape != (
            self.senders.shape[0],
            3,
        ):
            raise ValueError(
                f"senders {list(self.senders.shape)}, receivers {list(self.receivers.shape)} and "
                f"shifts {list(self.shifts.shape)} must be [E], [E], [E, 3]"
            )

    @property
    def n_atoms(self) -> int:
        return int(self.positions.shape[0])

    def edge_vectors(self) -> torch.Tensor:
        """r_ij = positions[senders] + shifts - positions[receivers], shape [E, 3]."""
        return self.positions[self.senders] + self.shifts - self.positions[self.receivers]


class Potential(nn.Module):
    """Base class: subclasses set ``cutoff`` and implement ``forward(graph) -> [n]``."""

    cutoff: float
    species: list[int]

    def forward(self, graph: Graph) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def set_species(self, species: list[int]) -> None:
        """Register the atomic numbers this potential has parameters for, in parameter-row order."""
        self.species = [int(z) for z in species]
        table = torch.full((max(self.species) + 1,), -1, dtype=torch.int64)
        table[torch.tensor(self.species)] = torch.arange(len(self.species))
        self.register_buffer("species_index", table, persistent=False)

    def species_rows(self, numbers: torch.Tensor) -> torch.Tensor:
        """The parameter row of each atom's species; a clear error for unknown atomic numbers."""
        table = self.species_index
        if numbers.numel() and (
            int(numbers.max()) >= table.numel()
            or bool((table[numbers.clamp(0, table.numel() - 1)] < 0).any())
        ):
            missing = sorted(set(numbers.tolist()) - set(self.species))
            raise ValueError(
                f"{type(self).__name__} has no parameters for atomic numbers {missing}; it knows "
                f"{self.species}: build it with species={sorted(set(self.species) | set(missing))}"
            )
        return table[numbers]


class Results(NamedTuple):
    """Energy (scalar tensor), per-atom energies [n], forces [n, 3], stress [3, 3] or None,
    virial [3, 3] or None (see the module docstring for the sign convention). The one result
    type: a distributed evaluation returns it too, with the owned rows as ``per_atom`` and
    ``forces`` and energy, stress and virial replicated."""

    energy: torch.Tensor
    per_atom: torch.Tensor
    forces: torch.Tensor
    stress: torch.Tensor | None
    virial: torch.Tensor | None = None


def graph_from_system(system: System, cutoff: float, edges: Edges | None = None) -> Graph:
    """The serial graph of a whole system (all atoms owned, identity refresh)."""
    if edges is None:
        edges = neighbor_list(system.positions, cutoff, system.cell, system.pbc)
    return Graph(
        positions=system.positions,
        numbers=system.numbers,
        senders=edges.senders,
        receivers=edges.receivers,
        shifts=edges.shifts.to(system.positions.dtype),
        n_owned=system.n_atoms,
    )


def strained(graph: Graph, strain: torch.Tensor) -> Graph:
    """The graph deformed by ``I + sym(strain)`` (positions and shifts alike)."""
    eps = 0.5 * (strain + strain.transpose(0, 1))
    return replace(
        graph,
        positions=graph.positions + graph.positions @ eps,
        shifts=graph.shifts + graph.shifts @ eps,
    )


def energy_forces_stress(
    potential: nn.Module, graph: Graph, volume: float | None, compute_stress: bool = True
) -> Results:
    """Energy of the owned atoms, forces on every row, virial and stress (if ``volume``).

    The positions in ``graph`` are detached and made a leaf here; the forces
    returned for halo rows (if any) are partial and belong to their owners.
    ``compute_stress``: also the virial (any box) and the stress (a box with a volume).
    """
    dtype = graph.positions.dtype
    pos = graph.positions.detach().requires_grad_(True)
    strain = torch.zeros(3, 3, dtype=dtype, device=pos.device, requires_grad=True)
    g = replace(graph, positions=pos)
    want_stress = compute_stress
    if want_stress:
        g = strained(g, strain)
    per_atom = potential(g)
    if per_atom.shape != (graph.n_atoms,):
        raise ValueError(
            f"a potential must return per-atom energies of shape [{graph.n_atoms}], "
            f"got {list(per_atom.shape)}"
        )
    energy = per_atom[: graph.n_owned].sum()
    inputs = [pos, strain] if want_stress else [pos]
    grads = torch.autograd.grad(energy, inputs, allow_unused=True)
    forces = -grads[0] if grads[0] is not None else torch.zeros_like(pos)
    stress = virial = None
    if want_stress:
        dstrain = (grads[1] if grads[1] is not None else torch.zeros_like(strain)).detach()
        virial = -dstrain
        if volume is not None and volume > 0:
            stress = dstrain / volume
    return Results(energy.detach(), per_atom.detach(), forces.detach(), stress, virial)


def evaluate(
    potential: nn.Module,
    system: System,
    edges: Edges | VerletList | None = None,
    compute_stress: bool = True,
    analytic: bool | None = None,
) -> Results:
    """Serial energy, per-atom energies, forces, stress and virial of a whole system.

    ``edges`` may be a prebuilt list (built with at least the potential's
    cutoff) or a :class:`VerletList` that is updated here. Stress is ``None``
    for a cell without volume (an open box given no cell).

    ``analytic``: use the potential's closed-form pair path (each pair once, from
    a half list; a full ``edges`` list is halved) instead of autograd over the
    full edge list; default: whenever the potential has one (:func:`has_analytic`).
    ``analytic=False`` is the autograd reference.
    """
    cutoff = float(potential.cutoff)
    fast = has_analytic(potential) if analytic is None else bool(analytic)
    if fast and not has_analytic(potential):
        raise ValueError(f"{type(potential).__name__} has no analytic path; use analytic=False")
    if isinstance(edges, VerletList):
        if edges.cutoff < cutoff:
            raise ValueError(f"Verlet list cutoff {edges.cutoff} < potential cutoff {cutoff}")
        edges, _ = edges.update(system.positions, system.cell, system.pbc, half=fast)
    elif edges is not None and fast:
        edges = half_of(edges)
    volume = system.volume if system.volume > 0 else None
    if fast:
        if edges is None:
            edges = neighbor_list(system.positions, cutoff, system.cell, system.pbc, half=True)
        dtype = system.positions.dtype
        pair = potential.analytic(
            system.positions,
            system.numbers,
            edges.receivers,
            edges.senders,
            edges.shifts.to(dtype),
            compute_virial=compute_stress,
        )
        stress = virial = None
        if compute_stress:
            virial = pair.virial
            if volume is not None and volume > 0:
                stress = -virial / volume
        return Results(pair.per_atom.sum(), pair.per_atom, pair.forces, stress, virial)
    graph = graph_from_system(system, cutoff, edges)
    return energy_forces_stress(potential, graph, volume, compute_stress)
