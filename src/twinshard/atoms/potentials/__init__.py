"""Reference interatomic potentials, the potential contract (see ``base``) and the one factory
(:func:`make_potential`)."""

from typing import Any

import torch

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


def make_potential(
    name: str,
    species: list[int] | None = None,
    *,
    model: str | None = None,
    plain: bool = False,
    **kwargs: object,
) -> Any:
    """The one potential factory of the particle side (``twinshard md``, ``validate``, ``run_md``'s
    callers and the benches build by name through it).

    - ``"lj"``: :class:`LennardJones` (``species`` other than argon take the embedded mixture's
      parameters unless ``parameters=`` is given);
    - ``"mpnn"``: the message-passing model for ``species``; ``plain=True`` its plain-PyTorch form
      (:class:`~twinshard.atoms.potentials.mpnn_plain.PlainMessagePassing`, the same draws: for
      graph storage and the dispatch); ``model``: a ``state_dict`` file loaded into it;
    - ``"mace"``: mace-torch's MACE behind ``MaceAdapter``: the saved model ``model``
      (``torch.save`` of the module) or, without it, the small random-weight MACE for its default
      species and ``species``; a species the model does not know raises a clear ``ValueError``.
    """
    if model is not None and name == "lj":
        raise ValueError("a model file is an option of the mpnn and mace potentials")
    if name == "mace":
        if kwargs:
            raise ValueError(f"the mace potential takes no options {sorted(kwargs)}: its cutoff is its r_max")
        from twinshard.atoms.potentials.mace import DEFAULT_SPECIES, MaceAdapter, build_mace, load_mace

        known = sorted(set(DEFAULT_SPECIES) | set(species or ()))
        adapter = MaceAdapter(load_mace(model) if model else build_mace(species=known))
        if species is not None:
            adapter.check_species(species)
        return adapter
    if name == "mpnn" and plain:
        from twinshard.atoms.potentials.mpnn_plain import PlainMessagePassing

        net = PlainMessagePassing(species=species or (18,), **kwargs)  # type: ignore[arg-type]
        if model:
            net.load_state_dict(torch.load(model, weights_only=True))
        return net
    if plain:
        raise ValueError(f"plain=True: only mpnn has a plain-PyTorch form here, not {name!r}")
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
        net = MessagePassingPotential(**kwargs)  # type: ignore[arg-type]
        if model:
            net.load_state_dict(torch.load(model, weights_only=True))
        return net
    raise ValueError(f"unknown potential {name!r}; choose 'lj', 'mpnn' or 'mace'")
