"""The pair layout: how a distributed pair, single or MSA tensor was padded, and the layout
that travels with it.

``PairLayout`` holds the caller's N (and MSA depth S) and the padded sizes on a rows x cols
grid: N padded to a multiple of rows along grid rows (``single``, dim 1 of ``pair``) and of
cols along grid columns (dim 2 of ``pair``, ``msa``), S to a multiple of rows (the policy of
``twinshard.pair.tiling``). ``distribute`` / ``shard_tensor``
(:mod:`twinshard.pair.features`) and every CP twin attach it to the DTensors they return;
:func:`layout_of` reads it back, :func:`with_layout` re-attaches it after a plain DTensor op
(zeroing the padding), :func:`padding_keep` says which entries of a tile are real, and
:func:`real_part` gives a tile's real block as sharding evidence. Metadata only: nothing here
communicates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from twinshard.comm.amp import autocast_rule
from twinshard.pair.tiling import (
    MSA,
    PAIR,
    SAMPLE,
    SINGLE,
    check_placements,
    from_local,
    pad_dim,
    padded_sequences,
    padded_tokens,
    real_tile,
    tile_slices,
    unpad,
)
from twinshard.runtime import ProcessGrid

__all__ = [
    "ATOM_KINDS",
    "KINDS",
    "PairLayout",
    "layout_kind",
    "layout_of",
    "padding_keep",
    "real_part",
    "with_layout",
    "zero_padding",
]

KINDS: dict[str, tuple[Placement, ...]] = {
    "single": SINGLE,
    "pair": PAIR,
    "msa": MSA,
    "sample": SAMPLE,
    # per-template per-token features [B, T, N, ...]: tokens split over grid rows like single
    "template": (Shard(2), Replicate()),
    # atoms (twinshard.pair.atoms): the atoms of token row block r on grid row r, replicated along
    # it, padded per block to A_blk; global shapes [B, R*A_blk, ...], [B, R*A_blk, Nr/R] and
    # [B, Nr, A_blk] (token indices local to the row block, atom indices local to the row's atoms)
    "atom": SINGLE,
    "atom_token": SINGLE,
    "token_atom": SINGLE,
    # per-conformer atoms [B, K, A, ...] (the true coordinates ``coords``): the atom placement
    # along dim 2, K whole; global shape [B, K, R*A_blk, ...]
    "atom_conf": (Shard(2), Replicate()),
}
ATOM_KINDS = ("atom", "atom_token", "token_atom", "atom_conf")


# Token dims of each kind -> the grid axis (0: rows, 1: cols) that splits them; sequence dim.
_TOKEN_DIMS: dict[str, dict[int, int]] = {"single": {1: 0}, "pair": {1: 0, 2: 1}, "msa": {2: 1}, "sample": {}}
_TOKEN_DIMS["template"] = {2: 0}
_SEQ_DIM = {"msa": 1}


@dataclass(frozen=True)
class PairLayout:
    """How features were padded and placed: what ``collect`` needs to undo it.

    ``n_tokens``: caller's N; ``padded``: ``(Nr, Nc)``, N padded along grid rows and along grid
    columns; ``n_seqs``/``s_padded``: the caller's and padded MSA depth (None without MSA
    features); ``kinds``: kind of every distributed key; ``added``: mask keys ``distribute``
    created; ``n_atoms``, ``atom_block``, ``atom_starts``/``atom_counts`` (``[B][rows]``): the
    atom placement (None without atom features, see :mod:`twinshard.pair.atoms`).
    """

    grid_shape: tuple[int, ...]
    n_tokens: int
    padded: tuple[int, int]
    n_seqs: int | None = None
    s_padded: int | None = None
    kinds: dict[str, str] = field(default_factory=dict)
    added: tuple[str, ...] = ()
    # atoms (set by distribute when atom features are present; twinshard.pair.atoms): Boltz's
    # padded atom count A, the per-block padded count A_blk, and per sample, per grid row, the
    # first global atom of the row and how many atoms it holds (the rows partition [0, A))
    n_atoms: int | None = None
    atom_block: int | None = None
    atom_starts: tuple[tuple[int, ...], ...] | None = None
    atom_counts: tuple[tuple[int, ...], ...] | None = None

    @classmethod
    def for_sizes(
        cls, n_tokens: int, grid: ProcessGrid | tuple[int, ...], n_seqs: int | None = None
    ) -> PairLayout:
        """Layout of a token count (and MSA depth) on a grid, without features."""
        shape = tuple(grid.shape) if isinstance(grid, ProcessGrid) else tuple(grid)
        return cls(
            grid_shape=shape,
            n_tokens=n_tokens,
            padded=padded_tokens(n_tokens, shape),
            n_seqs=n_seqs,
            s_padded=None if n_seqs is None else padded_sequences(n_seqs, shape),
        )

    def pad(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """Full tensor of ``kind`` padded with zeros to this layout (differentiable)."""
        for d, axis in _TOKEN_DIMS[kind].items():
            x = pad_dim(x, d, self.padded[axis])
        if kind in _SEQ_DIM:
            if self.s_padded is None:
                raise ValueError("this layout has no MSA depth: build it with n_seqs=")
            x = pad_dim(x, _SEQ_DIM[kind], self.s_padded)
        return x

    def unpad(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """Full padded tensor of ``kind`` cut back to the caller's sizes."""
        sizes = {d: self.n_tokens for d in _TOKEN_DIMS[kind]}
        if kind in _SEQ_DIM and self.n_seqs is not None:
            sizes[_SEQ_DIM[kind]] = self.n_seqs
        return unpad(x, sizes)

    def token_mask(
        self, axis: int, dtype: torch.dtype = torch.float64, device: torch.device | None = None
    ) -> torch.Tensor:
        """``[padded[axis]]``: 1 on real tokens, 0 on padding, for tokens split over grid rows
        (``axis=0``) or grid columns (``axis=1``)."""
        m = torch.zeros(self.padded[axis], dtype=dtype, device=device)
        m[: self.n_tokens] = 1
        return m


