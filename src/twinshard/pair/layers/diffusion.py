"""CP twins of the diffusion conditioning and the score model (the serial modules in
:mod:`twinshard.pair.reference.diffusion`; the atom windows and their halo in
:mod:`twinshard.pair.layers.atom_transformer`).

Placements. In: the ``ShardedFeatures`` of ``distribute`` (atoms of token row block r on grid row
r, replicated along it; ``atom_to_token`` tiles), ``s_trunk``/``s_inputs`` single
``[B, Nr, ts]`` at ``(Shard(1), Replicate())``, ``z_trunk``/relative positions pair ``[B, Nr, Nc,
tz]`` at ``(Shard(1), Shard(2))``, noisy coordinates ``r[B m, R A_blk, 3]`` of kind ``atom`` on
:func:`sample_layout` (the features' layout with every element's atom placement repeated m times:
sample ``b m + j`` is element b's j-th), ``times[B m]`` a plain tensor, the same on every rank.

:class:`CPDiffusionConditioning` returns ``(q, c, to_keys, atom_enc_bias, atom_dec_bias,
token_trans_bias)``: ``q``, ``c`` atom DTensors, ``to_keys`` the
:class:`~twinshard.pair.layers.atom_transformer.HaloKeys` of the rank's windows, the atom biases
``[B, nW, W, H, depth x heads]`` plain tensors of the rank's ``nW`` windows (query slots of atoms
that are not the rank's hold values nobody reads), ``token_trans_bias`` a pair DTensor ``[B, Nr,
Nc, depth x heads]``. :class:`CPDiffusionModule` returns ``r_update[B m, R A_blk, 3]`` of kind
``atom`` on :func:`sample_layout`. Padded entries of every DTensor are exactly zero.

The z band (``z_to_p``). Serial: ``p[b, k, w, h] += Z[b, token(query), token(key)]`` with
``Z = z_to_p_trans(z)`` (LayerNorm + linear to ``atom_z``, token-local: computed on each pair tile
by its owner). A rank's query atoms are its row block's (their tokens are the rows ``I_r`` of its
tile); its key atoms (its atoms and the window halo) have tokens in a narrow contiguous band
``[t_lo_b, t_hi_b)`` around ``I_r`` (atoms are in token order; a window spans ``H`` atoms). Every
rank of grid row r holds the same atoms, hence derives the same band from its key frame (one
extra static halo channel carries each key atom's token). ``_ZBand`` assembles ``Z[b, I_r, band]``
on every rank of the row: rank (r, c') sends the columns ``band ∩ J_c'`` of its tile to the other
ranks of grid row r (point to point, one message per peer, ``diffcond:z_band``); nothing from
other grid rows and never a full row of ``z``. Bytes received per rank and structure: ``sum_b
Nr/R x (|band_b| - |band_b ∩ J_c|) x atom_z x itemsize``; ``|band_b| <= Nr/R + 2 x`` (the tokens
of ``(H - W) / 2 + W`` atoms). Backward: the band is replicated along the row and so is its
gradient (everything downstream on the atom track is computed identically along the row): the
adjoint slices, each owner keeps the gradient of its own columns (no message; summing the row's
copies would count it C times). Then ``z_to_p_trans``'s parameter gradient is summed over the
whole grid (each tile's columns counted once), the others over the grid column.

Collectives. Conditioning: the pairwise conditioner and the token biases are tile-local (backward:
one all-reduce of their parameter gradients over the grid); the atom encoder issues the static
halo exchange (``embed:halo``, ``6 + atom_s`` channels), the z band, and in backward the halo's
reverse and the parameter all-reduces (over the grid column; over the grid for ``z_to_p_trans``).
Score model: single conditioning, ``s_to_a_linear``, ``a_norm`` and the atom-to-token mean are
tile-local; the atom encoder and decoder issue one halo exchange per layer (and its reverse); the
token transformer per layer: the attention with pair bias of
:class:`~twinshard.pair.layers.attention.CPAttentionPairBias` (key move, row max and log-sum-exp
merge along the grid row) with the layer's precomputed bias (:class:`CPBiasAttention`); parameter
gradients summed over the grid column (token-local) and over the grid (attention).

Memory per rank: the serial activations of the rank's atoms (``A / R`` per sample and
multiplicity plus two partial windows; the band ``[B, Nr/R, |band|, atom_z]``), of its token rows
(``N / R``), and of its pair tile (the token transformer's logits ``[B m, H, Nr/R, Nc/C]`` per
layer, the bias tile repeated m times per layer, transient): nothing of size A, A x N or N x N.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.func import functional_call

from twinshard.comm.amp import autocast_rule
from twinshard.pair.features import with_layout
from twinshard.pair.layers.atom_encoder import (
    CPAtomAttentionEncoder,
    CPAtomEncoder,
    TileFeatures,
    atom_dtensor,
    tile_features,
)
from twinshard.pair.layers.atom_transformer import CPAtomTransformer, HaloKeys, window_plan
from twinshard.pair.layers.attention import CPAttentionPairBias
from twinshard.pair.layers.tokenwise import replicated_params
from twinshard.pair.layers.triangle_attention import Packed
from twinshard.pair.layout import PairLayout, layout_of
from twinshard.pair.reference.atom_encoder import atom_tokens, token_pair_gather
from twinshard.pair.reference.atom_transformer import DiffusionTransformer
from twinshard.pair.reference.attention import AttentionPairBias
from twinshard.pair.reference.diffusion import (
    AtomAttentionDecoder,
    DiffusionConditioning,
    DiffusionModule,
    PairwiseConditioning,
)
from twinshard.pair.tiling import PAIR, SINGLE, check_placements, from_local
from twinshard.runtime.grid import ProcessGrid

__all__ = [
    "CPAtomAttentionDecoder",
    "CPBiasAttention",
    "CPDiffusionConditioning",
    "CPDiffusionModule",
    "CPPairwiseConditioning",
    "CPTokenTransformer",
    "sample_layout",
    "sample_keys",
]


def sample_layout(layout: PairLayout, multiplicity: int) -> PairLayout:
    """The layout of ``[B m, ...]`` atom tensors: element b's atom placement for its m samples."""
    m = int(multiplicity)
    if layout.atom_starts is None or layout.atom_counts is None:
        raise ValueError("sample_layout needs a layout with atoms (distribute the atom features)")
    return dataclasses.replace(
        layout,
        atom_starts=tuple(s for s in layout.atom_starts for _ in range(m)),
        atom_counts=tuple(c for c in layout.atom_counts for _ in range(m)),
    )


