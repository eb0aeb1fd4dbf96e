"""CP twins of triangle attention around the starting and the ending node (AF3 Alg. 14/15).

Placements. In: pair ``z[B, Nr, Nc, c_in]`` at ``(Shard(1), Shard(2))`` and optionally its
mask ``[B, Nr, Nc]`` at the same placements (N padded to a multiple of rows along dim 1 and of
cols along dim 2 by ``twinshard.pair.features``; Np below stands for either). Out:
``[B, Nr, Nc, c_in]`` at ``(Shard(1), Shard(2))``, carrying
z's ``PairLayout``, padded entries exactly zero. With ``mask=None`` the mask is the padding
mask of the layout z carries; a given mask is multiplied by it; without a layout a mask is
required (else: a clear error, on every rank).

Computation (starting node; the serial module's ``project`` / ``project_out`` run unchanged on
the local tile, only the attention over k is distributed). Rank (r, c) of an R x C grid holds
the queries ``(i, j)``, ``i`` in row block ``I_r`` (Np / R), ``j`` in column block ``J_c``
(Np / C), and the keys, values and mask bias of the same tile. The key blocks travel round
the ring of grid row r: at step t = 0 .. C - 1 the rank holds key block ``kb = (r + c + t)
mod C`` (a Cannon-style skew, then one shift to the left per step) and the bias block
``b[J_c, K_kb]`` (heads x Np/C x Np/C), which its owners (the ranks of grid column kb whose
row blocks meet J_c) send it for that step. Partial results merge with an online
log-sum-exp softmax (flash-style) in ``promote_types(dtype, float32)``; the output keeps the
log-sum-exp per query for backward. Attention backends (``backend=`` or the context,
``twinshard.pair.reference.attention_backends``, agreed over the world first): ``reference``
forms each step's logits explicitly; ``sdpa`` / ``flex`` run the fused kernel on each step's
chunk (its additive bias ``b_jk + mb_ik`` formed as one chunk-sized tensor) and fold its output
by its log-sum-exp; the backward is the same recompute for all three. The next step's blocks are posted before the current
block is multiplied, so transfers overlap compute.

Masking: ``key_mask_bias`` of the reference, with its row-wise max of the mask taken over the
whole grid row (an all-gather of one value per local row), so a fully masked row gets no
mask bias exactly as in serial. Padded keys always get ``-inf`` (they are not keys of the
serial problem, also in a fully masked row).

Ending node: the starting node on the transposed pair. ``z`` and the mask are transposed tile
by tile (``twinshard.comm.transpose_tiles``: one point-to-point exchange of tile-sized pieces
on any grid shape, its own adjoint), the starting-node attention runs on the transposed
tiles, and the output is transposed back.

Collectives. Forward: the agreement of the attention backend (one all-gather of a small Python
object over the world, ``agree_backend``; none inside a CP stack or sampler, which agree their
modules' backends once); one all-gather of the row maxima of the mask along the grid row
(``[B, Np/R]`` values per rank, no gradient); then C point-to-point exchanges along the ring
(``tri_attn:ring``), each carrying one key/value/mask-bias tile to the left neighbour and one
bias block from its owner(s); ending node: two more tile transpositions (z and the mask) and
one of the output. Backward: the same ring again, carrying key/value tiles together with
their gradient accumulators (dk, dv), the bias blocks for the next step and the bias
gradients of the current step back to their owners (one exchange per step,
``tri_attn:ring:backward``), then one delivery of the accumulators to the key owners;
ending node: the transpositions' adjoints; one all-reduce of the flat parameter gradient over
the grid (>= fp32).

Memory saved for backward per rank: the token-local activations of the serial module for one
tile (layer norm, projections, gate), plus for the attention q, k, v and the output of the
tile, the own bias tile, the mask-bias tile and the log-sum-exp (heads x tile): no
probabilities (the serial module saves ``B N^3 H`` of them). Transient: one key/value/bias
block in use and one in flight, and the step's logits for one chunk of the tile's query rows,
``[B, rows, H, Np/C, Np/C]`` with at most ``LOGITS_BUDGET`` elements (the whole
``[B, Np/R, H, Np/C, Np/C]`` when it fits; at least one row). Nothing of size Np x Np, or of a
full row of it, is held on any rank.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from twinshard.comm import primitives as P
from twinshard.comm import transpose_tiles
from twinshard.comm.amp import autocast_rule
from twinshard.comm.ops import transpose_tiles_local
from twinshard.pair.features import layout_of, with_layout
from twinshard.pair.layers.tokenwise import TokenwiseTwin, mixing_layout
from twinshard.pair.layers.triangle import pair_grid
from twinshard.pair.reference.attention_backends import agree_backend, biased_attention, resolve_backend
from twinshard.pair.reference.norm import compute_dtype
from twinshard.pair.reference.triangle_attention import TriangleAttention
from twinshard.pair.tiling import PAIR, check_placements
from twinshard.runtime.grid import ProcessGrid

__all__ = [
    "CPTriangleAttention",
    "CPTriangleAttentionEndingNode",
    "CPTriangleAttentionStartingNode",
    "LOGITS_BUDGET",
    "Packed",
    "ring_attend",
    "row_chunks",
]

Range = tuple[int, int]


def _inter(a: Range, b: Range) -> Range | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def assemble_rows(
    like: torch.Tensor,
    pieces: Sequence[torch.Tensor],
    rows: Sequence[slice],
    shape: tuple[int, ...],
    dim: int,
) -> torch.Tensor:
    """A block of ``shape`` from ``pieces`` at ascending slices ``rows`` along ``dim``: the piece
    itself or their concatenation when they cover the block, else zeros with the pieces written
    in (rows no piece covers lie beyond the other token axis's extent: padding)."""
    if sum(r.stop - r.start for r in rows) == shape[dim]:
        return pieces[0] if len(pieces) == 1 else torch.cat(list(pieces), dim=dim)
    out = like.new_zeros(shape)
    for r, piece in zip(rows, pieces):
        out[(slice(None),) * dim + (r,)] = piece
    return out


class Packed:
    """Point-to-point pieces, several per peer, packed into one message per peer and direction.

    ``sends = [(peer, tensor)]``, ``recvs = [(peer, shape)]`` (global ranks; a message to
    oneself is a local copy). Posted at construction (non-blocking); :meth:`wait` returns the
    received pieces in ``recvs`` order. Every piece travels in ``dtype``.
    """

    def __init__(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, tuple[int, ...]]],
        dtype: torch.dtype,
        op: str,
    ):
        by_send: dict[int, list[torch.Tensor]] = defaultdict(list)
        for p, t in sends:
            by_send[p].append(t.reshape(-1).to(dtype))
        by_recv: dict[int, list[int]] = defaultdict(list)
        for i, (p, _) in enumerate(recvs):
            by_recv[p].append(i)
        self._shapes = [tuple(s) for _, s in recvs]
        self._order = sorted(by_recv.items())
        send_list = [(p, torch.cat(v) if len(v) > 1 else v[0]) for p, v in sorted(by_send.items())]
        recv_list = [(p, (sum(math.prod(self._shapes[i]) for i in idx),)) for p, idx in self._order]
        self._pending = P.exchange(send_list, recv_list, dtype=dtype, op=op, async_op=True)

    def wait(self) -> list[torch.Tensor]:
        bufs = self._pending.wait()
        out: list[torch.Tensor | None] = [None] * len(self._shapes)
        for (_, idx), buf in zip(self._order, bufs):
            off = 0
            for i in idx:
                n = math.prod(self._shapes[i])
                out[i] = buf[off : off + n].view(self._shapes[i])
                off += n
        return out  # type: ignore[return-value]


