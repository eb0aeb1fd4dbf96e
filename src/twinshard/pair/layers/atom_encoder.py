"""CP twins of the atom encoder and the atom attention encoder (the serial modules in
:mod:`twinshard.pair.reference.atom_encoder`; the window halo in
:mod:`twinshard.pair.layers.atom_transformer`).

Placements. In: the ``ShardedFeatures`` of ``twinshard.pair.features.distribute`` (atom features
of kind ``atom`` ``[B, A_blk, ...]`` per rank, ``atom_to_token`` of kind ``atom_token``
``[B, A_blk, Nr/R]``, token features of kind ``single`` ``[B, Nr/R, ...]``: grid row r's atoms and
tokens, replicated along the row). ``CPAtomEncoder(feats) -> (q, c, p, to_keys)``: ``q``, ``c``
atom-kind DTensors ``[B, R A_blk, atom_s]`` (carrying the layout), ``p`` this rank's windows
``[B, nW, W, H, atom_z]`` (a plain tensor: its windows are the rank's own, see
:class:`~twinshard.pair.layers.atom_transformer.WindowPlan`), ``to_keys`` the
:class:`~twinshard.pair.layers.atom_transformer.HaloKeys` of those windows.
``CPAtomAttentionEncoder(feats, q, c, atom_enc_bias, to_keys) -> (a, q, c, to_keys)``: ``a`` a
single DTensor ``[B, Nr, token_s]`` (padded tokens zero), ``q`` atom kind; ``atom_enc_bias`` is
``p``'s projection (token-local, any module).

Computation on rank (r, c): the per-atom embedding ``c`` of my atoms (the residue features from
my ``atom_to_token`` tile and my token rows); one halo exchange of the static key features
(``ref_pos``, ``atom_pad_mask``, ``ref_space_uid``, ``c``: ``5 + atom_s`` channels) builds my
windows' key frame, from which ``p`` and the key mask follow as in serial; the atom transformer
exchanges the halo of its keys' input once per layer; the mean over each token's atoms reads only
my ``atom_token`` tile (every atom of my tokens is mine).

Collectives. Forward: ``1 + depth`` halo exchanges along the grid column (``embed:halo``: halo
atoms x channels per rank, nothing else). Backward: their reverses (``embed:halo:backward``) and
one all-reduce of the flat parameter gradient over the grid column (every rank of a grid row
computed the same values: summed over the column, each row counts once). Input gradients (e.g.
of ``ref_pos``) come back complete on every rank of the row for its tile, as ``collect_grad``
expects. Memory per rank: ``A_blk``-sized tiles and ``nW`` windows (module docstring of
``atom_transformer``); nothing of size A, A x N or N x N.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.func import functional_call

from twinshard.pair.features import with_layout
from twinshard.pair.layers.atom_transformer import CPAtomTransformer, HaloKeys, window_plan
from twinshard.pair.layers.tokenwise import replicated_params
from twinshard.pair.layers.triangle import pair_grid
from twinshard.pair.layout import PairLayout, layout_of
from twinshard.pair.reference.atom_encoder import AtomAttentionEncoder, AtomEncoder
from twinshard.pair.tiling import SINGLE, check_placements, from_local
from twinshard.runtime.grid import ProcessGrid

__all__ = [
    "CPAtomAttentionEncoder",
    "CPAtomEncoder",
    "TileFeatures",
    "atom_dtensor",
    "synced_call",
    "tile_features",
]


class TileFeatures(dict):
    """This rank's local tiles of a ``ShardedFeatures`` (plain tensors), with its layout and grid:
    what the twins pass to each other inside one call."""

    def __init__(self, items: Mapping[str, torch.Tensor], layout: PairLayout, grid: ProcessGrid):
        super().__init__(items)
        self.layout, self.grid = layout, grid


ATOM_INPUTS = {
    "ref_pos": "atom",
    "atom_pad_mask": "atom",
    "ref_space_uid": "atom",
    "atom_to_token": "atom_token",
}


def tile_features(feats: Mapping[str, Any], what: str, need: Mapping[str, str] = ATOM_INPUTS) -> TileFeatures:
    """The local tiles of distributed features; raises (alike on every rank: metadata only) when a
    needed feature is missing, not a DTensor, or of another kind than ``need`` says."""
    layout = getattr(feats, "layout", None)
    for name in sorted(need):
        x = feats.get(name)
        if x is None:
            raise ValueError(f"{what}: feature {name!r} is missing (kind {need[name]})")
        check_placements(x, SINGLE, f"{what} feature {name!r}")
        layout = layout or layout_of(x)
        if layout is not None and layout.kinds.get(name, need[name]) != need[name]:
            raise ValueError(
                f"{what}: feature {name!r} is of kind {layout.kinds[name]}, expected {need[name]}"
            )
    if layout is None or layout.n_atoms is None:
        raise ValueError(
            f"{what} takes the ShardedFeatures of twinshard.pair.features.distribute with atom features "
            "(their PairLayout places the atoms)"
        )
    grid = pair_grid(feats["ref_pos"])
    return TileFeatures({k: v.to_local() for k, v in feats.items() if isinstance(v, DTensor)}, layout, grid)


def synced_call(module: torch.nn.Module, like: DTensor, args: Iterable[Any]) -> Any:
    """``module(*args)`` with its parameters' gradients summed over the grid column (like's
    sharded axis of the single placement)."""
    named = list(module.named_parameters())
    synced = replicated_params([p for _, p in named], like)
    # Boltz's output_projection_linear is also output_projection.0 (one module under two names):
    # with tie_weights=True, torch 2.13's functional_call leaves the swapped-in tensors in such a
    # module after the call; one name per parameter and no tying swaps the shared module once
    return functional_call(module, {n: s for (n, _), s in zip(named, synced)}, tuple(args), tie_weights=False)


def atom_dtensor(x: torch.Tensor, tile: TileFeatures) -> DTensor:
    return with_layout(from_local(x, tile.grid.mesh, SINGLE), tile.layout, "atom")


class CPAtomEncoder(AtomEncoder):
    """Context-parallel atom encoder (module docstring); ``forward(feats)``, and with
    ``structure_prediction`` ``forward(feats, s_trunk, z)`` (``s_trunk`` single, ``z`` the
    conditioned pair, DTensors): the trunk conditioning of
    :mod:`twinshard.pair.layers.diffusion` (``z_to_p`` from the band of ``z``'s columns)."""

    def forward(self, feats: Mapping[str, Any], s_trunk=None, z=None) -> tuple:
        self._check_trunk(s_trunk, z)
        if isinstance(feats, TileFeatures):
            return self._tile_forward(feats, s_trunk, z)
        tile = tile_features(feats, type(self).__name__)
        if self.structure_prediction:
            from twinshard.pair.layers.diffusion import trunk_conditioned_encoder

            return trunk_conditioned_encoder(self, feats, tile, s_trunk, z)
        q, c, p, to_keys = synced_call(self, feats["ref_pos"], (tile,))
        return atom_dtensor(q, tile), atom_dtensor(c, tile), p, to_keys

    def _tile_forward(self, feats: TileFeatures, s_trunk=None, zp=None) -> tuple:
        if self.structure_prediction:
            from twinshard.pair.layers.diffusion import conditioned_tile_forward

            return conditioned_tile_forward(self, feats, s_trunk, zp)
        w, h = self.atoms_per_window_queries, self.atoms_per_window_keys
        if feats.layout.n_atoms % w:  # type: ignore[operator]
            raise ValueError(
                f"{feats.layout.n_atoms} atoms are not a whole number of windows of {w}: pad A (Boltz pads it)"
            )
        plan = window_plan(feats.layout, feats.grid, w, h)
        c = self.embed_atom_features(self.atom_features(feats))
        dt = c.dtype
        halo = HaloKeys(plan, c.device)
        static = torch.cat(
            [
                feats["ref_pos"].to(dt),
                feats["atom_pad_mask"].to(dt).unsqueeze(-1),
                feats["ref_space_uid"].to(dt).unsqueeze(-1),
                c,
            ],
            dim=-1,
        )
        keys = halo.keys(static)  # [B, nW, H, 5 + atom_s]: the one static halo exchange
        qs = halo.to_frame(static).unflatten(1, (plan.windows, w))
        valid = self.valid_pairs(qs[..., 3], keys[..., 3], qs[..., 4], keys[..., 4])
        p = self.pair_features(qs[..., :3], keys[..., :3], valid, qs[..., 5:], keys[..., 5:])
        halo.key_mask = keys[..., 3]
        return c, c, p, halo


class CPAtomAttentionEncoder(AtomAttentionEncoder):
    """Context-parallel atom attention encoder (module docstring);
    ``forward(feats, q, c, atom_enc_bias, to_keys)``."""

    _transformer_cls = CPAtomTransformer

    def forward(self, feats, q, c, atom_enc_bias, to_keys, r=None, multiplicity: int = 1) -> tuple:
        if isinstance(feats, TileFeatures):
            return AtomAttentionEncoder.forward(self, feats, q, c, atom_enc_bias, to_keys, r, multiplicity)
        what = type(self).__name__
        tile = tile_features(feats, what)
        for name, x in (("q", q), ("c", c)):
            check_placements(x, SINGLE, f"{what} input {name}")
        a, q, c, to_keys = synced_call(
            self,
            feats["ref_pos"],
            (tile, q.to_local(), c.to_local(), atom_enc_bias, to_keys, r, multiplicity),
        )
        a = with_layout(from_local(a, tile.grid.mesh, SINGLE), tile.layout, "single")
        return a, atom_dtensor(q, tile), atom_dtensor(c, tile), to_keys