def sample_keys(halo: HaloKeys, layout: PairLayout, grid: ProcessGrid, multiplicity: int, device) -> HaloKeys:
    """The :class:`HaloKeys` of ``B m`` samples (each element's windows repeated m times)."""
    if multiplicity == 1:
        return halo
    plan = halo.plan
    out = HaloKeys(window_plan(sample_layout(layout, multiplicity), grid, plan.w, plan.h), device)
    if halo.key_mask is not None:
        out.key_mask = halo.key_mask.repeat_interleave(multiplicity, 0)
    return out


def tile_call(module: nn.Module, like: DTensor, args: Sequence[Any], exclude: tuple[str, ...] = ()) -> Any:
    """``module(*args)`` on local tiles, its trainable parameters (but those under ``exclude``)
    with gradients summed over the mesh axes where ``like`` is sharded."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and not n.startswith(exclude)]
    synced = replicated_params([p for _, p in named], like)
    module._on_tile = True  # type: ignore[assignment]
    try:
        return functional_call(
            module, {n: s for (n, _), s in zip(named, synced)}, tuple(args), tie_weights=False
        )
    finally:
        module._on_tile = False  # type: ignore[assignment]


# -- the z band --------------------------------------------------------------------------------


def _segments(band: tuple[int, int], cols: int, n_j: int) -> list[tuple[int, int, int]]:
    """``(column block c', lo, hi)``: the global token columns of ``band`` that block c' holds."""
    out = []
    for c in range(cols):
        lo, hi = max(band[0], c * n_j), min(band[1], (c + 1) * n_j)
        if lo < hi:
            out.append((c, lo, hi))
    return out


@autocast_rule()
class _ZBand(torch.autograd.Function):
    """My pair tile ``Z[B, Nr/R, Nc/C, d]`` -> ``Z[B, Nr/R, band_b, d]`` (``[B, Nr/R, L, d]``, L the
    widest band, zero beyond each band): the band's columns from the ranks of my grid row that own
    them. Backward: my own columns' gradient (the band is replicated along the row: slice).

    Dtype path: band pieces travel in the tile's dtype; backward slices the gradient (no cast,
    no communication).
    """

    @staticmethod
    def forward(ctx: Any, zt: torch.Tensor, bands: tuple, grid: ProcessGrid, op: str) -> torch.Tensor:
        r, me = grid.coords
        n_j = zt.shape[2]
        ctx.bands, ctx.me, ctx.n_j, ctx.shape = bands, me, n_j, tuple(zt.shape)
        width = max(1, max(hi - lo for lo, hi in bands))
        b_, n_i, _, d = zt.shape
        out = zt.new_zeros((b_, n_i, width, d))
        sends, recvs, places = [], [], []
        for b, band in enumerate(bands):
            for c, lo, hi in _segments(band, grid.cols, n_j):
                if c == me:
                    out[b, :, lo - band[0] : hi - band[0]] = zt[b, :, lo - me * n_j : hi - me * n_j]
                    piece = zt[b, :, lo - me * n_j : hi - me * n_j]
                    sends += [(grid.rank_of((r, o)), piece) for o in range(grid.cols) if o != me]
                else:
                    recvs.append((grid.rank_of((r, c)), (n_i, hi - lo, d)))
                    places.append((b, lo - band[0], hi - band[0]))
        got = Packed(sends, recvs, zt.dtype, op).wait() if (sends or recvs) else []
        for (b, lo, hi), piece in zip(places, got):
            out[b, :, lo:hi] = piece
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        gz = g.new_zeros(ctx.shape)
        me, n_j = ctx.me, ctx.n_j
        for b, band in enumerate(ctx.bands):
            lo, hi = max(band[0], me * n_j), min(band[1], (me + 1) * n_j)
            if lo < hi:
                gz[b, :, lo - me * n_j : hi - me * n_j] = g[b, :, lo - band[0] : hi - band[0]]
        return gz, None, None, None


def z_band(
    zt: torch.Tensor, key_tokens: torch.Tensor, grid: ProcessGrid
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Z[b, I_r, band_b], band starts [B])`` for the key atoms' global tokens ``key_tokens[B,
    ...]`` (-1: no token): the band is ``[min, max]`` of each element's tokens."""
    b = key_tokens.shape[0]
    flat = key_tokens.reshape(b, -1)
    real = flat >= 0
    big = torch.iinfo(flat.dtype).max
    lo = torch.where(real, flat, torch.full_like(flat, big)).amin(1)
    hi = torch.where(real, flat, torch.full_like(flat, -1)).amax(1) + 1
    bands = tuple((int(a), int(z)) if int(z) > 0 else (0, 0) for a, z in zip(lo.tolist(), hi.tolist()))
    starts = torch.tensor([a for a, _ in bands], device=zt.device)
    return _ZBand.apply(zt.contiguous(), bands, grid, "diffcond:z_band"), starts


