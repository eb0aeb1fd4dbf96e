"""Atom features on the pair grid: the ``atom``, ``atom_token`` and ``token_atom`` kinds.

Boltz-2 keeps its atoms contiguous per token: ``atom_to_token`` (one-hot ``[B, A, N]``) is
non-decreasing over the atoms it maps, and the padding atoms (``atom_pad_mask == 0``, mapped to
no token) come last; ``A`` is padded to a multiple of the atom window (32). On a rows x cols
grid, grid row r holds the atoms whose token lies in token row block r (tokens
``[r Nr/R, (r + 1) Nr/R)``), replicated along the row, in global atom order, padded at the end
to a common ``A_blk`` (the most atoms any row holds in any sample). The atoms mapped to no token
(Boltz's padding) belong to the last grid row, so the rows partition ``[0, A)``: row r of
sample b holds global atoms ``[start[b][r], start[b][r] + count[b][r])``.

- ``atom``: serial ``[B, A, ...]`` (``ref_pos``, ...); tile ``[B, A_blk, ...]``; the DTensor's
  global shape ``[B, R A_blk, ...]``;
- ``atom_token``: serial ``[B, A, N]`` (``atom_to_token``); tile ``[B, A_blk, Nr/R]``, my atoms x
  my token block (token indices local to the block); global ``[B, R A_blk, Nr/R]``;
- ``token_atom``: serial ``[B, N, A]`` (``token_to_rep_atom``); tile ``[B, Nr/R, A_blk]``, my
  token block x my atoms (atom indices local to the row); global ``[B, Nr, A_blk]``.

All three sit at the single placements ``(Shard(1), Replicate())``. No rank holds a full
``A x N`` (or ``N x N``) tensor: an atom_token tile is ``A_blk x Nr/R``. The metadata
(``n_atoms``, ``atom_block``, ``atom_starts``, ``atom_counts``) travels in the ``PairLayout``,
replicated; :func:`atom_keep` (``twinshard.pair.layout``) tells the per-block padding.

Used by ``twinshard.pair.features`` (``distribute``, ``collect_tensor``), which this module
does not import. The values of Boltz-2's atom features (``atom_to_token`` one-hot, each real atom
on exactly one real token, padding atoms last and on none, atoms in token order, each token's
representative atom its own) are the feature contract's checks
(``twinshard.pair.feature_contract.check_features``), which ``distribute`` runs before
:func:`plan_atoms`. :func:`plan_atoms` checks what the placement adds and raises on every rank
(``raise_together``): ``atom_to_token`` present, atom features of one A, atom-token maps of the
token features' N, and every token-to-atom map (also those outside the contract, such as
``token_to_center_atom``) one-hot and inside its token's row block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from twinshard.comm import primitives as P
from twinshard.pair.layout import ATOM_KINDS, PairLayout, atom_tile_shape, layout_kind, layout_of
from twinshard.pair.tiling import pad_dim
from twinshard.runtime import ProcessGrid, raise_together
from twinshard.runtime.scope import default_group, to_global

__all__ = [
    "ATOM_FEATURES",
    "ATOM_KINDS",
    "atom_parts",
    "atom_rows",
    "atom_tile",
    "plan_atoms",
    "scatter_atom_tile",
    "unblock_atoms",
]

A2T = "atom_to_token"
ATOM_MASK = "atom_pad_mask"

# Boltz-2's atom features by kind (the per-atom features with the atom axis at dim 1).
ATOM_FEATURES: dict[str, str] = {
    "ref_pos": "atom",
    "ref_element": "atom",
    "ref_charge": "atom",
    "ref_atom_name_chars": "atom",
    "ref_space_uid": "atom",
    "ref_chirality": "atom",
    ATOM_MASK: "atom",
    "atom_backbone_feat": "atom",
    "atom_resolved_mask": "atom",
    "bfactor": "atom",
    "plddt": "atom",
    A2T: "atom_token",
    "token_to_rep_atom": "token_atom",
    "token_to_center_atom": "token_atom",
    "coords": "atom_conf",  # [B, K, A, 3] true coordinates per conformer (training)
    "r_set_token_to_atom": "token_atom",  # derived by distribute from r_set_to_rep_atom
}


# -- the plan ---------------------------------------------------------------------------------


def _atom_count(name: str, kind: str, shape: tuple[int, ...]) -> int:
    if kind == "atom_conf":
        if len(shape) < 3:
            raise ValueError(f"atom_conf feature {name!r} must be [B, K, A, ...], got shape {shape}")
        return shape[2]
    if kind == "atom":
        if len(shape) < 2:
            raise ValueError(f"atom feature {name!r} must be [B, A, ...], got shape {shape}")
        return shape[1]
    if len(shape) != 3:
        what = "[B, A, N]" if kind == "atom_token" else "[B, N, A]"
        raise ValueError(f"{kind} feature {name!r} must be {what}, got shape {shape}")
    return shape[1] if kind == "atom_token" else shape[2]


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def _one_hot_rows(name: str, x: torch.Tensor, axis_name: str) -> torch.Tensor:
    """Number of ones per row of a 0/1 map (last dim); raises if an entry is neither."""
    bad = (x != 0) & (x != 1)
    if bool(bad.any()):
        b, i, j = _first(bad)
        raise ValueError(
            f"{name} must be one-hot (entries 0 or 1), but sample {b}, {axis_name} {i} has "
            f"{x[b, i, j].item()} at column {j}"
        )
    return (x != 0).sum(-1)


def _rows_of_atoms(features: Mapping[str, torch.Tensor], n: int, grid_shape: tuple[int, ...], nr: int):
    """Per sample: starts and counts of the atoms per grid row.

    ``atom_to_token``'s values were checked by the feature contract before (``distribute`` runs
    ``check_contract`` first: 0/1 entries, each real atom on exactly one real token, padding atoms
    on none and last, real atoms in token order); here only its token count, which the contract
    cannot compare with token features outside it."""
    x = features[A2T].detach()
    b, a, cols = x.shape
    if cols != n:
        raise ValueError(
            f"feature {A2T!r} is [B, A, {cols}] but the token features have N = {n}: every atom must "
            "map to one of the N tokens"
        )
    mapped = (x != 0).any(-1)
    tok = x.argmax(-1)
    rows, nI = grid_shape[0], nr // grid_shape[0]
    starts, counts = [], []
    for s in range(b):
        m = int(mapped[s].sum())
        c = torch.bincount(torch.div(tok[s, :m], nI, rounding_mode="floor"), minlength=rows).tolist()
        c[-1] += a - m  # the padding atoms belong to the last grid row
        st = [0]
        for k in c[:-1]:
            st.append(st[-1] + k)
        starts.append(tuple(st))
        counts.append(tuple(c))
    return tuple(starts), tuple(counts)


def _check_block_maps(
    features: Mapping[str, torch.Tensor], kind_of: Mapping[str, str], layout: PairLayout
) -> None:
    """Every atom_token / token_atom map links atoms and tokens of the same grid row only."""
    n, nI = layout.n_tokens, layout.padded[0] // layout.grid_shape[0]
    for name in sorted(kind_of):
        kind = kind_of[name]
        if kind not in ("atom_token", "token_atom") or name == A2T:
            continue
        x = features[name].detach()
        tok_dim = 2 if kind == "atom_token" else 1
        if x.shape[tok_dim] != n:
            raise ValueError(
                f"{kind} feature {name!r} has {x.shape[tok_dim]} tokens, the token features N = {n}"
            )
        if kind == "token_atom":
            per = _one_hot_rows(name, x, "token")
            if bool((per > 1).any()):
                s, t = _first(per > 1)
                raise ValueError(f"{name} maps token {t} of sample {s} to {int(per[s, t])} atoms, not one")
        arow = atom_rows(layout, x.device)  # [B, A]
        trow = torch.div(torch.arange(n, device=x.device), nI, rounding_mode="floor")
        if kind == "atom_token":
            cross = (x != 0) & (arow[:, :, None] != trow[None, None, :])
        else:
            cross = (x != 0) & (trow[None, :, None] != arow[:, None, :])
        if bool(cross.any()):
            s, i, j = _first(cross)
            t, g = (j, i) if kind == "atom_token" else (i, j)
            r = int(trow[t])
            lo, cnt = layout.atom_starts[s][r], layout.atom_counts[s][r]  # type: ignore[index]
            raise ValueError(
                f"{name} links token {t} of sample {s} (grid row {r}) with atom {g}, which is not "
                f"among that row's atoms [{lo}, {lo + cnt}): a token's atoms (and its representative "
                "atom) must be its own"
            )


def _atom_fields(
    features: Mapping[str, torch.Tensor], kind_of: Mapping[str, str], layout: PairLayout
) -> dict[str, Any]:
    names = sorted(k for k, v in kind_of.items() if v in ATOM_KINDS)
    if A2T not in features or kind_of.get(A2T) != "atom_token":
        raise ValueError(
            f"atom features {names} need atom_to_token [B, A, N] (kind atom_token) to be placed on the grid"
        )
    counts = {k: _atom_count(k, kind_of[k], tuple(features[k].shape)) for k in names}
    if len(set(counts.values())) > 1:
        raise ValueError(f"atom features disagree on the atom count A: {counts}")
    starts, cnts = _rows_of_atoms(features, layout.n_tokens, layout.grid_shape, layout.padded[0])
    fields = {
        "n_atoms": counts[A2T],
        "atom_block": max(1, max(max(c) for c in cnts)),
        "atom_starts": starts,
        "atom_counts": cnts,
    }
    _check_block_maps(features, kind_of, dataclasses.replace(layout, **fields))
    return fields


def plan_atoms(
    features: Mapping[str, torch.Tensor] | None,
    kind_of: Mapping[str, str],
    layout: PairLayout,
    grid: ProcessGrid,
    src: int | None,
) -> PairLayout:
    """``layout`` with the atom placement of ``features`` (unchanged without atom features).

    The rank(s) holding the features (all with ``src=None``, rank ``src`` otherwise) check them
    and compute the placement; with ``src`` it is broadcast (one object broadcast), with
    ``src=None`` the ranks compare theirs (one object all-gather). Errors raise on every rank
    (one status exchange).
    """
    if not any(k in ATOM_KINDS for k in kind_of.values()):
        return layout
    fields, err = None, None
    if src is None or grid.rank == src:
        try:
            fields = _atom_fields(features, kind_of, layout)  # type: ignore[arg-type]
        except Exception as exc:  # reported together below
            err = exc
    if src is not None:
        box = [fields]
        dist.broadcast_object_list(box, src=to_global(src), group=default_group())
        fields = box[0]
    elif grid.size > 1:
        got: list = [None] * grid.size
        dist.all_gather_object(got, fields, group=default_group())
        ok = [g for g in got if g is not None]
        if err is None and any(g != ok[0] for g in ok):
            err = ValueError(
                "with src=None every rank must pass the same atom features, but the atom placement "
                "from atom_to_token differs between ranks"
            )
    raise_together(err, step="pair.features.distribute (atoms)")
    return dataclasses.replace(layout, **fields)  # type: ignore[arg-type]


# -- tiles --------------------------------------------------------------------------------------


def _row_index(layout: PairLayout, row: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index [B, A_blk] of the global atoms of grid row ``row``, valid [B, A_blk])``."""
    starts = torch.tensor([s[row] for s in layout.atom_starts], device=device)  # type: ignore[union-attr]
    counts = torch.tensor([c[row] for c in layout.atom_counts], device=device)  # type: ignore[union-attr]
    ar = torch.arange(layout.atom_block, device=device)  # type: ignore[arg-type]
    valid = ar[None, :] < counts[:, None]
    idx = torch.where(valid, starts[:, None] + ar[None, :], torch.zeros_like(valid, dtype=torch.long))
    return idx, valid


