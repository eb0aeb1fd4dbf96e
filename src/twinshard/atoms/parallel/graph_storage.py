"""Graph-parallel storage: atoms split by index into balanced blocks, geometry replicated, no halo.

The second storage strategy of the particle vertical (the first, halo decomposition, is
:mod:`twinshard.atoms.parallel.sharded`), for plain-PyTorch models (the dict contract of
:mod:`twinshard.atoms.parallel.plain_inputs`) run unmodified through the ShardTensor dispatch.

Layout (:class:`GraphSharded`, built by the collective :meth:`GraphSharded.scatter`):

- a *batch*: one System or a list of Systems of any sizes, concatenated in the caller's order;
  global row ``g`` is atom ``g`` of the concatenation, ``batch[g]`` its system;
- the N rows are split into P balanced contiguous blocks (counts differ by at most one; a rank
  may own none): rank ``r`` owns rows ``offsets[r]:offsets[r + 1]``;
- per-atom fields (``numbers``, ``batch``, ``ids``, ``masses``, ``velocities``): owned rows only;
- geometry replicated: every rank holds every position ``[N, 3]`` (3 numbers per atom) and the
  per-system ``cells [S, 3, 3]`` and ``pbcs [S, 3]``, so it builds the neighbour list of its own
  receivers without communication; ownership is by index, so MD never migrates atoms;
- cells (NPT): :meth:`GraphSharded.set_cell` / :meth:`GraphSharded.set_cells` replace a system's
  cell on every rank (replicated values from the barostat, no communication); the positions are
  scaled by the integrator on the owned rows and re-replicated by the next ``update``; the edges
  keep their integer lattice shifts (``cell_shifts``) and their Cartesian ``shifts`` become
  ``cell_shifts @ cell``; ``update`` rebuilds the list by the strain-aware rule of halo storage,
  per system;
- edges: receivers are the owned atoms, senders every atom within ``cutoff + skin`` of them in
  the same system. Indices are *rank-relative global ids* (placement :class:`OwnedFirst`): on
  rank ``r`` id ``i`` names global row ``(i + offsets[r]) mod N``, so the owned rows are ids
  ``0..n_r - 1`` (as in a halo block's ``[owned | halo]``): a model's scatter into a plain buffer of
  its own rows (mace's ``scatter_sum``) is local, and a gather of rows other ranks own goes through
  the dispatch (``sharded_gather``).

Model inputs (:func:`graph_inputs`): ``positions`` are the owned rows as an ``OwnedFirst``
ShardTensor over a leaf ``x``; ``numbers`` and ``batch`` likewise; ``senders``, ``receivers``,
``shifts`` plain per-edge tensors; ``cell [S, 3, 3]`` replicated.

Communication (one choice, and why): a gather of sender rows (``h.index_select(0, senders)``, once
per layer and once for the positions) is the dispatch's uneven all-to-all of just the rows a rank's
edges touch (``sharded_gather``: one all-to-all of counts, one of ids, one of rows; the counts and
ids only the first time the ranks gather with these edge tensors, then an all-gather of 13
integers per rank that says so; backward: the reverse all-to-all and a local index_add), not an
all-gather of the whole feature matrix with its
reduce-scatter adjoint: bytes and memory per rank scale with the rows a rank needs (its block and
the boundary rows of its neighbours' blocks), not with N x features per layer, and the handler and
its adjoint already exist and are tested. ``index_add_`` into an owned buffer ships contributions
to their owners (``sharded_scatter``; here every receiver is owned, so nothing leaves the rank but
the counts; and since every rank's receivers are its own, the dispatch's routing of those
calls is agreed local once, when it is built: a plain local ``index_select`` / ``index_add``
without a copy through the all-to-all, the same values). One rank: plain tensors, no dispatch.
Per-system energies ``(S,)``: ``per_system_reduce`` (one all-reduce). Forces: the
model's own ``torch.autograd.grad`` with respect to ``positions``; the gather's adjoint returns
every edge's contribution to the owner, so ``-dE/dx`` is complete on the owned rows (no further
reduction). Stress: the model's displacement ``[S, 3, 3]`` is a plain replicated input; its
gradient is a per-rank partial sum, all-reduced once by the ``replicated_grads`` handler.

The batch helpers (validation, header, the split back into Systems) are in
:mod:`twinshard.atoms.parallel.graph_batch`.

Memory per rank: positions ``N x 3`` (replicated), owned per-atom rows ``N / P``, the edges of owned
receivers and the autograd graph of those edges and rows, plus the gathered sender rows per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from twinshard.atoms.data.neighbors import RadiusGraph, neighbor_list
from twinshard.atoms.data.system import System
from twinshard.atoms.dynamics import sanity
from twinshard.atoms.parallel.graph_batch import (
    FIELDS,
    as_batch,
    balanced_counts,
    batch_header,
    broadcast_header,
    fingerprint,
    split_systems,
)
from twinshard.atoms.parallel.plain_inputs import call_plain_model, system_values
from twinshard.atoms.parallel.sharded import all_to_all_rows
from twinshard.atoms.potentials.base import Results
from twinshard.comm import primitives as prim
from twinshard.runtime import agree_step, require_world
from twinshard.shard.placements import Owned, ShardSpec
from twinshard.shard.shard_tensor import ShardTensor, from_local, to_local

__all__ = [
    "GraphSharded",
    "OwnedFirst",
    "balanced_counts",
    "graph_compute",
    "graph_energies",
    "graph_inputs",
]


@dataclass(frozen=True)
class OwnedFirst(Owned):
    """``Owned(counts)`` addressed from the rank: on rank ``r`` id ``i`` names global row
    ``(i + offsets[r]) mod N``, so a rank's own rows are ids ``0..n_r - 1`` (ids outside ``[0, N)``
    are left as they are: ``PAD`` stays PAD, any other raises in the dispatch on every rank)."""

    def to_global(self, ids: torch.Tensor, rank: int) -> torch.Tensor:
        off = self.offsets
        n = off[-1]
        ok = (ids >= 0) & (ids < n)
        return torch.where(ok, (ids + off[rank]) % max(n, 1), ids)

    def __repr__(self) -> str:
        return f"OwnedFirst(counts={list(self.counts or ())})"


class GraphSharded:
    """A batch of systems in graph-parallel storage (see the module docstring). Build with
    :meth:`scatter`.

    Replicated: ``n_systems``, ``sizes``, ``n_total``, ``counts``, ``offsets``, ``cells [S, 3, 3]``,
    ``pbcs [S, 3]``, ``all_positions [N, 3]``, ``cutoff``, ``skin``, ``builds``; ``cell`` / ``pbc``
    are system 0's (the MD driver's single-system view). Owned rows (``lo:hi``): ``positions``,
    ``numbers``, ``batch`` (system of each row), ``ids`` (each system's own atom ids), ``masses``,
    ``velocities``. Per rank: ``senders``, ``receivers`` (rank-relative ids), ``shifts``.
    """

    # the Storage interface (atoms.parallel.storage) read on both storages: graph storage holds no
    # halo rows (the geometry is replicated), never migrates (ownership is by index) and has no
    # spatial partition
    n_halo = 0
    migrations = 0
    partition = None

    def __init__(self) -> None:
        self.group: dist.ProcessGroup | None = None
        self.rank, self.nranks = 0, 1
        self.device = torch.device("cpu")
        self.sizes: list[int] = []
        self.counts_: tuple[int, ...] = ()
        self.cells = torch.zeros(0, 3, 3, dtype=torch.float64)
        self.pbcs = torch.zeros(0, 3, dtype=torch.bool)
        self.all_positions = torch.zeros(0, 3, dtype=torch.float64)
        self._positions = torch.zeros(0, 3, dtype=torch.float64)
        self._stale = False  # owned positions written since the last re-replication
        self.numbers = torch.zeros(0, dtype=torch.int64)
        self.ids = torch.zeros(0, dtype=torch.int64)
        self.masses = torch.zeros(0, dtype=torch.float64)
        self.velocities = torch.zeros(0, 3, dtype=torch.float64)
        self.batch = torch.zeros(0, dtype=torch.int64)
        self.infos: list[dict[str, Any]] = []  # each system's info (replicated)
        self.cutoff = self.skin = 0.0
        self.builds = 0
        self.senders = self.receivers = torch.zeros(0, dtype=torch.int64)
        self.shifts = torch.zeros(0, 3, dtype=torch.float64)
        self.cell_shifts = torch.zeros(0, 3, dtype=torch.int64)  # integer lattice shifts of the edges
        self.edge_counts: list[int] = []  # edges of each system (the list is concatenated by system)
        self._ref = torch.zeros(0, 3, dtype=torch.float64)
        self._build_cells = torch.zeros(0, 3, 3, dtype=torch.float64)  # the cells of the last build
        self.radius_graph = RadiusGraph()  # the model's edges: r < cutoff (graph_inputs)

    # ------------------------------------------------------------- scatter
    @classmethod
    def scatter(
        cls,
        source: System | list[System] | Any | None,
        src: int | None = 0,
        *,
        cutoff: float,
        skin: float = 0.5,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
    ) -> GraphSharded:
        """Collective: distribute the batch (a System, an ``ase.Atoms``, a path, or a list of
        them) held by rank ``src`` (the others pass ``None``); ``src=None``: every rank holds the
        same batch (checked: ranks that disagree raise on every rank).

        Collectives: a fail-together step; from ``src``: broadcasts of the header and of the
        positions ``[N, 3]`` (geometry replicated) and one all_to_all per per-atom field (owned
        blocks); with ``src=None`` one all_gather of a fingerprint instead. Then the owned
        receivers' neighbour list, without communication. Memory per rank: ``N x 3`` positions,
        owned rows, owned receivers' edges.
        """
        world = require_world("GraphSharded.scatter")
        if not (cutoff > 0 and math.isfinite(cutoff)) or not (skin >= 0 and math.isfinite(skin)):
            raise ValueError(f"cutoff must be > 0 and skin >= 0, got {cutoff}, {skin}")
        me, nranks = dist.get_rank(group), dist.get_world_size(group)
        if src is not None and not 0 <= src < nranks:
            raise ValueError(f"src={src} is not a rank of a group of {nranks}")
        self = cls()
        self.group, self.rank, self.nranks, self.device = group, me, nranks, world.device
        self.cutoff, self.skin = float(cutoff), float(skin)
        dev = self.device
        systems: list[System] | None = None
        with agree_step("graph storage: read and validate the batch", group):
            if src is None or me == src:
                systems = as_batch(source, dtype)
            elif source is not None:
                raise ValueError(
                    f"graph storage: rank {me} passed a batch but only rank {src} holds it (the others "
                    "pass None); give src=None if every rank holds the same batch"
                )
        if src is None:
            assert systems is not None
            fp = fingerprint(systems).to(dev)
            sizes = prim.all_gather(torch.tensor([fp.numel()], device=dev), 0, group, op="scatter")
            same = bool((sizes == sizes[0]).all())
            if same:
                allfp = prim.all_gather(fp[None], 0, group, op="scatter").cpu()
                same = bool((allfp == allfp[0]).all())
            if not same:  # every rank saw the same gathered fingerprints: all raise
                raise ValueError(
                    "graph storage: with src=None every rank must hold the same batch, but the ranks "
                    "disagree (sizes, positions, numbers, ids or cells differ); scatter from one rank"
                )
            header = batch_header(systems)
        else:
            header = broadcast_header(batch_header(systems) if me == src else None, src, group, dev)
        self.sizes, self.infos = header["sizes"], header["infos"]
        self.cells, self.pbcs = header["cells"].to(dev), header["pbcs"]
        ftype = header["dtype"]
        n_total = sum(self.sizes)
        self.counts_ = balanced_counts(n_total, nranks)
        lo, hi = self.offsets[me], self.offsets[me + 1]
        if systems is not None:
            whole = {k: torch.cat([getattr(s, k) for s in systems]).to(dev) for k in ("positions",) + FIELDS}
        if src is None:
            assert systems is not None
            self.all_positions = whole["positions"].contiguous()
            fields = {k: whole[k][lo:hi].contiguous() for k in FIELDS}
        else:
            pos = (
                whole["positions"].contiguous()
                if me == src
                else torch.zeros(n_total, 3, dtype=ftype, device=dev)
            )
            self.all_positions = prim.broadcast(pos, src, group, op="scatter")
            send = list(self.counts_) if me == src else [0] * nranks
            recv = [0] * nranks
            recv[src] = hi - lo
            fields = {}
            for k, (dt, tail) in header["schema"].items():
                t = whole[k] if me == src else torch.zeros((0,) + tail, dtype=dt, device=dev)
                fields[k] = all_to_all_rows(t, send, recv, group, "scatter")
        for k in FIELDS:
            setattr(self, k, fields[k])
        starts = torch.tensor([0] + self.sizes, dtype=torch.int64).cumsum(0)
        self.batch = (torch.searchsorted(starts[1:], torch.arange(lo, hi), right=True)).to(dev)
        self._positions = self.all_positions[lo:hi].clone()
        self._build()
        return self

    # ------------------------------------------------------------- queries
    @property
    def n_systems(self) -> int:
        return len(self.sizes)

    @property
    def n_total(self) -> int:
        return sum(self.sizes)

    @property
    def n_owned(self) -> int:
        return self.counts_[self.rank]

    @property
    def offsets(self) -> list[int]:
        out = [0]
        for c in self.counts_:
            out.append(out[-1] + c)
        return out

    @property
    def dtype(self) -> torch.dtype:
        return self.all_positions.dtype

    @property
    def cell(self) -> torch.Tensor:
        return self.cells[0]

    @property
    def pbc(self) -> torch.Tensor:
        return self.pbcs[0]

    @property
    def volumes(self) -> torch.Tensor:
        return torch.linalg.det(self.cells.to(torch.float64)).abs()

    @property
    def volume(self) -> float:
        return float(self.volumes[0])

    def counts(self) -> list[int]:
        """Owned rows per rank (replicated; no communication)."""
        return list(self.counts_)

    def spec(self) -> ShardSpec:
        """The spec of this storage's per-atom ShardTensors."""
        return ShardSpec(OwnedFirst(self.counts_), group=self.group, n_systems=self.n_systems)

    @property
    def positions(self) -> torch.Tensor:
        """Owned positions ``[n_owned, 3]`` (write them, then :meth:`update`, collective)."""
        return self._positions

    @positions.setter
    def positions(self, value: torch.Tensor) -> None:
        self._positions = value
        self._stale = True

    # ------------------------------------------------------------- neighbour list
    def _build(self) -> None:
        """The edges of the owned receivers, from the replicated geometry (no communication)."""
        lo, hi, n = self.offsets[self.rank], self.offsets[self.rank + 1], self.n_total
        x = self.all_positions.detach()
        snd, rcv, sh, csh, counts = [], [], [], [], []
        start = 0
        for s, size in enumerate(self.sizes):
            a, b = max(lo, start), min(hi, start + size)
            if a < b:  # this system has owned rows
                e = neighbor_list(
                    x[start : start + size], self.cutoff + self.skin, self.cells[s], self.pbcs[s]
                )
                keep = (e.receivers + start >= a) & (e.receivers + start < b)
                snd.append(e.senders[keep] + start)
                rcv.append(e.receivers[keep] + start)
                sh.append(e.shifts[keep])
                csh.append(e.cell_shifts[keep])
                counts.append(int(keep.sum()))
            else:
                counts.append(0)
            start += size
        dev = self.device
        none = torch.zeros(0, dtype=torch.int64, device=dev)
        glob_s = torch.cat(snd) if snd else none
        glob_r = torch.cat(rcv) if rcv else none
        self.senders = (glob_s - lo) % max(n, 1)  # rank-relative ids (OwnedFirst)
        self.receivers = glob_r - lo
        self.shifts = torch.cat(sh) if sh else torch.zeros(0, 3, dtype=self.dtype, device=dev)
        self.cell_shifts = torch.cat(csh) if csh else torch.zeros(0, 3, dtype=torch.int64, device=dev)
        self.edge_counts = counts
        self._ref = x.clone()
        self._build_cells = self.cells.detach().clone()
        self.builds += 1

    # ------------------------------------------------------------- the cell (NPT)
    def set_cell(self, cell: torch.Tensor, system: int | None = None) -> None:
        """Replicated, no communication: a barostat's new cell ``[3, 3]`` for one system (every
        rank passes the same one; ``system`` may be omitted for a single system). See
        :meth:`set_cells`."""
        if system is None:
            if self.n_systems != 1:
                raise ValueError(
                    f"set_cell: this storage holds a batch of {self.n_systems} systems; name the "
                    "system (set_cell(cell, system=s)) or give every cell (set_cells)"
                )
            system = 0
        if not 0 <= int(system) < self.n_systems:
            raise ValueError(f"set_cell: system {system} is not one of the {self.n_systems} systems")
        cells = self.cells.clone()
        cells[int(system)] = torch.as_tensor(cell).detach().to(cells)
        self.set_cells(cells)

    def set_cells(self, cells: torch.Tensor) -> None:
        """Replicated, no communication: the cells ``[S, 3, 3]`` of every system (the same on every
        rank: the barostats compute them from agreed values). The positions are replicated and
        scaled by the integrator on the owned rows (the next :meth:`update` re-replicates them), so
        nothing else moves here: the neighbour list keeps its pairs and integer lattice shifts,
        and the Cartesian shifts of a changed system's edges become ``cell_shifts @ cell`` (the
        formula of the list's own build, so the same bits as a fresh list at this cell). The list
        is rebuilt by :meth:`update` when the skin no longer covers the strain and the motion
        since the last build (its rule). Memory: the edges' shifts, rewritten in place of the old."""
        cells = torch.as_tensor(cells).detach().to(dtype=self.cells.dtype, device=self.cells.device)
        if cells.shape != self.cells.shape:
            raise ValueError(
                f"set_cells: expected cells of shape {tuple(self.cells.shape)}, got {tuple(cells.shape)}"
            )
        changed = [s for s in range(self.n_systems) if not torch.equal(cells[s], self.cells[s])]
        if not changed:
            return
        self.cells = cells.clone()
        self._reshift(changed)

    def _reshift(self, systems: list[int]) -> None:
        """The Cartesian shifts of the edges of ``systems`` at the current cells."""
        shifts = self.shifts.clone()
        at = 0
        for s, count in enumerate(self.edge_counts):
            if count and s in systems:
                cs = self.cell_shifts[at : at + count]
                if bool(self.pbcs[s].any()):
                    shifts[at : at + count] = cs.to(shifts.dtype) @ self.cells[s].to(shifts)
            at += count
        self.shifts = shifts  # a new tensor: the radius graph's cache sees the change

    def _affine_reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last build's positions carried by each system's deformation since then, ``x_ref
        M_s`` with ``M_s = cell_build^-1 cell``, ``[N, 3]``; each system's strain margin ``(cutoff
        + skin) (1 - sigma_min(M_s))``, ``[S]``, 0 for a system whose cell is the build's or only
        grew). Replicated: every rank computes it from the same cells (no communication)."""
        ref = self._ref
        margin = torch.zeros(self.n_systems, dtype=torch.float64)
        if self._build_cells.shape != self.cells.shape or torch.equal(self._build_cells, self.cells):
            return ref, margin
        ref = ref.clone()
        start = 0
        for s, size in enumerate(self.sizes):
            built, now = self._build_cells[s], self.cells[s]
            if not torch.equal(built, now):
                m = torch.linalg.solve(built.double().cpu(), now.double().cpu())
                sigma = float(torch.linalg.svdvals(m).min())
                margin[s] = max(0.0, (self.cutoff + self.skin) * (1.0 - sigma))
                ref[start : start + size] = ref[start : start + size] @ m.to(ref)
            start += size
        return ref, margin

    # ------------------------------------------------------------- MD
    def update(self, force: bool = False) -> bool:
        """Collective: re-replicate the positions (one all_gather of the owned rows) and rebuild
        the neighbour list when the skin no longer covers what changed since the last build (or
        when ``force``): per system ``s``, with ``M_s = cell_build^-1 cell`` its cell's deformation
        since then and ``d_s`` the largest displacement of its atoms from their build positions
        carried by ``M_s`` (``|x - x_ref M_s|``, the non-affine motion), the rule is ``2 d_s +
        (cutoff + skin) (1 - sigma_min(M_s)) > skin`` for any system (halo storage's rule,
        :meth:`ShardedSystem.update <twinshard.atoms.parallel.sharded.ShardedSystem.update>`; with
        fixed cells ``d > skin / 2``). The decision is taken from replicated data: the same on
        every rank. Raises :class:`~twinshard.atoms.dynamics.sanity.Diverged` (a ValueError) on
        every rank, before the neighbour list, if a position is NaN/inf or jumped farther than
        ``cutoff + skin`` from that reference (then, on that agreed path only, one all_gather of
        the owned ids names the atoms). Returns whether it rebuilt. Memory: the ``N x 3``
        replicated positions and the owned receivers' edges."""
        self._replicate(agreed=True)
        x = self.all_positions
        limit = self.cutoff + self.skin
        ref, margin = self._affine_reference()
        d = sanity.displacements(x, ref)
        disp = float(d.max()) if d.numel() else 0.0
        if disp > limit:  # replicated: every rank takes this branch
            ids = self.all_gather_rows(self.ids)
            lo, hi = self.offsets[:-1], self.offsets[1:]
            rows = [sanity.position_report(x[a:b], ref[a:b], ids[a:b], limit) for a, b in zip(lo, hi)]
            sanity.check_positions(torch.stack(rows), limit)
        need = False
        if bool(margin.any()):  # a cell changed since the build: the rule per system
            start = 0
            for s, size in enumerate(self.sizes):
                ds = float(d[start : start + size].max()) if size else 0.0
                need = need or 2.0 * ds + float(margin[s]) > self.skin
                start += size
        else:
            need = disp > 0.5 * self.skin
        if force or need:
            self._build()
            return True
        return False

    def _replicate(self, agreed: bool = False) -> None:
        """Collective: the replicated positions after owned rows were written. Whether any rank
        wrote is a per-rank fact, so it is agreed first (one all-reduce of a flag), never read
        locally: a rank that skipped the all-gather its peers enter would hang them. ``agreed``:
        the caller gathers anyway (``update``: the MD step wrote on every rank)."""
        stale = agreed or bool(
            prim.all_reduce(torch.tensor([float(self._stale)], device=self.device), self.group, op="stale")[0]
            > 0
        )
        if stale:
            self.all_positions = self.all_gather_rows(self._positions.detach())
            self._stale = False

    def all_gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Collective (one all_gather, not differentiable): per-atom owned rows -> all N rows in
        global order on every rank (memory: N rows per rank)."""
        return prim.all_gather(t.contiguous(), 0, self.group, list(self.counts_), op="gather")

    def gather_rows(self, t: torch.Tensor, dst: int = 0) -> torch.Tensor | None:
        """Collective (one all_to_all, not differentiable): per-atom owned rows -> all N rows in
        the caller's order on ``dst`` (N rows there), None elsewhere."""
        send = [0] * self.nranks
        send[dst] = int(t.shape[0])
        recv = list(self.counts_) if self.rank == dst else [0] * self.nranks
        out = all_to_all_rows(t.detach(), send, recv, self.group, "gather")
        return out if self.rank == dst else None

    def gather_systems(self, dst: int = 0) -> list[System] | None:
        """Collective (one all_to_all per per-atom field): the batch back on ``dst`` (each
        system's atoms in the caller's order; the whole batch held there), None elsewhere."""
        self._replicate()
        got = {k: self.gather_rows(getattr(self, k), dst) for k in FIELDS}
        if self.rank != dst:
            return None
        return split_systems(self.sizes, self.cells, self.pbcs, self.all_positions, got, self.infos)

    def gather(self, dst: int = 0) -> System | None:
        """Collective: a single system on ``dst``, atoms ordered by id (as
        :meth:`ShardedSystem.gather <twinshard.atoms.parallel.sharded.ShardedSystem.gather>`)."""
        if self.n_systems != 1:
            raise ValueError("gather: a batch of several systems; use gather_systems")
        got = self.gather_systems(dst)
        if got is None:
            return None
        return got[0].select(torch.argsort(got[0].ids))

    def __repr__(self) -> str:
        return (
            f"GraphSharded(rank={self.rank}/{self.nranks}, owned={self.n_owned}, total={self.n_total}, "
            f"systems={self.n_systems}, edges={int(self.senders.shape[0])}, builds={self.builds})"
        )