def trunk_conditioned_encoder(
    enc: CPAtomEncoder, feats: Mapping[str, Any], tile: TileFeatures, s_trunk, z
) -> tuple:
    """``CPAtomEncoder(structure_prediction=True).forward`` on DTensors (module docstring)."""
    what = type(enc).__name__
    check_placements(s_trunk, SINGLE, f"{what} input s_trunk", ndim=3)
    check_placements(z, PAIR, f"{what} input z", ndim=4)
    zp = tile_call(enc.z_to_p_trans, z, (z.to_local(),))  # tile-local; gradients summed over the grid
    q, c, p, to_keys = tile_call(
        enc, feats["ref_pos"], (tile, s_trunk.to_local(), zp), exclude=("z_to_p_trans.",)
    )
    return atom_dtensor(q, tile), atom_dtensor(c, tile), p, to_keys


def conditioned_tile_forward(
    enc: CPAtomEncoder, feats: TileFeatures, s_tile: torch.Tensor, zp: torch.Tensor
) -> tuple:
    """The tile computation of the trunk-conditioned atom encoder (``zp`` the projected pair tile)."""
    w, h = enc.atoms_per_window_queries, enc.atoms_per_window_keys
    layout, grid = feats.layout, feats.grid
    if layout.n_atoms % w:  # type: ignore[operator]
        raise ValueError(
            f"{layout.n_atoms} atoms are not a whole number of windows of {w}: pad A (Boltz pads it)"
        )
    plan = window_plan(layout, grid, w, h)
    q = enc.embed_atom_features(enc.atom_features(feats))
    a2t = feats["atom_to_token"]
    c = enc.condition_on_trunk(q, a2t, s_tile)
    dt = c.dtype
    n_i = a2t.shape[2]
    tok = atom_tokens(a2t)
    tok = torch.where(tok >= 0, tok + grid.coords[0] * n_i, tok)  # global token, -1: none
    halo = HaloKeys(plan, c.device)
    static = torch.cat(
        [
            feats["ref_pos"].to(dt),
            feats["atom_pad_mask"].to(dt).unsqueeze(-1),
            feats["ref_space_uid"].to(dt).unsqueeze(-1),
            (tok + 1).to(dt).unsqueeze(-1),
            c,
        ],
        dim=-1,
    )
    keys = halo.keys(static)  # [B, nW, H, 6 + atom_s]
    qs = halo.to_frame(static).unflatten(1, (plan.windows, w))
    valid = enc.valid_pairs(qs[..., 3], keys[..., 3], qs[..., 4], keys[..., 4])
    ik = keys[..., 5].detach().round().long() - 1
    iq = qs[..., 5].detach().round().long() - 1
    band, lo = z_band(zp, ik, grid)
    iq = torch.where(iq >= 0, iq - grid.coords[0] * n_i, iq)
    ik = torch.where(ik >= 0, ik - lo.view(-1, 1, 1), ik)
    z_to_p = token_pair_gather(band, iq, ik)
    p = enc.pair_features(qs[..., :3], keys[..., :3], valid, qs[..., 6:], keys[..., 6:], z_to_p)
    halo.key_mask = keys[..., 3]
    return q, c, p, halo


