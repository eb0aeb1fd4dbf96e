"""Halo (ghost) atoms: selection, plans, and the forward/reverse exchanges.

A rank's *halo-padded block* is ``[owned | halo]``: its owned atoms followed by
copies (periodic images included) of every atom, owned here or elsewhere,
that lies within the ghost width ``w = cutoff + skin`` of the rank's *box*.

Wrap axes (the partition's ``wrap_axes()``: periodic with one rank along them)
are the exception: there the block itself stays periodic (its neighbour list
gives edges integer lattice shifts along them, as the serial list does), so no
image along a wrap axis is a halo row, the ghost test ignores that axis, and a
halo row sits at its owner's frame coordinate along it. At P=1 on a fully
periodic system the block has no halo rows at all; on a ``(2, 1, 1)`` grid the
halo is the ghost shell along x only.
The box of a rank is, in fractional coordinates of its own frame, the union of
its partition region (if any) and the bounding box of the atoms it owns; the
ghost test extends it by ``w / h_a`` along axis ``a`` (``h_a`` the cell height),
which for triclinic cells is a (slightly generous) superset of the true
w-neighbourhood, never a subset.

Each image ``(atom j, lattice shift n)`` appears at most once in a block (up to
translations along wrap axes, which are edge shifts) and an owned atom never
reappears unshifted, so nothing is counted twice. Several images of one atom, and
images of a rank's own atoms (a rank bordering itself along a split periodic
axis, or a block partition of several ranks), are ordinary halo rows.

:class:`HaloPlan` records, per neighbour rank, which owned rows go there and
with which lattice shift, and how many halo rows come back. Its two exchanges:

- :meth:`HaloPlan.forward` (owned -> halo copies), ``F: [n_owned, ...] ->
  [n_halo, ...]``;
- :meth:`HaloPlan.reverse` (halo partial sums -> owners), ``R = F^T``,
  accumulating in ``promote_types(dtype, float32)`` (fp64 stays fp64).

Each is the autograd adjoint of the other (the backward of one calls the
other, so double backward works too). Both talk only to neighbour ranks, via
``twinshard.comm`` point-to-point ``exchange`` (ledger ops ``halo_forward`` and
``halo_reverse``, and ``halo_forward:backward`` for the reverse exchange run by
autograd); a rank's images of its own atoms are local copies.
Collectives per call: one all_gather of a vote (``<op>:grad_agree``: does
the exchange take the autograd path? one replicated decision, so no rank skips
its half of the backward) for floating payloads, then one sparse exchange with
the neighbour set, forward and backward alike. Memory: nothing saved for
backward but the plan (indices).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from twinshard.comm import primitives as prim
from twinshard.runtime.world import require_world
from twinshard.shard.custom_ops import halo_forward, halo_reverse

__all__ = ["HaloPlan", "frame_coordinates", "rank_box", "neighbour_ranks", "select_ghosts"]


def frame_coordinates(
    frac: torch.Tensor, centre: torch.Tensor, pbc: tuple[bool, bool, bool]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map unwrapped fractional coordinates into the frame ``[centre - 1/2, centre + 1/2)``.

    Returns ``(frac_in_frame, shift)`` with integer ``shift [n, 3]`` (zero on
    open axes) such that ``frac_in_frame = frac + shift``.
    """
    shift = torch.zeros(frac.shape, dtype=torch.int64, device=frac.device)
    for a in range(3):
        if pbc[a]:
            shift[:, a] = -torch.floor(frac[:, a] - float(centre[a]) + 0.5).to(torch.int64)
    return frac + shift.to(frac.dtype), shift