def atom_rows(layout: PairLayout, device: torch.device | None = None) -> torch.Tensor:
    """``[B, A]`` int64: the grid row holding each global atom."""
    out = torch.empty(len(layout.atom_starts), layout.n_atoms, dtype=torch.long, device=device)  # type: ignore[arg-type]
    for b, (st, cn) in enumerate(zip(layout.atom_starts, layout.atom_counts)):  # type: ignore[arg-type]
        for r, (s, c) in enumerate(zip(st, cn)):
            out[b, s : s + c] = r
    return out


def _mask_rows(x: torch.Tensor, valid: torch.Tensor, dim: int) -> torch.Tensor:
    shape = [1] * x.ndim
    shape[0], shape[dim] = valid.shape
    return x.masked_fill(~valid.view(shape), 0)


def atom_tile(x: torch.Tensor, kind: str, layout: PairLayout, row: int) -> torch.Tensor:
    """Grid row ``row``'s tile of the full atom-kind tensor ``x`` (differentiable: the gradient
    reaching ``x`` covers this tile only). See the module docstring for the tile shapes."""
    if kind == "atom_conf":  # [B, K, A, ...]: the atom tile of each conformer
        return atom_tile(x.transpose(1, 2), "atom", layout, row).transpose(1, 2).contiguous()
    idx, valid = _row_index(layout, row, x.device)
    bi = torch.arange(x.shape[0], device=x.device)[:, None]
    nI = layout.padded[0] // layout.grid_shape[0]
    tokens = slice(row * nI, (row + 1) * nI)
    if kind == "atom":
        return _mask_rows(x[bi, idx], valid, 1).contiguous()
    if kind == "atom_token":
        x = pad_dim(x, 2, layout.padded[0])
        return _mask_rows(x[bi, idx][:, :, tokens], valid, 1).contiguous()
    x = pad_dim(x, 1, layout.padded[0])[:, tokens]
    got = torch.gather(x, 2, idx[:, None, :].expand(x.shape[0], nI, idx.shape[1]))
    return _mask_rows(got, valid, 2).contiguous()