# -- the conditioning --------------------------------------------------------------------------


class CPPairwiseConditioning(PairwiseConditioning):
    """Tile-local pairwise conditioning: ``forward(z_trunk, relpos)`` pair DTensors -> pair DTensor."""

    _on_tile: bool = False

    def forward(self, z_trunk: Any, token_rel_pos_feats: Any) -> Any:  # type: ignore[override]
        if self._on_tile:
            return PairwiseConditioning.forward(self, z_trunk, token_rel_pos_feats)
        what = type(self).__name__
        check_placements(z_trunk, PAIR, f"{what} input z_trunk", ndim=4)
        check_placements(token_rel_pos_feats, PAIR, f"{what} input relative_position_encoding", ndim=4)
        out = tile_call(self, z_trunk, (z_trunk.to_local(), token_rel_pos_feats.to_local()))
        out = from_local(out, z_trunk.device_mesh, PAIR)
        layout = layout_of(z_trunk) or layout_of(token_rel_pos_feats)
        return out if layout is None else with_layout(out, layout, "pair")


def _project_tiles(layers: nn.ModuleList, like: DTensor, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([tile_call(layer, like, (x,)) for layer in layers], dim=-1)


class CPDiffusionConditioning(DiffusionConditioning):
    """Context-parallel ``DiffusionConditioning`` (module docstring):
    ``forward(s_trunk, z_trunk, relative_position_encoding, feats)``."""

    _encoder_cls = CPAtomEncoder
    _pairwise_cls = CPPairwiseConditioning

    def forward(self, s_trunk, z_trunk, relative_position_encoding, feats) -> tuple:
        z = self.pairwise_conditioner(z_trunk, relative_position_encoding)
        q, c, p, to_keys = self.atom_encoder(feats, s_trunk, z)
        like = feats["ref_pos"]
        atom_enc_bias = _project_tiles(self.atom_enc_proj_z, like, p)
        atom_dec_bias = _project_tiles(self.atom_dec_proj_z, like, p)
        tb = from_local(_project_tiles(self.token_trans_proj_z, z, z.to_local()), z.device_mesh, PAIR)
        return q, c, to_keys, atom_enc_bias, atom_dec_bias, with_layout(tb, z, "pair")


# -- the score model ---------------------------------------------------------------------------


class CPBiasAttention(CPAttentionPairBias):
    """:class:`CPAttentionPairBias` with a precomputed bias (Boltz-2's
    ``AttentionPairBias(compute_pair_bias=False)``, the serial ``WindowAttention`` on whole token
    rows): ``forward(s, bias, mask)`` with ``bias`` a pair DTensor ``[B, Nr, Nc, heads]``; no
    ``proj_z``. Parameters ``proj_q, proj_k, proj_v, proj_g, proj_o`` (the serial order)."""

    def __init__(self, c_s: int, num_heads: int, inf: float = 1e6):
        AttentionPairBias.__init__(self, c_s, num_heads, num_heads, inf)
        del self.proj_z

    def project(self, s: torch.Tensor, z: torch.Tensor, k_in: torch.Tensor | None = None) -> tuple:  # type: ignore[override]
        k_in = s if k_in is None else k_in
        heads = (self.num_heads, self.head_dim)
        q = self.proj_q(s).unflatten(-1, heads) / math.sqrt(self.head_dim)
        k = self.proj_k(k_in).unflatten(-1, heads)
        v = self.proj_v(k_in).unflatten(-1, heads)
        return q, k, v, z.permute(0, 3, 1, 2), torch.sigmoid(self.proj_g(s))


class CPTokenTransformer(DiffusionTransformer):
    """The token-level ``DiffusionTransformer`` on the single placement: ``forward(a, s, bias,
    mask, multiplicity)`` with ``a, s[B m, Nr, d]`` and ``mask[B m, Nr]`` single DTensors and
    ``bias[B, Nr, Nc, depth x heads]`` a pair DTensor shared by each element's m samples."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        for layer in self.layers:
            att = layer.pair_bias_attn
            layer.pair_bias_attn = CPBiasAttention(att.c_s, att.num_heads, att.inf)

    def forward(self, a: Any, s: Any, bias: Any, mask: Any, multiplicity: int = 1) -> Any:  # type: ignore[override]
        mesh, layout = a.device_mesh, layout_of(a)
        depth = len(self.layers)
        heads = bias.shape[-1] // depth
        a_t, s_t, b_t = a.to_local(), s.to_local(), bias.to_local()

        def single(x):
            x = from_local(x, mesh, SINGLE)
            return x if layout is None else with_layout(x, layout, "single")

        for i, layer in enumerate(self.layers):
            b = tile_call(layer.adaln, a, (a_t, s_t))
            bias_l = from_local(
                b_t[..., i * heads : (i + 1) * heads].repeat_interleave(multiplicity, 0), mesh, PAIR
            )
            bias_l = with_layout(bias_l, bias, "pair") if layout_of(bias) is not None else bias_l
            b = layer.pair_bias_attn(single(b), bias_l, mask).to_local()
            gate = torch.sigmoid(tile_call(layer.output_projection_linear, a, (s_t,)))
            a_t = a_t + gate * b
            a_t = a_t + tile_call(layer.transition, a, (a_t, s_t))
            if isinstance(layer.post_lnorm, nn.LayerNorm):
                a_t = tile_call(layer.post_lnorm, a, (a_t,))
        return single(a_t)


class CPAtomAttentionDecoder(AtomAttentionDecoder):
    """The atom attention decoder on tiles (called by :class:`CPDiffusionModule` only)."""

    _transformer_cls = CPAtomTransformer


class CPDiffusionModule(DiffusionModule):
    """Context-parallel score model (module docstring): ``forward(s_inputs, s_trunk, r_noisy, times,
    feats, diffusion_conditioning, multiplicity=1) -> r_update`` (atom DTensor, :func:`sample_layout`)."""

    _encoder_cls = CPAtomAttentionEncoder
    _decoder_cls = CPAtomAttentionDecoder

    def _token_transformer(self, **kwargs: Any) -> nn.Module:
        return CPTokenTransformer(**kwargs)

    def forward(  # type: ignore[override]
        self,
        s_inputs: Any,
        s_trunk: Any,
        r_noisy: Any,
        times: Any,
        feats: Any,
        diffusion_conditioning: Any,
        multiplicity: int = 1,
    ) -> Any:
        m = int(multiplicity)
        what = type(self).__name__
        dc = diffusion_conditioning
        for name, x in (("s_inputs", s_inputs), ("s_trunk", s_trunk), ("r_noisy", r_noisy)):
            check_placements(x, SINGLE, f"{what} input {name}", ndim=3)
        tile = tile_features(feats, what)
        layout, grid = tile.layout, tile.grid
        lay_m = sample_layout(layout, m)
        if r_noisy.to_local().shape[0] != s_trunk.to_local().shape[0] * m:
            raise ValueError(
                f"{what}: r_noisy holds {r_noisy.shape[0]} samples, expected B x multiplicity = "
                f"{s_trunk.shape[0]} x {m}"
            )
        mesh = s_trunk.device_mesh
        tl = layout_of(s_trunk) or layout

        def single(x):
            return with_layout(from_local(x, mesh, SINGLE), tl, "single")

        st, si = s_trunk.to_local(), s_inputs.to_local()
        s, _ = tile_call(
            self.single_conditioner, s_trunk, (times, st.repeat_interleave(m, 0), si.repeat_interleave(m, 0))
        )
        s = single(s)
        halo = sample_keys(dc["to_keys"], layout, grid, m, st.device)
        like = feats["ref_pos"]
        a, q_skip, c_skip, _ = tile_call(
            self.atom_attention_encoder,
            like,
            (tile, dc["q"].to_local(), dc["c"].to_local(), dc["atom_enc_bias"], halo, r_noisy.to_local(), m),
        )
        a = a + tile_call(self.s_to_a_linear, s, (s.to_local(),))
        a = single(a)
        mask = single(feats["token_pad_mask"].to_local().to(a.dtype).repeat_interleave(m, 0))
        a = self.token_transformer(a, s, dc["token_trans_bias"], mask, m)
        a = tile_call(self.a_norm, a, (a.to_local(),))
        tile_m = TileFeatures(tile, lay_m, grid)
        r_update = tile_call(
            self.atom_attention_decoder, like, (a, q_skip, c_skip, dc["atom_dec_bias"], tile, halo, m)
        )
        return with_layout(from_local(r_update, mesh, SINGLE), tile_m.layout, "atom")