def rank_box(frac_frame: torch.Tensor, region: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """``[2, 3]`` box (lo; hi): the region joined with the bounding box of the owned atoms.

    An empty box (no region, no atoms) is ``lo = +inf, hi = -inf``.
    """
    dev = frac_frame.device
    lo = torch.full((3,), math.inf, dtype=torch.float64, device=dev)
    hi = torch.full((3,), -math.inf, dtype=torch.float64, device=dev)
    if region is not None:
        lo, hi = region[0].to(dev, copy=True), region[1].to(dev, copy=True)
    if frac_frame.shape[0]:
        lo = torch.minimum(lo, frac_frame.min(0).values)
        hi = torch.maximum(hi, frac_frame.max(0).values)
    return torch.stack([lo, hi])


def _empty(box: torch.Tensor) -> bool:
    return bool((box[0] > box[1]).any())


_NO_WRAP = (False, False, False)


def neighbour_ranks(
    boxes: torch.Tensor,
    margin: torch.Tensor,
    pbc: tuple[bool, bool, bool],
    me: int,
    wrap: tuple[bool, bool, bool] = _NO_WRAP,
) -> list[int]:
    """Ranks (sorted, ``me`` included if it borders itself) whose boxes lie within the margin.

    The relation is symmetric, so both ends of every pair agree to talk.
    ``boxes [P, 2, 3]``; ``margin [3]`` is the ghost width in fractional units. Along a
    ``wrap`` axis the blocks are periodic: it neither separates two ranks nor makes a
    rank border itself.
    """
    out = []
    for q in range(boxes.shape[0]):
        if q == me:
            if _borders_itself(boxes[me], margin, pbc, wrap):
                out.append(q)
        elif _adjacent(boxes[min(me, q)], boxes[max(me, q)], margin, pbc, wrap):
            # evaluated in one orientation on both ranks, so rounding cannot break symmetry
            out.append(q)
    return out


def _adjacent(
    box_a: torch.Tensor,
    box_b: torch.Tensor,
    margin: torch.Tensor,
    pbc: tuple[bool, bool, bool],
    wrap: tuple[bool, bool, bool] = _NO_WRAP,
) -> bool:
    if _empty(box_a) or _empty(box_b):
        return False
    for a in range(3):
        if wrap[a]:
            continue
        d = float(margin[a])
        lo_a, hi_a = float(box_a[0, a]), float(box_a[1, a])
        lo_b, hi_b = float(box_b[0, a]), float(box_b[1, a])
        if pbc[a]:
            # some integer n with [lo_a + n, hi_a + n] meeting [lo_b - d, hi_b + d]
            if math.floor(hi_b + d - lo_a) < math.ceil(lo_b - d - hi_a):
                return False
        elif lo_a > hi_b + d or hi_a < lo_b - d:
            return False
    return True


def _borders_itself(
    box: torch.Tensor,
    margin: torch.Tensor,
    pbc: tuple[bool, bool, bool],
    wrap: tuple[bool, bool, bool] = _NO_WRAP,
) -> bool:
    """A non-zero lattice image of the box comes within the margin along some periodic axis
    (wrap axes excluded: those images are edge shifts of the block)."""
    if _empty(box):
        return False
    return any(
        pbc[a] and not wrap[a] and float(box[1, a] - box[0, a]) + 2 * float(margin[a]) >= 1.0
        for a in range(3)
    )


def select_ghosts(
    frac_frame: torch.Tensor,
    box: torch.Tensor,
    margin: torch.Tensor,
    pbc: tuple[bool, bool, bool],
    exclude_self: bool,
    wrap: tuple[bool, bool, bool] = _NO_WRAP,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Owned atoms (and lattice shifts) whose images lie within ``margin`` of ``box``.

    Args:
        frac_frame: ``[n, 3]`` fractional coordinates of the sender's owned atoms.
        box: ``[2, 3]`` receiver's box; ``margin [3]`` ghost width in fractional units.
        exclude_self: the receiver is the sender: skip the zero shift (the atom itself).
        wrap: axes along which the receiving block is periodic: no test and no image
            there (shift 0: the frame coordinate; the block's edges carry the images).

    Returns:
        ``idx [k]`` rows of ``frac_frame`` and ``shift [k, 3]`` integer images,
        ordered by image then row, so the order is deterministic.
    """
    n, dev = frac_frame.shape[0], frac_frame.device
    none = torch.zeros(0, dtype=torch.int64, device=dev), torch.zeros(0, 3, dtype=torch.int64, device=dev)
    if n == 0 or _empty(box):
        return none
    k0 = torch.zeros(n, 3, dtype=torch.int64, device=dev)
    cnt = torch.zeros(n, 3, dtype=torch.int64, device=dev)
    for a in range(3):
        f = frac_frame[:, a]
        lo = float(box[0, a]) - float(margin[a])
        hi = float(box[1, a]) + float(margin[a])
        if wrap[a]:
            cnt[:, a] = 1  # k0 = 0: one copy, at the frame coordinate
        elif pbc[a]:
            first = torch.ceil(lo - f)
            last = torch.floor(hi - f)
            k0[:, a] = first.to(torch.int64)
            cnt[:, a] = torch.clamp(last - first + 1, min=0).to(torch.int64)
        else:
            cnt[:, a] = ((f >= lo) & (f <= hi)).to(torch.int64)
    cand = torch.nonzero((cnt > 0).all(1)).flatten()
    idx_out, shift_out = [], []
    if cand.numel():
        kc, cc = k0[cand], cnt[cand]
        mx = cc.max(0).values.tolist()
        for j in itertools.product(range(mx[0]), range(mx[1]), range(mx[2])):
            jt = torch.tensor(j, dtype=torch.int64, device=dev)
            valid = (jt < cc).all(1)
            s = kc + jt
            if exclude_self:
                valid &= (s != 0).any(1)
            if bool(valid.any()):
                idx_out.append(cand[valid])
                shift_out.append(s[valid])
    if not idx_out:
        return none
    return torch.cat(idx_out), torch.cat(shift_out)


@dataclass
class HaloPlan:
    """Who sends which owned rows to whom, with which lattice shift.

    Attributes:
        rank: this rank in the group; ``peers``: sorted neighbour ranks (group ranks, may
            include itself); ``global_peers`` maps them to global ranks.
        n_owned: owned rows on this rank; ``n_halo``: halo rows it receives.
        send_idx / send_shift: per peer, owned rows and their integer image shifts
            (relative to the *unwrapped* positions) sent there.
        recv_counts: per peer, halo rows received (halo rows are grouped by peer,
            peers in sorted order).
        halo_ids: ``[n_halo]`` global ids of the halo rows.
        halo_shift: ``[n_halo, 3]`` integer lattice shifts: a halo row's position is
            the owner's unwrapped position plus ``halo_shift @ cell``.
        owned_shift: ``[n_owned, 3]`` shifts putting owned atoms into this rank's frame.
        wrap: axes along which the block is periodic (the partition's ``wrap_axes()``): its
            neighbour list must use the cell with ``pbc = wrap``; no halo row is an image
            along them.
    """

    rank: int
    peers: list[int]
    global_peers: dict[int, int]
    n_owned: int
    send_idx: dict[int, torch.Tensor]
    send_shift: dict[int, torch.Tensor]
    recv_counts: dict[int, int]
    halo_ids: torch.Tensor
    halo_shift: torch.Tensor
    owned_shift: torch.Tensor
    group: dist.ProcessGroup | None = None
    wrap: tuple[bool, bool, bool] = _NO_WRAP

    @property
    def n_halo(self) -> int:
        return int(self.halo_ids.shape[0])

    @property
    def n_sent(self) -> int:
        """Rows this rank sends to other ranks per forward exchange (self images excluded)."""
        return sum(int(v.numel()) for p, v in self.send_idx.items() if p != self.rank)

    # ----------------------------------------------------------- building
    @staticmethod
    def build(
        frac: torch.Tensor,
        ids: torch.Tensor,
        partition: object,
        ghost_width: float | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> HaloPlan:
        """Collective: build the plan from this rank's owned atoms.

        Args:
            frac: ``[n_owned, 3]`` unwrapped fractional coordinates of the owned atoms.
            ids: ``[n_owned]`` their global ids.
            partition: a :class:`~twinshard.atoms.parallel.partition.SpatialPartition` or
                :class:`~twinshard.atoms.parallel.partition.BlockPartition` (same on every rank).
            ghost_width: defaults to ``partition.ghost_width`` (cutoff + skin).
            group: the world (``None``) or a 1-D group whose ranks are the partition's.

        Collectives (every rank, same order): one all_gather of the ``[2, 3]``
        boxes, one exchange of counts and one of ``(id, shift)`` rows with the
        neighbour ranks.
        """
        me = dist.get_rank(group)
        nranks = dist.get_world_size(group)
        if getattr(partition, "nranks", nranks) != nranks:
            raise ValueError(f"partition is for {partition.nranks} ranks, the group has {nranks}")
        w = float(partition.ghost_width if ghost_width is None else ghost_width)
        pbc = partition.pbc
        wrap = tuple(bool(v) for v in getattr(partition, "wrap_axes", lambda: _NO_WRAP)())
        margin = w / partition.heights()
        frac, ids = frac.detach().to("cpu", torch.float64), ids.cpu()  # host-side planning
        frame, owned_shift = frame_coordinates(frac, partition.frame_center(me), pbc)
        box = rank_box(frame, partition.region(me))
        # planning runs on the host (frac is a CPU tensor); payloads travel on the world's device
        dev = require_world("HaloPlan.build").device
        boxes = prim.all_gather(box[None].to(dev), 0, group, op="halo_plan").reshape(nranks, 2, 3).cpu()
        peers = neighbour_ranks(boxes, margin, pbc, me, wrap)
        send_idx, send_shift = {}, {}
        for q in peers:
            idx, s = select_ghosts(frame, boxes[q], margin, pbc, exclude_self=(q == me), wrap=wrap)
            send_idx[q] = idx
            send_shift[q] = s + owned_shift[idx]
        gpeer = [_global(group, q) for q in peers]
        counts = _exchange(
            [
                (gp, torch.tensor([send_idx[q].numel()], dtype=torch.int64, device=dev))
                for q, gp in zip(peers, gpeer)
            ],
            [(gp, (1,)) for gp in gpeer],
            torch.int64,
            "halo_plan",
        )
        recv_counts = {q: int(c[0]) for q, c in zip(peers, counts)}
        payload = _exchange(
            [
                (gp, torch.cat([ids[send_idx[q]].to(torch.int64)[:, None], send_shift[q]], 1).to(dev))
                for q, gp in zip(peers, gpeer)
                if send_idx[q].numel()
            ],
            [(gp, (recv_counts[q], 4)) for q, gp in zip(peers, gpeer) if recv_counts[q]],
            torch.int64,
            "halo_plan",
        )
        rows = torch.cat(payload).cpu() if payload else torch.zeros(0, 4, dtype=torch.int64, device="cpu")
        return HaloPlan(
            rank=me,
            peers=peers,
            global_peers=dict(zip(peers, gpeer)),
            n_owned=int(frac.shape[0]),
            # what the per-step exchanges index with lives on the world's device (no copy per step)
            send_idx={q: v.to(dev) for q, v in send_idx.items()},
            send_shift=send_shift,
            recv_counts=recv_counts,
            halo_ids=rows[:, 0].contiguous(),
            halo_shift=rows[:, 1:].to(dev).contiguous(),
            owned_shift=owned_shift.to(dev),
            group=group,
            wrap=wrap,  # type: ignore[arg-type]
        )

    # ----------------------------------------------------------- exchanges
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Halo copies ``[n_halo, ...]`` of owned rows ``x [n_owned, ...]``, differentiable: the one
        halo exchange, ``twinshard::halo_forward`` (:func:`twinshard.shard.custom_ops.halo_forward`:
        a replicated autograd vote for floating ``x``; backward the reverse exchange, and double
        backward this one again)."""
        return halo_forward(x, self)

    def reverse(self, y: torch.Tensor) -> torch.Tensor:
        """Owner sums ``[n_owned, ...]`` of halo partials ``y [n_halo, ...]``, differentiable
        (``twinshard::halo_reverse``, :func:`twinshard.shard.custom_ops.halo_reverse`)."""
        return halo_reverse(y, self)

    def refresh(self, h: torch.Tensor) -> torch.Tensor:
        """``[owned | halo]`` rows with the halo overwritten by the owners' current values."""
        own = h[: self.n_owned]
        return torch.cat([own, self.forward(own)])

    def padded_positions(self, x_owned: torch.Tensor, cell: torch.Tensor, vote: bool = True) -> torch.Tensor:
        """``[n_owned + n_halo, 3]`` block positions in this rank's frame (differentiable in x).

        ``vote=False``: every rank passes detached positions and wants no gradient, so the
        exchange skips the autograd vote (one all_gather fewer; analytic paths, plan builds).
        """
        cell = cell.to(dtype=x_owned.dtype, device=x_owned.device)
        own = x_owned + self.owned_shift.to(x_owned.device, x_owned.dtype) @ cell
        sent = self.forward(x_owned) if vote else self._forward_raw(x_owned)
        halo = sent + self.halo_shift.to(x_owned.device, x_owned.dtype) @ cell
        return torch.cat([own, halo])

    def reverse_sum(self, y: torch.Tensor, op: str = "halo_reverse") -> torch.Tensor:
        """Collective with the neighbour ranks: owner sums ``[n_owned, ...]`` of halo partials
        ``y [n_halo, ...]``, no autograd and no vote (every rank calls it on the same path: the
        analytic pair potentials). One exchange; scatter-add into owned rows on the device."""
        if y.shape[0] != self.n_halo:
            raise ValueError(f"halo reverse: expected {self.n_halo} halo rows, got {y.shape[0]}")
        return self._reverse_raw(y, op)

    def forward_copy(self, x: torch.Tensor, op: str = "halo_forward") -> torch.Tensor:
        """Collective with the neighbour ranks: halo copies ``[n_halo, ...]`` of owned rows
        ``x [n_owned, ...]``, no autograd and no vote (the adjoint of :meth:`reverse_sum`; the
        kernel of ``twinshard::halo_forward``, whose registered autograd supplies the backward).
        One exchange, none with a rank that neither sends nor receives."""
        if x.shape[0] != self.n_owned:
            raise ValueError(f"halo forward: expected {self.n_owned} owned rows, got {x.shape[0]}")
        return self._forward_raw(x, op)

    def _forward_raw(self, x: torch.Tensor, op: str = "halo_forward") -> torch.Tensor:
        x = x.detach()
        tail = tuple(x.shape[1:])
        sends = [
            (self.global_peers[q], x[self.send_idx[q].to(x.device)])
            for q in self.peers
            if self.send_idx[q].numel()
        ]
        recvs = [
            (self.global_peers[q], (self.recv_counts[q],) + tail) for q in self.peers if self.recv_counts[q]
        ]
        got = _exchange(sends, recvs, x.dtype, op)
        if not got:
            return x.new_zeros((0,) + tail)
        return torch.cat(got)

    def _reverse_raw(self, y: torch.Tensor, op: str = "halo_reverse") -> torch.Tensor:
        y = y.detach()
        tail = tuple(y.shape[1:])
        acc = prim.reduce_dtype(y.dtype)
        counts = [self.recv_counts[q] for q in self.peers]
        parts = torch.split(y, counts) if self.peers else []
        sends = [(self.global_peers[q], p) for q, p in zip(self.peers, parts) if p.shape[0]]
        recvs = [
            (self.global_peers[q], (self.send_idx[q].numel(),) + tail)
            for q in self.peers
            if self.send_idx[q].numel()
        ]
        got = _exchange(sends, recvs, y.dtype, op)
        out = torch.zeros((self.n_owned,) + tail, dtype=acc, device=y.device)
        srcs = [q for q in self.peers if self.send_idx[q].numel()]
        for q, g in zip(srcs, got):
            out.index_add_(0, self.send_idx[q].to(y.device), g.to(acc))
        return out.to(y.dtype)


def _global(group: dist.ProcessGroup | None, q: int) -> int:
    return q if group is None else dist.get_global_rank(group, q)


def _exchange(sends: list, recvs: list, dtype: torch.dtype, op: str) -> list[torch.Tensor]:
    if not sends and not recvs:
        return []
    return prim.exchange(sends, recvs, dtype=dtype, op=op)  # type: ignore[return-value]