# -- the layout that travels with a DTensor -----------------------------------------------------

_ATTR = "_twinshard_layout"  # (PairLayout, kind) on a DTensor; plain DTensor ops drop it


def layout_of(x: object) -> PairLayout | None:
    """The ``PairLayout`` attached to ``x`` (by ``distribute``, ``shard_tensor``, a CP twin or
    :func:`with_layout`), or None: plain DTensor ops (``a + b``, ``.detach()``) drop it."""
    got = getattr(x, _ATTR, None)
    return None if got is None else got[0]


def layout_kind(x: object) -> str | None:
    """The kind (``single``, ``pair``, ``msa``, ``sample``) attached with ``x``'s layout, or None."""
    got = getattr(x, _ATTR, None)
    return None if got is None else got[1]


def _real_shape(shape: tuple[int, ...], layout: PairLayout, kind: str) -> tuple[int, ...]:
    real = list(shape)
    for d in _TOKEN_DIMS[kind]:
        real[d] = layout.n_tokens
    if kind in _SEQ_DIM:
        real[_SEQ_DIM[kind]] = layout.n_seqs  # type: ignore[assignment]
    return tuple(real)


def _check_fits(x: DTensor, layout: PairLayout, kind: str, what: str) -> None:
    """``x`` is a DTensor of ``kind`` whose padded sizes are ``layout``'s (metadata only)."""
    if kind not in KINDS:
        raise ValueError(f"{what}: unknown kind {kind!r}; choose one of {list(KINDS)}")
    check_placements(x, KINDS[kind], what)
    if tuple(x.device_mesh.shape) != tuple(layout.grid_shape):
        raise ValueError(
            f"{what} lives on a {tuple(x.device_mesh.shape)} grid, its layout on {layout.grid_shape}"
        )
    if kind in ATOM_KINDS:
        _check_atom_fits(x, layout, kind, what)
        return
    need = 1 + len(_TOKEN_DIMS[kind]) + (1 if kind in _SEQ_DIM else 0)
    if x.ndim < need:
        raise ValueError(f"{what}: a {kind} tensor needs >= {need} dims, got shape {tuple(x.shape)}")
    if kind in _SEQ_DIM and (layout.s_padded is None or layout.n_seqs is None):
        raise ValueError(
            f"{what}: an MSA tensor needs a layout with an MSA depth (PairLayout.for_sizes(n_seqs=))"
        )
    bad = [d for d, axis in _TOKEN_DIMS[kind].items() if x.shape[d] != layout.padded[axis]]
    if kind in _SEQ_DIM and x.shape[_SEQ_DIM[kind]] != layout.s_padded:
        bad.append(_SEQ_DIM[kind])
    if bad:
        raise ValueError(
            f"{what} has shape {tuple(x.shape)}, but a {kind} tensor of this layout has "
            f"{layout.padded} padded tokens along (rows, cols) (N = {layout.n_tokens})"
            + (
                ""
                if kind not in _SEQ_DIM
                else f" and {layout.s_padded} padded sequences (S = {layout.n_seqs})"
            )
        )


