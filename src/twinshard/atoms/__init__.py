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
  (the error of a run that left physics: :mod:`twinshard.atoms.dynamics.sanity`);
- ASE: :class:`TwinshardCalculator` (:class:`NonFiniteResults` when the potential returns NaN/inf).
"""

from twinshard._moved import alias as _alias
from twinshard.atoms.calculator import NonFiniteResults, TwinshardCalculator, evaluate_distributed
from twinshard.atoms.data.io import StructureReadError, read, read_trajectory, write
from twinshard.atoms.data.structures import fcc_argon, lj_mixture, random_packing, triclinic_argon
from twinshard.atoms.data.system import System
from twinshard.atoms.dynamics.api import MDResult, run_md
from twinshard.atoms.dynamics.md import (
    Langevin,
    SerialEngine,
    ThermoLog,
    VelocityVerlet,
    load_checkpoint,
    maxwell_boltzmann,
    save_checkpoint,
    simulate,
)
from twinshard.atoms.dynamics.sanity import Diverged
from twinshard.atoms.parallel.distributed import DistributedPotential, DistributedResults
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials import (
    Graph,
    LennardJones,
    MessagePassingPotential,
    Potential,
    Results,
    evaluate,
    make_potential,
)

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

# Old module paths (``twinshard.atoms.md``, ``twinshard.atoms.sharded``, ...) for one release: the
# modules moved into data/, parallel/ and dynamics/.
_alias(
    __name__,
    {
        m: f"twinshard.atoms.{group}.{m}"
        for group, modules in (
            ("data", ("system", "io", "structures", "cells", "neighbors")),
            (
                "parallel",
                (
                    "partition",
                    "halo",
                    "sharded",
                    "graph_storage",
                    "graph_batch",
                    "distributed",
                    "plain_inputs",
                    "validate",
                ),
            ),
            ("dynamics", ("integrators", "md", "md_files", "provenance", "sanity", "driver", "api")),
        )
        for m in modules
    }
    | {"md_cli": "twinshard.cli.md"},  # the command line lives in twinshard.cli
)
