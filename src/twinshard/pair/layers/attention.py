"""CP twin of attention with pair bias on the single track (AF3 Alg. 24, Boltz-2 attentionv2).

Placements. In: single ``s[B, Nr, c_s]`` at ``(Shard(1), Replicate())`` (rows block r on grid
row r, replicated along it), pair ``z[B, Nr, Nc, c_z]`` at ``(Shard(1), Shard(2))`` (N padded
along each axis for its grid axis, see ``twinshard.pair.tiling``; Np below stands for
either), optional token ``mask[B, Nr]`` and keys' input ``k_in[B, Nr, c_s]`` at the single
placement. Out: the update of ``s``, ``[B, Nr, c_s]`` at ``(Shard(1), Replicate())``, carrying
the layout of ``s``
(else of ``z``), padded tokens exactly zero. With ``mask=None`` every real token is a key and
padded tokens never are (from the layout); a given mask is multiplied by the padding mask;
with neither a layout nor a mask: a clear error on every rank.

Computation on rank (r, c). Queries ``i`` in row block ``I_r`` (Np / R) come from the local
single rows; keys ``j`` in column block ``J_c`` (Np / C) are the single rows ``J_c``, which
one point-to-point move brings from their owners (the single sharded along the grid's other
axis as well: rank (r, c) gets them from ranks (a, (r + c) mod C), a the grid rows whose block
meets J_c). The pair bias ``b[I_r, J_c]`` is the local pair tile's. The serial module's
``project`` / ``project_out`` run unchanged; only the softmax over ``j`` is split: each rank
forms the partial softmax of its key block against the row maximum (an all-gather of the
per-query maxima along the grid row, no gradient), and the partial normalisers and numerators
are summed by one all-reduce along the grid row (a log-sum-exp merge), in
``promote_types(dtype, float32)``. Attention backends (``backend=`` or the context,
``twinshard.pair.reference.attention_backends``; agreed over the world first, since the backend
changes the rounding): ``reference`` as just described; ``sdpa`` / ``flex`` run the fused
kernel on the local key block, which returns the block's softmax output and log-sum-exp, and
the blocks are merged with weights ``exp(lse_block - m)``, ``m`` the row maximum of the blocks'
log-sum-exps (one all-gather of ``[B, H, Np/R]`` values), by the same all-reduce. Masking follows ``key_mask_bias`` of the reference with
its per-sample max taken over the grid row; padded keys always get ``-inf``.

Gradients. Parameters are replicated; every rank's contribution to a parameter gradient is a
true partial (no value is counted twice): the attention core works on distinct key blocks,
and the part after the merge, which every rank of a grid row computes identically, takes its
share of the (replicated) output gradient only for its slice of the query tokens
(``_ShareGrad``, the adjoint of "every rank computed the same value": slice, do not sum).
So the parameter gradients are summed over the whole grid, and the gradient of ``s`` (used
as queries, gate and, through the move, keys) is summed over the grid row, where ``s`` is
replicated; it comes back complete and identical on every rank of the row.

Collectives. Forward: the agreement of the attention backend (one all-gather of a small
Python object over the world, ``agree_backend``; none inside a CP stack or sampler, which agree
their modules' backends once), the key move (one exchange, ``apb:keys``; the token mask rides the same
plan without gradient), an all-gather of the row maxima of the mask and of the logits along the
grid row (``[B, Np/R, H]`` values per rank), one all-reduce of the partial normalisers and
numerators along the grid row (``[B, Np/R, H (1 + c_s/H)]``). Backward: the adjoint of that
all-reduce (an all-reduce), the reverse key move (gradients to the owners, summed there),
one all-reduce of the gradient of ``s`` (and ``k_in``) along the grid row, and one
all-reduce of the flat parameter gradient over the grid (>= fp32).

Memory saved for backward per rank: the serial module's activations for the local pair tile
(``proj_z``'s layer norm and linear on ``[B, Np/R, Np/C, c_z]``, the logits and
probabilities ``[B, H, Np/R, Np/C]``) and for the single rows it uses (queries and gate on
``Np/R`` rows, keys and values on ``Np/C`` rows): serial / P for the pair-sized terms, which
dominate. Nothing of size Np x Np is held on any rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.func import functional_call

from twinshard import comm
from twinshard.comm import primitives as P
from twinshard.comm.amp import autocast_rule, fp32_region
from twinshard.pair.features import layout_of, with_layout
from twinshard.pair.layers.moves import MoveRows, column_moves, move_rows
from twinshard.pair.layers.tokenwise import replicated_params
from twinshard.pair.layers.triangle import pair_grid
from twinshard.pair.reference.attention import AttentionPairBias
from twinshard.pair.reference.attention_backends import agree_backend, biased_attention, resolve_backend
from twinshard.pair.reference.norm import compute_dtype
from twinshard.pair.tiling import PAIR, SINGLE, check_placements, from_local
from twinshard.runtime.grid import ProcessGrid

__all__ = ["CPAttentionPairBias"]


def _chunk(n: int, parts: int, index: int) -> tuple[int, int]:
    return n * index // parts, n * (index + 1) // parts


@autocast_rule()
class _ShareGrad(torch.autograd.Function):
    """Identity on a value every rank of a grid row computed identically; backward keeps this
    rank's slice (chunk ``index`` of ``parts`` along the token dim 1) of the replicated
    gradient, zeros elsewhere, so the contributions downstream are partials that sum (over the
    row) to the gradient exactly once.

    Dtype path: identity (a view); backward slices the gradient in its dtype. No communication.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: int, parts: int) -> torch.Tensor:
        ctx.index, ctx.parts = index, parts
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        if ctx.parts == 1:
            return g, None, None
        lo, hi = _chunk(g.shape[1], ctx.parts, ctx.index)
        out = torch.zeros_like(g)
        out[:, lo:hi] = g[:, lo:hi]
        return out, None, None


