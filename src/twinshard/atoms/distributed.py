"""The distributed potential: a serial potential evaluated on halo-padded blocks.

:class:`DistributedPotential` wraps any module that follows the potential
contract (:mod:`twinshard.atoms.potentials.base`: ``cutoff`` and
``forward(graph) -> per-atom energies``) and evaluates it on each rank's
``[owned | halo]`` block of a :class:`~twinshard.atoms.sharded.ShardedSystem`.

Placements:
    in:  owned positions ``Shard(0)`` (uneven), parameters replicated;
    out: ``energy`` (scalar) and ``virial`` / ``stress`` ``[3, 3]`` replicated
         (all-reduced); ``per_atom`` energies and ``forces`` ``Shard(0)``, rows
         matching ``sharded.ids``.

Counting: each rank keeps the energies of its owned atoms only, and the block's
edges all have owned receivers (an edge contributes to its receiver), so summed
over ranks every atom and every edge counts exactly once. Periodic images are
explicit halo rows, so the block has open boundaries and zero edge shifts.

Collectives per evaluation:
    forward:  one halo forward exchange of the positions, plus one per
              ``graph.refresh`` call of the model (a message-passing model
              refreshes its node features before each layer: a one-cutoff halo
              refreshed per layer, not a layers x cutoff halo); each exchange
              first agrees on its autograd path (one all_gather of a vote);
    backward: the adjoint reverse exchange of each of those (halo partial
              gradients summed onto their owners, in >= fp64 for fp64), and,
              when parameter gradients are asked for, one all-reduce of the
              flat parameter gradient per dtype (``comm.sync_params``);
    then one all_reduce of ``[energy, virial (9)]``; and once per neighbour-list
    build, a fail-together agreement on a communication-free probe of the block's
    inputs (so an input error the model finds on some ranks is raised on all).
Memory per rank: the autograd graph of the block (owned + halo atoms, owned-
receiver edges), i.e. ~(N/P + halo) / N of the serial graph; nothing scales with N.

Stress: a symmetric strain leaf ``eps`` is applied to the whole padded block
(``x -> x (I + eps)``; halo rows carry their lattice image, so this strains the
cell too); ``dE/deps`` is summed over ranks. ``stress = (dE/deps) / V`` (ASE's
sign: positive is tensile) for any cell with a volume (as the serial evaluator),
``virial = -dE/deps`` always.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.func import functional_call

from twinshard.atoms.potentials.base import Graph, strained
from twinshard.atoms.sharded import ShardedSystem
from twinshard.comm import primitives as prim
from twinshard.comm.ops import sync_params
from twinshard.runtime import agree_step

__all__ = ["DistributedPotential", "DistributedResults"]


class DistributedResults(NamedTuple):
    """``energy`` (replicated scalar), ``per_atom [n_owned]``, ``forces [n_owned, 3]``,
    ``virial [3, 3]`` (replicated), ``stress [3, 3]`` or None (replicated)."""

    energy: torch.Tensor
    per_atom: torch.Tensor
    forces: torch.Tensor
    virial: torch.Tensor | None
    stress: torch.Tensor | None


class DistributedPotential:
    """Run a serial potential on a sharded system with serial-identical results.

    The wrapped module keeps its own parameter names: ``dp.state_dict()`` is the
    serial ``state_dict`` and a serial checkpoint loads unchanged.

    Example (every rank)::

        sharded = ShardedSystem.scatter(system if rank == 0 else None,
                                        cutoff=pot.cutoff, skin=1.0)
        dp = DistributedPotential(pot)
        res = dp.compute(sharded)           # energy, per_atom, forces, virial, stress
        ...integrate owned atoms..., then sharded.update()
    """

    def __init__(self, potential: nn.Module) -> None:
        if not hasattr(potential, "cutoff"):
            raise TypeError("the potential must have a float attribute `cutoff` (see potentials.base)")
        self.module = potential
        self._probed: tuple[int, int] | None = None

    @property
    def cutoff(self) -> float:
        return float(self.module.cutoff)

    # -- the serial module's parameters, unchanged names
    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> Any:
        return self.module.load_state_dict(state, strict=strict)

    def _check(self, sharded: ShardedSystem) -> None:
        if sharded.cutoff + 1e-12 < self.cutoff:
            raise ValueError(
                f"the sharded system's halo was built for cutoff {sharded.cutoff}, but the "
                f"potential needs {self.cutoff}; scatter with cutoff=potential.cutoff"
            )
        if self._probed != (id(sharded), sharded.builds):
            # Input errors the model raises on some ranks only (an atomic number it has no
            # parameters for, ...) would leave the other ranks waiting in the halo exchange.
            # Probe the block once per build on an edge-free, communication-free graph and
            # agree, so every rank raises the same error instead.
            with agree_step("distributed potential: check the block's inputs", sharded.group):
                x = sharded.positions.detach()
                numbers = torch.cat([sharded.numbers, sharded.halo_numbers])
                block = torch.cat([x, x.new_zeros(sharded.n_halo, 3)])
                none = torch.zeros(0, dtype=torch.int64, device=x.device)
                with torch.no_grad():
                    self.module(Graph(block, numbers, none, none, x.new_zeros(0, 3), sharded.n_owned))
            self._probed = (id(sharded), sharded.builds)

    # -------------------------------------------------------------- energies
    def per_atom_energies(
        self,
        sharded: ShardedSystem,
        positions: torch.Tensor | None = None,
        strain: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Collective: energies ``[n_owned]`` of the owned atoms, differentiable.

        Differentiable in ``positions`` (owned rows; default ``sharded.positions``)
        through the halo: backpropagating any function of every rank's owned
        energies delivers the complete gradient on each owner (the halo
        exchange's backward is the reverse exchange, a collective: every rank
        must run its backward). Differentiable in the parameters too: they enter
        through ``comm.sync_params`` (as in the pair twins), so the backward sums
        every rank's share and ``param.grad`` comes back complete and replicated
        (one all-reduce per parameter dtype, in backward; nothing to call after).
        ``strain`` (3x3) optionally deforms the block by ``I + sym(strain)``.
        """
        self._check(sharded)
        graph = sharded.block_graph(positions)
        if strain is not None:
            graph = strained(graph, strain)
        named = list(self.module.named_parameters())
        synced = sync_params([p for _, p in named], sharded.group)
        per_atom = functional_call(self.module, {n: p for (n, _), p in zip(named, synced)}, (graph,))
        if per_atom.shape != (graph.n_atoms,):
            raise ValueError(
                f"a potential must return per-atom energies of shape [{graph.n_atoms}] "
                f"(owned + halo rows), got {list(per_atom.shape)}"
            )
        return per_atom[: sharded.n_owned]

    def compute(
        self, sharded: ShardedSystem, compute_stress: bool = True, create_graph: bool = False
    ) -> DistributedResults:
        """Collective: total energy, owned per-atom energies, owned forces, virial, stress.

        ``create_graph`` keeps the graph of the forces (to train on forces);
        otherwise every result is detached.
        """
        dtype = sharded.dtype
        x = sharded.positions.detach().requires_grad_(True)
        strain = torch.zeros(3, 3, dtype=dtype, device=x.device, requires_grad=True)
        per_atom = self.per_atom_energies(sharded, x, strain if compute_stress else None)
        e_local = per_atom.sum()
        inputs = [x, strain] if compute_stress else [x]
        grads = torch.autograd.grad(e_local, inputs, create_graph=create_graph, allow_unused=True)
        forces = -grads[0] if grads[0] is not None else torch.zeros_like(x)
        dstrain = None
        if compute_stress:
            dstrain = grads[1] if grads[1] is not None else torch.zeros_like(strain)
        packed = torch.cat(
            [e_local.detach().reshape(1)] + ([dstrain.detach().reshape(9)] if dstrain is not None else [])
        )
        total = prim.all_reduce(packed.to(prim.reduce_dtype(dtype)), sharded.group, op="potential").to(dtype)
        energy = total[0]
        virial = stress = None
        if dstrain is not None:
            de = total[1:].reshape(3, 3)
            virial = -de
            if sharded.volume > 0:
                stress = de / sharded.volume
        if not create_graph:
            per_atom, forces = per_atom.detach(), forces.detach()
        return DistributedResults(energy, per_atom, forces, virial, stress)

    __call__ = compute