# ----------------------------------------------------------------------------- evaluation
def graph_inputs(
    g: GraphSharded,
    positions: torch.Tensor | None = None,
    cutoff: float | None = None,
    wrap: bool | None = None,
) -> dict[str, Any]:
    """The plain-contract input dict of this rank (no communication): ``positions``, ``numbers``,
    ``batch`` as ``OwnedFirst`` ShardTensors (``positions`` differentiable in the owned rows
    ``positions``, default ``g.positions``), per-edge ``senders``, ``receivers``, ``shifts``
    (rank-relative ids, cartesian shifts), the replicated ``cell [S, 3, 3]`` and the systems'
    replicated ``charge`` / ``spin`` ``[S]`` when their infos hold them (``SYSTEM_VALUES``).

    The edges are the radius graph ``r < cutoff`` (default ``g.cutoff``) at the replicated
    positions ``g.all_positions`` (current after :meth:`GraphSharded.update`): the Verlet list
    (``cutoff + skin``) minus its skin edges, as the model's own neighbour list would give it.

    A group of one rank gets plain tensors (every row is owned, the ids are the global rows: there
    is nothing to fetch or ship), so the model runs as serially, without the dispatch's per-op
    cost, as halo storage's one-rank block (:func:`~twinshard.atoms.parallel.plain_inputs.block_inputs`);
    ``wrap=True`` wraps them anyway (a one-rank check of the dispatch itself)."""
    x = g.positions if positions is None else positions
    spec = g.spec()
    # rank-relative ids: id i is global row (i + offsets[rank]) mod N
    rel = torch.roll(g.all_positions.to(x.dtype), -g.offsets[g.rank], 0)
    senders, receivers, shifts = g.radius_graph(
        rel, g.senders, g.receivers, g.shifts.to(x.dtype), float(g.cutoff if cutoff is None else cutoff)
    )
    plain = not wrap and g.nranks == 1
    return {
        "positions": x if plain else from_local(x, spec),
        "numbers": g.numbers if plain else ShardTensor.wrap(g.numbers, spec),
        "senders": senders,
        "receivers": receivers,
        "shifts": shifts,
        "batch": g.batch if plain else ShardTensor.wrap(g.batch, spec),
        "cell": g.cells.to(x.device, x.dtype),
        **system_values(g.infos, x),
    }


