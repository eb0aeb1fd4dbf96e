"""A system sharded over ranks: owned atoms per rank, halos, migration.

:class:`ShardedSystem` is the distributed twin of :class:`~twinshard.atoms.data.system.System`:
each rank holds only the atoms it owns (``positions``, ``velocities``, ``masses``,
``numbers``, ``ids`` and every extra per-atom array, all ``Shard(0)`` with uneven
counts) plus the replicated per-system values (``cell``, ``pbc``, ``info``).
Every atom keeps its global id through scatter, migration and gather.

Lifecycle (every call marked *collective* must be reached by every rank of
the group, in the same order):

1. ``ShardedSystem.scatter(source, src=0, cutoff=..., skin=...)`` (collective):
   only rank ``src`` holds the system (a System, an ``ase.Atoms`` or a file
   path); the others pass ``None``. Reading and validating the structure and
   choosing the rank grid happen on ``src`` inside a fail-together step, so a
   missing file, NaN coordinates, a missing mass or a box too small for the
   ranks raise the same error on every rank. Schema, dtypes, cell, pbc, info
   and the partition are broadcast; each field goes out in one all_to_all.
2. The MD driver changes ``positions`` / ``velocities`` in place (owned rows),
   then calls ``update()`` (collective): if any atom, on any rank, moved more
   than ``skin / 2`` since the last build, atoms that left their subdomain
   (by more than ``hysteresis``) migrate to their new owner (all_to_all), and
   the halo plan and the padded-block neighbour list are rebuilt.
3. ``block_graph()`` gives the potential-contract graph of the halo-padded
   block (see :mod:`twinshard.atoms.potentials.base`), ``local()`` a plain
   System of the owned atoms, ``gather(dst)`` / ``gather_all()`` the whole
   system (atoms ordered by id).

Invariant: after every collective call, each global id is owned by exactly one
rank (no atom lost or duplicated) and owned rows are sorted by id.

Memory per rank: owned atoms (N / P) plus the halo (~ surface x ghost width x
density) and the neighbour list of owned receivers; nothing scales with N.
"""

from __future__ import annotations

import math
import pickle
import time
from typing import Any

import torch
import torch.distributed as dist

from twinshard.atoms.data.io import as_system
from twinshard.atoms.data.neighbors import Edges, RadiusGraph, lex_positive, neighbor_list
from twinshard.atoms.data.system import System
from twinshard.atoms.dynamics import sanity
from twinshard.atoms.parallel.balance import imbalance
from twinshard.atoms.parallel.halo import HaloPlan
from twinshard.atoms.parallel.partition import BlockPartition, SpatialPartition
from twinshard.atoms.potentials.base import Graph
from twinshard.comm import primitives as prim
from twinshard.runtime import agree_step, require_world

__all__ = ["ShardedSystem"]

_CORE = ("positions", "velocities", "masses", "numbers", "ids")


def source_system(source: Any, dtype: torch.dtype | None) -> System:
    """The source rank's input as a System (``atoms.data.io.as_system``, the one input path)."""
    system = as_system(source, dtype, what="the source rank (the other ranks pass None)")
    system.validate()
    return system