def atom_tile_shape(layout: PairLayout, kind: str) -> tuple[int, int, int | None]:
    """``(B, dim 1, dim 2)`` of a rank's tile of an atom kind (dim 2 None for ``atom``): ``atom``
    ``[B, A_blk, ...]``, ``atom_token`` ``[B, A_blk, Nr/R]``, ``token_atom`` ``[B, Nr/R, A_blk]``."""
    if layout.atom_block is None or layout.atom_starts is None:
        raise ValueError(
            f"a {kind} tensor needs a layout with atoms: distribute the atom features (with "
            "atom_to_token) through twinshard.pair.features.distribute"
        )
    b, a, n = len(layout.atom_starts), layout.atom_block, layout.padded[0] // layout.grid_shape[0]
    return {
        "atom": (b, a, None),
        "atom_token": (b, a, n),
        "token_atom": (b, n, a),
        "atom_conf": (b, a, None),
    }[kind]


def _check_atom_fits(x: DTensor, layout: PairLayout, kind: str, what: str) -> None:
    b, d1, d2 = atom_tile_shape(layout, kind)
    local = tuple(x.to_local().shape)
    if kind == "atom_conf":  # [B, K, A_blk, ...]: the atom dim is 2
        local = local[:1] + local[2:] if len(local) >= 3 else local
    want = (b, d1) if d2 is None else (b, d1, d2)
    if local[: len(want)] != want:
        raise ValueError(
            f"{what}: a {kind} tile of this layout is {want + ('...',) if d2 is None else want}, "
            f"got {local} (A = {layout.n_atoms}, A_blk = {layout.atom_block}, N = {layout.n_tokens})"
        )


def atom_keep(layout: PairLayout, kind: str, row: int, device: torch.device | None = None) -> torch.Tensor:
    """Bool keep-mask of grid row ``row``'s tile of an atom kind: ``[B, A_blk]`` (``atom``),
    ``[B, A_blk, Nr/R]`` (``atom_token``), ``[B, Nr/R, A_blk]`` (``token_atom``); True on the
    row's atoms (and real tokens), False on the per-block padding."""
    atom_tile_shape(layout, kind)  # raises without atoms
    counts = torch.tensor([c[row] for c in layout.atom_counts], device=device)  # type: ignore[union-attr]
    atoms = torch.arange(layout.atom_block, device=device)[None, :] < counts[:, None]  # type: ignore[arg-type]
    if kind == "atom":
        return atoms
    if kind == "atom_conf":
        return atoms[:, None, :]
    nI = layout.padded[0] // layout.grid_shape[0]
    tokens = torch.arange(row * nI, (row + 1) * nI, device=device) < layout.n_tokens
    if kind == "atom_token":
        return atoms[:, :, None] & tokens[None, None, :]
    return tokens[None, :, None] & atoms[:, None, :]


def _attach(x: DTensor, layout: PairLayout, kind: str) -> DTensor:
    setattr(x, _ATTR, (layout, kind))
    return x


def padding_keep(x: DTensor, layout: PairLayout, kind: str) -> torch.Tensor | None:
    """Bool ``[1, *tile dims]`` of ``x``'s local tile (batch and trailing dims broadcast): True on
    real entries, False on padding; None when this tile holds no padding (nothing to mask). For
    the atom kinds it is ``[B, *tile dims]`` (the padding differs per sample, :func:`atom_keep`)."""
    if kind == "sample":
        return None
    if kind in ATOM_KINDS:
        keep = atom_keep(layout, kind, x.device_mesh.get_coordinate()[0], x.device)
        return None if bool(keep.all()) else keep
    real = _real_shape(tuple(x.shape), layout, kind)
    glob = tile_slices(tuple(x.shape), x.device_mesh, x.placements)
    dims = sorted(set(_TOKEN_DIMS[kind]) | ({_SEQ_DIM[kind]} if kind in _SEQ_DIM else set()))
    if all(glob[d].stop <= real[d] for d in dims):
        return None
    nd = 1 + max(dims)  # the kept dims need not follow the batch dim (template: [B, T, N])
    keep = torch.ones((1,) * nd, dtype=torch.bool, device=x.device)
    for d in dims:
        idx = torch.arange(glob[d].start, glob[d].stop, device=x.device) < real[d]
        keep = keep & idx.view((1,) * d + (-1,) + (1,) * (nd - 1 - d))
    return keep