def _tile_shape(meta_shape: tuple[int, ...], kind: str, layout: PairLayout) -> tuple[int, ...]:
    b, d1, d2 = atom_tile_shape(layout, kind)
    if kind == "atom_conf":
        return (b, meta_shape[1], d1) + tuple(meta_shape[3:])
    return (b, d1) + (tuple(meta_shape[2:]) if d2 is None else (d2,))


def scatter_atom_tile(
    full: torch.Tensor | None,
    kind: str,
    layout: PairLayout,
    grid: ProcessGrid,
    src: int,
    dtype: torch.dtype,
    meta_shape: tuple[int, ...],
) -> torch.Tensor:
    """Rank ``src`` sends each rank its row's tile of ``full`` point to point; returns mine."""
    wire = torch.uint8 if dtype == torch.bool else dtype  # gloo moves no bools
    if grid.rank == src:
        tiles = {r: atom_tile(full.detach(), kind, layout, r).to(wire) for r in range(grid.rows)}  # type: ignore[union-attr]
        sends = [(p, tiles[grid.coords_of(p)[0]]) for p in range(grid.size) if p != src]
        P.exchange(sends, [], dtype=wire, op="features.distribute")
        return tiles[grid.coords[0]].to(dtype)
    got = P.exchange([], [(src, _tile_shape(meta_shape, kind, layout))], dtype=wire, op="features.distribute")
    return got[0].to(dtype)  # type: ignore[index]


