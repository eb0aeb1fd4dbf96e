"""Inputs for plain-PyTorch models (MACE-like dict contract), serial and as ShardTensors.

A *plain* model (e.g. :class:`~twinshard.atoms.potentials.mpnn_plain.PlainMessagePassing`)
takes ``data = {positions [n, 3], numbers [n], senders [E], receivers [E], shifts [E, 3]
(cartesian), batch [n], cell [S, 3, 3]}`` (plus ``charge [S]`` / ``spin [S]`` when every
system's ``info`` has them: the per-system values of :data:`SYSTEM_VALUES`) and returns a dict with ``node_energy [n]``,
``energy [S]`` and, when asked, ``forces``, ``virial`` and ``stress`` (computed by the model
itself with ``torch.autograd.grad``). It never calls twinshard.

Distributed (:func:`block_inputs`), each rank's block is ``[owned | halo]`` as
ShardTensors with the halo plan: ``positions`` hold the owned (unwrapped) rows and a STALE
halo, so the model's first gather refreshes it through the dispatch (forward exchange;
backward: halo gradients summed onto their owners, so ``-dE/dpositions`` is complete on the
owned rows); ``numbers`` and ``batch`` are FRESH; the lattice images of the halo rows, the
frame shifts of owned rows and the block neighbour list's own shifts along the wrap axes
(periodic axes with one rank, where no image is a halo row) are all carried by the edge
``shifts``, so every halo row is a plain copy of its owner's row. ``cell`` is replicated.

:func:`dispatch_energies` / :func:`dispatch_compute` are the ``mode="dispatch"`` paths of
:class:`~twinshard.atoms.parallel.distributed.DistributedPotential`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from twinshard.atoms.data.neighbors import Edges, RadiusGraph, VerletList, neighbor_list
from twinshard.atoms.data.system import System
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials.base import Results
from twinshard.comm.ops import sync_params
from twinshard.comm.primitives import group_size
from twinshard.shard.dispatch import lazy_halo
from twinshard.shard.placements import HaloPadded, HaloState, ShardSpec
from twinshard.shard.shard_tensor import ShardTensor, from_local, to_local

__all__ = [
    "as_potential",
    "block_inputs",
    "dispatch_compute",
    "dispatch_energies",
    "evaluate_plain",
    "evaluate_reference",
    "evaluate_serial",
    "is_plain",
    "potential_mode",
    "system_inputs",
    "system_values",
]

# per-system scalars a model may read (a charged or spin-polarised MLIP): from ``System.info``,
# replicated on every rank, ``[S]`` in the positions' dtype
SYSTEM_VALUES = ("charge", "spin")


def system_values(infos: list[dict[str, Any]], like: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{key: [S]}`` for each key of :data:`SYSTEM_VALUES` that every system's info holds."""
    out = {}
    for key in SYSTEM_VALUES:
        if infos and all(key in info for info in infos):
            out[key] = torch.tensor(
                [float(info[key]) for info in infos], dtype=like.dtype, device=like.device
            )
    return out


def is_plain(model: Any) -> bool:
    """Does ``model`` follow the plain dict contract (``plain_contract = True``, or a ``forward``
    taking ``compute_forces``) rather than the Graph contract?"""
    if getattr(model, "plain_contract", False):
        return True
    import inspect

    fwd = getattr(model, "forward", None)
    try:
        return fwd is not None and "compute_forces" in inspect.signature(fwd).parameters
    except (TypeError, ValueError):
        return False


def potential_mode(model: Any) -> str:
    """The ``DistributedPotential`` mode for ``model``: ``"dispatch"`` for a plain model."""
    return "dispatch" if is_plain(model) else "hooks"


def as_potential(model: Any) -> Any:
    """A bare MACE module (mace-torch's ``MACE`` / ``ScaleShiftMACE``) behind
    :class:`~twinshard.atoms.potentials.mace.MaceAdapter`; any other potential unchanged."""
    if (
        getattr(model, "cutoff", None) is None
        and hasattr(model, "r_max")
        and hasattr(model, "atomic_numbers")
    ):
        from twinshard.atoms.potentials.mace import MaceAdapter

        return MaceAdapter(model)
    return model


