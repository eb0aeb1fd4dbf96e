"""An ASE calculator for twinshard potentials, serial or distributed.

``TwinshardCalculator(potential)`` evaluates any module that follows the
potential contract (:mod:`twinshard.atoms.potentials.base`):

- serially (default when no world is initialised, or ``distributed=False``):
  :func:`~twinshard.atoms.potentials.base.evaluate` on the whole system;
- distributed (default inside an initialised world of more than one rank, or
  ``distributed=True``): every rank of the world calls the calculator on the
  same ``ase.Atoms`` (as an ASE optimiser or MD loop replicated on every rank
  does); the system is scattered from rank ``src`` with
  :class:`~twinshard.atoms.parallel.sharded.ShardedSystem` (``storage="halo"``, spatial blocks with
  halo atoms) or :class:`~twinshard.atoms.parallel.graph_storage.GraphSharded` (``storage="graph"``,
  atoms split by index, geometry replicated: plain-PyTorch models only), evaluated with
  :class:`~twinshard.atoms.parallel.distributed.DistributedPotential`, and energy,
  per-atom energies, forces and stress come back replicated on every rank.

Distributed collectives per calculation: those of ``ShardedSystem.scatter``
(a fail-together step, broadcasts, one all_to_all per field), of
``DistributedPotential.compute`` (halo exchanges forward and backward, one
all_reduce; with graph storage the model's row all-to-alls and per-system all-reduces
instead) and three all_gathers (counts, then ids and
per-atom results). Memory per rank: the owned atoms and their halo for the
evaluation, plus the replicated ``[N, 4]`` result the calculator must return
to ASE.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from ase.calculators.calculator import Calculator, CalculatorError, all_changes
from torch import nn

from twinshard.atoms.data.io import as_system
from twinshard.atoms.dynamics.sanity import nonfinite_rows
from twinshard.atoms.parallel.evaluate import evaluate
from twinshard.atoms.parallel.plain_inputs import evaluate_serial

__all__ = ["NonFiniteResults", "TwinshardCalculator", "evaluate_distributed"]


class NonFiniteResults(CalculatorError):
    """The potential returned NaN/inf (raised on every rank: the results are replicated)."""


def check_finite(energy: float, per_atom: torch.Tensor, forces: torch.Tensor, stress: Any) -> None:
    """Raise :class:`NonFiniteResults` naming each non-finite quantity and its atoms (indices
    of the ``Atoms``) instead of handing NaN/inf to ASE."""
    bad = [] if np.isfinite(energy) else [f"energy ({energy})"]
    for name, t in (("per-atom energies", per_atom), ("forces", forces)):
        rows = nonfinite_rows(t)
        if rows:
            bad.append(f"{name} of atoms {rows[:10]}{' ...' if len(rows) > 10 else ''}")
    if stress is not None and not bool(torch.isfinite(stress).all()):
        bad.append("stress")
    if bad:
        raise NonFiniteResults(
            f"TwinshardCalculator: the potential returned non-finite {', '.join(bad)}; check the "
            "structure (two atoms at the same position, or closer than the potential can handle?)"
        )


evaluate_distributed = evaluate  # the calculator's name for the one distributed evaluation


class TwinshardCalculator(Calculator):
    """ASE calculator: energy, free_energy, energies, forces, stress (Voigt, eV/A^3).

    Args:
        potential: a module following the potential contract (``LennardJones``,
            ``MessagePassingPotential``, or your own), or a plain dict-contract model
            (:mod:`twinshard.atoms.parallel.plain_inputs`): a mace-torch ``MACE`` / ``ScaleShiftMACE``
            module (wrapped in ``MaceAdapter``; distributed through the ShardTensor dispatch).
        distributed: ``None`` = distributed iff a twinshard world of more than
            one rank is initialised; ``True`` requires a world.
        src: the rank whose copy of the atoms is scattered (distributed).
        skin: extra ghost width of the distributed halo (0 is exact for a
            one-shot evaluation).
        dtype: float dtype of the computation (default fp64).
        storage: ``"halo"`` (spatial blocks with halo atoms) or ``"graph"`` (atoms split by
            index, geometry replicated; plain-PyTorch models such as MACE only).
    """

    implemented_properties = ["energy", "free_energy", "energies", "forces", "stress"]

    def __init__(
        self,
        potential: nn.Module,
        distributed: bool | None = None,
        src: int = 0,
        skin: float = 0.0,
        dtype: torch.dtype = torch.float64,
        storage: str = "halo",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        from twinshard.atoms.parallel.plain_inputs import as_potential

        potential = as_potential(potential)  # a bare MACE module: behind MaceAdapter
        if not hasattr(potential, "cutoff"):
            raise TypeError("potential must have a float `cutoff` (see twinshard.atoms.potentials)")
        self.potential = potential
        self.distributed = distributed
        self.src = int(src)
        self.skin = float(skin)
        self.dtype = dtype
        from twinshard.atoms.parallel.storage import STORAGES

        if storage not in STORAGES:
            raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
        self.storage = storage

    def _use_world(self) -> bool:
        from twinshard.runtime import get_world, require_world

        if self.distributed is None:
            world = get_world()
            return world is not None and world.size > 1
        if self.distributed:
            require_world("TwinshardCalculator(distributed=True)")
        return bool(self.distributed)

    def calculate(
        self, atoms: Any = None, properties: Any = ("energy",), system_changes: Any = all_changes
    ) -> None:
        super().calculate(atoms, properties, system_changes)
        system = as_system(self.atoms, self.dtype, what="the calculator's atoms")
        if hasattr(self.potential, "check_species"):  # every rank holds the same atoms: all raise
            self.potential.check_species(system.numbers.unique().tolist())
        if self._use_world():
            from twinshard.runtime import get_world

            world = get_world()
            mine = system if world is not None and world.rank == self.src else None
            res = evaluate_distributed(self.potential, mine, self.src, self.skin, storage=self.storage)
            order = torch.argsort(system.ids).to(res.forces.device)  # results come sorted by id
            inv = torch.empty_like(order)
            inv[order] = torch.arange(order.numel(), device=order.device)
            per_atom, forces = res.per_atom[inv], res.forces[inv]
        else:
            res = evaluate_serial(self.potential, system)
            per_atom, forces = res.per_atom, res.forces
        energy = float(res.energy)
        check_finite(energy, per_atom, forces, res.stress)  # every rank holds the same values
        self.results["energy"] = energy
        self.results["free_energy"] = energy
        self.results["energies"] = per_atom.detach().cpu().double().numpy()
        self.results["forces"] = forces.detach().cpu().double().numpy()
        if res.stress is not None:
            s = res.stress.detach().cpu().double().numpy()
            self.results["stress"] = np.array([s[0, 0], s[1, 1], s[2, 2], s[1, 2], s[0, 2], s[0, 1]])
