"""Particles: systems, reference potentials, distributed evaluation and MD, the ASE calculator.

The public names, importable from ``twinshard.atoms``:

- data: :class:`System` (one box of atoms as tensors), :func:`read` / :func:`write` /
  :func:`read_trajectory` (any format ASE reads), embedded structures
  (:func:`fcc_argon`, :func:`random_packing`, :func:`lj_mixture`, :func:`triclinic_argon`);
- potentials (the contract in :mod:`twinshard.atoms.potentials.base`):
  :class:`LennardJones`, :class:`MessagePassingPotential`, :class:`Potential` (base class),
  :class:`Graph`, :func:`evaluate` (serial energy, forces, stress, virial), :func:`make_potential`;
- distributed: :class:`ShardedSystem`, :class:`DistributedPotential`,
  :func:`evaluate_distributed`;
- dynamics: :func:`run_md` (one call, local ranks or torchrun), :class:`VelocityVerlet`,
  :class:`Langevin`, :func:`maxwell_boltzmann`, :func:`simulate`, :class:`SerialEngine`,
  :class:`ThermoLog`, :func:`save_checkpoint`, :func:`load_checkpoint`; :class:`Diverged`
  (the error of a run that left physics: :mod:`twinshard.atoms.sanity`);
- ASE: :class:`TwinshardCalculator` (:class:`NonFiniteResults` when the potential returns NaN/inf).
"""

from twinshard.atoms.api import MDResult, run_md
from twinshard.atoms.calculator import NonFiniteResults, TwinshardCalculator, evaluate_distributed
from twinshard.atoms.distributed import DistributedPotential, DistributedResults
from twinshard.atoms.io import StructureReadError, read, read_trajectory, write
from twinshard.atoms.md import (
    Langevin,
    SerialEngine,
    ThermoLog,
    VelocityVerlet,
    load_checkpoint,
    maxwell_boltzmann,
    save_checkpoint,
    simulate,
)
from twinshard.atoms.potentials import (
    Graph,
    LennardJones,
    MessagePassingPotential,
    Potential,
    Results,
    evaluate,
    make_potential,
)
from twinshard.atoms.sanity import Diverged
from twinshard.atoms.sharded import ShardedSystem
from twinshard.atoms.structures import fcc_argon, lj_mixture, random_packing, triclinic_argon
from twinshard.atoms.system import System

__all__ = [
    "Diverged",
    "DistributedPotential",
    "DistributedResults",
    "Graph",
    "Langevin",
    "LennardJones",
    "MDResult",
    "MessagePassingPotential",
    "NonFiniteResults",
    "Potential",
    "Results",
    "SerialEngine",
    "ShardedSystem",
    "StructureReadError",
    "System",
    "ThermoLog",
    "TwinshardCalculator",
    "VelocityVerlet",
    "evaluate",
    "evaluate_distributed",
    "fcc_argon",
    "lj_mixture",
    "load_checkpoint",
    "make_potential",
    "maxwell_boltzmann",
    "random_packing",
    "read",
    "read_trajectory",
    "run_md",
    "save_checkpoint",
    "simulate",
    "triclinic_argon",
    "write",
]