def _row_max(x: torch.Tensor, grid: ProcessGrid, op: str) -> torch.Tensor:
    """Max over the grid row of ``x`` (last dim kept as 1); no gradient."""
    m = x.detach().amax(dim=-1, keepdim=True)
    return P.all_gather(m, -1, grid.row_group, op=op).amax(dim=-1, keepdim=True)


def _merge_partials(
    logits: torch.Tensor, v: torch.Tensor, grid: ProcessGrid
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial softmax of the local key block against the row maximum, summed over the grid
    row: ``(L[B, H, I], A[B, I, H, d])`` with ``softmax @ v = A / L``."""
    m = _row_max(logits, grid, "apb:logit_max")  # shift only: the result does not depend on it
    p = torch.exp(logits - m)
    l = p.sum(-1)
    acc = torch.einsum("bhij,bjhd->bihd", p, v)
    return comm.all_reduce(l, grid.row_group), comm.all_reduce(acc, grid.row_group)


def _merge_blocks(o: torch.Tensor, lse: torch.Tensor, grid: ProcessGrid) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused-backend form of :func:`_merge_partials`: the local key block's softmax output
    ``o[B, H, I, d]`` and log-sum-exp ``lse[B, H, I]`` (both differentiable), weighted by
    ``exp(lse - m)`` with ``m`` the row maximum of the blocks' ``lse`` and summed over the grid
    row: ``(L[B, H, I], A[B, I, H, d])`` with ``softmax @ v = A / L``. A key block of padding only
    (``lse = -inf``) weighs exactly zero."""
    m = _row_max(lse.unsqueeze(-1), grid, "apb:lse_max")  # the common shift, over the row's blocks
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse.unsqueeze(-1) - m)
    acc = torch.where(w > 0, o * w, torch.zeros_like(o)).transpose(1, 2)
    return comm.all_reduce(w.squeeze(-1), grid.row_group), comm.all_reduce(acc, grid.row_group)


@dataclass(frozen=True)
class _TileArgs:
    mask: torch.Tensor
    key_real: torch.Tensor | None
    grid: ProcessGrid
    has_k_in: bool
    backend: str = "reference"