# -- back to the serial tensor ------------------------------------------------------------------


def _blocked_positions(layout: PairLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pos [B, A], row [B, A])``: where each global atom sits along dim 1 of the row-gathered
    blocked tensor ``[B, R A_blk, ...]``, and its grid row."""
    row = atom_rows(layout, device)
    starts = torch.tensor(layout.atom_starts, device=device)  # [B, R]
    g = torch.arange(layout.n_atoms, device=device)[None, :]  # type: ignore[arg-type]
    pos = row * layout.atom_block + g - starts.gather(1, row)
    return pos, row


def unblock_atoms(blocked: torch.Tensor, layout: PairLayout, kind: str) -> torch.Tensor:
    """The serial tensor (global atom order, Boltz's padded A, the caller's N) from the tiles
    gathered along the grid rows (``[B, R A_blk, ...]`` or ``[B, Nr, A_blk]``). Differentiable;
    the adjoint puts each atom's gradient back at its tile position (zero on the padding)."""
    if kind == "atom_conf":  # [B, K, R A_blk, ...] -> [B, K, A, ...]
        return unblock_atoms(blocked.transpose(1, 2), layout, "atom").transpose(1, 2)
    dev = blocked.device
    pos, row = _blocked_positions(layout, dev)
    bi = torch.arange(blocked.shape[0], device=dev)[:, None]
    nI = layout.padded[0] // layout.grid_shape[0]
    if kind == "atom":
        return blocked[bi, pos]
    if kind == "atom_token":
        sel = blocked[bi, pos]  # [B, A, Nr/R]: my token block's columns
        own = torch.nn.functional.one_hot(row, layout.grid_shape[0]).bool()  # [B, A, R]
        out = torch.where(own[..., None], sel[:, :, None, :], torch.zeros((), dtype=sel.dtype, device=dev))
        return out.reshape(sel.shape[0], sel.shape[1], -1)[:, :, : layout.n_tokens]
    # token_atom: [B, Nr, A_blk] -> [B, Nr, A]
    starts = torch.tensor(layout.atom_starts, device=dev)  # [B, R]
    counts = torch.tensor(layout.atom_counts, device=dev)
    trow = torch.div(torch.arange(layout.padded[0], device=dev), nI, rounding_mode="floor")
    st, cn = starts[:, trow], counts[:, trow]  # [B, Nr]
    local = torch.arange(layout.n_atoms, device=dev)[None, None, :] - st[:, :, None]  # type: ignore[arg-type]
    valid = (local >= 0) & (local < cn[:, :, None])
    got = torch.gather(blocked, 2, torch.where(valid, local, torch.zeros_like(local)))
    out = torch.where(valid, got, torch.zeros((), dtype=got.dtype, device=dev))
    return out[:, : layout.n_tokens]