def _check(dp: Any, g: GraphSharded) -> None:
    if dp.mode != "dispatch":
        raise ValueError(
            "graph storage runs plain-PyTorch models through the dispatch: DistributedPotential(model, "
            "mode='dispatch') (the Graph-contract models use halo storage)"
        )
    if g.cutoff + 1e-12 < dp.cutoff:  # replicated values: every rank raises
        raise ValueError(
            f"the graph storage's neighbour list was built for cutoff {g.cutoff}, but the potential "
            f"needs {dp.cutoff}; scatter with cutoff=potential.cutoff"
        )
    g._replicate()


def graph_energies(dp: Any, g: GraphSharded, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Collective: owned per-atom energies ``[n_owned]`` (differentiable in the owned
    ``positions`` and the parameters; the backward is collective: every rank runs it).
    Placements: in owned rows / replicated parameters; out owned rows. Collectives: the model's
    gathers (all-to-alls) and per-system reduce (all-reduce), their adjoints in backward."""
    _check(dp, g)
    out = call_plain_model(
        dp, g, graph_inputs(g, positions, dp.cutoff), compute_forces=False, compute_stress=False
    )
    return to_local(out["node_energy"])


def graph_compute(
    dp: Any, g: GraphSharded, compute_stress: bool = True, create_graph: bool = False
) -> Results:
    """Collective: energies, owned per-atom energies and forces, virials and stresses of the
    batch, computed by the model itself (its ``torch.autograd.grad``).

    Placements out: ``per_atom [n_owned]``, ``forces [n_owned, 3]`` owned rows (global rows
    ``offsets[rank]:offsets[rank + 1]``); ``energy``, ``virial``, ``stress`` replicated: for one
    system a scalar and ``[3, 3]`` (``stress`` None without a cell volume), for a batch of S
    systems ``[S]`` and ``[S, 3, 3]`` (a system without volume has a NaN stress). ``stress =
    -virial / V``. Collectives: see the module docstring (forward: per gather or scatter one
    all-gather of the ranks' index keys and one all-to-all of rows, plus two all-to-alls of
    routing the first time an index is seen; one all-reduce per per-system sum; backward: their
    adjoints; the displacement's gradient one all-reduce). Memory per rank: the autograd graph of the owned rows and edges."""
    _check(dp, g)
    x = g.positions.detach().requires_grad_(True)
    out = call_plain_model(
        dp,
        g,
        graph_inputs(g, x, dp.cutoff),
        compute_forces=True,
        compute_stress=compute_stress,
        training=create_graph,
    )
    energy = to_local(out["energy"])
    per_atom, forces = to_local(out["node_energy"]), to_local(out["forces"])
    virial = stress = None
    if compute_stress:
        virial = to_local(out["virial"]).reshape(-1, 3, 3)
        vol = g.volumes.to(virial.dtype)
        stress = torch.where(
            (vol > 0)[:, None, None], -virial / vol.clamp_min(1e-300)[:, None, None], float("nan")
        )
    if g.n_systems == 1:
        energy = energy.reshape(-1)[0]
        if virial is not None:
            virial, stress = virial[0], (stress[0] if g.volume > 0 else None)
    if not create_graph:
        energy, per_atom, forces = energy.detach(), per_atom.detach(), forces.detach()
        virial = None if virial is None else virial.detach()
        stress = None if stress is None else stress.detach()
    return Results(energy, per_atom, forces, stress=stress, virial=virial)
