"""The storage of a sharded system: one interface, two implementations, one factory.

A *storage* holds a system (or a batch of systems) distributed over the ranks of a group:
every rank owns some atoms and keeps what its model evaluation needs of the others.

- ``"halo"`` (:class:`~twinshard.atoms.parallel.sharded.ShardedSystem`): spatial (or id-block)
  domains; each rank holds its owned atoms and the halo rows within ``cutoff + skin`` of them;
  atoms migrate between owners as they move. Any potential (the ``Graph`` contract with halo
  refreshes, analytic pair potentials, plain models through the dispatch); NPT, load balance.
- ``"graph"`` (:class:`~twinshard.atoms.parallel.graph_storage.GraphSharded`): atoms split by
  index into balanced blocks, the geometry replicated, no halo and no migration; plain-PyTorch
  models through the ShardTensor dispatch; a batch of systems of any sizes; NPT (each system's
  cell set by ``set_cell``/``set_cells``, replicated, the edges' shifts following it).

:class:`Storage` is what the rest of the package may read or call on either (the MD engine,
:class:`~twinshard.atoms.parallel.distributed.DistributedPotential`, the calculator, validate,
the benches). :func:`scatter_storage` is the one way to build one by name. The evaluation is the
distributed potential's (:meth:`DistributedPotential.compute`, which picks the path by the
storage's type, never by probing attributes).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from twinshard.atoms.data.system import System

__all__ = ["STORAGES", "Storage", "scatter_storage"]

STORAGES = ("halo", "graph")


class Storage(Protocol):
    """What both storages provide (owned rows are this rank's atoms; replicated values are the
    same on every rank of ``group``).

    Replicated: ``group``, ``rank``, ``nranks``, ``device``, ``cutoff``, ``skin`` (the list's
    Verlet skin), ``builds`` (neighbour-list builds so far), ``n_total`` (atoms of the whole
    system or batch), ``cell`` / ``pbc`` (the single system's; a batch's first), ``volume``,
    ``dtype``, ``partition`` (the spatial or block partition of a halo storage; ``None`` in graph
    storage, which splits by index), ``migrations`` (atoms that changed owner so far; always 0 in
    graph storage). Per rank: ``n_owned``, ``n_halo`` (halo rows held; 0 in graph storage, which
    replicates the geometry instead), owned rows ``positions``, ``velocities``, ``masses``,
    ``numbers``, ``ids``.
    """

    group: dist.ProcessGroup | None
    rank: int
    nranks: int
    device: torch.device
    cutoff: float
    skin: float
    builds: int
    n_total: int
    migrations: int
    partition: Any
    velocities: torch.Tensor
    masses: torch.Tensor
    numbers: torch.Tensor
    ids: torch.Tensor

    @property
    def n_owned(self) -> int: ...

    @property
    def n_halo(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def volume(self) -> float: ...

    def counts(self) -> list[int]:
        """Owned atoms of every rank (replicated)."""
        ...

    def update(self, force: bool = False) -> bool:
        """Collective, after owned positions moved: rebuild the lists past half the skin (or when
        ``force``); returns whether it rebuilt (the same on every rank)."""
        ...

    def gather(self, dst: int = 0) -> System | None:
        """Collective: the whole system on rank ``dst`` (ordered by id), ``None`` elsewhere."""
        ...


def scatter_storage(
    storage: str,
    source: System | list[System] | Any | None,
    src: int = 0,
    *,
    cutoff: float,
    skin: float,
    group: dist.ProcessGroup | None = None,
    partition: str = "spatial",
    balance: float | None = None,
    dtype: torch.dtype | None = None,
) -> Storage:
    """Collective: distribute ``source`` (held by rank ``src``; ``None`` on the others) into the
    storage named ``storage`` (``"halo"`` or ``"graph"``, a replicated option: a bad name raises on
    every rank). ``partition`` and ``balance`` are the halo storage's (graph storage splits by
    index: asking it for a spatial balance raises, on every rank). Collectives: those of
    :meth:`ShardedSystem.scatter` or :meth:`GraphSharded.scatter`."""
    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
    if storage == "graph":
        if balance is not None:
            raise ValueError(
                "balance moves the cut planes of a spatial partition: graph storage splits atoms by "
                "index into balanced blocks already; use storage='halo' to balance"
            )
        from twinshard.atoms.parallel.graph_storage import GraphSharded

        return GraphSharded.scatter(source, src, cutoff=cutoff, skin=skin, group=group, dtype=dtype)
    from twinshard.atoms.parallel.sharded import ShardedSystem

    return ShardedSystem.scatter(
        source, src, cutoff=cutoff, skin=skin, group=group, partition=partition, balance=balance, dtype=dtype
    )