@autocast_rule()
class _ZeroPadding(torch.autograd.Function):
    """``x.masked_fill(~keep, 0)``; its adjoint is the same masking, made without a copy when the
    incoming gradient is zero on the padding already (whenever what reads the output ignores
    its padding: a mixing twin's masks, ``collect``). That copy was one tile more at the start
    of every twin's backward. The test reads the padded entries only (on CUDA: one host sync).

    Dtype path: masked_fill in x's dtype (backward: the gradient's); no communication.
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(keep)
        return local.masked_fill(~keep, 0)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (keep,) = ctx.saved_tensors
        if bool(g.masked_select(~keep).any()):  # NaN counts as non-zero
            g = g.masked_fill(~keep, 0)
        return g, None


def zero_padding(x: DTensor, layout: PairLayout, kind: str) -> DTensor:
    """``x`` with its padded entries set to exactly zero (no communication; differentiable).

    ``masked_fill``, not a product, so junk that is inf or NaN on padding is cleared too."""
    keep = padding_keep(x, layout, kind)
    if keep is None:
        return x
    local = x.to_local()
    keep = keep.view(tuple(keep.shape) + (1,) * (local.ndim - keep.ndim))
    return from_local(_ZeroPadding.apply(local, keep), x.device_mesh, x.placements)


def with_layout(x: DTensor, layout: PairLayout | DTensor, kind: str | None = None) -> DTensor:
    """``x`` with ``layout`` attached and its padding zeroed: after a plain DTensor op, e.g.
    ``z = with_layout(z + layer(z), z)``. ``layout`` is a ``PairLayout`` or a DTensor that
    carries one (its kind is taken too). ``kind`` is needed only where it is ambiguous (pair
    and MSA tensors share placements). Raises if the sizes do not fit the layout."""
    if isinstance(layout, DTensor):
        like = layout
        layout, like_kind = layout_of(like), layout_kind(like)  # type: ignore[assignment]
        if layout is None:
            raise ValueError(
                "with_layout(x, like): `like` carries no PairLayout either; pass the PairLayout "
                "(e.g. ShardedFeatures.layout from distribute)"
            )
        kind = kind or like_kind
    if not isinstance(layout, PairLayout):
        raise TypeError(
            f"with_layout needs a PairLayout or a DTensor carrying one, got {type(layout).__name__}"
        )
    if kind is None:
        kind = _infer_kind(x, layout)
    _check_fits(x, layout, kind, "with_layout")
    return _attach(zero_padding(x, layout, kind), layout, kind)


def _infer_kind(x: DTensor, layout: PairLayout) -> str:
    pl = tuple(x.placements)
    if pl == SAMPLE:
        return "sample"
    if pl == SINGLE:
        return "single"
    if pl == KINDS["template"]:
        return "template"
    fits_pair = x.ndim >= 3 and tuple(x.shape[1:3]) == tuple(layout.padded)
    fits_msa = layout.s_padded is not None and x.ndim >= 3 and x.shape[1] == layout.s_padded
    fits_msa = fits_msa and x.shape[2] == layout.padded[1]
    if fits_pair != fits_msa:
        return "pair" if fits_pair else "msa"
    raise ValueError(f"with_layout: say kind='pair' or kind='msa' for a tensor of shape {tuple(x.shape)}")


def real_part(
    x: DTensor, layout: PairLayout | None = None, kind: str | None = None
) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's real (unpadded) block of ``x`` and where it sits in the unpadded full tensor:
    ``(local, index)`` with ``full[index] == local`` (index: one slice per dim). The sharding
    evidence of a parity test (``TwinResult.shards``), detached. Layout and kind default to
    ``x``'s."""
    layout = layout or layout_of(x)
    kind = kind or layout_kind(x)
    if layout is None or kind is None:
        raise ValueError("real_part needs the PairLayout and kind of x (none is attached: pass them)")
    if kind in ATOM_KINDS:
        raise ValueError(
            f"real_part: a {kind} tile is one block per sample: use twinshard.pair.atoms.atom_parts"
        )
    _check_fits(x, layout, kind, "real_part")
    local = x.to_local().detach()
    return real_tile(local, x.device_mesh, x.placements, _real_shape(tuple(x.shape), layout, kind))
