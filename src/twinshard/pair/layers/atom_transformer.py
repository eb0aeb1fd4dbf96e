"""CP twin of the atom transformer: sequence-local window attention over the atoms of a grid row,
with the keys from a halo of atoms (AF3 Alg. 7/23-26; the serial modules in
:mod:`twinshard.pair.reference.atom_transformer`).

Placement. Atoms are placed as ``twinshard.pair.atoms`` says: grid row r holds the global atoms
``[s_b, s_b + n_b)`` of sample b (its token block's), replicated along the row, in a tile
``[B, A_blk, ...]``. Boltz-2's windows are global: window k has the queries ``[W k, W k + W)``
and the keys ``[W k - m, W k + W + m)`` (``m = (H - W) / 2``; 48 for 32 x 128), zero outside
``[0, A)``. A rank computes the queries of its own atoms only; they lie in the windows
``k_lo = s_b // W`` to ``k_hi = (s_b + n_b - 1) // W``, whose keys are the atoms
``need_b = [W k_lo - m, W k_hi + W + m) ∩ [0, A)``. The *halo* is ``need_b`` minus my atoms:
exactly the atoms of the neighbouring row blocks (one or several, when blocks are small) that
the windows of my atoms read, nothing more.

:class:`WindowPlan` (a pure function of the replicated layout: every rank derives every peer's
part) lays out a rank's ``nW = max_b (k_hi - k_lo + 1)`` windows: a *query frame*
``[B, nW W, ...]`` (window slot p holds global atom ``W k_lo + p``; slots of atoms that are not
mine hold zeros, their outputs are dropped and get no gradient) and a *key frame*
``[B, nW W + H - W, ...]`` starting at global atom ``W k_lo - m``, holding my atoms, the halo and
zeros elsewhere; :func:`twinshard.pair.reference.atom_transformer.window_keys` cuts the keys of
each window from it, as in serial. The serial modules run unchanged on the frames.

Equality with serial. A query's logits are Boltz-2's for every key the halo holds. A key slot
the halo leaves zero is either outside ``[0, A)`` (Boltz's keys are zero there too, mask 0) or
belongs to a window slot beyond ``k_hi`` (no query of mine reads it). Keys with mask 0 get
``-1e6`` added to a logit of order 1, whose ``exp`` is exactly 0 in fp32/fp64 whenever the
window has a real key, so what a zero-filled (or padding) key holds never reaches an output.

Collectives (``_KeyFrame``, point to point along the grid column only: rank (r, c) exchanges
with the ranks (r', c)): forward, one sparse exchange of the halo rows (``embed:halo``, one
message per peer); backward, the reverse (``embed:halo:backward``): the gradient of each halo
row goes back to its owner, which adds it to the gradient of its own tile. The atom encoder
issues one for the static key features (position, mask, uid, ``c``) and the transformer one
per layer for the keys' input; bytes per exchange and rank: halo atoms x channels x itemsize.
Parameters are replicated and every rank of a grid row computes the same values, so their
gradients are summed over the grid column only (``grad_group`` of the single placement), which
counts each row's contribution once.

Memory saved for backward per rank: the serial module's activations for ``nW`` windows
(``nW W <= A_blk + 2 (W - 1)`` queries, ``nW`` key blocks of H), i.e. the serial ``A / R`` share
plus two partial windows; nothing of size A (or A x N) is held.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from twinshard.comm.amp import autocast_rule
from twinshard.pair.layers.triangle_attention import Packed
from twinshard.pair.layout import PairLayout
from twinshard.pair.reference.atom_transformer import AtomTransformer, frame_margin, window_keys
from twinshard.runtime.grid import ProcessGrid

__all__ = ["CPAtomTransformer", "HaloKeys", "WindowPlan", "window_plan"]


def _inter(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True)
class WindowPlan:
    """One rank's windows and halo (module docstring). Per sample ``b``: ``k_lo[b]`` the first
    window, ``starts[b]``/``counts[b]`` my atoms; ``sends``: ``(peer, b, lo, hi)`` rows of my tile
    to send; ``recvs``: ``(peer, b, lo, hi, pos)`` rows ``[lo, hi)`` of the peer's tile, placed at
    key-frame position ``pos``."""

    w: int
    h: int
    windows: int
    k_lo: tuple[int, ...]
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    sends: tuple[tuple[int, int, int, int], ...]
    recvs: tuple[tuple[int, int, int, int, int], ...]

    @property
    def frame_len(self) -> int:
        return self.windows * self.w + self.h - self.w

    def origin(self, b: int) -> int:
        """Global atom at key-frame position 0 of sample ``b``."""
        return self.w * self.k_lo[b] - frame_margin(self.w, self.h)

    def halo_atoms(self) -> int:
        """Atoms this rank receives per exchange (all samples)."""
        return sum(hi - lo for _, _, lo, hi, _ in self.recvs)


def _need(layout: PairLayout, row: int, b: int, w: int, h: int) -> tuple[int, int] | None:
    """Global atoms the windows of grid row ``row``'s atoms read as keys (None: no atoms)."""
    s, c = layout.atom_starts[b][row], layout.atom_counts[b][row]  # type: ignore[index]
    if c == 0:
        return None
    m = frame_margin(w, h)
    k_lo, k_hi = s // w, (s + c - 1) // w
    return max(0, w * k_lo - m), min(layout.n_atoms, w * k_hi + w + m)  # type: ignore[type-var]