class CPAttentionPairBias(AttentionPairBias):
    """Context-parallel attention with pair bias; parameters as the serial module (module doc).

    ``forward(s, z, mask=None, k_in=None)`` on DTensors: ``s`` (and ``k_in``) single, ``z``
    pair, ``mask`` a single-placed token mask.
    """

    _on_tile: bool = False

    def forward(
        self, s: DTensor, z: DTensor, mask: DTensor | None = None, k_in: DTensor | None = None
    ) -> Any:
        if self._on_tile:
            return self._tile_forward(s, z, mask, k_in)
        what = type(self).__name__
        check_placements(s, SINGLE, f"{what} input s", ndim=3)
        check_placements(z, PAIR, f"{what} input z", ndim=4)
        b, n = s.shape[:2]
        if s.shape[-1] != self.c_s or tuple(z.shape[:2]) != (b, n) or z.shape[-1] != self.c_z:
            raise ValueError(
                f"expected s [B, N, {self.c_s}] and z [B, N, N, {self.c_z}], got {tuple(s.shape)}, {tuple(z.shape)}"
            )
        if z.device_mesh != s.device_mesh:
            raise ValueError(f"{what}: s and z live on different meshes")
        grid = pair_grid(z)
        if mask is not None:
            check_placements(mask, SINGLE, f"{what} mask", ndim=2)
            if tuple(mask.shape) != (b, n):
                raise ValueError(f"mask must be [B, N] = {(b, n)}, got {tuple(mask.shape)}")
        if k_in is not None:
            check_placements(k_in, SINGLE, f"{what} k_in", ndim=3)
            if tuple(k_in.shape) != tuple(s.shape):
                raise ValueError(f"k_in {tuple(k_in.shape)} must match s {tuple(s.shape)}")
        layout = layout_of(s) or layout_of(z) or (layout_of(mask) if mask is not None else None)
        if layout is None and mask is None:
            raise ValueError(
                f"{what} (mask=None): neither s nor z carries a PairLayout and no mask was given, so "
                "padded tokens cannot be told from real ones: restore it with "
                "twinshard.pair.features.with_layout(x, like), or pass mask="
            )
        s_local = s.to_local()
        mask_local = mask.to_local() if mask is not None else s_local.new_ones(s_local.shape[:2])
        key_real = None
        if layout is None and z.shape[2] != n:
            raise ValueError(
                f"{what}: z {tuple(z.shape)} is not square and carries no PairLayout that tells its "
                "padding: keep the layout from twinshard.pair.features on it (with_layout)"
            )
        if layout is not None and layout.n_tokens < max(layout.padded):
            nI, nJ, c = s_local.shape[1], z.shape[2] // grid.cols, grid.coords[1]
            r = grid.coords[0]
            mask_local = mask_local * (
                torch.arange(r * nI, (r + 1) * nI, device=s_local.device) < layout.n_tokens
            )
            key_real = torch.arange(c * nJ, (c + 1) * nJ, device=s_local.device) < layout.n_tokens
        backend = resolve_backend(self.backend)
        agree_backend(backend, what)
        named = list(self.named_parameters())
        synced = replicated_params([p for _, p in named], z)  # partial contributions: sum over the grid
        args = _TileArgs(mask_local, key_real, grid, k_in is not None, backend)
        self._on_tile = True
        try:
            out = functional_call(
                self,
                {k: v for (k, _), v in zip(named, synced)},
                (s_local, z.to_local(), args, None if k_in is None else k_in.to_local()),
            )
        finally:
            self._on_tile = False
        out = from_local(out, s.device_mesh, SINGLE)
        return out if layout is None else with_layout(out, layout, "single")

    def _tile_forward(
        self, s: torch.Tensor, z: torch.Tensor, args: _TileArgs, k_in: torch.Tensor | None
    ) -> torch.Tensor:
        grid = args.grid
        moves = column_moves(grid, (s.shape[1] * grid.rows, z.shape[2] * grid.cols))
        # s is replicated along the grid row: every rank's gradient is a partial, summed there
        s = comm.sync_grad(s, grid.row_group)
        k_in = s if k_in is None else comm.sync_grad(k_in, grid.row_group)
        keys = MoveRows.apply(k_in.contiguous(), moves, "apb:keys")
        q, k, v, bias, g = self.project(s, z, keys)
        ct = compute_dtype(q.dtype)
        mask = move_rows(args.mask.detach().contiguous(), moves, "apb:mask").to(q.dtype)
        mb = self.inf * (mask - 1) * _row_max(mask, grid, "apb:mask_max")
        if args.key_real is not None:
            mb = torch.where(args.key_real.view(1, -1), mb, torch.full_like(mb, -self.inf))
        with fp32_region(q.device.type):  # the softmax region, as the serial attend_single
            if args.backend == "reference":
                logits = torch.einsum("bihd,bjhd->bhij", q.to(ct), k.to(ct))
                logits = logits + bias.to(ct) + mb.to(ct)[:, None, None, :]
                l, acc = _merge_partials(logits, v.to(ct), grid)
            else:  # a fused kernel per key block, merged by its log-sum-exp
                full = bias.to(ct) + mb.to(ct)[:, None, None, :]
                ob, lse = biased_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), full, args.backend
                )
                l, acc = _merge_blocks(ob, lse, grid)
            o = acc / l.permute(0, 2, 1).unsqueeze(-1)
        out = self.project_out(o, g)
        return _ShareGrad.apply(out, grid.coords[1], grid.cols)

    def serial_forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The serial computation on plain tensors (no communication)."""
        return AttentionPairBias.forward(self, *args, **kwargs)
