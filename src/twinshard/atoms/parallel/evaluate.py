"""The distributed evaluation every particle entry point shares: place a system and a potential on
the ranks (:func:`place`), gather per-atom rows in serial order (:func:`rows_by_id`), or both with
one evaluation between them (:func:`evaluate`).

``twinshard md`` and ``run_md`` (through :func:`twinshard.atoms.dynamics.run.run_rank`), the ASE
calculator, ``twinshard validate`` and the benches all build their ranks' storage and distributed
potential here, so the model contract (Graph contract with halo refreshes, analytic pair
potentials, or a plain model through the ShardTensor dispatch) is picked in one place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from twinshard.atoms.data.system import System
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.plain_inputs import as_potential, potential_mode
from twinshard.atoms.parallel.storage import Storage, scatter_storage
from twinshard.atoms.potentials.base import Results
from twinshard.comm import primitives as prim

__all__ = ["evaluate", "place", "rows_by_id"]


def place(
    system: System | Any | None,
    potential: nn.Module,
    *,
    storage: str = "halo",
    src: int = 0,
    skin: float = 0.0,
    partition: str = "spatial",
    balance: float | None = None,
    group: Any = None,
    mode: str | None = None,
    analytic: bool | None = None,
) -> tuple[Storage, DistributedPotential]:
    """Collective: scatter ``system`` (held by rank ``src``; ``None`` on the others) into the
    storage named ``storage`` (:func:`~twinshard.atoms.parallel.storage.scatter_storage`) with the
    potential's cutoff, and wrap ``potential`` (on the storage's device) in a
    :class:`DistributedPotential` whose mode follows the model contract (``mode`` overrides it:
    ``validate`` traces a model through the dispatch). A bare mace-torch module goes behind
    ``MaceAdapter`` first. Collectives: the storage's scatter. Placements: ``system`` on ``src``
    in; out, each rank's owned atoms (and its halo rows, or the replicated geometry in graph
    storage) and the potential's parameters replicated."""
    potential = as_potential(potential)
    if not hasattr(potential, "cutoff"):
        raise TypeError("potential must have a float `cutoff` and forward(graph) -> per-atom energies")
    sharded = scatter_storage(
        storage,
        system,
        src,
        cutoff=float(potential.cutoff),
        skin=skin,
        group=group,
        partition=partition,
        balance=balance,
    )
    dp = DistributedPotential(
        potential.to(sharded.device), analytic=analytic, mode=mode or potential_mode(potential)
    )
    return sharded, dp


def rows_by_id(sharded: Storage, rows: torch.Tensor, op: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Collective: every rank's owned ``rows`` (one per owned atom) gathered and ordered by global
    atom id, with the sorted ids, ``(ids, rows)``, replicated on every rank of the storage's group.
    Two all_gathers (ids, rows) of the whole system's rows: O(N) per rank, for results, not for the
    inner loop."""
    counts = sharded.counts()
    ids = prim.all_gather(sharded.ids.contiguous(), 0, sharded.group, counts, op=op)
    rows = prim.all_gather(rows.contiguous(), 0, sharded.group, counts, op=op)
    order = torch.argsort(ids)
    return ids[order], rows[order]


def evaluate(
    potential: nn.Module,
    system: System | None,
    src: int = 0,
    skin: float = 0.0,
    group: Any = None,
    partition: str = "spatial",
    storage: str = "halo",
) -> Results:
    """Collective: scatter ``system`` (held by ``src``; ``None`` elsewhere), evaluate once (energy,
    per-atom energies, forces, stress and virial), and return the results in serial order (rows by
    global id; for a system built with default ids, the original order), replicated on every rank.

    ``storage``: ``"halo"`` (spatial blocks with halo atoms, ``partition``) or ``"graph"`` (atoms
    split by index, geometry replicated; plain-PyTorch models through the dispatch).

    Collectives: the scatter, the evaluation's (halo exchanges and their adjoints, one energy
    all_reduce), two all_gathers of the rows. Memory per rank: the storage during the evaluation,
    then the whole system's ``N x 4`` result rows (replicated: an ASE calculator's contract)."""
    sharded, dp = place(
        system, potential, storage=storage, src=src, skin=skin, partition=partition, group=group
    )
    res = dp.compute(sharded)
    _, rows = rows_by_id(sharded, torch.cat([res.per_atom[:, None], res.forces], dim=1), op="calculator")
    return Results(res.energy, rows[:, 0], rows[:, 1:], res.stress, res.virial)