# -- the schedule (pure functions of replicated metadata; every rank derives every peer's) ---


def _key_block(grid: ProcessGrid, rank: int, t: int) -> int:
    """Key block (grid column of the key tile) that ``rank`` works on at ring step t."""
    r, c = grid.coords_of(rank)
    return (r + c + t) % grid.cols


def _ring_peers(grid: ProcessGrid, t: int) -> tuple[int, int]:
    """(send_to, recv_from) of the key/value tiles that arrive for step t (0 <= t <= C).

    t = 0: the skew (rank (r, c) gets tile (r, r + c) from its owner); 0 < t < C: one step left
    along the grid row (the block of step t was the right neighbour's at step t - 1); t = C:
    the gradient accumulators go home (the block of step C - 1 is ``r + c - 1``)."""
    r, c = grid.coords
    C = grid.cols
    if t == 0:
        return grid.rank_of((r, c - r)), grid.rank_of((r, r + c))
    if t < C:
        return grid.rank_of((r, c - 1)), grid.rank_of((r, c + 1))
    return grid.rank_of((r, r + c - 1)), grid.rank_of((r, c - r + 1))


def _bias_plan(
    grid: ProcessGrid, n: tuple[int, int], t: int
) -> tuple[list[tuple[int, slice]], list[tuple[int, slice]]]:
    """Who sends which bias rows at step t. ``serve = [(receiver, rows of my bias tile)]``,
    ``fetch = [(owner, rows of my bias block)]`` (ascending rows, covering the part of the block
    inside the bias's Nr rows; ``n`` is the pair's global (Nr, Nc)).

    Rank (r, c) needs ``b[J_c, K_kb]``; rows ``J_c`` lie in the row blocks ``I_a`` of the
    ranks (a, kb); rows beyond Nr (padding, when Nc > Nr) are zero. On a square grid each
    rank serves exactly one receiver per step."""
    R, C = grid.rows, grid.cols
    nI, nJ = n[0] // R, n[1] // C
    me = grid.rank
    serve, fetch = [], []
    for rank in range(grid.size):
        r, c = grid.coords_of(rank)
        kb = _key_block(grid, rank, t)
        jc = (c * nJ, (c + 1) * nJ)
        for a in range(R):
            hit = _inter((a * nI, (a + 1) * nI), jc)
            if hit is None:
                continue
            owner = grid.rank_of((a, kb))
            if rank == me:
                fetch.append((owner, slice(hit[0] - c * nJ, hit[1] - c * nJ)))
            if owner == me:
                serve.append((rank, slice(hit[0] - a * nI, hit[1] - a * nI)))
    return serve, fetch


