"""Feature placement table, distributor and collector for the pair trunk.

``distribute(features, grid, src=...)`` turns a dict of full feature tensors
into DTensors on a rows x cols grid at the contract placements (see
``twinshard.pair.tiling``), for any token count N and MSA depth S:

- kind ``single`` ``[B, N, ...]``: rows block r on grid row r, replicated along it;
- kind ``pair``   ``[B, N, N, ...]``: tile (r, c) = rows block r x columns block c;
- kind ``msa``    ``[B, S, N, ...]``: sequences block r x tokens block c;
- kind ``sample`` ``[B, ...]``: replicated (per-sample scalars and vectors).

N is padded at the end, to a multiple of rows where tokens are split over grid rows
(``single``, dim 1 of ``pair``) and to a multiple of cols where they are split over grid
columns (dim 2 of ``pair``, ``msa``); S to a multiple of rows. So on a rectangular grid a
pair tensor may be ``[B, Nr, Nc, ...]`` with Nr != Nc (``twinshard.pair.tiling``);
padded entries are zero. The masks that make padding inert are added or
extended: ``token_pad_mask [B, N]`` (given, else ones), ``pair_mask [B, N, N]``
(given, else the outer product of the token mask) and, when MSA features are
present, ``msa_mask [B, S, N]`` (given, else the token mask on every real
sequence); padded entries of all three are zero. ``collect(features, layout)``
gathers DTensors back to full tensors on every rank, cuts the padding away and
drops the masks ``distribute`` added, so the caller gets its own N and S back.

With ``src=None`` every rank holds the same full features and slices its tiles
(no communication). With ``src=k`` only rank k needs them (others may pass
``None``): rank k broadcasts the metadata and sends each rank its tiles point to
point, so no other rank ever holds a full tensor. Input errors raise on every rank together
(``twinshard.runtime.raise_together``): unknown names, inconsistent sizes, and every violation
of the Boltz-2 feature contract (:func:`twinshard.pair.feature_contract.check_features`, run on
the rank(s) holding the data over the contract's features present: values, masks, one-hots,
id ranges, an atom mapped beyond N, to no token or out of order, an MSA of depth 0, ...). Zero
templates (T = 0) are valid. A feature the model needs but the dict lacks is the model's check
(``CPBoltz2Trunk`` names the missing ones on every rank).

The layout travels with the tensors (:mod:`twinshard.pair.layout`, whose names this
module re-exports). Every DTensor that ``distribute`` or ``shard_tensor`` returns
carries its ``PairLayout`` and kind (read it with :func:`layout_of` / :func:`layout_kind`), and every CP twin in
``twinshard.pair.layers`` passes its input's layout on to its outputs. So a user
who never heard of padding gets the serial answer on any N:

- a mixing twin (triangle multiplication, outer product mean) called with
  ``mask=None`` derives the padding mask from the layout; a given mask is
  multiplied by it (padding can never count);
- every twin's output has its padded entries EXACTLY zero, so residual sums of
  twin outputs and distributed inputs (padded with zeros) stay inert;
- a plain DTensor op (``z + layer(z)``, ``z.detach()``) returns a DTensor
  without the layout (torch does not carry Python attributes through ops). A
  token-local twin (linear, layer norm, transition, dropout) is exact on real
  entries whatever the padding holds, so it runs and returns a tensor without a
  layout; a mixing twin given such a tensor and no mask RAISES (the same error
  on every rank: the check reads metadata every rank holds alike) and says how
  to fix it: ``with_layout(z + layer(z), z)`` (which also zeroes the padding)
  or ``pointwise(lambda a, b: a + b, z, layer(z))`` from ``pair.layers``, which
  keeps the first argument's layout. Nothing falls back to "no padding".

Gradients. With ``src=None`` the tiles are slices of each rank's own full
tensors: a rank's ``x.grad`` holds the gradient of its own tile only (zeros
elsewhere). :func:`collect_grad` sums these partial gradients over the mesh
axes along which the kind is sharded (not along replicated ones, where every
rank holds the same tile and the same gradient), giving every rank the full
gradient. With ``src=k`` data moves point to point without autograd; rather
than drop gradients silently, ``distribute`` raises on every rank when rank
k's features require grad.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Placement

from twinshard.comm import primitives as P
from twinshard.comm.amp import autocast_rule
from twinshard.pair.atoms import ATOM_FEATURES, atom_tile, plan_atoms, scatter_atom_tile, unblock_atoms
from twinshard.pair.feature_contract import CONTRACT, check_features, r_set_token_form
from twinshard.pair.layout import (
    _SEQ_DIM,
    _TOKEN_DIMS,
    ATOM_KINDS,
    KINDS,
    PairLayout,
    _attach,
    layout_kind,
    layout_of,
    padding_keep,
    real_part,
    with_layout,
    zero_padding,
)
from twinshard.pair.tiling import (
    check_placements,
    from_local,
    local_block,
    pad_dim,
    reduction_axes,
    tile_slices,
)
from twinshard.runtime import ProcessGrid, raise_together
from twinshard.runtime.scope import default_group, scope_size, to_global

__all__ = [
    "KINDS",
    "MSA_MASK",
    "PAIR_MASK",
    "PLACEMENT_TABLE",
    "TOKEN_MASK",
    "PairLayout",
    "ShardedFeatures",
    "collect",
    "collect_grad",
    "check_contract",
    "collect_tensor",
    "distribute",
    "layout_kind",
    "layout_of",
    "padding_keep",
    "real_part",
    "shard_tensor",
    "with_layout",
    "zero_padding",
]

TOKEN_MASK, PAIR_MASK, MSA_MASK = "token_pad_mask", "pair_mask", "msa_mask"
R_SET = "r_set_to_rep_atom"

# Feature name -> kind. Names follow Boltz-2's featuriser where one exists, plus
# the trunk activations (s, z, m). Unknown names need ``kinds={name: kind}``.
PLACEMENT_TABLE: dict[str, str] = {
    # trunk activations
    "s": "single",
    "s_inputs": "single",
    "z": "pair",
    "m": "msa",
    # masks
    TOKEN_MASK: "single",
    PAIR_MASK: "pair",
    MSA_MASK: "msa",
    # per-token features
    "res_type": "single",
    "token_index": "single",
    "residue_index": "single",
    "asym_id": "single",
    "entity_id": "single",
    "sym_id": "single",
    "mol_type": "single",
    "profile": "single",
    "deletion_mean": "single",
    "token_resolved_mask": "single",
    "disto_center": "single",
    "modified": "single",
    "cyclic_period": "single",
    "frames_idx": "single",  # [B, N, 3] global atom indices of each token's frame (confidence pTM)
    "token_disto_mask": "single",  # [B, N] distogram loss mask (training)
    "frame_resolved_mask": "single",  # [B, N] (training: confidence PAE loss)
    # per-token-pair features
    "token_bonds": "pair",
    "type_bonds": "pair",
    "contact_conditioning": "pair",
    "contact_threshold": "pair",
    "relative_position": "pair",
    "disto_target": "pair",  # [B, N, N, K, bins] true distogram (training)
    # MSA features
    "msa": "msa",
    "has_deletion": "msa",
    "deletion_value": "msa",
    "msa_paired": "msa",
    "method_feature": "single",  # [B, N]: Boltz featurises the method per token
    # per-sample
    "num_tokens": "sample",
    # template features [B, T, N, ...] (Boltz-2's featuriser; T whole, tokens over grid rows)
    "template_restype": "template",
    "template_frame_rot": "template",
    "template_frame_t": "template",
    "template_mask_frame": "template",
    "template_cb": "template",
    "template_ca": "template",
    "template_mask_cb": "template",
    "template_mask": "template",
    "query_to_template": "template",
    "visibility_ids": "template",
    # per-atom features (kinds atom, atom_token, token_atom: twinshard.pair.atoms)
    **ATOM_FEATURES,
}


class ShardedFeatures(dict):
    """``dict[str, DTensor]`` returned by :func:`distribute`, with its ``layout``."""

    def __init__(self, items: Mapping[str, DTensor], layout: PairLayout):
        super().__init__(items)
        self.layout = layout


def collect_grad(grad: torch.Tensor, kind: str, grid: ProcessGrid) -> torch.Tensor:
    """The full gradient of a feature distributed with ``src=None``, from each rank's ``x.grad``.

    Each rank's gradient holds its own tile only (its tiles are slices of its own copy). The
    sum runs over the mesh axes along which ``kind`` is sharded: along a replicated axis the
    ranks hold the same tile and the same (replicated) gradient, and summing there would count
    it once per rank. Collective: one all-reduce (>= fp32) over those axes; every rank returns
    the same full gradient.
    """
    axes = reduction_axes(KINDS[kind])
    if not axes or grid.size == 1:
        return grad.clone()
    if len(axes) == grid.ndim:
        if grid.size != scope_size():
            raise ValueError("collect_grad: the pair grid must span the whole world or sub-world")
        group = None
    else:
        group = grid.mesh.get_group(axes[0])
    return P.all_reduce(grad, group, op="features.collect_grad")


def _kind_of(name: str, kinds: Mapping[str, str] | None) -> str:
    kind = (kinds or {}).get(name, PLACEMENT_TABLE.get(name))
    if kind is None:
        raise KeyError(
            f"feature {name!r} is not in twinshard.pair.features.PLACEMENT_TABLE: pass "
            f"kinds={{{name!r}: 'single' | 'pair' | 'msa' | 'sample'}}"
        )
    if kind not in KINDS:
        raise ValueError(f"feature {name!r}: unknown kind {kind!r}; choose one of {list(KINDS)}")
    return kind


def check_contract(features: Mapping[str, torch.Tensor], kinds: Mapping[str, str] | None = None) -> None:
    """:func:`twinshard.pair.feature_contract.check_features` on the features the contract knows
    (Boltz-2's names at the contract's kind; other names and overridden kinds are left to the
    placement checks), without requiring any (``need=None``) and without the atom-window check
    (the atom encoder, which knows its window, checks that). Raises ``ValueError`` naming the
    feature. Serial; ``distribute`` runs it on the rank(s) holding the data."""
    known = {
        k: v
        for k, v in features.items()
        if k in CONTRACT and (k == R_SET or (kinds or {}).get(k, PLACEMENT_TABLE.get(k)) == CONTRACT[k].kind)
    }
    if known:
        check_features(known, need=None, window=None)


def _derived(features: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """Features whose serial form cannot be placed, replaced by a placeable equivalent:
    ``r_set_to_rep_atom`` (rows not token-aligned) -> ``r_set_token_to_atom`` (kind
    ``token_atom``, row t = token t's R-set atom; :func:`feature_contract.r_set_token_form`).
    ``collect`` returns the derived key."""
    if R_SET not in features:
        return features
    if "atom_to_token" not in features:
        raise ValueError(f"feature {R_SET!r} needs 'atom_to_token' to be placed on the grid")
    out = {k: v for k, v in features.items() if k != R_SET}
    out["r_set_token_to_atom"] = r_set_token_form(features[R_SET].detach(), features["atom_to_token"])
    return out


def _plan(
    meta: dict[str, tuple[tuple[int, ...], torch.dtype]],
    kinds: Mapping[str, str] | None,
    grid_shape: tuple[int, ...],
) -> tuple[PairLayout, dict[str, str]]:
    """Validate shapes against kinds; return the layout. Pure function of replicated metadata."""
    if not meta:
        raise ValueError("distribute: no features given")
    kind_of = {k: _kind_of(k, kinds) for k in sorted(meta)}
    batch: set[int] = set()
    ns: dict[str, int] = {}
    ss: dict[str, int] = {}
    for k, kind in kind_of.items():
        shape = meta[k][0]
        if kind in ATOM_KINDS:  # checked by twinshard.pair.atoms.plan_atoms
            batch.add(shape[0])
            continue
        need = 1 + len(_TOKEN_DIMS[kind]) + (1 if kind in _SEQ_DIM else 0)
        if len(shape) < need:
            raise ValueError(f"feature {k!r} of kind {kind} needs >= {need} dims, got {shape}")
        batch.add(shape[0])
        dims = _TOKEN_DIMS[kind]
        if kind == "pair" and shape[1] != shape[2]:
            raise ValueError(f"pair feature {k!r} must be [B, N, N, ...], got {shape}")
        for d in dims:
            ns[k] = shape[d]
        if kind in _SEQ_DIM:
            ss[k] = shape[_SEQ_DIM[kind]]
    if len(batch) > 1:
        raise ValueError(f"features disagree on the batch size: {sorted(batch)}")
    if len(set(ns.values())) > 1:
        raise ValueError(f"features disagree on the token count N: {ns}")
    if len(set(ss.values())) > 1:
        raise ValueError(f"MSA features disagree on the depth S: {ss}")
    ts = {k: meta[k][0][1] for k, kind in kind_of.items() if kind == "template"}
    short = [k for k in ts if len(meta[k][0]) < 3]
    if short:
        raise ValueError(
            f"template features {short} must be [B, T, N, ...], got {[meta[k][0] for k in short]}"
        )
    if len(set(ts.values())) > 1:
        raise ValueError(f"template features disagree on the number of templates T: {ts}")
    if not ns:
        raise ValueError("distribute needs at least one single, pair or msa feature to know N")
    n = next(iter(ns.values()))
    s = next(iter(ss.values())) if ss else None
    if s == 0:
        raise ValueError(
            f"MSA features {sorted(ss)} have depth S = 0: Boltz-2's MSA holds at least the query sequence"
        )
    return PairLayout.for_sizes(n, grid_shape, s), kind_of


def _mask_dtype(meta: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> torch.dtype:
    floats = [dt for _, dt in meta.values() if dt.is_floating_point]
    dt = torch.float32
    for f in floats:
        dt = torch.promote_types(dt, f)
    return dt


def _full_with_masks(
    features: Mapping[str, torch.Tensor],
    layout: PairLayout,
    kind_of: dict[str, str],
    mask_dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Padded full tensors, with the token/pair/MSA masks completed (on the rank holding data)."""
    out = {k: layout.pad(features[k], kind_of[k]) for k in kind_of if kind_of[k] not in ATOM_KINDS}
    b = next(iter(features.values())).shape[0]
    dev = next(iter(features.values())).device
    if TOKEN_MASK not in out:
        out[TOKEN_MASK] = layout.token_mask(0, mask_dtype, dev).expand(b, -1).clone()
    tok = out[TOKEN_MASK]  # [B, Nr]; the same tokens along columns: [B, Nc]
    tok_c = pad_dim(tok[:, : layout.n_tokens], 1, layout.padded[1])
    if PAIR_MASK not in out:
        out[PAIR_MASK] = (tok[:, :, None] * tok_c[:, None, :]).to(mask_dtype)
    if any(kind == "msa" for kind in kind_of.values()) and MSA_MASK not in out:
        seq = torch.zeros(layout.s_padded, dtype=mask_dtype, device=dev)  # type: ignore[arg-type]
        seq[: layout.n_seqs] = 1
        out[MSA_MASK] = (seq[None, :, None] * tok_c[:, None, :]).to(mask_dtype)
    return out


def _placements(kind: str) -> tuple[Placement, ...]:
    return KINDS[kind]


def _local_shape(
    shape: tuple[int, ...], grid: ProcessGrid, placements: tuple[Placement, ...]
) -> tuple[int, ...]:
    out = list(shape)
    for a, p in enumerate(placements):
        if hasattr(p, "dim"):
            out[p.dim] //= grid.shape[a]
    return tuple(out)


def distribute(
    features: Mapping[str, torch.Tensor] | None,
    grid: ProcessGrid,
    src: int | None = None,
    kinds: Mapping[str, str] | None = None,
    mask_dtype: torch.dtype | None = None,
) -> ShardedFeatures:
    """Full features (on every rank, or on rank ``src``) -> DTensors at the contract placements.

    ``kinds`` overrides or extends ``PLACEMENT_TABLE``. Masks default to the
    promoted floating dtype of the features (>= fp32). The result holds every
    input key plus the added masks, and ``.layout`` for :func:`collect`.
    Collectives: with ``src=None``, a metadata all-gather (ranks must agree)
    and one status exchange (fail-together check); with ``src``, a metadata
    broadcast, the check, and one point-to-point message per feature and rank
    from ``src``; with atom features one more object exchange and status exchange
    (``pair.atoms.plan_atoms``). Checks: :func:`check_contract` on the rank(s) holding
    the data (every rank with ``src=None``, rank ``src`` otherwise), then the placement
    checks; the first error is raised on every rank (``RankFailure``, step
    ``pair.features.distribute``). Differentiable only with ``src=None`` (tiles are slices of the
    caller's tensors); the ``src`` path moves data, not gradients.
    """
    if grid.ndim != 2:
        raise ValueError(f"pair features live on a rows x cols grid, got a {grid.ndim}-D grid")
    meta: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
    err: BaseException | None = None
    holds_data = src is None or grid.rank == src
    if holds_data:
        try:
            if features is None:
                raise ValueError(f"rank {grid.rank} must pass the features (src={src})")
            check_contract(features, kinds)  # the contract's value checks, where the data is
            features = _derived(features)
            meta = {k: (tuple(v.shape), v.dtype) for k, v in features.items()}
        except Exception as exc:  # reported together below
            err = exc
    src_failed = False
    if src is not None:
        # Whether rank src's features need gradients (or failed the contract) travels with the
        # metadata, so every rank raises together: the point-to-point scatter moves data, not
        # gradients; a failure on src is reported as src's alone (the others do not plan).
        needs_grad = holds_data and features is not None and any(v.requires_grad for v in features.values())
        box = [(meta, needs_grad, err is not None)]
        dist.broadcast_object_list(box, src=to_global(src), group=default_group())
        meta, needs_grad, src_failed = box[0]
        if err is None and needs_grad and not src_failed:
            err = ValueError(
                f"distribute(src={src}) scatters data without autograd, but rank {src}'s features "
                "require grad and their gradients would be dropped: pass src=None with the same "
                "features on every rank (then sum each rank's partial x.grad with collect_grad), "
                "or detach them"
            )
    elif grid.size > 1:  # every rank claims to hold the same features: check, don't trust
        sigs: list = [None] * grid.size
        dist.all_gather_object(
            sigs, None if meta is None else sorted(meta.items(), key=str), group=default_group()
        )
        if err is None and any(sig != sigs[0] for sig in sigs if sig is not None):
            bad = [r for r, sig in enumerate(sigs) if sig != sigs[0]]
            err = ValueError(
                f"with src=None every rank must pass the same features, but ranks {bad} differ "
                "from rank 0 in names, shapes or dtypes; or pass them on one rank with src="
            )
    layout = kind_of = None
    if err is None and meta is not None and not src_failed:
        try:
            layout, kind_of = _plan(meta, kinds, tuple(grid.shape))
            if math.prod(grid.shape) > 1 and layout.n_tokens < max(grid.shape):
                raise ValueError(
                    f"{layout.n_tokens} tokens on a {'x'.join(map(str, grid.shape))} grid leave "
                    "whole grid rows or columns with padding only: use a smaller grid"
                )
        except Exception as exc:
            err = exc
    raise_together(err, step="pair.features.distribute")
    assert layout is not None and kind_of is not None and meta is not None
    mdt = mask_dtype or _mask_dtype(meta)
    full = _full_with_masks(features, layout, kind_of, mdt) if holds_data else None  # type: ignore[arg-type]
    added = tuple(
        k
        for k in (TOKEN_MASK, PAIR_MASK, MSA_MASK)
        if k not in meta and (k != MSA_MASK or "msa" in kind_of.values())
    )
    all_kinds = {**kind_of, **{k: PLACEMENT_TABLE[k] for k in added}}
    layout = PairLayout(
        layout.grid_shape,
        layout.n_tokens,
        layout.padded,
        layout.n_seqs,
        layout.s_padded,
        all_kinds,
        added,
    )
    layout = plan_atoms(features if holds_data else None, kind_of, layout, grid, src)
    out: dict[str, DTensor] = {}
    for k in sorted(all_kinds):
        pl = _placements(all_kinds[k])
        if all_kinds[k] in ATOM_KINDS:
            if src is None:
                local = atom_tile(features[k], all_kinds[k], layout, grid.coords[0])  # type: ignore[index]
            else:
                held = features[k] if features is not None and grid.rank == src else None
                local = scatter_atom_tile(held, all_kinds[k], layout, grid, src, meta[k][1], meta[k][0])
        elif src is None:
            local = local_block(full[k], grid, pl)  # type: ignore[index]
        else:
            local = _scatter_tiles(
                full[k] if full is not None else None,
                k,
                layout,
                grid,
                pl,
                src,
                meta[k][1] if k in meta else mdt,
                meta,
            )
        out[k] = _attach(from_local(local, grid, pl), layout, all_kinds[k])
    return ShardedFeatures(out, layout)


def _scatter_tiles(
    full: torch.Tensor | None,
    name: str,
    layout: PairLayout,
    grid: ProcessGrid,
    placements: tuple[Placement, ...],
    src: int,
    dtype: torch.dtype,
    meta: dict[str, tuple[tuple[int, ...], torch.dtype]],
) -> torch.Tensor:
    """Rank ``src`` sends each rank its tile of ``full`` (point to point); returns my tile."""
    wire = torch.uint8 if dtype == torch.bool else dtype  # gloo moves no bools
    if grid.rank == src:
        sends = []
        mine = None
        for r in range(grid.size):
            idx = tile_slices(full.shape, grid, placements, grid.coords_of(r))  # type: ignore[union-attr]
            tile = full[idx].detach().to(wire).contiguous()  # type: ignore[index]
            if r == src:
                mine = tile
            else:
                sends.append((r, tile))
        P.exchange(sends, [], dtype=wire, op="features.distribute")
        return mine.to(dtype)  # type: ignore[union-attr]
    shape = _padded_shape(name, layout, meta)
    got = P.exchange([], [(src, _local_shape(shape, grid, placements))], dtype=wire, op="features.distribute")
    return got[0].to(dtype)  # type: ignore[index]


def _padded_shape(
    name: str, layout: PairLayout, meta: dict[str, tuple[tuple[int, ...], torch.dtype]]
) -> tuple[int, ...]:
    """Global padded shape of a distributed key (an input feature or an added mask)."""
    kind = layout.kinds[name]
    if name in meta:
        shape = list(meta[name][0])
    else:  # an added mask: [B, N], [B, N, N] or [B, S, N]
        b = next(iter(meta.values()))[0][0]
        shape = [b] + [0] * (len(_TOKEN_DIMS[kind]) + (1 if kind in _SEQ_DIM else 0))
    for d, axis in _TOKEN_DIMS[kind].items():
        shape[d] = layout.padded[axis]
    if kind in _SEQ_DIM:
        shape[_SEQ_DIM[kind]] = layout.s_padded  # type: ignore[assignment]
    return tuple(shape)


def shard_tensor(x: torch.Tensor, kind: str, grid: ProcessGrid, layout: PairLayout) -> DTensor:
    """One full tensor (held by every rank) -> its padded DTensor of ``kind`` (no communication).

    Differentiable: the gradient reaching ``x`` on a rank covers only that rank's tile (sum
    them with :func:`collect_grad`). The result carries ``layout`` (see :func:`layout_of`).
    """
    pl = _placements(kind)
    return _attach(from_local(local_block(layout.pad(x, kind), grid, pl), grid, pl), layout, kind)


@autocast_rule()
class _GatherTiles(torch.autograd.Function):
    """All-gather of tiles into the full (padded) tensor; backward keeps my tile of the gradient.

    Every rank computes the same thing from the gathered value, so its gradient is
    replicated, not partial: the adjoint slices, it does not sum (DESIGN rule 7).

    Dtype path: tiles travel in the local tile's dtype; backward slices (no cast).
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, groups: list, dims: list[int]) -> torch.Tensor:
        ctx.groups, ctx.dims = groups, dims
        ctx.blocks = []
        out = local
        for g, d in zip(groups, dims):
            ctx.blocks.append((P.group_rank(g), out.shape[d]))
            out = P.all_gather(out, d, g, op="features.collect")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        for d, (i, b) in zip(reversed(ctx.dims), reversed(ctx.blocks)):
            grad = grad.narrow(d, i * b, b)
        return grad.contiguous(), None, None


def collect_tensor(
    x: DTensor, layout: PairLayout | None = None, kind: str | None = None, what: str = "tensor"
) -> torch.Tensor:
    """Gather a DTensor of ``kind`` to the full tensor on every rank, padding removed.

    Layout and kind default to those ``x`` carries. Differentiable with a replicated-gradient
    adjoint (each rank keeps its tile of the gradient). A gathering boundary function: tests
    and outputs only.
    """
    layout = layout or layout_of(x)
    kind = kind or layout_kind(x)
    if layout is None or kind is None:
        raise ValueError(f"collect_tensor({what}): no PairLayout attached to it; pass layout= and kind=")
    pl = _placements(kind)
    check_placements(x, pl, what)
    mesh = x.device_mesh
    groups, dims = [], []
    for a in reversed(range(mesh.ndim)):  # cols first: contiguous rows of tiles, then stack
        p = pl[a]
        if hasattr(p, "dim"):
            groups.append(mesh.get_group(a))
            dims.append(p.dim % x.ndim)
    full = _GatherTiles.apply(x.to_local(), groups, dims)
    if kind in ATOM_KINDS:
        return unblock_atoms(full, layout, kind)
    return layout.unpad(full, kind)


def collect(
    features: Mapping[str, DTensor],
    layout: PairLayout | None = None,
    kinds: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """DTensors -> full tensors at the caller's sizes, on every rank (the masks
    ``distribute`` added are dropped). Keys are gathered in sorted order, so every
    rank issues the same collectives. ``layout`` defaults to ``features.layout``.
    """
    if layout is None:
        layout = getattr(features, "layout", None)
        if layout is None:
            raise ValueError("collect needs the PairLayout returned by distribute (.layout)")
    out = {}
    for k in sorted(features):
        if k in layout.added:
            continue
        kind = (kinds or {}).get(k) or layout.kinds.get(k) or _kind_of(k, None)
        out[k] = collect_tensor(features[k], layout, kind, what=k)
    return out
