"""The distributed potential: a serial potential evaluated on halo-padded blocks.

:class:`DistributedPotential` wraps any module that follows the potential
contract (:mod:`twinshard.atoms.potentials.base`: ``cutoff`` and
``forward(graph) -> per-atom energies``) and evaluates it on each rank's
``[owned | halo]`` block of a :class:`~twinshard.atoms.parallel.sharded.ShardedSystem`.

Placements:
    in:  owned positions ``Shard(0)`` (uneven), parameters replicated;
    out: ``energy`` (scalar) and ``virial`` / ``stress`` ``[3, 3]`` replicated
         (all-reduced); ``per_atom`` energies and ``forces`` ``Shard(0)``, rows
         matching ``sharded.ids``.

Counting: each rank keeps the energies of its owned atoms only, and the block's
edges all have owned receivers (an edge contributes to its receiver), so summed
over ranks every atom and every edge counts exactly once. Along a periodic axis
split over several ranks, periodic images are explicit halo rows (the block is
open there); along a periodic axis with one rank (a *wrap axis*) the block stays
periodic and its edges carry the lattice shift, as the serial list does (no image
rows: at P=1 a periodic block has no halo at all).

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

Analytic pair potentials (:func:`~twinshard.atoms.potentials.base.has_analytic`,
e.g. Lennard-Jones) take a fast path in :meth:`DistributedPotential.compute`
(not with ``create_graph``): the block's half list with the owner rule
(:meth:`ShardedSystem.half_edges`: each pair of the system evaluated once over
all ranks), closed-form per-atom energies, forces and virial, then one
halo forward exchange of the positions (no vote), one reverse exchange of the
halo rows' ``[force, energy]`` partial sums scatter-added into the owned rows,
and the same all_reduce of ``[energy, virial]``. No autograd graph.
``DistributedPotential(pot, analytic=False)`` forces the autograd path (the oracle).

Graph-parallel storage (the storage's type picks the path; :mod:`twinshard.atoms.parallel.storage`):
given a :class:`~twinshard.atoms.parallel.graph_storage.GraphSharded` instead of a
ShardedSystem, ``compute`` / ``per_atom_energies`` run a plain model (``mode="dispatch"``) on it
(:func:`~twinshard.atoms.parallel.graph_storage.graph_compute`; a batch of S systems gives ``[S]`` energies
and ``[S, 3, 3]`` virials and stresses).

Stress: a symmetric strain leaf ``eps`` is applied to the whole padded block
(``x -> x (I + eps)``, edge shifts alike; halo rows carry their lattice image and
edge shifts the wrap-axis images, so this strains the cell too); ``dE/deps`` is
summed over ranks. ``stress = (dE/deps) / V`` (ASE's sign: positive is tensile)
for any cell with a volume (as the serial evaluator), ``virial = -dE/deps`` always.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from twinshard.atoms.parallel.graph_storage import GraphSharded, graph_compute, graph_energies
from twinshard.atoms.parallel.plain_inputs import dispatch_compute, dispatch_energies
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials.base import Graph, Results, has_analytic, strained
from twinshard.comm import primitives as prim
from twinshard.comm.ops import sync_params
from twinshard.runtime import agree_step

__all__ = ["DistributedPotential", "DistributedResults"]


# One result type for serial and distributed evaluations (per_atom and forces are the owned
# rows when distributed); the old name stays for code that imported it.
DistributedResults = Results


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

    def __init__(self, potential: nn.Module, analytic: bool | None = None, mode: str = "hooks") -> None:
        # mode "hooks": the model follows the Graph contract and calls graph.refresh; mode "dispatch": a
        # plain-PyTorch model (dict contract, atoms.plain_inputs) runs unmodified on ShardTensor inputs
        if mode not in ("hooks", "dispatch"):
            raise ValueError(f"mode must be 'hooks' or 'dispatch', got {mode!r}")
        self.mode = mode
        if not hasattr(potential, "cutoff"):
            raise TypeError("the potential must have a float attribute `cutoff` (see potentials.base)")
        if analytic and not has_analytic(potential):
            raise ValueError(f"{type(potential).__name__} has no analytic path; use analytic=False")
        self.module = potential
        self.analytic = mode == "hooks" and (has_analytic(potential) if analytic is None else bool(analytic))
        self._probed: tuple[int, int] | None = None
        # seconds of the last compute(), by part (the benchmark reads them)
        self.timings: dict[str, float] = {}

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

    def _check_cutoff(self, sharded: ShardedSystem) -> None:
        if sharded.cutoff + 1e-12 < self.cutoff:
            raise ValueError(
                f"the sharded system's halo was built for cutoff {sharded.cutoff}, but the "
                f"potential needs {self.cutoff}; scatter with cutoff=potential.cutoff"
            )
        check = getattr(self.module, "check_species", None)
        if check is not None and self._probed != (id(sharded), sharded.builds):
            # a plain model (MACE) finds an unknown atomic number in its forward, on the ranks
            # that hold one, while the others wait in the first gather: agree first, once per build
            with agree_step("distributed potential: check the block's species", sharded.group):
                check(torch.cat([sharded.numbers, sharded.halo_numbers]).unique().tolist())
            self._probed = (id(sharded), sharded.builds)

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
        sharded: ShardedSystem | GraphSharded,
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
        if isinstance(sharded, GraphSharded):
            if strain is not None:
                raise ValueError("graph storage: the model applies its own strain (compute_stress=True)")
            return graph_energies(self, sharded, positions)
        if self.mode == "dispatch":
            if strain is not None:
                raise ValueError(
                    "mode='dispatch': the model applies its own strain (compute(compute_stress=True))"
                )
            self._check_cutoff(sharded)
            return dispatch_energies(self, sharded, positions)
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
        self, sharded: ShardedSystem | GraphSharded, compute_stress: bool = True, create_graph: bool = False
    ) -> Results:
        """Collective: total energy, owned per-atom energies, owned forces, virial, stress.

        ``create_graph`` keeps the graph of the forces (to train on forces);
        otherwise every result is detached. An analytic pair potential takes the
        closed-form path unless ``create_graph`` (same results to round-off).
        """
        if isinstance(sharded, GraphSharded):  # per-system results
            return graph_compute(self, sharded, compute_stress, create_graph)
        if self.analytic and not create_graph:
            return self._compute_analytic(sharded, compute_stress)
        if self.mode == "dispatch":
            self._check_cutoff(sharded)
            return dispatch_compute(self, sharded, compute_stress, create_graph)
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
        return Results(energy, per_atom, forces, stress=stress, virial=virial)

    def _compute_analytic(self, sharded: ShardedSystem, compute_stress: bool) -> Results:
        """Each pair once over all ranks (half list + owner rule), closed form, then the reverse sum."""
        clock = time.perf_counter
        self._check(sharded)
        t0 = clock()
        half = sharded.half_edges()  # built once per plan build, reused until the next one
        t1 = clock()
        plan = sharded.plan
        assert plan is not None
        x = sharded.positions.detach()
        block = plan.padded_positions(x, sharded.cell, vote=False)  # forward exchange, no autograd
        numbers = torch.cat([sharded.numbers, sharded.halo_numbers])
        t2 = clock()
        shifts = half.shifts.to(block.dtype) if any(plan.wrap) else None  # None: an open block
        pair = self.module.analytic(
            block, numbers, half.receivers, half.senders, shifts, compute_virial=compute_stress
        )
        t3 = clock()
        n = sharded.n_owned
        halo = torch.cat([pair.forces[n:], pair.per_atom[n:, None]], 1)  # one message: [f, e]
        back = plan.reverse_sum(halo)
        forces = pair.forces[:n] + back[:, :3]
        per_atom = pair.per_atom[:n] + back[:, 3]
        t4 = clock()
        dtype = per_atom.dtype
        e_local = per_atom.sum()
        parts = [e_local.reshape(1)]
        if compute_stress:
            parts.append(pair.virial.reshape(9))
        total = prim.all_reduce(
            torch.cat(parts).to(prim.reduce_dtype(dtype)), sharded.group, op="potential"
        ).to(dtype)
        energy = total[0]
        virial = stress = None
        if compute_stress:
            virial = total[1:].reshape(3, 3)
            if sharded.volume > 0:
                stress = -virial / sharded.volume
        t5 = clock()
        self.timings = {
            "neighbor_list": t1 - t0,
            "halo_forward": t2 - t1,
            "pairs": t3 - t2,
            "halo_reverse": t4 - t3,
            "all_reduce": t5 - t4,
        }
        return Results(energy, per_atom, forces, stress=stress, virial=virial)

    __call__ = compute