def window_plan(layout: PairLayout, grid: ProcessGrid, w: int, h: int) -> WindowPlan:
    """This rank's :class:`WindowPlan` (no communication)."""
    if layout.atom_starts is None or layout.atom_counts is None or layout.n_atoms is None:
        raise ValueError("the atom transformer needs a layout with atoms (distribute the atom features)")
    r, col = grid.coords
    rows = grid.rows
    nb = len(layout.atom_starts)
    k_lo, windows = [], 1
    for b in range(nb):
        s, c = layout.atom_starts[b][r], layout.atom_counts[b][r]
        k_lo.append(s // w if c else 0)
        if c:
            windows = max(windows, (s + c - 1) // w - s // w + 1)
    m = frame_margin(w, h)
    sends, recvs = [], []
    for other in range(rows):
        if other == r:
            continue
        peer = grid.rank_of((other, col))
        for b in range(nb):
            own = (layout.atom_starts[b][r], layout.atom_starts[b][r] + layout.atom_counts[b][r])
            theirs = (
                layout.atom_starts[b][other],
                layout.atom_starts[b][other] + layout.atom_counts[b][other],
            )
            need = _need(layout, r, b, w, h)
            got = _inter(need, theirs) if need else None
            if got:
                recvs.append((peer, b, got[0] - theirs[0], got[1] - theirs[0], got[0] - (w * k_lo[b] - m)))
            need = _need(layout, other, b, w, h)
            give = _inter(need, own) if need else None
            if give:
                sends.append((peer, b, give[0] - own[0], give[1] - own[0]))
    return WindowPlan(
        w,
        h,
        windows,
        tuple(k_lo),
        tuple(s[r] for s in layout.atom_starts),
        tuple(c[r] for c in layout.atom_counts),
        tuple(sends),
        tuple(recvs),
    )


def slice_move(x: torch.Tensor, sends: Any, recvs: Any, op: str) -> Packed:
    """Start moving rows between ranks: ``x[b, lo:hi]`` to peer ``p`` for each ``(p, b, lo, hi)`` of
    ``sends``; ``hi - lo`` rows from peer ``p`` for each ``(p, b, lo, hi, pos)`` of ``recvs`` (their
    place ``pos`` is the caller's). ``.wait()`` gives the received pieces in ``recvs`` order."""
    rest = tuple(x.shape[2:])
    return Packed(
        [(p, x[b, lo:hi]) for p, b, lo, hi in sends],
        [(p, (hi - lo, *rest)) for p, _, lo, hi, _ in recvs],
        x.dtype,
        op,
    )


def slice_return(g: torch.Tensor, sends: Any, recvs: Any, op: str) -> Packed:
    """The adjoint of :func:`slice_move`: each received piece's gradient ``g[b, pos : pos + hi -
    lo]`` back to its sender; ``.wait()`` gives the returned pieces in ``sends`` order."""
    rest = tuple(g.shape[2:])
    return Packed(
        [(p, g[b, pos : pos + hi - lo]) for p, b, lo, hi, pos in recvs],
        [(p, (hi - lo, *rest)) for p, _, lo, hi in sends],
        g.dtype,
        f"{op}:backward",
    )


@autocast_rule()
class _KeyFrame(torch.autograd.Function):
    """My tile ``[B, A_blk, ...]`` -> my key frame ``[B, L, ...]`` (my atoms, the halo from the
    owners, zeros elsewhere). Backward: the frame's gradient on my atoms, plus the gradient of my
    rows that other ranks used, sent back by them and summed here.

    Dtype path: halo rows travel in the tile's dtype; backward in the gradient's dtype, summed
    in it (one addend per owner: the sum of a row's own gradient and those sent back). No cast.
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, plan: WindowPlan, op: str) -> torch.Tensor:
        ctx.plan, ctx.op, ctx.shape = plan, op, tuple(local.shape)
        pending = slice_move(local, plan.sends, plan.recvs, op)
        frame = local.new_zeros((local.shape[0], plan.frame_len, *local.shape[2:]))
        for b, (s, c) in enumerate(zip(plan.starts, plan.counts)):
            pos = s - plan.origin(b)
            frame[b, pos : pos + c] = local[b, :c]
        for (_, b, lo, hi, pos), piece in zip(plan.recvs, pending.wait()):
            frame[b, pos : pos + hi - lo] = piece
        return frame

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        plan = ctx.plan
        g = g.contiguous()
        back = slice_return(g, plan.sends, plan.recvs, ctx.op)
        gl = g.new_zeros(ctx.shape)
        for b, (s, c) in enumerate(zip(plan.starts, plan.counts)):
            pos = s - plan.origin(b)
            gl[b, :c] = g[b, pos : pos + c]
        for (_, b, lo, hi), piece in zip(plan.sends, back.wait()):
            gl[b, lo:hi] += piece
        return gl, None, None


class HaloKeys:
    """The twin's ``to_keys``: query frames of my windows -> their keys, through the halo.

    ``to_frame(x[B, A_blk, ...])`` / ``from_frame(f[B, nW W, ...])`` move between my tile and
    my query frame (differentiable gathers; zeros on slots that are not mine);
    ``keys(x[B, A_blk, ...])`` is ``[B, nW, H, ...]`` (one halo exchange); calling the object on
    a query frame is ``keys(from_frame(f))``, Boltz-2's ``to_keys`` on my windows.
    ``key_mask[B, nW, H]`` is set by the atom encoder from the static key features.
    """

    op = "embed:halo"

    def __init__(self, plan: WindowPlan, device: torch.device):
        self.plan = plan
        self.key_mask: torch.Tensor | None = None
        w = plan.w
        k0 = torch.tensor(plan.k_lo, device=device)[:, None] * w
        st = torch.tensor(plan.starts, device=device)[:, None]
        cn = torch.tensor(plan.counts, device=device)[:, None]
        slot = torch.arange(plan.windows * w, device=device)[None, :]
        a = k0 + slot - st  # my tile row of each query slot
        self._q_valid = (a >= 0) & (a < cn)
        self._q_index = torch.where(self._q_valid, a, torch.zeros_like(a))
        self._bi = torch.arange(len(plan.k_lo), device=device)[:, None]
        self._a_blk: int | None = None

    def _local_index(self, a_blk: int) -> tuple[torch.Tensor, torch.Tensor]:
        p, dev = self.plan, self._q_index.device
        st = torch.tensor(p.starts, device=dev)[:, None]
        k0 = torch.tensor(p.k_lo, device=dev)[:, None] * p.w
        ar = torch.arange(a_blk, device=dev)[None, :]
        valid = ar < torch.tensor(p.counts, device=dev)[:, None]
        return torch.where(valid, st + ar - k0, torch.zeros_like(ar)), valid

    @staticmethod
    def _masked(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(~valid.view(valid.shape + (1,) * (x.ndim - 2)), 0)

    def to_frame(self, x: torch.Tensor) -> torch.Tensor:
        self._a_blk = x.shape[1]
        return self._masked(x[self._bi, self._q_index], self._q_valid)

    def from_frame(self, f: torch.Tensor) -> torch.Tensor:
        if self._a_blk is None:
            raise RuntimeError("HaloKeys.from_frame before to_frame: the tile size is unknown")
        idx, valid = self._local_index(self._a_blk)
        return self._masked(f[self._bi, idx], valid)

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        self._a_blk = x.shape[1]
        frame = _KeyFrame.apply(x.contiguous(), self.plan, self.op)
        return window_keys(frame, self.plan.windows, self.plan.w, self.plan.h)

    def __call__(self, f: torch.Tensor) -> torch.Tensor:
        return self.keys(self.from_frame(f))


class CPAtomTransformer(AtomTransformer):
    """The atom transformer on my atoms' windows (module docstring).

    ``forward(q, c, bias, to_keys, mask)``: ``q, c[B, A_blk, ...]`` and ``mask[B, A_blk]`` my
    tiles (plain tensors), ``bias[B, nW, W, H, depth x heads]`` my windows' bias (from the CP atom
    encoder), ``to_keys`` the :class:`HaloKeys` of the atom encoder -> ``q[B, A_blk, dim]``.
    Collectives: one halo exchange per layer (and its reverse in backward).
    """

    def forward(  # type: ignore[override]
        self,
        q: torch.Tensor,
        c: torch.Tensor,
        bias: torch.Tensor,
        to_keys: HaloKeys,
        mask: torch.Tensor,
        multiplicity: int = 1,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not isinstance(to_keys, HaloKeys):
            raise TypeError(
                "CPAtomTransformer takes the HaloKeys of the CP atom encoder as to_keys, got "
                f"{type(to_keys).__name__}"
            )
        if to_keys.key_mask is None and key_mask is None:
            raise ValueError("CPAtomTransformer: the key mask comes from the atom encoder's static halo")
        qf, cf, mf = to_keys.to_frame(q), to_keys.to_frame(c), to_keys.to_frame(mask.to(q.dtype))
        out = AtomTransformer.forward(
            self, qf, cf, bias, to_keys, mf, multiplicity, to_keys.key_mask if key_mask is None else key_mask
        )
        return to_keys.from_frame(out)