def radius_graph(
    positions: torch.Tensor,
    senders: torch.Tensor,
    receivers: torch.Tensor,
    shifts: torch.Tensor,
    cutoff: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The edges with ``r < cutoff`` (serial: nothing to keep between calls)."""
    return RadiusGraph()(positions, senders, receivers, shifts, cutoff)


def system_inputs(system: System, cutoff: float, edges: Edges | None = None) -> dict[str, torch.Tensor]:
    """The serial input dict of a whole system (one system, all atoms): the radius graph
    ``r < cutoff`` (a Verlet list's skin edges dropped, :func:`radius_graph`)."""
    if edges is None:
        edges = neighbor_list(system.positions, cutoff, system.cell, system.pbc)
    x = system.positions
    senders, receivers, shifts = radius_graph(
        x, edges.senders, edges.receivers, edges.shifts.to(x.dtype), cutoff
    )
    return {
        "positions": x,
        "numbers": system.numbers,
        "senders": senders,
        "receivers": receivers,
        "shifts": shifts,
        "batch": torch.zeros(system.n_atoms, dtype=torch.int64, device=x.device),
        "cell": system.cell.to(x.dtype)[None],
        **system_values([system.info], x),
    }


def evaluate_plain(
    model: nn.Module, system: System, compute_stress: bool = True, edges: Edges | VerletList | None = None
) -> Results:
    """Serial energy, per-atom energies, forces, stress and virial of a plain model.

    ``edges``: a prebuilt list (at least the model's cutoff) or a :class:`VerletList` updated here
    (edges beyond the cutoff, from the skin, must contribute nothing: a smooth cutoff)."""
    if isinstance(edges, VerletList):
        if edges.cutoff < float(model.cutoff):
            raise ValueError(f"Verlet list cutoff {edges.cutoff} < potential cutoff {model.cutoff}")
        edges, _ = edges.update(system.positions, system.cell, system.pbc, half=False)
    data = system_inputs(system, float(model.cutoff), edges)
    data["positions"] = system.positions.detach().clone().requires_grad_(True)
    out = model(data, compute_forces=True, compute_stress=compute_stress)
    stress = out.get("stress")
    virial = out.get("virial")
    return Results(
        out["energy"].sum().detach(),
        out["node_energy"].detach(),
        out["forces"].detach(),
        None if stress is None else stress[0].detach(),
        None if virial is None else virial[0].detach(),
    )


def evaluate_serial(
    potential: nn.Module, system: System, edges: Edges | VerletList | None = None, compute_stress: bool = True
) -> Results:
    """Serial evaluation of either contract: :func:`evaluate_plain` for a plain model, else
    :func:`~twinshard.atoms.potentials.base.evaluate` (the Graph contract)."""
    if is_plain(potential):
        return evaluate_plain(potential, system, compute_stress, edges)
    from twinshard.atoms.potentials.base import evaluate

    return evaluate(potential, system, edges, compute_stress=compute_stress)


def evaluate_reference(potential: nn.Module, system: System, compute_stress: bool = True) -> Results:
    """The serial oracle: the model's own evaluation path where it has one (``potential.native``,
    a third-party model's own code: MACE's calculator, its neighbour list and batch), so an error
    shared by twinshard's serial and distributed paths cannot hide; else :func:`evaluate_serial`."""
    native = getattr(potential, "native", None)
    if callable(native):
        return native(system, compute_stress)
    return evaluate_serial(potential, system, compute_stress=compute_stress)


def block_inputs(
    sharded: ShardedSystem,
    positions: torch.Tensor | None = None,
    wrap: bool | None = None,
    cutoff: float | None = None,
) -> dict[str, Any]:
    """This rank's ``[owned | halo]`` block as ShardTensors: the halo of ``positions`` is STALE and
    refreshed by the model's first gather (differentiable, in the dispatch).

    The edges are the block's radius graph ``r < cutoff`` (default ``sharded.cutoff``) at these
    positions, as the model's own neighbour list would give it: the Verlet list (``cutoff +
    skin``) minus its skin edges. That needs the halo rows' current positions: one forward
    exchange of the owned positions (no autograd, no vote; ``3 x n_halo`` numbers), the only
    communication here.

    A group of one rank with no halo rows (P = 1: every image is an edge shift) gets plain
    tensors: there is nothing to exchange or reduce, so the model runs exactly as serially,
    without the dispatch's per-op cost (``bench atoms --mode overhead``: dispatch / plain at P = 1).
    ``wrap=True`` wraps them anyway (a 1-rank check of the dispatch itself)."""
    plan, e = sharded.plan, sharded.edges
    assert plan is not None and e is not None
    x = sharded.positions if positions is None else positions
    rc = float(sharded.cutoff if cutoff is None else cutoff)
    nh = sharded.n_halo
    numbers = torch.cat([sharded.numbers, sharded.halo_numbers])
    batch = torch.zeros(sharded.n_owned + nh, dtype=torch.int64, device=x.device)
    if wrap or nh > 0 or group_size(sharded.group) > 1:
        stale = ShardSpec(HaloPadded(plan), HaloState.STALE, sharded.group, 1)
        fresh = stale.with_state(HaloState.FRESH)
        pos = from_local(torch.cat([x, x.new_zeros(nh, 3)]), stale)
        numbers, batch = ShardTensor.wrap(numbers, fresh), ShardTensor.wrap(batch, fresh)
    else:
        pos = x
    cell = sharded.cell.to(x.device, x.dtype)
    # halo rows are plain copies of their owners' rows; the edge shifts carry every image. Every
    # rank takes part (a rank without halo rows may still send rows to its neighbours)
    block = torch.cat([x.detach(), plan.forward_copy(x.detach(), op="halo_radius")])
    senders, receivers, shifts = sharded.radius_graph(
        block, e.senders, e.receivers, sharded.edge_shifts(x.dtype, x.device), rc
    )
    return {
        "positions": pos,
        "numbers": numbers,
        "senders": senders,
        "receivers": receivers,
        "shifts": shifts,
        "batch": batch,
        "cell": cell[None],
        **system_values([sharded.info], x),
    }


def call_plain_model(dp: Any, sharded: ShardedSystem, data: dict, **flags: Any) -> dict:
    named = list(dp.module.named_parameters())
    synced = sync_params([p for _, p in named], sharded.group)
    with lazy_halo():  # scatters leave the halo STALE: one exchange per layer, as a refresh hook
        out = functional_call(dp.module, {n: p for (n, _), p in zip(named, synced)}, (data,), flags)
    _check_per_atom_outputs(dp.module, data, out)
    return out


def _check_per_atom_outputs(model: Any, data: dict, out: dict) -> None:
    """A model run on ShardTensor inputs returns its per-atom results (``node_energy``,
    ``forces``) as ShardTensors: they came from the dispatch (forces: the gradient with respect to
    the positions ShardTensor, whose halo contributions the gather's adjoint sent to their
    owners). A PLAIN per-atom result was computed outside it, e.g. edge gradients scattered into
    a fresh ``torch.zeros(n_local, 3)`` (a LAMMPS-style force head), and its halo rows' partial
    sums never reach their owners: refuse it rather than hand back a silently wrong result.
    The types come from the model's code, so every rank raises (no collective is pending)."""
    if not isinstance(data["positions"], ShardTensor):
        return  # plain inputs (one rank, no halo): the model ran as serially
    for key in ("node_energy", "forces"):
        v = out.get(key)
        if isinstance(v, torch.Tensor) and not isinstance(v, ShardTensor):
            raise ValueError(
                f"{type(model).__name__} returned its per-atom {key!r} as a plain tensor from ShardTensor "
                "inputs: it was computed outside the dispatch (e.g. edge gradients scattered into a plain "
                "buffer of the block's rows), so the partial sums of halo rows never reach their owners. "
                "Compute it from the positions (torch.autograd.grad of the energy with respect to "
                'data["positions"]), or scatter into a buffer made from a per-atom input '
                "(torch.zeros_like(positions)), so the dispatch sees it"
            )


def _owned(t: torch.Tensor, n: int) -> torch.Tensor:
    return to_local(t)[:n]


def dispatch_energies(dp: Any, sharded: ShardedSystem, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Collective: owned per-atom energies ``[n_owned]`` of a plain model (differentiable)."""
    data = block_inputs(sharded, positions, cutoff=dp.cutoff)
    out = call_plain_model(dp, sharded, data, compute_forces=False, compute_stress=False)
    return _owned(out["node_energy"], sharded.n_owned)


def dispatch_compute(dp: Any, sharded: ShardedSystem, compute_stress: bool, create_graph: bool) -> Results:
    """Collective: the :class:`Results` (owned rows) of a plain model computing its own
    forces and stress; energy, virial and stress come back replicated from the dispatch."""
    x = sharded.positions.detach().requires_grad_(True)
    data = block_inputs(sharded, x, cutoff=dp.cutoff)
    out = call_plain_model(
        dp, sharded, data, compute_forces=True, compute_stress=compute_stress, training=create_graph
    )
    n = sharded.n_owned
    energy = to_local(out["energy"]).sum()
    per_atom, forces = _owned(out["node_energy"], n), _owned(out["forces"], n)
    virial = stress = None
    if compute_stress:
        virial = to_local(out["virial"])[0]
        if out.get("stress") is not None and sharded.volume > 0:
            stress = to_local(out["stress"])[0]
    if not create_graph:
        energy, per_atom, forces = energy.detach(), per_atom.detach(), forces.detach()
        virial = None if virial is None else virial.detach()
        stress = None if stress is None else stress.detach()
    return Results(energy, per_atom, forces, stress=stress, virial=virial)
