"""Reference interatomic potentials and the potential contract (see ``base``)."""

from twinshard.atoms.potentials.base import (
    Graph,
    Potential,
    Results,
    energy_forces_stress,
    evaluate,
    graph_from_system,
    has_analytic,
    identity,
    strained,
)
from twinshard.atoms.potentials.lj import LennardJones
from twinshard.atoms.potentials.mpnn import MessagePassingPotential

__all__ = [
    "Graph",
    "Potential",
    "Results",
    "LennardJones",
    "MessagePassingPotential",
    "energy_forces_stress",
    "evaluate",
    "graph_from_system",
    "has_analytic",
    "identity",
    "strained",
    "make_potential",
]


def make_potential(name: str, species: list[int] | None = None, **kwargs: object) -> Potential:
    """``"lj"`` or ``"mpnn"`` by name; ``species`` sizes the MPNN embedding / checks LJ."""
    if name == "lj":
        if species is not None and set(species) - {18}:
            from twinshard.atoms.data.structures import lj_mixture_parameters

            params = lj_mixture_parameters()
            unknown = sorted(set(species) - set(params))
            if unknown:
                raise ValueError(f"no default LJ parameters for atomic numbers {unknown}")
            kwargs.setdefault("parameters", {z: params[z] for z in species})
        return LennardJones(**kwargs)  # type: ignore[arg-type]
    if name == "mpnn":
        if species is not None:
            kwargs.setdefault("species", species)
        return MessagePassingPotential(**kwargs)  # type: ignore[arg-type]
    raise ValueError(f"unknown potential {name!r}; choose 'lj' or 'mpnn'")