def atom_parts(
    x: Any, layout: PairLayout | None = None, kind: str | None = None
) -> list[tuple[torch.Tensor, tuple[slice, ...]]]:
    """This rank's real pieces of an atom-kind DTensor and where they sit in the serial tensor:
    one ``(local, index)`` per sample holding atoms (the sharding evidence of a parity test)."""
    layout = layout or layout_of(x)
    kind = kind or layout_kind(x)
    if layout is None or kind not in ATOM_KINDS:
        raise ValueError("atom_parts needs an atom-kind DTensor with its PairLayout")
    r = x.device_mesh.get_coordinate()[0]
    local = x.to_local().detach()
    nI = layout.padded[0] // layout.grid_shape[0]
    t0, t1 = min(r * nI, layout.n_tokens), min((r + 1) * nI, layout.n_tokens)
    out = []
    for b, (st, cn) in enumerate(zip(layout.atom_starts, layout.atom_counts)):  # type: ignore[arg-type]
        s, c = st[r], cn[r]
        if c == 0:
            continue
        if kind == "atom":
            out.append((local[b : b + 1, :c], (slice(b, b + 1), slice(s, s + c))))
        elif kind == "atom_conf":
            out.append((local[b : b + 1, :, :c], (slice(b, b + 1), slice(None), slice(s, s + c))))
        elif kind == "atom_token":
            out.append((local[b : b + 1, :c, : t1 - t0], (slice(b, b + 1), slice(s, s + c), slice(t0, t1))))
        else:
            out.append((local[b : b + 1, : t1 - t0, :c], (slice(b, b + 1), slice(t0, t1), slice(s, s + c))))
    return out