def _bias_grad_moves(
    grid: ProcessGrid, n: tuple[int, int], t: int
) -> tuple[list[tuple[int, slice]], list[tuple[int, slice]]]:
    """The reverse of step t's bias fetch: ``(sends = [(owner, rows of my block gradient)],
    recvs = [(receiver, rows of my bias-tile gradient)])``."""
    serve, fetch = _bias_plan(grid, n, t)
    return fetch, serve


def _merge(
    m: torch.Tensor | None, l: torch.Tensor | None, acc: torch.Tensor | None, s: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One online-softmax step: fold logits ``s[B, I, H, J, K]`` (consumed: overwritten by the
    probabilities) with values ``v[B, I, H, K, d]`` into the running max ``m``, normaliser ``l``
    and numerator ``acc`` ([B, I, H, J]; updated in place). In place: one pass less over the
    chunk's logits per operation (the forward runs without autograd)."""
    m_blk = s.amax(-1)
    if m is None:
        p = s.sub_(m_blk.unsqueeze(-1)).exp_()
        return m_blk, p.sum(-1), torch.einsum("bihjk,bihkd->bihjd", p, v)
    m_new = torch.maximum(m, m_blk)
    alpha = torch.exp(m - m_new)  # rescale what was summed under the old max
    p = s.sub_(m_new.unsqueeze(-1)).exp_()
    assert l is not None and acc is not None
    l.mul_(alpha).add_(p.sum(-1))
    acc.mul_(alpha.unsqueeze(-1)).add_(torch.einsum("bihjk,bihkd->bihjd", p, v))
    return m_new, l, acc


def _merge_block(
    m: torch.Tensor | None,
    l: torch.Tensor | None,
    acc: torch.Tensor | None,
    ob: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_merge` for a fused backend: fold a block's softmax output ``ob[B, I, H, J, d]``
    and log-sum-exp ``lse[B, I, H, J]`` into the running max, normaliser and numerator. A block
    of padded keys only (``lse = -inf``) weighs exactly zero."""
    m_new = lse if m is None else torch.maximum(m, lse)
    shift = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
    beta = torch.exp(lse - shift)
    part = torch.where(beta.unsqueeze(-1) > 0, ob * beta.unsqueeze(-1), torch.zeros_like(ob))
    if m is None:
        return m_new, beta, part
    alpha = torch.exp(m - shift)  # rescale what was summed under the old max
    return m_new, l * alpha + beta, acc * alpha.unsqueeze(-1) + part


def _block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, mb: torch.Tensor, backend: str
):
    """``(o, lse)`` of one ring step's chunk by a fused backend: ``q, k, v[B, rows, H, J|K, d]``,
    the bias block ``[B, H, J, K]`` and mask bias ``[B, rows, K]`` summed into one additive bias
    ``[B, rows, H, J, K]`` (the size of the chunk's logits), batch and rows flattened."""
    full = (bias.unsqueeze(1) + mb[:, :, None, None, :]).flatten(0, 1)
    o, lse = biased_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), full, backend)
    return o.unflatten(0, q.shape[:2]), lse.unflatten(0, q.shape[:2])


# Elements of one logits block [B, rows, H, J, K] a ring step holds at once (128 MiB in fp64).
# Whole, the step's block is [B, N/R, H, N/C, N/C]: at N = 1024 on 2x2 with 4 heads in fp32,
# 2 GiB against a 128-channel pair tile's 128 MiB. Rows i attend independently, so cutting
# them into chunks changes no value (the bias gradient's sum over i only regroups).
LOGITS_BUDGET = 1 << 24


def row_chunks(q_shape: Sequence[int], keys: int) -> list[Range]:
    """The tile's query rows ``i`` cut so that one chunk's logits ``[B, rows, H, J, keys]``
    hold at most ``LOGITS_BUDGET`` elements (at least one row per chunk)."""
    B, n_rows, H, J = q_shape[0], q_shape[1], q_shape[2], q_shape[3]
    per_row = max(1, B * H * J * keys)
    step = max(1, min(n_rows, LOGITS_BUDGET // per_row))
    return [(a, min(a + step, n_rows)) for a in range(0, n_rows, step)]


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _logits(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
    s = torch.einsum("bihjd,bihkd->bihjk", q, k)
    s += bias.unsqueeze(1)  # in place: the chunk's logits are written once
    s += mb[:, :, None, None, :]
    return s


class _Step:
    """The moves that bring step t's key tiles (``travel``) and bias block, plus extra pieces,
    posted as one exchange; :meth:`wait` gives ``(travel pieces, bias block, extra pieces)``."""

    def __init__(
        self,
        grid: ProcessGrid,
        n: tuple[int, int],
        t: int,
        travel: Sequence[torch.Tensor],
        bias: torch.Tensor,
        op: str,
        extra_sends: Sequence[tuple[int, torch.Tensor]] = (),
        extra_recvs: Sequence[tuple[int, tuple[int, ...]]] = (),
    ):
        to, frm = _ring_peers(grid, t)
        serve, fetch = _bias_plan(grid, n, t)
        B, H, _, nJ = bias.shape
        sends = [(to, x) for x in travel] + [(p, bias[:, :, rows]) for p, rows in serve] + list(extra_sends)
        recvs = [(frm, tuple(x.shape)) for x in travel]
        recvs += [(p, (B, H, rows.stop - rows.start, nJ)) for p, rows in fetch] + list(extra_recvs)
        self._k, self._fetch = len(travel), fetch
        self._block = (B, H, nJ, nJ)  # b[J_c, K_kb]: N / C rows and columns
        self._packed = Packed(sends, recvs, bias.dtype, op)

    def wait(self) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
        got = self._packed.wait()
        k, nf = self._k, len(self._fetch)
        rows = [r for _, r in self._fetch]  # of J_c, ascending; beyond Nr: zero bias
        block = assemble_rows(got[0], got[k : k + nf], rows, self._block, 2)
        return got[:k], block, got[k + nf :]


@autocast_rule("compute")
class _RingAttention(torch.autograd.Function):
    """``o[B, I, H, J, d] = sum_k softmax_k(q_ij . k_ik + b_jk + mb_ik) v_ik`` on this rank's
    tile, with the keys of the whole grid row (see the module docstring).

    ``backend``: the forward's block softmax (``reference``: explicit logits and ``_merge``;
    ``sdpa`` / ``flex``: the fused kernel per chunk, returning the block's output and
    log-sum-exp, folded by ``_merge_block``). The backward is the same recompute for every
    backend (the probabilities from the saved log-sum-exp), since no CPU kernel returns the
    bias gradient.

    Dtype path (cast="compute": the triangle-attention softmax in fp32, autocast off): q, k, v,
    bias and the mask bias are cast once to ``ct = promote(q, fp32)``; keys, values, mask bias
    and bias rows travel, and the logits, the online softmax (running max, sum, accumulator) and
    the output are in ``ct``; saved in ``ct``. Backward: everything in ``ct`` (the key and value
    gradient accumulators travel in ``ct``), the input gradients cast once to the input dtypes.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor,
        mb: torch.Tensor,
        grid: ProcessGrid,
        n: tuple[int, int],
        backend: str = "reference",
    ) -> torch.Tensor:
        ct = compute_dtype(q.dtype)
        ctx.in_dtypes = (q.dtype, k.dtype, v.dtype, bias.dtype)
        q, k, v, bias, mb = (t.to(ct) for t in (q, k, v, bias, mb))
        k, v, mb, bias = k.contiguous(), v.contiguous(), mb.contiguous(), bias.contiguous()
        C = grid.cols
        pend = _Step(grid, n, 0, (k, v, mb), bias, "tri_attn:ring")
        chunks = row_chunks(q.shape, k.shape[3])
        state: list[tuple[Any, Any, Any]] = [(None, None, None)] * len(chunks)
        for t in range(C):
            (kt, vt, mbt), bblk, _ = pend.wait()
            if t + 1 < C:  # the next blocks travel while this one is multiplied
                pend = _Step(grid, n, t + 1, (kt, vt, mbt), bias, "tri_attn:ring")
            if backend == "reference":
                state = [
                    _merge(*st, _logits(q[:, a:b], kt[:, a:b], bblk, mbt[:, a:b]), vt[:, a:b])
                    for st, (a, b) in zip(state, chunks)
                ]
            else:
                state = [
                    _merge_block(*st, *_block(q[:, a:b], kt[:, a:b], vt[:, a:b], bblk, mbt[:, a:b], backend))
                    for st, (a, b) in zip(state, chunks)
                ]
        m, l, acc = (_cat_rows([st[i] for st in state]) for i in range(3))
        o = acc / l.unsqueeze(-1)
        lse = m + torch.log(l)
        ctx.grid, ctx.n = grid, n
        ctx.save_for_backward(q, k, v, bias, mb, o, lse)
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor):
        q, k, v, bias, mb, o, lse = ctx.saved_tensors
        grid, n = ctx.grid, ctx.n
        C = grid.cols
        B, H, nI, nJ = bias.shape
        do = do.to(q.dtype)
        delta = (do * o).sum(-1)  # [B, I, H, J]
        dq = torch.zeros_like(q)
        dbias = torch.zeros_like(bias)
        op = "tri_attn:ring:backward"
        (kt, vt, mbt), bblk, _ = _Step(grid, n, 0, (k, v, mb), bias, op).wait()
        dkt, dvt = torch.zeros_like(k), torch.zeros_like(v)
        chunks = row_chunks(q.shape, k.shape[3])
        for t in range(C):
            dblk = None  # [B, H, J, K]: this rank's rows i of the bias gradient, summed over i
            for a, b in chunks:  # in place: dkt, dvt are this rank's own (received) buffers
                p = _logits(q[:, a:b], kt[:, a:b], bblk, mbt[:, a:b]).sub_(lse[:, a:b].unsqueeze(-1)).exp_()
                dvt[:, a:b] += torch.einsum("bihjk,bihjd->bihkd", p, do[:, a:b])
                ds = torch.einsum("bihjd,bihkd->bihjk", do[:, a:b], vt[:, a:b])
                ds.sub_(delta[:, a:b].unsqueeze(-1)).mul_(p)  # in place: dS = P (dP - delta)
                del p
                dq[:, a:b] += torch.einsum("bihjk,bihkd->bihjd", ds, kt[:, a:b])
                dkt[:, a:b] += torch.einsum("bihjk,bihjd->bihkd", ds, q[:, a:b])
                dblk = ds.sum(1) if dblk is None else dblk.add_(ds.sum(1))
                del ds
            assert dblk is not None  # at least one row
            # One exchange: the bias gradients of step t go back to their owners, and either
            # the key tiles with their accumulators move on, or (last step) the accumulators go home.
            gsend, grecv = _bias_grad_moves(grid, n, t)
            extra_s = [(p_, dblk[:, :, rows]) for p_, rows in gsend]
            extra_r = [(p_, (B, H, rows.stop - rows.start, nJ)) for p_, rows in grecv]
            if t + 1 < C:
                step = _Step(grid, n, t + 1, (kt, vt, mbt, dkt, dvt), bias, op, extra_s, extra_r)
                (kt, vt, mbt, dkt, dvt), bblk, back = step.wait()
            else:
                to, frm = _ring_peers(grid, C)
                sends = [(to, dkt), (to, dvt), *extra_s]
                recvs = [(frm, tuple(dkt.shape)), (frm, tuple(dvt.shape)), *extra_r]
                got = Packed(sends, recvs, q.dtype, op).wait()
                dkt, dvt, back = got[0], got[1], got[2:]
            for (_, rows), piece in zip(grecv, back):
                dbias[:, :, rows] += piece
        dq_, dk_, dv_, db_ = (g.to(dt) for g, dt in zip((dq, dkt, dvt, dbias), ctx.in_dtypes))
        return dq_, dk_, dv_, db_, None, None, None, None


def ring_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    mb: torch.Tensor,
    grid: ProcessGrid,
    backend: str = "reference",
) -> torch.Tensor:
    """The distributed ``attend`` of the reference on this rank's tiles (differentiable).

    ``q, k, v[B, I, H, J, d]`` (q scaled), ``bias[B, H, I, J]`` (this rank's tile of the
    triangle bias), ``mb[B, I, J]`` (the mask bias of this tile's keys, no gradient) ->
    ``o[B, I, H, J, d]`` in ``promote_types(dtype, float32)``."""
    n = (q.shape[1] * grid.rows, q.shape[3] * grid.cols)  # the pair's (Nr, Nc)
    if grid.rows == grid.cols and n[0] != n[1]:
        raise ValueError(
            f"tile {tuple(q.shape)} does not tile an N x N pair on a {grid.rows}x{grid.cols} grid"
        )
    return _RingAttention.apply(q, k, v, bias, mb.detach(), grid, n, backend)


def ring_mask_bias(
    mask: torch.Tensor, key_real: torch.Tensor | None, inf: float, dtype: torch.dtype, grid: ProcessGrid
) -> torch.Tensor:
    """``key_mask_bias`` of the reference on a tile ``mask[B, I, J]``: the row-wise max of the
    mask is taken over the whole grid row (all-gather of ``[B, I, 1]`` along it, no gradient);
    padded keys (``key_real`` False) get ``-inf`` whatever the row."""
    m = mask.detach().to(dtype)
    rowmax = m.amax(dim=-1, keepdim=True)
    rowmax = P.all_gather(rowmax, -1, grid.row_group, op="tri_attn:row_max").amax(dim=-1, keepdim=True)
    mb = inf * (m - 1) * rowmax
    if key_real is not None:
        mb = torch.where(key_real.view(1, 1, -1), mb, torch.full_like(mb, -inf))
    return mb


@dataclass(frozen=True)
class _TileArgs:
    mask: torch.Tensor
    key_real: torch.Tensor | None
    grid: ProcessGrid
    backend: str = "reference"


class CPTriangleAttention(TriangleAttention, TokenwiseTwin):
    """Context-parallel triangle attention; parameters as the serial module (see module doc).

    ``forward(z, mask=None)``: ``z`` a pair DTensor, ``mask`` an optional pair-placed mask;
    with ``mask=None`` every real entry counts and the padding is masked from the layout.
    """

    def forward(self, z: DTensor | torch.Tensor, mask: Any = None) -> DTensor | torch.Tensor:
        if self._on_tile:
            return self._tile_forward(z, mask)
        what = type(self).__name__
        check_placements(z, PAIR, f"{what} input z", ndim=4)
        if z.shape[-1] != self.c_in:
            raise ValueError(f"expected a pair tensor [B, N, N, {self.c_in}], got {tuple(z.shape)}")
        grid = pair_grid(z)
        local_shape = z.to_local().shape[:3]
        if mask is not None:
            check_placements(mask, PAIR, f"{what} mask", ndim=3)
            if tuple(mask.shape) != tuple(z.shape[:3]):
                raise ValueError(f"mask {tuple(mask.shape)} does not match z {tuple(z.shape)}")
        layout, keep = mixing_layout(z, mask, "pair", f"{what} (mask=None)")
        mask_local = mask.to_local() if mask is not None else z.to_local().new_ones(local_shape)
        if keep is not None:  # padding never counts, whatever the mask says
            mask_local = mask_local * keep.to(mask_local.dtype).expand(local_shape)
        key_real = None
        if layout is not None and layout.n_tokens < layout.padded[1]:
            c, nJ = grid.coords[1], local_shape[2]
            key_real = torch.arange(c * nJ, (c + 1) * nJ, device=mask_local.device) < layout.n_tokens
        backend = resolve_backend(self.backend)
        agree_backend(backend, what)
        out = self.tile_forward(z, _TileArgs(mask_local, key_real, grid, backend))
        if layout is not None and layout_of(out) is None:  # the layout came with the mask
            out = with_layout(out, layout, "pair")
        return out

    def _tile_forward(self, z: torch.Tensor, args: _TileArgs) -> torch.Tensor:
        grid, mask = args.grid, args.mask
        if not self.starting:  # ending node: the starting node on the transposed tiles
            z = transpose_tiles(z, grid)
            mask = transpose_tiles_local(mask.contiguous(), grid, op="tri_attn:mask_transpose")
        q, k, v, bias, g = self.project(z)
        mb = ring_mask_bias(mask, args.key_real, self.inf, q.dtype, grid)
        o = self.project_out(ring_attend(q, k, v, bias, mb, grid, args.backend), g)
        return o if self.starting else transpose_tiles(o, grid)


class CPTriangleAttentionStartingNode(CPTriangleAttention):
    """CP twin of AF3 Algorithm 14 (see the module docstring)."""

    def __init__(
        self, c_in: int, c_hidden: int = 32, no_heads: int = 4, inf: float = 1e9, backend: str | None = None
    ):
        super().__init__(c_in, c_hidden, no_heads, starting=True, inf=inf, backend=backend)


class CPTriangleAttentionEndingNode(CPTriangleAttention):
    """CP twin of AF3 Algorithm 15 (see the module docstring)."""

    def __init__(
        self, c_in: int, c_hidden: int = 32, no_heads: int = 4, inf: float = 1e9, backend: str | None = None
    ):
        super().__init__(c_in, c_hidden, no_heads, starting=False, inf=inf, backend=backend)