class ShardedSystem:
    """Owned atoms of this rank, the halo plan, and the padded-block neighbour list.

    Attributes (owned rows, sorted by id): ``positions [n, 3]``, ``velocities
    [n, 3]``, ``masses [n]``, ``numbers [n]``, ``ids [n]``, ``arrays`` (extra
    per-atom fields). Replicated: ``cell``, ``pbc``, ``info``, ``n_total``,
    ``partition``, ``cutoff``, ``skin``, ``hysteresis``, ``migrations`` (atoms
    moved between ranks so far), ``builds`` (plan/neighbour-list builds).
    Per rank: ``plan`` (:class:`~twinshard.atoms.parallel.halo.HaloPlan`), ``edges`` (on
    the padded block, owned receivers only, built with ``cutoff + skin``; periodic
    along the wrap axes, where edges carry lattice shifts, open elsewhere),
    ``half_edges`` (each pair once, for analytic pair potentials: see
    :meth:`half_edges`), ``halo_numbers``. The two lists are built on first use
    after each plan build (only the kind a potential asks for);
    ``neighbor_seconds`` sums their build times.

    Do not construct directly; use :meth:`scatter`.
    """

    def __init__(self) -> None:
        self.group: dist.ProcessGroup | None = None
        self.rank = 0
        self.nranks = 1
        self.device = torch.device("cpu")  # the world's, set by scatter: per-atom data lives there
        self.positions = torch.zeros(0, 3, dtype=torch.float64)
        self.velocities = torch.zeros(0, 3, dtype=torch.float64)
        self.masses = torch.zeros(0, dtype=torch.float64)
        self.numbers = torch.zeros(0, dtype=torch.int64)
        self.ids = torch.zeros(0, dtype=torch.int64)
        self.arrays: dict[str, torch.Tensor] = {}
        self.cell = torch.zeros(3, 3, dtype=torch.float64)
        self.pbc = torch.zeros(3, dtype=torch.bool)
        self.info: dict[str, Any] = {}
        self.n_total = 0
        self.partition: SpatialPartition | BlockPartition | None = None
        self.cutoff = 0.0
        self.skin = 0.0
        self.hysteresis = 0.0
        self.migrations = 0
        self.builds = 0
        self.balance: float | None = None  # rebalance threshold on max/mean owned atoms
        self.rebalances = 0  # cut-plane moves after scatter
        self.load = 1.0  # max/mean owned atoms at the last update's agreement
        self.plan: HaloPlan | None = None
        self._edges: Edges | None = None
        self._half: Edges | None = None
        self._block: torch.Tensor | None = None
        self._shifts: tuple[Any, ...] | None = None  # edge_shifts' cache: (edges, plan, cell, shifts)
        self.neighbor_seconds = 0.0
        self.radius_graph = RadiusGraph()  # a plain model's edges: r < cutoff (plain_inputs.block_inputs)
        self.halo_numbers = torch.zeros(0, dtype=torch.int64)
        self._ref: torch.Tensor | None = None
        self._build_cell: torch.Tensor | None = None  # the cell of the last build (lists, plan)
        self._schema: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    # ------------------------------------------------------------- scatter
    @classmethod
    def scatter(
        cls,
        source: System | Any | str | None,
        src: int = 0,
        *,
        cutoff: float,
        skin: float = 1.0,
        hysteresis: float | None = None,
        partition: str = "spatial",
        grid: tuple[int, int, int] | None = None,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        balance: float | None = None,
    ) -> ShardedSystem:
        """Collective: distribute the system held by rank ``src`` over the group.

        Args:
            source: on ``src`` a System, an ``ase.Atoms`` or a structure file path;
                ``None`` on every other rank.
            cutoff: the potential's cutoff (Angstrom); ``skin``: Verlet skin.
                Ghost width = ``cutoff + skin``.
            hysteresis: an atom stays with its owner while it is within this
                distance outside the owner's slab (default ``skin / 4``).
            partition: ``"spatial"`` (3-D slabs, default) or ``"block"``
                (contiguous ids, no migration).
            grid: force the 3-D rank grid of a spatial partition (default: chosen where
                the atoms are, see :meth:`SpatialPartition.build`).
            dtype: cast float fields to this dtype (default: keep the source's).
            balance: load balance (spatial partition): a threshold on the imbalance, max /
                mean owned atoms per rank (>= 1, e.g. 1.1). At scatter, and at every rebuild
                of :meth:`update` where the imbalance exceeds it, the cut planes move to
                balance the counts (:meth:`SpatialPartition.rebalance`, from histograms summed
                over the ranks) and atoms migrate to their new owners. ``None``: equal slabs.

        Collectives: a fail-together step, 3 broadcasts (header length, header,
        counts), one all_to_all per field, then the plan build (see ``update``).

        Raises (on every rank, as RankFailure): unreadable file, NaN
        coordinates, missing masses, box too small for the rank grid, ...
        """
        require_world("ShardedSystem.scatter")
        if not (cutoff > 0 and math.isfinite(cutoff)) or not (skin >= 0 and math.isfinite(skin)):
            raise ValueError(f"cutoff must be > 0 and skin >= 0, got {cutoff}, {skin}")
        hyst = 0.25 * skin if hysteresis is None else float(hysteresis)
        me, nranks = dist.get_rank(group), dist.get_world_size(group)
        if not 0 <= src < nranks:
            raise ValueError(f"src={src} is not a rank of a group of {nranks}")
        self = cls()
        self.group, self.rank, self.nranks = group, me, nranks
        self.device = dev = require_world("ShardedSystem.scatter").device
        self.cutoff, self.skin, self.hysteresis = float(cutoff), float(skin), hyst
        self.balance = None if balance is None else float(balance)
        system: System | None = None
        payload = b""
        with agree_step("scatter: read, validate and partition the system", group):
            if me == src:
                system = source_system(source, dtype)
                check_ids(system.ids)
                part = _make_partition(system, partition, nranks, cutoff + skin, grid, self.balance)
                schema = [(k, getattr(system, k).dtype, tuple(getattr(system, k).shape[1:])) for k in _CORE]
                schema += [
                    (f"arrays.{k}", v.dtype, tuple(v.shape[1:])) for k, v in sorted(system.arrays.items())
                ]
                header = {
                    "n": system.n_atoms,
                    "schema": schema,
                    "cell": system.cell,
                    "pbc": system.pbc,
                    "info": system.info,
                    "partition": part,
                }
                payload = pickle.dumps(header)
        length = prim.broadcast(
            torch.tensor([len(payload)], dtype=torch.int64, device=dev), src, group, op="scatter"
        )
        raw = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev)
            if me == src
            else torch.zeros(int(length[0]), dtype=torch.uint8, device=dev)
        )
        raw = prim.broadcast(raw, src, group, op="scatter")
        header = pickle.loads(raw.cpu().numpy().tobytes())  # our own source rank's bytes
        self.n_total = int(header["n"])
        self._schema = header["schema"]
        self.cell, self.pbc, self.info = header["cell"], header["pbc"], header["info"]
        self.partition = header["partition"]
        if me == src:
            assert system is not None
            order = torch.argsort(system.ids)
            # a block partition splits the id-sorted list, whatever values the ids have
            keys = (
                torch.arange(system.n_atoms)
                if isinstance(self.partition, BlockPartition)
                else system.ids[order]
            )
            owners = self.partition.owner_of(self.partition.fractional(system.positions[order]), keys)
            order = order[torch.sort(owners, stable=True).indices]
            counts = torch.bincount(owners, minlength=nranks).to(dev, torch.int64)
            fields = {name: self._field_of(system, name)[order].to(dev) for name, _, _ in self._schema}
        else:
            counts = torch.zeros(nranks, dtype=torch.int64, device=dev)
            fields = {name: torch.zeros((0,) + tail, dtype=dt, device=dev) for name, dt, tail in self._schema}
        counts = prim.broadcast(counts, src, group, op="scatter").cpu()
        send = counts.tolist() if me == src else [0] * nranks
        recv = [0] * nranks
        recv[src] = int(counts[me])
        self._set_fields({n: all_to_all_rows(fields[n], send, recv, group, "scatter") for n in fields})
        self._build()
        return self

    @staticmethod
    def _field_of(system: System, name: str) -> torch.Tensor:
        if name.startswith("arrays."):
            return system.arrays[name[7:]]
        return getattr(system, name)

    def _fields(self) -> dict[str, torch.Tensor]:
        return {name: self._get(name) for name, _, _ in self._schema}

    def _get(self, name: str) -> torch.Tensor:
        return self.arrays[name[7:]] if name.startswith("arrays.") else getattr(self, name)

    def _set_fields(self, fields: dict[str, torch.Tensor]) -> None:
        order = torch.argsort(fields["ids"])
        for name, t in fields.items():
            t = t[order].contiguous()
            if name.startswith("arrays."):
                self.arrays[name[7:]] = t
            else:
                setattr(self, name, t)

    # ------------------------------------------------------------- queries
    @property
    def n_owned(self) -> int:
        return int(self.positions.shape[0])

    @property
    def n_halo(self) -> int:
        return 0 if self.plan is None else self.plan.n_halo

    @property
    def dtype(self) -> torch.dtype:
        return self.positions.dtype

    @property
    def volume(self) -> float:
        return abs(float(torch.linalg.det(self.cell.to(torch.float64))))

    def local(self) -> System:
        """The owned atoms as a plain System (views of this rank's tensors)."""
        return System(
            positions=self.positions,
            numbers=self.numbers,
            cell=self.cell,
            pbc=self.pbc,
            masses=self.masses,
            velocities=self.velocities,
            ids=self.ids,
            arrays=dict(self.arrays),
            info=dict(self.info),
        )

    def block_graph(self, positions: torch.Tensor | None = None) -> Graph:
        """The halo-padded block as a potential-contract Graph (collective: halo exchange).

        ``positions`` are this rank's owned positions (default ``self.positions``);
        the block positions are differentiable in them *through the halo*: the
        backward of the forward exchange is the reverse exchange, so the gradient
        of the sum of every rank's owned energies lands on the owners. ``refresh``
        is the forward halo exchange of node features. Edge ``shifts`` are the block
        neighbour list's lattice shifts along the wrap axes (periodic with one rank), zero
        elsewhere.
        """
        assert self.plan is not None and self.edges is not None
        x = self.positions if positions is None else positions
        block = self.plan.padded_positions(x, self.cell)
        e = self.edges
        return Graph(
            positions=block,
            numbers=torch.cat([self.numbers, self.halo_numbers]),
            senders=e.senders,
            receivers=e.receivers,
            # lattice shifts along the wrap axes (zero along the others: images there are halo rows)
            shifts=e.shifts.to(device=x.device, dtype=x.dtype),
            n_owned=self.n_owned,
            refresh=self.plan.refresh,
        )

    def counts(self) -> list[int]:
        """Owned atoms per rank (collective: one all_gather)."""
        c = torch.tensor([self.n_owned], dtype=torch.int64, device=self.device)
        return prim.all_gather(c, 0, self.group, op="gather").tolist()

    def gather(self, dst: int = 0) -> System | None:
        """Collective: the whole system (ordered by id) on rank ``dst``, ``None`` elsewhere."""
        counts = self.counts()
        send = [0] * self.nranks
        send[dst] = self.n_owned
        recv = counts if self.rank == dst else [0] * self.nranks
        got = {n: all_to_all_rows(t, send, recv, self.group, "gather") for n, t in self._fields().items()}
        return self._system_from(got) if self.rank == dst else None

    def gather_all(self) -> System:
        """Collective: the whole system (ordered by id) on every rank."""
        counts = self.counts()
        got = {n: _gather_rows(t, counts, self.group) for n, t in self._fields().items()}
        return self._system_from(got)

    def _system_from(self, f: dict[str, torch.Tensor]) -> System:
        order = torch.argsort(f["ids"])
        f = {k: v[order] for k, v in f.items()}
        return System(
            positions=f["positions"],
            numbers=f["numbers"],
            cell=self.cell,
            pbc=self.pbc,
            masses=f["masses"],
            velocities=f["velocities"],
            ids=f["ids"],
            arrays={k[7:]: v for k, v in f.items() if k.startswith("arrays.")},
            info=dict(self.info),
        )

    # -------------------------------------------------------------- update
    def max_displacement(self) -> float:
        """Collective: the largest displacement of any atom since the last build."""
        return self._agree_update(False)[0]

    def _agree_update(self, force: bool) -> tuple[float, bool]:
        """Collective (one all_gather of each rank's position report and rebuild request): the
        largest displacement over all ranks and whether any rank asks for a rebuild; raises
        :class:`~twinshard.atoms.dynamics.sanity.Diverged` on every rank if any position is non-finite or
        jumped beyond ``cutoff + skin`` (:func:`~twinshard.atoms.dynamics.sanity.check_positions`)."""
        assert self._ref is not None
        limit = self.cutoff + self.skin
        ref, _ = self._affine_reference()
        row = sanity.position_report(self.positions, ref, self.ids, limit)
        stats = torch.cat([row, row.new_tensor([float(bool(force)), float(self.n_owned)])])[None]
        allstats = prim.all_gather(stats, 0, self.group, op="update").cpu()
        self.load = imbalance(allstats[:, -1].to(torch.int64))  # replicated: the same rows everywhere
        return sanity.check_positions(allstats[:, :-2], limit), bool((allstats[:, -2] > 0).any())

    def set_cell(self, cell: torch.Tensor) -> None:
        """Replicated, no communication: a barostat's new cell (every rank passes the same one).

        The partition keeps its rank grid and fractional slabs on the new cell
        (:meth:`~twinshard.atoms.parallel.partition.SpatialPartition.with_cell`, which raises on
        every rank if the cell became too thin for the grid). The halo plan (images and ghost
        margins), the neighbour lists (Cartesian lattice shifts) and the edge-shift cache belong
        follow the cell without a rebuild while the skin covers the strain (:meth:`update`'s rule):
        the plan's images and the lists' integer lattice shifts do not depend on the cell, and
        their Cartesian shifts are recomputed here from the new cell.
        """
        assert self.partition is not None
        cell = torch.as_tensor(cell).detach().to(dtype=self.cell.dtype, device=self.cell.device)
        if torch.equal(cell, self.cell):
            return
        self.partition = self.partition.with_cell(cell)
        self.cell = cell.clone()
        if self._edges is not None:
            self._edges = self._at_cell(self._edges)
        if self._half is not None:
            self._half = self._at_cell(self._half)

    def _at_cell(self, e: Edges) -> Edges:
        """``e`` with Cartesian shifts ``cell_shifts @ cell`` of the current cell (unchanged while
        the cell is the build's: the same bits as the list's own shifts)."""
        if self._build_cell is None or torch.equal(self._build_cell, self.cell):
            return e
        shifts = e.cell_shifts.to(device=e.shifts.device, dtype=e.shifts.dtype) @ self.cell.to(e.shifts)
        return Edges(e.senders, e.receivers, shifts, e.cell_shifts)

    def _affine_reference(self) -> tuple[torch.Tensor | None, float]:
        """(the last build's positions carried by the cell's deformation since then, ``x_ref M``
        with ``M = cell_build^-1 cell``; the strain margin ``(cutoff + skin) (1 - sigma_min(M))``,
        0 when the cell only grew). Replicated: every rank computes it from the same cells."""
        ref, built = self._ref, self._build_cell
        if ref is None or built is None or torch.equal(built, self.cell):
            return ref, 0.0
        m = torch.linalg.solve(built.double().cpu(), self.cell.double().cpu())
        sigma = float(torch.linalg.svdvals(m).min())
        return ref @ m.to(ref), max(0.0, (self.cutoff + self.skin) * (1.0 - sigma))

    def update(self, force: bool = False) -> bool:
        """Collective: after an integration step, migrate and rebuild if needed.

        Rebuilds (migration + halo plan + neighbour list) when ``force`` on any rank, or when the
        skin no longer covers what changed since the last build: with ``M = cell_build^-1 cell``
        the cell's deformation since then and ``d`` the largest displacement of any atom on any
        rank from its build position carried by ``M`` (``|x - x_ref M|``, the non-affine motion),
        the rule is ``2 d + (cutoff + skin) (1 - sigma_min(M)) > skin`` (a pair at distance
        ``r0 >= cutoff + skin`` at the build is now at least ``sigma_min(M) r0 - 2 d`` apart, so
        ``>= cutoff`` while the rule holds; with a fixed cell it is ``d > skin / 2``). Every rank
        takes the same decision from one all_gather (``M`` is replicated). Returns whether
        it rebuilt. Raises :class:`~twinshard.atoms.dynamics.sanity.Diverged` (a ValueError) on every rank,
        before migration and the neighbour list, if any position is NaN/inf or jumped farther
        than ``cutoff + skin`` since the last build (a diverged MD step).

        Collectives: one all_gather of ``[max displacement, #non-finite, #jumped, 3 of their ids,
        force]``; on a
        rebuild also (spatial partition, P > 1) one all_to_all of counts, one
        all_reduce of the number of migrating atoms and, if any moved, one
        all_to_all per field; then the halo plan (one all_gather of boxes, two
        neighbour exchanges) and one halo forward exchange of atomic numbers.
        """
        disp, forced = self._agree_update(force)
        _, strain = self._affine_reference()
        if 2.0 * disp + strain > self.skin or forced:
            self._rebalance()
            self._migrate()
            self._build()
            return True
        return False

    def _rebalance(self) -> None:
        """Move the cut planes when the agreed imbalance (``self.load``, max / mean owned atoms,
        replicated) exceeds ``self.balance``: each rank bins its owned atoms, the histograms are
        summed over the ranks (one all_reduce per split axis), every rank computes the same cuts;
        the migration that follows moves the atoms. A replicated decision: every rank or none."""
        part = self.partition
        if self.balance is None or not isinstance(part, SpatialPartition) or self.nranks == 1:
            return
        if self.load <= self.balance:
            return
        dev = self.device

        def reduce(hist: torch.Tensor) -> torch.Tensor:
            return prim.all_reduce(hist.to(dev), self.group, op="balance").cpu()

        self.partition = part.rebalance(part.fractional(self.positions.detach().cpu()), reduce)
        self.rebalances += 1

    def _migrate(self) -> None:
        part = self.partition
        if isinstance(part, BlockPartition) or self.nranks == 1:
            return
        # ownership is planned on the host; the payloads travel on the world's device
        dev = self.device
        frac = part.fractional(self.positions.detach().cpu())
        cur = torch.full((self.n_owned,), self.rank, dtype=torch.int64, device="cpu")
        dest = part.owner_of(frac, self.ids.cpu(), current=cur, hysteresis=self.hysteresis)
        order = torch.sort(dest, stable=True).indices.to(dev)
        send = torch.bincount(dest, minlength=self.nranks).to(torch.int64)
        recv = prim.all_to_all(send.to(dev), [1] * self.nranks, [1] * self.nranks, self.group, op="migrate")
        left = torch.tensor([int(self.n_owned - send[self.rank])], device=dev)
        moved = prim.all_reduce(left, self.group, op="migrate")
        self.migrations += int(moved[0])
        if int(moved[0]) == 0:
            return
        s, r = send.tolist(), recv.tolist()
        self._set_fields(
            {n: all_to_all_rows(t[order], s, r, self.group, "migrate") for n, t in self._fields().items()}
        )

    def _build(self) -> None:
        part = self.partition
        x = self.positions.detach()
        self._edges = self._half = None  # dropped before the new plan is built (peak memory)
        self.plan = HaloPlan.build(part.fractional(x.cpu()), self.ids, part, group=self.group)
        self.halo_numbers = self.plan.forward(self.numbers)
        # the neighbour lists are built lazily from this block, the kind a potential asks for
        self._block = self.plan.padded_positions(x, self.cell, vote=False)
        self._ref = x.clone()
        self._build_cell = self.cell.clone()
        self.builds += 1

    @property
    def edges(self) -> Edges:
        """Full list on the padded block with owned receivers (the potential contract's graph)."""
        if self._edges is None:
            assert self._block is not None
            t0 = time.perf_counter()
            edges = self._block_list(half=False)
            keep = edges.receivers < self.n_owned  # only owned receivers carry energy (contract)
            self._edges = self._at_cell(
                Edges(edges.senders[keep], edges.receivers[keep], edges.shifts[keep], edges.cell_shifts[keep])
            )
            self.neighbor_seconds += time.perf_counter() - t0
        return self._edges

    @edges.setter
    def edges(self, value: Edges | None) -> None:
        self._edges = value

    def _block_list(self, half: bool) -> Edges:
        """vesin on the padded block (the build's positions, so the build's cell): periodic along
        the plan's wrap axes (edges carry the integer shift there), open along the others (their
        images are halo rows)."""
        assert self._block is not None and self.plan is not None
        wrap = self.plan.wrap
        built = self.cell if self._build_cell is None else self._build_cell
        cell = built if any(wrap) else None
        return neighbor_list(self._block, self.cutoff + self.skin, cell, wrap, half=half)

    def edge_shifts(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """``[n_edges, 3]`` Cartesian shift of each edge of :attr:`edges` in the unwrapped frame
        of the block's positions (``r_ij = x[j] + shift - x[i]``): the two rows' frames plus the
        list's own lattice shift along the wrap axes, summed exactly in int64, then one product
        with the cell. Reused while the edge list, the plan, the cell and the tensor itself are
        unchanged, in place or by ``requires_grad_`` (a plain model's input at every evaluation:
        ~3% of a 4,400-atom step)."""
        plan, e = self.plan, self.edges
        assert plan is not None
        cell = self.cell.to(device, dtype)
        got = self._shifts
        if (
            got is not None
            and got[0] is e
            and got[1] is plan
            and got[3].dtype == dtype
            and got[3].device == torch.device(device)
            and got[3]._version == got[4]
            and not got[3].requires_grad
            and torch.equal(got[2], cell)
        ):
            return got[3]
        frame = torch.cat([plan.owned_shift, plan.halo_shift]).to(device)
        n = frame[e.senders] - frame[e.receivers] + e.cell_shifts.to(device)
        shifts = n.to(dtype) @ cell
        self._shifts = (e, plan, cell.clone(), shifts, shifts._version)
        return shifts

    def half_edges(self) -> Edges:
        """Each pair of the whole system within ``cutoff + skin`` exactly once over all ranks.

        A half list (vesin) on the padded block, periodic along the wrap axes (an
        atom and its own image along them is one pair with a lexicographically
        positive shift, as serially), pairs between two halo rows dropped.
        A pair of two owned atoms is kept; a pair of an owned atom ``o`` and a halo
        row ``h`` (an image of an atom owned here or elsewhere) appears on two ranks
        (or twice on one), so it is kept only where the owner rule (:func:`owner_keeps`)
        holds: ``id(o) < id(h)`` when ``id(o) + id(h)`` is even, ``id(o) > id(h)`` when odd,
        or, for an atom and its own periodic image, a lexicographically positive relative
        lattice shift ``halo_shift(h) + m - owned_shift(o)`` (``m`` the edge's block shift). Oriented with the owned atom
        as receiver; ``shifts`` are the block shifts ``m @ cell``. Forces and
        energies of halo rows are partial sums for their owners (reverse exchange).
        """
        if self._half is None:
            assert self._block is not None and self.plan is not None
            t0 = time.perf_counter()
            e = self._block_list(half=True)
            i, j, m = e.receivers, e.senders, e.cell_shifts
            n = self.n_owned
            own_i, own_j = i < n, j < n
            # orient: the owned atom receives (i < j in the half list, so only (halo, owned) flips)
            flip = ~own_i & own_j
            i, j = torch.where(flip, j, i), torch.where(flip, i, j)
            m = torch.where(flip[:, None], -m, m)
            keep = own_j.clone() & own_i  # owned-owned: each pair once already
            cross = own_i ^ own_j
            if bool(cross.any()):
                plan = self.plan
                ids = torch.cat([self.ids.to(plan.halo_ids.device), plan.halo_ids]).to(i.device)
                shift = torch.cat([plan.owned_shift, plan.halo_shift]).to(i.device)
                io, jh = i[cross], j[cross]
                # the pair's lattice translation: frames plus the block's own (wrap-axis) shift
                keep[cross] = owner_keeps(ids[io], ids[jh], shift[jh] - shift[io] + m[cross])
            m = m[keep]
            cell = self.cell.to(device=m.device, dtype=e.shifts.dtype)
            self._half = Edges(j[keep], i[keep], m.to(e.shifts.dtype) @ cell, m)
            self.neighbor_seconds += time.perf_counter() - t0
        return self._half

    def __repr__(self) -> str:
        grid = getattr(self.partition, "grid", None)
        return (
            f"ShardedSystem(rank={self.rank}/{self.nranks}, owned={self.n_owned}, "
            f"halo={self.n_halo}, total={self.n_total}, grid={grid}, "
            f"migrations={self.migrations}, builds={self.builds})"
        )


def owner_keeps(id_owned: torch.Tensor, id_halo: torch.Tensor, rel_shift: torch.Tensor) -> torch.Tensor:
    """The owner rule for a pair (owned atom, halo image), seen from the two ends: the smaller
    id's rank evaluates it when the two ids sum to an even number, the larger id's when odd (the
    rule flips with the ends, so exactly one keeps it; the parity spreads a boundary's pairs over
    both sides: ids that grow along the split axis would otherwise hand one rank all of them);
    an atom and its own image (equal ids) by the sign of the relative lattice shift, which is
    opposite at the two ends."""
    odd = ((id_owned + id_halo) % 2).bool()
    return ((id_owned < id_halo) ^ odd) & (id_owned != id_halo) | (
        (id_owned == id_halo) & lex_positive(rel_shift)
    )


_MAX_ID = 2**32 - 1  # ids key the counter-based RNG (Langevin noise, velocities): 32-bit words


def check_ids(ids: torch.Tensor) -> None:
    """Atom ids are unique integers in [0, 2**32) (checked where the system enters, on the source)."""
    if not ids.numel():
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi > _MAX_ID:
        raise ValueError(
            f"atom ids must be in [0, 2**32) (they key the random streams), got ids from {lo} to {hi}: "
            "renumber the atoms (ids = 0..N-1 are always valid)"
        )
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError("atom ids must be unique: two atoms share an id")


def _make_partition(
    system: System,
    kind: str,
    nranks: int,
    width: float,
    grid: tuple[int, int, int] | None,
    balance: float | None = None,
) -> SpatialPartition | BlockPartition:
    pbc = tuple(bool(p) for p in system.pbc.tolist())
    cell = system.cell.detach().to(torch.float64)
    if kind == "spatial":
        return SpatialPartition.build(
            cell, pbc, nranks, width, grid=grid, positions=system.positions.detach(), balance=balance
        )
    if balance is not None:
        raise ValueError(f"balance= applies to the spatial partition, not {kind!r}")
    if kind == "block":
        return BlockPartition.build(cell, pbc, nranks, width, natoms=system.n_atoms)
    raise ValueError(f"unknown partition {kind!r}; choose 'spatial' or 'block'")


def all_to_all_rows(
    t: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None, op: str
) -> torch.Tensor:
    """all_to_all of rows; bool travels as uint8 (gloo has no bool)."""
    if t.dtype == torch.bool:
        return prim.all_to_all(t.to(torch.uint8), send, recv, group, op=op).to(torch.bool)
    return prim.all_to_all(t.contiguous(), send, recv, group, op=op)


def _gather_rows(t: torch.Tensor, counts: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    if t.dtype == torch.bool:
        return prim.all_gather(t.to(torch.uint8), 0, group, counts, op="gather").to(torch.bool)
    return prim.all_gather(t.contiguous(), 0, group, counts, op="gather")
